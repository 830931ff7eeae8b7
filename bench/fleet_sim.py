"""A fleet simulator: the real sans-IO admission code, a virtual clock, many agents.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/fleet_sim.py --agents 40 --relays 1 --provider quantized --seconds 60
    python bench/fleet_sim.py --agents 40 --relays 2 --store redis --provider textbook
    python bench/fleet_sim.py --matrix --out /tmp/fleet.md --plot /tmp/fleet-img

Each agent runs streamed turns back to back, each one a real `TurnMachine`
(`unbroken.core.turn.machine`) with its `RetryState` on its relay's real `HealthBoard`
(breakers, pacers, rate limiters): the simulator feeds the machine the events a
transport would (``start``, ``answered`` with the provider's headers parsed by
`parse_rate_headers`, ``feed_chunk`` with an SSE body that reports its usage,
``body_ended``, ``error_body``) and carries out its actions (`Open`: the request
goes to the simulated provider; `Wait`: the turn sleeps until the board's pump
grants its ticket, the upstream recovers, or the wait ends; see
`fleet_sim_relay.SimRelay`).  Relays share a simulated store (`fleet_sim_world.SimStore`)
with the semantics of the relay's Redis scripts, a latency and fault windows.
Time is a heap of events at virtual times: a run is deterministic for its seed.

Reported per scenario: the share of upstream requests answered 429; goodput (ok
requests a second against what the provider's true limit leaves the fleet, over the
run, an outage included; above 100 %: budget the provider held at the start or
banked during an outage was used too); Jain's fairness over the agents' completed turns; the most
requests sent in any 1-second window against the limit; the longest wait (a turn
waiting at the relay between attempts, or before its first); requests into an
outage (answered 503); the recovery time (the outage's end to the first second with
80 % of the limit answered); and store round trips a completed turn.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleet_sim_agent import DRAIN_S, NO_HEADERS, Agent, sse_body
from fleet_sim_relay import Loop, SimRelay
from fleet_sim_world import OUTAGES, PROVIDERS, WALL0, Outage, ProviderModel, SimStore
from unbroken.config import StreamSettings
from unbroken.core.admission.health import AttemptAccounting, HealthSettings
from unbroken.core.admission.policy import RetryPolicy
from unbroken.core.admission.ratelimit import RateSettings
from unbroken.core.turn.ledger import Hold

__all__ = ["Fleet", "Result", "Scenario", "main", "run"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One run (the CLI's flags, same names)."""

    agents: int = 40
    relays: int = 1
    #: "none": each relay alone; "redis": relays share the simulated store
    store: str = "none"
    provider: str = "textbook"
    outage: str = "none"
    seconds: float = 60.0
    seed: int = 1
    #: the provider's true limit, requests a second
    limit_rps: float = 5.0
    #: the share of the provider's budget left when the run begins (0: spent, a team
    #: already at its limit, as bench/ratelimit_bench.py starts)
    start_share: float = 0.0
    #: the store's round trip (mean), and windows (start, end) it is down
    store_latency_s: float = 0.001
    store_down: tuple[tuple[float, float], ...] = ()
    #: the store's rate buckets are poisoned at this time (rate 0, level -100)
    poison_at_s: float | None = None
    outage_start_s: float = 20.0
    outage_s: float = 30.0
    #: the share of the agents on the first relay (None: spread evenly, agent i on relay
    #: i mod relays); ``serve --workers 2``'s kernel split 40 agents 25 and 15 (0.625)
    first_share: float | None = None
    #: an agent's pause between turns
    think_s: float = 0.0
    #: agents start at random within this long
    start_spread_s: float = 1.0
    #: the config a user gets unless overridden here
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    health: HealthSettings = field(default_factory=HealthSettings)
    rate: RateSettings = field(default_factory=RateSettings)

    def check(self) -> None:
        if not 1 <= self.agents <= 1_000_000:
            raise ValueError("agents: expected 1 to 1,000,000")
        if not 1 <= self.relays <= 10_000:
            raise ValueError("relays: expected 1 to 10,000")
        if self.store not in ("none", "redis"):
            raise ValueError("store: expected 'none' or 'redis'")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider: expected one of {', '.join(PROVIDERS)}")
        if self.outage not in OUTAGES:
            raise ValueError(f"outage: expected one of {', '.join(OUTAGES)}")
        if not (self.seconds > 0 and self.limit_rps > 0 and self.store_latency_s >= 0):
            raise ValueError("seconds, limit_rps: expected > 0; store_latency_s >= 0")
        if not 0.0 <= self.start_share <= 1.0:
            raise ValueError("start_share: expected a share in [0, 1]")
        if self.first_share is not None and not 0.0 <= self.first_share <= 1.0:
            raise ValueError("first_share: expected a share in [0, 1]")

    @property
    def label(self) -> str:
        store = f", {self.store} store" if self.relays > 1 else ""
        out = "" if self.outage == "none" else f", {self.outage}"
        return f"{self.agents} agents, {self.relays} relay(s){store}, {self.provider}{out}"


