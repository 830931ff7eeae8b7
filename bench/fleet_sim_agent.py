"""The fleet simulator's agents: each runs streamed turns back to back, each turn a
real `TurnMachine` fed the events a transport would feed it (`bench/fleet_sim.py`)."""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from fleet_sim_relay import SimRelay, Timer
from fleet_sim_world import WALL0
from unbroken.core.admission.policy import Failure, RetryState, parse_retry_after
from unbroken.core.admission.ratehead import parse_rate_headers
from unbroken.core.admission.ratelimit import credential_hash
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.machine import (
    End,
    GiveUp,
    Open,
    Phase,
    ReadErrorBody,
    Stream,
    TurnMachine,
    TurnState,
    Wait,
)
from unbroken.core.wire.protocols import CHAT

if TYPE_CHECKING:
    from fleet_sim import Fleet

__all__ = ["CRED", "DRAIN_S", "KEY", "NO_HEADERS", "Agent", "SimReport", "sse_body"]

KEY = "sim|https://provider.invalid/v1"
CRED = credential_hash("sk-sim-fleet")
ERROR_BODY = b'{"error":{"message":"rate limited","type":"rate_limit_error"}}'
#: the provider's answer latencies (s): a streamed turn's first byte and whole body,
#: and an error's
TTFB_S = (0.1, 0.3)
TURN_S = (0.2, 2.0)
ERROR_S = (0.02, 0.08)
#: a run's turns still open when it ends get this long to finish (then: unfinished)
DRAIN_S = 120.0
NO_HEADERS: dict[str, str] = {}


def sse_body(prompt_tokens: int) -> bytes:
    """A streamed Chat Completions answer that reports its usage."""

    def frame(obj: dict[str, Any]) -> str:
        return "data: " + json.dumps(obj) + "\n\n"

    base = {"id": "c", "object": "chat.completion.chunk"}
    return (
        frame({**base, "choices": [{"index": 0, "delta": {"content": "ok"}}]})
        + frame({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        + frame(
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 2,
                    "total_tokens": prompt_tokens + 2,
                },
            }
        )
        + "data: [DONE]\n\n"
    ).encode()


class SimReport:
    """The turn's observer: each attempt's end counted as the relay's observer does
    (`AttemptAccounting`, the fleet's counters); the rest ignored."""

    __slots__ = ("agent",)

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def attempt_started(self, number: int, upstream: int, choice: str = "") -> None:
        pass

    def attempt_ended(
        self, reason: str, phase: Phase | None, status: int | None, stats: AttemptStats | None
    ) -> None:
        a = self.agent
        relay = a.relay
        failed = a.fleet.accounting[relay.index].attempt_ended(
            a.fleet.loop.now,
            a.turn_id,
            KEY,
            reason=reason,
            phase=phase.value if phase is not None else "",
            status=status,
        )
        if failed is not None:
            relay.count(KEY, failed)

    def attempt_failed(self, failure: Failure, phase: Phase, wait_s: float | None) -> None:
        pass

    def state(self, state: TurnState) -> None:
        pass

    def hold_overflow(self, held_bytes: int) -> None:
        pass

    def parked(self, why: str) -> None:
        pass

    def headers_sent(self) -> None:
        pass

    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        pass

    def uncovered(self, result: str) -> None:
        pass


