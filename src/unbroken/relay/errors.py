"""Transport exceptions to typed failures: the I/O half of the failure tables.

The sans-IO core (`unbroken.core.admission.policy`) names the failure classes and decides
what each one means; this module, which may import aiohttp, asyncio and ssl,
maps the exceptions those libraries raise onto them.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections.abc import Mapping, Sequence

import aiohttp

from unbroken.core.admission.policy import Failure, FailureClass

__all__ = ["ERRNO_CLASSES", "EXCEPTION_CLASSES", "classify_exception"]


# errno -> class.  The Python counterpart of Node's ECONNREFUSED/ECONNRESET/... list.
ERRNO_CLASSES: Mapping[int, FailureClass] = {
    errno.ECONNREFUSED: FailureClass.REFUSED,
    errno.ECONNRESET: FailureClass.RESET,
    errno.ECONNABORTED: FailureClass.ABORTED,
    errno.EPIPE: FailureClass.BROKEN_PIPE,
    errno.EHOSTUNREACH: FailureClass.UNREACHABLE,
    errno.ENETUNREACH: FailureClass.UNREACHABLE,
    errno.ENETDOWN: FailureClass.UNREACHABLE,
    errno.EHOSTDOWN: FailureClass.UNREACHABLE,
    errno.ETIMEDOUT: FailureClass.CONNECT_TIMEOUT,
    errno.EADDRNOTAVAIL: FailureClass.UNREACHABLE,
}

# Exception type -> class, most specific first (checked with isinstance in order).
EXCEPTION_CLASSES: Sequence[tuple[type[BaseException], FailureClass]] = (
    (aiohttp.ClientConnectorDNSError, FailureClass.DNS),
    (aiohttp.ClientConnectorCertificateError, FailureClass.TLS),
    (aiohttp.ClientConnectorSSLError, FailureClass.TLS),
    (aiohttp.ClientSSLError, FailureClass.TLS),
    (ssl.SSLError, FailureClass.TLS),
    (aiohttp.ConnectionTimeoutError, FailureClass.CONNECT_TIMEOUT),
    (aiohttp.SocketTimeoutError, FailureClass.STALL),
    (aiohttp.ServerDisconnectedError, FailureClass.DISCONNECTED),
    (aiohttp.ClientPayloadError, FailureClass.PAYLOAD),
    (aiohttp.ClientConnectionResetError, FailureClass.RESET),
    (ConnectionRefusedError, FailureClass.REFUSED),
    (ConnectionResetError, FailureClass.RESET),
    (ConnectionAbortedError, FailureClass.ABORTED),
    (BrokenPipeError, FailureClass.BROKEN_PIPE),
    (asyncio.IncompleteReadError, FailureClass.DISCONNECTED),
    (TimeoutError, FailureClass.HEADER_TIMEOUT),
)


def _errno_of(exc: BaseException) -> int | None:
    """Find an errno on the exception or anything it wraps."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        code = getattr(cur, "errno", None)
        if isinstance(code, int) and code in ERRNO_CLASSES:
            return code
        os_error = getattr(cur, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(os_error, OSError) and os_error.errno in ERRNO_CLASSES:
            return os_error.errno
        cur = cur.__cause__ or cur.__context__
    return None


def classify_exception(exc: BaseException) -> Failure | None:
    """Map a transport exception to a retryable `Failure`, or None if it is not one.

    A connect-phase aiohttp error with a known errno is classified by errno
    (refused, unreachable, ...); anything else by its type.  Unknown
    ``aiohttp.ClientError`` and ``OSError`` subclasses are still network failures
    (class ``other_network``): a relay that misses a connect failure hangs a
    session, so the net is wide on purpose.
    """
    if isinstance(exc, asyncio.CancelledError):
        return None
    code = _errno_of(exc)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return Failure(FailureClass.DNS, f"dns: {exc}")
    if code is not None and isinstance(exc, (aiohttp.ClientConnectorError, OSError)):
        cls = ERRNO_CLASSES[code]
        return Failure(cls, f"{cls.value} ({errno.errorcode.get(code, code)})")
    if isinstance(exc, aiohttp.ClientPayloadError):
        if code is not None:  # e.g. ECONNRESET underneath: say what it was
            cls = ERRNO_CLASSES[code]
            return Failure(cls, f"{cls.value} ({errno.errorcode.get(code, code)}) mid-body")
        if "not completed" in str(exc):
            # The connection closed before the body's end (no chunked terminator,
            # short Content-Length): the server went away mid-body.
            return Failure(FailureClass.DISCONNECTED, "server_disconnected: body cut short")
    for etype, cls in EXCEPTION_CLASSES:
        if isinstance(exc, etype):
            return Failure(cls, f"{cls.value}: {type(exc).__name__}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        # e.g. "Multiple exceptions": every address failed, with different errnos
        return Failure(FailureClass.CONNECT_FAILED, "connect_failed: no address connected")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return Failure(FailureClass.OTHER, f"network: {type(exc).__name__}")
    return None
