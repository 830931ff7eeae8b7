"""soak.py's load: streamed turns under injected faults, each turn's bytes checked, RSS
and fds sampled; and the leak check.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from soak_procs import TOKEN, RedisProcess, RelayProcess

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from unbroken.core.wire.sse import SSESplitter  # noqa: E402
from unbroken.mock import MockProvider, frames_for  # noqa: E402

PATHS = {"chat": "v1/chat/completions", "responses": "v1/responses", "anthropic": "v1/messages"}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "responses": {"model": "m", "input": "hi", "stream": True, "store": False},
    "anthropic": {
        "model": "m",
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    },
}
SHAPE = {"deltas": 20, "chunk_delay_ms": 100}
FAULTS = [
    "503",
    "429",
    "500",
    "close_before_headers",
    "reset_after_headers",
    "reset",
    "stall",
    "end",
    "error_event",
    "malformed",
]
TURN_LIMIT_S = 90.0


def fault_action(kind: str, rng: random.Random) -> dict[str, Any]:
    k = rng.randint(0, 12)
    if kind == "503":
        return {"status": 503}
    if kind == "429":
        return {"status": 429, "headers": {"Retry-After": "1"}}
    if kind == "500":
        return {"status": 500}
    if kind in ("close_before_headers", "reset_after_headers"):
        return {"fault": kind}
    if kind == "stall":
        return {**SHAPE, "fault": "stall", "after_frame": k, "seconds": 30}
    if kind == "error_event":
        return {**SHAPE, "fault": "error_event", "after_frame": k, "error": "overloaded"}
    return {**SHAPE, "fault": kind, "after_frame": k}


# -- the relay process --------------------------------------------------------------------


@dataclass
class Counts:
    turns: int = 0
    clean: int = 0  # every frame, no fault injected
    recovered: int = 0  # a fault injected, every frame arrived anyway
    ended_with_error: int = 0  # a prefix, then the protocol's error event
    aborted: int = 0  # the client went away on purpose
    slow: int = 0
    faults: int = 0
    duplicates: int = 0
    unexpected: int = 0
    hangs: int = 0
    errors: list[str] = field(default_factory=list)

    def add_error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)


def is_error_event(proto: str, raw: bytes, name: str | None, data: str | None) -> bool:
    if proto == "chat":
        return data is not None and (data == "[DONE]" or data.lstrip().startswith('{"error"'))
    if proto == "responses":
        return name in ("error", "response.failed")
    return name == "error"


def check_turn(proto: str, received: bytes, counts: Counts, faulted: bool) -> None:
    clean = frames_for(proto, SHAPE, BODIES[proto])
    events = [e for e in SSESplitter().feed(received) if not e.is_comment]
    i = 0
    while i < len(events) and i < len(clean) and events[i].raw == clean[i]:
        i += 1
    rest = events[i:]
    if i == len(clean) and not rest:
        if faulted:
            counts.recovered += 1
        else:
            counts.clean += 1
        return
    if rest and all(is_error_event(proto, e.raw, e.name, e.data) for e in rest):
        counts.ended_with_error += 1
        if not faulted:
            counts.unexpected += 1
            counts.add_error(f"{proto}: error event without an injected fault")
        return
    counts.duplicates += 1
    where = rest[0].raw[:120] if rest else b"(stream ended early)"
    counts.add_error(f"{proto}: frame {i} is not the expected one: {where!r}")


async def one_turn(
    session: aiohttp.ClientSession,
    relay_url: str,
    mock: MockProvider,
    key: str,
    proto: str,
    rng: random.Random,
    counts: Counts,
    fault_rate: float,
) -> None:
    faulted = rng.random() < fault_rate
    abort = rng.random() < 0.03
    slow = rng.random() < 0.05
    if faulted:
        counts.faults += 1
        mock.script([fault_action(rng.choice(FAULTS), rng)], key=key)
    headers = {"x-unbroken-token": TOKEN, "x-mock-key": key}
    counts.turns += 1
    try:
        async with asyncio.timeout(TURN_LIMIT_S):
            async with session.post(
                f"{relay_url}/mock/{PATHS[proto]}", json=BODIES[proto], headers=headers
            ) as r:
                if r.status != 200:
                    counts.unexpected += 1
                    counts.add_error(f"{proto}: HTTP {r.status}")
                    await r.read()
                    return
                chunks: list[bytes] = []
                stop_after = rng.randint(1, 10) if abort else None
                async for chunk in r.content.iter_any():
                    chunks.append(chunk)
                    if stop_after is not None and len(chunks) >= stop_after:
                        counts.aborted += 1
                        r.close()  # the client goes away mid-stream
                        return
                    if slow:
                        await asyncio.sleep(0.05)  # a slow reader's own pace
                if slow:
                    counts.slow += 1
                check_turn(proto, b"".join(chunks), counts, faulted)
    except TimeoutError:
        counts.hangs += 1
        counts.add_error(f"{proto}: no end within {TURN_LIMIT_S:.0f} s")
    except aiohttp.ClientError as exc:
        counts.unexpected += 1
        counts.add_error(f"{proto}: {type(exc).__name__}: {exc}")
    finally:
        mock._queues.pop(key, None)  # an unconsumed fault must not stay queued (private API)


# -- the soak -------------------------------------------------------------------------------


@dataclass
class SoakReport:
    duration_s: float
    streams: int
    fault_rate: float
    warmup_s: float
    sample_s: float
    samples: list[dict[str, Any]]
    idle_before: dict[str, Any]
    idle_after: dict[str, Any]
    counts: Counts
    failures: list[str]
    started: str
    stderr_tail: str = ""
    load_start: float = 0.0
    load_end: float = 0.0
    workers: int = 0
    redis: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures


def _grows(values: list[float]) -> tuple[bool, float, float]:
    third = max(1, len(values) // 3)
    first, last = max(values[:third]), max(values[-third:])
    return last > first * 1.10 + 10, first, last


def worker_series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Each worker's (t, RSS MiB) samples, by pid (a restarted worker is a new series)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for pid, rss in (s.get("workers") or {}).items():
            out.setdefault(pid, []).append((s["t"], rss))
    return out


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares growth of RSS in MiB per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var


def verdict(r: SoakReport) -> list[str]:
    failures: list[str] = []
    after = [s for s in r.samples if s["t"] >= r.warmup_s]
    if len(after) >= 2:
        series = {pid: pts for pid, pts in worker_series(after).items() if len(pts) >= 2} or {
            "relay": [(s["t"], s["rss_mib"]) for s in after]
        }
        for pid, pts in series.items():
            base = pts[0][1]
            peak = max(v for _, v in pts)
            if peak > base * 1.10:
                who = "RSS" if pid == "relay" else f"worker {pid}'s RSS"
                failures.append(
                    f"{who} drifted {100 * (peak / base - 1):.1f} % after warm-up "
                    f"({base:.1f} -> {peak:.1f} MiB)"
                )
        for key in ("fds",) if r.workers > 1 else ("fds", "tasks"):
            grew, first, last = _grows([float(s[key]) for s in after])
            if grew:
                failures.append(f"{key} grew under steady load: {first:.0f} -> {last:.0f}")
    else:
        failures.append("too few samples after warm-up to judge drift")
    c = r.counts
    if c.duplicates:
        failures.append(f"{c.duplicates} turn(s) with a duplicate or misplaced frame")
    if c.hangs:
        failures.append(f"{c.hangs} turn(s) hung")
    if c.unexpected:
        failures.append(f"{c.unexpected} unexpected answer(s)")
    if r.workers <= 1 and r.idle_after["tasks"] > r.idle_before["tasks"] + 2:
        failures.append(
            f"tasks did not return to idle: {r.idle_before['tasks']} -> {r.idle_after['tasks']}"
        )
    if r.idle_after["connections"] > 1 or r.idle_after["inflight"]:
        failures.append(f"connections/turns still open after the load: {r.idle_after}")
    if any(s.get("journal_healthy") is False for s in r.samples):
        failures.append("the journal reported a write failure")
    return failures


async def run_soak(
    duration_s: float = 600,
    streams: int = 200,
    fault_rate: float = 0.05,
    warmup_s: float = 120,
    sample_s: float = 10,
    seed: int = 1,
    log: Any = None,
    workers: int = 0,
    redis: bool = False,
) -> SoakReport:
    rng = random.Random(seed)
    counts = Counts()
    samples: list[dict[str, Any]] = []
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="unbroken-soak-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            mock = await stack.enter_async_context(MockProvider(record=False, default=SHAPE))
            store = ""
            if redis:
                store = (await stack.enter_async_context(RedisProcess(Path(tmp) / "redis"))).url
            relay = await stack.enter_async_context(
                RelayProcess(mock.url, Path(tmp), workers, store)
            )
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
            conn = aiohttp.TCPConnector(limit=0, force_close=False)
            async with (
                aiohttp.ClientSession(timeout=timeout, connector=conn) as session,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as probe,
            ):
                idle_before = await relay.wait_idle(probe)
                t0 = time.monotonic()
                end = t0 + duration_s

                async def client(i: int) -> None:
                    crng = random.Random(rng.random())
                    n = 0
                    while time.monotonic() < end:
                        proto = ("chat", "responses", "anthropic")[n % 3]
                        await one_turn(
                            session, relay.url, mock, f"c{i}-{n}", proto, crng, counts, fault_rate
                        )
                        n += 1

                async def sampler() -> None:
                    while True:
                        await asyncio.sleep(sample_s)  # the sampling period itself
                        s = await relay.sample(probe)
                        s["t"] = round(time.monotonic() - t0, 1)
                        s["turns"] = counts.turns
                        samples.append(s)
                        if log:
                            per = " ".join(f"{k}:{v}" for k, v in (s.get("workers") or {}).items())
                            log(
                                f"t={s['t']:6.1f}s turns={counts.turns:6d} rss={s['rss_mib']:6.1f}"
                                f" MiB fds={s['fds']} tasks={s['tasks']} conns={s['connections']}"
                                f" journal={s['journal_kib']} KiB"
                                + (f" workers {per} store={s.get('store')}" if per else "")
                            )

                sampling = asyncio.create_task(sampler())
                try:
                    await asyncio.gather(*(client(i) for i in range(streams)))
                finally:
                    sampling.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sampling
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as probe:
                idle_after = await relay.wait_idle(probe)
            tail = relay.stderr()[-3000:]
    report = SoakReport(
        duration_s=duration_s,
        streams=streams,
        fault_rate=fault_rate,
        warmup_s=warmup_s,
        sample_s=sample_s,
        samples=samples,
        idle_before=idle_before,
        idle_after=idle_after,
        counts=counts,
        failures=[],
        started=started,
        stderr_tail=tail,
        load_start=load_start,
        load_end=os.getloadavg()[0],
        workers=workers,
        redis=redis,
    )
    report.failures = verdict(report)
    if "Traceback" in tail:
        report.failures.append("the relay printed a traceback")
    return report


# -- the leak check -------------------------------------------------------------------------


@dataclass
class LeakReport:
    requests: int
    aborted: int
    idle_before: dict[str, Any]
    idle_after: dict[str, Any]
    concurrency: int
    failures: list[str]


async def run_leak_check(
    requests: int = 2000,
    concurrency: int = 20,
    abort_rate: float = 0.3,
    seed: int = 2,
) -> LeakReport:
    rng = random.Random(seed)
    shape = {"deltas": 8, "chunk_delay_ms": 5}
    aborted = 0
    with tempfile.TemporaryDirectory(prefix="unbroken-leak-") as tmp:
        async with (
            MockProvider(record=False, default=shape) as mock,
            RelayProcess(mock.url, Path(tmp)) as relay,
        ):
            headers = {"x-unbroken-token": TOKEN}
            url = f"{relay.url}/mock/{PATHS['chat']}"

            async def batch(n: int, abort_share: float) -> None:
                nonlocal aborted
                sem = asyncio.Semaphore(concurrency)
                async with aiohttp.ClientSession() as session:

                    async def one() -> None:
                        nonlocal aborted
                        async with (
                            sem,
                            session.post(url, json=BODIES["chat"], headers=headers) as r,
                        ):
                            if rng.random() < abort_share:
                                await r.content.readany()
                                aborted += 1
                                r.close()
                            else:
                                await r.read()

                    await asyncio.gather(*(one() for _ in range(n)))

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as probe:
                await batch(concurrency * 3, 0.0)  # warm-up: the upstream pool fills
                idle_before = await relay.wait_idle(probe)
                counted = aborted
                await batch(requests, abort_rate)
                idle_after = await relay.wait_idle(probe)
            aborted -= counted
            stderr = relay.stderr()
    failures: list[str] = []
    if idle_after["tasks"] > idle_before["tasks"]:
        failures.append(f"tasks {idle_before['tasks']} -> {idle_after['tasks']}")
    if idle_after["fds"] > idle_before["fds"] + concurrency:
        failures.append(
            f"fds {idle_before['fds']} -> {idle_after['fds']} (pool slack {concurrency})"
        )
    if idle_after["connections"] > 1 or idle_after["inflight"]:
        failures.append(f"not idle after the load: {idle_after}")
    if "Traceback" in stderr:
        failures.append("the relay printed a traceback")
    return LeakReport(requests, aborted, idle_before, idle_after, concurrency, failures)


# -- report ---------------------------------------------------------------------------------
