"""Frame kinds and the classifier interface shared by every protocol (sans-IO).

A classifier is a small state machine per stream.  ``classify(event)`` returns
``(kinds, open_tools)``:

* ``kinds`` is a bit set of `Kind` flags.  Usually one flag; a Chat Completions
  chunk that carries text *and* ``finish_reason`` yields
  ``OUTPUT | TOOL_END | TERMINAL_OK``.
* ``open_tools`` is the number of tool calls started but not yet complete after
  this frame.  The ledger holds frames while it is non-zero (the dispatch gate).

Plain ``int`` flags keep the per-frame cost low on the hot path.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Protocol

import msgspec

from unbroken.core.admission.policy import RETRY_STATUSES
from unbroken.core.wire.sse import LF, Event

# msgspec parses a stream chunk several times faster than json (and chat's typed
# proof uses it too: one parser decides what is valid JSON on both paths).
_loads = msgspec.json.Decoder().decode

__all__ = ["Classifier", "Kind", "kind_names", "loads_object"]


class Kind:
    """Frame kinds (bit flags)."""

    CONTROL = 1 << 0  # carries nothing the client can act on (created, pings, role-only)
    OUTPUT = 1 << 1  # user-visible text, refusal, server tool progress
    REASONING = 1 << 2  # output that is model thinking (held only with hold "reasoning")
    TOOL_START = 1 << 3
    TOOL_DELTA = 1 << 4
    TOOL_END = 1 << 5
    TERMINAL_OK = 1 << 6
    TERMINAL_ERROR = 1 << 7
    RETRYABLE = 1 << 8  # modifier on TERMINAL_ERROR: a transient provider error
    UNKNOWN = 1 << 9  # not recognised: treated as OUTPUT (commits)
    MALFORMED = 1 << 10  # the frame could not be parsed: a stream failure

    #: kinds that make the frame visible output once released (they commit)
    COMMITTING = OUTPUT | REASONING | UNKNOWN | TOOL_START | TOOL_DELTA | TOOL_END


_NAMES = [
    (Kind.CONTROL, "CONTROL"),
    (Kind.OUTPUT, "OUTPUT"),
    (Kind.REASONING, "REASONING"),
    (Kind.TOOL_START, "TOOL_START"),
    (Kind.TOOL_DELTA, "TOOL_DELTA"),
    (Kind.TOOL_END, "TOOL_END"),
    (Kind.TERMINAL_OK, "TERMINAL_OK"),
    (Kind.TERMINAL_ERROR, "TERMINAL_ERROR"),
    (Kind.RETRYABLE, "RETRYABLE"),
    (Kind.UNKNOWN, "UNKNOWN"),
    (Kind.MALFORMED, "MALFORMED"),
]


def kind_names(kinds: int) -> str:
    """Human-readable form of a kind set, e.g. ``"OUTPUT|TERMINAL_OK"``."""
    return "|".join(name for bit, name in _NAMES if kinds & bit) or "NONE"


class Classifier(Protocol):
    """Per-stream frame classifier."""

    def classify(self, event: Event) -> tuple[int, int]: ...

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        """The fast path's proof (`Ledger.release_run`; after commit, no tool open):
        ``(frames, end)`` when the complete frames of ``chunk[start:end]`` are each
        provably released as they are; ``(0, start)`` when the first is not, which is
        always safe.  ``chunk`` holds no CR, and ``start`` is where a frame begins;
        a frame not yet ended is never in the run."""
        ...


_CLOSE = 0x7D  # }


def named_run(chunk: bytes, start: int, plain_lines: Container[bytes]) -> tuple[int, int]:
    """`Classifier.plain_prefix` for a protocol whose event name decides a frame: the
    frames from ``start`` that are each an ``event:`` line in ``plain_lines`` and one
    ``data: {…}`` line.  The same shape check `classify` makes for those names
    (`looks_like_object`), stricter: the ``}`` must end the line."""
    frames, pos = 0, start
    while True:
        end = chunk.find(b"\n\n", pos)
        if end < 0:
            return frames, pos
        nl = chunk.find(LF, pos, end)
        if (
            nl < 0
            or chunk[pos:nl] not in plain_lines
            or not chunk.startswith(b"data: {", nl + 1)
            or chunk.find(LF, nl + 1, end) >= 0
            or chunk[end - 1] != _CLOSE
        ):
            return frames, pos
        frames += 1
        pos = end + 2


def looks_like_object(data: str | None) -> bool:
    """Cheap shape check for frames the event name classifies without parsing.

    A cut or garbled JSON payload almost always loses its closing brace; this
    catches it without paying for ``json.loads`` on every text delta.
    """
    return data is not None and data.startswith("{") and data.rstrip().endswith("}")


def loads_object(data: str | bytes | None) -> dict[str, Any] | None:
    """Parse a JSON object, or return None when it is not one."""
    if not data:
        return None
    try:
        obj = _loads(data)
    except (msgspec.DecodeError, ValueError, RecursionError):  # malformed, or too deep
        return None
    return obj if isinstance(obj, dict) else None


# Fragments of error types / codes that name a transient provider failure, e.g.
# server_error, overloaded_error, server_is_overloaded, rate_limit_exceeded,
# service_unavailable, websocket_connection_limit_reached, timeout_error.
RETRYABLE_ERROR_FRAGMENTS: tuple[str, ...] = (
    "server_error",
    "server_is",
    "api_error",
    "overload",
    "rate_limit",
    "rate_limited",
    "too_many_requests",
    "unavailable",
    "timeout",
    "internal",
    "bad_gateway",
    "upstream",
    "connection_limit",
    "capacity",
    "resource_exhausted",
    "slow_down",
)


def error_is_retryable(error: object) -> bool:
    """Decide from an error object (``{"type", "code", ...}``) whether it is transient."""
    if not isinstance(error, dict):
        return False
    for key in ("type", "code", "status"):
        value = error.get(key)
        if isinstance(value, str):
            low = value.lower()
            if any(f in low for f in RETRYABLE_ERROR_FRAGMENTS):
                return True
            if low.isdigit() and int(low) in RETRY_STATUSES:
                return True
        elif isinstance(value, int) and value in RETRY_STATUSES:
            return True
    return False
