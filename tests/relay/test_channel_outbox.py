"""A worker's datagrams to a sibling whose queue is full wait, in order, and go.

A Unix datagram socket queues at most ``net.unix.max_dgram_qlen`` datagrams (10 by
default on Linux) for its reader; past that a non-blocking ``sendto`` fails with
``EAGAIN``.  The workers' channel dropped those silently: a sibling busy for a moment
(the first second of a fleet, a burst of 429s, each a breaker change and a throttle
measure) lost a worker's throttle measure, and nothing answered it.  In the
benchmark (`bare` over ``serve --workers 2``) one worker, cut to 0.57 requests a
second by its third 429, heard no sibling for eight seconds with 23 turns waiting
(``sibling_news`` 2 throughout), its agents far behind the other worker's (fairness
0.541 to 0.619).  Now what the queue cannot take waits in the worker's outbox for that
sibling (bounded: the oldest go past `OUTBOX_MAX`, counted and logged once a minute)
and is sent again shortly, in order.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from pathlib import Path

from relay.test_health_relay import until
from unbroken.core.admission.health import HealthBoard
from unbroken.relay.channel_store import OUTBOX_MAX, ChannelStore, channel_socket
from unbroken.relay.workers import SHORT_TMP

KEY = "mock|http://127.0.0.1:1"


def _short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ub-outbox-", dir=SHORT_TMP))


def _qlen() -> int:
    try:
        return int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    except (OSError, ValueError):
        return 10


async def test_datagrams_a_full_sibling_cannot_take_wait_and_go_in_order() -> None:
    where = _short_dir()
    sibling = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sibling.bind(str(channel_socket(where, 1)))  # a sibling that does not read yet
    sibling.setblocking(False)
    store = ChannelStore(HealthBoard(), where, 0)
    await store.start()
    try:
        n = _qlen() + 30
        for i in range(n):  # a burst: more than the sibling's queue holds
            store._tell_throttle(KEY, "-", float(i), 1.0)
        got: list[float] = []

        def drained() -> bool:
            while True:
                try:
                    data = sibling.recv(8192)
                except BlockingIOError:
                    return len(got) >= n
                msg = json.loads(data)
                if msg.get("kind") == "throttle":
                    got.append(msg["a"])

        await until(drained, cap=10)
        assert got == [float(i) for i in range(n)]  # every one, in the order sent
        out = store.status()["datagrams"]
        assert out["deferred"] >= 30 and out["dropped"] == 0, out
    finally:
        await store.close()
        sibling.close()


async def test_an_outbox_is_bounded_and_a_sibling_that_is_gone_is_forgotten() -> None:
    where = _short_dir()
    sibling = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sibling.bind(str(channel_socket(where, 1)))
    store = ChannelStore(HealthBoard(), where, 0)
    await store.start()
    try:
        for i in range(_qlen() + OUTBOX_MAX + 50):  # a sibling that never reads
            store._tell_throttle(KEY, "-", float(i), 1.0)
        out = store.status()["datagrams"]
        # (the kernel's queue may take one more or fewer than max_dgram_qlen)
        assert 40 <= out["dropped"] <= 50 and out["waiting"] == OUTBOX_MAX, out
        sibling.close()
        channel_socket(where, 1).unlink()  # the sibling is gone: its outbox goes
        await until(lambda: store.status()["datagrams"]["waiting"] == 0, cap=10)
    finally:
        await store.close()
        sibling.close()


async def test_a_burst_to_a_busy_sibling_loses_no_throttle_measure() -> None:
    """Two stores, as two workers: B's loop is busy (not reading) while A tells forty
    measures; when B reads again it hears all forty."""
    where = _short_dir()
    a_board, b_board = HealthBoard(), HealthBoard()
    b_board.get(KEY)  # an upstream B knows: a message about another is garbage
    a, b = ChannelStore(a_board, where, 0), ChannelStore(b_board, where, 1)
    await b.start()
    await a.start()
    heard: list[float] = []
    assert b.rates is not None

    def hear(
        key: str, cred: str, who: str, anchor: float, demand: float, asks: bool = True
    ) -> None:
        heard.append(anchor)

    b.rates.sibling_news = hear  # type: ignore[method-assign]
    try:
        assert b.sock is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.sock.fileno())  # busy
        for i in range(40):
            a._tell_throttle(KEY, "-", float(i), 1.0)
        loop.add_reader(b.sock.fileno(), b._readable)
        await until(lambda: len(heard) >= 40, cap=10)
        assert heard == [float(i) for i in range(40)]
    finally:
        await a.close()
        await b.close()
