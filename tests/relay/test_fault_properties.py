"""Random fault schedules through the real relay and mock (real sockets).

Invariants, checked on what the client actually received:
1. on success, the client bytes equal the frames of exactly one upstream attempt;
2. no tool call is visible twice or partially;
3. after commit the upstream never receives another request for the turn;
4. a turn that did not complete ends in the protocol-native error, never in a
   success terminal or a bare clean end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayfix import make_config, start_relay
from unbroken.core.turn.ledger import Ledger, LedgerState
from unbroken.core.wire.protocols import Kind, protocol_for_path
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider

PATHS = {"chat": "v1/chat/completions", "responses": "v1/responses", "anthropic": "v1/messages"}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "responses": {"model": "m", "input": "hi", "stream": True},
    "anthropic": {
        "model": "m",
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
    },
}
STREAM = {"first_frame_timeout_s": 0.3, "idle_timeout_s": 0.3}
FAULTS = ["reset", "end", "stall", "malformed", "error_event", "status", "close_before_headers"]

fault_st = st.tuples(st.sampled_from(FAULTS), st.integers(min_value=0, max_value=14))
schedule_st = st.lists(fault_st, min_size=0, max_size=3)


def _action(fault: str, k: int, reply: str) -> dict[str, Any]:
    if fault == "status":
        return {"status": 503}
    if fault == "close_before_headers":
        return {"fault": fault}
    action: dict[str, Any] = {"fault": fault, "after_frame": k, "reply": reply}
    if fault == "stall":
        action["seconds"] = 5
    if fault == "error_event":
        action["error"] = "overloaded"
    return action


def _classify(proto: str, raw: bytes) -> list[tuple[bytes, int, int]]:
    c = protocol_for_path(PATHS[proto]).new_classifier()
    out = []
    for e in SSESplitter().feed(raw):
        kinds, open_tools = c.classify(e)
        out.append((e.raw, kinds, open_tools))
    return out


async def _scenario(proto: str, reply: str, schedule: list[tuple[str, int]]) -> None:
    async with MockProvider(host="127.0.0.1", port=0) as mock:
        server, _ = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
        try:
            async with aiohttp.ClientSession() as s:
                mock.script([{"reply": reply}])
                async with s.post(f"{mock.url}/{PATHS[proto]}", json=BODIES[proto]) as r:
                    clean = await r.read()
                mock.reset()
                frames = _classify(proto, clean)
                actions = [_action(f, min(k, len(frames) - 1), reply) for f, k in schedule]
                mock.script([*actions, {"reply": reply}])
                async with s.post(f"{server.url}/mock/{PATHS[proto]}", json=BODIES[proto]) as r:
                    got = await r.read()
            n_requests = len(mock.requests)
        finally:
            await server.stop()

    # Where does the turn commit?  Replay the clean frames through a ledger.
    ledger = Ledger(protocol_for_path(PATHS[proto]))
    released_after: list[bytes] = [b""]  # bytes released once k frames were received
    commit_at = None
    for i, e in enumerate(SSESplitter().feed(clean), start=1):
        released_after.append(released_after[-1] + ledger.feed_bytes(e))
        if commit_at is None and ledger.state is not LedgerState.PENDING:
            commit_at = i
    assert commit_at is not None
    frame_faults = {"reset", "end", "stall", "malformed", "error_event"}
    fatal = next(
        (
            i
            for i, (f, k) in enumerate(schedule)
            if f in frame_faults and min(k, len(frames) - 1) >= commit_at
        ),
        None,
    )
    if fatal is None:
        # every failure came before commit: invisible (invariant 1)
        assert got == clean
        assert n_requests == len(schedule) + 1
        return
    # invariant 3: no request after the committing attempt
    assert n_requests == fatal + 1
    k = min(schedule[fatal][1], len(frames) - 1)
    expected = released_after[k]
    assert got.startswith(expected)  # only this attempt's frames (invariant 1)
    seen = _classify(proto, got)
    if any(kinds & Kind.TERMINAL_OK for _, kinds, _ in _classify(proto, expected)):
        return  # the turn had completed before the fault: a complete answer
    # invariant 4: the rest is exactly the native error, and no success terminal
    assert not any(kinds & Kind.TERMINAL_OK for _, kinds, _ in seen)
    tail = _classify(proto, got[len(expected) :])
    assert len(tail) == (2 if proto == "responses" else 1), got[len(expected) :]
    assert all(kinds & Kind.TERMINAL_ERROR for _, kinds, _ in tail)
    assert b"unbroken" in tail[-1][0]
    # invariant 2: no tool call left partial in what was released
    assert _classify(proto, expected)[-1][2] == 0 if expected else True


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    proto=st.sampled_from(list(PATHS)),
    reply=st.sampled_from(["text", "tool", "tools"]),
    schedule=schedule_st,
)
def test_random_fault_schedules_keep_the_invariants(
    proto: str, reply: str, schedule: list[tuple[str, int]]
) -> None:
    asyncio.run(_scenario(proto, reply, schedule))