class Agent:
    """One agent: streamed turns back to back through its relay."""

    __slots__ = (
        "fleet",
        "idle_since",
        "index",
        "machine",
        "relay",
        "report",
        "rng",
        "session",
        "timer",
        "turn_id",
        "turn_t0",
        "turns",
        "wait_key",
        "wait_ticket",
        "waiting",
    )

    def __init__(self, fleet: Fleet, index: int, relay: SimRelay) -> None:
        self.fleet = fleet
        self.index = index
        self.relay = relay
        self.session = f"agent-{index}"
        self.rng = random.Random(fleet.rng.random())
        self.report = SimReport(self)
        self.machine: TurnMachine | None = None
        self.turn_id = 0
        self.turn_t0 = 0.0
        self.idle_since: float | None = None
        self.turns = 0
        self.waiting = False
        self.timer: Timer | None = None
        self.wait_key: str | None = None
        self.wait_ticket = 0

    def start_turn(self) -> None:
        f = self.fleet
        now = f.loop.now
        if now >= f.scenario.seconds:
            return  # the run is over: no new turn
        sc = f.scenario
        relay = self.relay
        retry = RetryState(
            sc.retry,
            1,
            rng=self.rng,
            cooloff_until=f.cooloffs[relay.index],
            board=relay.board,
            keys=[KEY],
            sticky=self.session,
            quota_cooloff_s=sc.health.quota_cooloff_s,
            park_check_s=sc.health.park_check_s,
            creds=[CRED],
            body_bytes=f.provider.body_bytes,
        )
        f.turn_ids += 1
        self.turn_id = f.turn_ids
        self.machine = TurnMachine(
            protocol=CHAT,
            hold=f.hold,
            timers=f.timers,
            retry=retry,
            stream=True,
            now=now,
            report=self.report,
            clock=f.clock,
            wall_clock=f.wall_clock,
        )
        self.turn_t0 = self.idle_since = now
        f.open_turns += 1
        self.handle(self.machine.start(now))

    def handle(self, action: object) -> None:
        kind = type(action)
        if kind is Open:
            self.send()
        elif kind is Wait:
            assert isinstance(action, Wait)
            self.relay.wait(self, action.seconds, action.key, action.ticket)
        elif kind is End:
            self.done(ok=True)
        elif kind is GiveUp:
            self.done(ok=False)
        else:
            raise RuntimeError(f"the simulator does not carry out {action!r}")

    def resume(self) -> None:
        m = self.machine
        assert m is not None
        self.handle(m.next_attempt(self.fleet.loop.now))

    def send(self) -> None:
        f = self.fleet
        now = f.loop.now
        since = self.idle_since
        if since is not None:
            f.longest_wait = max(f.longest_wait, now - since)
            self.idle_since = None
        status, headers = f.upstream(now)
        rng = self.rng
        if status == 200:
            ttfb = rng.uniform(*TTFB_S)
            rest = max(rng.uniform(*TURN_S) - ttfb, 0.0)
        else:
            ttfb, rest = rng.uniform(*ERROR_S), 0.0
        f.loop.call_later(ttfb, lambda: self.on_headers(status, headers, rest))

    def on_headers(self, status: int, headers: dict[str, str], rest: float) -> None:
        f = self.fleet
        now = f.loop.now
        m = self.machine
        assert m is not None
        wall = WALL0 + now
        ra = parse_retry_after(headers, now_wall=wall) if status >= 400 else None
        rate = None
        if m.retry.admitted:
            rate = parse_rate_headers(headers, now_wall=wall, max_wait_s=f.scenario.rate.max_wait_s)
        action = m.answered(now, status, sse=status == 200, retry_after_s=ra, rate=rate)
        kind = type(action)
        if kind is Stream:
            f.loop.call_later(rest, self.on_body)
        elif kind is ReadErrorBody:
            self.idle_since = now
            self.handle(m.error_body(now, ERROR_BODY))
        else:
            self.handle(action)

    def on_body(self) -> None:
        f = self.fleet
        now = f.loop.now
        m = self.machine
        assert m is not None
        fed = m.feed_chunk(now, f.body)
        over = fed.over
        self.handle(over if over is not None else m.body_ended(now))

    def done(self, *, ok: bool) -> None:
        f = self.fleet
        now = f.loop.now
        f.open_turns -= 1
        f.accounting[self.relay.index].turn_ended(self.turn_id)
        self.machine = None
        if ok:
            if now <= f.scenario.seconds:
                self.turns += 1
                f.turn_times.append(now - self.turn_t0)
        else:
            f.given_up += 1
        think = f.scenario.think_s
        f.loop.call_later(think * self.rng.random() * 2 if think else 0.0, self.start_turn)
