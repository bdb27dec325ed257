"""Exceptions raised by verifyd_client."""

import grpc

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value):
    """A google.rpc.Code number (as the stream's error_code carries it) as a grpc.StatusCode."""
    return _CODES.get(int(value), grpc.StatusCode.UNKNOWN)


class VerifydError(Exception):
    """A call verifyd refused or failed.

    ``code`` is a grpc.StatusCode and ``message`` the server's text, which starts with the field
    at fault ("kv_indices[3]: page 9 is outside the pool's [0, 8)"); ``field`` is that prefix.
    ``hint`` is what the client may have got wrong when the call never reached verifyd (a
    plaintext client of a TLS port: "is HOST:PORT serving TLS? pass tls_ca_file ..."), else
    None; the error's text ends with it in parentheses.
    """

    def __init__(self, code, message, hint=None):
        super().__init__(f"{code.name}: {message}" + (f" ({hint})" if hint else ""))
        self.code = code
        self.message = message
        self.hint = hint
        head = message.split(":", 1)[0] if ":" in message else ""
        self.field = head if head and " " not in head else None

    @classmethod
    def from_rpc_error(cls, e, hint=None):
        """``hint``: a function of (code, message) returning a hint or None."""
        message = e.details() or ""
        return cls(e.code(), message, hint(e.code(), message) if hint else None)


class InvalidBundleError(VerifydError, ValueError):
    """A bundle rejected before it was sent, with the code the server would have answered."""

    def __init__(self, message):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
