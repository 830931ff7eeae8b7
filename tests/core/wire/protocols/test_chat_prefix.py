"""Chat Completions continuation by a documented prefix mode (sans-IO).

Property: random text streams cut again and again, continued by a model that answers
from the prefix (without it, as DeepSeek, Moonshot and Qwen document, or starting with
it, as Mistral's reference says): the client's text is the uncut text, with one
finish and one ``[DONE]``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import CHAT
from unbroken.core.wire.protocols.chat_prefix import (
    ChatPrefix,
    Committed,
    FrameSplicer,
    Plan,
    plan_continuation,
    read_committed,
    request_refusal,
)
from unbroken.core.wire.protocols.prefill import JoinError, PrefillRefusal, echo_tails
from unbroken.core.wire.sse import Event, SSESplitter


def chunk(delta: dict[str, Any], finish: str | None = None, cid: str = "c1") -> bytes:
    payload = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


def stream(pieces: list[str], cid: str = "c1", usage: int | None = 9) -> list[bytes]:
    out = [chunk({"role": "assistant", "content": ""}, cid=cid)]
    out += [chunk({"content": p}, cid=cid) for p in pieces]
    out.append(chunk({}, "stop", cid=cid))
    if usage is not None:
        u = {"prompt_tokens": 10, "completion_tokens": usage, "total_tokens": 10 + usage}
        out.append(f"data: {json.dumps({'id': cid, 'choices': [], 'usage': u})}\n\n".encode())
    out.append(b"data: [DONE]\n\n")
    return out


def events(raw: bytes) -> list[Event]:
    return SSESplitter().feed(raw)


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a] or [""]


def client_text(raw: bytes) -> tuple[str, int, int]:
    text, finishes, ids = [], 0, set()
    done = 0
    for event in events(raw):
        if event.data == "[DONE]":
            done += 1
            continue
        obj = json.loads(event.data or "{}")
        ids.add(obj.get("id"))
        for choice in obj.get("choices") or []:
            text.append(choice["delta"].get("content") or "")
            finishes += choice.get("finish_reason") is not None
    assert ids == {"c1"}, "every chunk keeps the client's id"
    return "".join(text), finishes, done


def repeats(prefix: str, rest: str) -> bool:
    """Whether a continuation whose text is ``rest`` repeats the end of ``prefix``
    (`prefill.echo_tails`): refused, the model's own words or an echo alike."""
    tails = echo_tails(prefix)
    return any(rest.startswith(t) for t in tails) or (
        bool(rest.strip()) and any(t.startswith(rest) for t in tails)
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c\n.", min_size=1, max_size=40),
    split=st.lists(st.integers(0, 60), max_size=8),
    cuts=st.lists(st.integers(2, 30), min_size=1, max_size=4),
    mode=st.sampled_from(list(ChatPrefix)),
)
def test_cut_again_and_again_the_client_gets_the_uncut_text(
    text: str, split: list[int], cuts: list[int], mode: ChatPrefix
) -> None:
    request = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}
    frames = stream(pieces_of(text, split))
    ledger = Ledger(CHAT)
    client = b"".join(
        e.raw
        for raw in frames[: min(cuts[0], len(frames) - 3)]
        for e in ledger.feed(events(raw)[0])
    )
    for cut in [*cuts[1:], None]:
        committed = read_committed(client)
        assert isinstance(committed, Committed)
        p = plan_continuation(request, committed, mode)
        assert isinstance(p, Plan)
        if p.prefill:
            assert p.body["messages"][-1] == {
                "role": "assistant",
                "content": p.prefill,
                mode.flag: True,
            }
        rest = text[len(p.prefill) :]
        answer = (p.full_prefix + rest) if mode is ChatPrefix.PREFIX_ECHO else rest
        cont = stream(pieces_of(answer, split), cid="c2")
        splicer = FrameSplicer(p, mode)
        ledger = Ledger(CHAT)
        ledger.state = LedgerState.COMMITTED
        take = cont if cut is None else cont[: min(cut, len(cont) - 3)]
        try:
            for raw in take:
                for spliced in splicer.feed(events(raw)[0]):
                    client += b"".join(e.raw for e in ledger.feed(spliced))
        except JoinError:
            # the continuation repeats the end of the prefix: refused (issue 33), never
            # shown twice; the client has a prefix of the text
            assert repeats(p.full_prefix, rest)
            assert text.startswith(client_text(client)[0])
            return
        if cut is None:
            assert ledger.verdict is Verdict.DONE
    got, finishes, done = client_text(client)
    assert got == text
    assert (finishes, done) == (1, 1)


