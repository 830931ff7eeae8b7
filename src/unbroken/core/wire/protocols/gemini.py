"""Gemini API stream classifier (``models/<model>:streamGenerateContent?alt=sse``).

Every SSE event is one ``data: <GenerateContentResponse>`` with no event name;
the Gemini API separates events with ``\\r\\n\\r\\n``.  A response carries
``candidates[]``, each with ``content.parts[]``, an optional ``finishReason``
(on the candidate's last chunk), and ``usageMetadata`` / ``modelVersion`` /
``responseId`` beside them.  Each part is classified by what it holds
(`PART_KINDS`); a ``functionCall`` part arrives whole (name and all its
``args`` in one part), so it is a complete tool call the moment it arrives:
released with the frame, it commits.  An ``error`` object inside the stream is
Google's RPC error (``code``, ``message``, ``status``): retryable when its code
or status names a transient failure (503 ``UNAVAILABLE``, 429
``RESOURCE_EXHAUSTED``, 500 ``INTERNAL``, ...).

A non-streamed ``:generateContent`` or ``:countTokens`` answer is a plain JSON
body: it never reaches this classifier.

Error bodies of 429/503 answers carry ``google.rpc.RetryInfo`` with a
``retryDelay`` (``"37s"``): `retry_delay` reads it, so it is obeyed like a
``Retry-After`` (and clamped like one, by the retry policy).  A per-day quota
(`is_quota_wall`) is a quota wall, not a delay.
"""

from __future__ import annotations

import json
import re
from typing import Any

from unbroken.core.wire.protocols.base import Kind, error_is_retryable, loads_object
from unbroken.core.wire.sse import Event

__all__ = [
    "BLANK_LINE_KEEPALIVE",
    "PART_KINDS",
    "GeminiClassifier",
    "error_frame",
    "final_error_frame",
    "is_gemini_path",
    "is_quota_wall",
    "is_stream_path",
    "retry_delay",
]

_C, _OUT, _R = Kind.CONTROL, Kind.OUTPUT, Kind.REASONING
#: a ``functionCall`` part: the call starts and is complete in the same part
CALL = Kind.TOOL_START | Kind.TOOL_END

#: part field -> kind, for the first of these fields a part holds.  ``text`` is
#: REASONING when the part says ``"thought": true``; an empty text carries nothing.
#: A part with none of these (only ``thoughtSignature`` / ``thought``) carries nothing
#: the client can act on; any other part is UNKNOWN (it commits).
PART_KINDS: dict[str, int] = {
    "functionCall": CALL,
    "text": _OUT,
    "executableCode": _OUT,  # code the server runs (code execution tool): output
    "codeExecutionResult": _OUT,
    "inlineData": _OUT,
    "fileData": _OUT,
}
#: part fields that carry nothing by themselves
_SILENT_PART_FIELDS = frozenset({"thought", "thoughtSignature", "partMetadata"})
#: what a candidate's ``finishReason`` may say when it has not finished
_NOT_FINISHED = (None, "", "FINISH_REASON_UNSPECIFIED")

#: The keepalive for every Gemini client: a blank line.  The genai SDK's stream parser
#: (@google/genai, inside Gemini CLI 0.61) matches ``^\\s*data: (.*)`` at the start of
#: its buffer, so an SSE comment (``: keepalive``) would stop it from ever parsing
#: another event; leading whitespace is skipped.  By the SSE rules a blank line
#: dispatches nothing.
BLANK_LINE_KEEPALIVE = b"\r\n"

_GEMINI_METHODS = (":streamGenerateContent", ":generateContent", ":countTokens")


def is_gemini_path(path: str) -> bool:
    """A Gemini API method path (``v1beta/models/<model>:<method>``)."""
    p = path.rstrip("/")
    return "/models/" in f"/{p}" and p.endswith(_GEMINI_METHODS)


def is_stream_path(path: str) -> bool:
    """The streamed method: its answer is SSE with ``alt=sse`` (the only kind relayed
    as a stream; without it the Gemini API streams a JSON array, a plain body)."""
    return path.rstrip("/").endswith(":streamGenerateContent")


class GeminiClassifier:
    """Per-stream state: the candidates seen and the ones that finished."""

    __slots__ = ("finished", "seen")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.finished: set[int] = set()

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        # The Gemini API ends its events with CRLF: such chunks never take a run.
        return 0, start

    def classify(self, event: Event) -> tuple[int, int]:
        data = event.data
        if data is None:
            # A comment or a blank line; an event name without data is no Gemini frame.
            return (_C if event.name is None else Kind.UNKNOWN), 0
        if event.name is not None:
            return Kind.UNKNOWN, 0
        obj = loads_object(data)
        if obj is None:
            return Kind.MALFORMED, 0
        error = obj.get("error")
        if error is not None:
            kinds = Kind.TERMINAL_ERROR
            if error_is_retryable(error):
                kinds |= Kind.RETRYABLE
            return kinds, 0
        candidates = obj.get("candidates")
        if candidates is None:
            feedback = obj.get("promptFeedback")
            if isinstance(feedback, dict) and feedback.get("blockReason"):
                return Kind.TERMINAL_ERROR, 0  # the prompt was blocked: a final answer
            return _C, 0  # usage or metadata only
        if not isinstance(candidates, list):
            return Kind.UNKNOWN, 0
        kinds = 0
        finished_now = False
        for position, candidate in enumerate(candidates):
            if not isinstance(candidate, dict):
                kinds |= Kind.UNKNOWN
                continue
            index = candidate.get("index", position)
            if not isinstance(index, int):
                index = position
            self.seen.add(index)
            kinds |= _content(candidate.get("content"))
            if candidate.get("finishReason") not in _NOT_FINISHED:
                self.finished.add(index)
                finished_now = True
        if finished_now and self.finished >= self.seen:
            kinds |= Kind.TERMINAL_OK
        return kinds or _C, 0