@dataclass(slots=True)
class Result:
    """What one run measured (see the module docstring)."""

    scenario: Scenario
    requests: int = 0
    ok: int = 0
    limited: int = 0
    errors_5xx: int = 0
    share_429: float = 0.0
    goodput: float = 0.0
    fairness: float = 0.0
    max_rps_window: int = 0
    max_rps_ratio: float = 0.0
    longest_wait_s: float = 0.0
    into_outage: int = 0
    recovery_s: float | None = None
    store_ops: int = 0
    store_ops_per_turn: float = 0.0
    turns: int = 0
    turns_given_up: int = 0
    unfinished: int = 0
    p50_turn_s: float = 0.0
    p99_turn_s: float = 0.0
    events: int = 0
    wall_s: float = 0.0
    #: this process's CPU seconds for the run (the machine's load aside)
    cpu_s: float = 0.0
    #: per second of the run: requests sent, answered 429, answered ok
    per_second: list[tuple[int, int, int]] = field(default_factory=list)

    def row(self) -> dict[str, str]:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.1f}"
        return {
            "429 share": f"{self.share_429:.1%}",
            "goodput": f"{self.goodput:.0%}",
            "fairness": f"{self.fairness:.3f}",
            "max req/s (x limit)": f"{self.max_rps_window} ({self.max_rps_ratio:.1f}x)",
            "longest wait s": f"{self.longest_wait_s:.1f}",
            "into outage": str(self.into_outage),
            "recovery s": rec,
            "store ops/turn": f"{self.store_ops_per_turn:.1f}",
            "turns": str(self.turns),
            "sim s/CPU s": f"{self.scenario.seconds:g}/{self.cpu_s:.1f}",
        }


