"""The admin client: status, flip, rollback, sampling and capture (what verifyctl does)."""

import getpass
import math
import socket

import grpc

from ._channel import ChannelClient
from ._proto import admin_pb2, admin_pb2_grpc, types_pb2
from .errors import VerifydError
from .regions import region_dict

_MODES = {"reference": types_pb2.MODE_REFERENCE, "shadow": types_pb2.MODE_SHADOW,
          "canary": types_pb2.MODE_CANARY, "custom": types_pb2.MODE_CUSTOM}


def _mode_name(m):
    return types_pb2.Mode.Name(m)[len("MODE_"):].lower()


def _num(v):
    return v if math.isfinite(v) else None


def _runtime(rt):
    """What the daemon runs with (GetStatusResponse.runtime) as a dict."""
    t = rt.tolerances
    return {"inject_custom_fault": rt.inject_custom_fault,
            "tolerances": {"atol": t.atol, "rtol": t.rtol, "max_rel_l2": t.max_rel_l2,
                           "max_abs": t.max_abs, "max_lse_abs": t.max_lse_abs,
                           "max_beyond_tol": t.max_beyond_tol},
            "gate_window": rt.gate_window, "rollback_breaches": rt.rollback_breaches,
            "rollback_window": rt.rollback_window, "oracle_sample_rate": rt.oracle_sample_rate,
            "custom_timeout_ms": rt.custom_timeout_ms, "uptime_seconds": rt.uptime_seconds,
            "started": rt.started, "listen": list(rt.listen),
            "admin_listen": rt.admin_listen, "metrics_address": rt.metrics_address,
            "state_dir": rt.state_dir}


def _who():
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class AdminClient(ChannelClient):
    """verifyd's AdminService.

    admin_target: "unix:PATH" (the default deployment) or "HOST:PORT" with ``token``, the
    bearer token of the daemon's --admin_token_file.
    """

    def __init__(self, admin_target, token=None, timeout=10.0):
        super().__init__(admin_target, timeout)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def _call(self, method, req):
        try:
            return method(req, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise VerifydError.from_rpc_error(e) from None

    def status(self):
        """The daemon's state as a dict (the same fields as `verifyctl status --json`)."""
        s = self._call(self._stub.GetStatus, admin_pb2.GetStatusRequest())
        g, r, c, cap, e = s.gate, s.recent, s.counters, s.capture, s.engine
        return {
            "mode": _mode_name(s.mode),
            "canary_fraction": s.canary_fraction,
            "sample_rate": s.sample_rate,
            "shadow_sample_rate": s.shadow_sample_rate,
            "custom_sample_rate": s.custom_sample_rate,
            "gate": {"ready": g.ready, "clean": g.clean, "needed": g.needed, "reason": g.reason,
                     "last_breach": g.last_breach},
            "recent": {"comparisons": r.comparisons, "breaches": r.breaches,
                       "rel_l2_mean": _num(r.rel_l2_mean), "rel_l2_max": _num(r.rel_l2_max),
                       "max_abs_max": _num(r.max_abs_max), "oracle_samples": r.oracle_samples,
                       "custom_vs_oracle_rel_l2": _num(r.custom_vs_oracle_rel_l2),
                       "reference_vs_oracle_rel_l2": _num(r.reference_vs_oracle_rel_l2)},
            "counters": {"requests": c.requests, "request_errors": c.request_errors,
                         "served_reference": c.served_reference,
                         "served_custom": c.served_custom,
                         "comparisons_match": c.comparisons_match,
                         "comparisons_breach": c.comparisons_breach,
                         "comparisons_error": c.comparisons_error,
                         "comparisons_skipped": c.comparisons_skipped,
                         "rollbacks": c.rollbacks},
            "last_rollback_reason": s.last_rollback_reason,
            "capture": {"dir": cap.dir, "files": cap.files, "bytes": cap.bytes,
                        "pending": cap.pending, "written": cap.written, "dropped": cap.dropped},
            "engine": {"engine": e.engine, "device": e.device, "sm_count": e.sm_count,
                       "compute_capability": e.compute_capability},
            "version": s.version,
            "commit": s.commit,
            "audit": [{"time": a.time, "from": _mode_name(getattr(a, "from")),
                       "to": _mode_name(a.to), "canary_fraction": a.canary_fraction,
                       "reason": a.reason, "forced": a.forced, "who": a.who,
                       "peer": a.peer}
                      for a in s.recent_audit],
            "runtime": _runtime(s.runtime),
            "regions": [region_dict(x) for x in s.regions],
        }

    def flip(self, mode, reason, fraction=None, force=False, who=None):
        """Sets the served mode: "custom", "canary" (with ``fraction`` in (0, 1]), "shadow" or
        "reference". The daemon's flip gate refuses canary/custom (FAILED_PRECONDITION) until
        enough clean comparisons, unless ``force``, which the audit log records.
        """
        if mode not in _MODES:
            raise ValueError(f"mode: '{mode}' is not one of {', '.join(_MODES)}")
        if not reason:
            raise ValueError("reason: say why (it goes to the audit log)")
        if mode == "canary" and not (fraction is not None and 0 < fraction <= 1):
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

    def set_sampling(self, mode, rate, who=None):
        """Fraction of calls in ``mode`` ("shadow" or "custom") that also run the other path."""
        if mode not in ("shadow", "custom"):
            raise ValueError(f"mode: '{mode}' is not shadow or custom")
        r = self._call(self._stub.SetSampling,
                       admin_pb2.SetSamplingRequest(mode=_MODES[mode], rate=rate,
                                                    who=who or _who()))
        return {"shadow_sample_rate": r.shadow_sample_rate,
                "custom_sample_rate": r.custom_sample_rate}

    def capture(self, next_calls):
        """Captures the next ``next_calls`` compared calls (0 cancels)."""
        r = self._call(self._stub.Capture, admin_pb2.CaptureRequest(next=next_calls))
        c = r.capture
        return {"dir": c.dir, "files": c.files, "bytes": c.bytes, "pending": c.pending,
                "written": c.written, "dropped": c.dropped}
