"""Rendering a reply in its protocol (cached by request digest), and which protocol
a request path speaks."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import unbroken.mock.wire.gemini_api as _gemini
from unbroken.mock.actions import Action
from unbroken.mock.wire.chat_api import _chat_body, _chat_items
from unbroken.mock.wire.frames import (
    ANTHROPIC_NAME,
    CHAT_NAME,
    GEMINI_NAME,
    PROTOCOL_NAMES,
    RESPONSES_NAME,
    Event,
    _encode_items,
    _expand_events,
    _Run,
    dumps,
)
from unbroken.mock.wire.messages_api import _anthropic_body, _anthropic_items
from unbroken.mock.wire.reply import MockReply, ReplyKey, make_reply
from unbroken.mock.wire.responses_api import _responses_body, _responses_items

_PATH_SUFFIXES: Final = (
    ("/chat/completions", CHAT_NAME),
    ("/responses", RESPONSES_NAME),
    ("/messages", ANTHROPIC_NAME),
)


def protocol_name_for_path(path: str) -> str | None:
    """Map a request path to a protocol by suffix (``/x/v1/messages`` -> anthropic;
    ``/v1beta/models/<model>:streamGenerateContent`` -> gemini)."""
    path = path.rstrip("/")
    if _gemini.parse_path(path) is not None:
        return GEMINI_NAME
    for suffix, protocol in _PATH_SUFFIXES:
        if path.endswith("/v1" + suffix):
            return protocol
    return None


_ITEMS = {
    CHAT_NAME: _chat_items,
    RESPONSES_NAME: _responses_items,
    ANTHROPIC_NAME: _anthropic_items,
    GEMINI_NAME: _gemini.items,
}
_BODIES = {
    CHAT_NAME: _chat_body,
    RESPONSES_NAME: _responses_body,
    ANTHROPIC_NAME: _anthropic_body,
    GEMINI_NAME: _gemini.body,
}


@dataclass(frozen=True, slots=True)
class Rendered:
    """A rendered successful reply.

    ``frames``: SSE frames for a streamed request; for a non-streamed request the
    JSON body split in two halves (frame 1 and frame 2). ``body`` is the joined
    frames.
    """

    frames: tuple[bytes, ...]
    body: bytes
    stream: bool
    request_id: str
    #: ``frames`` with HTTP/1.1 chunked framing, ready for ``transport.write``.
    chunked: tuple[bytes, ...]


def halves(body: bytes) -> tuple[bytes, bytes]:
    mid = len(body) // 2
    return body[:mid], body[mid:]


def _render(reply: MockReply) -> Rendered:
    if reply.stream:
        frames = tuple(_encode_items(_ITEMS[reply.protocol](reply)))
        if reply.protocol == GEMINI_NAME:
            frames = tuple(_gemini.to_crlf(f) for f in frames)
        body = b"".join(frames)
    else:
        body = dumps(_BODIES[reply.protocol](reply)).encode()
        frames = halves(body)
    chunked = tuple(b"%x\r\n%s\r\n" % (len(f), f) for f in frames)
    return Rendered(frames, body, reply.stream, reply.request_id, chunked)


@functools.lru_cache(maxsize=256)
def _render_memo(key: ReplyKey) -> Rendered:
    return _render(key.reply)


def render_reply(reply: MockReply) -> Rendered:
    """Render ``reply`` (the last 256 are kept by digest: identical requests share
    the bytes)."""
    return _render_memo(ReplyKey.of(reply))


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOL_NAMES:
        raise ValueError(
            f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOL_NAMES)}"
        )


def frames_for(
    protocol: str,
    action: Mapping[str, Any] | Action | None,
    request_json: Mapping[str, Any],
) -> list[bytes]:
    """Exact bytes of the successful reply the mock sends for this request.

    For a streamed request (``"stream": true``) each element is one SSE frame;
    otherwise the JSON body split into two halves. ``b"".join(...)`` is always
    the exact response body. Fault keys in ``action`` are ignored.
    """
    _check_protocol(protocol)
    return list(render_reply(make_reply(protocol, action, request_json)).frames)


def events_for(
    protocol: str,
    action: Mapping[str, Any] | Action | None,
    request_json: Mapping[str, Any],
) -> list[Event]:
    """The successful streamed reply as ``(event_name | None, payload)`` pairs.

    ``encode_sse`` of each pair gives exactly the frames of :func:`frames_for`
    for the same (streamed) request.
    """
    _check_protocol(protocol)
    reply = make_reply(protocol, action, request_json)
    return _expand_events(_ITEMS[protocol](reply))


def responses_events(
    action: Mapping[str, Any] | Action | None, request_json: Mapping[str, Any]
) -> list[Event]:
    """Responses API events (name, payload) for a reply; reusable by a WebSocket transport."""
    return events_for(RESPONSES_NAME, action, request_json)


def delta_offset(reply: MockReply) -> int:
    """Frames before the first delta of the reply's first run (text deltas, or a tool
    call's argument fragments): ``after_deltas`` counts from there."""
    count = 0
    for item in _ITEMS[reply.protocol](reply):
        if isinstance(item, _Run):
            if item.values:
                return count
            continue
        count += 1
    return count


def cut_after(reply: MockReply, action: Action, total: int) -> int:
    """The frames a faulted reply sends before its fault (``after_frame``, or
    ``after_deltas`` counted from the first delta), at most ``total``."""
    if action.after_deltas is not None:
        offset = delta_offset(reply) if reply.stream else 0
        return min(offset + action.after_deltas, total)
    return min(action.after_frame, total)
