"""Anthropic Messages: finish a cut turn by assistant prefill (sans-IO).

A Messages request whose last message is an assistant message makes the model
continue that text.  When a streamed turn is cut after commit and everything the
client has is text, the turn can be finished in place:

1. `request_refusal` checks the request once: streamed, a list of messages,
   thinking not enabled, and a client prefill (an assistant message last) of
   plain text only.
2. `read_committed` reads what the client has from the bytes unbroken released
   (never from what it received): text blocks only, no ``tool_use`` started, no
   ``thinking`` / ``redacted_thinking``, no server-tool block, no
   ``message_delta`` yet.  Anything else is a typed `PrefillRefusal`: the turn ends as
   today, with the native error (or the profile's reset).
3. `plan_continuation` builds the continuation request: the original body plus an assistant
   message with the committed text, trailing whitespace trimmed (the client's own
   prefill is extended instead when it has one).
4. A `FrameSplicer` turns the continuation's frames into the client's stream: its
   ``message_start`` and the first ``content_block_start`` of text are absorbed,
   its deltas continue the client's open block with the client's index (later
   blocks renumbered after the client's), the join's whitespace follows
   `prefill.TextJoin`'s rule (and a continuation that repeats the end of the
   prefill, an echo, is refused: never shown twice), usage is merged (input as
   the original reported it, output: the committed text's tokens plus the
   continuation's), and the
   continuation's own ``message_delta`` and ``message_stop`` end the turn: exactly
   one of each reaches the client.

Frames are re-serialised on this path only (a continued turn); a delta whose
index needs no change and that is past the join passes as it is.

The committed text's tokens are measured, not guessed: the continuation's prompt
is the original's plus the prefill, so the difference of the two prompts' totals
(input + cache creation + cache read, from each ``message_start``) is what the
cut attempt had produced.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.protocols.prefill import (
    PrefillRefusal,
    TextJoin,
    released_events,
    split_trailing_ws,
)
from unbroken.core.wire.sse import Event

__all__ = [
    "Committed",
    "FrameSplicer",
    "Plan",
    "plan_continuation",
    "read_committed",
    "request_refusal",
]

#: content block types whose start refuses the continuation, and why
_BLOCK_REFUSALS: dict[str, PrefillRefusal] = {
    "tool_use": PrefillRefusal.TOOL_CALL,
    "thinking": PrefillRefusal.THINKING,
    "redacted_thinking": PrefillRefusal.THINKING,
    "server_tool_use": PrefillRefusal.SERVER_TOOL,
    "mcp_tool_use": PrefillRefusal.SERVER_TOOL,
    "mcp_tool_result": PrefillRefusal.SERVER_TOOL,
    "web_search_tool_result": PrefillRefusal.SERVER_TOOL,
    "web_fetch_tool_result": PrefillRefusal.SERVER_TOOL,
    "code_execution_tool_result": PrefillRefusal.SERVER_TOOL,
    "bash_code_execution_tool_result": PrefillRefusal.SERVER_TOOL,
    "text_editor_code_execution_tool_result": PrefillRefusal.SERVER_TOOL,
    "container_upload": PrefillRefusal.SERVER_TOOL,
}
#: usage fields that describe the prompt (kept as the original reported them)
_INPUT_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
_ANY_THINKING = frozenset({"enabled", "adaptive"})


def request_refusal(request: Mapping[str, Any]) -> PrefillRefusal | None:
    """None when the request allows a prefill continuation, else why not."""
    if request.get("stream") is not True:
        return PrefillRefusal.NOT_STREAMED
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return PrefillRefusal.BAD_REQUEST
    thinking = request.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or thinking.get("type") in _ANY_THINKING
    ):
        # Prefill is refused with extended thinking (and anything we cannot read is
        # taken as thinking: the provider would refuse the continuation anyway).
        return PrefillRefusal.THINKING_ENABLED
    choice = request.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        # A forced tool call is the provider's own prefill: a text prefill cannot join it.
        return PrefillRefusal.FORCED_TOOL
    last = messages[-1]
    if last.get("role") == "assistant" and _client_prefill(last.get("content")) is None:
        return PrefillRefusal.CLIENT_PREFILL
    return None


def _client_prefill(content: object) -> str | None:
    """The text of a client's own assistant prefill, or None when it is not plain text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts: list[str] = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            return None
        text = block.get("text")
        if not isinstance(text, str):
            return None
        parts.append(text)
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Committed:
    """What the client has of a cut Messages stream (read from the released bytes)."""

    #: the text of every text block, in order (the text the client shows)
    text: str
    #: the client's text block still open (no ``content_block_stop`` yet), or None
    open_index: int | None
    #: the index the next new block gets
    next_index: int
    #: ``message_start``'s usage (the original prompt's tokens)
    usage: Mapping[str, Any] = field(default_factory=dict)
    #: the client saw ``message_start`` (a continuation's is then absorbed)
    started: bool = True
    #: text delta frames the client has (about a token each: what a redo samples again)
    deltas: int = 0


