"""``unbroken serve --workers N``: N relay processes on one port, and their supervisor.

* **One port, N accept queues.**  The supervisor resolves the port once (port 0
  picks a free one) by binding a ``SO_REUSEPORT`` socket that never listens; each
  worker then binds and listens on the same address with ``SO_REUSEPORT``, and the
  Linux kernel spreads new connections over the workers.
* **Supervision.**  The parent only watches: a worker that exits while the relay is
  not shutting down is restarted (with a growing pause if it keeps crashing).
  SIGTERM, SIGINT or SIGHUP is forwarded to every worker as SIGTERM, which drains it
  like a single ``unbroken serve`` (in-flight turns finish within ``grace_s``); a
  second signal is forwarded as SIGUSR1, which cuts the grace period short.  Workers
  ignore SIGINT and SIGHUP themselves and take a repeated SIGTERM as the same drain,
  so a signal to the whole process group (Ctrl-C, a closed terminal, systemd's
  ``KillMode=control-group``) is one signal, not two.  SIGHUP drains rather than
  reloads: a closed terminal means "this relay's terminal is gone", and nothing
  is reloadable in place; started under ``nohup`` (SIGHUP ignored) it stays ignored.
  A worker whose supervisor dies without forwarding (SIGKILL) gets SIGTERM from the
  kernel (``PR_SET_PDEATHSIG``) and drains instead of serving on unsupervised.
* **Shared health.**  With ``[health] store = "redis://..."`` the workers share
  health through Redis like any fleet.  Without it they share it through a local
  channel in the supervisor's runtime directory (`unbroken.relay.channel_store.ChannelStore`:
  Unix datagrams between siblings, probe ownership by exclusive file creation, the
  providers' rate-limit budgets in ``rates.sqlite``: `unbroken.relay.ratefile`).  The
  same directory holds each worker's ``/status`` summary (``status-<id>.json``,
  rewritten every second), so whichever worker answers ``/status`` shows them all.
  The directory (``$TMPDIR/unbroken-workers-<random>``, its supervisor's pid in
  ``supervisor.pid``) is removed when the supervisor exits; one left by a supervisor
  killed with SIGKILL is removed by the next supervisor that starts
  (`clean_stale_runtime_dirs`: only this user's, only those whose supervisor is gone).
  It is made in the temporary directory (``TMPDIR``), or under ``/tmp`` when a
  worker's socket path there would be longer than a Unix socket can bind
  (`channel_store.SUN_PATH_MAX`, 107 bytes): a long ``TMPDIR`` costs nothing but a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.config import Config
from unbroken.relay.server import RelayServer, finish_cut_short, tune_gc
from unbroken.relay.siblings import WorkerSpec, stop_signals
from unbroken.relay.store import SUN_PATH_MAX, channel_socket

__all__ = ["OWNER_FILE", "RUNTIME_PREFIX", "clean_stale_runtime_dirs", "serve_workers"]

log = logging.getLogger("unbroken")

STATUS_EVERY_S = 1.0
#: sent by the supervisor to its workers on a second signal: stop waiting for turns
FORCE_SIGNAL = signal.SIGUSR1
#: the supervisor's runtime directory: ``<prefix><random>`` in the temp dir (its Unix
#: sockets' paths must stay short: a pid in the name could push them over 108 bytes)
RUNTIME_PREFIX = "unbroken-workers-"
#: in the runtime directory: the supervisor's pid
OWNER_FILE = "supervisor.pid"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: someone's process is there
        return False
    return False


def _owner(path: str) -> int | None:
    """The pid in a runtime directory's `OWNER_FILE` (None: none, or garbage)."""
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        text = os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


