"""OpenAI Responses stream classifier (``/v1/responses``, SSE and WebSocket).

The event name decides almost every frame (``EVENTS``).  Only output items
(``response.output_item.added`` / ``.done``) and errors are parsed, to learn
the item type or the error code.

Tool items are split by who executes them.  Items the *client* dispatches are
held from ``output_item.added`` to ``output_item.done`` (the dispatch gate).
Items the server runs (web search, file search, code interpreter, ...) are
treated as output: they commit, which is the conservative side.
"""

from __future__ import annotations

import json
import re
from typing import Any

from unbroken.core.wire.protocols.base import (
    Kind,
    error_is_retryable,
    loads_object,
    looks_like_object,
    named_run,
)
from unbroken.core.wire.sse import Event

_C, _OUT, _R = Kind.CONTROL, Kind.OUTPUT, Kind.REASONING
TD = Kind.TOOL_DELTA

# event name -> kind.  Names not here (and not parsed below) are UNKNOWN.
EVENTS: dict[str, int] = {
    "response.created": _C,
    "response.queued": _C,
    "response.in_progress": _C,
    "response.content_part.added": _C,
    "response.reasoning_summary_part.added": _C,  # an empty summary part opens
    "response.output_text.delta": _OUT,
    "response.output_text.done": _OUT,
    "response.output_text.annotation.added": _OUT,
    "response.content_part.done": _OUT,
    "response.refusal.delta": _OUT,
    "response.refusal.done": _OUT,
    "response.reasoning_summary_text.delta": _R,
    "response.reasoning_summary_text.done": _R,
    "response.reasoning_summary_part.done": _R,
    "response.reasoning_text.delta": _R,
    "response.reasoning_text.done": _R,
    "response.function_call_arguments.delta": TD,
    "response.function_call_arguments.done": TD,
    "response.custom_tool_call_input.delta": TD,
    "response.custom_tool_call_input.done": TD,
    "response.completed": Kind.TERMINAL_OK,
    "response.incomplete": Kind.TERMINAL_ERROR,  # max tokens / content filter: final
}

#: the ``event:`` lines of events released as they are once a turn has committed with
#: no tool open (they open, close or end nothing): the fast path may pass them on
PLAIN_EVENT_LINES = frozenset(
    b"event: " + name.encode()
    for name, kind in EVENTS.items()
    if kind in (_C, _OUT, _R) and name != "response.created"
)

# Output item types the client executes: held until their output_item.done.
CLIENT_TOOL_ITEMS = frozenset(
    {
        "function_call",
        "custom_tool_call",
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
        "computer_call",
        "mcp_approval_request",
    }
)

_SEQ = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


class ResponsesClassifier:
    __slots__ = ("open_items", "snapshot")

    def __init__(self) -> None:
        self.open_items: set[str] = set()
        #: the ``response`` object of ``response.created``, reused by a failure event
        self.snapshot: dict[str, Any] | None = None

    def classify(self, event: Event) -> tuple[int, int]:
        name = event.name
        if name is None:
            if event.data is None:
                return _C, len(self.open_items)  # comment keepalive
            name = _type_of(event.data)  # WebSocket messages / nameless SSE events
            if name is None:
                return Kind.MALFORMED, len(self.open_items)
        kind = EVENTS.get(name)
        if kind is not None:
            if not looks_like_object(event.data):
                return Kind.MALFORMED, len(self.open_items)
            if name == "response.created":
                self._remember(event.data)
            return kind, len(self.open_items)
        if name == "response.output_item.added":
            return self._item(event.data, added=True)
        if name == "response.output_item.done":
            return self._item(event.data, added=False)
        if name in ("response.failed", "error"):
            return self._error(event.data), len(self.open_items)
        return Kind.UNKNOWN, len(self.open_items)

    def plain_prefix(self, chunk: bytes, start: int = 0) -> tuple[int, int]:
        """``(frames, end)``: the frames of ``chunk[start:end]``, each provably released
        as it is; ``(0, start)`` when the first is not.

        Each frame must be ``event: <a plain event>`` + one ``data: {…}`` line: the
        same shape check `classify` makes for those names (stricter: the ``}`` must
        end the line), without building events.
        """
        return named_run(chunk, start, PLAIN_EVENT_LINES)

    def _remember(self, data: str | None) -> None:
        obj = loads_object(data)
        if obj is None:
            return
        resp = obj.get("response")
        if isinstance(resp, dict):
            self.snapshot = resp

    def _item(self, data: str | None, *, added: bool) -> tuple[int, int]:
        obj = loads_object(data)
        if obj is None:
            return Kind.MALFORMED, len(self.open_items)
        item = obj.get("item")
        if not isinstance(item, dict):
            return Kind.UNKNOWN, len(self.open_items)
        itype = item.get("type")
        if not isinstance(itype, str):  # a list or object here is no type we know
            return Kind.UNKNOWN, len(self.open_items)
        key = str(item.get("id") or obj.get("output_index"))
        if itype in CLIENT_TOOL_ITEMS:
            if added:
                self.open_items.add(key)
                return Kind.TOOL_START, len(self.open_items)
            if key in self.open_items:
                self.open_items.discard(key)
                return Kind.TOOL_END, len(self.open_items)
            return Kind.UNKNOWN, len(self.open_items)  # done without added
        if itype == "reasoning":
            # Its .done repeats the reasoning: thinking, if it carries any text.
            return (_R if not added and _has_reasoning(item) else _C), len(self.open_items)
        if itype == "message":
            return (_C if added else _OUT), len(self.open_items)
        return _OUT, len(self.open_items)  # server-side tool items and others: commit

    @staticmethod
    def _error(data: str | None) -> int:
        obj = loads_object(data)
        if obj is None:
            return Kind.TERMINAL_ERROR | Kind.MALFORMED
        err: Any = obj.get("error")
        resp = obj.get("response")
        if err is None and isinstance(resp, dict):
            err = resp.get("error")
        if err is None:  # the WebSocket `error` event may carry code/message at top level
            err = obj
        if isinstance(err, dict) and isinstance(err.get("error"), dict):
            err = err["error"]
        kinds = Kind.TERMINAL_ERROR
        if error_is_retryable(err):
            kinds |= Kind.RETRYABLE
        return kinds


