"""Deterministic wire formats of the provider protocols (Gemini's: `unbroken.mock.gemini`).

Every reply is described as a list of *events* ``(event_name | None, payload)``
where ``payload`` is a JSON-able dict (or the raw string ``"[DONE]"`` for Chat
Completions). :func:`events_for` returns that list (reusable by non-SSE
transports such as a Responses WebSocket); :func:`frames_for` returns the exact
SSE bytes. The byte path is optimised: the many small delta frames are rendered
from a pre-encoded template instead of one ``json.dumps`` per frame, and whole
replies are cached by request digest.

Ids and timestamps are derived only from the protocol, the reply-shape keys of
the action and the request JSON, so identical requests give byte-identical
replies, and a faulted reply is a byte-exact prefix of the clean one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from json.encoder import encode_basestring
from typing import Any, Final, TypeAlias

from unbroken.mock import gemini as _gemini
from unbroken.mock.actions import Action, parse_action

__all__ = [
    "ANTHROPIC",
    "CHAT",
    "CREATED",
    "GEMINI",
    "PROTOCOLS",
    "RESPONSES",
    "Event",
    "Reply",
    "encode_sse",
    "error_body",
    "error_frame",
    "events_for",
    "frames_for",
    "garbage_frame",
    "make_reply",
    "protocol_name_for_path",
    "render",
    "responses_events",
    "status_error_body",
    "ws_error",
    "ws_messages",
    "ws_messages_for",
    "ws_request",
]

CHAT: Final = "chat"
RESPONSES: Final = "responses"
ANTHROPIC: Final = "anthropic"
GEMINI: Final = _gemini.GEMINI
PROTOCOLS: Final[tuple[str, ...]] = (CHAT, RESPONSES, ANTHROPIC, GEMINI)

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

_PATH_SUFFIXES: Final = (
    ("/chat/completions", CHAT),
    ("/responses", RESPONSES),
    ("/messages", ANTHROPIC),
)


def protocol_name_for_path(path: str) -> str | None:
    """Map a request path to a protocol by suffix (``/x/v1/messages`` -> anthropic;
    ``/v1beta/models/<model>:streamGenerateContent`` -> gemini)."""
    path = path.rstrip("/")
    if _gemini.parse_path(path) is not None:
        return GEMINI
    for suffix, protocol in _PATH_SUFFIXES:
        if path.endswith("/v1" + suffix):
            return protocol
    return None


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


# ---------------------------------------------------------------------------
# Reply model


def split_exact(text: str, n: int) -> list[str]:
    """Split ``text`` into exactly ``n`` non-empty, near-equal pieces.

    If ``text`` is shorter than ``n`` it is first repeated (or, if empty, padded
    with spaces) until it is long enough, so there are always ``n`` pieces.
    """
    if n <= 0:
        return []
    if not text:
        text = " "
    if len(text) < n:
        text = text * -(-n // len(text))
    size = len(text)
    return [text[i * size // n : (i + 1) * size // n] for i in range(n)]


def _split_args(args: str, n: int) -> list[str]:
    return split_exact(args, max(1, min(n, len(args))))


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int
    name: str
    arguments: str
    pieces: tuple[str, ...]
    call_id: str
    item_id: str


def _first_tool_name(request: Mapping[str, Any]) -> str | None:
    tools = request.get("tools")
    if not isinstance(tools, list):
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        name = tool.get("name")
        if isinstance(name, str) and name:
            return name
        decls = tool.get("functionDeclarations")  # Gemini
        if isinstance(decls, list) and decls and isinstance(decls[0], dict):
            name = decls[0].get("name")
            if isinstance(name, str) and name:
                return name
        for sub in ("function", "custom"):
            inner = tool.get(sub)
            if isinstance(inner, dict):
                name = inner.get("name")
                if isinstance(name, str) and name:
                    return name
    return None


class Reply:
    """Everything needed to render one deterministic reply."""

    def __init__(
        self, protocol: str, action: Action, request: Mapping[str, Any], canonical: str
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
        self.protocol = protocol
        self.action = action
        self.request = request
        model = request.get("model")
        self.model: str = model if isinstance(model, str) and model else DEFAULT_MODEL
        self.stream: bool = request.get("stream") is True
        opts = request.get("stream_options")
        self.include_usage: bool = (
            protocol == CHAT and isinstance(opts, dict) and opts.get("include_usage") is True
        )
        seed = action.seed or ""
        h = hashlib.blake2b(digest_size=32)
        h.update(f"{protocol}\x00{action.shape_key}\x00{seed}\x00".encode())
        h.update(canonical.encode())
        self.digest: str = h.hexdigest()
        self.prompt_tokens: int = max(1, len(canonical) // 4)

    def ident(self, label: str, length: int) -> str:
        """A deterministic hex id of ``length`` chars for ``label``."""
        h = hashlib.blake2b(f"{self.digest}:{label}".encode(), digest_size=32).hexdigest()
        return (h + hashlib.blake2b(h.encode(), digest_size=32).hexdigest())[:length]

    @cached_property
    def pieces(self) -> tuple[str, ...]:
        if self.action.reply not in ("text", "text_tool"):
            return ()
        pieces = tuple(split_exact(self.action.text, self.action.deltas))
        prefix = prefill_of(self.protocol, self.request)
        if prefix is None:
            return pieces
        rest = continue_pieces(pieces, prefix)
        if self.action.prefix_echo and self.protocol == CHAT and rest is not pieces:
            return (prefix, *rest)  # Mistral's answer starts with the prefix
        return rest

    @cached_property
    def text(self) -> str:
        return "".join(self.pieces)

    @cached_property
    def calls(self) -> tuple[ToolCall, ...]:
        action = self.action
        n = {"tool": 1, "tools": 2, "text_tool": 1}.get(action.reply, 0)
        default_name = _first_tool_name(self.request) or DEFAULT_TOOL
        calls: list[ToolCall] = []
        for i in range(n):
            if action.tool_names:
                name = action.tool_names[min(i, len(action.tool_names) - 1)]
            else:
                name = default_name
            if action.tool_args:
                args_obj = action.tool_args[min(i, len(action.tool_args) - 1)]
            else:
                args_obj = DEFAULT_TOOL_ARGS[i]
            args = dumps(args_obj)
            if self.protocol == ANTHROPIC:
                call_id = "toolu_01" + self.ident(f"toolu{i}", 22)
            else:
                call_id = "call_" + self.ident(f"call{i}", 24)
            calls.append(
                ToolCall(
                    index=i,
                    name=name,
                    arguments=args,
                    pieces=tuple(_split_args(args, action.deltas)),
                    call_id=call_id,
                    item_id="fc_" + self.ident(f"fc{i}", 48),
                )
            )
        return tuple(calls)

    @cached_property
    def completion_tokens(self) -> int:
        """One token per content delta frame."""
        return max(1, len(self.pieces) + sum(len(c.pieces) for c in self.calls))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @cached_property
    def request_id(self) -> str:
        return "req_" + self.ident("request", 24)

    @cached_property
    def message_id(self) -> str:
        if self.protocol == CHAT:
            return "chatcmpl-" + self.ident("chat", 29)
        if self.protocol == RESPONSES:
            return "msg_" + self.ident("msg", 48)
        return "msg_01" + self.ident("msg", 22)

    @cached_property
    def response_id(self) -> str:
        return "resp_" + self.ident("resp", 48)


# ---------------------------------------------------------------------------
# Prefill continuation: a request that ends with an assistant prefix continues the
# scripted text from that prefix (Anthropic: an assistant message last; Chat: an
# assistant message last with ``prefix: true`` or ``partial: true``).


def prefill_of(protocol: str, request: Mapping[str, Any]) -> str | None:
    """The assistant prefix a request ends with, or None."""
    if protocol not in (ANTHROPIC, CHAT):
        return None
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    if protocol == CHAT and last.get("prefix") is not True and last.get("partial") is not True:
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    return None


def continue_pieces(pieces: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    """The pieces of the scripted text after ``prefix``, cut where the full reply's
    pieces are cut (the first one partly); the whole text when it does not start with
    ``prefix`` (a model that continues something else)."""
    if not "".join(pieces).startswith(prefix):
        return pieces
    out: list[str] = []
    skip = len(prefix)
    for piece in pieces:
        if skip >= len(piece):
            skip -= len(piece)
            continue
        out.append(piece[skip:])
        skip = 0
    return tuple(out)


def delta_offset(reply: Reply) -> int:
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


def cut_after(reply: Reply, action: Action, total: int) -> int:
    """The frames a faulted reply sends before its fault (``after_frame``, or
    ``after_deltas`` counted from the first delta), at most ``total``."""
    if action.after_deltas is not None:
        offset = delta_offset(reply) if reply.stream else 0
        return min(offset + action.after_deltas, total)
    return min(action.after_frame, total)


def make_reply(
    protocol: str, action: Mapping[str, Any] | Action | None, request: Mapping[str, Any]
) -> Reply:
    return Reply(protocol, parse_action(action), request, canonical_json(request))


# ---------------------------------------------------------------------------
# Chat Completions


def _chat_usage(r: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.total_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_items(r: Reply) -> list[_Item]:
    base = {
        "id": r.message_id,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": r.model,
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        payload = dict(base)
        payload["choices"] = [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ]
        if r.include_usage:
            payload["usage"] = None
        return payload

    items: list[_Item] = [(None, chunk({"role": "assistant", "content": ""}))]
    if r.pieces and r.calls:  # text_tool: the text, then the call
        items.append(_Run(None, chunk({"content": _VAL}), r.pieces))
    if r.calls:
        for call in r.calls:
            first = {
                "index": call.index,
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            items.append((None, chunk({"tool_calls": [first]})))
            frag = {"index": call.index, "function": {"arguments": _VAL}}
            items.append(_Run(None, chunk({"tool_calls": [frag]}), call.pieces))
        finish = "tool_calls"
    else:
        items.append(_Run(None, chunk({"content": _VAL}), r.pieces))
        finish = "stop"
    items.append((None, chunk({}, finish)))
    if r.include_usage:
        final = dict(base)
        final["choices"] = []
        final["usage"] = _chat_usage(r)
        items.append((None, final))
    items.append((None, "[DONE]"))
    return items


def _chat_body(r: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if r.calls and not r.pieces else r.text,
        "refusal": None,
        "annotations": [],
    }
    if r.calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in r.calls
        ]
    return {
        "id": r.message_id,
        "object": "chat.completion",
        "created": CREATED,
        "model": r.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if r.calls else "stop",
            }
        ],
        "usage": _chat_usage(r),
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


# ---------------------------------------------------------------------------
# Responses


def _responses_usage(r: Reply) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.total_tokens,
    }


def _response_object(
    r: Reply,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    req = r.request
    return {
        "id": r.response_id,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": req.get("background") is True,
        "completed_at": CREATED + 1 if status == "completed" else None,
        "error": error,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": r.model,
        "output": output,
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": req.get("reasoning") or {"effort": None, "summary": None},
        "store": req.get("store", True),
        "temperature": req.get("temperature", 1.0),
        "text": req.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": req.get("tools") or [],
        "top_p": req.get("top_p", 1.0),
        "truncation": req.get("truncation", "disabled"),
        "usage": usage,
        "user": req.get("user"),
        "metadata": req.get("metadata") or {},
    }


def _responses_items(r: Reply) -> list[_Item]:
    items: list[_Item] = []
    seq = 0

    def ev(name: str, **fields: Any) -> None:
        nonlocal seq
        items.append((name, {"type": name, "sequence_number": seq, **fields}))
        seq += 1

    def run(name: str, values: tuple[str, ...], **fields: Any) -> None:
        nonlocal seq
        template = {"type": name, "sequence_number": _SEQ, **fields}
        items.append(_Run(name, template, values, seq))
        seq += len(values)

    started = _response_object(r, "in_progress", [], None)
    if r.request.get("background") is True:
        # Background mode (`mock.background`): created and announced queued first.
        queued = _response_object(r, "queued", [], None)
        ev("response.created", response=queued)
        ev("response.queued", response=queued)
    else:
        ev("response.created", response=started)
    ev("response.in_progress", response=started)
    output: list[dict[str, Any]] = []
    if r.calls:
        for call in r.calls:
            i = call.index
            added = {
                "id": call.item_id,
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": call.call_id,
                "name": call.name,
            }
            ev("response.output_item.added", output_index=i, item=added)
            run(
                "response.function_call_arguments.delta",
                call.pieces,
                item_id=call.item_id,
                output_index=i,
                delta=_VAL,
            )
            ev(
                "response.function_call_arguments.done",
                item_id=call.item_id,
                output_index=i,
                arguments=call.arguments,
            )
            done = {**added, "status": "completed", "arguments": call.arguments}
            ev("response.output_item.done", output_index=i, item=done)
            output.append(done)
    else:
        mid = r.message_id
        ev(
            "response.output_item.added",
            output_index=0,
            item={
                "id": mid,
                "type": "message",
                "status": "in_progress",
                "content": [],
                "role": "assistant",
            },
        )
        empty_part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        ev(
            "response.content_part.added",
            item_id=mid,
            output_index=0,
            content_index=0,
            part=empty_part,
        )
        run(
            "response.output_text.delta",
            r.pieces,
            item_id=mid,
            output_index=0,
            content_index=0,
            delta=_VAL,
            logprobs=[],
        )
        ev(
            "response.output_text.done",
            item_id=mid,
            output_index=0,
            content_index=0,
            text=r.text,
            logprobs=[],
        )
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": r.text}
        ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        item = {
            "id": mid,
            "type": "message",
            "status": "completed",
            "content": [part],
            "role": "assistant",
        }
        ev("response.output_item.done", output_index=0, item=item)
        output.append(item)
    ev("response.completed", response=_response_object(r, "completed", output, _responses_usage(r)))
    return items


def _responses_body(r: Reply) -> dict[str, Any]:
    completed = _responses_items(r)[-1]
    assert isinstance(completed, tuple)
    body: dict[str, Any] = completed[1]["response"]
    return body


# ---------------------------------------------------------------------------
# Anthropic Messages


def _anthropic_start_usage(r: Reply, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _anthropic_items(r: Reply) -> list[_Item]:
    message: dict[str, Any] = {
        "id": r.message_id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _anthropic_start_usage(r, 1),
    }
    items: list[_Item] = [("message_start", {"type": "message_start", "message": message})]
    blocks: list[tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = []
    if r.pieces or not r.calls:  # text (text_tool: the text, then the call)
        blocks.append(
            ({"type": "text", "text": ""}, {"type": "text_delta", "text": _VAL}, r.pieces)
        )
    for call in r.calls:
        block = {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}
        blocks.append((block, {"type": "input_json_delta", "partial_json": _VAL}, call.pieces))
    stop_reason = "tool_use" if r.calls else "end_turn"
    for index, (block, delta, values) in enumerate(blocks):
        items.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        if index == 0:
            items.append(("ping", {"type": "ping"}))
        items.append(
            _Run(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
                values,
            )
        )
        items.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    items.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": r.completion_tokens},
            },
        )
    )
    items.append(("message_stop", {"type": "message_stop"}))
    return items


def _anthropic_body(r: Reply) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if r.pieces or not r.calls:
        content.append({"type": "text", "text": r.text})
    content += [
        {"type": "tool_use", "id": c.call_id, "name": c.name, "input": json.loads(c.arguments)}
        for c in r.calls
    ]
    return {
        "id": r.message_id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": content,
        "stop_reason": "tool_use" if r.calls else "end_turn",
        "stop_sequence": None,
        "usage": _anthropic_start_usage(r, r.completion_tokens),
    }


# ---------------------------------------------------------------------------
# Errors


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


def error_frame(reply: Reply, error: str, sequence_number: int, style: str = "failed") -> bytes:
    """The protocol-native in-stream error frame for ``error`` (an ERROR_KINDS name)."""
    kind = _ERRORS[error]
    if reply.protocol == GEMINI:
        _status, payload = _gemini.error_body(error)
        return _gemini.to_crlf(encode_sse(None, payload.decode()))
    if reply.protocol == CHAT:
        return encode_sse(None, {"error": _openai_error(kind)})
    if reply.protocol == ANTHROPIC:
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


def error_body(protocol: str, error: str) -> tuple[int, bytes]:
    """HTTP status and JSON body of the non-streamed form of an error kind."""
    kind = _ERRORS[error]
    if protocol == GEMINI:
        return _gemini.error_body(error)
    if protocol == ANTHROPIC:
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
    if protocol == GEMINI:
        return _gemini.status_error_body(status)
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
    if protocol == ANTHROPIC:
        message = _ANTHROPIC_MESSAGES.get(an_type, message)
        return dumps({"type": "error", "error": {"type": an_type, "message": message}}).encode()
    return dumps(
        {"error": {"message": message, "type": oa_type, "param": None, "code": code}}
    ).encode()


_GARBAGE: Final[dict[str, bytes]] = {
    CHAT: b'data: {"choices": [{"delta": {"content": "x"\n\n',
    RESPONSES: b"event: response.output_text.delta\n"
    b'data: {"type": "response.output_text.delta", "delta": "x"\n\n',
    ANTHROPIC: b"event: content_block_delta\n"
    b'data: {"type": "content_block_delta", "index": 0, '
    b'"delta": {"type": "text_delta", "text": "x"\n\n',
    GEMINI: _gemini.garbage(),
}
#: Inserted into a non-streamed body; NUL bytes make any JSON invalid.
BODY_GARBAGE: Final = b"\x00<malformed>\x00"


def garbage_frame(protocol: str, stream: bool = True) -> bytes:
    """The malformed frame injected by the ``malformed`` fault."""
    return _GARBAGE[protocol] if stream else BODY_GARBAGE


# ---------------------------------------------------------------------------
# Public rendering API

_ITEMS: dict[str, Callable[[Reply], list[_Item]]] = {
    CHAT: _chat_items,
    RESPONSES: _responses_items,
    ANTHROPIC: _anthropic_items,
    GEMINI: functools.partial(_gemini.items, run=_Run, val=_VAL),
}
_BODIES = {
    CHAT: _chat_body,
    RESPONSES: _responses_body,
    ANTHROPIC: _anthropic_body,
    GEMINI: _gemini.body,
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


def _render_reply(reply: Reply) -> Rendered:
    if reply.stream:
        frames = tuple(_encode_items(_ITEMS[reply.protocol](reply)))
        if reply.protocol == GEMINI:
            frames = tuple(_gemini.to_crlf(f) for f in frames)
        body = b"".join(frames)
    else:
        body = dumps(_BODIES[reply.protocol](reply)).encode()
        frames = halves(body)
    chunked = tuple(b"%x\r\n%s\r\n" % (len(f), f) for f in frames)
    return Rendered(frames, body, reply.stream, reply.request_id, chunked)


_CACHE_MAX: Final = 256
_cache: dict[str, Rendered] = {}


def render(reply: Reply) -> Rendered:
    """Render ``reply`` (cached by digest; identical requests share the bytes)."""
    key = reply.digest + ("s" if reply.stream else "n")
    hit = _cache.get(key)
    if hit is not None:
        return hit
    rendered = _render_reply(reply)
    if len(_cache) >= _CACHE_MAX:
        del _cache[next(iter(_cache))]
    _cache[key] = rendered
    return rendered


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")


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
    return list(render(make_reply(protocol, action, request_json)).frames)


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
    return events_for(RESPONSES, action, request_json)


# ---------------------------------------------------------------------------
# Responses WebSocket mode
#
# A ``response.create`` message is answered with the events of the streamed HTTP
# reply, one TEXT message per event holding exactly the JSON of the SSE ``data:``
# line. The reply is rendered for the request ``ws_request(message)``: the message
# without ``"type"``, with ``"stream": true`` (streaming is implicit on a socket).
# So a socket reply and the SSE reply to ``POST /v1/responses`` with that body
# carry the same ids and byte-identical payloads.

_WS_CACHE_MAX: Final = 256
_ws_cache: dict[str, tuple[bytes, ...]] = {}


def ws_request(message: Mapping[str, Any]) -> dict[str, Any]:
    """The HTTP request JSON a ``response.create`` message is rendered as."""
    request = {k: v for k, v in message.items() if k != "type"}
    request["stream"] = True
    return request


def _sse_data(frame: bytes) -> bytes:
    start = frame.index(b"data: ") + 6
    return frame[start:-2] if frame.endswith(b"\n\n") else frame[start:]


def ws_messages(reply: Reply) -> tuple[bytes, ...]:
    """The WebSocket TEXT messages (UTF-8 JSON) of a streamed Responses ``reply``.

    Each is the ``data:`` payload of the matching SSE frame of :func:`render`.
    """
    if reply.protocol != RESPONSES or not reply.stream:
        raise ValueError("ws_messages needs a streamed Responses reply")
    hit = _ws_cache.get(reply.digest)
    if hit is not None:
        return hit
    messages = tuple(_sse_data(f) for f in render(reply).frames)
    if len(_ws_cache) >= _WS_CACHE_MAX:
        del _ws_cache[next(iter(_ws_cache))]
    _ws_cache[reply.digest] = messages
    return messages


def ws_messages_for(
    action: Mapping[str, Any] | Action | None, message: Mapping[str, Any]
) -> list[bytes]:
    """Exact TEXT messages of the clean socket reply to a ``response.create`` message.

    ``message`` may include ``"type"`` (it is dropped); fault keys are ignored.
    """
    return list(ws_messages(make_reply(RESPONSES, action, ws_request(message))))


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
    error = json.loads(status_error_body(RESPONSES, status))["error"]
    return ws_error(status, error["type"], error["code"], error["message"])


def ws_failed_event(reply: Reply, error: str, sequence_number: int) -> bytes:
    """The ``response.failed`` payload (as in SSE ``error_style: failed``)."""
    return _sse_data(error_frame(reply, error, sequence_number, "failed"))


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
    if protocol == ANTHROPIC:
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