class Fleet:
    """The world of one run: the loop, the relays, the agents, the provider."""

    def __init__(self, scenario: Scenario) -> None:
        scenario.check()
        sc = self.scenario = scenario
        self.rng = random.Random(sc.seed)
        self.loop = Loop()
        self.provider = ProviderModel(
            sc.provider,
            limit_rps=sc.limit_rps,
            rng=random.Random(self.rng.random()),
            start_share=sc.start_share,
        )
        self.outage = Outage(sc.outage, sc.outage_start_s, sc.outage_s)
        self.store: SimStore | None = None
        if sc.store == "redis":
            self.store = SimStore(
                random.Random(self.rng.random()),
                latency_s=sc.store_latency_s,
                down=sc.store_down,
            )
        pace = sc.retry.pace_settings()
        self.relays = [
            SimRelay(i, self.loop, health=sc.health, pace=pace, rate=sc.rate, store=self.store)
            for i in range(sc.relays)
        ]
        for r in self.relays:
            r.peers = [p for p in self.relays if p is not r] if self.store is not None else []
        self.accounting = [AttemptAccounting(r.board) for r in self.relays]
        self.cooloffs: list[dict[int, float]] = [{} for _ in self.relays]
        self.hold = Hold()
        self.timers = StreamSettings()
        self.body = sse_body(self.provider.prompt_tokens)
        self.agents = [Agent(self, i, self.relays[_relay_of(sc, i)]) for i in range(sc.agents)]
        self.turn_ids = 0
        self.store_ops = 0
        self.open_turns = 0
        self.given_up = 0
        self.longest_wait = 0.0
        self.turn_times: list[float] = []
        #: (send time, status) of every upstream request
        self.sent: list[tuple[float, int]] = []
        self._out_rng = random.Random(self.rng.random())

    def clock(self) -> float:
        return self.loop.now

    def wall_clock(self) -> float:
        return WALL0 + self.loop.now

    def upstream(self, now: float) -> tuple[int, dict[str, str]]:
        """One request reaches the provider: (status, headers)."""
        out = self.outage
        if out.active(now) and (out.kind == "outage" or self._out_rng.random() < 0.5):
            status, headers = 503, NO_HEADERS
        else:
            status, headers = self.provider.request(now)
        self.sent.append((now, status))
        return status, headers

    def _background(self) -> None:
        p = self.provider
        p.background(self.loop.now)
        rate = p.background_share * p.limit_rps
        self.loop.call_later(self._out_rng.expovariate(rate), self._background)

    def run(self) -> Result:
        t0, c0 = time.perf_counter(), time.process_time()
        sc = self.scenario
        loop = self.loop
        for a in self.agents:
            loop.call_later(a.rng.random() * sc.start_spread_s, a.start_turn)
        if self.provider.background_share > 0:
            loop.call_soon(self._background)
        if sc.poison_at_s is not None and self.store is not None:
            store = self.store
            loop.call_at(sc.poison_at_s, lambda: store.poison(loop.now))
        loop.run(sc.seconds)
        provider_ok_bg = self.provider.background_ok
        self.store_ops = self.store.ops if self.store is not None else 0
        end = sc.seconds
        while self.open_turns and end < sc.seconds + DRAIN_S:  # let open turns finish
            end += 1.0
            loop.run(end)
        r = self._result(provider_ok_bg)
        r.wall_s, r.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        return r

    def _result(self, background_ok: int) -> Result:
        sc = self.scenario
        r = Result(sc)
        sent = [(t, s) for t, s in self.sent if t < sc.seconds]
        r.requests = len(sent)
        r.ok = sum(1 for _, s in sent if s == 200)
        r.limited = sum(1 for _, s in sent if s == 429)
        r.errors_5xx = sum(1 for _, s in sent if s >= 500)
        r.share_429 = r.limited / r.requests if r.requests else 0.0
        seconds = sc.seconds
        available = max(sc.limit_rps - background_ok / sc.seconds, 1e-9)
        r.goodput = r.ok / (available * seconds) if seconds > 0 else 0.0
        turns = [a.turns for a in self.agents]
        total = sum(turns)
        squares = sum(x * x for x in turns)
        r.fairness = total * total / (len(turns) * squares) if squares else 0.0
        r.max_rps_window = _max_window([t for t, _ in sent], 1.0)
        r.max_rps_ratio = r.max_rps_window / sc.limit_rps
        r.longest_wait_s = self.longest_wait
        r.into_outage = r.errors_5xx
        bins = max(1, math.ceil(sc.seconds))
        per = [[0, 0, 0] for _ in range(bins)]
        for t, s in sent:
            b = per[min(int(t), bins - 1)]
            b[0] += 1
            if s == 429:
                b[1] += 1
            elif s == 200:
                b[2] += 1
        r.per_second = [(a, b, c) for a, b, c in per]
        if sc.outage != "none":
            r.recovery_s = _recovery(
                [t for t, s in sent if s == 200], self.outage.end_s, 0.8 * available
            )
        r.store_ops = self.store_ops  # at the run's end (not the open turns' drain)
        r.turns = len(self.turn_times)
        r.store_ops_per_turn = r.store_ops / r.turns if r.turns else 0.0
        r.turns_given_up = self.given_up
        r.unfinished = self.open_turns
        times = sorted(self.turn_times)
        if times:
            r.p50_turn_s = times[len(times) // 2]
            r.p99_turn_s = times[min(len(times) - 1, int(len(times) * 0.99))]
        r.events = self.loop.events
        return r


def _max_window(times: Sequence[float], width: float) -> int:
    """The most of ``times`` (sorted) in any window ``[t, t + width)``."""
    best = lo = 0
    for hi, t in enumerate(times):
        while times[lo] <= t - width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _recovery(ok_times: Sequence[float], end: float, rate: float) -> float | None:
    """Seconds from ``end`` until a 1-second window ending then holds ``rate`` oks."""
    after = [t for t in ok_times if t >= end]
    lo = 0
    for hi, t in enumerate(after):
        while after[lo] <= t - 1.0:
            lo += 1
        if hi - lo + 1 >= rate:
            return t - end
    return None


def run(scenario: Scenario) -> Result:
    """Run one scenario (deterministic for its seed)."""
    return Fleet(scenario).run()


def _parse_window(text: str) -> tuple[float, float]:
    a, sep, b = text.partition(":")
    try:
        start, end = float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected START:END seconds") from None
    if not sep or not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"{text!r}: expected START:END with START < END")
    return start, end


