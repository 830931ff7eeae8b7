"""Memory probe for ``serve --workers`` (issue 25): put this directory on PYTHONPATH.

    PYTHONPATH=src:bench/memprobe MEMPROBE_DIR=/tmp/mp MEMPROBE_TRIM=1 \\
        python bench/soak.py --workers 2 --redis --duration 400 --warmup 60 --sample 30

Python imports ``sitecustomize`` at start-up; with ``MEMPROBE_DIR`` set, every process
forked from the one that imported it (the supervisor's workers) starts a daemon thread
that appends one JSON line every ``MEMPROBE_PERIOD`` seconds (default 20) to
``MEMPROBE_DIR/<pid>.jsonl``: RSS, glibc's ``mallinfo2`` (heap reserved, in use, free),
``sys.getallocatedblocks()``, the number of objects the collector tracks (frozen ones,
see ``tune_gc``, excluded), the 12 commonest types, and the Redis store's write queue.
With ``MEMPROBE_TRIM=1`` the first worker forked also calls ``malloc_trim(0)`` after
each sample and records its RSS after.  The bench's own env filter drops ``UNBROKEN_*``
variables, hence the names.  glibc (Linux) only.
"""

from __future__ import annotations

import os

if os.environ.get("MEMPROBE_DIR"):
    import collections
    import ctypes
    import gc
    import json
    import re
    import sys
    import threading
    import time
    from typing import Any

    _OUT = os.environ["MEMPROBE_DIR"]
    _PERIOD = float(os.environ.get("MEMPROBE_PERIOD", "20"))
    _TRIM = os.environ.get("MEMPROBE_TRIM") == "1"
    _FIELDS: tuple[str, ...]
    _FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
    _FIELDS += ("uordblks", "fordblks", "keepcost")

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in _FIELDS]

    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2
    _forks = [0]

    def _rss_mib() -> float:
        with open(f"/proc/{os.getpid()}/status") as f:
            m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) / 1024 if m else 0.0

    def _store_queue() -> int | None:
        import asyncio.tasks

        # every task of every loop (all_tasks() sees only this thread's): private, untyped
        for task in list(asyncio.tasks._all_tasks):  # type: ignore[attr-defined]
            coro = task.get_coro()
            if getattr(coro, "__name__", "") == "_writer" and coro.cr_frame is not None:
                return int(coro.cr_frame.f_locals["self"]._queue.qsize())
        return None

    def _loop(trim: bool) -> None:
        t0 = time.time()
        with open(f"{_OUT}/{os.getpid()}.jsonl", "a") as out:
            while True:
                time.sleep(_PERIOD)
                mi = _libc.mallinfo2()
                objs = gc.get_objects()
                rec: dict[str, Any] = {
                    "t": round(time.time() - t0, 1),
                    "rss": _rss_mib(),
                    "blocks": sys.getallocatedblocks(),
                    "objs": len(objs),
                    "top": collections.Counter(type(o).__qualname__ for o in objs).most_common(12),
                    "arena_mib": mi.arena / 2**20,
                    "used_mib": mi.uordblks / 2**20,
                    "free_mib": mi.fordblks / 2**20,
                    "mmap_mib": mi.hblkhd / 2**20,
                    "threads": threading.active_count(),
                    "trim": trim,
                }
                del objs
                try:
                    rec["queue"] = _store_queue()
                except Exception as exc:  # a probe, not the relay: note it and go on
                    rec["error"] = repr(exc)
                if trim:
                    _libc.malloc_trim(0)
                    rec["rss_after_trim"] = _rss_mib()
                out.write(json.dumps(rec) + "\n")
                out.flush()

    def _child() -> None:
        _forks[0] += 1
        trim = _TRIM and _forks[0] == 1
        threading.Thread(target=_loop, args=(trim,), daemon=True, name="memprobe").start()

    def _parent() -> None:
        _forks[0] += 1

    os.register_at_fork(after_in_child=_child, after_in_parent=_parent)
