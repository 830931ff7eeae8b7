"""HTTP benchmark: direct to the mock vs a bare aiohttp proxy vs unbroken.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/http_bench.py [--quick] [--out docs/performance.md] [--json FILE]

Everything runs in separate processes on loopback, on ephemeral ports:

* the mock provider (``unbroken.mock.MockProvider``; request recording is
  switched off so its memory and GC work stay flat over ~10^5 requests),
* the systems under test, pinned to CPU 0 with ``taskset -c 0``: the bare
  pass-through proxy (``bench/bare_proxy.py``, the floor) and
  ``python -m unbroken serve``,
* one load generator (aiohttp client), pinned to CPU 1 together with the mock,
  so the system under test has a core of its own.  "direct" (client -> mock)
  uses the same CPU 1 and so measures the harness's own limit.

The machine is shared and noisy: every metric is compared against the direct
path measured in the same run, and every number is a median over several
repetitions (interleaved across paths where that matters).

Metrics (see ``docs/performance.md`` for the definitions and the last results):
added time to first text delta (c=1), streamed req/s (c=64), relay CPU per SSE
frame (chat, responses, messages), idle RSS and RSS per open stream, and the
time the dispatch gate holds a streamed tool call back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SUT_CPU = 0  # the system under test
HARNESS_CPU = 1  # mock + load generator

# Issue 13's targets, each against the bare pass-through measured in the same run
# (memory: no worse than when the issue was filed, in absolute terms).
TARGETS = {
    "ttfc_added_over_bare_ms": 0.15,  # unbroken's added TTFC p50 - bare's
    "rps_per_core_vs_bare": 0.8,  # streamed (c=64) and non-streamed (c=32)
    "cpu_per_frame_vs_bare": 1.3,
    "idle_rss_mib": 44.0,
    "kib_per_stream": 26.7,
}

PROTOCOLS: dict[str, dict[str, Any]] = {
    # path after the route, request body, marker of the first text delta in the bytes
    "chat": {
        "path": "v1/chat/completions",
        "body": {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        "text_marker": '"delta":{"content":"',
    },
    "responses": {
        "path": "v1/responses",
        "body": {"model": "bench", "stream": True, "input": "hi"},
        "text_marker": "response.output_text.delta",
    },
    "messages": {
        "path": "v1/messages",
        "body": {
            "model": "bench",
            "stream": True,
            "max_tokens": 1024,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "text_marker": '"text_delta"',
    },
}
TOOL_MARKER = '"tool_calls"'
BIG_BODY_KIB = 256  # an agent turn late in a session: long history, tool outputs


@dataclass(frozen=True)
class Profile:
    reps: int  # repetitions, each on freshly started SUT processes
    ttfc_n: int  # sequential requests per path per repetition
    tool_n: int
    rps_duration_s: float
    rps_warmup_s: float
    cpu_requests: int  # streamed requests per CPU run
    cpu_concurrency: int
    cpu_deltas: int
    cpu_delay_ms: float
    mem_streams: int
    mem_reps: int
    big_n: int  # TTFC requests per path per repetition with the large body
    big_streams: int  # open streams with the large body
    settle_s: float = 1.0  # a pause for RSS to settle before it is read


FULL = Profile(
    reps=5,
    ttfc_n=300,
    tool_n=40,
    rps_duration_s=5.0,
    rps_warmup_s=1.0,
    cpu_requests=96,
    cpu_concurrency=16,
    cpu_deltas=200,
    cpu_delay_ms=2.0,
    mem_streams=500,
    mem_reps=2,
    big_n=60,
    big_streams=100,
)
QUICK = Profile(
    reps=1,
    ttfc_n=30,
    tool_n=6,
    rps_duration_s=0.8,
    rps_warmup_s=0.3,
    cpu_requests=16,
    cpu_concurrency=8,
    cpu_deltas=200,
    cpu_delay_ms=2.0,
    mem_streams=200,
    mem_reps=1,
    big_n=10,
    big_streams=40,
    settle_s=0.2,
)


# =====================================================================================
# /proc helpers (Linux)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# =====================================================================================
# Load generator (runs in its own process: ``http_bench.py --loadgen``)
#
# Line protocol: one JSON command per stdin line, one JSON answer per stdout line.


class _Gen:
    def __init__(self) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self.held: list[asyncio.Task[None]] = []
        self.release = asyncio.Event()

    async def one(
        self, url: str, body: bytes, headers: dict[str, str], marker: bytes | None
    ) -> tuple[float | None, float, int, int]:
        """One streamed request: (first marker s, end s, SSE frames, body reads)."""
        t0 = time.perf_counter()
        first: float | None = None
        frames = reads = 0
        tail = b""
        last_lf = False
        keep = len(marker) - 1 if marker else 0
        async with self.session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300]
                raise RuntimeError(f"HTTP {resp.status}: {text!r}")
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                reads += 1
                if marker is not None and first is None:
                    if marker in (tail + chunk if tail else chunk):
                        first = now - t0
                    else:
                        tail = chunk[-keep:]
                frames += chunk.count(b"\n\n") + (1 if last_lf and chunk[:1] == b"\n" else 0)
                last_lf = chunk[-1:] == b"\n"
        return first, time.perf_counter() - t0, frames, reads

    async def cmd_ttfc(self, c: dict[str, Any]) -> dict[str, Any]:
        """Sequential requests, interleaved over the targets, order rotated each round."""
        targets: list[list[str]] = c["targets"]
        body = c["body"].encode()
        headers = c["headers"]
        marker = c["marker"].encode()
        first: dict[str, list[float]] = {name: [] for name, _ in targets}
        end: dict[str, list[float]] = {name: [] for name, _ in targets}
        errors: dict[str, int] = {name: 0 for name, _ in targets}
        last_error = ""
        for _name, url in targets:  # warm the connections
            for _ in range(c.get("warmup", 3)):
                with contextlib.suppress(Exception):
                    await self.one(url, body, headers, marker)
        k = len(targets)
        gap = c.get("gap_ms", 0) / 1000
        for i in range(c["n"]):
            for j in range(k):
                name, url = targets[(i + j) % k]
                if gap:
                    # every system under test shares one CPU: let the last one finish its
                    # turn's bookkeeping first, or its tail is charged to this request
                    await asyncio.sleep(gap)
                try:
                    f, e, _, _ = await self.one(url, body, headers, marker)
                except Exception as exc:
                    errors[name] += 1
                    last_error = repr(exc)
                    continue
                if f is None:
                    errors[name] += 1
                    last_error = f"{name}: marker not seen"
                    continue
                first[name].append(f * 1000)
                end[name].append(e * 1000)
        return {"first_ms": first, "end_ms": end, "errors": errors, "last_error": last_error}

    async def cmd_throughput(self, c: dict[str, Any]) -> dict[str, Any]:
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        conc, warmup, duration = c["concurrency"], c["warmup"], c["duration"]
        pids: list[int] = c.get("cpu_pids", [])
        loop = asyncio.get_running_loop()
        t_start = loop.time() + warmup
        t_end = t_start + duration
        done = 0
        errors = 0
        frames = 0
        last_error = ""
        cpu: dict[str, list[float]] = {}

        async def client() -> None:
            nonlocal done, errors, frames, last_error
            while loop.time() < t_end:
                try:
                    _, _, nf, _ = await self.one(url, body, headers, None)
                except Exception as exc:
                    errors += 1
                    last_error = repr(exc)
                    await asyncio.sleep(0.01)
                    continue
                now = loop.time()
                if t_start <= now < t_end:
                    done += 1
                    frames += nf

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, t_start - loop.time()))
            cpu["start"] = [cpu_seconds(p) for p in pids] + [time.perf_counter()]
            await asyncio.sleep(max(0.0, t_end - loop.time()))
            cpu["end"] = [cpu_seconds(p) for p in pids] + [time.perf_counter()]

        await asyncio.gather(sampler(), *(client() for _ in range(conc)))
        wall = cpu["end"][-1] - cpu["start"][-1]
        util = [(b - a) / wall for a, b in zip(cpu["start"][:-1], cpu["end"][:-1], strict=True)]
        return {
            "rps": done / wall,
            "done": done,
            "frames_per_req": frames / done if done else 0.0,
            "wall_s": wall,
            "errors": errors,
            "last_error": last_error,
            "cpu_util": dict(zip(map(str, pids), util, strict=True)),
        }

    async def cmd_batch(self, c: dict[str, Any]) -> dict[str, Any]:
        """``n`` streamed requests at ``concurrency``; SSE frames and body reads counted."""
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        queue = list(range(c["n"]))
        totals = {"frames": 0, "reads": 0, "ok": 0, "errors": 0}
        last_error = ""

        async def client() -> None:
            nonlocal last_error
            while queue:
                queue.pop()
                try:
                    _, _, nf, nr = await self.one(url, body, headers, None)
                except Exception as exc:
                    totals["errors"] += 1
                    last_error = repr(exc)
                    continue
                totals["ok"] += 1
                totals["frames"] += nf
                totals["reads"] += nr

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c["concurrency"])))
        return {**totals, "wall_s": time.perf_counter() - t0, "last_error": last_error}

    async def cmd_multi(self, c: dict[str, Any]) -> dict[str, Any]:
        """Several commands at once (e.g. one batch per SUT, so they share the same noise)."""
        results = await asyncio.gather(*(getattr(self, f"cmd_{j['op']}")(j) for j in c["jobs"]))
        return {"results": list(results)}

    async def cmd_hold(self, c: dict[str, Any]) -> dict[str, Any]:
        """Open ``n`` streams, wait until each has its first body bytes, keep them open."""
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        n = c["n"]
        self.release = asyncio.Event()
        ready = 0
        failed = 0
        last_error = ""
        all_ready = asyncio.Event()

        async def hold_one() -> None:
            nonlocal ready, failed, last_error
            resp = None
            try:
                resp = await self.session.post(url, data=body, headers=headers)
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                await resp.content.readany()
                ready += 1
            except Exception as exc:
                failed += 1
                last_error = repr(exc)
                if resp is not None:
                    resp.close()
                return
            finally:
                if ready + failed >= n:
                    all_ready.set()
            try:
                await self.release.wait()
            finally:
                resp.close()

        self.held = [asyncio.ensure_future(hold_one()) for _ in range(n)]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(c.get("timeout", 60)):
                await all_ready.wait()
        return {"ready": ready, "failed": failed, "last_error": last_error}

    async def cmd_release(self, c: dict[str, Any]) -> dict[str, Any]:
        self.release.set()
        for t in self.held:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.held, return_exceptions=True)
        n = len(self.held)
        self.held = []
        return {"released": n}

    async def close(self) -> None:
        await self.cmd_release({})
        await self.session.close()


async def _loadgen_main() -> None:
    gen = _Gen()
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                return
            try:
                result = await getattr(gen, f"cmd_{op}")(cmd)
            except Exception as exc:
                result = {"fatal": repr(exc)}
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
    finally:
        await gen.close()


def loadgen_main() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_loadgen_main())


# =====================================================================================
# The mock provider process (``http_bench.py --mock``)


async def _mock_main() -> None:
    from unbroken.mock import MockProvider

    class BenchMock(MockProvider):
        def _record(self, rec: Any) -> None:  # keep memory and GC work flat
            pass

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with BenchMock(host="127.0.0.1", port=0) as mock:
        print(f"bench mock listening on {mock.url}", flush=True)
        await stop.wait()


def mock_main() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_mock_main())


# =====================================================================================
# Orchestration


def _die_with_parent() -> None:
    """preexec: SIGTERM this child when the benchmark dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; survives exec


