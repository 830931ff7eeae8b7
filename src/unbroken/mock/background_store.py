"""OpenAI Responses background mode in the mock: stored streams, resume and cancel.

A streamed ``POST .../responses`` with ``background: true`` (which needs
``store: true``) is stored whole, with its frames, before any of it is sent: the
response "keeps running" whatever happens to the connection.  Then

* ``GET .../responses/{id}?stream=true&starting_after=N`` streams the stored
  events after sequence number N (the frames of the same reply, byte for byte),
  and the request's action may still cut it (``fault`` / ``after_frame`` count the
  resumed frames);
* ``POST .../responses/{id}/cancel`` marks it cancelled and answers the response
  object with ``status: "cancelled"``.

Fault knobs (action keys): ``refuse_background: true`` answers the creating
request with a 400 naming ``background``; ``resume`` answers a resume with
``not_found`` (404), ``bad_request`` (400), ``other_id`` (the events of another
response), ``other_response`` (the same events, sequence numbers and item ids, naming
another response id), ``backwards`` (from sequence number N, one event again) or ``queued``
(headers, then silence: a response stuck in ``queued``).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Final

from unbroken.mock.actions import Action
from unbroken.mock.wire import MockReply, render_reply

__all__ = [
    "BackgroundStore",
    "Stored",
    "background_refused_body",
    "not_found_body",
    "resume_frames",
    "resume_target",
    "store_required_body",
]

_STORE_MAX: Final = 4096
_TARGET = re.compile(r"/responses/([A-Za-z0-9_-]+)(/cancel)?/?$")


@dataclass(slots=True)
class Stored:
    """One background response: its reply and whether it was cancelled."""

    reply: MockReply
    frames: tuple[bytes, ...]
    cancelled: bool = False
    resumes: list[int] = field(default_factory=list)  # each resume's starting_after


class BackgroundStore:
    """The background responses the mock created (the oldest forgotten first)."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, Stored] = OrderedDict()
        #: ids a cancel was asked for, in order (known or not)
        self.cancels: list[str] = []

    def put(self, response_id: str, reply: MockReply, frames: tuple[bytes, ...]) -> None:
        self.items[response_id] = Stored(reply, frames)
        self.items.move_to_end(response_id)
        while len(self.items) > _STORE_MAX:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self.items.get(response_id)

    def clear(self) -> None:
        self.items.clear()
        self.cancels.clear()


def resume_target(path: str) -> tuple[str, bool] | None:
    """``(response id, is cancel)`` of ``.../responses/{id}[/cancel]``, else None."""
    m = _TARGET.search(path)
    if m is None:
        return None
    return m.group(1), m.group(2) is not None


def resume_frames(stored: Stored, after: int, action: Action) -> tuple[bytes, ...]:
    """The frames of a resume after sequence number ``after`` (frame k has number k-1),
    as the action's ``resume`` knob shapes them."""
    frames = stored.frames
    start = max(after + 1, 0)
    if action.resume == "backwards":
        return frames[max(after, 0) :]
    if action.resume == "other_response":
        rid = stored.reply.response_id.encode()
        return tuple(f.replace(rid, rid + b"x") for f in frames[start:])
    if action.resume == "other_id":
        reply = stored.reply
        other = MockReply(
            reply.protocol,
            replace(reply.action, seed=(reply.action.seed or "") + "-other"),
            reply.request,
            json.dumps(reply.request, sort_keys=True),
        )
        return render_reply(other).frames[start:]
    return frames[start:]


def _error(message: str, *, param: str | None, code: str | None, type_: str) -> bytes:
    body: dict[str, Any] = {
        "error": {"message": message, "type": type_, "param": param, "code": code}
    }
    return json.dumps(body, separators=(",", ":")).encode()


def not_found_body(response_id: str) -> bytes:
    return _error(
        f"Response with id '{response_id}' not found.",
        param=None,
        code=None,
        type_="invalid_request_error",
    )


def background_refused_body() -> bytes:
    return _error(
        "Background mode is not supported by this endpoint: 'background' must be false.",
        param="background",
        code="unsupported_parameter",
        type_="invalid_request_error",
    )


def store_required_body() -> bytes:
    return _error(
        "Background mode requires 'store' to be true.",
        param="store",
        code="invalid_value",
        type_="invalid_request_error",
    )


def cancelled_body(response_id: str) -> bytes:
    return json.dumps(
        {"id": response_id, "object": "response", "status": "cancelled", "background": True},
        separators=(",", ":"),
    ).encode()