def read_committed(released: bytes) -> Committed | PrefillRefusal:
    """Read the client's stream back from the bytes released to it."""
    events = released_events(released)
    if isinstance(events, PrefillRefusal):
        return events
    parts: list[str] = []
    open_index: int | None = None
    next_index = 0
    usage: Mapping[str, Any] = {}
    started = False
    deltas = 0
    for event in events:
        name = event.name
        if event.data is None:
            continue  # a comment (keepalive)
        obj = loads_object(event.data)
        if obj is None:
            return PrefillRefusal.MALFORMED
        if name == "ping":
            continue
        if name == "message_start":
            message = obj.get("message")
            u = message.get("usage") if isinstance(message, dict) else None
            usage = u if isinstance(u, dict) else {}
            started = True
        elif name == "content_block_start":
            index = obj.get("index")
            block = obj.get("content_block")
            btype = block.get("type") if isinstance(block, dict) else None
            if not isinstance(index, int) or not isinstance(btype, str):
                return PrefillRefusal.MALFORMED
            if btype != "text":
                return _BLOCK_REFUSALS.get(btype, PrefillRefusal.OTHER_CONTENT)
            assert isinstance(block, dict)
            text = block.get("text", "")
            if not isinstance(text, str) or block.get("citations"):
                return PrefillRefusal.OTHER_CONTENT
            parts.append(text)
            open_index = index
            next_index = max(next_index, index + 1)
        elif name == "content_block_delta":
            delta = obj.get("delta")
            if obj.get("index") != open_index or not isinstance(delta, dict):
                return PrefillRefusal.MALFORMED
            text = delta.get("text")
            if delta.get("type") != "text_delta" or not isinstance(text, str):
                return PrefillRefusal.OTHER_CONTENT  # citations, or a delta the rule does not know
            parts.append(text)
            deltas += 1
        elif name == "content_block_stop":
            if obj.get("index") != open_index:
                return PrefillRefusal.MALFORMED
            open_index = None
        elif name in ("message_delta", "message_stop"):
            return PrefillRefusal.STOP_RELEASED
        else:
            return PrefillRefusal.OTHER_CONTENT  # an error, or a frame the rule does not know
    return Committed("".join(parts), open_index, next_index, usage, started, deltas)


@dataclass(frozen=True, slots=True)
class Plan:
    """A continuation: the request to send, and how its frames join the client's."""

    body: dict[str, Any]
    committed: Committed
    #: the committed text's trailing whitespace, trimmed from the prefill
    shown_ws: str
    #: the assistant text the continuation request ends with (a user-message
    #: continuation: the interrupted turn's text, `anthropic_continue`)
    prefill: str
    #: the text the answer must begin with, dropped (a user-message continuation's
    #: anchor, `anthropic_continue.anchor_of`); "" for a prefill
    echo: str = ""


