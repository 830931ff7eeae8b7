"""Responses WebSocket mode: a reply as TEXT messages, and the socket's errors."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, Final

from unbroken.mock.actions import Action
from unbroken.mock.wire.error_replies import _ERRORS, kind_error_frame, status_error_body
from unbroken.mock.wire.frames import (
    ANTHROPIC_NAME,
    RESPONSES_NAME,
    dumps,
)
from unbroken.mock.wire.render import render_reply
from unbroken.mock.wire.reply import MockReply, ReplyKey, make_reply

# ---------------------------------------------------------------------------
# Responses WebSocket mode
#
# A ``response.create`` message is answered with the events of the streamed HTTP
# reply, one TEXT message per event holding exactly the JSON of the SSE ``data:``
# line. The reply is rendered for the request ``ws_request(message)``: the message
# without ``"type"``, with ``"stream": true`` (streaming is implicit on a socket).
# So a socket reply and the SSE reply to ``POST /v1/responses`` with that body
# carry the same ids and byte-identical payloads.


def ws_request(message: Mapping[str, Any]) -> dict[str, Any]:
    """The HTTP request JSON a ``response.create`` message is rendered as."""
    request = {k: v for k, v in message.items() if k != "type"}
    request["stream"] = True
    return request


def _sse_data(frame: bytes) -> bytes:
    start = frame.index(b"data: ") + 6
    return frame[start:-2] if frame.endswith(b"\n\n") else frame[start:]


def ws_messages(reply: MockReply) -> tuple[bytes, ...]:
    """The WebSocket TEXT messages (UTF-8 JSON) of a streamed Responses ``reply``.

    Each is the ``data:`` payload of the matching SSE frame of :func:`render_reply`
    (the last 256 are kept by digest).
    """
    if reply.protocol != RESPONSES_NAME or not reply.stream:
        raise ValueError("ws_messages needs a streamed Responses reply")
    return _ws_messages_memo(ReplyKey.of(reply))


@functools.lru_cache(maxsize=256)
def _ws_messages_memo(key: ReplyKey) -> tuple[bytes, ...]:
    return tuple(_sse_data(f) for f in render_reply(key.reply).frames)


def ws_messages_for(
    action: Mapping[str, Any] | Action | None, message: Mapping[str, Any]
) -> list[bytes]:
    """Exact TEXT messages of the clean socket reply to a ``response.create`` message.

    ``message`` may include ``"type"`` (it is dropped); fault keys are ignored.
    """
    return list(ws_messages(make_reply(RESPONSES_NAME, action, ws_request(message))))


def ws_error(
    status: int | None,
    error_type: str,
    code: str | None,
    message: str,
    *,
    param: str | None = None,
    sequence_number: int | None = None,
) -> bytes:
    """A Responses WebSocket ``error`` message (``ResponseWsError`` in the openai SDK).

    ``sequence_number`` is present only for errors inside a started reply.
    """
    payload: dict[str, Any] = {"type": "error"}
    if status is not None:
        payload["status"] = status
    payload["error"] = {"type": error_type, "code": code, "message": message, "param": param}
    if sequence_number is not None:
        payload["sequence_number"] = sequence_number
    return dumps(payload).encode()


#: Error kind -> (status, type, code) of the WebSocket ``error_event`` fault.
_WS_ERROR_CODES: Final[dict[str, tuple[int, str, str]]] = {
    "overloaded": (503, "server_error", "server_is_overloaded"),
    "server_error": (500, "server_error", "server_error"),
    "rate_limit": (429, "tokens", "rate_limit_exceeded"),
    "invalid_request": (400, "invalid_request_error", "invalid_request_error"),
    "context_length": (400, "invalid_request_error", "context_length_exceeded"),
}


def ws_error_kind(error: str, sequence_number: int | None) -> bytes:
    """The WebSocket error message of an ERROR_KINDS name (``error_event`` fault)."""
    status, error_type, code = _WS_ERROR_CODES[error]
    return ws_error(
        status, error_type, code, _ERRORS[error].openai_message, sequence_number=sequence_number
    )


def ws_status_error(status: int) -> bytes:
    """The WebSocket error message for an action's HTTP-style ``status``."""
    error = json.loads(status_error_body(RESPONSES_NAME, status))["error"]
    return ws_error(status, error["type"], error["code"], error["message"])


def ws_failed_event(reply: MockReply, error: str, sequence_number: int) -> bytes:
    """The ``response.failed`` payload (as in SSE ``error_style: failed``)."""
    return _sse_data(kind_error_frame(reply, error, sequence_number, "failed"))


PREVIOUS_NOT_FOUND_CODE: Final = "previous_response_not_found"
CONNECTION_LIMIT_CODE: Final = "websocket_connection_limit_reached"
CONNECTION_LIMIT_MESSAGE: Final = (
    "Responses websocket connection limit reached (60 minutes). "
    "Create a new websocket connection to continue."
)


def previous_not_found_message(previous_response_id: str) -> str:
    return f"Previous response with id '{previous_response_id}' not found."


def ws_previous_not_found(previous_response_id: str) -> bytes:
    return ws_error(
        400,
        "invalid_request_error",
        PREVIOUS_NOT_FOUND_CODE,
        previous_not_found_message(previous_response_id),
        param="previous_response_id",
    )


def previous_not_found_body(previous_response_id: str) -> bytes:
    """HTTP 400 body of ``POST /v1/responses`` with an unknown ``previous_response_id``."""
    error = {
        "message": previous_not_found_message(previous_response_id),
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": PREVIOUS_NOT_FOUND_CODE,
    }
    return dumps({"error": error}).encode()


def ws_connection_limit() -> bytes:
    return ws_error(400, "invalid_request_error", CONNECTION_LIMIT_CODE, CONNECTION_LIMIT_MESSAGE)


def connection_limit_body(protocol: str) -> bytes:
    """HTTP 400 body of the ``connection_limit`` fault on a plain HTTP request."""
    if protocol == ANTHROPIC_NAME:
        error = {"type": "invalid_request_error", "message": CONNECTION_LIMIT_MESSAGE}
        return dumps({"type": "error", "error": error}).encode()
    return dumps(
        {
            "error": {
                "message": CONNECTION_LIMIT_MESSAGE,
                "type": "invalid_request_error",
                "param": None,
                "code": CONNECTION_LIMIT_CODE,
            }
        }
    ).encode()


#: The broken JSON text message of the WebSocket ``malformed`` fault.
WS_GARBAGE: Final = b'{"type": "response.output_text.delta", "delta": "x"'
