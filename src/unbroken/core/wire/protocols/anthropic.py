"""Anthropic Messages stream classifier (``/v1/messages``).

The event name decides most frames.  ``content_block_start`` is parsed to
learn the block type; the deltas that follow are classified by the type of
the open block (Anthropic streams one content block at a time), so text
deltas are never parsed.
"""

from __future__ import annotations

import json

from unbroken.core.wire.protocols.base import (
    Kind,
    error_is_retryable,
    loads_object,
    looks_like_object,
    named_run,
)
from unbroken.core.wire.sse import Event

_C = Kind.CONTROL

EVENTS: dict[str, int] = {
    "message_start": _C,
    "ping": _C,
    "message_delta": _C,  # stop_reason + usage: released with the rest, or held while pending
    "message_stop": Kind.TERMINAL_OK,
}

# content block type -> (kind of its start frame, kind of its deltas, kind of its stop)
BLOCKS: dict[str, tuple[int, int, int]] = {
    "text": (_C, Kind.OUTPUT, _C),
    "thinking": (_C, Kind.REASONING, _C),
    "redacted_thinking": (Kind.REASONING, Kind.REASONING, _C),
    "tool_use": (Kind.TOOL_START, Kind.TOOL_DELTA, Kind.TOOL_END),
    "server_tool_use": (Kind.TOOL_START, Kind.TOOL_DELTA, Kind.TOOL_END),
    "mcp_tool_use": (Kind.TOOL_START, Kind.TOOL_DELTA, Kind.TOOL_END),
}
_UNKNOWN_BLOCK = (Kind.UNKNOWN, Kind.UNKNOWN, Kind.UNKNOWN)
_PLAIN_NAMES = (b"event: content_block_delta", b"event: ping")


class AnthropicClassifier:
    __slots__ = ("block", "open_tools")

    def __init__(self) -> None:
        self.block: tuple[int, int, int] | None = None
        self.open_tools = 0

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        """``(frames, end)``: the frames of ``chunk[start:end]``, each provably released
        as it is; ``(0, start)`` when the first is not.

        Each frame must be a ``content_block_delta`` (or a ``ping``) of the open text
        or thinking block, with one ``data: {…}`` line: the same checks `classify`
        makes (stricter: the ``}`` must end the line), without building events.
        """
        block = self.block
        if block is None or block[1] not in (Kind.OUTPUT, Kind.REASONING):
            return 0, start
        return named_run(chunk, start, _PLAIN_NAMES)

    def classify(self, event: Event) -> tuple[int, int]:
        name = event.name
        if name is None:
            if event.data is None:
                return _C, self.open_tools
            return Kind.UNKNOWN, self.open_tools
        if not looks_like_object(event.data):
            return Kind.MALFORMED, self.open_tools
        if name == "content_block_delta":
            block = self.block
            return (block[1] if block is not None else Kind.UNKNOWN), self.open_tools
        kind = EVENTS.get(name)
        if kind is not None:
            return kind, self.open_tools
        if name == "content_block_start":
            obj = loads_object(event.data)
            if obj is None:
                return Kind.MALFORMED, self.open_tools
            cb = obj.get("content_block")
            btype = cb.get("type") if isinstance(cb, dict) else None
            self.block = (
                BLOCKS.get(btype, _UNKNOWN_BLOCK) if isinstance(btype, str) else (_UNKNOWN_BLOCK)
            )
            if self.block[0] == Kind.TOOL_START:
                self.open_tools += 1
            return self.block[0], self.open_tools
        if name == "content_block_stop":
            block, self.block = self.block, None
            if block is None:
                return Kind.UNKNOWN, self.open_tools
            if block[2] == Kind.TOOL_END:
                self.open_tools -= 1
            return block[2], self.open_tools
        if name == "error":
            obj = loads_object(event.data)
            kinds = Kind.TERMINAL_ERROR
            if obj is not None and error_is_retryable(obj.get("error")):
                kinds |= Kind.RETRYABLE
            return kinds, self.open_tools
        return Kind.UNKNOWN, self.open_tools


def error_frame(message: str) -> bytes:
    """``event: error`` that ends a truncated Messages stream.

    ``overloaded_error`` is what Anthropic itself sends for transient failures:
    the anthropic SDK raises ``APIStatusError`` (type overloaded_error) and
    OpenCode's retry rules match "Overloaded".  The ``event:`` line is required.
    """
    payload = {
        "type": "error",
        "error": {"type": "overloaded_error", "message": f"Overloaded ({message})"},
    }
    return b"event: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
