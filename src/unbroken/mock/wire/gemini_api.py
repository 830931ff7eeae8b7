"""The mock's Gemini API: ``POST .../v1beta/models/<model>:streamGenerateContent?alt=sse``
and ``:generateContent``, in the shapes the Gemini API sends (and Gemini CLI 0.61 reads).

A streamed reply is one ``data: <GenerateContentResponse>`` event per text piece,
each ended by ``\\r\\n\\r\\n`` as the Gemini API ends them; the last piece carries
``finishReason: "STOP"`` and the full ``usageMetadata``.  A tool reply sends each
``functionCall`` whole, one event per call, then a last event with the finish.
Errors are Google's RPC error objects (``code``, ``message``, ``status``), in the
stream as a ``data:`` event, as a body for a status.

The model comes from the path and streaming from the method, so the server renders
a Gemini request as ``{**body, "model": <from the path>, "stream": <method>}``
(`request_view`); `unbroken.mock.wire` does the rest as for the other protocols.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from unbroken.mock.wire.frames import _VAL, GEMINI_NAME, _Item, _Run
from unbroken.mock.wire.reply import MockReply

__all__ = [
    "GEMINI_NAME",
    "body",
    "error_payload",
    "garbage",
    "items",
    "kind_body",
    "parse_path",
    "request_view",
    "status_body",
    "to_crlf",
]

#: ``.../v1beta/models/<model>:<method>`` (any prefix, like the other protocols' paths)
_PATH = re.compile(r".*/v1(?:beta|alpha)?/models/([^/:]+):(streamGenerateContent|generateContent)")

#: HTTP status -> google.rpc status name and the Gemini API's message
_STATUS: Final[dict[int, tuple[str, str]]] = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "Request had invalid authentication credentials."),
    403: ("PERMISSION_DENIED", "The caller does not have permission."),
    404: ("NOT_FOUND", "Requested entity was not found."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: ("INTERNAL", "An internal error has occurred. Please retry or report."),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    504: ("DEADLINE_EXCEEDED", "The request timed out. Please try again."),
}

#: the mock's error kinds (`unbroken.mock.actions.ERROR_KINDS`) as Gemini errors
_KINDS: Final[dict[str, int]] = {
    "overloaded": 503,
    "server_error": 500,
    "rate_limit": 429,
    "invalid_request": 400,
    "context_length": 400,
}
_CONTEXT_MESSAGE: Final = (
    "The input token count (1250000) exceeds the maximum number of tokens allowed (1048576)."
)


def parse_path(path: str) -> tuple[str, bool] | None:
    """``(model, streamed)`` of a Gemini method path, or None."""
    m = _PATH.fullmatch(path.rstrip("/"))
    if m is None:
        return None
    return m.group(1), m.group(2) == "streamGenerateContent"


def request_view(body: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """The request a Gemini call is rendered as: its body, with the model and the
    streaming its path names."""
    return {**body, "model": model, "stream": stream}


def to_crlf(frame: bytes) -> bytes:
    """An SSE frame ended with ``\\r\\n\\r\\n`` (the Gemini API's event separator)."""
    return frame[:-2] + b"\r\n\r\n" if frame.endswith(b"\n\n") else frame


def _usage(r: MockReply, final: bool) -> dict[str, Any]:
    if not final:
        return {"promptTokenCount": r.prompt_tokens, "totalTokenCount": r.prompt_tokens}
    return {
        "promptTokenCount": r.prompt_tokens,
        "candidatesTokenCount": r.completion_tokens,
        "totalTokenCount": r.total_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": r.prompt_tokens}],
    }


def _response(r: MockReply, parts: list[Any], *, final: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}}
    if final:
        candidate["finishReason"] = "STOP"
    candidate["index"] = 0
    return {
        "candidates": [candidate],
        "usageMetadata": _usage(r, final),
        "modelVersion": r.model,
        "responseId": r.ident("gemini-response", 22),
    }


def _call_part(name: str, arguments: str) -> dict[str, Any]:
    return {"functionCall": {"name": name, "args": json.loads(arguments)}}


def items(r: MockReply) -> list[_Item]:
    """The streamed reply's events (``(None, payload)``; text pieces as one run)."""
    if r.calls:
        out: list[_Item] = [
            (None, _response(r, [_call_part(c.name, c.arguments)], final=False)) for c in r.calls
        ]
        out.append((None, _response(r, [{"text": ""}], final=True)))
        return out
    pieces = r.pieces
    out = []
    if len(pieces) > 1:
        template = _response(r, [{"text": _VAL}], final=False)
        out.append(_Run(None, template, pieces[:-1]))
    out.append((None, _response(r, [{"text": pieces[-1] if pieces else ""}], final=True)))
    return out


def body(r: MockReply) -> dict[str, Any]:
    """The ``:generateContent`` answer."""
    if r.calls:
        parts = [_call_part(c.name, c.arguments) for c in r.calls]
    else:
        parts = [{"text": r.text}]
    return _response(r, parts, final=True)


def error_payload(status: int, message: str | None = None) -> dict[str, Any]:
    name, default = _STATUS.get(
        status, ("INTERNAL" if status >= 500 else "INVALID_ARGUMENT", f"Mock HTTP {status} error.")
    )
    return {"error": {"code": status, "message": message or default, "status": name}}


def kind_body(error: str) -> tuple[int, bytes]:
    """Status and body of a mock error kind, in Gemini's terms."""
    status = _KINDS[error]
    message = _CONTEXT_MESSAGE if error == "context_length" else None
    return status, json.dumps(error_payload(status, message), separators=(",", ":")).encode()


def status_body(status: int) -> bytes:
    return json.dumps(error_payload(status), separators=(",", ":")).encode()


def garbage() -> bytes:
    """The ``malformed`` fault's frame: a text chunk cut mid-JSON."""
    return b'data: {"candidates": [{"content": {"parts": [{"text": "x"\r\n\r\n'
