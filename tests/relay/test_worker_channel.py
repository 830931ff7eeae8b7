"""Issue 25: the workers' channel takes no garbage (real ``--workers 2`` processes).

A same-user process can send datagrams to a worker's socket in the supervisor's
runtime directory.  Each worker size-limits and schema-checks them: a ``ttl`` of
1e9 is clamped to the worker's own bounds, ``NaN`` / ``Infinity`` / ``{"w": "abc"}``
/ an unknown upstream are ignored (one log line a minute per kind, no traceback),
and a ``\\n`` in a field cannot forge a log line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp

from relay.test_health_relay import until
from relay.test_workers import mock2  # a fixture
from unbroken.mock import MockProvider
from unbroken.relay.store import SUN_PATH_MAX, channel_socket
from unbroken.relay.workers import SHORT_TMP

__all__ = ["mock2"]


class Fleet:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, runtime: Path) -> None:
        self.proc, self.url, self.runtime = proc, url, runtime
        self.err: list[str] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.err.append(line.decode(errors="replace"))

    async def status(self) -> dict[str, Any]:
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(self.url + "/status") as r:
            return await r.json()  # type: ignore[no-any-return]

    def send(self, data: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for w in (0, 1):
                s.sendto(data, str(self.runtime / f"w{w}.sock"))

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), 30)
        await asyncio.wait_for(self.reader, 5)
        assert self.proc.returncode is not None
        return self.proc.returncode


async def start(tmp_path: Path, upstreams: list[str], *, tmpdir: Path | None = None) -> Fleet:
    cfg = tmp_path / "fleet.toml"
    ups = ", ".join(f'{{ url = "{u}" }}' for u in upstreams)
    cfg.write_text(
        "[server]\ngrace_s = 5\n[retry]\ndelay_ms = 5\n[journal]\nenabled = false\n"
        "[health]\nquota_cooloff_s = 30\n"
        f"[routes.mock]\nupstreams = [{ups}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "OPENCODE_"))}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "unbroken", "serve", "--config", str(cfg)),
        *("--port", "0", "--workers", "2"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    m = re.search(r"http://127\.0\.0\.1:\d+", line)
    if m is None:  # it never listened: its stderr says why
        proc.kill()
        err = (await asyncio.wait_for(proc.stderr.read(), 10)).decode(errors="replace")
        raise AssertionError(f"no URL on stdout ({line!r}); stderr:\n{err[-3000:]}")
    fleet = Fleet(proc, m.group(0), Path("/nonexistent"))

    def runtime() -> bool:
        for e in fleet.err:
            found = re.search(r"runtime dir (\S+?)\)", e)
            if found:
                fleet.runtime = Path(found.group(1))
                return True
        return False

    await until(runtime, cap=10)
    return fleet


def msg(**fields: Any) -> bytes:
    return json.dumps({"o": "intruder", **fields}).encode()


async def test_a_worker_clamps_and_ignores_what_its_channel_brings(
    tmp_path: Path, mock: MockProvider, mock2: MockProvider
) -> None:
    fleet = await start(tmp_path, [mock.url, mock2.url])
    try:
        k1, k2 = f"mock|{mock.url}", f"mock|{mock2.url}"
        for data in (
            b'{"o": "intruder", "kind": "open", "k": "%s", "ttl": NaN}' % k2.encode(),
            b'{"o": "intruder", "kind": "open", "k": "%s", "ttl": Infinity}' % k2.encode(),
            msg(kind="open", k=k2, ttl=1e999),  # out of JSON's range: inf, clamped
            msg(kind="open", k=k2, ttl=0.05, n=10**30),
            msg(kind="hello", w="abc"),
            msg(kind="hello", w=-1),
            msg(kind="cooloff", k="other|http://x", ttl=5.0, r="retry_after"),
            msg(kind="open", k=k1, ttl=0.05, r="x\n2026-01-01 unbroken WARNING forged line"),
            b"[1, 2",
            b"x" * 70_000,
        ) + (msg(kind="open", k=k2, ttl="abc"),) * 5:
            fleet.send(data)
        # last: a cool-off of a billion seconds and a quota one; once both workers
        # show them (datagrams arrive in order), every garbage one was read before
        fleet.send(msg(kind="cooloff", k=k1, ttl=1e9, r="retry_after"))
        fleet.send(msg(kind="cooloff", k=k2, ttl=1e9, r="quota"))
        seen: dict[int, dict[str, Any]] = {}

        async def both_learned() -> bool:
            data = await fleet.status()
            ups = {u["upstream"]: u for u in data["upstreams"]}
            if ups[mock.url]["cooloff_s"] > 0 and ups[mock2.url]["cooloff_s"] > 0:
                seen[data["worker"]["id"]] = ups
            return set(seen) == {0, 1}

        await until(both_learned, cap=20)
        for ups in seen.values():
            assert 50 < ups[mock.url]["cooloff_s"] <= 60  # max_retry_after_ms
            assert 20 < ups[mock2.url]["cooloff_s"] <= 30  # quota_cooloff_s
        closed: set[int] = set()

        async def breakers_closed_again() -> bool:  # max_open_s (0.5 s): never Infinity
            data = await fleet.status()
            ups = {u["upstream"]: u for u in data["upstreams"]}
            if ups[mock2.url]["breaker"] != "open":
                closed.add(data["worker"]["id"])
            return closed == {0, 1}

        await until(breakers_closed_again, cap=5)
        final = await fleet.status()
        assert sorted(w["id"] for w in final["workers"]) == [0, 1]
        assert not any("exited" in e for e in fleet.err)  # no worker died of it
    finally:
        assert await fleet.stop() == 0
    err = "".join(fleet.err)
    assert "Traceback" not in err, err
    assert not any(line.startswith("2026-01-01") for line in fleet.err), err
    assert "forged line" in err and "\\n2026-01-01" in err  # logged, escaped
    ignored = [e for e in fleet.err if "ignored malformed message" in e]
    assert 2 <= len(ignored) <= 2, ignored  # once a minute per worker, for all of them


async def test_a_siblings_status_summary_that_is_garbage_is_skipped(
    tmp_path: Path, mock: MockProvider
) -> None:
    """/status merges the workers' summaries from the runtime directory: a file there
    that is not shaped like one (or too deep to parse) is skipped, never a 500."""
    fleet = await start(tmp_path, [mock.url])
    try:

        async def both_up() -> bool:
            return len((await fleet.status()).get("workers", [])) == 2

        await until(both_up, cap=20)
        for i, junk in enumerate(
            ({"now": [1]}, {"now": 1e300, "worker": 7, "pid": 7, "inflight": 5}, [1], "x")
        ):
            (fleet.runtime / f"status-{7 + i}.json").write_text(json.dumps(junk))
        (fleet.runtime / "status-20.json").write_text("{" * 100_000)
        answered: set[int] = set()

        async def both_answer() -> bool:
            data = await fleet.status()  # a 500 has no JSON: this would raise
            assert sorted(w["id"] for w in data["workers"]) == [0, 1]
            answered.add(data["worker"]["id"])
            return answered == {0, 1}

        await until(both_answer, cap=20)
    finally:
        assert await fleet.stop() == 0
    assert "Traceback" not in "".join(fleet.err)


async def test_workers_under_a_long_tmpdir_put_their_sockets_in_a_short_runtime_dir(
    tmp_path: Path, mock: MockProvider
) -> None:
    # Issue 34: under a TMPDIR whose runtime dir makes a socket path longer than
    # sun_path (107 bytes), every worker died at bind ("AF_UNIX path too long") and
    # `serve --workers 2` exited 1 without listening.  The supervisor now puts the
    # runtime dir under /tmp then, and says so.
    long_tmp = tmp_path / ("long-tmpdir-" + "x" * 100)
    long_tmp.mkdir()
    assert len(os.fsencode(long_tmp / "unbroken-workers-12345678" / "w1.sock")) > SUN_PATH_MAX
    fleet = await start(tmp_path, [mock.url], tmpdir=long_tmp)
    try:
        assert fleet.runtime.parent == Path(SHORT_TMP)
        assert len(os.fsencode(channel_socket(fleet.runtime, 1))) <= SUN_PATH_MAX
        assert fleet.runtime.stat().st_mode & 0o777 == 0o700
        key = f"mock|{mock.url}"
        fleet.send(msg(kind="cooloff", k=key, ttl=30.0, r="retry_after"))
        learned: set[int] = set()

        async def both_learned() -> bool:  # the channel works: both sockets are bound
            data = await fleet.status()
            ups = {u["upstream"]: u for u in data["upstreams"]}
            if ups[mock.url]["cooloff_s"] > 0:
                learned.add(data["worker"]["id"])
            return learned == {0, 1}

        await until(both_learned, cap=20)
        assert not list(long_tmp.iterdir())  # nothing was made in the long TMPDIR
    finally:
        assert await fleet.stop() == 0
    assert not fleet.runtime.exists()  # removed on exit, as in TMPDIR
    err = "".join(fleet.err)
    assert "too long for the workers' sockets" in err and "Traceback" not in err, err
