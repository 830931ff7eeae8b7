"""The fleet simulator (``bench/fleet_sim.py``) runs the real core to sane results.

Invariants, never performance targets: every turn of a tiny fleet ends well, no
wait is longer than the rate limiter's bound plus a retry's delay, the shares are
shares, and a run is the same for the same seed; and one behaviour of the admission
code, on a fixed seed (so no flake): agents spread unevenly over relays that share a
budget get turns alike (the fleet's line).
"""

from __future__ import annotations

import random
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fleet_sim
from fleet_sim import Result, Scenario, run
from fleet_sim_world import OUTAGES, PROVIDERS, SimStore


def tiny(**kw: Any) -> Scenario:
    return Scenario(**{"agents": 10, "seconds": 10.0, **kw})


def same(r: Result) -> dict[str, Any]:
    out = asdict(r)
    out.pop("wall_s")
    out.pop("cpu_s")
    return out


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(("relays", "store"), [(1, "none"), (2, "redis"), (2, "none")])
def test_every_turn_of_a_tiny_fleet_ends_well(provider: str, relays: int, store: str) -> None:
    sc = tiny(provider=provider, relays=relays, store=store)
    r = run(sc)
    assert r.turns > 0 and r.requests >= r.turns
    assert r.turns_given_up == 0 and r.unfinished == 0, r  # every turn completes
    assert r.longest_wait_s <= sc.rate.max_wait_s + sc.retry.delay_ms / 1000, r
    assert 0.0 <= r.share_429 <= 1.0 and r.limited <= r.requests
    assert 0.0 < r.fairness <= 1.0 + 1e-9
    assert r.ok + r.limited + r.errors_5xx == r.requests
    assert sum(p[0] for p in r.per_second) == r.requests
    assert (r.store_ops > 0) == (store == "redis")


@pytest.mark.parametrize("outage", OUTAGES[1:])
def test_an_outage_is_counted(outage: str) -> None:
    sc = tiny(outage=outage, seconds=20.0, outage_start_s=5.0, outage_s=5.0)
    r = run(sc)
    assert r.into_outage > 0 and r.errors_5xx == r.into_outage
    assert r.recovery_s is None or r.recovery_s >= 0.0  # (None: not within the run)
    assert r.turns_given_up == 0 and r.unfinished == 0


def test_a_run_is_deterministic_for_its_seed() -> None:
    sc = tiny(relays=2, store="redis", provider="quantized", store_down=((3.0, 5.0),))
    first = run(sc)
    assert same(run(sc)) == same(first)
    assert same(run(replace(sc, seed=2))) != same(first)


