"""Per-protocol stream knowledge: which classifier, which native error (sans-IO)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from unbroken.core.protocols import anthropic, chat, responses
from unbroken.core.protocols.base import Classifier, Kind, kind_names, loads_object
from unbroken.core.sse import Event

__all__ = [
    "ANTHROPIC",
    "BODY",
    "CHAT",
    "GENERIC",
    "RESPONSES",
    "Classifier",
    "Kind",
    "Protocol",
    "kind_names",
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

    def error_frame(self, message: str, classifier: Classifier, last_raw: bytes | None) -> bytes:
        """The protocol-native, retryable error event that ends a truncated turn."""
        if self is CHAT:
            return chat.error_frame(message)
        if self is ANTHROPIC:
            return anthropic.error_frame(message)
        if self is RESPONSES:
            snapshot = None
            if isinstance(classifier, responses.ResponsesClassifier):
                snapshot = classifier.snapshot
            return responses.error_frame(
                message,
                snapshot=snapshot,
                sequence_number=responses.next_sequence_number(last_raw),
            )
        if self is BODY:
            return b""  # a plain body has no error frame: the shell aborts the connection
        return b"event: error\ndata: " + json.dumps({"error": {"message": message}}).encode() + (
            b"\n\n"
        )

    def final_error_frame(self, status: int, body: bytes) -> bytes:
        """A non-retryable HTTP answer, re-sent as the protocol's in-stream error event.

        Used when SSE headers already went out (early headers), so the status can
        no longer be sent as a status.  The provider's own error object is kept.
        """
        obj = loads_object(body)
        err: Any = obj.get("error") if obj else None
        if self.anthropic_errors:
            payload: dict[str, Any] = obj if obj and obj.get("type") == "error" else {
                "type": "error",
                "error": {"type": "api_error", "message": f"upstream HTTP {status}"},
            }
            return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
        if self is RESPONSES:
            e = err if isinstance(err, dict) else {}
            payload = {
                "type": "error",
                "code": e.get("code") or e.get("type") or str(status),
                "message": e.get("message") or f"upstream HTTP {status}",
                "param": e.get("param"),
            }
            return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
        payload = {"error": err} if isinstance(err, dict) else {
            "error": {"message": f"upstream HTTP {status}", "type": "upstream_error"}
        }
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def error_body(self, message: str, *, type_: str = "upstream_unavailable") -> bytes:
        """A JSON error body in the protocol's style (for non-streamed failures)."""
        if self.anthropic_errors:
            return json.dumps(
                {"type": "error", "error": {"type": "api_error", "message": message}}
            ).encode()
        return json.dumps(
            {"error": {"message": message, "type": "server_error", "code": type_}}
        ).encode()


CHAT = Protocol("chat", True, chat.ChatClassifier, done_marker=b"data: [DONE]\n\n")
RESPONSES = Protocol("responses", True, responses.ResponsesClassifier)
ANTHROPIC = Protocol("anthropic", True, anthropic.AnthropicClassifier, anthropic_errors=True)
GENERIC = Protocol("generic", False, GenericClassifier)
#: A non-SSE body (JSON answer, file): each chunk is one UNKNOWN frame, so the
#: first forwarded byte commits; a failure after it ends with an abort.
BODY = Protocol("body", False, GenericClassifier)


_USAGE_IN = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')
_USAGE_OUT = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')


def usage_from(frames: Iterable[bytes]) -> tuple[int | None, int | None]:
    """(input, output) tokens reported in the given frames; the last report wins."""
    tokens_in: int | None = None
    tokens_out: int | None = None
    for raw in frames:
        if b"tokens" not in raw:
            continue
        found = _USAGE_IN.findall(raw)
        if found:
            tokens_in = int(found[-1])
        found = _USAGE_OUT.findall(raw)
        if found:
            tokens_out = int(found[-1])
    return tokens_in, tokens_out


def protocol_for_path(path: str) -> Protocol:
    """Pick the protocol from the request path (the part after the route name)."""
    p = path.rstrip("/")
    if p.endswith("chat/completions"):
        return CHAT
    if p.endswith("/responses") or p == "responses":
        return RESPONSES
    if p.endswith("/messages") or p == "messages":
        return ANTHROPIC
    return GENERIC
