"""recovery_bench's turns and scenarios: one turn through a system, the outage and busy runs,
the plan of runs and the statistics of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import harness
from harness import log
from recovery_sut import Context, Profile, Sut, make_mock, now, start_sut, stop_sut
from reporting import fnum

# =====================================================================================
# Turns


def body(turn: str) -> bytes:
    return json.dumps(
        {
            "model": "bench",
            "stream": True,
            "messages": [{"role": "user", "content": f"bench-turn {turn}"}],
        }
    ).encode()


async def one_turn(
    http: Any,
    url: str,
    headers: dict[str, str],
    turn: str,
    out: dict[str, dict[str, Any]],
    limit_s: float | None = None,
) -> None:
    """One streamed turn; its result (times, completed or why not) goes into ``out``."""
    t0 = now()
    status = None
    try:
        async with asyncio.timeout(limit_s):
            async with http.post(url, data=body(turn), headers=headers) as r:
                status = r.status
                data = await r.read()
        ok = status == 200 and b"data: [DONE]" in data and b'"error"' not in data
        err = (
            ""
            if ok
            else (
                f"HTTP {status}"
                if status != 200
                else "in-stream error"
                if b'"error"' in data
                else "no [DONE]"
            )
        )
    except TimeoutError:
        ok, err = False, f"not finished within {limit_s:g} s"
    except Exception as exc:  # connection errors: the client's view
        ok, err = False, f"{type(exc).__name__}: {exc}"[:120]
    out[turn] = {"start": t0, "end": now(), "ok": ok, "error": err, "status": status}


async def warm(http: Any, sut: Sut) -> str | None:
    """One clean turn through each address (imports, pools); an error text if one fails."""
    for i, url in enumerate(sut.urls):
        out: dict[str, dict[str, Any]] = {}
        await one_turn(http, url, sut.headers, f"warm{i}", out, 120.0)
        if not out[f"warm{i}"]["ok"]:
            return f"warm-up turn failed: {out[f'warm{i}']['error']}"
    return None


def pct(values: Sequence[float], q: float) -> float | None:
    return None if not values else harness.pct(values, q)


def dist(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "max": max(values) if values else None,
        "mean": sum(values) / len(values) if values else None,
    }


def request_stats(
    log_rows: list[tuple[float, str | None, bool]],
    t0: float,
    t_rec: float,
    end: float,
    bin_s: float,
) -> dict[str, Any]:
    """Upstream requests during the outage, first attempts vs the rest, and a time series."""
    seen: set[str | None] = set()
    first = rest = 0
    nbins = max(1, int((end - t0) / bin_s) + 1)
    s_first, s_rest = [0] * nbins, [0] * nbins
    after = 0
    for t, turn, _failed in log_rows:
        is_first = turn is not None and turn not in seen
        seen.add(turn)
        k = int((t - t0) / bin_s)
        if 0 <= k < nbins:
            (s_first if is_first else s_rest)[k] += 1
        if t0 <= t <= t_rec:  # the N-th 503 of a count outage is part of it
            if is_first:
                first += 1
            else:
                rest += 1
        elif t > t_rec:
            after += 1
    span = t_rec - t0
    return {
        "outage_s": span,
        "first": first,
        "rest": rest,
        "rps_first": first / span if span > 0 else None,
        "rps_rest": rest / span if span > 0 else None,
        "after_recovery": after,
        "series": {"bin_s": bin_s, "first": s_first, "rest": s_rest, "recovery_at_s": span},
    }


async def wait_turns(tasks: list[asyncio.Task[None]], deadline: float) -> None:
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=max(0.0, deadline - now()))
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still, timeout=10)


def turn_results(out: dict[str, dict[str, Any]], ids: list[str], cut: str) -> list[dict[str, Any]]:
    return [
        out.get(i) or {"start": None, "end": None, "ok": False, "error": cut, "status": None}
        for i in ids
    ]


async def outage_run(
    ctx: Context, http: Any, sut: Sut, mock: Any, kind: str, param: float, n: int, tag: str
) -> dict[str, Any]:
    """All ``n`` turns start when the outage does; ``kind`` is "time" or "count"."""
    prof = ctx.prof
    mock.log.clear()
    if kind == "time":
        mock.set_default({"status": 503})
    else:
        mock.failed, mock.fail_target = 0, int(param)
        mock.reached.clear()
        mock.script([{"status": 503, "count": int(param)}])
    ids = [f"{tag}t{i}" for i in range(n)]
    out: dict[str, dict[str, Any]] = {}
    t0 = now()
    tasks = [
        asyncio.ensure_future(one_turn(http, sut.urls[i % len(sut.urls)], sut.headers, turn, out))
        for i, turn in enumerate(ids)
    ]
    capped = False
    if kind == "time":
        await asyncio.sleep(max(0.0, t0 + param - now()))
        mock.set_default(None)
        t_rec = now()
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(mock.reached.wait(), max(0.0, t0 + prof.count_cap_s - now()))
        if not mock.reached.is_set():
            capped = True
            mock.reset()  # drop the rest of the 503s: the upstream is back
            t_rec = now()
        else:
            t_rec = max(t for t, _turn, failed in mock.log if failed)
    served = mock.failures()
    await wait_turns(tasks, t_rec + prof.tail_s)
    end = now()
    res = turn_results(out, ids, f"not finished {prof.tail_s:g} s after recovery")
    hit = {turn for _t, turn, failed in mock.log if failed}
    ok = [r for r in res if r["ok"]]
    rec = [
        r["end"] - t_rec
        for i, r in zip(ids, res, strict=True)
        if r["ok"] and (kind == "time" or i in hit)
    ]
    total = [r["end"] - r["start"] for r in ok]
    errors = Counter(r["error"] for r in res if not r["ok"])
    stats = request_stats(mock.log, t0, t_rec, end, prof.bin_s)
    return {
        "turns": n,
        "completed": len(ok),
        "hit": len(hit & set(ids)) if kind == "count" else n,
        "capped": capped,
        "served_503": served,
        "recovery": dist(rec),
        "total": dist(total),
        "errors": dict(errors.most_common(3)),
        "recovery_s": [round(x, 4) for x in rec],
        "total_s": [round(x, 4) for x in total],
        **stats,
    }


async def busy_run(ctx: Context, http: Any, sut: Sut, mock: Any, tag: str) -> dict[str, Any]:
    prof = ctx.prof
    mock.log.clear()
    mock.fail_rate = prof.busy_fail
    n = max(1, round(prof.busy_rate * prof.busy_seconds))
    ids = [f"{tag}b{i}" for i in range(n)]
    out: dict[str, dict[str, Any]] = {}
    t0 = now()
    tasks = []
    for i, turn in enumerate(ids):
        delay = t0 + i / prof.busy_rate - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(
            asyncio.ensure_future(
                one_turn(
                    http, sut.urls[i % len(sut.urls)], sut.headers, turn, out, prof.busy_timeout_s
                )
            )
        )
    launched = now() - t0
    await wait_turns(tasks, now() + prof.busy_timeout_s + 5)
    mock.fail_rate = 0.0
    res = turn_results(out, ids, f"not finished within {prof.busy_timeout_s:g} s")
    ok = [r for r in res if r["ok"]]
    by_turn: dict[str | None, list[tuple[float, bool]]] = {}
    for t, turn, failed in mock.log:
        by_turn.setdefault(turn, []).append((t, failed))
    waits: list[float] = []
    unanswered = 0  # failed attempts never followed by another one
    for rows in by_turn.values():
        for (ta, failed), nxt in zip(rows, [*rows[1:], None], strict=True):
            if failed:
                if nxt is None:
                    unanswered += 1
                else:
                    waits.append(nxt[0] - ta)
    return {
        "turns": n,
        "launch_s": launched,
        "completed": len(ok),
        "latency": dist([r["end"] - r["start"] for r in ok]),
        "attempts": len(mock.log),
        "failed_attempts": mock.failures(),
        "waits": dist(waits),
        "waits_over_1s": sum(1 for w in waits if w > 1.0),
        "failed_without_retry": unanswered,
        "errors": dict(Counter(r["error"] for r in res if not r["ok"]).most_common(3)),
        "waits_s": [round(w, 4) for w in waits],
        "latency_s": [round(r["end"] - r["start"], 4) for r in ok],
    }


async def one_run(
    ctx: Context, http: Any, system: str, scenario: str, param: float, n: int
) -> dict[str, Any]:
    """Fresh mock, fresh system under test, one warm-up turn, then the scenario."""
    ctx.serial += 1
    tag = f"r{ctx.serial}"
    row: dict[str, Any] = {"system": system, "scenario": scenario, "param": param, "turns": n}
    why = ctx.not_run(system)
    if why:
        return {**row, "not_run": why}
    mock = make_mock(seed=ctx.prof.seed)
    await mock.start()
    try:
        try:
            sut = await asyncio.to_thread(start_sut, ctx, system, mock.url, tag)
        except Exception as exc:
            why = " ".join(f"did not start: {exc}".split())[:300]
            if system == "litellm":  # not again for every run: it would wait minutes each
                ctx.litellm, ctx.litellm_reason = None, why
            return {**row, "not_run": why}
        try:
            problem = await warm(http, sut)
            if problem:
                return {**row, "not_run": " ".join(problem.split())}
            if scenario == "busy":
                return {**row, **await busy_run(ctx, http, sut, mock, tag)}
            return {**row, **await outage_run(ctx, http, sut, mock, scenario, param, n, tag)}
        finally:
            await asyncio.to_thread(stop_sut, ctx, sut)
    finally:
        await mock.stop()


def plan(prof: Profile, systems: Sequence[str]) -> list[tuple[str, str, float, int]]:
    """(system, scenario, parameter, turns) of every run, in order."""
    runs: list[tuple[str, str, float, int]] = []
    for scenario, params in (("time", prof.outages), ("count", prof.counts)):
        for p in params:
            for n in (1, prof.turns):
                for s in systems:
                    if s == "redis" and n == 1:
                        continue  # two relays share the many turns; a lone turn has one
                    runs.append((s, scenario, float(p), n))
    if prof.busy_seconds > 0:
        runs += [(s, "busy", 0.0, 0) for s in systems]
    return runs


def describe(r: dict[str, Any]) -> str:
    if r["scenario"] == "time":
        return f"{r['param']:g} s outage, {r['turns']} turn{'s' if r['turns'] > 1 else ''}"
    if r["scenario"] == "count":
        return f"{r['param']:g} × 503, {r['turns']} turn{'s' if r['turns'] > 1 else ''}"
    return "busy"


def summary_line(r: dict[str, Any]) -> str:
    head = f"{r['system']:8s} {r['scenario']:5s} {describe(r):22s}"
    if "not_run" in r:
        return f"{head} not run: {r['not_run']}"
    if r["scenario"] == "busy":
        w = r["waits"]
        return (
            f"{head} {r['completed']}/{r['turns']} completed, latency p50 "
            f"{fnum(r['latency']['p50'])} s; retry wait mean {fnum(w['mean'])} s, max "
            f"{fnum(w['max'])} s"
        )
    rc = r["recovery"]
    return (
        f"{head} {r['completed']}/{r['turns']} completed; recovery p50 {fnum(rc['p50'])} "
        f"max {fnum(rc['max'])} s; during the outage ({r['outage_s']:.1f} s) "
        f"{fnum(r['rps_first'])} first + {fnum(r['rps_rest'])} other req/s"
    )


async def run_all(ctx: Context, runs: list[tuple[str, str, float, int]]) -> list[dict[str, Any]]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    results = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        for k, (system, scenario, param, n) in enumerate(runs):
            log(f"run {k + 1}/{len(runs)}: {system}, {scenario} {param:g}, {n or 'busy'} turns")
            r = await one_run(ctx, http, system, scenario, param, n)
            log("  " + summary_line(r))
            results.append(r)
    return results