def test_bad_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_sim.main(["--agents", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "agents" in err


def test_the_cli_writes_the_table_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "fleet.md"
    argv = ["--agents", "5", "--relays", "2", "--seconds", "5", "--outage", "brownout"]
    argv += ["--outage-start", "1", "--outage-s", "2", "--out", str(out), "--plot", str(tmp_path)]
    assert fleet_sim.main(argv) == 0
    table = out.read_text().splitlines()
    assert len(table) == 3 and "brownout: 5 agents, 2 relay(s), redis" in table[2]
    assert len(list(tmp_path.glob("fleet-*.png"))) == 1


def test_the_store_keeps_the_scripts_semantics() -> None:
    store = SimStore(random.Random(0))
    name, view = "unbroken:rl:k|c:requests", (300.0, 5.0)
    assert store.take([name], 4, [1.0], [view], 120_000, 0.0) == (-1, "0")  # unknown: teach it
    assert store.learn(name, 300.0, 5.0, 2.0, 120_000, 0.0) == (0, 0.0)
    assert store.take([name], 4, [1.0], [view], 120_000, 0.0)[0] == 2  # what is there
    got, wait = store.take([name], 4, [1.0], [view], 120_000, 0.5)
    assert got == 2 and float(wait) == 0.0  # refilled 2.5 in 0.5 s: 2 whole requests
    # a report lowers the level, never raises it; the takes granted 4 in all
    assert store.learn(name, 300.0, 5.0, 100.0, 120_000, 0.5) == (0, 4.0)
    assert store.buckets[name][2] < 1.0
    store.poison(1.0)  # rate 0, level -100: garbage to the relay's view, taught again
    assert store.take([name], 4, [1.0], [view], 120_000, 1.0) == (-2, "0")
    assert store.learn(name, 300.0, 5.0, 3.0, 120_000, 1.0) == (1, 0.0)  # counted afresh
    assert store.take([name], 4, [1.0], [view], 120_000, 1.0)[0] == 3


def _turns_per_agent(sc: Scenario) -> list[float]:
    """Each relay's completed turns per agent on it."""
    fleet = fleet_sim.Fleet(sc)
    fleet.run()
    out = []
    for relay in fleet.relays:
        mine = [a.turns for a in fleet.agents if a.relay is relay]
        out.append(sum(mine) / len(mine))
    return out


def test_agents_spread_unevenly_over_relays_get_turns_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet's line (`leasemath.LineMark`): 25 agents on one relay and 15 on the
    other, sharing one budget, get as many turns each.  Without the line each relay got
    about half of the budget whatever its line: the busier relay's agents fewer turns."""
    import fleet_sim_relay

    sc = Scenario(agents=40, relays=2, store="redis", seconds=60.0, first_share=0.625)
    a, b = _turns_per_agent(sc)
    assert min(a, b) / max(a, b) >= 0.9, (a, b)
    monkeypatch.setattr(fleet_sim_relay, "FLEET_LINE", False)
    a, b = _turns_per_agent(sc)
    assert min(a, b) / max(a, b) < 0.7, (a, b)  # the test can tell the difference


def test_a_relay_served_below_its_share_is_raised_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The throttles' measures pooled (`AdmissionThrottle.sibling_news`): `overstated`
    over two relays.  Each relay correcting itself on its own 429s could be anchored at
    one request a second by an early 429 (it had seen a second of answers while the
    other relay took most) and climb back as slowly as it was low: goodput 78 % in one
    seed of four.  Pooled, a relay served below its share is raised to it at once."""
    import fleet_sim_relay

    def goodput(seed: int) -> float:
        sc = Scenario(agents=40, relays=2, store="redis", provider="overstated", seed=seed)
        return run(sc).goodput

    told = [goodput(seed) for seed in (1, 2, 3, 4)]
    assert min(told) >= 0.95, told
    # leases held to what a relay sends (`Limiter.lease_want`) no longer let one relay
    # take the fleet's budget, so the anchored relay is the old leases' case.  Those
    # take all a line wants, and since turns wait out a 429's block in their place in
    # the rate line (`RetryState._park`) a relay's line is longer: in one seed of four
    # (87 %) a relay anchored low hoards leases, and its starved sibling measures as
    # little, so pooling has nothing to raise it to.  Over the four, pooling still
    # tells:
    monkeypatch.setattr(fleet_sim_relay, "FLEET_HOLD", False)
    told = [goodput(seed) for seed in (1, 2, 3, 4)]
    assert sum(told) / 4 >= 0.95, told
    monkeypatch.setattr(fleet_sim_relay, "FLEET_THROTTLE", False)
    alone = [goodput(seed) for seed in (1, 2, 3, 4)]
    assert min(alone) < 0.9, alone  # the test can tell the difference
    assert sum(alone) / 4 < sum(told) / 4 - 0.05, (alone, told)


def test_a_fleet_leases_a_second_at_a_time_what_its_relays_can_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet's requests bucket holds a second's share for a take, and a relay
    leases what its throttle and second's share let go soon, less what it holds
    (`Limiter.fleet_hold`, `Limiter.lease_want`).  Before, a relay took up to sixteen
    whatever it could send: held by its throttle, they were the fleet's budget its
    sibling could not take, and the budget banked went out at each relay's own second's
    share.  `quantized` over two relays, seeds 1-4: 5.4 to 6.4 % 429s before."""
    import fleet_sim_relay

    def share_429(seed: int) -> float:
        sc = Scenario(agents=40, relays=2, store="redis", provider="quantized", seed=seed)
        return run(sc).share_429

    held = [share_429(seed) for seed in (1, 2, 3, 4)]
    assert max(held) <= 0.04, held
    monkeypatch.setattr(fleet_sim_relay, "FLEET_HOLD", False)
    before = [share_429(seed) for seed in (1, 2, 3, 4)]
    assert min(before) > 0.05, before  # the test can tell the difference


@pytest.mark.parametrize("provider", ["anthropic", "quantized"])
def test_one_relay_is_not_anchored_on_its_first_answers(provider: str) -> None:
    """Issue 32: one relay behind a limit enforced per second, its key spent at the
    start.  A 429 measured on the first one or two streamed answers (the others not
    back yet) anchored the throttle at 1 a second, and CUBIC's plateau held it there:
    44 % goodput on half the seeds of `anthropic`, two of twelve of `quantized`.  A
    measure on fewer than ``MIN_SUPPORT`` accepted answers is a guess now (the
    throttle probes up from it).  Fixed seeds: no flake."""
    told = [run(Scenario(agents=40, provider=provider, seed=s)).goodput for s in range(1, 13)]
    assert min(told) >= 0.9, told


def test_a_cooloff_does_not_send_a_waiting_turn_to_the_back_of_the_line() -> None:
    """Issue 32: no wait longer than ``max_wait_s``.  A turn that a cool-off held out of
    its rate line came back as a newcomer, its bound started again: behind `shared` at
    1 request a second a turn waited 94.5 s (seeds 1 to 6; 102 s at 14cbe37) for its
    first attempt.  Now the line's bound holds, plus what is left of a cool-off the
    provider asked for when the bound ran out."""
    for seed in range(1, 7):
        sc = Scenario(agents=40, provider="shared", seed=seed, limit_rps=1.0)
        r = run(sc)
        assert r.longest_wait_s <= sc.rate.max_wait_s + 5.0, (seed, r.longest_wait_s)


def test_a_fleet_on_a_key_others_share_finds_their_drain() -> None:
    """Issue 32: a key shared with traffic the fleet does not see (`shared`: 40 % of
    the limit).  The fleet's bucket refilled at the key's rate and only the relays'
    throttles found out, each one probing on its own: two relays over the store, 150
    simulated seconds, 5.1 and 5.0 % of the requests refused on seeds 1 and 2 (3.0
    and 3.2 % now).  The store now answers a report with what it granted in all, and
    each relay measures what others took (`core/admission/bucket.py`,
    `Drift.observe_fleet`).  Fixed seeds: no flake."""
    for seed in (1, 2):
        r = run(
            Scenario(
                agents=40, relays=2, store="redis", provider="shared", seed=seed, seconds=150.0
            )
        )
        assert r.share_429 <= 0.04, (seed, r.share_429)
        assert r.goodput >= 0.9, (seed, r.goodput)


def test_forty_agents_behind_one_request_a_second_are_not_refused_in_bursts() -> None:
    """Issue 32's overload: 40 agents behind a per-minute limit of 60 that the provider
    enforces per second (`quantized`) or reports as Anthropic does.  A crowd went a
    second's share at once, at least the cold start's four: 20.5 % and 14 % 429s, 52 %
    and 77 % goodput through one relay (seeds 1 to 4), 38 % and 42 % 429s over two.
    After the provider refuses a request its headers had room for, the share is one."""
    for provider in ("quantized", "anthropic"):
        for relays, store in ((1, "none"), (2, "redis")):
            for seed in (1, 2):
                sc = Scenario(
                    agents=40,
                    relays=relays,
                    store=store,
                    provider=provider,
                    seed=seed,
                    limit_rps=1.0,
                )
                r = run(sc)
                assert r.share_429 < 0.10 and r.goodput > 0.9, (provider, relays, seed, r)
