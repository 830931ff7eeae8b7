"""``unbroken demo``'s run: a storm against the mock provider, with and without the relay.

Starts the fault-injecting mock provider and a relay in front of it (both on loopback,
ephemeral ports), then drives N concurrent agent turns through the relay
(`agent_loop.agent_turn`, over the chosen protocol): each turn streams a tool call,
"runs" it, and streams the answer, under its own scripted storm.  Then the same storms
run straight against the mock, with the same client, for contrast.  What the relay
absorbed is counted by a hook (`_Absorbed`); the summary is one dict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from unbroken.config import JournalSettings, parse_config
from unbroken.core.turn.machine import NOT_FAILURES, Outcome
from unbroken.demo.agent_loop import DemoProtocol, DemoTurn, Storm, agent_turn
from unbroken.demo.chat_agent import CHAT_DEMO
from unbroken.demo.gemini_agent import GEMINI_DEMO
from unbroken.demo.messages_agent import MESSAGES_DEMO
from unbroken.mock import MockProvider
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord
from unbroken.relay.server import RelayServer

__all__ = [
    "AFTER_COMMIT",
    "CONTINUE_PROTOCOLS",
    "DEMO_PROTOCOLS",
    "NO_GEMINI_CONTINUE",
    "PROTOCOLS",
    "STORMS",
    "DemoRun",
    "run_demo",
    "storms",
]

ROUTE = "demo"
#: the wire protocols the demo's agent can speak (`run_demo`'s ``protocol``), by name
PROTOCOLS: dict[str, DemoProtocol] = {p.name: p for p in (CHAT_DEMO, GEMINI_DEMO, MESSAGES_DEMO)}
DEMO_PROTOCOLS = tuple(PROTOCOLS)
#: ``--after-commit``: the relay's ``[stream] after_commit`` for the run
AFTER_COMMIT = ("error", "continue")
#: the protocols whose cut answer the relay can continue in place (``continue``): the
#: Gemini API documents no model-role continuation, so a Gemini cut always ends in error
CONTINUE_PROTOCOLS = tuple(n for n, p in PROTOCOLS.items() if p.continue_route is not None)
NO_GEMINI_CONTINUE = (
    "--after-commit continue needs --protocol chat or anthropic: the Gemini API has no "
    "way to continue a cut answer, so its drops after output always end in an error"
)


def storms(
    *, retry_after_s: float = 1.0, stall_s: float = 20.0, protocol: str = "chat"
) -> list[Storm]:
    """The storm of each kind of turn, in the protocol's terms."""
    return PROTOCOLS[protocol].storms(retry_after_s, stall_s)


STORMS = storms()


class _Absorbed(Hooks):
    """Upstream failures by label, before commit (absorbed) and after (reached the client)."""

    def __init__(self) -> None:
        self.before: Counter[str] = Counter()
        self.after: Counter[str] = Counter()
        self.by_session: Counter[str] = Counter()  # absorbed, per agent session
        self.continued = 0  # cuts after output finished in place (after_commit = continue)
        self.gave_up = 0  # attempts the client abandoned (its own timeout) before they ended

    def continuation(self, turn: TurnRecord, result: str) -> None:
        if result == "spliced":
            self.continued += 1

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        if attempt.reason == Outcome.ABORTED_BY_CLIENT:
            self.gave_up += 1
        if attempt.reason in NOT_FAILURES:
            return
        if attempt.phase == "committed":
            self.after[attempt.reason] += 1
        else:
            self.before[attempt.reason] += 1
            self.by_session[turn.session_id or ""] += 1


@dataclass
class DemoRun:
    name: str
    turns: list[DemoTurn]
    server: RelayServer | None = None
    absorbed: _Absorbed | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0


async def _drive(
    run: DemoRun,
    protocol: DemoProtocol,
    base_url: str,
    client_timeout_s: float,
    on_tick: Callable[[DemoRun], None] | None,
) -> None:
    """Every turn of ``run``, each by its own agent over ``protocol``, at once."""
    async with protocol.agents(base_url, client_timeout_s) as agent_for:
        await _tick_while(run, on_tick, [agent_turn(agent_for(t), t) for t in run.turns])


async def _tick_while(
    run: DemoRun,
    on_tick: Callable[[DemoRun], None] | None,
    turns: list[Coroutine[Any, Any, None]],
) -> None:
    """Run the turns, with the live table refreshed meanwhile."""
    ticker: asyncio.Task[None] | None = None
    if on_tick is not None:

        async def tick() -> None:
            while True:
                on_tick(run)
                await asyncio.sleep(0.1)

        ticker = asyncio.ensure_future(tick())
    try:
        await asyncio.gather(*turns)
    finally:
        run.seconds = time.monotonic() - run.started
        if ticker is not None:
            ticker.cancel()
        if on_tick is not None:
            on_tick(run)


def _turns(n: int, kinds: list[Storm], prefix: str) -> list[DemoTurn]:
    return [
        DemoTurn(number=i + 1, storm=kinds[i % len(kinds)].name, key=f"{prefix}-{i + 1}")
        for i in range(n)
    ]


def _script(mock: MockProvider, turns: list[DemoTurn], kinds: list[Storm]) -> int:
    by_name = {s.name: s for s in kinds}
    faults = 0
    for t in turns:
        storm = by_name[t.storm]
        mock.script(list(storm.script), key=t.key)
        faults += storm.faults
    return faults


