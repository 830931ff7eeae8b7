"""The reply model: everything one deterministic reply is rendered from (its text
pieces, tool calls, ids and token counts), and the prefill continuation's prefix."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from unbroken.core.wire.protocols.anthropic_continue import ANCHOR_TAG
from unbroken.mock.actions import Action, parse_action
from unbroken.mock.wire.frames import (
    ANTHROPIC_NAME,
    CHAT_NAME,
    DEFAULT_MODEL,
    DEFAULT_TOOL,
    DEFAULT_TOOL_ARGS,
    PROTOCOL_NAMES,
    RESPONSES_NAME,
    dumps,
)


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


@dataclass(frozen=True, slots=True)
class ReplyKey:
    """A reply as a memo's key: replies with one ``digest`` and ``stream`` flag render
    to the same bytes, so only those two are compared and hashed (``reply`` rides
    along for the memo's miss)."""

    digest: str
    stream: bool
    reply: MockReply = field(compare=False, repr=False)

    @classmethod
    def of(cls, reply: MockReply) -> ReplyKey:
        return cls(reply.digest, reply.stream, reply)


class MockReply:
    """Everything needed to render one deterministic reply."""

    def __init__(
        self, protocol: str, action: Action, request: Mapping[str, Any], canonical: str
    ) -> None:
        if protocol not in PROTOCOL_NAMES:
            raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOL_NAMES}")
        self.protocol = protocol
        self.action = action
        self.request = request
        model = request.get("model")
        self.model: str = model if isinstance(model, str) and model else DEFAULT_MODEL
        self.stream: bool = request.get("stream") is True
        opts = request.get("stream_options")
        self.include_usage: bool = (
            protocol == CHAT_NAME and isinstance(opts, dict) and opts.get("include_usage") is True
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
        asked = asked_to_continue(self.protocol, self.request)
        prefix = prefill_of(self.protocol, self.request) if asked is None else asked[0]
        if prefix is None:
            return pieces
        rest = continue_pieces(pieces, prefix)
        if rest is pieces:
            return pieces  # a text that does not start with the prefix: the whole of it
        first: tuple[str, ...] = ()
        if self.action.preamble:
            first = (self.action.preamble,)  # a model that comments first
        if asked is not None:
            first += (asked[1],)  # it does as it is asked: the quoted end first
        if self.action.prefix_echo:
            return (*first, prefix, *rest)  # Mistral's answer starts with the prefix
        if self.action.echo_tail and prefix:
            return (*first, prefix[-self.action.echo_tail :], *rest)  # the end of it, again
        return (*first, *rest)

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
            if self.protocol == ANTHROPIC_NAME:
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
        if self.protocol == CHAT_NAME:
            return "chatcmpl-" + self.ident("chat", 29)
        if self.protocol == RESPONSES_NAME:
            return "msg_" + self.ident("msg", 48)
        return "msg_01" + self.ident("msg", 22)

    @cached_property
    def response_id(self) -> str:
        return self.action.response_id or "resp_" + self.ident("resp", 48)


# ---------------------------------------------------------------------------
# Prefill continuation: a request that ends with an assistant prefix continues the
# scripted text from that prefix (Anthropic: an assistant message last; Chat: an
# assistant message last with ``prefix: true`` or ``partial: true``).


def prefill_of(protocol: str, request: Mapping[str, Any]) -> str | None:
    """The assistant prefix a request ends with, or None."""
    if protocol not in (ANTHROPIC_NAME, CHAT_NAME):
        return None
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    if protocol == CHAT_NAME and last.get("prefix") is not True and last.get("partial") is not True:
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    return None


def asked_to_continue(protocol: str, request: Mapping[str, Any]) -> tuple[str, str] | None:
    """Anthropic's user-message continuation (for models that refuse prefill): the
    last message is a user message that quotes the end of the assistant message
    before it between ``<interrupted_response_end>`` lines (the relay's, see
    `unbroken.core.wire.protocols.anthropic_continue`): ``(that assistant text, the quoted
    end)``, else None."""
    if protocol != ANTHROPIC_NAME:
        return None
    messages = request.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    last, before = messages[-1], messages[-2]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    if not isinstance(before, dict) or before.get("role") != "assistant":
        return None
    text = before.get("content")
    asked = last.get("content")
    if not isinstance(text, str) or not isinstance(asked, str):
        return None
    opening, closing = f"<{ANCHOR_TAG}>\n", f"\n</{ANCHOR_TAG}>"
    start = asked.find(opening)
    end = asked.find(closing, start + len(opening))
    if start < 0 or end < 0:
        return None
    return text, asked[start + len(opening) : end]


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


def make_reply(
    protocol: str, action: Mapping[str, Any] | Action | None, request: Mapping[str, Any]
) -> MockReply:
    return MockReply(protocol, parse_action(action), request, canonical_json(request))
