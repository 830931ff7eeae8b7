"""Each protocol's errors: in-stream error frames, error bodies for a status or an
error kind, and the malformed frames of the ``malformed`` fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import unbroken.mock.wire.gemini_api as _gemini
from unbroken.mock.wire.frames import (
    ANTHROPIC_NAME,
    CHAT_NAME,
    GEMINI_NAME,
    RESPONSES_NAME,
    dumps,
    encode_sse,
)
from unbroken.mock.wire.reply import MockReply
from unbroken.mock.wire.responses_api import _response_object


@dataclass(frozen=True, slots=True)
class _ErrorKind:
    openai_status: int
    anthropic_status: int
    openai_type: str
    openai_code: str
    openai_message: str
    anthropic_type: str
    anthropic_message: str


_ERRORS: Final[dict[str, _ErrorKind]] = {
    "overloaded": _ErrorKind(
        503,
        529,
        "server_error",
        "server_is_overloaded",
        "The server is overloaded or not ready yet.",
        "overloaded_error",
        "Overloaded",
    ),
    "server_error": _ErrorKind(
        500,
        500,
        "server_error",
        "server_error",
        "The server had an error while processing your request. Sorry about that!",
        "api_error",
        "Internal server error",
    ),
    "rate_limit": _ErrorKind(
        429,
        429,
        "tokens",
        "rate_limit_exceeded",
        "Rate limit reached for requests (mock). Please try again in 1s.",
        "rate_limit_error",
        "This request would exceed the rate limit for your organization (mock). "
        "Please try again later.",
    ),
    "invalid_request": _ErrorKind(
        400,
        400,
        "invalid_request_error",
        "invalid_prompt",
        "Invalid prompt: the mock provider rejected this request.",
        "invalid_request_error",
        "Invalid request (mock).",
    ),
    "context_length": _ErrorKind(
        400,
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "Your input exceeds the context window of this model. "
        "Please adjust your input and try again.",
        "invalid_request_error",
        "prompt is too long: 250000 tokens > 200000 maximum",
    ),
}


def _openai_error(kind: _ErrorKind) -> dict[str, Any]:
    return {
        "message": kind.openai_message,
        "type": kind.openai_type,
        "param": None,
        "code": kind.openai_code,
    }


def _anthropic_error(kind: _ErrorKind) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": kind.anthropic_type, "message": kind.anthropic_message},
    }


def kind_error_frame(
    reply: MockReply, error: str, sequence_number: int, style: str = "failed"
) -> bytes:
    """The protocol-native in-stream error frame for ``error`` (an ERROR_KINDS name)."""
    kind = _ERRORS[error]
    if reply.protocol == GEMINI_NAME:
        _status, payload = _gemini.kind_body(error)
        return _gemini.to_crlf(encode_sse(None, payload.decode()))
    if reply.protocol == CHAT_NAME:
        return encode_sse(None, {"error": _openai_error(kind)})
    if reply.protocol == ANTHROPIC_NAME:
        return encode_sse("error", _anthropic_error(kind))
    if style == "error":
        return encode_sse(
            "error",
            {
                "type": "error",
                "sequence_number": sequence_number,
                "code": kind.openai_code,
                "message": kind.openai_message,
                "param": None,
            },
        )
    failed = _response_object(
        reply, "failed", [], None, {"code": kind.openai_code, "message": kind.openai_message}
    )
    return encode_sse(
        "response.failed",
        {"type": "response.failed", "sequence_number": sequence_number, "response": failed},
    )


def kind_error_body(protocol: str, error: str) -> tuple[int, bytes]:
    """HTTP status and JSON body of the non-streamed form of an error kind."""
    kind = _ERRORS[error]
    if protocol == GEMINI_NAME:
        return _gemini.kind_body(error)
    if protocol == ANTHROPIC_NAME:
        return kind.anthropic_status, dumps(_anthropic_error(kind)).encode()
    return kind.openai_status, dumps({"error": _openai_error(kind)}).encode()


_STATUS_MESSAGES: Final[dict[int, tuple[str, str, str | None, str]]] = {
    # status: (openai type, openai message, openai code, anthropic type)
    400: ("invalid_request_error", "Invalid request (mock).", None, "invalid_request_error"),
    401: (
        "invalid_request_error",
        "Incorrect API key provided (mock).",
        "invalid_api_key",
        "authentication_error",
    ),
    402: ("invalid_request_error", "Payment required (mock).", None, "billing_error"),
    403: (
        "invalid_request_error",
        "You do not have access to this resource (mock).",
        None,
        "permission_error",
    ),
    404: ("invalid_request_error", "Not found (mock).", None, "not_found_error"),
    408: ("server_error", "Request timed out (mock).", None, "timeout_error"),
    413: ("invalid_request_error", "Request too large (mock).", None, "request_too_large"),
    429: (
        "tokens",
        "Rate limit reached for requests (mock). Please try again in 1s.",
        "rate_limit_exceeded",
        "rate_limit_error",
    ),
    500: (
        "server_error",
        "The server had an error while processing your request. Sorry about that!",
        None,
        "api_error",
    ),
    502: ("server_error", "Bad gateway.", None, "api_error"),
    503: ("server_error", "The server is overloaded or not ready yet.", None, "overloaded_error"),
    504: ("server_error", "Gateway timeout.", None, "timeout_error"),
    529: ("server_error", "The server is overloaded or not ready yet.", None, "overloaded_error"),
}


_ANTHROPIC_MESSAGES: Final[dict[str, str]] = {
    "authentication_error": "invalid x-api-key",
    "rate_limit_error": "This request would exceed the rate limit for your organization (mock). "
    "Please try again later.",
    "api_error": "Internal server error",
    "overloaded_error": "Overloaded",
}


def status_error_body(protocol: str, status: int) -> bytes:
    """Default protocol-shaped JSON error body for an HTTP status."""
    if protocol == GEMINI_NAME:
        return _gemini.status_body(status)
    entry = _STATUS_MESSAGES.get(status)
    if entry is None:
        server = status >= 500
        entry = (
            "server_error" if server else "invalid_request_error",
            f"Mock HTTP {status} error.",
            None,
            "api_error" if server else "invalid_request_error",
        )
    oa_type, message, code, an_type = entry
    if protocol == ANTHROPIC_NAME:
        message = _ANTHROPIC_MESSAGES.get(an_type, message)
        return dumps({"type": "error", "error": {"type": an_type, "message": message}}).encode()
    return dumps(
        {"error": {"message": message, "type": oa_type, "param": None, "code": code}}
    ).encode()


_GARBAGE: Final[dict[str, bytes]] = {
    CHAT_NAME: b'data: {"choices": [{"delta": {"content": "x"\n\n',
    RESPONSES_NAME: b"event: response.output_text.delta\n"
    b'data: {"type": "response.output_text.delta", "delta": "x"\n\n',
    ANTHROPIC_NAME: b"event: content_block_delta\n"
    b'data: {"type": "content_block_delta", "index": 0, '
    b'"delta": {"type": "text_delta", "text": "x"\n\n',
    GEMINI_NAME: _gemini.garbage(),
}
#: Inserted into a non-streamed body; NUL bytes make any JSON invalid.
BODY_GARBAGE: Final = b"\x00<malformed>\x00"


def garbage_frame(protocol: str, stream: bool = True) -> bytes:
    """The malformed frame injected by the ``malformed`` fault."""
    return _GARBAGE[protocol] if stream else BODY_GARBAGE


#: Anthropic's answer to a prefill from a model that refuses it (Claude 4.6 and later;
#: the wording reported in anthropics/claude-code#28478)
PREFILL_REFUSED_BODY: Final = dumps(
    {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "This model does not support assistant message prefill. "
            "The conversation must end with a user message.",
        },
    }
).encode()
