"""Issue 36 item 6: a supervisor killed with SIGKILL left its runtime directory in the
temp directory for good.  The next supervisor removes it at start: only this user's
directories, only those whose supervisor is gone."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from relay.test_health_relay import until
from relay.test_signals import alive, start_relay, tmpdir_of
from unbroken.mock import MockProvider
from unbroken.relay.workers import OWNER_FILE, RUNTIME_PREFIX, clean_stale_runtime_dirs


@pytest.mark.timeout(90)
async def test_a_killed_supervisors_runtime_dir_is_removed_by_the_next(
    tmp_path: Path, mock: MockProvider
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    relay = await start_relay(tmp_path / "a", mock.url, workers=2)
    tmpdir = tmpdir_of(relay)
    pids: set[int] = set()

    async def both_workers() -> bool:
        pids.update(w["pid"] for w in (await relay.status()).get("workers", []))
        return len(pids) == 2

    try:
        await until(both_workers, cap=20)
        relay.proc.kill()  # SIGKILL: the supervisor cleans nothing up
        await relay.proc.wait()
        await until(lambda: not any(alive(p) for p in pids), cap=30)
        left = list(tmpdir.glob(f"{RUNTIME_PREFIX}*"))
        assert len(left) == 1  # what the kill leaves
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # a live supervisor's directory (this test's pid stands for one), and one without
    # an owner (nobody can tell whose it is) stay
    live = _runtime(tmpdir, "live", os.getpid())
    old = _runtime(tmpdir, "old", None)
    relay2 = await start_relay(tmp_path / "b", mock.url, workers=2, tmpdir=tmpdir)
    try:
        assert not left[0].exists(), "the killed supervisor's runtime dir is still there"
        assert live.exists() and old.exists()
        assert len(list(tmpdir.glob(f"{RUNTIME_PREFIX}*"))) == 3  # and relay2's own
    finally:
        await relay2.stop()


def _runtime(base: Path, name: str, pid: int | None) -> Path:
    d = base / f"{RUNTIME_PREFIX}{name}"
    d.mkdir()
    if pid is not None:
        (d / OWNER_FILE).write_text(f"{pid}\n")
    return d


def test_only_our_own_dirs_of_dead_supervisors_are_removed(tmp_path: Path) -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = _runtime(tmp_path, "stale", dead)
    (stale / "w0.sock").write_text("")
    mine = _runtime(tmp_path, "mine", os.getpid())
    parent = _runtime(tmp_path, "parent", os.getppid())  # alive
    unowned = _runtime(tmp_path, "unowned", None)
    garbage = _runtime(tmp_path, "garbage", None)
    (garbage / OWNER_FILE).write_text("not a pid")
    a_file = tmp_path / f"{RUNTIME_PREFIX}file"
    a_file.write_text(f"{dead}")
    (tmp_path / "x").mkdir()
    target = _runtime(tmp_path / "x", "t", dead)
    link = tmp_path / f"{RUNTIME_PREFIX}link"
    link.symlink_to(target)
    other = tmp_path / "unrelated"
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead}\n")
    assert clean_stale_runtime_dirs(tmp_path) == [str(stale)]
    assert not stale.exists()
    for kept in (mine, parent, unowned, garbage, a_file, link, target, other):
        assert kept.exists(), kept
