"""Which continuation a turn gets (`core.turn.continuation_choice`), with plain values:
each protocol's strategy, each refusal, and none with the setting off."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.core.turn.background import BackgroundResume
from unbroken.core.turn.continuation import AfterCommit, ContinuationMemory, Refusal
from unbroken.core.turn.continuation_choice import continuation_for, continuation_over_socket
from unbroken.core.turn.prefill_continue import PrefillContinue
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, GEMINI, GENERIC, RESPONSES, Protocol
from unbroken.core.wire.protocols.prefill import PrefillRefusal

KEYS = ("r|a", "r|b")
MESSAGES: dict[str, Any] = {
    "model": "m",
    "stream": True,
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "q"}],
}
RESPONSE: dict[str, Any] = {"model": "m", "stream": True, "input": "q"}


def choose(
    protocol: Protocol,
    parsed: dict[str, Any] | None,
    *,
    after_commit: str = AfterCommit.CONTINUE,
    streamed: bool = True,
    content_encoding: str | None = None,
    chat_prefix: str | None = None,
    anthropic_continue: str | None = None,
    memory: ContinuationMemory | None = None,
) -> object:
    return continuation_for(
        after_commit,
        protocol,
        "v1/x",
        parsed,
        streamed=streamed,
        content_encoding=content_encoding,
        chat_prefix=chat_prefix,
        anthropic_continue=anthropic_continue,
        keys=KEYS,
        memory=memory or ContinuationMemory(),
        max_splices=7,
    )


@pytest.mark.parametrize("protocol", [ANTHROPIC, CHAT, RESPONSES, GEMINI, GENERIC])
def test_none_with_the_setting_off_or_a_turn_that_is_not_streamed(protocol: Protocol) -> None:
    body = RESPONSE if protocol is RESPONSES else MESSAGES
    assert choose(protocol, body, after_commit=AfterCommit.ERROR, chat_prefix="prefix") is None
    assert choose(protocol, body, after_commit="error", chat_prefix="prefix") is None
    assert choose(protocol, body, streamed=False, chat_prefix="prefix") is None


def test_anthropic_gets_a_prefill_in_the_routes_mode() -> None:
    memory = ContinuationMemory()
    strategy = choose(ANTHROPIC, MESSAGES, memory=memory)
    assert isinstance(strategy, PrefillContinue)
    assert strategy.name == "anthropic_prefill"
    assert strategy.path == "v1/x" and strategy.request is MESSAGES
    assert strategy.max_splices == 7
    asks = choose(ANTHROPIC, MESSAGES, anthropic_continue="user_message")
    assert isinstance(asks, PrefillContinue) and asks.name == "anthropic_user_message"


def test_a_prefill_is_refused_for_a_request_it_cannot_continue() -> None:
    assert choose(ANTHROPIC, None) is PrefillRefusal.BAD_REQUEST
    thinking = {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert choose(ANTHROPIC, thinking) is PrefillRefusal.THINKING_ENABLED
    assert choose(ANTHROPIC, {**MESSAGES, "messages": []}) is PrefillRefusal.BAD_REQUEST
    forced = {**MESSAGES, "tool_choice": "required"}
    assert choose(CHAT, forced, chat_prefix="prefix") is PrefillRefusal.FORCED_TOOL
    assert choose(CHAT, None, chat_prefix="prefix") is PrefillRefusal.BAD_REQUEST


def test_chat_needs_the_routes_prefix_mechanism() -> None:
    assert choose(CHAT, MESSAGES) is PrefillRefusal.NO_OPTION
    assert choose(CHAT, None) is PrefillRefusal.NO_OPTION
    for mode in ("prefix", "prefix_echo", "partial"):
        strategy = choose(CHAT, MESSAGES, chat_prefix=mode)
        assert isinstance(strategy, PrefillContinue) and strategy.name == f"chat_{mode}"


def test_responses_gets_background_mode_for_a_plain_streamed_request() -> None:
    strategy = choose(RESPONSES, RESPONSE)
    assert isinstance(strategy, BackgroundResume)
    assert strategy.path == "v1/x" and strategy.max_splices == 7
    # A gzip body: the relay forwards the bytes it got, and cannot patch them.
    assert choose(RESPONSES, RESPONSE, content_encoding="gzip") is Refusal.UNSUPPORTED
    assert choose(RESPONSES, None) is PrefillRefusal.BAD_REQUEST
    asked = {**RESPONSE, "background": True}  # background mode asked by the client itself
    assert choose(RESPONSES, asked) is Refusal.UNSUPPORTED
    assert choose(RESPONSES, {**RESPONSE, "stream": False}) is Refusal.UNSUPPORTED


@pytest.mark.parametrize("protocol", [GEMINI, GENERIC])
def test_a_protocol_with_no_mechanism_is_unsupported(protocol: Protocol) -> None:
    assert choose(protocol, MESSAGES) is Refusal.UNSUPPORTED
    assert choose(protocol, MESSAGES, chat_prefix="prefix") is Refusal.UNSUPPORTED


def test_a_socket_turn_gets_background_mode_whenever_the_setting_is_on() -> None:
    memory = ContinuationMemory()
    strategy = continuation_over_socket(
        AfterCommit.CONTINUE, "v1/responses", keys=KEYS, memory=memory, max_splices=3
    )
    assert isinstance(strategy, BackgroundResume)
    assert strategy.path == "v1/responses" and strategy.max_splices == 3
    off = continuation_over_socket("error", "v1/responses", keys=KEYS, memory=memory, max_splices=3)
    assert off is None
