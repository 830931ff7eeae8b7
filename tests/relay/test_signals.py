"""Signals to a real relay (issue 25): SIGHUP drains like SIGTERM, and so does a group signal.

A closed terminal sends SIGHUP to the whole foreground process group: the
supervisor and every worker at once (``os.killpg`` here).  systemd's default
``KillMode=control-group`` does the same with SIGTERM.  Either way every stream
in flight must finish whole, every worker must exit, and the supervisor's
runtime directory must be gone.  ``nohup`` (SIGHUP ignored at start) still means
"keep running".
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relay.test_health_relay import CHAT, PATH, until
from servefix import Served, serve_subprocess
from unbroken.mock import MockProvider

STREAM = {"deltas": 30, "chunk_delay_ms": 100, "count": 100}  # ~3 s streams


def short_tmpdir() -> Path:
    """A TMPDIR short enough for the workers' sockets, so their runtime directory is
    made in it and the tests can look there (pytest's tmp_path under an xdist worker
    is long enough that the supervisor rightly moves it to /tmp); removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="ubt-", dir="/tmp"))
    atexit.register(shutil.rmtree, path, True)
    return path


def _hup_default() -> None:
    """The relay starts with SIGHUP's default disposition, as from a terminal, even when
    this test session runs under ``nohup`` (a relay keeps an inherited ignore, by
    design: under ``nohup`` the SIGHUP cases failed; ``ignore_hup`` tests that)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


async def start_relay(
    tmp_path: Path,
    upstream: str,
    workers: int,
    *,
    ignore_hup: bool = False,
    tmpdir: Path | None = None,
) -> Served:
    """The relay in its own process group, as a shell job is, its runtime directory made
    in ``tmpdir`` (by default a short one of its own: `tmpdir_of`)."""
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        "[server]\ngrace_s = 20\n[retry]\ndelay_ms = 5\n[journal]\nenabled = false\n"
        f'[routes.mock]\nupstreams = [{{ url = "{upstream}" }}]\n'
    )
    if tmpdir is None:  # the supervisor's runtime directory is made here
        tmpdir = short_tmpdir()
    return await serve_subprocess(
        cfg,
        *(["--workers", str(workers)] if workers > 1 else []),
        env={"TMPDIR": str(tmpdir)},
        prefix=["nohup"] if ignore_hup else [],
        new_session=True,
        preexec_fn=_hup_default,
    )


def tmpdir_of(relay: Served) -> Path:
    """Where the relay makes its runtime directory (its ``TMPDIR``)."""
    return Path(relay.env["TMPDIR"])


async def test_a_relay_that_does_not_start_fails_the_helper_with_its_stderr(
    tmp_path: Path,
) -> None:
    # The helper showed only the empty stdout line ("AssertionError: ''") when the
    # relay died before it listened: the reason was in the child's stderr, unread.
    with pytest.raises(pytest.fail.Exception) as failed:
        await start_relay(tmp_path, "ftp://nowhere", workers=1)
    message = str(failed.value)
    assert "exit 2" in message and "ftp://nowhere" in message, message


def gone(path: str) -> bool:
    return not os.path.lexists(path)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def streams_in_flight(
    relay: Served, http: aiohttp.ClientSession, workers: int
) -> tuple[list[asyncio.Future[bytes]], set[int]]:
    """Streams open on every worker; returns them and the worker pids."""

    async def stream() -> bytes:
        async with http.post(relay.url + PATH, json=CHAT) as r:
            assert r.status == 200
            return await r.read()

    futures: list[asyncio.Future[bytes]] = [asyncio.ensure_future(stream()) for _ in range(8)]
    want = set(range(workers)) if workers > 1 else {None}
    pids: set[int] = set()

    async def on_all() -> bool:
        data = await relay.status()
        pids.update(w["pid"] for w in data.get("workers", []))
        if workers <= 1:
            return len(data["inflight"]) == len(futures)
        return {t["worker"] for t in data["inflight"]} == want and len(pids) == workers

    try:
        await until(on_all, cap=10)
    except AssertionError:  # the kernel put all 8 on one worker: add more
        futures += [asyncio.ensure_future(stream()) for _ in range(8)]
        await until(on_all, cap=10)
    return futures, pids


async def signal_and_check(
    relay: Served, mock: MockProvider, workers: int, sig: int, *, group: bool
) -> None:
    mock.script([STREAM])
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    pids: set[int] = set()
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            streams, pids = await streams_in_flight(relay, http, workers)
            if group:
                os.killpg(relay.proc.pid, sig)
            else:
                relay.proc.send_signal(sig)
            bodies = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        cut = [b for b in bodies if not (isinstance(b, bytes) and b"[DONE]" in b)]
        assert not cut, f"{len(cut)} of {len(bodies)} streams cut: {cut[:2]}"
        code, err = await relay.exited()
        try:
            await until(lambda: not any(alive(p) for p in pids), cap=10)
        except AssertionError:
            raise AssertionError(f"orphaned workers: {[p for p in pids if alive(p)]}") from None
        assert code == 0, f"exit {code}: {err[-2000:]}"
        assert "Traceback" not in err, err[-2000:]
        assert not list(tmpdir_of(relay).glob("unbroken-workers-*")), "runtime dir left behind"
        if workers > 1:  # wherever it was (a long TMPDIR puts it under /tmp): gone
            runtime = re.search(r"runtime dir (\S+?)\)", err)
            assert runtime, err[-2000:]
            assert gone(runtime.group(1)), "runtime dir left behind"
    finally:
        for pid in [relay.proc.pid, *pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGHUP, False), (signal.SIGHUP, True), (signal.SIGTERM, True)],
    ids=["hup-supervisor", "hup-group", "term-group"],
)
async def test_workers_drain_on_hup_and_group_signals(
    tmp_path: Path, mock: MockProvider, sig: signal.Signals, group: bool
) -> None:
    """SIGHUP to the supervisor, SIGHUP to the group (a closed terminal), SIGTERM to the group."""
    relay = await start_relay(tmp_path, mock.url, workers=2)
    await signal_and_check(relay, mock, 2, sig, group=group)


@pytest.mark.timeout(60)
async def test_single_serve_drains_on_sighup(tmp_path: Path, mock: MockProvider) -> None:
    relay = await start_relay(tmp_path, mock.url, workers=1)
    await signal_and_check(relay, mock, 1, signal.SIGHUP, group=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
async def test_nohup_keeps_serving_after_sighup(
    tmp_path: Path, mock: MockProvider, workers: int
) -> None:
    """Started under nohup, SIGHUP is still ignored: the relay answers on, then drains on TERM."""
    relay = await start_relay(tmp_path, mock.url, workers=workers, ignore_hup=True)
    try:
        os.killpg(relay.proc.pid, signal.SIGHUP)
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as http:
            for _ in range(4):  # new connections: each worker takes some
                async with http.post(relay.url + PATH, json=CHAT) as r:
                    assert r.status == 200 and b"[DONE]" in await r.read()
        assert relay.proc.returncode is None
    finally:
        code, _ = await relay.stop()
    assert code == 0


@pytest.mark.timeout(60)
async def test_workers_of_a_killed_supervisor_drain_and_exit(
    tmp_path: Path, mock: MockProvider
) -> None:
    """SIGKILL leaves the supervisor no say: the kernel tells each worker (PDEATHSIG)."""
    relay = await start_relay(tmp_path, mock.url, workers=2)
    mock.script([STREAM])
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    pids: set[int] = set()
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            streams, pids = await streams_in_flight(relay, http, 2)
            relay.proc.kill()
            bodies = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        cut = [b for b in bodies if not (isinstance(b, bytes) and b"[DONE]" in b)]
        assert not cut, f"{len(cut)} of {len(bodies)} streams cut: {cut[:2]}"
        await until(lambda: not any(alive(p) for p in pids), cap=20)  # none serves on alone
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await relay.exited()


@pytest.mark.timeout(90)
async def test_what_a_worker_crash_costs(tmp_path: Path, mock: MockProvider) -> None:
    """As README says: the crashed worker's streams are cut (the client sees the body end
    early, no terminal frame), the other worker's finish whole, and it is restarted."""
    relay = await start_relay(tmp_path, mock.url, workers=2)
    mock.script([STREAM])
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            by_worker: dict[int, int] = {}

            async def stream() -> bytes | BaseException:
                try:
                    async with http.post(relay.url + PATH, json=CHAT) as r:
                        assert r.status == 200
                        return await r.read()
                except aiohttp.ClientError as exc:  # the body ended early
                    return exc

            futures = [asyncio.ensure_future(stream()) for _ in range(12)]

            async def on_both() -> bool:
                data = await relay.status()
                for w in data.get("workers", []):
                    by_worker[w["id"]] = w["pid"]
                ids = [t["worker"] for t in data["inflight"]]
                return set(ids) == {0, 1} and len(by_worker) == 2

            await until(on_both, cap=15)
            data = await relay.status()
            on_victim = sum(1 for t in data["inflight"] if t["worker"] == 0)
            os.kill(by_worker[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*futures), 30)
            cut = [b for b in results if isinstance(b, BaseException)]
            whole = [b for b in results if isinstance(b, bytes) and b"[DONE]" in b]
            assert len(cut) >= on_victim > 0, results
            assert len(cut) + len(whole) == len(futures)

            async def restarted() -> bool:
                data = await relay.status()
                return any(w["id"] == 0 and w["pid"] != by_worker[0] for w in data["workers"])

            await until(restarted, cap=20)
    finally:
        code, err = await relay.stop()
    assert code == 0
    assert re.search(r"worker 0 \(pid \d+\) exited with code -9: restarting", err), err