class Proc:
    """A child process with stdout/stderr in files and a "ready" line with its URL."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        *,
        cpu: int | None,
        pinning: str,
        ready: str | None,
        pipe_stdio: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        self._err = open(self.err_path, "wb")
        self._out = None if pipe_stdio else open(self.out_path, "wb")
        cmd = list(argv)
        preexec: Callable[[], None] = _die_with_parent
        if cpu is not None and pinning == "taskset":
            cmd = ["taskset", "-c", str(cpu), *cmd]
        elif cpu is not None and pinning == "sched_setaffinity":

            def preexec() -> None:
                _die_with_parent()
                os.sched_setaffinity(0, {cpu})

        self.popen = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE if pipe_stdio else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_stdio else self._out,
            stderr=self._err,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children
            preexec_fn=preexec,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.pid = self.popen.pid
        self.url = ""
        if ready is not None:
            self.url = self._wait_ready(ready)

    def _wait_ready(self, pattern: str, timeout: float = 30.0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.out_path.read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start:\n{self.err_path.read_text()[-2000:]}")

    def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command line to a --loadgen child, wait for its one answer line."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write((json.dumps(cmd) + "\n").encode())
        self.popen.stdin.flush()
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.name}: no answer to {cmd['op']} within {timeout:.0f}s")
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited:\n{self.err_path.read_text()[-2000:]}")
        result: dict[str, Any] = json.loads(line)
        if "fatal" in result:
            raise RuntimeError(f"{self.name}: {cmd['op']} failed: {result['fatal']}")
        return result

    def stop(self) -> None:
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(5)
        for f in (self._out, self._err, p.stdin, p.stdout):
            if f is not None:
                with contextlib.suppress(Exception):
                    f.close()


class Fleet:
    """Every child process, stopped in reverse order on exit (also on Ctrl-C)."""

    def __init__(self, workdir: Path, pinning: str) -> None:
        self.workdir = workdir
        self.pinning = pinning
        pinned = pinning != "none"
        self.sut_cpu = SUT_CPU if pinned else None
        self.harness_cpu = HARNESS_CPU if pinned else None
        self.procs: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], **kw: Any) -> Proc:
        p = Proc(name, argv, self.workdir, pinning=self.pinning, **kw)
        self.procs.append(p)
        return p

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        while self.procs:
            self.procs.pop().stop()


@dataclass
class SUTs:
    bare: Proc
    unbroken: Proc

    def items(self) -> list[tuple[str, Proc]]:
        return [("bare", self.bare), ("unbroken", self.unbroken)]


def start_suts(fleet: Fleet, mock_url: str, tag: str, *, extra_config: str = "") -> SUTs:
    """``extra_config``: TOML appended to unbroken's config (for experiments)."""
    bare = fleet.start(
        f"bare-{tag}",
        [PY, str(ROOT / "bench" / "bare_proxy.py"), "--upstream", mock_url, "--port", "0"],
        cpu=fleet.sut_cpu,
        ready=r"listening on (http://\S+)",
    )
    return SUTs(bare, start_unbroken(fleet, mock_url, tag, extra_config=extra_config))


def start_unbroken(
    fleet: Fleet,
    mock_url: str,
    tag: str,
    *,
    extra_config: str = "",
    python_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> Proc:
    """``unbroken serve`` in front of the mock: ``[retry] verbose = false``, defaults
    otherwise.  ``python_args`` go before ``-m unbroken`` (e.g. ``-m cProfile -o F``);
    ``env`` adds to the child's environment (e.g. ``PYTHONPATH`` of another tree);
    ``launcher`` goes before the interpreter (e.g. ``valgrind --tool=callgrind``)."""
    cfg = fleet.workdir / f"unbroken-{tag}.toml"
    cfg.write_text(
        "[server]\ngrace_s = 1.0\n\n[retry]\nverbose = false\n\n"
        f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
        + (f"\n{extra_config}\n" if extra_config else "")
    )
    # Anything unbroken persists by default (the turn journal) goes to a directory of
    # this run, never to the user's state directory.
    state = fleet.workdir / f"state-{tag}"
    state.mkdir(exist_ok=True)
    return fleet.start(
        f"unbroken-{tag}",
        [
            *launcher,
            PY,
            *python_args,
            "-m",
            "unbroken",
            "serve",
            "--config",
            str(cfg),
            "--port",
            "0",
        ],
        cpu=fleet.sut_cpu,
        ready=r"relaying on (http://\S+)",
        env={"XDG_STATE_HOME": str(state), "HOME": str(state), **(env or {})},
    )


def _headers(action: dict[str, Any]) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "x-mock-action": json.dumps(action, separators=(",", ":")),
    }


