"""Zero-config storm benchmark (issue 22): how long a storm of 503s or 529s takes to
get through, with the real agent CLIs and the defaults a user gets.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/agent_storm_bench.py [--repeat N] [--only NAME,...] [--out FILE]
    python bench/agent_storm_bench.py --quick          # the `unbroken serve` 30 x 503 row once

Every run has a fresh mock provider (``unbroken.mock``) that answers the storm
(``status`` x ``count``), then the answer.  The agents run through ``unbroken run --
<agent>`` with **no unbroken config** and no ``UNBROKEN_*`` variable: the agent is
pointed at the mock as at the user's own gateway, in a scratch HOME and XDG
directories (the e2e harness of ``tests/e2e``: ``agent_run.py``, ``oc_harness.py``).
``unbroken serve`` gets a config with one route to the mock and nothing else, and a
plain streamed HTTP client (aiohttp, Chat Completions) sends the turn.

Measured: for an agent, the wall time of the whole ``unbroken run -- <agent>`` command
(the agent's and the relay's start-up included, as the user waits for it); for
``unbroken serve``, from the client's request to the end of its stream (the relay is
already up).  Also: when the first upstream request arrived after the start, and the
storm's span (first to last upstream request, ideally ``count`` x 250 ms).  A run
counts only if the turn completed with the answer, the agent saw no failure (no
``api_retry``, no "Reconnecting", no OpenCode "stream error") and the mock saw
``count + 1`` requests; otherwise the table says why.  Exit status 1 if a run did not
complete (there is no measurement then), never for a time over its target.

The CLIs are the pinned ones of ``tests/e2e/clis.py``, installed with npm into the
test cache on first use (``UNBROKEN_<BIN>_BIN`` names an installed binary instead).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # tests/ for e2e.agent_run, ...
# the unbroken the child processes run (`python -m unbroken`) is this tree's too
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
)

import aiohttp  # noqa: E402

from e2e.agent_run import (  # noqa: E402
    agent_text,
    base_env,
    claude_argv,
    claude_env,
    claude_result,
    codex_argv,
    codex_home,
    reconnects,
    run,
    zero_config,
)
from e2e.clis import INSTALLED, PINNED, ensure_npm_cli  # noqa: E402
from e2e.oc_harness import (  # noqa: E402
    Sandbox,
    fake_provider,
    run_args,
    run_to_end,
    turn_requests,
    unbroken_run,
)
from e2e.oc_scenarios import TEXT  # noqa: E402
from unbroken.config import parse_config  # noqa: E402
from unbroken.mock import MockProvider, RecordedRequest  # noqa: E402

#: how long one run may take before it is stopped (and counted as not completed)
LIMIT_S = 300.0
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@dataclass
class Sample:
    seconds: float
    ok: bool
    why: str  # why the run does not count ("" when it does)
    requests: int
    first_s: float | None  # the first upstream request, after the start
    span_s: float | None  # first to last upstream request


@dataclass(frozen=True)
class Storm:
    name: str  # for --only
    through: str  # the command, for the table
    status: int
    count: int
    target_s: float | None
    cli: str | None  # the pinned CLI it needs
    go: Callable[[Storm, Path, MockProvider], Awaitable[Sample]]

    @property
    def label(self) -> str:
        return f"{self.status} x {self.count}"


def _sample(
    storm: Storm, seconds: float, started: float, requests: Sequence[RecordedRequest], why: str
) -> Sample:
    if not why and len(requests) != storm.count + 1:
        why = f"{len(requests)} upstream requests, not {storm.count + 1}"
    first = requests[0].at - started if requests else None
    span = requests[-1].at - requests[0].at if requests else None
    return Sample(seconds, not why, why, len(requests), first, span)


async def _claude(storm: Storm, root: Path, mock: MockProvider) -> Sample:
    env = claude_env(root, mock.url)
    r = await run(zero_config(claude_argv("say hi")), env, root / "project", limit_s=LIMIT_S)
    result = claude_result(r)
    why = ""
    if r.code != 0 or result.get("result") != TEXT or result.get("is_error"):
        why = f"exit {r.code}: {(r.stderr or r.stdout).strip()[-300:]}"
    elif any(e.get("subtype") == "api_retry" for e in r.events()):
        why = "Claude Code saw a failure (api_retry)"
    return _sample(storm, r.seconds, r.started, mock.requests, why)


async def _codex(storm: Storm, root: Path, mock: MockProvider) -> Sample:
    env = codex_home(root, mock.url)
    argv = zero_config(codex_argv(root, "say hi"))
    r = await run(argv, env, root / "project", limit_s=LIMIT_S)
    why = ""
    if r.code != 0 or not agent_text(r).startswith(TEXT):
        why = f"exit {r.code}: {(r.stderr or r.stdout).strip()[-300:]}"
    elif reconnects(r):
        why = f"Codex saw a failure: {reconnects(r)[0]}"
    return _sample(storm, r.seconds, r.started, mock.requests, why)


async def _opencode(storm: Storm, root: Path, mock: MockProvider) -> Sample:
    box = Sandbox(root)
    box.write_global_config(fake_provider(mock.url + "/v1"))
    started = time.monotonic()
    try:
        f = await run_to_end(unbroken_run(*run_args()), box, limit_s=LIMIT_S)
    except TimeoutError:
        return _sample(
            storm,
            time.monotonic() - started,
            started,
            turn_requests(mock),
            f"still running after {LIMIT_S:.0f} s",
        )
    why = ""
    if f.code != 0 or TEXT not in f.stdout:
        why = f"exit {f.code}: {f.stderr.strip()[-300:]}"
    elif f.stream_errors():
        why = f"OpenCode saw {f.stream_errors()} stream error(s)"
    return _sample(storm, f.elapsed, started, turn_requests(mock), why)


async def _serve(storm: Storm, root: Path, mock: MockProvider) -> Sample:
    """`unbroken serve` (one route to the mock, the defaults otherwise) and one streamed
    Chat Completions turn from a plain HTTP client."""
    cfg = root / "unbroken.toml"
    cfg.write_text(f"[routes.mock]\nupstreams = [{{ url = {json.dumps(mock.url)} }}]\n")
    env = base_env(root / "home")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "serve",
        "--config",
        str(cfg),
        "--port",
        "0",
        env={**env, "PYTHONUNBUFFERED": "1"},
        cwd=str(root),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    drain: asyncio.Task[None] | None = None
    try:
        assert proc.stdout is not None
        url = await _relay_url(proc.stdout)
        drain = asyncio.create_task(_drain(proc.stdout))
        timeout = aiohttp.ClientTimeout(total=LIMIT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            started = time.monotonic()
            async with http.post(f"{url}/mock/v1/chat/completions", json=CHAT) as resp:
                body = await resp.read()
                seconds = time.monotonic() - started
        text = _chat_text(body)
        why = "" if resp.status == 200 and text == TEXT else f"HTTP {resp.status}: {body[:300]!r}"
        return _sample(storm, seconds, started, mock.requests, why)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if drain is not None:
            drain.cancel()


async def _relay_url(stdout: asyncio.StreamReader) -> str:
    async with asyncio.timeout(60):
        while line := await stdout.readline():
            m = re.search(r"relaying on (http://\S+)", line.decode(errors="replace"))
            if m:
                return m.group(1)
    raise RuntimeError("unbroken serve exited before it was relaying")


async def _drain(stdout: asyncio.StreamReader) -> None:
    while await stdout.read(65536):
        pass


def _chat_text(body: bytes) -> str:
    out = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            with contextlib.suppress(ValueError, LookupError, TypeError):
                out.append(json.loads(line[5:])["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def _serve_target(count: int) -> float:
    return 1.1 * count * 0.25 + 1.0


STORMS: list[Storm] = [
    Storm("claude-100", "`unbroken run -- claude -p`", 529, 100, 30.0, "claude", _claude),
    Storm("claude-30", "`unbroken run -- claude -p`", 529, 30, None, "claude", _claude),
    Storm("codex-40", "`unbroken run -- codex exec`", 503, 40, 12.0, "codex", _codex),
    Storm("opencode-30", "`unbroken run -- opencode run`", 503, 30, None, "opencode", _opencode),
    Storm(
        "serve-30",
        "`unbroken serve` + streamed HTTP client",
        503,
        30,
        _serve_target(30),
        None,
        _serve,
    ),
    Storm(
        "serve-100",
        "`unbroken serve` + streamed HTTP client",
        503,
        100,
        _serve_target(100),
        None,
        _serve,
    ),
]


def _install(name: str) -> None:
    cli = PINNED[name]
    override = os.environ.get(cli.override_env)
    INSTALLED[name] = (
        Path(override) if override else ensure_npm_cli(cli.package, cli.version, cli.bin)
    )


async def _one(storm: Storm) -> Sample:
    with tempfile.TemporaryDirectory(prefix=f"unbroken-storm-{storm.name}-") as tmp:
        async with MockProvider(host="127.0.0.1", port=0) as mock:
            mock.script([{"status": storm.status, "count": storm.count}])
            try:
                return await storm.go(storm, Path(tmp), mock)
            except Exception as exc:  # a run that breaks is reported, not fatal
                return Sample(
                    0.0, False, f"{type(exc).__name__}: {exc}", len(mock.requests), None, None
                )


@dataclass
class Results:
    storms: list[Storm]
    samples: dict[str, list[Sample]] = field(default_factory=dict)


async def measure(storms: list[Storm], repeat: int) -> Results:
    results = Results(storms, {s.name: [] for s in storms})
    for i in range(repeat):  # the repeats interleaved: a slow minute touches every row
        for storm in storms:
            sample = await _one(storm)
            results.samples[storm.name].append(sample)
            said = "ok" if sample.ok else f"NOT COMPLETED: {sample.why}"
            print(
                f"{storm.name} #{i + 1}: {sample.seconds:.1f} s, {sample.requests} upstream "
                f"requests; {said}",
                file=sys.stderr,
                flush=True,
            )
    return results


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} s"


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def render(results: Results, command: str, before: str, after: str) -> str:
    defaults = parse_config({}, env={})
    retry, health = defaults.retry, defaults.health
    clis = dict.fromkeys(s.cli for s in results.storms if s.cli is not None)
    versions = ", ".join(PINNED[name].spec for name in clis)
    lines = [
        "# Zero-config storm benchmark",
        "",
        f"Reproduce: `{command}`",
        "",
        f"unbroken {_commit()}, {datetime.date.today().isoformat()}; Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {before} at the "
        f"start and {after} at the end; {versions or 'no agent CLI'}.",
        "",
        f'No unbroken config (the defaults): `[retry] backoff = "{retry.backoff}"`, '
        f"`delay_ms = {retry.delay_ms}`; `[health] breakers = {str(health.breakers).lower()}`. "
        "An agent row times the whole `unbroken run -- <agent>` command (start-up included); "
        'a `serve` row times one streamed turn, request to end of stream. "First request" '
        'is when the first upstream request arrived after the start, "span" the first to '
        "the last upstream request (medians). The `serve` targets are 1.1 × N × 0.25 s + 1 s.",
        "",
        "| storm | through | target | min | median | max | within target | first request "
        "| span | completed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures: list[str] = []
    for storm in results.storms:
        samples = results.samples[storm.name]
        ok = [s for s in samples if s.ok]
        times = [s.seconds for s in ok]
        target = "—" if storm.target_s is None else f"≤ {storm.target_s:g} s"
        within = (
            "—"
            if storm.target_s is None or not ok
            else (f"{sum(t <= storm.target_s for t in times)}/{len(ok)}")
        )
        lines.append(
            f"| {storm.label} | {storm.through} | {target} | "
            f"{_s(min(times) if times else None)} | {_s(_median(times))} | "
            f"{_s(max(times) if times else None)} | {within} | "
            f"{_s(_median([s.first_s for s in ok]))} | {_s(_median([s.span_s for s in ok]))} | "
            f"{len(ok)}/{len(samples)} |"
        )
        failures += [f"- {storm.name}: {s.why}" for s in samples if not s.ok]
    if failures:
        lines += ["", "Runs that did not complete (not counted above):", "", *failures]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return "(unknown commit)"


def _load() -> str:
    with contextlib.suppress(OSError):
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    return "?"


async def _main(storms: list[Storm], repeat: int) -> Results:
    task = asyncio.current_task()
    assert task is not None
    # SIGTERM (the smoke test's stop) unwinds like Ctrl-C: every child is stopped
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await measure(storms, repeat)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each storm (default 1)")
    ap.add_argument("--only", help="comma-separated storms: " + ", ".join(s.name for s in STORMS))
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the serve-30 storm once (no agent CLI needed)",
    )
    ap.add_argument("--out", help="also write the Markdown table to this file")
    args = ap.parse_args(argv)
    names = (args.only or ("serve-30" if args.quick else "")).split(",")
    storms = [s for s in STORMS if s.name in names] if names != [""] else list(STORMS)
    unknown = set(names) - {s.name for s in STORMS} - {""}
    if unknown or args.repeat < 1:
        ap.error(
            f"unknown storm(s): {', '.join(sorted(unknown))}"
            if unknown
            else "--repeat must be at least 1"
        )
    for name in dict.fromkeys(s.cli for s in storms if s.cli is not None):
        _install(name)
    command = shlex.join(
        ["python", "bench/agent_storm_bench.py", *(sys.argv[1:] if argv is None else argv)]
    )
    before = _load()
    try:
        results = asyncio.run(_main(storms, args.repeat))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    table = render(results, command, before, _load())
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if all(s.ok for ss in results.samples.values() for s in ss) else 1


if __name__ == "__main__":
    sys.exit(main())