@pytest.mark.timeout(90)
async def test_sigterm_while_a_crashed_worker_waits_to_restart(
    tmp_path: Path, mock: MockProvider
) -> None:
    """A signal during the restart pause: the worker is not started again behind the
    supervisor's back (it was, and the supervisor waited for it forever)."""
    relay = await start_relay(tmp_path, mock.url, workers=2)
    pids: set[int] = set()
    data: dict[str, Any] = {}

    async def has_worker_0() -> bool:
        data.update(await relay.status())
        return any(w["id"] == 0 and w["pid"] not in pids for w in data["workers"])

    try:
        for _ in range(3):  # the pause grows: 0.05 s, 0.1 s, 0.2 s
            await until(has_worker_0, cap=20)
            [victim] = [w["pid"] for w in data["workers"] if w["id"] == 0]
            pids.add(victim)
            os.kill(victim, signal.SIGKILL)
            # the supervisor says it will restart it, then pauses
            await relay.err_line("restarting in", 20)
        relay.proc.send_signal(signal.SIGTERM)  # during the 0.2 s pause
        code = await asyncio.wait_for(relay.proc.wait(), 30)
        assert code == 0
        assert not list(tmpdir_of(relay).glob("unbroken-workers-*"))
    finally:
        relay.kill()
        await relay.exited()
