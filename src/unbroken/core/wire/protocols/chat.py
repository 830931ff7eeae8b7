"""OpenAI Chat Completions stream classifier (``/v1/chat/completions``).

Chunks carry no SSE event name, so each ``data:`` payload is parsed.  The
table below maps the delta fields to kinds; ``finish_reason`` closes every
open tool call and ends the turn.  The usage chunk and ``[DONE]`` that follow
are forwarded as they come (the ledger is already DONE by then).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from unbroken.core.wire.protocols.base import Kind, error_is_retryable, loads_object
from unbroken.core.wire.sse import LF, Event

# delta field -> kind, when the field holds a non-empty value.  Fields not here
# (legacy function_call, audio, ...) are UNKNOWN: they commit.
DELTA_FIELDS: dict[str, int] = {
    "role": 0,  # carries nothing by itself
    "content": Kind.OUTPUT,
    "refusal": Kind.OUTPUT,
    "reasoning_content": Kind.REASONING,  # DeepSeek, vLLM, Groq
    "reasoning": Kind.REASONING,  # OpenRouter and others
    "reasoning_details": Kind.REASONING,  # OpenRouter's structured reasoning
}
_TEXT_FIELDS = frozenset({"content", "refusal", "reasoning_content", "reasoning"})

# The byte-level proof that a run of chunks is plain output (see `plain_prefix`), looked
# for with ``find``, not ``in`` (see `unbroken.core.wire.sse.CR`).  ``[DONE]`` needs no
# marker: its frame does not start with ``data: {``.
_NOT_PLAIN = (b"tool_calls", b"function_call", b'"error"')
_FINISH = b'"finish_reason"'
_FINISH_NULL = (b'"finish_reason":null', b'"finish_reason": null')
# A finish with a reason (``"finish_reason":"stop"``): a raw quote always opens or closes a
# JSON string, so these bytes are a key ``finish_reason`` whose value is a string, which
# `_PlainChunk` refuses wherever it stands (null only, or an unknown field).  A frame
# holding them, in a run (`plain_prefix`), is not tried with the typed decode, as if it
# had failed it: it would, at the cost of the decode and a ValidationError with its
# message (about 13k instructions, every turn whose finish arrives with other frames).
_FINISH_STR = b'"finish_reason":"'


# The typed proof (see `plain_prefix`): a chunk of this shape, every field known and of
# the type declared, nothing else, is plain output.  Every value is checked, none is
# skipped, so it accepts only what `classify`'s parse accepts too (duplicate keys:
# each copy is checked).  ``usage``, ``logprobs`` and ``finish_reason`` must be null;
# a delta may carry only text fields.  The fields are OpenAI's and its peers', declared
# in the order they are sent: msgspec looks a key up from the field after the last one
# matched, so keys in that order are found at the first comparison (``kw_only`` lets
# the required ``choices`` stand after the fields with defaults).
class _PlainDelta(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _PlainChoice(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    index: int = 0
    delta: _PlainDelta | None = None
    logprobs: None = None
    finish_reason: None = None


class _PlainChunk(msgspec.Struct, forbid_unknown_fields=True, gc=False, kw_only=True):
    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    service_tier: str | None = None
    system_fingerprint: str | None = None
    choices: list[_PlainChoice]
    usage: None = None
    obfuscation: str | None = None
    error: None = None


_plain_chunk = msgspec.json.Decoder(_PlainChunk).decode
# What a chunk that does not fit raises: ValidationError is a DecodeError; DecodeError is a
# ValueError only since msgspec 0.19 (ValueError also covers a str it cannot encode).
_NOT_PLAIN_CHUNK = (msgspec.DecodeError, ValueError)


class ChatClassifier:
    __slots__ = ("finished", "open_indices", "typed")

    def __init__(self) -> None:
        self.open_indices: set[int] = set()
        self.finished = False
        #: `classify` and `plain_prefix` try the typed decode (`_PlainChunk`) first, until
        #: a frame does not fit it (a finish, a tool call, a provider's other fields)
        self.typed = True

    def classify(self, event: Event) -> tuple[int, int]:
        data = event.data
        if data is None:  # comment-only event (keepalive)
            return _KIND_CONTROL, len(self.open_indices)
        if data == "[DONE]":
            self.open_indices.clear()
            return _KIND_TERMINAL_OK, 0
        if self.typed:
            # A plain chunk's kinds, read off the typed decode: what the dict walk below
            # gives for it (no tool call, no finish, no error; text fields are strings).
            try:
                plain = _plain_chunk(data)
            except _NOT_PLAIN_CHUNK:
                self.typed = False
            else:
                kinds = 0
                for choice in plain.choices:
                    delta = choice.delta
                    if delta is not None:
                        if delta.content or delta.refusal:
                            kinds |= _KIND_OUTPUT
                        if delta.reasoning_content or delta.reasoning:
                            kinds |= _KIND_REASONING
                return kinds or _KIND_CONTROL, len(self.open_indices)
        obj = loads_object(data)
        if obj is None:
            return _KIND_MALFORMED, len(self.open_indices)
        if "error" in obj and obj["error"] is not None:
            kinds = _KIND_TERMINAL_ERROR
            if error_is_retryable(obj["error"]):
                kinds |= _KIND_RETRYABLE
            return kinds, len(self.open_indices)
        choices = obj.get("choices")
        if not choices:
            return _KIND_CONTROL, len(self.open_indices)  # usage chunk, or an empty one
        if not isinstance(choices, list):
            return _KIND_UNKNOWN, len(self.open_indices)
        kinds = 0
        for choice in choices:
            kinds |= self._choice(choice)
        return kinds or _KIND_CONTROL, len(self.open_indices)

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        """``(frames, end)``: the frames of ``chunk[start:end]``, each provably released
        as it is; ``(0, start)`` when the first is not.

        Used only after commit with no tool call open (see `Ledger.release_run`): then
        every frame is released unless it opens a tool call, ends the turn, is an
        error, or is malformed.  Each frame is one ``data: {...}`` line, and either
        proof shows the rest:

        * typed, frame by frame: the payload decodes as `_PlainChunk` (every field
          known, checked and plain: no tool call, no error, every ``finish_reason``
          null).  One C-level pass, no Python objects but the few it declares.  The
          run ends before the first frame that is incomplete or not one such line.
          The first frame that fails the decode (the turn's last, or a provider's
          other fields) ends the run and switches the typed proof off for this
          attempt.
        * bytes, all or nothing (what is left once the typed proof is off): no
          ``tool_calls``/``function_call``/``"error"`` anywhere, every
          ``finish_reason`` null, and each payload parses, as in `classify` (so a
          malformed frame takes the slow path and fails exactly as it would).
        """
        size = len(chunk)
        if self.typed and not start and chunk.find(LF) == size - 2 and chunk[-1] == LF:
            # One frame, as a paced stream sends them: the loop below, unrolled.
            if chunk[:7] != b"data: {":
                return 0, 0
            try:
                _plain_chunk(chunk[6:-2])
                return 1, size
            except _NOT_PLAIN_CHUNK:
                self.typed = False
        # The frames at once (one search for the blank lines, not one a frame): what
        # follows the last blank line is never a whole frame.
        rest = chunk[start:] if start else chunk
        parts = rest.split(b"\n\n")
        tail = parts.pop()
        if self.typed:
            # Each frame is a part holding no LF: its one line, ended by a blank one.
            frames, pos = 0, start
            # the first finish with a reason in the run (one search, not one a frame)
            finish = chunk.find(_FINISH_STR, start)
            if finish < 0:
                finish = size
            for part in parts:
                if part[:7] != b"data: {" or LF in part:  # (no argument parsing)
                    return frames, pos
                end = pos + len(part)
                plain = finish > end
                if plain:
                    try:
                        _plain_chunk(part[6:])
                    except _NOT_PLAIN_CHUNK:
                        plain = False
                if not plain:
                    self.typed = False
                    if frames:
                        return frames, pos
                    break
                frames += 1
                pos = end + 2
            else:
                return frames, pos
        if tail:
            return 0, start
        for part in parts:
            if not part.startswith(b"data: {") or LF in part:
                return 0, start
        for marker in _NOT_PLAIN:
            if rest.find(marker) >= 0:
                return 0, start
        finish = rest.count(_FINISH)
        if finish and finish != rest.count(_FINISH_NULL[0]) + rest.count(_FINISH_NULL[1]):
            return 0, start
        for part in parts:
            if loads_object(part[6:]) is None:
                return 0, start
        return len(parts), len(chunk)

    def _choice(self, choice: Any) -> int:
        if not isinstance(choice, dict):
            return _KIND_UNKNOWN
        kinds = 0
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key, value in delta.items():
                if not value:
                    continue  # "", None, [] carry nothing
                kind = DELTA_FIELDS.get(key)
                if kind is None:
                    kinds |= self._tool_calls(value) if key == "tool_calls" else _KIND_UNKNOWN
                elif key in _TEXT_FIELDS and not isinstance(value, str):
                    kinds |= _KIND_UNKNOWN
                else:
                    kinds |= kind
        elif delta is not None:
            kinds |= _KIND_UNKNOWN
        if choice.get("finish_reason") is not None:
            if self.open_indices:
                kinds |= _KIND_TOOL_END
                self.open_indices.clear()
            kinds |= _KIND_TERMINAL_OK
            self.finished = True
        return kinds

    def _tool_calls(self, calls: Any) -> int:
        if not isinstance(calls, list):
            return _KIND_UNKNOWN
        kinds = 0
        for call in calls:
            if not isinstance(call, dict):
                return _KIND_UNKNOWN
            index = call.get("index", 0)
            if not isinstance(index, int):
                return _KIND_UNKNOWN
            if index in self.open_indices and not call.get("id"):
                kinds |= _KIND_TOOL_DELTA
            else:
                self.open_indices.add(index)
                kinds |= _KIND_TOOL_START
        return kinds


def error_frame(message: str) -> bytes:
    """The in-band error chunk that ends a truncated Chat Completions stream.

    The openai SDK raises ``APIError`` on it; the Vercel AI SDK (OpenCode)
    yields an error part that OpenCode retries: type ``server_error``, and a
    code containing ``unavailable`` (see docs/protocols.md, section 6).
    No ``[DONE]`` follows.
    """
    payload = {
        "error": {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        }
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# The frame kinds the functions above test, as module constants: an attribute of a
# class (``Kind.OUTPUT``) is a generic lookup on Python 3.11 (about 200 instructions),
# a global about 40.
_KIND_CONTROL = Kind.CONTROL
_KIND_MALFORMED = Kind.MALFORMED
_KIND_OUTPUT = Kind.OUTPUT
_KIND_REASONING = Kind.REASONING
_KIND_RETRYABLE = Kind.RETRYABLE
_KIND_TERMINAL_ERROR = Kind.TERMINAL_ERROR
_KIND_TERMINAL_OK = Kind.TERMINAL_OK
_KIND_TOOL_DELTA = Kind.TOOL_DELTA
_KIND_TOOL_END = Kind.TOOL_END
_KIND_TOOL_START = Kind.TOOL_START
_KIND_UNKNOWN = Kind.UNKNOWN