async def run_demo(
    *,
    turns: int = 12,
    direct: bool = True,
    retry_after_s: float = 1.0,
    stall_s: float = 20.0,
    client_timeout_s: float = 5.0,
    journal: str | None = None,
    on_tick: Callable[[DemoRun], None] | None = None,
    protocol: str = "chat",
    after_commit: str = "error",
) -> dict[str, Any]:
    """Run the storm through the relay (and straight at the mock); return the summary.

    ``protocol``: ``chat`` (the openai SDK, Chat Completions), ``gemini`` (the Gemini
    API's ``streamGenerateContent``) or ``anthropic`` (Messages).  ``after_commit``:
    the relay's ``[stream] after_commit``; ``continue`` finishes a drop after output in
    place (Messages by prefill; Chat by the mock's documented ``prefix`` mode)."""
    if protocol not in DEMO_PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(DEMO_PROTOCOLS)}, got {protocol!r}")
    if after_commit not in AFTER_COMMIT:
        raise ValueError(f"after_commit: expected one of {', '.join(AFTER_COMMIT)}")
    if after_commit == "continue" and protocol not in CONTINUE_PROTOCOLS:
        raise ValueError(NO_GEMINI_CONTINUE)
    speaks = PROTOCOLS[protocol]
    route: dict[str, Any] = {}  # the demo route's keys beside its upstream
    if after_commit == "continue" and speaks.continue_route is not None:
        route.update(speaks.continue_route)
    kinds = speaks.storms(retry_after_s, stall_s)
    async with MockProvider(host="127.0.0.1", port=0, record=False) as mock:
        config = parse_config(
            {
                # Each turn's storm is scripted on its own: fixed waits and no circuit
                # breaker, so the turns do not pay for each other's faults (one mock
                # upstream takes all twelve storms; with breakers on it would open and
                # park every turn, and an exponential backoff would outgrow the client's
                # 5 s read timeout).  The stream timers are scaled to that timeout: early
                # headers (then keepalives) come well before it, as the default 20 s come
                # before an SDK's 600 s.  With the default 20 s, a turn parked behind a
                # 429 for 3 s and then stalled waited 5 s for its headers: the client gave
                # up before the relay's 2 s stall timer fired (journaled aborted_by_client).
                "retry": {"delay_ms": 200, "backoff": "fixed", "verbose": False},
                "health": {"breakers": False},
                "stream": {
                    "first_frame_timeout_s": 2.0,
                    "idle_timeout_s": 1.0,
                    "keepalive_s": 2.0,
                    "early_headers_s": 1.0,
                },
                "routes": {ROUTE: {**route, "upstreams": [{"url": mock.url}]}},
            },
            env={},
        )
        config = dataclasses.replace(
            config,
            port=0,
            grace_s=2.0,
            journal=JournalSettings(enabled=journal is not None, path=journal),
        )
        relay_turns = _turns(turns, kinds, "relay")
        faults = _script(mock, relay_turns, kinds)
        absorbed = _Absorbed()
        server = RelayServer(config, hooks=absorbed)
        await server.start()
        run = DemoRun("Through unbroken", relay_turns, server, absorbed)
        try:
            await _drive(run, speaks, f"{server.url}/{ROUTE}", client_timeout_s, on_tick)
            totals = server.status.totals()
        finally:
            await server.stop()

        direct_run: DemoRun | None = None
        if direct:
            mock.reset()
            direct_turns = _turns(turns, kinds, "direct")
            _script(mock, direct_turns, kinds)
            direct_run = DemoRun("Straight to the mock, no relay", direct_turns)
            await _drive(direct_run, speaks, mock.url, client_timeout_s, on_tick)

    summary: dict[str, Any] = {
        "protocol": protocol,
        "after_commit": after_commit,
        "continued": absorbed.continued,
        "turns": turns,
        "completed": sum(t.completed for t in relay_turns),
        "lost": sum(t.lost for t in relay_turns),
        "faults_injected": faults,
        "failures_absorbed": sum(absorbed.before.values()),
        "failures_after_commit": sum(absorbed.after.values()),
        "absorbed_by_reason": dict(absorbed.before.most_common()),
        "after_commit_by_reason": dict(absorbed.after.most_common()),
        "client_errors": sum(t.errors for t in relay_turns),
        "client_gave_up": absorbed.gave_up,
        "duplicates": sum(t.duplicates for t in relay_turns),
        "corrupted": sum(t.corrupted for t in relay_turns),
        "retries": totals["retries"],
        "wasted_tokens_est": totals["wasted_tokens_est"],
        "seconds": round(run.seconds, 2),
        "storms": dict(Counter(t.storm for t in relay_turns)),
        "direct_completed": None,
        "direct_lost": None,
        "direct_client_errors": None,
        "direct_duplicates": None,
        "direct_seconds": None,
    }
    if direct_run is not None:
        summary.update(
            direct_completed=sum(t.completed for t in direct_run.turns),
            direct_lost=sum(t.lost for t in direct_run.turns),
            direct_client_errors=sum(t.errors for t in direct_run.turns),
            direct_duplicates=sum(t.duplicates for t in direct_run.turns),
            direct_seconds=round(direct_run.seconds, 2),
        )
    return summary