def _has_reasoning(item: dict[str, Any]) -> bool:
    """Whether a reasoning item carries summary or content text."""
    for key in ("summary", "content"):
        parts = item.get(key)
        if isinstance(parts, list) and any(isinstance(p, dict) and p.get("text") for p in parts):
            return True
    return False


_TYPE_RE = re.compile(r'"type"\s*:\s*"([^"]+)"')


def _type_of(data: str) -> str | None:
    """The ``type`` of a nameless event (WebSocket messages carry it in the JSON)."""
    if data.startswith('{"type":"'):  # how OpenAI serialises every event: type first
        end = data.find('"', 9)
        if end > 9 and "\\" not in data[9:end]:
            return data[9:end]
    m = _TYPE_RE.search(data, 0, 200)
    if m is not None and data.lstrip().startswith("{"):
        # The first "type" key of an event object is the event's type: Responses
        # events always put it first.  Fall back to a parse when unsure.
        if data[: m.start()].count("{") == 1:
            return m.group(1)
    obj = loads_object(data)
    if obj is None:
        return None
    t = obj.get("type")
    return t if isinstance(t, str) else ""


#: lifecycle events: they carry the whole ``response`` object, with its id
LIFECYCLE_TYPES = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.completed",
        "response.failed",
        "response.incomplete",
        "response.cancelled",
    }
)


def lifecycle_of(data: str) -> tuple[str, str] | None:
    """(type, response id) of a lifecycle event, or None for any other event."""
    etype = _type_of(data)
    if etype not in LIFECYCLE_TYPES:
        return None
    obj = loads_object(data)
    response = obj.get("response") if obj is not None else None
    rid = response.get("id") if isinstance(response, dict) else None
    return (etype, rid) if isinstance(rid, str) else None


def error_code_of(data: str) -> str | None:
    """The ``code`` of an ``error`` event (top level, or in its ``error`` object)."""
    if _type_of(data) != "error":
        return None
    obj = loads_object(data)
    if obj is None:
        return None
    err = obj.get("error")
    code = (err.get("code") if isinstance(err, dict) else None) or obj.get("code")
    return code if isinstance(code, str) else None


def next_sequence_number(last_raw: bytes | None) -> int | None:
    """One past the sequence_number of the last frame, if it carried one."""
    if not last_raw:
        return None
    found = _SEQ.findall(last_raw)
    return int(found[-1]) + 1 if found else None


def error_frame(
    message: str,
    *,
    snapshot: dict[str, Any] | None = None,
    sequence_number: int | None = None,
    now: float,
) -> bytes:
    """The events that end a truncated Responses turn: ``error`` then ``response.failed``.

    The ``error`` event is a hybrid: flat ``code``/``message`` (what the Vercel
    AI SDK's schema requires) and a nested ``error`` (what makes the openai SDK
    raise).  ``response.failed`` reuses the upstream ``response.created``
    snapshot, because the openai SDK's stream helper rejects a changed id.
    See docs/protocols.md, section 6.  ``now`` (Unix time, passed in: the core reads
    no clock) dates a failed response that has no snapshot.
    """
    seq = 0 if sequence_number is None else sequence_number
    nested = {"type": "server_error", "code": "server_error", "message": message, "param": None}
    error_event = {
        "type": "error",
        "sequence_number": seq,
        "code": "upstream_unavailable",
        "message": message,
        "param": None,
        "error": nested,
    }
    response: dict[str, Any] = dict(snapshot or {})
    response.setdefault("id", f"resp_unbroken_{int(now * 1000)}")
    response.setdefault("object", "response")
    response.setdefault("created_at", int(now))
    response.update(
        status="failed",
        output=[],
        error={"code": "server_error", "message": message},
        incomplete_details=None,
    )
    failed = {"type": "response.failed", "sequence_number": seq + 1, "response": response}
    return (
        b"event: error\ndata: " + _dumps(error_event) + b"\n\n"
        b"event: response.failed\ndata: " + _dumps(failed) + b"\n\n"
    )


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
