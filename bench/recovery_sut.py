"""recovery_bench's systems under test and what they run against: the profiles, the relay
child (``recovery_bench.py --relay CONFIG.json``), Redis, the timestamping mock, and
unbroken (defaults, fixed delay, two relays + Redis) or the LiteLLM proxy started fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from compare_suts import LITELLM_ENV, LITELLM_KEY, LITELLM_VERSION, wait_http
from harness import PY, Fleet, Proc, die_with_parent, free_port

ROUTE = "mock"
CHAT_PATH = "v1/chat/completions"
TAG = re.compile(rb"bench-turn ([A-Za-z0-9_.-]+)")
DELAY_S = 0.25  # the retry delay the targets are written against
SYSTEMS = ("defaults", "fixed", "litellm", "redis")
LABELS = {
    "defaults": "unbroken, defaults",
    "fixed": "unbroken, fixed 250 ms, no breakers",
    "litellm": f"LiteLLM proxy {LITELLM_VERSION}",
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
            preexec_fn=die_with_parent,
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
    procs: list[Proc]


class Context:
    def __init__(
        self,
        prof: Profile,
        workdir: Path,
        fleet: Fleet,
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
            env={**LITELLM_ENV, "HOME": str(state)},
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", p, 180)
        except BaseException:
            fleet.stop(p)
            raise
        return Sut(
            system,
            [f"http://127.0.0.1:{port}/{CHAT_PATH}"],
            {
                "content-type": "application/json",
                "accept": "text/event-stream",
                "authorization": f"Bearer {LITELLM_KEY}",
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
    procs: list[Proc] = []
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
                    [PY, str(Path(__file__).with_name("recovery_bench.py")), "--relay", str(cfg)],
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
