"""`unbroken serve` as a real process: one way to start it, wait until it listens, and
end it (`serve_subprocess`), for every test that needs the real command.

The child's stderr is read from the start, line by line, into `Served.err` (a relay
that logs much never blocks on a full pipe, and a test can wait for a line with
`Served.err_line`); its stdout's first line is the ready line, which names the URL.  A
relay that never listens fails the test with its exit code and its stderr, never with
an empty line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

__all__ = ["Served", "clean_env", "serve_subprocess"]

#: the ready line's URL (``unbroken: relaying on http://127.0.0.1:PORT ...``)
_URL = re.compile(r"http://127\.0\.0\.1:(\d+)")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without unbroken's and OpenCode's own variables (the
    relay would read them), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "OPENCODE_"))}
    env.update(extra)
    return env


class Served:
    """A running (or ended) ``unbroken serve`` child."""

    def __init__(self, proc: asyncio.subprocess.Process, env: dict[str, str], group: bool) -> None:
        self.proc = proc
        #: the environment it runs with
        self.env = env
        #: the ready line (empty until it listens, or when not waited for)
        self.ready = ""
        #: ``http://127.0.0.1:PORT`` from the ready line
        self.url = ""
        #: its stderr so far, line by line
        self.err: list[str] = []
        #: what it wrote on stdout after the lines read (once it has `exited`)
        self.out = ""
        self._group = group  # its own process group: end the group
        self._seen = 0  # lines `err_line` has looked at
        self._ended = False
        self._new = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read_err())

    @property
    def port(self) -> int:
        m = _URL.search(self.url)
        assert m, self.url
        return int(m.group(1))

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    async def _read_err(self) -> None:
        assert self.proc.stderr is not None
        try:
            async for raw in self.proc.stderr:
                self.err.append(raw.decode(errors="replace"))
                self._new.set()
        finally:
            self._ended = True
            self._new.set()

    async def line(self, within_s: float = 30) -> str:
        """The next line on its stdout (after the ready line)."""
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), within_s)).decode()

    async def err_line(self, text: str, within_s: float = 20) -> str:
        """The next line of stderr that holds ``text``, after those this has looked at."""
        async with asyncio.timeout(within_s):
            while True:
                while self._seen < len(self.err):
                    line = self.err[self._seen]
                    self._seen += 1
                    if text in line:
                        return line
                assert not self._ended, f"its stderr ended without {text!r}"
                self._new.clear()
                await self._new.wait()

    async def status(self) -> dict[str, Any]:
        """``GET /status``, on a new connection (a worker's, with ``--workers``)."""
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(self.url + "/status") as r:
            return await r.json()  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL (to its process group when it has its own)."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()

    async def exited(self, within_s: float = 30) -> tuple[int, str]:
        """Wait for it to exit on its own: its exit code and its whole stderr.  A child
        still running after ``within_s`` seconds is killed, and the test fails."""
        try:
            code = await asyncio.wait_for(self.proc.wait(), within_s)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
            raise AssertionError(
                f"unbroken serve did not exit within {within_s:g} s; stderr:\n{self.stderr[-4000:]}"
            ) from None
        # the rest of its output (a worker that outlives it keeps the pipes open: the
        # wait is bounded)
        assert self.proc.stdout is not None
        with contextlib.suppress(TimeoutError):
            self.out = (await asyncio.wait_for(self.proc.stdout.read(), 10)).decode()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), 10)
        self._reader.cancel()
        return code, self.stderr

    async def stop(self, sig: int = signal.SIGTERM, within_s: float = 30) -> tuple[int, str]:
        """Send ``sig`` (SIGTERM: a drain) unless it has exited, then `exited`."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await self.exited(within_s)


async def serve_subprocess(
    config: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    listen: bool = True,
    prefix: Sequence[str] = (),
    new_session: bool = False,
    preexec_fn: Callable[[], None] | None = None,
    within_s: float = 30,
) -> Served:
    """``[prefix...] python -m unbroken serve --config CONFIG --port 0 ARGS...``.

    ``env``: variables on top of `clean_env`.  With ``listen`` (the default) it returns
    once the ready line names the URL, and fails the test with the child's exit code and
    stderr if it never does within ``within_s`` seconds; without, at once (for a test that
    expects it to refuse to start: then `Served.exited`).  ``new_session``: its own
    process group, as a shell job has.  ``preexec_fn``: run in the child before it starts
    (a resource limit)."""
    full = clean_env(**dict(env or {}))
    argv = [*prefix, sys.executable, "-m", "unbroken", "serve", "--config", str(config)]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full,
        start_new_session=new_session,
        preexec_fn=preexec_fn,
    )
    served = Served(proc, full, new_session)
    if not listen:
        return served
    try:
        line = await served.line(within_s)
    except TimeoutError:
        line = ""
    m = _URL.search(line)
    if m is None:  # it died or hangs: say why, with what it wrote on stderr
        served.kill()
        code = await asyncio.wait_for(proc.wait(), 10)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(served._reader), 10)
        said = f"exit {code}, stdout {line!r}"
        pytest.fail(
            f"the relay did not say its URL ({said}); stderr:\n{served.stderr[-4000:]}", False
        )
    served.ready, served.url = line, m.group(0)
    return served
