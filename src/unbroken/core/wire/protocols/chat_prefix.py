"""Chat Completions: finish a cut turn with a provider's documented prefix mode (sans-IO).

The Chat Completions API itself has no continuation; some providers document one,
an assistant message last with a flag (docs/gate.md lists the sources):

* ``prefix``: ``{"role": "assistant", "content": P, "prefix": true}`` (DeepSeek,
  beta endpoint ``https://api.deepseek.com/beta``): the answer continues after P;
* ``prefix_echo``: the same message, for a provider whose answer *starts with* P
  (Mistral's API reference: the prefix message forces "the model to start its
  answer by the content of the message"): the answer must begin with exactly P,
  which is dropped; an answer that does not breaks the join (`JoinError`);
* ``partial``: ``{"role": "assistant", "content": P, "partial": true}`` (Moonshot /
  Kimi; Alibaba Qwen on DashScope, non-thinking models).

A route opts in with ``chat_prefix = "prefix"`` or ``"partial"``; without it a Chat
turn cut after commit ends as today.  The rules are the Anthropic prefill's
(`anthropic_prefill`): only when everything the client has is text of choice 0 (no
``tool_calls``, no reasoning, no refusal, no ``finish_reason`` yet), the request is
streamed with one choice and does not ask for thinking; the committed text,
trailing whitespace trimmed, is the prefix (a client's own prefix message is
extended); the join follows `prefill.TextJoin`.

The `FrameSplicer` drops the continuation's role-only first chunk, keeps the client's
chunk ``id`` and ``created`` on every chunk, and passes ``finish_reason``, the
usage chunk and ``[DONE]`` through: the turn ends once.  Usage is the
continuation's own (the cut attempt's was never reported: Chat sends usage last):
its ``prompt_tokens`` count the prefix, its ``completion_tokens`` the continuation.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.protocols.prefill import (
    PrefillRefusal,
    TextJoin,
    released_events,
    split_trailing_ws,
)
from unbroken.core.wire.sse import Event

__all__ = [
    "ChatPrefix",
    "Committed",
    "FrameSplicer",
    "Plan",
    "plan_continuation",
    "read_committed",
    "request_refusal",
]


class ChatPrefix(enum.StrEnum):
    """``[routes.NAME] chat_prefix``: the provider's documented prefix flag."""

    PREFIX = "prefix"  # DeepSeek (beta): the answer continues after the prefix
    PREFIX_ECHO = "prefix_echo"  # Mistral: the answer starts with the prefix
    PARTIAL = "partial"  # Moonshot / Kimi, Qwen (DashScope)

    @property
    def flag(self) -> str:
        """The message field that marks the prefix."""
        return "partial" if self is ChatPrefix.PARTIAL else "prefix"


#: delta fields that carry reasoning (refused: it cannot be prefilled)
_REASONING = ("reasoning_content", "reasoning", "reasoning_details")
#: delta fields that carry nothing to continue when empty or null, and are not text
_QUIET = frozenset({"role"})


def request_refusal(request: Mapping[str, Any], mode: ChatPrefix) -> PrefillRefusal | None:
    """None when the request allows a prefix continuation, else why not."""
    if request.get("stream") is not True:
        return PrefillRefusal.NOT_STREAMED
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return PrefillRefusal.BAD_REQUEST
    n = request.get("n")
    if n is not None and n != 1:
        return PrefillRefusal.CHOICES
    thinking = request.get("thinking")
    if (
        request.get("enable_thinking") is True
        or request.get("reasoning_effort") not in (None, "none", "minimal")
        or (
            thinking is not None
            and not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
        )
    ):
        return PrefillRefusal.THINKING_ENABLED
    choice = request.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return PrefillRefusal.FORCED_TOOL  # a forced call: the answer is no text to continue
    last = messages[-1]
    if last.get("role") == "assistant":
        # Only the client's own prefix message of the same mode, with plain text, is
        # extended; an assistant message last without the flag is no prefix.
        if (
            mode is ChatPrefix.PREFIX_ECHO  # its answer repeats the client's prefix too
            or last.get(mode.flag) is not True
            or not isinstance(last.get("content"), str)
        ):
            return PrefillRefusal.CLIENT_PREFILL
    return None


@dataclass(frozen=True, slots=True)
class Committed:
    """What the client has of a cut Chat Completions stream."""

    text: str
    #: the client's chunk ``id`` and ``created`` (kept on the continuation's chunks)
    id: str | None
    created: int | None
    #: text chunks the client has (about a token each: what a redo samples again)
    deltas: int = 0


