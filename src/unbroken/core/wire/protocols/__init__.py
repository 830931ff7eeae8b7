"""Per-protocol stream knowledge: which classifier, which native error (sans-IO)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from unbroken.core.admission.policy import is_quota_body
from unbroken.core.wire.protocols import anthropic, chat, gemini, responses
from unbroken.core.wire.protocols.base import Classifier, Kind, kind_names, loads_object
from unbroken.core.wire.sse import Event

__all__ = [
    "ANTHROPIC",
    "BODY",
    "CHAT",
    "GEMINI",
    "GENERIC",
    "RESPONSES",
    "Classifier",
    "Kind",
    "Protocol",
    "kind_names",
    "model_answered",
    "model_asked",
    "protocol_for_path",
    "usage_from",
]


class GenericClassifier:
    """Any other ``text/event-stream``: every frame is UNKNOWN (it commits)."""

    __slots__ = ()

    def classify(self, event: Event) -> tuple[int, int]:
        if event.is_comment:
            return Kind.CONTROL, 0
        return Kind.UNKNOWN, 0

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        return 0, start  # no table: every frame goes through the ledger


@dataclass(frozen=True, slots=True)
class Protocol:
    name: str
    #: True when the protocol has a success terminal frame: a stream that ends
    #: without it was truncated.  Generic SSE has none, so its clean end is success.
    has_terminal: bool
    new_classifier: Callable[[], Classifier]
    anthropic_errors: bool = False
    #: the frame that closes the stream after its terminal frame, if the protocol has
    #: one (``data: [DONE]``): sent by the relay when the upstream is cut before it
    done_marker: bytes | None = None
    #: the protocol's own keepalive event, for clients whose idle timer ignores SSE
    #: comments (`core.profiles`); None: only comments
    keepalive_event: bytes | None = None
    #: False when an SSE comment would break the protocol's clients (the genai SDK
    #: stops parsing at one): every client then gets ``keepalive_event``
    comment_keepalive: bool = True

    def error_frame(
        self, message: str, classifier: Classifier, last_raw: bytes | None, now: float
    ) -> bytes:
        """The protocol-native, retryable error event that ends a truncated turn (``now``:
        Unix time, for a Responses turn cut before its ``response.created``)."""
        if self is CHAT:
            return chat.error_frame(message)
        if self is ANTHROPIC:
            return anthropic.error_frame(message)
        if self is GEMINI:
            return gemini.error_frame(message)
        if self is RESPONSES:
            snapshot = None
            if isinstance(classifier, responses.ResponsesClassifier):
                snapshot = classifier.snapshot
            return responses.error_frame(
                message,
                snapshot=snapshot,
                sequence_number=responses.next_sequence_number(last_raw),
                now=now,
            )
        if self is BODY:
            return b""  # a plain body has no error frame: the shell aborts the connection
        return (
            b"event: error\ndata: "
            + json.dumps({"error": {"message": message}}).encode()
            + (b"\n\n")
        )

    def final_error_frame(self, status: int, body: bytes, request_id: str | None = None) -> bytes:
        """A non-retryable HTTP answer, re-sent as the protocol's in-stream error event.

        Used when SSE headers already went out (early headers), so the status can
        no longer be sent as a status.  The provider's own error object is kept, its
        type says the answer is final (``invalid_request_error``,
        ``authentication_error``, ...: never a retryable type), and the provider's
        ``request-id`` goes with it when known.
        """
        if self is GEMINI:
            return gemini.final_error_frame(status, body, request_id)
        obj = loads_object(body)
        err: Any = obj.get("error") if obj else None
        e: dict[str, Any] = dict(err) if isinstance(err, dict) else {}
        etype = e.get("type") if isinstance(e.get("type"), str) else None
        etype = etype or _FINAL_TYPES.get(status, "invalid_request_error")
        message = e.get("message") if isinstance(e.get("message"), str) else None
        message = message or f"upstream HTTP {status}"
        shown = f"{message} (request id {request_id})" if request_id else message
        if self.anthropic_errors:
            payload: dict[str, Any] = (
                dict(obj)
                if obj and obj.get("type") == "error" and e
                else {
                    "type": "error",
                    "error": {"type": etype, "message": message},
                }
            )
            if request_id and "request_id" not in payload:
                payload["request_id"] = request_id
            return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
        if self is RESPONSES:
            code = e.get("code") or etype
            error_event = {
                "type": "error",
                "code": code,
                "message": shown,
                "param": e.get("param"),
                "error": {"type": etype, "code": code, "message": shown, "param": e.get("param")},
            }
            response: dict[str, Any] = {
                "id": f"resp_unbroken_final_{status}",
                "object": "response",
                "status": "failed",
                "output": [],
                "error": {"code": code, "message": shown},
                "incomplete_details": None,
            }
            failed = {"type": "response.failed", "response": response}
            return (
                b"event: error\ndata: " + json.dumps(error_event).encode() + b"\n\n"
                b"event: response.failed\ndata: " + json.dumps(failed).encode() + b"\n\n"
            )
        e.setdefault("type", etype)
        e["message"] = shown
        return b"data: " + json.dumps({"error": e}).encode() + b"\n\n"

    def error_body(self, message: str, *, type_: str = "upstream_unavailable") -> bytes:
        """A JSON error body in the protocol's style (for non-streamed failures)."""
        if self.anthropic_errors:
            return json.dumps(
                {"type": "error", "error": {"type": "api_error", "message": message}}
            ).encode()
        if self is GEMINI:
            return json.dumps(
                {"error": {"code": 502, "message": message, "status": "UNAVAILABLE"}}
            ).encode()
        return json.dumps(
            {"error": {"message": message, "type": "server_error", "code": type_}}
        ).encode()

    def retry_delay(self, body: bytes) -> float | None:
        """Seconds to wait that a retryable answer's body names (Gemini's
        ``RetryInfo.retryDelay``), or None; obeyed like ``Retry-After``."""
        return gemini.retry_delay(body) if self is GEMINI else None

    def quota_body(self, body: bytes) -> bool:
        """The answer says the account's quota is spent (a long cool-off, no retry).
        A Gemini 429 says "You exceeded your current quota" for a per-minute window
        too, with a ``retryDelay``: only a per-day quota is a wall there."""
        if self is GEMINI:
            return gemini.is_quota_wall(body)
        return is_quota_body(body)