def _content(content: Any) -> int:
    if content is None:
        return 0
    if not isinstance(content, dict):
        return Kind.UNKNOWN
    parts = content.get("parts")
    if parts is None:
        return 0
    if not isinstance(parts, list):
        return Kind.UNKNOWN
    kinds = 0
    for part in parts:
        kinds |= _part(part)
    return kinds


def _part(part: Any) -> int:
    if not isinstance(part, dict):
        return Kind.UNKNOWN
    for field, kind in PART_KINDS.items():
        if field not in part:
            continue
        value = part[field]
        if field == "text":
            if not isinstance(value, str):
                return Kind.UNKNOWN
            if not value:
                return 0
            return _R if part.get("thought") is True else _OUT
        if field == "functionCall" and not (
            isinstance(value, dict) and isinstance(value.get("name"), str)
        ):
            return Kind.UNKNOWN
        return kind
    if all(field in _SILENT_PART_FIELDS for field in part):
        return 0
    return Kind.UNKNOWN


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\r\n\r\n"


def error_frame(message: str) -> bytes:
    """The in-stream error that ends a truncated Gemini stream: Google's RPC error
    shape (503 ``UNAVAILABLE``, retryable by every Google client's rules), framed as
    the Gemini API frames its events.  No candidate carries a ``finishReason``, so a
    client that reads the stream (Gemini CLI) sees a turn without a finish, never a
    complete one."""
    return _frame({"error": {"code": 503, "message": message, "status": "UNAVAILABLE"}})


#: HTTP status -> google.rpc status name, for final answers re-sent in the stream
_RPC_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
}


def final_error_frame(status: int, body: bytes, request_id: str | None = None) -> bytes:
    """A final (non-retryable) HTTP answer re-sent in the stream after early headers:
    the provider's own ``error`` object when it sent one, with its code kept, so a
    client maps it to the same final status."""
    obj = loads_object(body)
    error = obj.get("error") if obj else None
    out: dict[str, Any] = dict(error) if isinstance(error, dict) else {}
    out.setdefault("code", status)
    out.setdefault("status", _RPC_STATUS.get(status, "INVALID_ARGUMENT"))
    message = out.get("message") if isinstance(out.get("message"), str) else None
    message = message or f"upstream HTTP {status}"
    out["message"] = f"{message} (request id {request_id})" if request_id else message
    return _frame({"error": out})


# -- error bodies -----------------------------------------------------------------------

#: protobuf Duration in JSON: seconds with up to 9 decimals, then ``s``
_DURATION = re.compile(r"(\d{1,12})(?:\.(\d{1,9}))?s")
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"


def _details(body: bytes) -> list[dict[str, Any]]:
    if not body or body.find(b"details") < 0:
        return []
    obj = loads_object(body)
    if obj is None:
        # Some gateways send a one-element array (the Gemini API's non-SSE stream form).
        try:
            arr = json.loads(body)
        except (ValueError, RecursionError):
            return []
        obj = arr[0] if isinstance(arr, list) and arr and isinstance(arr[0], dict) else None
        if obj is None:
            return []
    error = obj.get("error")
    details = error.get("details") if isinstance(error, dict) else None
    if not isinstance(details, list):
        return []
    return [d for d in details if isinstance(d, dict)]


def retry_delay(body: bytes) -> float | None:
    """Seconds from a ``google.rpc.RetryInfo`` ``retryDelay`` in an error body, or None."""
    for detail in _details(body):
        if detail.get("@type") != _RETRY_INFO:
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, str):
            m = _DURATION.fullmatch(delay.strip())
            if m is not None:
                frac = m.group(2) or ""
                return int(m.group(1)) + (int(frac) / 10 ** len(frac) if frac else 0.0)
        elif isinstance(delay, dict):  # the proto form, {"seconds": n, "nanos": n}
            seconds, nanos = delay.get("seconds", 0), delay.get("nanos", 0)
            if isinstance(seconds, str) and seconds.isdigit():
                seconds = int(seconds)
            if isinstance(seconds, int) and isinstance(nanos, int) and seconds >= 0 and nanos >= 0:
                return seconds + nanos / 1e9
    return None


def is_quota_wall(body: bytes) -> bool:
    """The 429 names a per-day quota (``QuotaFailure`` violation ``...PerDay...``): the
    quota is spent until tomorrow, not for the next ``retryDelay`` seconds."""
    for detail in _details(body):
        if detail.get("@type") != _QUOTA_FAILURE:
            continue
        violations = detail.get("violations")
        if not isinstance(violations, list):
            continue
        for v in violations:
            if isinstance(v, dict) and "perday" in str(v.get("quotaId", "")).lower():
                return True
    return False
