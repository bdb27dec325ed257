"""The admin client: status, flip, rollback, sampling and capture (what verifyctl does)."""

import getpass
import math
import socket

import grpc

from ._channel import DEFAULT_ADMIN_TARGET, ChannelClient, resolve_target
from ._proto import admin_pb2, admin_pb2_grpc, types_pb2
from .errors import VerifydError

_MODES = {"reference": types_pb2.MODE_REFERENCE, "shadow": types_pb2.MODE_SHADOW,
          "canary": types_pb2.MODE_CANARY, "custom": types_pb2.MODE_CUSTOM}


def _mode_name(m):
    return types_pb2.Mode.Name(m)[len("MODE_"):].lower()


def _num(v):
    return v if math.isfinite(v) else None


def _enum_name(field, number):
    """An enum value by name, without the prefix all of its values share: MODE_SHADOW -> shadow."""
    values = field.enum_type.values
    names = [v.name for v in values]
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix[:prefix.rfind("_") + 1]
    return field.enum_type.values_by_number[number].name[len(prefix):].lower()


def _value(field, v):
    if field.type == field.TYPE_MESSAGE:
        return _to_dict(v)
    if field.type == field.TYPE_ENUM:
        return _enum_name(field, v)
    if isinstance(v, float):
        return _num(v)
    return v


def _repeated(value):
    # A repeated field's container, told apart by shape: its descriptor attributes differ across
    # protobuf versions (label, is_repeated).
    return (hasattr(value, "__len__") and not isinstance(value, (str, bytes))
            and not hasattr(value, "DESCRIPTOR"))


def _to_dict(msg):
    """A message as verifyctl's --json prints it (src/cli/proto_json.h): every field, defaults
    too, under its .proto name."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        v = getattr(msg, field.name)
        if _repeated(v):
            out[field.name] = [_value(field, x) for x in v]
        else:
            out[field.name] = _value(field, v)
    return out


def _who():
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class AdminClient(ChannelClient):
    """verifyd's AdminService.

    admin_target: "unix:PATH" (the default deployment) or "HOST:PORT" with ``token``, the
    bearer token of the daemon's --admin_token_file (or ``token_file``, a file holding it, as
    verifyctl's --admin_token_file); None: $VERIFYD_ADMIN, else the systemd unit's
    "unix:/run/verifyd/admin.sock". A TCP admin with a token is served over TLS: tls_ca_file
    (and tls_cert_file, tls_key_file) as for VerifyClient, with the same environment defaults.
    """

    def __init__(self, admin_target=None, token=None, timeout=10.0, token_file=None,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None):
        if token is not None and token_file is not None:
            raise ValueError("token, token_file: give one")
        if token_file is not None:
            try:
                with open(token_file, encoding="ascii") as f:
                    token = f.readline().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"token_file: cannot read {token_file}: {e}") from None
            if not token:
                raise ValueError(f"token_file: {token_file} is empty")
        admin_target = resolve_target(admin_target, "VERIFYD_ADMIN", DEFAULT_ADMIN_TARGET)
        super().__init__(admin_target, timeout, None, tls_ca_file, tls_cert_file, tls_key_file)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def _call(self, method, req, timeout=None):
        try:
            return method(req, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise VerifydError.from_rpc_error(e, self._hint) from None

    def status(self):
        """The daemon's state as a dict, with the same fields and names as `verifyctl status
        --json`: every field of GetStatusResponse, enums by name ("shadow"), NaN as None, the
        audit entries under "audit"."""
        d = _to_dict(self._call(self._stub.GetStatus, admin_pb2.GetStatusRequest()))
        d["audit"] = d.pop("recent_audit")
        return d

    def run_probes(self, timeout=300):
        """Runs the daemon's probe suite now (seconds on the CPU engine); a dict as `verifyctl
        probe --json` prints it ("passed", "results", "seconds", "summary")."""
        return _to_dict(self._call(self._stub.RunProbes, admin_pb2.RunProbesRequest(), timeout))

    def flip(self, mode, reason, fraction=None, force=False, who=None):
        """Sets the served mode: "custom", "canary" (``fraction`` in (0, 1]; without one, the
        persisted fraction, 0.05 until one was set), "shadow" or "reference". The daemon's flip gate refuses canary/custom (FAILED_PRECONDITION) until
        enough clean comparisons, unless ``force``, which the audit log records.
        """
        if mode not in _MODES:
            raise ValueError(f"mode: '{mode}' is not one of {', '.join(_MODES)}")
        if not reason:
            raise ValueError("reason: say why (it goes to the audit log)")
        if mode == "canary" and fraction is not None and not 0 < fraction <= 1:
            raise ValueError("fraction: canary needs a fraction in (0, 1]")
        if mode != "canary" and fraction is not None:
            raise ValueError(f"fraction: only canary takes a fraction, not {mode}")
        req = admin_pb2.SetModeRequest(mode=_MODES[mode], canary_fraction=fraction or 0.0,
                                       reason=reason, force=force, who=who or _who())
        r = self._call(self._stub.SetMode, req)
        return {"mode": _mode_name(r.mode), "canary_fraction": r.canary_fraction,
                "forced": r.forced}

    def rollback(self, reason, who=None):
        """Back to shadow: the reference is served again. ``reason`` goes to the audit log."""
        return self.flip("shadow", reason, who=who)

    def set_sampling(self, mode, rate, reason, who=None, force=False):
        """Fraction of calls in ``mode`` ("shadow" or "custom") that also run the other path.
        ``reason`` goes to the audit log. A custom rate of 0 leaves the served custom path
        unchecked (no rollback can fire) and needs ``force=True``, which is audited."""
        if mode not in ("shadow", "custom"):
            raise ValueError(f"mode: '{mode}' is not shadow or custom")
        if not reason:
            raise ValueError("reason: a reason is required")
        r = self._call(self._stub.SetSampling,
                       admin_pb2.SetSamplingRequest(mode=_MODES[mode], rate=rate,
                                                    who=who or _who(), reason=reason,
                                                    force=force))
        return {"shadow_sample_rate": r.shadow_sample_rate,
                "custom_sample_rate": r.custom_sample_rate}

    def capture(self, next_calls):
        """Captures the next ``next_calls`` compared calls (0 cancels)."""
        r = self._call(self._stub.Capture, admin_pb2.CaptureRequest(next=next_calls))
        c = r.capture
        return {"dir": c.dir, "files": c.files, "bytes": c.bytes, "pending": c.pending,
                "written": c.written, "dropped": c.dropped}