CHAT = Protocol("chat", True, chat.ChatClassifier, done_marker=b"data: [DONE]\n\n")
#: The Responses API has no keepalive event of its own: an event type that Codex's and
#: the openai SDK's parsers accept and ignore (checked with Codex 0.169.0 and openai 3.57).
RESPONSES = Protocol(
    "responses",
    True,
    responses.ResponsesClassifier,
    keepalive_event=b'event: keepalive\ndata: {"type":"keepalive"}\n\n',
)
#: Anthropic's own ``ping``, which its API sends between frames.
ANTHROPIC = Protocol(
    "anthropic",
    True,
    anthropic.AnthropicClassifier,
    anthropic_errors=True,
    keepalive_event=b'event: ping\ndata: {"type": "ping"}\n\n',
)
#: The Gemini API (``:streamGenerateContent?alt=sse``): keepalives are blank lines for
#: every client (see `gemini.BLANK_LINE_KEEPALIVE`).
GEMINI = Protocol(
    "gemini",
    True,
    gemini.GeminiClassifier,
    keepalive_event=gemini.BLANK_LINE_KEEPALIVE,
    comment_keepalive=False,
)
GENERIC = Protocol("generic", False, GenericClassifier)
#: A non-SSE body (JSON answer, file): each chunk is one UNKNOWN frame, so the
#: first forwarded byte commits; a failure after it ends with an abort.
BODY = Protocol("body", False, GenericClassifier)


#: the error type a final status gets when the provider's body names none
_FINAL_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
}

_USAGE_IN = re.compile(rb'"(?:prompt_tokens|input_tokens|promptTokenCount)"\s*:\s*(\d+)')
_USAGE_OUT = re.compile(rb'"(?:completion_tokens|output_tokens|candidatesTokenCount)"\s*:\s*(\d+)')


def usage_from(frames: Iterable[bytes]) -> tuple[int | None, int | None]:
    """(input, output) tokens reported in the given frames; the last report wins."""
    tokens_in: int | None = None
    tokens_out: int | None = None
    if not isinstance(frames, list | tuple):
        frames = list(frames)
    if b"".join(frames).find(b"oken") < 0:  # (one search, not one a frame: most have none)
        return tokens_in, tokens_out
    for raw in frames:
        if raw.find(b"oken") < 0:  # tokens, promptTokenCount
            continue
        found = _USAGE_IN.findall(raw)
        if found:
            tokens_in = int(found[-1])
        found = _USAGE_OUT.findall(raw)
        if found:
            tokens_out = int(found[-1])
    return tokens_in, tokens_out


#: a model name as an observer may show it: printable, bounded
_MODEL_NAME = re.compile(r"[\w.:/@+-]{1,128}")
_MODEL_IN_PATH = re.compile(r"(?:^|/)models/([^/:]{1,128}):")
_MODEL_IN_FRAME = re.compile(rb'"(?:model|modelVersion)"\s*:\s*"([^"\\]{1,128})"')


def model_asked(body: Any, path: str) -> str:
    """The model a request names: the body's ``model`` (Chat, Responses, Anthropic), else
    the Gemini API path's ``models/<model>:<method>``; "" when none (or not a plain name)."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        found = _MODEL_IN_PATH.search(path)
        model = found.group(1) if found else ""
    return model if _MODEL_NAME.fullmatch(model) else ""


def model_answered(first: bytes) -> str:
    """The model an answer names in its first frame or body: its first ``"model"`` key
    (Gemini's ``"modelVersion"``) with a plain string value; "" when none."""
    at = first.find(b'"model')
    while at >= 0:
        found = _MODEL_IN_FRAME.match(first, at)
        if found is not None:
            model = found.group(1).decode("utf-8", "replace")
            return model if _MODEL_NAME.fullmatch(model) else ""
        at = first.find(b'"model', at + 6)
    return ""


def protocol_for_path(path: str) -> Protocol:
    """Pick the protocol from the request path (the part after the route name)."""
    p = path.rstrip("/")
    if p.endswith("chat/completions"):
        return CHAT
    if p.endswith("/responses") or p == "responses":
        return RESPONSES
    if p.endswith("/messages") or p == "messages":
        return ANTHROPIC
    if gemini.is_gemini_path(p):
        return GEMINI
    return GENERIC