def read_committed(released: bytes) -> Committed | PrefillRefusal:
    """Read the client's stream back from the bytes released to it."""
    events = released_events(released)
    if isinstance(events, PrefillRefusal):
        return events
    parts: list[str] = []
    chunk_id: str | None = None
    created: int | None = None
    deltas = 0
    for event in events:
        if event.data is None:
            continue
        if event.data == "[DONE]":
            return PrefillRefusal.STOP_RELEASED
        obj = loads_object(event.data)
        if obj is None:
            return PrefillRefusal.MALFORMED
        if obj.get("error") is not None:
            return PrefillRefusal.OTHER_CONTENT
        if chunk_id is None and isinstance(obj.get("id"), str):
            chunk_id = obj["id"]
            c = obj.get("created")
            created = c if isinstance(c, int) and not isinstance(c, bool) else None
        choices = obj.get("choices")
        if choices is None or choices == []:
            if obj.get("usage") is not None:
                return PrefillRefusal.STOP_RELEASED  # the usage chunk comes after the finish
            continue
        if not isinstance(choices, list):
            return PrefillRefusal.MALFORMED
        for choice in choices:
            if not isinstance(choice, dict):
                return PrefillRefusal.MALFORMED
            if choice.get("index", 0) != 0:
                return PrefillRefusal.CHOICES
            if choice.get("finish_reason") is not None:
                return PrefillRefusal.STOP_RELEASED
            delta = choice.get("delta")
            if delta is None:
                continue
            if not isinstance(delta, dict):
                return PrefillRefusal.MALFORMED
            for key, value in delta.items():
                if value is None or value == "" or value == [] or key in _QUIET:
                    continue
                if key == "content":
                    if not isinstance(value, str):
                        return PrefillRefusal.OTHER_CONTENT
                    parts.append(value)
                    deltas += 1
                elif key in ("tool_calls", "function_call"):
                    return PrefillRefusal.TOOL_CALL
                elif key in _REASONING:
                    return PrefillRefusal.THINKING
                else:
                    return PrefillRefusal.OTHER_CONTENT  # refusal, audio, a field we do not know
    return Committed("".join(parts), chunk_id, created, deltas)


@dataclass(frozen=True, slots=True)
class Plan:
    body: dict[str, Any]
    committed: Committed
    shown_ws: str
    #: the committed part of the prefix message's content (without the client's own)
    prefill: str
    #: the prefix message's whole content
    full_prefix: str


def plan_continuation(
    request: Mapping[str, Any], committed: Committed, mode: ChatPrefix
) -> Plan | PrefillRefusal:
    """The continuation request for ``request`` after ``committed`` (or why not)."""
    refusal = request_refusal(request, mode)
    if refusal is not None:
        return refusal
    messages: list[Any] = list(request["messages"])
    last = messages[-1]
    kept, shown_ws = split_trailing_ws(committed.text)
    if not kept:
        shown_ws = committed.text
    body = dict(request)
    if last.get("role") == "assistant":
        base: str = last["content"]
        full = (base + committed.text).rstrip() or base
        messages[-1] = {**last, "content": full}
    else:
        full = kept
        if full:
            messages.append({"role": "assistant", "content": full, mode.flag: True})
    body["messages"] = messages
    return Plan(body, committed, shown_ws, kept, full)


def _chunk(payload: Mapping[str, Any]) -> Event:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return Event(f"data: {data}\n\n".encode(), None, data)


class FrameSplicer:
    """The continuation's chunks, as the client's stream goes on (`feed`, chunk by chunk)."""

    __slots__ = ("_join", "committed")

    def __init__(self, plan: Plan, mode: ChatPrefix) -> None:
        self.committed = plan.committed
        echo = plan.full_prefix if mode is ChatPrefix.PREFIX_ECHO else ""
        self._join = TextJoin(plan.shown_ws, echo=echo, tail=plan.full_prefix)

    def feed(self, event: Event) -> list[Event]:
        """The client's chunks for one of the continuation's; raises `JoinError` when
        the answer does not repeat the prefix it must (``prefix_echo``)."""
        return self._feed(event)

    def _feed(self, event: Event) -> list[Event]:
        data = event.data
        if data is None or data == "[DONE]":
            return [event]
        obj = loads_object(data)
        if obj is None or obj.get("error") is not None:
            return [event]  # the ledger judges it
        out = dict(obj)
        committed = self.committed
        if committed.id is not None and "id" in out:
            out["id"] = committed.id
        if committed.created is not None and "created" in out:
            out["created"] = committed.created
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return [_chunk(out)]  # the usage chunk
        new_choices: list[Any] = []
        for choice in choices:
            if not isinstance(choice, dict) or not isinstance(choice.get("delta"), dict):
                new_choices.append(choice)
                continue
            delta = dict(choice["delta"])
            delta.pop("role", None)  # the client has its role already
            content = delta.get("content")
            if isinstance(content, str):
                delta["content"] = self._join.text(content)
            if choice.get("finish_reason") is not None and not self._join.done:
                delta["content"] = delta.get("content", "") + self._join.flush()
            if not any(v not in (None, "", []) for v in delta.values()) and (
                choice.get("finish_reason") is None
                and choice.get("logprobs") is None
                and obj.get("usage") is None
            ):
                continue  # nothing left to send in this choice (role-only, held text)
            new_choices.append({**choice, "delta": delta})
        if not new_choices:
            return []
        out["choices"] = new_choices
        return [_chunk(out)]
