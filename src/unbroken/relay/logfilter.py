"""Keep request bytes out of the logs that aiohttp writes.

aiohttp logs a malformed request at ERROR with the parser's exception, whose
message quotes the raw header line or body bytes (``Authorization: Bearer
sk-...\\x01``, ``Data after Connection: close: b'{"model": ...'``), plus a
traceback; and a client that went away mid-response shows up as an "Error
handling request" traceback too.  `SafeLogFilter`, attached to aiohttp's
loggers, rewrites every record into one line: the message template with only
safe arguments (numbers, peer addresses), and the exception's class name,
never its text or traceback.  A client that went away is an INFO line.

A malformed request (aiohttp's ``HttpProcessingError``: a bad request line,
header or body framing) is the client's fault and costs an unauthenticated local
process nothing to repeat, so it is a WARNING at most once a minute, with the
count of those left out since the last one; every other error keeps its line.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["AIOHTTP_LOGGERS", "SafeLogFilter", "install_log_filter"]

AIOHTTP_LOGGERS: tuple[str, ...] = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)
#: Exceptions that mean "the client went away": an INFO line, not an ERROR.
_GONE = (
    "ClientGone",
    "ConnectionResetError",
    "BrokenPipeError",
    "ConnectionAbortedError",
    "ClientConnectionResetError",
    "CancelledError",
)
#: An argument kept as is: a peer address (IPv4/IPv6, optional port) or a number.
#: A malformed request is reported at most once this often.
MALFORMED_EVERY_S = 60.0
_PEER = re.compile(r"\[?[0-9A-Fa-f:.]{2,45}\]?(?::\d{1,5})?")
_BYTES_LITERAL = re.compile(r"""b(['"]).*?(?<!\\)\1""", re.S)


def _safe_arg(arg: object) -> object:
    if isinstance(arg, bool | int | float) or arg is None:
        return arg
    if isinstance(arg, str) and _PEER.fullmatch(arg):
        return arg
    if isinstance(arg, tuple) and all(isinstance(a, str | int) for a in arg) and len(arg) <= 4:
        return arg if all(_safe_arg(a) == a for a in arg) else "<dropped>"
    return "<dropped>"


def _one_line(text: str) -> str:
    text = _BYTES_LITERAL.sub("b'<dropped>'", text)
    first = text.splitlines()[0] if text else text
    return "".join(ch if ch.isprintable() else "?" for ch in first)[:300]


class SafeLogFilter(logging.Filter):
    """Rewrite a record so that no request byte (header line, body) can be in it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._malformed_at = float("-inf")
        self._malformed_since = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        malformed = isinstance(exc, HttpProcessingError)
        if malformed:
            now = self._clock()
            if now - self._malformed_at < MALFORMED_EVERY_S:
                self._malformed_since += 1
                return False
            left_out, self._malformed_at, self._malformed_since = self._malformed_since, now, 0
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        args = record.args
        safe: tuple[object, ...] | dict[str, object]
        if isinstance(args, dict):
            safe = {k: _safe_arg(v) for k, v in args.items()}
        elif isinstance(args, tuple):
            safe = tuple(_safe_arg(a) for a in args)
        else:
            safe = ()
        try:
            text = template % safe if safe else template
        except (TypeError, ValueError, KeyError):
            text = template
        text = _one_line(text)
        if exc is not None:
            name = type(exc).__name__
            text = f"{text} ({name})"
            if name in _GONE or isinstance(exc, ConnectionError):
                record.levelno, record.levelname = logging.INFO, "INFO"
                text = f"client went away: {text}"
            elif malformed:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
                text = (
                    f"{text}: a malformed request; {left_out} more since the last report "
                    f"(reported once every {MALFORMED_EVERY_S:g} s)"
                )
        record.msg, record.args = text, ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


_FILTER = SafeLogFilter()


def install_log_filter(names: Iterable[str] = AIOHTTP_LOGGERS) -> None:
    """Attach the filter to aiohttp's loggers (once; idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