def plan_continuation(request: Mapping[str, Any], committed: Committed) -> Plan | PrefillRefusal:
    """The continuation request for ``request`` after ``committed`` (or why not)."""
    refusal = request_refusal(request)
    if refusal is not None:
        return refusal
    messages: list[Any] = list(request["messages"])
    last = messages[-1]
    kept, shown_ws = split_trailing_ws(committed.text)
    if not kept:
        shown_ws = committed.text  # whitespace only: all of it was shown
    body = dict(request)
    if last.get("role") == "assistant":
        # The client's own prefill: the model continues it, so the committed text
        # extends it (its content: a string, or plain text blocks).
        base = _client_prefill(last.get("content")) or ""
        prefill = (base + committed.text).rstrip()
        message = dict(last)
        content = last.get("content")
        if isinstance(content, list) and content:
            blocks = [dict(b) for b in content]
            blocks[-1]["text"] = blocks[-1]["text"] + (prefill[len(base) :] if prefill else "")
            message["content"] = blocks
        else:
            message["content"] = prefill if prefill else base
        messages[-1] = message
    else:
        prefill = kept
        if prefill:
            messages.append({"role": "assistant", "content": prefill})
    body["messages"] = messages
    return Plan(body, committed, shown_ws, prefill)


def _frame(name: str, payload: Mapping[str, Any]) -> Event:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return Event(f"event: {name}\ndata: {data}\n\n".encode(), name, data)


def _total_input(usage: Mapping[str, Any]) -> int | None:
    total = 0
    seen = False
    for key in _INPUT_FIELDS:
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            total += value
            seen = True
    return total if seen else None


