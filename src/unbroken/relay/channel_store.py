"""Workers on one machine share health without Redis: `ChannelStore`.

`ChannelStore`: what ``unbroken serve --workers N`` uses when no Redis is
configured.  Each worker binds a Unix datagram socket in the supervisor's runtime
directory and sends every change to its siblings' sockets (no broker, nothing to
start, a dead sibling costs one failed ``sendto``); the half-open probe is owned by
whoever creates ``probe-<hash>`` there first (``O_CREAT|O_EXCL``; it holds the
owner's pid and origin).  The owner removes it the moment the core gives the lease
back (`unbroken.core.admission.health.ProbeRelease`); a lock whose owner is dead or that is
older than ``probe_timeout_s`` is taken over (`unbroken.core.admission.health.probe_lease_stale`
decides).  A worker that (re)starts asks its siblings for their state.  Every second
a worker with turns in an upstream's line tells its siblings so (a ``waiting`` mark
that lasts ``WAITERS_TTL_MS`` unless renewed, withdrawn when its line empties), and
each worker splits the pacer's floor among the workers with live marks, as Redis
splits it among relays: a dead upstream gets one floor from all the workers, not
one from each.  A datagram is at most 4 KiB and schema-checked like a Redis
message (`unbroken.core.admission.shared`).

Each provider budget (per key) is shared as relays share it through Redis
(``self.rates``, a `unbroken.relay.ratestore.RateShare`): its buckets live in
`RATES_FILE` in the same directory, and each worker takes leases from them for the
turns in its line (`unbroken.relay.ratefile.FileRates`: SQLite transactions, off
the event loop).  A slow or failing file leaves a worker pacing alone until the
next report (logged once, and once when it answers again); a worker's throttle
measure (after a 429 lowered it, or answering a sibling's) goes to the siblings in a
datagram, as relays send it on Redis's channel; ``/status`` shows ``ratelimits``
(``shared_buckets``, ``leases``, ``sibling_news``) under the store.

A sibling's socket queues only so many datagrams (``net.unix.max_dgram_qlen``, 10
by default on Linux); past that ``sendto`` fails with ``EAGAIN``.  What a busy
sibling's queue cannot take waits in this worker's outbox for it, in order, and is
sent again after `FLUSH_S` (doubling to `FLUSH_MAX_S` while the sibling stays
full): a burst of changes and throttle measures loses none (they were dropped, and
one worker cut by its 429s heard no sibling for eight seconds).  An outbox holds at
most `OUTBOX_MAX` datagrams (the oldest go, counted and logged once a minute); a
sibling that is gone takes its outbox with it.  ``/status`` shows ``datagrams``
(``deferred``, ``dropped``, ``waiting``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.core.admission.health import Change, HealthBoard, probe_lease_stale
from unbroken.core.admission.shared import (
    MAX_DATAGRAM,
    Link,
    Message,
    SharedBounds,
    escape,
)
from unbroken.relay.ratefile import RATES_FILE, FileRates
from unbroken.relay.ratestore import RateShare
from unbroken.relay.store_base import RESYNC_S, WAITERS_TTL_MS, HealthStore

__all__ = ["FLUSH_MAX_S", "FLUSH_S", "OUTBOX_MAX", "SUN_PATH_MAX", "ChannelStore", "channel_socket"]

log = logging.getLogger("unbroken")

#: the longest path a Unix socket can bind: ``sun_path`` holds 108 bytes on Linux, the
#: NUL included (the supervisor picks a runtime directory where every worker's fits)
SUN_PATH_MAX = 107
#: datagrams waiting for one sibling whose queue is full, at most (the oldest go)
OUTBOX_MAX = 256
#: a full sibling's queue is tried again after this long, doubling up to FLUSH_MAX_S
FLUSH_S = 0.002
FLUSH_MAX_S = 0.1


class ChannelStore(HealthStore):
    """Workers on one machine, no Redis: Unix datagrams between siblings (see above)."""

    kind = "workers"

    def __init__(
        self,
        board: HealthBoard,
        directory: str | os.PathLike[str],
        worker: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        bounds: SharedBounds | None = None,
    ) -> None:
        super().__init__(board, clock=clock, bounds=bounds)
        self.dir = Path(directory)
        self.worker = worker
        self.path = channel_socket(self.dir, worker)
        self.sock: socket.socket | None = None
        self.board.probe_gate = self._probe_gate
        self.board.probe_release = self._probe_release
        #: what this worker writes in the probe locks it owns
        self._lock_mark = f"{os.getpid()} {self.origin}\n".encode()
        #: siblings with turns in an upstream's line: key -> worker -> until (monotonic)
        self.waiters: dict[str, dict[int, float]] = {}
        self._marked: set[str] = set()  # keys this worker told its siblings it waits on
        self._ticker: asyncio.Task[None] | None = None
        #: sibling socket -> datagrams its full queue could not take yet, oldest first
        self._outbox: dict[str, deque[bytes]] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        self._flush_s = FLUSH_S
        self.deferred = 0  # datagrams that waited in an outbox (for /status)
        self.dropped = 0  # ... and that an outbox full to OUTBOX_MAX let go
        #: the providers' rate-limit budgets, one per key across the workers (leases
        #: from `RATES_FILE`); its errors are logged once per outage
        self._rates_link = Link()
        if board.rates.settings.enabled:
            self.rates = RateShare(
                board,
                FileRates(self.dir / RATES_FILE),
                is_up=lambda: True,
                on_error=self._rates_failed,
                on_garbage=lambda why: self._ignored(why, f"{RATES_FILE}"),
                on_answer=self._rates_answered,
                tell=self._tell_throttle,
            )

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "state": "ok",
            "worker": self.worker,
            "ignored": dict(sorted(self.garbage.items())),
            #: datagrams a sibling's full queue made wait, let go, and waiting now
            "datagrams": {
                "deferred": self.deferred,
                "dropped": self.dropped,
                "waiting": sum(len(box) for box in self._outbox.values()),
            },
            #: rate-limit budgets shared between the workers, and the leases taken
            "ratelimits": self.rates.status() if self.rates is not None else None,
        }

    def _rates_failed(self, exc: BaseException) -> None:
        """A rate-limit transaction failed (the limiter paces locally): logged once."""
        if self._rates_link.failed(self.clock()):
            log.warning(
                "worker %d: the workers' rate-limit file is unusable (%s: %s); pacing "
                "locally until it answers again",
                self.worker,
                type(exc).__name__,
                escape(str(exc)),
            )

    def _rates_answered(self) -> None:
        if self._rates_link.answered(self.clock()):
            log.warning("worker %d: the workers' rate-limit file answers again", self.worker)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(self.path))
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self._send(json.dumps({"o": self.origin, "kind": "hello", "w": self.worker}).encode())
        self._ticker = asyncio.ensure_future(self._tick())

    async def close(self) -> None:
        if self.rates is not None:
            self.rates.close()
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        self._outbox.clear()
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            await asyncio.wait([ticker], timeout=2.0)
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
            self.sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def publish(self, change: Change) -> None:
        if change.kind == "half_open":
            return
        self._send(self._encode(change))

    def _broadcast(self, data: bytes) -> None:
        self._send(data)

    def _send(self, data: bytes, to: str | None = None) -> None:
        sock = self.sock
        if sock is None:
            return
        peers = (
            [to] if to else [str(p) for p in self.dir.glob("w*.sock") if p.name != self.path.name]
        )
        for peer in peers:
            if peer in self._outbox:  # behind what already waits for it: in order
                self._hold(peer, data)
                continue
            try:
                sock.sendto(data, peer)
            except BlockingIOError:  # its queue is full: the datagram waits
                self._hold(peer, data)
            except OSError:
                pass  # a sibling that is gone or restarting: it asks for state when back

    def _hold(self, peer: str, data: bytes) -> None:
        """``data`` waits in ``peer``'s outbox (bounded: the oldest go)."""
        box = self._outbox.get(peer)
        if box is None:
            box = self._outbox[peer] = deque()
        if len(box) >= OUTBOX_MAX:
            box.popleft()
            self.dropped += 1
            if self._throttle.allow("outbox", self.clock()):
                log.warning(
                    "worker %d: a sibling's queue stayed full; %d datagram(s) to it let go "
                    "(logged once a minute)",
                    self.worker,
                    self.dropped,
                )
        box.append(data)
        self.deferred += 1
        if self._flush_at is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (closing): nothing will read it anyway
                self._outbox.clear()
                return
            self._flush_at = loop.call_later(self._flush_s, self._flush)

    def _flush(self) -> None:
        """Send what waits, in order, until a sibling's queue is full again."""
        self._flush_at = None
        sock = self.sock
        if sock is None:
            self._outbox.clear()
            return
        for peer, box in list(self._outbox.items()):
            while box:
                try:
                    sock.sendto(box[0], peer)
                except BlockingIOError:
                    break  # still full: later
                except OSError:
                    box.clear()  # gone or restarting: it asks for state when back
                    break
                box.popleft()
            if not box:
                del self._outbox[peer]
        if self._outbox:  # a sibling still busy: again, less often
            self._flush_s = min(self._flush_s * 2.0, FLUSH_MAX_S)
            self._flush_at = asyncio.get_running_loop().call_later(self._flush_s, self._flush)
        else:
            self._flush_s = FLUSH_S

    def _readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        # at most 256 datagrams per wake-up: a flood cannot hold the event loop
        for _ in range(256):
            try:
                data = sock.recv(MAX_DATAGRAM + 1)  # longer: cut, and rejected as oversized
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            msg = self._apply_message(data, "a datagram")
            if msg is not None and msg.kind == "waiting":
                self._mark(msg)
            elif msg is not None and msg.worker is not None:  # a sibling's hello
                peer = str(channel_socket(self.dir, msg.worker))
                for change in self._local_changes():
                    self._send(self._encode(change), to=peer)

    # -- the pacer's floor, split among the workers with turns waiting -------------------
    async def _tick(self) -> None:
        while True:
            self._announce()
            await asyncio.sleep(RESYNC_S)

    def _announce(self) -> None:
        """Tell the siblings which lines this worker has turns in (and which it left),
        then split each pacer's floor anew."""
        for key, pacer in self.board.pacers.items():
            if pacer.queue:
                self._marked.add(key)
                self._send_waiting(key, WAITERS_TTL_MS / 1000)
            elif key in self._marked:  # the line emptied: the siblings have it all back
                self._marked.discard(key)
                self._send_waiting(key, 0.0)
        now = self.clock()
        for key, marks in list(self.waiters.items()):
            for w, until in list(marks.items()):
                if until <= now:
                    del marks[w]
            if not marks:
                del self.waiters[key]
        for key in self.board.pacers:
            self._split(key, now)

    def _send_waiting(self, key: str, ttl_s: float) -> None:
        msg = {"o": self.origin, "kind": "waiting", "w": self.worker, "k": key, "ttl": ttl_s}
        self._send(json.dumps(msg).encode())

    def _mark(self, msg: Message) -> None:
        """A sibling's ``waiting`` mark (validated by `core.admission.shared.parse_message`)."""
        assert msg.key is not None and msg.worker is not None
        if msg.worker == self.worker:
            return  # (a stale socket's sender cannot speak for this worker)
        now = self.clock()
        marks = self.waiters.setdefault(msg.key, {})
        if msg.ttl_s > 0:
            marks[msg.worker] = now + msg.ttl_s
        else:
            marks.pop(msg.worker, None)
        self._split(msg.key, now)

    def _split(self, key: str, now: float) -> None:
        """The pacer's floor is split among the workers with turns in ``key``'s line:
        the siblings with a live mark, and this one (counted always: at least 1)."""
        pacer = self.board.pacers.get(key)
        if pacer is None:
            return
        marks = self.waiters.get(key, {})
        pacer.share = 1 + sum(1 for w, until in marks.items() if until > now and w != self.worker)

    def _probe_path(self, key: str) -> Path:
        return self.dir / f"probe-{hashlib.sha1(key.encode()).hexdigest()[:16]}"

    def _probe_gate(self, key: str, ttl_s: float) -> bool | None:
        path = self._probe_path(key)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                holder = self._lock_holder(path)
                if holder is None:
                    continue  # gone meanwhile: try again
                age, mark = holder
                mine = mark == self._lock_mark  # a lease the core lost track of
                if mine or probe_lease_stale(age, ttl_s, holder_alive=_pid_alive(mark)):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
                return False
            except OSError as exc:  # pragma: no cover - a broken runtime dir
                if exc.errno in (errno.EACCES, errno.ENOENT):
                    return True
                raise
            try:
                os.write(fd, self._lock_mark)
            finally:
                os.close(fd)
            return True
        return False

    def _probe_release(self, key: str) -> None:
        """The core gave the lease back: the lock goes, if it is still ours."""
        path = self._probe_path(key)
        holder = self._lock_holder(path)
        if holder is not None and holder[1] == self._lock_mark:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    @staticmethod
    def _lock_holder(path: Path) -> tuple[float, bytes] | None:
        """A probe lock's age (s) and content; None when there is none."""
        try:
            with open(path, "rb") as f:
                mark = f.read(128)
                age = time.time() - os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        except OSError:  # pragma: no cover - a broken runtime dir: as old as can be
            return float("inf"), b""
        return age, mark


def _pid_alive(mark: bytes) -> bool:
    """Is the process whose pid a probe lock names alive?  A lock being written (empty)
    or garbage counts as alive: only its age can free it then."""
    try:
        pid = int(mark.split(maxsplit=1)[0])
    except (ValueError, IndexError):
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def channel_socket(directory: str | os.PathLike[str], worker: int) -> Path:
    """Worker ``worker``'s datagram socket in the runtime directory."""
    return Path(directory) / f"w{worker}.sock"