@pytest.mark.parametrize(
    ("delta", "refusal"),
    [
        (
            {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": ""}}]},
            PrefillRefusal.TOOL_CALL,
        ),
        ({"reasoning_content": "hmm"}, PrefillRefusal.THINKING),
        ({"refusal": "no"}, PrefillRefusal.OTHER_CONTENT),
        ({"audio": {"id": "a"}}, PrefillRefusal.OTHER_CONTENT),
    ],
)
def test_refusals_read_from_what_was_released(
    delta: dict[str, Any], refusal: PrefillRefusal
) -> None:
    released = chunk({"role": "assistant", "content": "Hi"}) + chunk(delta)
    assert read_committed(released) is refusal


def test_refusals_of_the_stream_and_the_request() -> None:
    assert read_committed(chunk({"content": "x"}, "stop")) is PrefillRefusal.STOP_RELEASED
    assert read_committed(b"data: {nope\n\n") is PrefillRefusal.MALFORMED
    two = b'data: {"choices":[{"index":1,"delta":{"content":"x"}}]}\n\n'
    assert read_committed(two) is PrefillRefusal.CHOICES
    ok: dict[str, Any] = {"stream": True, "messages": [{"role": "user", "content": "q"}]}
    assert request_refusal(ok, ChatPrefix.PREFIX) is None
    assert (
        request_refusal({**ok, "stream": False}, ChatPrefix.PREFIX) is PrefillRefusal.NOT_STREAMED
    )
    assert request_refusal({**ok, "n": 2}, ChatPrefix.PREFIX) is PrefillRefusal.CHOICES
    assert request_refusal({**ok, "tool_choice": "required"}, ChatPrefix.PREFIX) is (
        PrefillRefusal.FORCED_TOOL
    )
    assert request_refusal({**ok, "tool_choice": "auto"}, ChatPrefix.PREFIX) is None
    assert (
        request_refusal({**ok, "reasoning_effort": "high"}, ChatPrefix.PREFIX)
        is PrefillRefusal.THINKING_ENABLED
    )
    assert (
        request_refusal({**ok, "enable_thinking": True}, ChatPrefix.PARTIAL)
        is PrefillRefusal.THINKING_ENABLED
    )
    assert (
        request_refusal({**ok, "thinking": {"type": "enabled"}}, ChatPrefix.PARTIAL)
        is PrefillRefusal.THINKING_ENABLED
    )
    own = {"role": "assistant", "content": "{", "partial": True}
    with_own = {**ok, "messages": [*ok["messages"], own]}
    assert request_refusal(with_own, ChatPrefix.PARTIAL) is None
    assert request_refusal(with_own, ChatPrefix.PREFIX) is PrefillRefusal.CLIENT_PREFILL
    p = plan_continuation(with_own, Committed('"a": 1 ', "c1", 1), ChatPrefix.PARTIAL)
    assert isinstance(p, Plan)
    assert p.body["messages"][-1] == {"role": "assistant", "content": '{"a": 1', "partial": True}
    assert p.shown_ws == " "


def test_an_answer_that_does_not_repeat_the_prefix_breaks_the_join() -> None:
    request: dict[str, Any] = {"stream": True, "messages": [{"role": "user", "content": "q"}]}
    p = plan_continuation(request, Committed("Hello wor", "c1", 1), ChatPrefix.PREFIX_ECHO)
    assert isinstance(p, Plan)
    splicer = FrameSplicer(p, ChatPrefix.PREFIX_ECHO)
    assert splicer.feed(events(chunk({"content": "Hello"}))[0]) == []  # the echo, so far
    with pytest.raises(JoinError):
        splicer.feed(events(chunk({"content": " there"}))[0])
    ended = FrameSplicer(p, ChatPrefix.PREFIX_ECHO)
    ended.feed(events(chunk({"content": "Hel"}))[0])
    with pytest.raises(JoinError):
        ended.feed(events(chunk({}, "stop"))[0])
    own = {
        **request,
        "messages": [*request["messages"], {"role": "assistant", "content": "{", "prefix": True}],
    }
    assert request_refusal(own, ChatPrefix.PREFIX_ECHO) is PrefillRefusal.CLIENT_PREFILL