def _spec(protocol: str, action: dict[str, Any]) -> dict[str, Any]:
    p = PROTOCOLS[protocol]
    return {"body": json.dumps(p["body"]), "headers": _headers(action)}


def _urls(mock_url: str, suts: SUTs, protocol: str) -> dict[str, str]:
    path = PROTOCOLS[protocol]["path"]
    return {
        "direct": f"{mock_url}/{path}",
        "bare": f"{suts.bare.url}/mock/{path}",
        "unbroken": f"{suts.unbroken.url}/mock/{path}",
    }


def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------
# The measurements.  Each repetition runs on freshly started SUT processes: on this VM two
# processes of the same code can differ persistently by 10-30 % in CPU per frame (memory
# layout, cache placement), so a single long-lived instance would bias every number.


PATHS = ("direct", "bare", "unbroken")
SUT_NAMES = ("bare", "unbroken")


def latency_rep(
    gen: Proc, urls: dict[str, str], spec: dict[str, Any], marker: str, n: int
) -> dict[str, Any]:
    """One repetition: n sequential requests per path, interleaved; p50/p99 of the marker."""
    r = gen.call(
        {"op": "ttfc", "targets": [[p, urls[p]] for p in PATHS], "n": n, "marker": marker, **spec},
        timeout=120 + n * 3,
    )
    rep: dict[str, Any] = {"errors": r["errors"], "last_error": r["last_error"]}
    for p in PATHS:
        first, end = r["first_ms"][p], r["end_ms"][p]
        rep[p] = {
            "p50": pct(first, 50),
            "p99": pct(first, 99),
            "end_p50": pct(end, 50),
            "n": len(first),
        }
    return rep


def aggregate_latency(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across repetitions; added = path - direct of the same percentile and rep."""
    out: dict[str, Any] = {
        "per_rep": reps,
        "errors": {p: sum(r["errors"][p] for r in reps) for p in PATHS},
        "last_error": next((r["last_error"] for r in reps if r["last_error"]), ""),
    }
    for p in PATHS:
        out[p] = {k: med([r[p][k] for r in reps]) for k in ("p50", "p99", "end_p50")}
        out[p]["added_p50"] = med([r[p]["p50"] - r["direct"]["p50"] for r in reps])
        out[p]["added_p99"] = med([r[p]["p99"] - r["direct"]["p99"] for r in reps])
        out[p]["samples"] = sum(int(r[p]["n"]) for r in reps)
    return out


def throughput_rep(
    gen: Proc,
    mock: Proc,
    urls: dict[str, str],
    suts: SUTs,
    spec: dict[str, Any],
    prof: Profile,
    rep: int,
    concurrency: int = 64,
) -> dict[str, dict[str, Any]]:
    sut_pid = {"direct": None, "bare": suts.bare.pid, "unbroken": suts.unbroken.pid}
    out: dict[str, dict[str, Any]] = {}
    for p in PATHS[rep % 3 :] + PATHS[: rep % 3]:
        pid = sut_pid[p]
        pids = [mock.pid, gen.pid] + ([pid] if pid else [])
        r = gen.call(
            {
                "op": "throughput",
                "url": urls[p],
                "concurrency": concurrency,
                "warmup": prof.rps_warmup_s,
                "duration": prof.rps_duration_s,
                "cpu_pids": pids,
                **spec,
            },
            timeout=120,
        )
        util = r["cpu_util"]
        r["mock_util"] = util[str(mock.pid)]
        r["gen_util"] = util[str(gen.pid)]
        r["sut_util"] = util[str(pid)] if pid else None
        # Requests per CPU-second of the SUT: its capacity on one core, harness limits aside.
        r["per_core"] = r["rps"] / r["sut_util"] if r["sut_util"] else None
        out[p] = r
        log(
            f"  c={concurrency} {p:8s}: {r['rps']:6.0f} req/s, errors {r['errors']}"
            + (
                f", SUT CPU {r['sut_util']:.0%} -> {r['per_core']:5.0f} req per SUT CPU-s"
                if pid
                else ""
            )
            + f", mock {r['mock_util']:.0%} + loadgen {r['gen_util']:.0%}"
        )
    return out


def aggregate_throughput(reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": {p: [r[p] for r in reps] for p in PATHS}}
    # paired within a repetition (same minute, same noise), then the median
    out["per_core_ratio"] = med([r["unbroken"]["per_core"] / r["bare"]["per_core"] for r in reps])
    for p in PATHS:
        rr = out["runs"][p]
        sut = p != "direct"
        out[p] = {
            "rps": med([r["rps"] for r in rr]),
            "rps_min": min(r["rps"] for r in rr),
            "rps_max": max(r["rps"] for r in rr),
            "errors": sum(r["errors"] for r in rr),
            "sut_util": med([r["sut_util"] for r in rr]) if sut else None,
            "per_core": med([r["per_core"] for r in rr]) if sut else None,
            "harness_util": med([r["mock_util"] + r["gen_util"] for r in rr]),
            "frames_per_req": med([r["frames_per_req"] for r in rr]),
        }
    return out


def cpu_rep(gen: Proc, mock_url: str, suts: SUTs, prof: Profile, rep: int) -> dict[str, Any]:
    """Per protocol: SUT utime+stime over a batch of streamed requests / SSE frames."""
    action = {"deltas": prof.cpu_deltas, "chunk_delay_ms": prof.cpu_delay_ms}
    out: dict[str, Any] = {}
    for proto in PROTOCOLS:
        spec = _spec(proto, action)
        urls = _urls(mock_url, suts, proto)
        order = suts.items() if rep % 2 == 0 else suts.items()[::-1]
        for name, _proc in order:  # warm-up: first-use imports, pools, caches
            gen.call(
                {"op": "batch", "url": urls[name], "n": 2, "concurrency": 2, **spec}, timeout=120
            )
        for name, proc in order:
            before = cpu_seconds(proc.pid)
            r = gen.call(
                {
                    "op": "batch",
                    "url": urls[name],
                    "n": prof.cpu_requests,
                    "concurrency": prof.cpu_concurrency,
                    **spec,
                },
                timeout=300,
            )
            used = cpu_seconds(proc.pid) - before
            frames = r["frames"]
            r.update(cpu_s=used, us_per_frame=used / frames * 1e6 if frames else float("nan"))
            out.setdefault(proto, {})[name] = r
            log(
                f"  cpu {proto:9s} {name:8s}: {r['us_per_frame']:5.1f} µs/frame "
                f"({used:.2f} s / {frames} frames; client reads/frame "
                f"{r['reads'] / max(frames, 1):.2f}; errors {r['errors']})"
            )
    return out


def aggregate_cpu(reps: list[dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for proto in PROTOCOLS:
        res[proto] = {}
        for name in SUT_NAMES:
            runs = [r[proto][name] for r in reps]
            res[proto][name] = {
                "runs": runs,
                "us_per_frame": med([r["us_per_frame"] for r in runs]),
                "frames_per_req": med([r["frames"] / max(r["ok"], 1) for r in runs]),
                "reads_per_frame": med([r["reads"] / max(r["frames"], 1) for r in runs]),
                "errors": sum(r["errors"] for r in runs),
            }
        # paired within a repetition (same minute, same noise), then the median
        res[proto]["ratio"] = med(
            [r[proto]["unbroken"]["us_per_frame"] / r[proto]["bare"]["us_per_frame"] for r in reps]
        )
        res[proto]["extra_us"] = med(
            [r[proto]["unbroken"]["us_per_frame"] - r[proto]["bare"]["us_per_frame"] for r in reps]
        )
    return res


def big_body(kib: int) -> str:
    """A deterministic agent-like chat request of about ``kib`` KiB: a long conversation."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40}]
    size = 0
    i = 0
    while size < kib * 1024:
        i += 1
        if i % 3 == 0:
            content = json.dumps({"stdout": f"line {i}\n" * 30, "exit_code": 0})
            msgs.append({"role": "tool", "tool_call_id": f"call_{i:06d}", "content": content})
        else:
            msgs.append(
                {
                    "role": "user" if i % 3 == 1 else "assistant",
                    "content": f"step {i}: " + "lorem ipsum dolor sit amet " * 20,
                }
            )
        size += len(json.dumps(msgs[-1]))
    return json.dumps({"model": "bench", "stream": True, "messages": msgs})


def _rss_per_stream(
    fleet: Fleet,
    gen: Proc,
    mock_url: str,
    tag: str,
    n: int,
    body: str | None,
    settle_s: float = 1.0,
) -> dict[str, Any]:
    """Fresh SUTs: idle RSS after one warm-up request, then with ``n`` open slow streams."""
    suts = start_suts(fleet, mock_url, tag)
    out: dict[str, Any] = {}
    try:
        warm = _spec("chat", {"deltas": 4})
        slow = _spec("chat", {"deltas": 600, "chunk_delay_ms": 1000})
        if body is not None:
            warm["body"] = slow["body"] = body
        urls = _urls(mock_url, suts, "chat")
        for name, _proc in suts.items():
            gen.call(
                {"op": "batch", "url": urls[name], "n": 1, "concurrency": 1, **warm}, timeout=30
            )
        time.sleep(settle_s)
        idle = {name: rss_kib(proc.pid) for name, proc in suts.items()}
        for name, proc in suts.items():
            h = gen.call(
                {"op": "hold", "url": urls[name], "n": n, "timeout": 60, **slow}, timeout=90
            )
            time.sleep(settle_s)
            samples = []
            for _ in range(3):
                samples.append(rss_kib(proc.pid))
                time.sleep(settle_s * 0.5)
            gen.call({"op": "release"}, timeout=60)
            loaded = max(samples)
            per = (loaded - idle[name]) / max(h["ready"], 1)
            out[name] = {
                "idle_kib": idle[name],
                "loaded_kib": loaded,
                "streams": h["ready"],
                "failed": h["failed"],
                "kib_per_stream": per,
                "last_error": h["last_error"],
            }
            log(
                f"  memory {tag} {name:8s}: idle {idle[name] / 1024:.1f} MiB, "
                f"{h['ready']} open streams {loaded / 1024:.1f} MiB -> {per:.1f} KiB/stream"
                + (f" ({h['failed']} failed: {h['last_error']})" if h["failed"] else "")
            )
            time.sleep(settle_s * 0.5)
    finally:
        fleet.stop(suts.bare)
        fleet.stop(suts.unbroken)
    return out


def aggregate_memory(runs: list[dict[str, Any]]) -> dict[str, Any]:
    memory: dict[str, Any] = {}
    for name in SUT_NAMES:
        rs = [r[name] for r in runs]
        memory[name] = {
            "idle_mib": med([r["idle_kib"] for r in rs]) / 1024,
            "loaded_mib": med([r["loaded_kib"] for r in rs]) / 1024,
            "kib_per_stream": med([r["kib_per_stream"] for r in rs]),
            "streams": min(r["streams"] for r in rs),
            "runs": rs,
        }
    return memory


# -------------------------------------------------------------------------------------
# Report


def machine_info(pinning: str) -> dict[str, Any]:
    import aiohttp

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = ""
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if dirty:
            commit += " (src/ has uncommitted changes)"
    from unbroken import __version__

    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "unbroken": __version__,
        "commit": commit,
        "pinning": pinning,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": os.getloadavg(),
    }