def clean_stale_runtime_dirs(tmp: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the runtime directories that supervisors killed with SIGKILL left in the
    temp directory: only this user's real directories (no symlink) whose
    `OWNER_FILE` names a pid that is gone (a reused pid keeps its directory: a live
    process there may be a supervisor; a directory without the file is left alone,
    as nobody can tell whose it is).  Returns the paths removed."""
    base = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(RUNTIME_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        pid = _owner(entry.path)
        if pid is None or pid == os.getpid() or not _pid_gone(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.info(
            "removed %d runtime dir(s) left by supervisors that were killed: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


#: where the runtime directory goes when ``TMPDIR`` is too long for the sockets
SHORT_TMP = "/tmp"


def _reserve_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def make_runtime_dir(workers: int) -> str:
    """The supervisor's runtime directory (mode 0700): in the temporary directory, or
    under `SHORT_TMP` when the last worker's socket path would not fit a Unix socket
    address there (``bind`` would fail with "AF_UNIX path too long")."""
    runtime = tempfile.mkdtemp(prefix=RUNTIME_PREFIX)
    longest = len(os.fsencode(channel_socket(runtime, workers - 1)))
    if longest <= SUN_PATH_MAX:
        return runtime
    os.rmdir(runtime)
    short = tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=SHORT_TMP)
    log.info(
        "the temporary directory is too long for the workers' sockets (%d bytes, at most %d):"
        " the runtime dir goes under %s",
        longest,
        SUN_PATH_MAX,
        SHORT_TMP,
    )
    return short


def serve_workers(config: Config, n: int, *, ready: Callable[[str], None] | None = None) -> int:
    """Run ``n`` workers until SIGTERM/SIGINT; restart any that die.  Returns 0."""
    if not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - not Linux/BSD
        raise OSError("--workers needs SO_REUSEPORT (Linux)")
    host = config.host.strip() or "127.0.0.1"
    holder = _reserve_port(host, config.port)
    port = holder.getsockname()[1]
    cfg = dataclasses.replace(config, host=host, port=port)
    clean_stale_runtime_dirs()
    runtime = make_runtime_dir(n)
    Path(runtime, OWNER_FILE).write_text(f"{os.getpid()}\n")
    # Imported here: a relay without --workers never needs it (about 0.4 MiB resident).
    import multiprocessing
    import multiprocessing.connection

    ctx = multiprocessing.get_context("fork")
    started: Any = ctx.SimpleQueue()
    procs: dict[int, Any] = {}
    crashes: dict[int, list[float]] = {}
    state = {"signals": 0}

    def start(i: int) -> None:
        p = ctx.Process(
            target=_worker_main,
            args=(cfg, WorkerSpec(i, runtime), started, holder.fileno(), os.getpid()),
            name=f"unbroken-worker-{i}",
        )
        p.start()
        procs[i] = p
        if state["signals"] and p.pid is not None:  # a signal came during the fork: it drains too
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.pid, signal.SIGTERM)

    def on_signal(signum: int, frame: object) -> None:
        state["signals"] += 1
        forward = signal.SIGTERM if state["signals"] == 1 else FORCE_SIGNAL
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.pid, forward)

    previous = {sig: signal.signal(sig, on_signal) for sig in stop_signals()}
    try:
        for i in range(n):
            start(i)
        ready_ids: set[int] = set()
        while len(ready_ids) < n:  # each worker says when it listens
            if not started.empty():
                ready_ids.add(started.get())
                continue
            dead = [i for i, p in procs.items() if i not in ready_ids and not p.is_alive()]
            if dead:
                log.error("worker %d exited before it was ready: stopping", dead[0])
                for p in procs.values():
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(p.pid, signal.SIGTERM)
                return 1
            time.sleep(0.02)
        bracket = f"[{host}]" if ":" in host else host
        url = f"http://{bracket}:{port}"
        log.info("%d workers on %s (runtime dir %s)", n, url, runtime)
        if ready is not None:
            ready(url)
        while procs:
            while not started.empty():  # restarted workers say they listen: not needed now
                started.get()
            sentinels = {p.sentinel: i for i, p in procs.items()}
            for s in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                i = sentinels[s]
                p = procs.pop(i)
                p.join()
                if state["signals"]:
                    continue
                recent = [t for t in crashes.get(i, []) if time.monotonic() - t < 30]
                recent.append(time.monotonic())
                crashes[i] = recent
                pause = min(5.0, 0.05 * 2 ** (len(recent) - 1))
                log.warning(
                    "worker %d (pid %d) exited with code %s: restarting in %.2fs",
                    i,
                    p.pid,
                    p.exitcode,
                    pause,
                )
                time.sleep(pause)
                if not state["signals"]:  # a signal during the pause: no restart
                    start(i)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs.values():
            with contextlib.suppress(Exception):
                p.kill()
                p.join(1)
        holder.close()
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(
    config: Config, spec: WorkerSpec, started: Any, holder_fd: int, supervisor: int
) -> None:
    """A worker process: one relay on the shared port, drained on SIGTERM."""
    # the supervisor forwards SIGINT and SIGHUP as SIGTERM: a group signal is one signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(FORCE_SIGNAL, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.close(holder_fd)
    _die_with_parent(supervisor)
    try:
        code = asyncio.run(_worker_serve(config, spec, lambda: started.put(spec.id)))
    except KeyboardInterrupt:  # pragma: no cover
        code = 0
    os._exit(code)


async def _worker_serve(config: Config, spec: WorkerSpec, ready: Callable[[], None]) -> int:
    server = RelayServer(config, worker=spec)
    await server.start()
    tune_gc()
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    # SIGTERM drains (again and again: the group's and the supervisor's are one);
    # only the supervisor's second signal, FORCE_SIGNAL, cuts the grace period short
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def on_force() -> None:
        stop.set()
        force.set()

    loop.add_signal_handler(FORCE_SIGNAL, on_force)
    ready()
    try:
        await stop.wait()
        log.info("worker %d: shutting down, up to %gs for in-flight turns", spec.id, config.grace_s)
    finally:
        cleanup = asyncio.ensure_future(server.stop())
        forced = asyncio.ensure_future(force.wait())
        await asyncio.wait({cleanup, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not cleanup.done():
            await finish_cut_short(server, cleanup)
    return 0
