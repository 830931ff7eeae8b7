"""The frame toolkit every protocol renders with: protocol names, fixed ids and
timestamps, SSE encoding, and delta runs (many frames that differ in one string,
rendered from one pre-encoded template)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Final, TypeAlias

#: each protocol's name, as a mock reply and its path say it (the relay's `Protocol`
#: objects are `unbroken.core.wire.protocols.CHAT` and the like)
CHAT_NAME: Final = "chat"
RESPONSES_NAME: Final = "responses"
ANTHROPIC_NAME: Final = "anthropic"
GEMINI_NAME: Final = "gemini"
PROTOCOL_NAMES: Final[tuple[str, ...]] = (CHAT_NAME, RESPONSES_NAME, ANTHROPIC_NAME, GEMINI_NAME)

#: Fixed ``created`` / ``created_at`` timestamp of every reply (determinism).
CREATED: Final = 1_700_000_000
SYSTEM_FINGERPRINT: Final = "fp_mock"
DEFAULT_MODEL: Final = "mock-model"
DEFAULT_TOOL: Final = "bash"
DEFAULT_TOOL_ARGS: Final[tuple[Mapping[str, Any], ...]] = (
    {"command": "echo hello"},
    {"command": "echo world"},
)

#: An event: (SSE event name or None, JSON-able payload or raw data string).
Event: TypeAlias = tuple[str | None, Any]

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
dumps = _encoder.encode


def encode_sse(event: str | None, payload: Any) -> bytes:
    """Encode one event as an SSE frame (``event: NAME\\ndata: JSON\\n\\n``)."""
    data = payload if isinstance(payload, str) else dumps(payload)
    if event is None:
        return f"data: {data}\n\n".encode()
    return f"event: {event}\ndata: {data}\n\n".encode()


# ---------------------------------------------------------------------------
# Delta runs: many frames that differ only in one string (and a sequence number)

_VAL: Final = "\x00val\x00"
_SEQ: Final = "\x00seq\x00"
_VAL_J: Final = dumps(_VAL)
_SEQ_J: Final = dumps(_SEQ)
_SPLIT_RE: Final = re.compile(f"({re.escape(_VAL_J)}|{re.escape(_SEQ_J)})")


def _substitute(obj: Any, value: str, seq: int) -> Any:
    if isinstance(obj, dict):
        return {k: _substitute(v, value, seq) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, value, seq) for v in obj]
    if isinstance(obj, str):
        if obj == _VAL:
            return value
        if obj == _SEQ:
            return seq
    return obj


@dataclass(frozen=True, slots=True)
class _Run:
    """A run of delta events sharing one payload template.

    ``template`` holds the ``_VAL`` placeholder where each value goes and,
    optionally, ``_SEQ`` where ``seq_start + i`` goes.
    """

    event: str | None
    template: dict[str, Any]
    values: tuple[str, ...]
    seq_start: int = 0

    def events(self) -> list[Event]:
        return [
            (self.event, _substitute(self.template, v, self.seq_start + i))
            for i, v in enumerate(self.values)
        ]

    def frames(self) -> list[bytes]:
        parts = _SPLIT_RE.split(encode_sse(self.event, self.template).decode())
        lits = [p.encode() for p in parts[0::2]]
        kinds = parts[1::2]
        enc = encode_basestring
        if kinds == [_VAL_J]:
            a, b = lits
            return [a + enc(v).encode() + b for v in self.values]
        if kinds == [_SEQ_J, _VAL_J]:
            a, b, c = lits
            seq = self.seq_start
            return [
                a + str(seq + i).encode() + b + enc(v).encode() + c
                for i, v in enumerate(self.values)
            ]
        out: list[bytes] = []  # generic fallback (not used by the built-in protocols)
        for i, v in enumerate(self.values):
            buf = [lits[0]]
            for kind, lit in zip(kinds, lits[1:], strict=True):
                buf.append(str(self.seq_start + i).encode() if kind == _SEQ_J else enc(v).encode())
                buf.append(lit)
            out.append(b"".join(buf))
        return out


_Item: TypeAlias = "Event | _Run"


def _expand_events(items: Sequence[_Item]) -> list[Event]:
    out: list[Event] = []
    for item in items:
        if isinstance(item, _Run):
            out.extend(item.events())
        else:
            out.append(item)
    return out


def _encode_items(items: Sequence[_Item]) -> list[bytes]:
    out: list[bytes] = []
    for item in items:
        if isinstance(item, _Run):
            out.extend(item.frames())
        else:
            out.append(encode_sse(item[0], item[1]))
    return out