def _relay_of(sc: Scenario, agent: int) -> int:
    """The relay agent number ``agent`` talks to."""
    if sc.first_share is None or sc.relays == 1:
        return agent % sc.relays
    first = round(sc.agents * sc.first_share)
    return 0 if agent < first else 1 + (agent - first) % (sc.relays - 1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fleet_sim.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    d = Scenario()
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--relays", type=int, default=d.relays)
    p.add_argument(
        "--store",
        choices=("none", "redis"),
        default=None,
        help="relays share a simulated Redis (default: redis with 2+ relays)",
    )
    p.add_argument("--provider", choices=PROVIDERS, default=d.provider)
    p.add_argument("--outage", choices=OUTAGES, default=d.outage)
    p.add_argument("--seconds", type=float, default=d.seconds)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--limit-rps",
        type=float,
        default=d.limit_rps,
        help="the provider's true limit, requests a second",
    )
    p.add_argument(
        "--start-share",
        type=float,
        default=d.start_share,
        help="the share of the provider's budget left at the start (0: spent)",
    )
    p.add_argument(
        "--first-share",
        type=float,
        default=None,
        help="the share of the agents on the first relay (default: spread evenly)",
    )
    p.add_argument("--store-latency-ms", type=float, default=d.store_latency_s * 1000)
    p.add_argument(
        "--store-down",
        type=_parse_window,
        action="append",
        default=[],
        metavar="START:END",
        help="the store is down then (repeatable)",
    )
    p.add_argument(
        "--poison-at",
        type=float,
        default=None,
        metavar="S",
        help="poison the store's rate buckets (rate 0, level -100) at S",
    )
    p.add_argument("--outage-start", type=float, default=d.outage_start_s)
    p.add_argument("--outage-s", type=float, default=d.outage_s)
    p.add_argument(
        "--matrix",
        action="store_true",
        help="the standard table: 40 agents x every provider x {1 relay, 2 relays "
        "shared, 2 relays alone}, outages, and 10,000 agents over 50 relays",
    )
    p.add_argument(
        "--big-seconds",
        type=float,
        default=60.0,
        help="--matrix: the 10,000-agent runs' simulated seconds",
    )
    p.add_argument("--no-big", action="store_true", help="--matrix without the 10,000 agents")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown here too")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a PNG of requests/s per scenario here (matplotlib)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON lines")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from fleet_sim_report import matrix, plot, table

    args = parse_args(argv)
    store = args.store or ("redis" if args.relays > 1 else "none")
    base = Scenario(
        agents=args.agents,
        relays=args.relays,
        store=store,
        provider=args.provider,
        outage=args.outage,
        seconds=args.seconds,
        seed=args.seed,
        limit_rps=args.limit_rps,
        start_share=args.start_share,
        first_share=args.first_share,
        store_latency_s=args.store_latency_ms / 1000,
        store_down=tuple(args.store_down),
        poison_at_s=args.poison_at,
        outage_start_s=args.outage_start,
        outage_s=args.outage_s,
    )
    try:
        scenarios = (
            matrix(base, big=not args.no_big, big_seconds=args.big_seconds)
            if (args.matrix)
            else [base]
        )
        for sc in scenarios:
            sc.check()
    except ValueError as exc:
        print(f"fleet_sim.py: error: {exc}", file=sys.stderr)
        return 2
    results: list[Result] = []
    for sc in scenarios:
        res = run(sc)
        results.append(res)
        print(
            f"[fleet_sim] {sc.label}: {res.turns} turns, {res.events} events, "
            f"{res.wall_s:.1f} s ({res.cpu_s:.1f} s CPU)",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            row = asdict(res)
            row.pop("per_second")
            row["scenario"] = {
                k: v for k, v in asdict(sc).items() if k not in ("retry", "health", "rate")
            }
            print(json.dumps(row), flush=True)
    text = table(results)
    if not args.json:
        print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.plot is not None:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