def _f(x: float | None, nd: int = 2) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:,.{nd}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}×"


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's targets: each row's ``value`` is what the target is about (a ratio or
    a difference against bare from the same run, or an absolute size)."""
    t = res["ttfc"]
    tp, ns = res["throughput"], res["throughput_ns"]
    cpu = res["cpu"]
    mem = res["memory"]
    lim = TARGETS
    rows: list[tuple[str, str, str, float, float, float, str, bool, int]] = [
        # (metric, short, target, unbroken, bare, value, value unit, pass, decimals)
        (
            "added TTFC p50 (chat, c=1)",
            "added-TTFC",
            f"≤ bare + {lim['ttfc_added_over_bare_ms']} ms",
            t["unbroken"]["added_p50"],
            t["bare"]["added_p50"],
            t["unbroken"]["added_p50"] - t["bare"]["added_p50"],
            "ms over bare",
            t["unbroken"]["added_p50"] - t["bare"]["added_p50"] <= lim["ttfc_added_over_bare_ms"],
            3,
        ),
        (
            "streamed req/s per core, c=64 (*)",
            "streamed-req/s",
            f"≥ {lim['rps_per_core_vs_bare']}× bare",
            tp["unbroken"]["per_core"],
            tp["bare"]["per_core"],
            tp["per_core_ratio"],
            "× bare",
            tp["per_core_ratio"] >= lim["rps_per_core_vs_bare"],
            0,
        ),
        (
            "non-streamed req/s per core, c=32 (*)",
            "non-streamed-req/s",
            f"≥ {lim['rps_per_core_vs_bare']}× bare",
            ns["unbroken"]["per_core"],
            ns["bare"]["per_core"],
            ns["per_core_ratio"],
            "× bare",
            ns["per_core_ratio"] >= lim["rps_per_core_vs_bare"],
            0,
        ),
    ]
    for proto in PROTOCOLS:
        d = cpu[proto]
        rows.append(
            (
                f"CPU per frame ({proto}), µs",
                f"CPU-per-frame-{proto}",
                f"≤ {lim['cpu_per_frame_vs_bare']}× bare",
                d["unbroken"]["us_per_frame"],
                d["bare"]["us_per_frame"],
                d["ratio"],
                "× bare",
                d["ratio"] <= lim["cpu_per_frame_vs_bare"],
                1,
            )
        )
    rows += [
        (
            "idle RSS, MiB",
            "idle-RSS",
            f"≤ {lim['idle_rss_mib']} MiB",
            mem["unbroken"]["idle_mib"],
            mem["bare"]["idle_mib"],
            mem["unbroken"]["idle_mib"] - mem["bare"]["idle_mib"],
            "MiB over bare",
            mem["unbroken"]["idle_mib"] <= lim["idle_rss_mib"],
            1,
        ),
        (
            "RSS per open stream, KiB",
            "RSS-per-stream",
            f"≤ {lim['kib_per_stream']} KiB",
            mem["unbroken"]["kib_per_stream"],
            mem["bare"]["kib_per_stream"],
            mem["unbroken"]["kib_per_stream"] - mem["bare"]["kib_per_stream"],
            "KiB over bare",
            mem["unbroken"]["kib_per_stream"] <= lim["kib_per_stream"],
            1,
        ),
    ]
    return [
        {
            "metric": m,
            "short": short,
            "target": tgt,
            "unbroken": u,
            "bare": b,
            "value": v,
            "value_unit": vu,
            "pass": ok and v == v,
            "nd": nd,
        }
        for m, short, tgt, u, b, v, vu, ok, nd in rows
    ]


def reflow(md: str, width: int = 92) -> str:
    """Re-wrap prose paragraphs and bullets; leave headings, tables and code blocks alone."""
    out: list[str] = []
    para: list[str] = []
    bullet = False
    fence = False

    def flush() -> None:
        nonlocal para, bullet
        if para:
            text = " ".join(x.strip() for x in para)
            out.append(
                textwrap.fill(
                    text,
                    width,
                    subsequent_indent="  " if bullet else "",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        para, bullet = [], False

    for line in md.split("\n"):
        if line.startswith("```"):
            flush()
            fence = not fence
            out.append(line)
        elif fence or not line.strip() or line.startswith(("|", "#")):
            flush()
            out.append(line)
        elif line.startswith("* "):
            flush()
            para, bullet = [line], True
        else:
            para.append(line)
    flush()
    return "\n".join(out)


def _throughput_rows(tp: dict[str, Any]) -> list[str]:
    """A throughput window's table, one row per path."""
    rows = [
        "| path | req/s | min – max | vs direct | SUT CPU | per SUT core | harness CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in PATHS:
        r = tp[p]
        sut = "—" if r["sut_util"] is None else f"{r['sut_util']:.0%}"
        core = "—" if r["per_core"] is None else _f(r["per_core"], 0)
        rows.append(
            f"| {p} | {_f(r['rps'], 0)} | {_f(r['rps_min'], 0)} – {_f(r['rps_max'], 0)} | "
            f"{_ratio(r['rps'], tp['direct']['rps'])} | {sut} | {core} | "
            f"{r['harness_util']:.0%} |"
        )
    return rows


def _throughput_errors(tp: dict[str, Any]) -> list[str]:
    errs = {p: tp[p]["errors"] for p in PATHS if tp[p]["errors"]}
    return [f"Errors during the runs: {errs}."] if errs else []


def render_markdown(res: dict[str, Any], argv: Sequence[str]) -> str:
    m = res["machine"]
    prof: dict[str, Any] = res["profile"]
    t, tool, tp, cpu, mem = (
        res["ttfc"],
        res["tool"],
        res["throughput"],
        res["cpu"],
        res["memory"],
    )
    reps = prof["reps"]
    cmd = "python bench/http_bench.py" + "".join(f" {a}" for a in argv)
    L: list[str] = []
    a = L.append
    a("# Performance")
    a("")
    a("What the relay costs on the request path, measured by `bench/http_bench.py` against two")
    a("baselines in the same run: **direct** (client → mock provider) and **bare**, a bare")
    a("aiohttp pass-through proxy (`bench/bare_proxy.py`: one server, one ClientSession,")
    a("`iter_any` → `write`, no logic), the floor for any aiohttp-based relay.")
    a("")
    a("This file is generated by the benchmark. To reproduce (Linux, from the repository root,")
    a("with the package installed; 6-7 minutes on this machine):")
    a("")
    a("```")
    a(cmd)
    a("```")
    a("")
    a("`--quick` (under a minute, small counts) only smoke-tests the harness; its numbers mean")
    a("little. `--json FILE` also writes every raw run.")
    a("")
    a("## Machine and setup")
    a("")
    a(
        f"* {m['date']}; unbroken {m['unbroken']} at commit `{m['commit'] or 'unknown'}`"
        f"{'; **quick run**' if res['quick'] else ''}; {res['elapsed_s']:.0f} s."
    )
    a(
        f"* nproc {m['nproc']} ({m['cpu_model'] or 'unknown CPU'}, a KVM guest), Linux "
        f"{m['kernel']}; a shared, noisy machine: load average {m['loadavg_start'][0]:.2f} at "
        f"the start, {res['loadavg_end'][0]:.2f} at the end."
    )
    a(f"* Python {m['python']}, aiohttp {m['aiohttp']}.")
    pin = {
        "taskset": "`taskset -c 0` for the system under test (SUT), `taskset -c 1` for the "
        "mock and the load generator",
        "sched_setaffinity": "taskset was not found: pinned with `os.sched_setaffinity` "
        "instead (SUT on CPU 0, mock and load generator on CPU 1)",
        "none": "**nothing pinned** (fewer than 2 CPUs)",
    }[m["pinning"]]
    a(f"* Pinning: {pin}. The SUT has a core to itself; mock and load generator share the")
    a("  other, so **direct** measures the harness's own ceiling on that core.")
    a("* Processes: the mock provider (`unbroken.mock.MockProvider` in its own process, its")
    a("  request log switched off so its memory stays flat), the bare proxy, `python -m")
    a("  unbroken serve` (`[retry] verbose = false`, every other setting at its default, e.g.")
    a("  `[stream] hold` = control + tool calls; the turn journal, if the build has one, writes")
    a("  to a temporary directory), and one aiohttp load-generator process. Loopback only,")
    a("  ephemeral ports, keep-alive connections on every hop.")
    a(f"* {reps} repetitions, each on **freshly started** bare and unbroken processes (on this")
    a("  VM two processes of the same code can differ by 10-30 % in CPU per frame for their")
    a("  whole life), paths interleaved within each; every number below is the median across")
    a("  the repetitions. Ratios are taken against direct (or bare) from the same repetition.")
    a("")
    a("## Targets")
    a("")
    a("Issue 13's targets, each against the bare pass-through measured in the same run (the")
    a("ratios and differences are paired within each repetition, then the median; memory is")
    a("absolute: no worse than when the issue was filed).")
    a("")
    a("| metric | target | unbroken | bare proxy (floor) | unbroken vs bare | verdict |")
    a("|---|---|---:|---:|---:|---|")
    for r in evaluate_targets(res):
        nd = r["nd"]
        vnd = 2 if r["value_unit"] == "× bare" else (3 if r["nd"] == 3 else 1)
        sign = "" if r["value_unit"] == "× bare" else ("+" if r["value"] >= 0 else "")
        a(
            f"| {r['metric']} | {r['target']} | {_f(r['unbroken'], nd)} | {_f(r['bare'], nd)} | "
            f"{sign}{_f(r['value'], vnd)} {r['value_unit']} | {_verdict(r['pass'])} |"
        )
    a("")
    a("(*) Requests completed per CPU-second of the SUT process in the window: its rate on")
    a("one fully used core. It equals the measured rate when the SUT saturates its core; when")
    a("it does not (the mock and load generator on the other core are the limit), it is the")
    a("rate a busy core would sustain. Measured rates are under the throughput sections.")
    a("")
    # -- TTFC
    a("## Added time to first chunk (TTFC)")
    a("")
    a("Concurrency 1, streamed chat (`/v1/chat/completions`); the upstream sends one frame")
    a("every 5 ms (`chunk_delay_ms: 5`: the role chunk at once, the first text delta 5 ms")
    a("later). TTFC = request sent → first **text delta** at the client, on every path")
    a("(unbroken holds the role chunk, and the response headers, until the first output, so")
    a(
        '"first byte" would not compare like with like). Per repetition '
        f"{prof['ttfc_n']} requests per path, p50 and p99; added = path − direct, same"
    )
    a("percentile, same repetition.")
    a("")
    a("| path | TTFC p50 ms | TTFC p99 ms | added p50 ms | added p99 ms | p50 vs direct |")
    a("|---|---:|---:|---:|---:|---:|")
    for p in PATHS:
        r = t[p]
        added50 = "—" if p == "direct" else _f(r["added_p50"], 3)
        added99 = "—" if p == "direct" else _f(r["added_p99"], 3)
        a(
            f"| {p} | {_f(r['p50'], 3)} | {_f(r['p99'], 3)} | {added50} | {added99} | "
            f"{_ratio(r['p50'], t['direct']['p50'])} |"
        )
    a("")
    a(
        f"unbroken adds {_ratio(t['unbroken']['added_p50'], t['bare']['added_p50'])} what the "
        f"bare proxy adds at p50 ({_f(t['unbroken']['added_p50'] - t['bare']['added_p50'], 3)} ms "
        "more)."
    )
    if any(t["errors"].values()):
        a(f"Errors: {t['errors']} (last: `{t['last_error']}`).")
    a("")
    # -- throughput
    a("## Streamed requests per second (concurrency 64)")
    a("")
    a(
        f"Streamed chat, 20 text deltas, no delay ({_f(tp['unbroken']['frames_per_req'], 0)} SSE "
        "frames a response), 64 concurrent clients, the SUT pinned to one core; per repetition"
    )
    a(
        f"one {prof['rps_duration_s']:g} s window (after {prof['rps_warmup_s']:g} s warm-up) per "
        "path. *SUT CPU* and *harness CPU* are the share of a core used in the window"
    )
    a("(utime+stime / wall) by the SUT and by mock + load generator (together on the other")
    a("core). *Per SUT core* = req/s ÷ SUT CPU: the rate one fully used core would sustain.")
    a("")
    L += _throughput_rows(tp)
    a("")
    a(
        f"unbroken / bare: {_ratio(tp['unbroken']['rps'], tp['bare']['rps'])} measured, "
        f"{_ratio(tp['unbroken']['per_core'], tp['bare']['per_core'])} per SUT core; CPU per "
        f"request {_f(1e6 / tp['unbroken']['per_core'], 0)} µs vs "
        f"{_f(1e6 / tp['bare']['per_core'], 0)} µs."
    )
    L += _throughput_errors(tp)
    a("")
    # -- non-streamed throughput
    ns = res["throughput_ns"]
    a("## Non-streamed requests per second (concurrency 32)")
    a("")
    a('The same chat turn with `"stream": false` (one JSON body of the 20 deltas\' text), 32')
    a("concurrent clients, one window per path per repetition as above.")
    a("")
    L += _throughput_rows(ns)
    a("")
    a(
        f"unbroken / bare per SUT core: {_f(ns['per_core_ratio'], 2)}× (paired by repetition); "
        f"CPU per request {_f(1e6 / ns['unbroken']['per_core'], 0)} µs vs "
        f"{_f(1e6 / ns['bare']['per_core'], 0)} µs."
    )
    L += _throughput_errors(ns)
    a("")
    # -- CPU per chunk
    a("## CPU per chunk")
    a("")
    a(
        f"utime+stime of the SUT process (`/proc/PID/stat`, 10 ms ticks, all threads) over "
        f"{prof['cpu_requests']} streamed requests of {prof['cpu_deltas']} deltas"
    )
    a(
        f"(concurrency {prof['cpu_concurrency']}, `chunk_delay_ms: {prof['cpu_delay_ms']:g}`, so "
        "each frame travels on its own as with a real model), divided by the SSE frames the"
    )
    a("client received. Nothing is subtracted: per-request work (accept, headers, upstream")
    a(
        "request, per-turn bookkeeping) is included, spread over "
        f"~{cpu['chat']['unbroken']['frames_per_req']:.0f} frames."
    )
    a("")
    a(
        "| protocol | frames/response | bare µs/frame | unbroken µs/frame | unbroken − bare | "
        "unbroken / bare | client reads/frame |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|")
    for proto in PROTOCOLS:
        d = cpu[proto]
        b, u = d["bare"], d["unbroken"]
        a(
            f"| {proto} (`/{PROTOCOLS[proto]['path']}`) | {u['frames_per_req']:.0f} | "
            f"{_f(b['us_per_frame'], 1)} | {_f(u['us_per_frame'], 1)} | "
            f"{_f(d['extra_us'], 1)} | {d['ratio']:.2f}× | {u['reads_per_frame']:.2f} |"
        )
    a("")
    a("Direct has no relay process, so it has no column here. The difference and the ratio")
    a("are paired within each repetition, then the median.")
    a("*Client reads/frame* near 1.00 means the frames were not coalesced on the way (one read")
    a("and one write per frame in the SUT); well below 1, batching would make the per-frame")
    a("cost look smaller than it is for a paced, real stream.")
    a("")
    # -- memory
    a("## Memory")
    a("")
    a(
        "RSS (`VmRSS`) of freshly started SUTs after one warm-up request (idle), and with "
        f"{prof['mem_streams']}"
    )
    a("open slow streams (`chunk_delay_ms: 1000`; every client has its first bytes and keeps")
    a("the stream open). Per stream = (RSS with streams − idle RSS) / streams. The mock and")
    a(
        f"the clients are other processes (so direct has no row). Median of {prof['mem_reps']} "
        "fresh start(s)."
    )
    a("")
    a("| path | idle RSS MiB | RSS with streams MiB | streams | KiB per open stream |")
    a("|---|---:|---:|---:|---:|")
    for name in SUT_NAMES:
        r = mem[name]
        a(
            f"| {name} | {_f(r['idle_mib'], 1)} | {_f(r['loaded_mib'], 1)} | {r['streams']} | "
            f"{_f(r['kib_per_stream'], 1)} |"
        )
    a("")
    a(
        f"unbroken / bare: idle {_ratio(mem['unbroken']['idle_mib'], mem['bare']['idle_mib'])}, "
        f"per stream {_ratio(mem['unbroken']['kib_per_stream'], mem['bare']['kib_per_stream'])}."
    )
    a("")
    # -- tool gate
    a("## Dispatch gate: when a streamed tool call becomes visible")
    a("")
    a('A streamed chat tool call (`x-mock-action: {"reply": "tool", "chunk_delay_ms": 5}`:')
    a("role chunk, tool-call start, 8 argument deltas, finish, `[DONE]`, 5 ms apart). Time from")
    a('the request to the first byte of the tool call (`"tool_calls"`) at the client, per')
    a(f"repetition {prof['tool_n']} requests per path. Direct and bare stream the call as it is")
    a("generated; unbroken holds it until it is complete (the dispatch gate) and releases it")
    a("whole, so the difference is the time the model spent streaming the arguments.")
    a("")
    a(
        "| path | first tool-call byte p50 ms | p99 ms | end of stream p50 ms | "
        "first byte − direct |"
    )
    a("|---|---:|---:|---:|---:|")
    for p in PATHS:
        r = tool[p]
        added = "—" if p == "direct" else _f(r["added_p50"], 2)
        a(f"| {p} | {_f(r['p50'], 2)} | {_f(r['p99'], 2)} | {_f(r['end_p50'], 2)} | {added} |")
    a("")
    before_end = tool["unbroken"]["end_p50"] - tool["unbroken"]["p50"]
    end_delta = tool["unbroken"]["end_p50"] - tool["direct"]["end_p50"]
    a(
        f"Through unbroken the call arrives {_f(tool['unbroken']['added_p50'], 1)} ms later than "
        f"directly and {_f(before_end, 1)} ms before the end of the stream: the gate costs the"
    )
    a(
        "argument-streaming time, not the turn: the stream ends "
        f"{_f(end_delta, 2)} ms after direct's."
    )
    a("")
    # -- large body supplement
    bb = res["big_body"]
    bt, bm = bb["ttfc"], bb["memory"]
    a(f"## Supplement: a {bb['body_kib']:.0f} KiB request body")
    a("")
    a("The tables above use a tiny request. A coding agent late in a session sends its whole")
    a(
        "history every turn, so here the same chat request carries a "
        f"{bb['body_kib']:.0f} KiB body (system prompt, a long"
    )
    a(
        "conversation, tool outputs). Added TTFC as above (c=1, 5 ms/chunk, "
        f"{prof['big_n']} requests per path per repetition), and RSS per open stream"
    )
    a(f"({prof['big_streams']} streams, fresh processes, one start).")
    a("")
    a(
        "| path | TTFC p50 ms | added p50 ms | idle RSS MiB | RSS with streams MiB | "
        "KiB per open stream |"
    )
    a("|---|---:|---:|---:|---:|---:|")
    for p in PATHS:
        r = bt[p]
        added = "—" if p == "direct" else _f(r["added_p50"], 3)
        if p == "direct":
            a(f"| {p} | {_f(r['p50'], 3)} | {added} | — | — | — |")
        else:
            mm = bm[p]
            a(
                f"| {p} | {_f(r['p50'], 3)} | {added} | {_f(mm['idle_mib'], 1)} | "
                f"{_f(mm['loaded_mib'], 1)} | {_f(mm['kib_per_stream'], 1)} |"
            )
    a("")
    a(
        "With this body unbroken adds "
        f"{_f(bt['unbroken']['added_p50'] - bt['bare']['added_p50'], 2)}"
        f" ms more than the bare proxy to TTFC (tiny body: "
        f"{_f(t['unbroken']['added_p50'] - t['bare']['added_p50'], 2)} ms) and holds "
        f"{_ratio(bm['unbroken']['kib_per_stream'], bm['bare']['kib_per_stream'])} the bare "
        "proxy's memory per open stream."
    )
    a("")
    a("## Interpretation")
    a("")
    for line in interpretation(res):
        a(f"* {line}")
    a("")
    a("## WebSocket")
    a("")
    a("(added by the WebSocket issue)")
    a("")
    return reflow("\n".join(L))


def interpretation(res: dict[str, Any]) -> list[str]:
    t, tp, cpu, mem = res["ttfc"], res["throughput"], res["cpu"], res["memory"]
    out: list[str] = []
    u, b = t["unbroken"], t["bare"]
    out.append(
        f"**Latency.** unbroken adds {_f(u['added_p50'], 2)} ms at p50 over direct; the bare "
        f"aiohttp hop alone adds {_f(b['added_p50'], 2)} ms, so the relay's own work on the "
        f"first text delta costs {_f(u['added_p50'] - b['added_p50'], 2)} ms. Part of that is "
        "by design: unbroken sends the response headers together with the first output (so "
        "an attempt that dies first stays invisible and a final failure can still be a real "
        "HTTP status), so its client parses the headers when the text arrives, while bare "
        "and direct clients parsed them 5 ms earlier. The p99 differences are dominated by "
        "scheduler noise on this shared VM (the mock's 5 ms timer jitter is common to all "
        "paths but does not cancel exactly); read them as orders of magnitude."
    )
    d, ub, bb = tp["direct"], tp["unbroken"], tp["bare"]
    parts = []
    for name, r in (("bare", bb), ("unbroken", ub)):
        if r["sut_util"] >= 0.9:
            parts.append(
                f"{name} saturates its core ({r['sut_util']:.0%} CPU), so the SUT is the limit"
            )
        else:
            parts.append(
                f"{name} uses {r['sut_util']:.0%} of its core while mock + load "
                f"generator use {r['harness_util']:.0%} of theirs, so the harness is "
                "(at least partly) the limit"
            )
    out.append(
        f"**Throughput.** Direct reaches {_f(d['rps'], 0)} req/s with mock and load generator "
        "on one core: the harness ceiling on this machine (a relay in between can even raise "
        "it, because it hands the client coalesced chunks that are cheaper to read, which is "
        f"why bare can beat direct). {'; '.join(parts)}. Normalised "
        f"to one busy core, unbroken sustains {_f(ub['per_core'], 0)} req/s against the bare "
        f"proxy's {_f(bb['per_core'], 0)} ({_ratio(ub['per_core'], bb['per_core'])}): "
        f"{_f(1e6 / ub['per_core'] - 1e6 / bb['per_core'], 0)} µs more CPU per "
        f"{_f(ub['frames_per_req'], 0)}-frame request: the gate's proof of each frame and the "
        'relay\'s per-turn work (see "Where the per-turn floor is" below for a profile; '
        "this window's ratio moves by ±0.1 between runs of the same code)."
    )
    cu = cpu["chat"]
    protos = ", ".join(f"{p} +{_f(cpu[p]['extra_us'], 1)} µs" for p in PROTOCOLS)
    out.append(
        f"**CPU per chunk.** Of unbroken's {_f(cu['unbroken']['us_per_frame'], 1)} µs per chat "
        f"frame, {_f(cu['bare']['us_per_frame'], 1)} µs is the aiohttp read + write that the "
        f"bare proxy pays too; the relay's logic adds {protos}. Chat chunks carry no event "
        "name, so each one is JSON-parsed to classify it; Responses and Messages frames are "
        "classified by their event name and parse only item starts, errors and the like."
    )
    big = res["big_body"]
    bt, bm = big["ttfc"], big["memory"]
    out.append(
        f"**Large bodies.** With a {big['body_kib']:.0f} KiB request, unbroken's extra TTFC over "
        f"the bare proxy grows to {_f(bt['unbroken']['added_p50'] - bt['bare']['added_p50'], 2)} "
        f"ms and its memory per open stream to {_f(bm['unbroken']['kib_per_stream'], 0)} KiB "
        f"(bare {_f(bm['bare']['kib_per_stream'], 0)} KiB): the relay parses the whole request "
        "body as JSON before it opens the upstream request, and keeps the raw bytes for the "
        "life of the turn for a replay (the parsed object only when an upstream renames "
        "models). The tiny-request tables understate both costs for real agent traffic."
    )
    mu, mb = mem["unbroken"], mem["bare"]
    out.append(
        f"**Memory.** Idle RSS {_f(mu['idle_mib'], 1)} MiB against {_f(mb['idle_mib'], 1)} MiB "
        "for the bare proxy: the interpreter, aiohttp and unbroken's modules. Per open stream "
        f"{_f(mu['kib_per_stream'], 1)} KiB against {_f(mb['kib_per_stream'], 1)} KiB: most of "
        "it is the two connections' aiohttp state (client side and upstream side) that any "
        "relay pays; unbroken adds its per-turn state (ledger, classifier, watchdog, "
        'turn and attempt records) and more coroutines per turn (see "Where the per-turn '
        'floor is").'
    )
    return out


def print_summary(res: dict[str, Any]) -> None:
    print("\nunbroken HTTP benchmark" + (" (QUICK: smoke test only)" if res["quick"] else ""))
    t, tp = res["ttfc"], res["throughput"]
    print(
        f"  TTFC c=1 added p50/p99: bare {t['bare']['added_p50']:+.3f}/"
        f"{t['bare']['added_p99']:+.3f} ms, unbroken {t['unbroken']['added_p50']:+.3f}/"
        f"{t['unbroken']['added_p99']:+.3f} ms"
    )
    for label, r in (("req/s c=64", tp), ("non-streamed req/s c=32", res["throughput_ns"])):
        print(
            f"  {label}: direct {r['direct']['rps']:.0f}, bare {r['bare']['rps']:.0f} "
            f"({r['bare']['per_core']:.0f} per SUT core), unbroken {r['unbroken']['rps']:.0f} "
            f"({r['unbroken']['per_core']:.0f} per SUT core)"
        )
    for proto, d in res["cpu"].items():
        print(
            f"  CPU/frame {proto:9s}: bare {d['bare']['us_per_frame']:.1f} µs, "
            f"unbroken {d['unbroken']['us_per_frame']:.1f} µs ({d['extra_us']:+.1f})"
        )
    mem = res["memory"]
    print(
        f"  RSS idle: bare {mem['bare']['idle_mib']:.1f} MiB, unbroken "
        f"{mem['unbroken']['idle_mib']:.1f} MiB; per stream: bare "
        f"{mem['bare']['kib_per_stream']:.1f} KiB, unbroken "
        f"{mem['unbroken']['kib_per_stream']:.1f} KiB"
    )
    big = res["big_body"]
    print(
        f"  {big['body_kib']:.0f} KiB body: added TTFC p50 bare "
        f"{big['ttfc']['bare']['added_p50']:+.3f} ms, unbroken "
        f"{big['ttfc']['unbroken']['added_p50']:+.3f} ms; per stream bare "
        f"{big['memory']['bare']['kib_per_stream']:.0f} KiB, unbroken "
        f"{big['memory']['unbroken']['kib_per_stream']:.0f} KiB"
    )
    tool = res["tool"]
    print(
        f"  first tool-call byte p50: direct {tool['direct']['p50']:.1f} ms, bare "
        f"{tool['bare']['p50']:.1f} ms, unbroken {tool['unbroken']['p50']:.1f} ms"
    )
    print("  targets:")
    for r in evaluate_targets(res):
        print(
            f"    {'PASS' if r['pass'] else 'MISS'}  {r['metric']:38s} {r['target']:16s} "
            f"{_f(r['value'], 3)} {r['value_unit']} (unbroken {_f(r['unbroken'], r['nd'])}, "
            f"bare {_f(r['bare'], r['nd'])})"
        )


# -------------------------------------------------------------------------------------
# main


def run(prof: Profile, quick: bool, argv: Sequence[str]) -> dict[str, Any]:
    ncpu = len(os.sched_getaffinity(0))
    if ncpu < 2:
        pinning = "none"
    elif shutil.which("taskset"):
        pinning = "taskset"
    else:
        pinning = "sched_setaffinity"
    if pinning == "taskset":
        log("taskset found: SUT on CPU 0, mock + load generator on CPU 1")
    elif pinning == "sched_setaffinity":
        log("taskset NOT found: pinning with os.sched_setaffinity instead")
    else:
        log("fewer than 2 CPUs: NOT pinning anything; numbers will be harder to read")
    harness_cpu = None if pinning == "none" else HARNESS_CPU
    if harness_cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {harness_cpu})  # keep this orchestrator off the SUT core

    # 500 streams x (client socket + upstream socket) per SUT, plus the mock's and client's.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * prof.mem_streams + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        log(f"raised RLIMIT_NOFILE {soft} -> {new} (inherited by the children)")

    machine = machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-bench-"))
    fleet = Fleet(workdir, pinning)
    ok = False
    try:
        me = str(Path(__file__).resolve())
        mock = fleet.start(
            "mock", [PY, me, "--mock"], cpu=harness_cpu, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen", [PY, me, "--loadgen"], cpu=harness_cpu, ready=None, pipe_stdio=True
        )
        log(f"mock {mock.url} (pid {mock.pid}); load generator pid {gen.pid}; logs in {workdir}")

        # Memory first, on fresh processes of their own.
        log(f"memory: idle and {prof.mem_streams} open streams")
        memory = aggregate_memory(
            [
                _rss_per_stream(
                    fleet, gen, mock.url, f"mem{i}", prof.mem_streams, None, prof.settle_s
                )
                for i in range(prof.mem_reps)
            ]
        )
        body = big_body(BIG_BODY_KIB)
        log(f"memory: {prof.big_streams} open streams with a {len(body) // 1024} KiB request body")
        big_memory = aggregate_memory(
            [_rss_per_stream(fleet, gen, mock.url, "big", prof.big_streams, body, prof.settle_s)]
        )

        ttfc_reps: list[dict[str, Any]] = []
        tool_reps: list[dict[str, Any]] = []
        tp_reps: list[dict[str, dict[str, Any]]] = []
        cpu_reps: list[dict[str, Any]] = []
        ttfc_spec = _spec("chat", {"deltas": 1, "chunk_delay_ms": 5})
        tool_spec = _spec("chat", {"reply": "tool", "chunk_delay_ms": 5})
        tp_spec = _spec("chat", {"deltas": 20})
        ns_spec = {
            "body": json.dumps(dict(PROTOCOLS["chat"]["body"], stream=False)),
            "headers": dict(tp_spec["headers"], accept="application/json"),
        }
        ns_reps: list[dict[str, dict[str, Any]]] = []
        big_spec = {**ttfc_spec, "body": body}
        big_reps: list[dict[str, Any]] = []
        for rep in range(prof.reps):
            suts = start_suts(fleet, mock.url, f"r{rep}")
            log(
                f"repetition {rep + 1}/{prof.reps}: fresh bare (pid {suts.bare.pid}) and "
                f"unbroken (pid {suts.unbroken.pid})"
            )
            urls = _urls(mock.url, suts, "chat")
            for p in PATHS:
                gen.call(
                    {"op": "batch", "url": urls[p], "n": 16, "concurrency": 4, **tp_spec},
                    timeout=60,
                )

            r = latency_rep(gen, urls, ttfc_spec, PROTOCOLS["chat"]["text_marker"], prof.ttfc_n)
            ttfc_reps.append(r)
            log(
                "  TTFC (first text delta) p50/p99 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.3f}/{r[p]['p99']:.3f}" for p in PATHS)
            )

            r = latency_rep(gen, urls, big_spec, PROTOCOLS["chat"]["text_marker"], prof.big_n)
            big_reps.append(r)
            log(
                f"  TTFC with the {len(body) // 1024} KiB body, p50 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.3f}" for p in PATHS)
            )

            r = latency_rep(gen, urls, tool_spec, TOOL_MARKER, prof.tool_n)
            tool_reps.append(r)
            log(
                "  first tool-call byte p50 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.2f}" for p in PATHS)
            )

            tp_reps.append(throughput_rep(gen, mock, urls, suts, tp_spec, prof, rep))
            ns_reps.append(throughput_rep(gen, mock, urls, suts, ns_spec, prof, rep, 32))
            cpu_reps.append(cpu_rep(gen, mock.url, suts, prof, rep))
            fleet.stop(suts.bare)
            fleet.stop(suts.unbroken)

        ttfc = aggregate_latency(ttfc_reps)
        tool = aggregate_latency(tool_reps)
        big = {
            "body_kib": len(body) / 1024,
            "ttfc": aggregate_latency(big_reps),
            "memory": big_memory,
        }
        throughput = aggregate_throughput(tp_reps)
        throughput_ns = aggregate_throughput(ns_reps)
        cpu = aggregate_cpu(cpu_reps)

        res = {
            "quick": quick,
            "machine": machine,
            "profile": prof.__dict__,
            "ttfc": ttfc,
            "tool": tool,
            "throughput": throughput,
            "throughput_ns": throughput_ns,
            "cpu": cpu,
            "memory": memory,
            "big_body": big,
            "loadavg_end": os.getloadavg(),
        }
        with contextlib.suppress(Exception):
            gen.call({"op": "quit"}, timeout=1)
        ok = True
        return res
    except (KeyboardInterrupt, SystemExit):
        ok = True  # interrupted, not broken: nothing worth keeping
        raise
    finally:
        fleet.stop_all()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")


def _iter_argv(args: argparse.Namespace) -> Iterator[str]:
    if args.quick:
        yield "--quick"
    if args.out:
        yield "--out"
        yield args.out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        loadgen_main()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--mock":
        mock_main()
        return 0
    parser = argparse.ArgumentParser(description="unbroken HTTP benchmark (see module docstring)")
    parser.add_argument("--quick", action="store_true", help="small counts, < 1 minute")
    parser.add_argument("--out", help="write the Markdown report here (e.g. docs/performance.md)")
    parser.add_argument("--json", help="also write the raw results as JSON here")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("http_bench: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    t0 = time.monotonic()
    try:
        res = run(QUICK if args.quick else FULL, args.quick, list(_iter_argv(args)))
    except KeyboardInterrupt:
        log("interrupted; all child processes stopped")
        return 130
    except SystemExit:
        log("terminated; all child processes stopped")
        raise
    res["elapsed_s"] = time.monotonic() - t0
    print_summary(res)
    print(f"  ({res['elapsed_s']:.0f} s)")
    if args.out:
        Path(args.out).write_text(render_markdown(res, list(_iter_argv(args))))
        log(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
