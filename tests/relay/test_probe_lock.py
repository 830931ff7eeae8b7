"""Issue 36 item 1: the workers' probe lock (``probe-<hash>`` in the runtime directory)
is released as soon as its holder has no probe out, so a sibling probes at once.

Two `ChannelStore` boards share one directory, as two ``--workers`` processes do.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from redisfix import RedisServer
from relay.test_health_relay import until
from unbroken.core.admission.health import Breaker, Change, HealthBoard
from unbroken.relay import store as store_mod
from unbroken.relay.store import ChannelStore, RedisStore

KEY = "mock|http://127.0.0.1:1"


def _pair(tmp_path: Path) -> tuple[HealthBoard, ChannelStore, HealthBoard, ChannelStore]:
    a, b = HealthBoard(), HealthBoard()
    return a, ChannelStore(a, tmp_path, 0), b, ChannelStore(b, tmp_path, 1)


def _open_both(a: HealthBoard, b: HealthBoard, now: float) -> None:
    for _ in range(a.settings.failures_to_open):
        a.failure(KEY, now, "connect")
    for _ in range(b.settings.failures_to_open):
        b.failure(KEY, now, "connect")
    assert a.state(KEY, now) is b.state(KEY, now) is Breaker.OPEN


def _locks(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("probe-*"))


def test_a_probe_overtaken_by_a_siblings_open_releases_its_lock(tmp_path: Path) -> None:
    """The race of the issue: B's probe fails (B re-opens and frees the lock); A, half-open
    before B's news arrives, takes the lock and probes; B's "open" arrives; A's probe fails
    on a breaker already open.  Old code: A's lock stayed for ``probe_timeout_s`` (30 s)
    and neither worker probed again."""
    a, _, b, _ = _pair(tmp_path)
    t = 100.0
    _open_both(a, b, t)
    t += 1.0  # both half-open
    assert b.take(KEY, t)  # B probes
    b.failure(KEY, t, "connect")  # and fails: B re-opens (its lock goes)
    assert a.take(KEY, t)  # A, half-open on its own clock, probes too
    a.apply(_open_change(b, t), t)  # B's news arrives
    a.failure(KEY, t + 0.01, "connect")  # A's probe fails on an open breaker
    assert _locks(tmp_path) == [], "a lock whose holder has no probe out"
    t += 1.0  # both half-open again: one of them probes at once
    assert a.take(KEY, t) or b.take(KEY, t)


def _open_change(board: HealthBoard, now: float) -> Change:
    rec = board.get(KEY)
    return Change(KEY, "open", rec.open_until - now, "probe failed", rec.reopens)


def test_a_sibling_looks_again_soon_not_when_the_lease_runs_out(tmp_path: Path) -> None:
    """The loser of the lock is blocked for ``max_open_s``, not ``probe_timeout_s``: when
    the holder gives the lease back without a verdict, the sibling probes at once."""
    a, _, b, _ = _pair(tmp_path)
    t = 100.0
    _open_both(a, b, t)
    t += 1.0
    assert a.take(KEY, t)
    assert not b.take(KEY, t)
    assert b.blocked_until(KEY, t) <= t + b.settings.max_open_s
    a.probe_abandoned(KEY)  # A's probe's turn ended with no verdict (its client left)
    assert _locks(tmp_path) == []
    assert b.take(KEY, t + b.settings.max_open_s)  # B probes now


def test_a_lock_whose_holder_is_dead_is_taken_over(tmp_path: Path) -> None:
    """A worker killed while it held the lock: its pid is gone, the lock is stale at once."""
    _, _, b, _ = _pair(tmp_path)
    t = 100.0
    for _ in range(b.settings.failures_to_open):
        b.failure(KEY, t, "connect")
    lock = tmp_path / f"probe-{hashlib.sha1(KEY.encode()).hexdigest()[:16]}"
    lock.write_bytes(b"999999999 deadbeef0000\n")  # no such pid
    assert b.take(KEY, t + 1.0)
    assert _locks(tmp_path) == [lock] and lock.read_bytes() != b"999999999 deadbeef0000\n"
    lock.write_bytes(f"{os.getppid()} cafebabe0000\n".encode())  # a live holder
    b.failure(KEY, t + 1.0, "connect")  # B's probe failed: B's lease goes (not another's)
    assert lock.exists()
    assert not b.take(KEY, t + 2.0)


async def test_a_redis_probe_lease_is_given_back_when_a_peers_open_overtakes_it(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race through Redis: the lease key goes at once (only while it is ours).

    The lease must come from Redis: on a loaded machine an answer slower than the probe's
    budget (0.2 s) makes the relay probe on its own word and the key may never be set, so
    the test gives the question all the time it needs (it failed so in a clean-clone run).
    """
    monkeypatch.setattr(store_mod, "PROBE_BUDGET_S", 30.0)
    board = HealthBoard()
    store = RedisStore(board, redis_server.url)
    await store.start()
    try:
        await until(lambda: store.up, cap=10)
        t = 100.0
        for _ in range(board.settings.failures_to_open):
            board.failure(KEY, t, "connect")
        t += 1.0
        assert board.take(KEY, t) is False  # asked Redis: not known yet
        await until(lambda: KEY in store._probes, cap=5)
        assert board.take(KEY, t + 0.1)  # ours
        name = f"unbroken:{KEY}:probe"
        assert await store.redis.get(name) == store.origin.encode()
        board.apply(Change(KEY, "open", 0.5, "peer", 1), t + 0.1)  # a peer's probe failed
        await until(lambda: _gone(store, name), cap=5)
        # a lease that is another's is left alone
        await store.redis.set(name, "someone-else", px=30_000)
        board.records[KEY].probe_held = True
        board.apply(Change(KEY, "close"), t + 0.2)
        await until(lambda: not store._side, cap=5)  # the release ran
        assert await store.redis.get(name) == b"someone-else"
    finally:
        await store.close()


async def _gone(store: RedisStore, name: str) -> bool:
    return not await store.redis.exists(name)
