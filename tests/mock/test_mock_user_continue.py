"""The mock's model that refuses prefill (Claude 4.6 and later) and answers the
user-message continuation, over real sockets."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import pytest

from mock.test_mock_prefill import TEXT, texts
from unbroken.core.wire.protocols.anthropic_continue import continue_instruction
from unbroken.mock import MockProvider
from unbroken.mock.actions import ActionError, parse_action

USER = {"role": "user", "content": "q"}


async def _post(
    session: aiohttp.ClientSession, mock: MockProvider, messages: Sequence[object]
) -> tuple[int, bytes]:
    body = {"model": "m", "stream": True, "max_tokens": 64, "messages": messages}
    async with session.post(mock.url + "/v1/messages", json=body) as resp:
        return resp.status, await resp.read()


async def test_refuse_prefill_answers_a_prefill_with_anthropics_400(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.set_default({"text": TEXT, "deltas": 6, "refuse_prefill": True})
    status, body = await _post(session, mock, [USER, {"role": "assistant", "content": "Hello"}])
    assert status == 400
    assert b"does not support assistant message prefill" in body
    assert b'"invalid_request_error"' in body
    status, body = await _post(session, mock, [USER])  # no prefill: answered
    assert status == 200 and "".join(texts("anthropic", body)) == TEXT


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, ["there,", " g", "ener", "al Ke", "nobi."]),
        ({"preamble": "Sure: "}, ["Sure: ", "there,", " g", "ener", "al Ke", "nobi."]),
        ({"echo_tail": 3}, ["there,", "re,", " g", "ener", "al Ke", "nobi."]),
    ],
)
async def test_a_user_message_quoting_the_end_is_answered_from_there(
    mock: MockProvider,
    session: aiohttp.ClientSession,
    extra: dict[str, object],
    expected: list[str],
) -> None:
    """The quoted end first (as asked), then the rest of the scripted text after the
    interrupted turn, cut where the full reply's deltas are cut; a ``preamble`` or an
    ``echo_tail`` misbehave as scripted."""
    mock.set_default({"text": TEXT, "deltas": 6, "refuse_prefill": True, **extra})
    messages = [
        USER,
        {"role": "assistant", "content": "Hello there,"},
        {"role": "user", "content": continue_instruction("there,")},
    ]
    status, body = await _post(session, mock, messages)
    assert status == 200
    assert texts("anthropic", body) == expected


def test_the_action_keys_are_checked() -> None:
    assert parse_action({"refuse_prefill": True}).refuse_prefill is True
    assert parse_action({"preamble": "x"}).preamble == "x"
    with pytest.raises(ActionError, match="refuse_prefill"):
        parse_action({"refuse_prefill": "yes"})
    with pytest.raises(ActionError, match="preamble"):
        parse_action({"preamble": ""})
