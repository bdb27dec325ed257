"""What both clients share: one gRPC channel, closed by close() or by leaving a with-block.

TCP targets speak TLS when a CA (or a client certificate) is given, by argument or by the same
environment variables as verifyctl's options; Unix sockets stay plaintext, guarded by their file
mode, whatever is given.
"""

import os

import grpc

# verifyd's and verifyctl's defaults: the systemd unit's sockets.
DEFAULT_DATA_TARGET = "unix:/run/verifyd/verifyd.sock"
DEFAULT_ADMIN_TARGET = "unix:/run/verifyd/admin.sock"

# Argument -> the environment variable that gives its default (verifyctl's --tls_* options read
# the same ones).
TLS_ENV = {"tls_ca_file": "VERIFYD_TLS_CA_FILE", "tls_cert_file": "VERIFYD_TLS_CERT_FILE",
           "tls_key_file": "VERIFYD_TLS_KEY_FILE"}


def is_tcp(target):
    return not target.startswith(("unix:", "unix-abstract:"))


def resolve_target(target, env, default):
    """``target``, else $``env``, else ``default``; a bare path is refused with the form to
    write instead."""
    if target is None:
        target = os.environ.get(env) or default
    if target.startswith(("/", "./", "../")):
        raise ValueError(f"target: '{target}' is a path; a Unix socket is written "
                         f"unix:{target} (TCP is HOST:PORT)")
    return target


def _pem(arg, path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{arg}: cannot read {path} ({TLS_ENV[arg]} gives its default): "
                         f"{e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{arg}: {path} holds no PEM block")
    return data


def _tls_files(tls_ca_file, tls_cert_file, tls_key_file):
    """Each argument, else its environment variable; "" turns one off whatever the environment
    says."""
    given = {"tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
             "tls_key_file": tls_key_file}
    files = {arg: (os.environ.get(TLS_ENV[arg]) or "") if v is None else v
             for arg, v in given.items()}
    if bool(files["tls_cert_file"]) != bool(files["tls_key_file"]):
        raise ValueError("tls_cert_file, tls_key_file: give both (a client certificate and its "
                         "key) or neither")
    return files


class ChannelClient:
    def __init__(self, target, timeout, options=None, tls_ca_file=None, tls_cert_file=None,
                 tls_key_file=None):
        self.target = target
        self.timeout = timeout
        files = _tls_files(tls_ca_file, tls_cert_file, tls_key_file)
        # Whether this client speaks TLS: a TCP target and a CA or a client certificate.
        self.tls = is_tcp(target) and bool(files["tls_ca_file"] or files["tls_cert_file"])
        if self.tls:
            pems = {arg: _pem(arg, path) if path else None for arg, path in files.items()}
            creds = grpc.ssl_channel_credentials(root_certificates=pems["tls_ca_file"],
                                                 private_key=pems["tls_key_file"],
                                                 certificate_chain=pems["tls_cert_file"])
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)

    def _hint(self, code, message):
        """What the caller may have got wrong when a call failed with ``code`` and ``message``:
        a plaintext client of a TLS port, or a failed TLS handshake; None when nothing is
        known."""
        if code != grpc.StatusCode.UNAVAILABLE or not is_tcp(self.target):
            return None
        if not self.tls:
            # A TLS server closes a plaintext client's connection without a word.
            if any(s in message for s in ("Socket closed", "Connection reset", "EOF")):
                return (f"is {self.target} serving TLS? pass tls_ca_file "
                        f"(VERIFYD_TLS_CA_FILE) with the CA that signed its certificate")
            return None
        if any(s in message for s in ("andshake", "SSL", "ssl", "certificate", "Socket closed")):
            return (f"TLS with {self.target} failed: does it serve TLS with a certificate that "
                    f"tls_ca_file signed, for this host name? A verifyd with "
                    f"--tls_client_ca_file also needs tls_cert_file and tls_key_file from this "
                    f"client")
        return None

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
