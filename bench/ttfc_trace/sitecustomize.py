"""Timestamps along the c=1 path of ``unbroken serve``: where time to first chunk goes.

A benchmark aid, not part of unbroken.  Put this directory first on ``PYTHONPATH``
of a ``bench/turn_cost.py --ttfc N`` run (every process imports it; only a process
that loads unbroken's server is instrumented):

    PYTHONPATH=bench/ttfc_trace python bench/turn_cost.py --turns 100 --rounds 1 \\
        --ttfc 2000 --also before=/tmp/before

Each instrumented relay writes ``ttfc_trace_<pid>.txt`` (in ``$TTFC_TRACE_DIR``, else
``/tmp``) when it exits: per step
of a request (request bytes in, handler, turn built, upstream request written and
answered, each frame fed, headers prepared, bytes written), the p50, p75, p90 and
mean in µs over its most common sequence of steps, and the median from the first
request byte to the first text delta written.  Works on the current layout and on
the pre-rewrite one (``cec0759``), so two trees can be compared step by step.  The
wrappers cost about a µs per step, the same in both.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

_ns = time.perf_counter_ns
_EVENTS: list[tuple[str, int]] = []  # the current request's steps
_SEQS: dict[tuple[str, ...], list[list[int]]] = {}
_TO_FIRST: list[int] = []


def _mark(label: str) -> None:
    _EVENTS.append((label, _ns()))


def _flush() -> None:
    labels = [label for label, _ in _EVENTS]
    if "prepare" in labels:
        i = labels.index("prepare")
        if "written" in labels[i:]:
            _TO_FIRST.append(_EVENTS[labels.index("written", i)][1] - _EVENTS[0][1])
    if len(_EVENTS) > 1:
        steps = [_EVENTS[i + 1][1] - _EVENTS[i][1] for i in range(len(_EVENTS) - 1)]
        _SEQS.setdefault(tuple(labels), []).append(steps)
    _EVENTS.clear()


def _dump() -> None:
    if not _SEQS:
        return
    labels, rows = max(_SEQS.items(), key=lambda kv: len(kv[1]))
    folder = os.environ.get("TTFC_TRACE_DIR") or "/tmp"
    with open(os.path.join(folder, f"ttfc_trace_{os.getpid()}.txt"), "w") as f:
        if _TO_FIRST:
            f.write(
                f"first request byte -> first delta written: median "
                f"{statistics.median(_TO_FIRST) / 1000:.1f} us of {len(_TO_FIRST)}\n"
            )
        f.write(f"{len(rows)} requests; µs: p50 p75 p90 mean (of the fastest 99 %)\n")
        for i in range(len(labels) - 1):
            col = sorted(r[i] for r in rows)
            n = len(col)
            f.write(
                f"  {labels[i]:>18} -> {labels[i + 1]:<18} {col[n // 2] / 1000:8.1f} "
                f"{col[n * 3 // 4] / 1000:8.1f} {col[n * 9 // 10] / 1000:8.1f} "
                f"{statistics.fmean(col[: max(1, n * 99 // 100)]) / 1000:8.1f}\n"
            )


def _wrap(owner: Any, name: str, label: str, *, end: str | None = None) -> None:
    f = getattr(owner, name)

    def sync(*a: Any, **k: Any) -> Any:
        _mark(label)
        out = f(*a, **k)
        if end:
            _mark(end)
        return out

    setattr(owner, name, sync)


def _wrap_async(owner: Any, name: str, label: str, *, end: str | None = None) -> None:
    f = getattr(owner, name)

    async def coro(*a: Any, **k: Any) -> Any:
        _mark(label)
        out = await f(*a, **k)
        if end:
            _mark(end)
        return out

    setattr(owner, name, coro)


def _instrument(server: Any) -> None:
    import aiohttp.http_writer as hw
    import aiohttp.web_protocol as wp
    import aiohttp.web_response as wr

    current = hasattr(server, "_dispatch")
    if current:
        turn = importlib.import_module("unbroken.relay.http")._HttpTurn
        upstream = importlib.import_module("unbroken.relay.upstream")
        sse = importlib.import_module("unbroken.core.wire.sse")
        handler = importlib.import_module("unbroken.relay.connections").GuardedHandler
        entry = "_dispatch"
    else:  # the pre-rewrite layout
        turn = importlib.import_module("unbroken.relay")._Turn
        upstream = importlib.import_module("unbroken.upstream")
        sse = importlib.import_module("unbroken.sse")
        handler = wp.RequestHandler
        entry = "_relay"
    received = handler.data_received

    def data_received(self: Any, data: bytes) -> None:
        if not _EVENTS or _EVENTS[-1][0] == "handler_end":
            _flush()  # a new request on the connection
        _mark("bytes_in")
        received(self, data)

    handler.data_received = data_received
    _wrap_async(server, entry, "handler", end="handler_end")
    _wrap(turn, "__init__", "turn_init", end="turn_built")
    _wrap_async(upstream.UpstreamClient, "request", "client.request", end="upstream_answered")
    _wrap_async(hw.StreamWriter, "write_headers", "write_headers")
    _wrap(sse.SSESplitter, "feed", "feed")
    _wrap_async(turn, "_prepare", "prepare", end="prepared")
    _wrap_async(wr.StreamResponse, "write", "write", end="written")


class _OnServerImport(importlib.abc.MetaPathFinder):
    """Instruments unbroken's server module right after it is first imported."""

    NAMES = ("unbroken.relay.server", "unbroken.server")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.NAMES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _instrument(module)
            atexit.register(_dump)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _OnServerImport())