class FrameSplicer:
    """The continuation's frames, as the client's stream goes on (`feed`, frame by frame).

    Every frame out is a valid frame of the client's stream.  Frames the continuation
    adds that the client must not see twice (``message_start``, the joined block's
    ``content_block_start``) are absorbed.  A frame that cannot be read is passed as
    it is: the ledger that follows judges it (a malformed frame fails the attempt).
    """

    __slots__ = (
        "_block",
        "_closed_open",
        "_cont_input",
        "_join",
        "_joined",
        "_merged",
        "committed",
    )

    def __init__(self, plan: Plan) -> None:
        self.committed = plan.committed
        self._join = TextJoin(plan.shown_ws, echo=plan.echo, tail=plan.prefill)
        self._block: int | None = None  # the continuation's open block (its own index)
        self._joined = False  # the first block was seen (the join is placed)
        self._merged = False  # the first block continues the client's open block
        self._closed_open = False  # the client's open block was closed here
        self._cont_input: int | None = None

    # -- index mapping -------------------------------------------------------------
    def _index(self, index: int) -> int:
        """The client's index for the continuation's block ``index``."""
        base = self.committed.next_index
        if self._merged:
            if index == 0:
                assert self.committed.open_index is not None
                return self.committed.open_index
            return base + index - 1
        return base + index

    def feed(self, event: Event) -> list[Event]:
        name = event.name
        if event.data is None or name is None or name == "ping":
            return [event]
        if name == "content_block_delta" and self._join.done and self._block is not None:
            if self._index(self._block) == self._block:
                return [event]  # past the join, same index: as it is
        obj = loads_object(event.data)
        if obj is None:
            return [event]
        if name == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._cont_input = _total_input(usage)
            if self.committed.started:
                return []
            return [event]
        if name == "content_block_start":
            return self._block_start(event, obj)
        if name == "content_block_delta":
            return self._delta(event, obj)
        if name == "content_block_stop":
            out = self._flush()
            index = obj.get("index")
            if isinstance(index, int):
                self._block = None
                out.append(_frame(name, {**obj, "index": self._index(index)}))
                return out
            out.append(event)
            return out
        if name == "message_delta":
            out = self._flush()
            out.extend(self._close_open())
            out.append(_frame(name, self._merged_usage(obj)))
            return out
        if name == "message_stop":
            out = self._flush()
            out.extend(self._close_open())
            out.append(event)
            return out
        return [event]  # error, or a frame the table does not know: the ledger decides

    def _block_start(self, event: Event, obj: dict[str, Any]) -> list[Event]:
        index = obj.get("index")
        block = obj.get("content_block")
        if not isinstance(index, int) or not isinstance(block, dict):
            return [event]
        out: list[Event] = []
        self._block = index
        if not self._joined:
            self._joined = True
            is_text = block.get("type") == "text"
            if is_text and self.committed.open_index is not None and index == 0:
                # The continuation goes on in the client's open block: absorbed; its
                # initial text (if any) goes through the join.
                self._merged = True
                text = block.get("text")
                if isinstance(text, str) and text:
                    out.extend(self._text(text))
                return out
            out.extend(self._close_open())
            if not is_text:
                self._join.flush()  # no text at the join: the client keeps what it has
            else:
                text = block.get("text")
                start = dict(block)
                start["text"] = ""
                out.append(
                    _frame(
                        "content_block_start",
                        {**obj, "index": self._index(index), "content_block": start},
                    )
                )
                if isinstance(text, str) and text:
                    out.extend(self._text(text))
                return out
        out.extend(self._flush())
        out.append(_frame("content_block_start", {**obj, "index": self._index(index)}))
        return out

    def _delta(self, event: Event, obj: dict[str, Any]) -> list[Event]:
        index = obj.get("index")
        delta = obj.get("delta")
        if not isinstance(index, int) or not isinstance(delta, dict):
            return [event]
        if not self._join.done and delta.get("type") == "text_delta":
            text = delta.get("text")
            if isinstance(text, str):
                return self._text(text, obj)
        mapped = self._index(index)
        if mapped == index:
            return [event]
        return [_frame("content_block_delta", {**obj, "index": mapped})]

    def _text(self, piece: str, obj: dict[str, Any] | None = None) -> list[Event]:
        """Text at the join: held while whitespace only, then sent reconciled."""
        out = self._join.text(piece)
        if not out:
            return []
        return [self._text_frame(out, obj)]

    def _text_frame(self, text: str, obj: dict[str, Any] | None = None) -> Event:
        block = self._block if self._block is not None else 0
        payload: dict[str, Any] = dict(obj) if obj is not None else {"type": "content_block_delta"}
        payload["index"] = self._index(block)
        payload["delta"] = {"type": "text_delta", "text": text}
        return _frame("content_block_delta", payload)

    def _flush(self) -> list[Event]:
        """No more text comes at the join: send what the rule keeps of what is held."""
        if self._join.done:
            return []
        text = self._join.flush()
        if not text or not self._joined:
            return []  # nothing to send, or no block opened yet to send it in
        return [self._text_frame(text)]

    def _close_open(self) -> list[Event]:
        """Close the client's open block if the continuation did not continue it."""
        open_index = self.committed.open_index
        if open_index is None or self._merged or self._closed_open:
            return []
        self._closed_open = True
        self._join.flush()  # whitespace held for a block that ends here: the client has W
        return [_frame("content_block_stop", {"type": "content_block_stop", "index": open_index})]

    def _merged_usage(self, obj: dict[str, Any]) -> dict[str, Any]:
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return obj
        merged = dict(usage)
        original = self.committed.usage
        for key in _INPUT_FIELDS:
            if key in merged and key in original:
                merged[key] = original[key]
        out = usage.get("output_tokens")
        if isinstance(out, int) and not isinstance(out, bool):
            merged["output_tokens"] = out + self.committed_tokens()
        return {**obj, "usage": merged}

    def committed_tokens(self) -> int:
        """Tokens of what the cut attempts had produced: the continuation's prompt less
        the original's (the prefill), else what the original's ``message_start`` said."""
        original = _total_input(self.committed.usage)
        if original is not None and self._cont_input is not None:
            return max(0, self._cont_input - original)
        start = self.committed.usage.get("output_tokens")
        return start if isinstance(start, int) and not isinstance(start, bool) else 0
