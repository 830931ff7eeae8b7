"""HTTP benchmark: direct to the mock vs a bare aiohttp proxy vs unbroken.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/http_bench.py [--quick] [--out docs/performance.md] [--json FILE]

Everything runs in separate processes on loopback, on ephemeral ports:

* the mock provider (``unbroken.mock.MockProvider``; request recording is
  switched off so its memory and GC work stay flat over ~10^5 requests),
* the systems under test, pinned to CPU 0 with ``taskset -c 0``: the bare
  pass-through proxy (``bench/bare_proxy.py``, the floor) and
  ``python -m unbroken serve``,
* one load generator (aiohttp client), pinned to CPU 1 together with the mock,
  so the system under test has a core of its own.  "direct" (client -> mock)
  uses the same CPU 1 and so measures the harness's own limit.

The machine is shared and noisy: every metric is compared against the direct
path measured in the same run, and every number is a median over several
repetitions (interleaved across paths where that matters).

Metrics (see ``docs/performance.md`` for the definitions and the last results):
added time to first text delta (c=1), streamed req/s (c=64), relay CPU per SSE
frame (chat, responses, messages), idle RSS and RSS per open stream, and the
time the dispatch gate holds a streamed tool call back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# `X as X`: re-exported for the scripts that use this harness as `hb.X` (turn_cost.py,
# instr_cost.py)
from harness import HARNESS_CPU as HARNESS_CPU
from harness import LAUNCHED_READY_S as LAUNCHED_READY_S
from harness import PY as PY
from harness import ROOT as ROOT
from harness import Fleet as Fleet
from harness import Proc as Proc
from harness import cpu_seconds as cpu_seconds
from harness import cpu_times as cpu_times
from harness import log as log
from harness import pct as pct
from harness import pin_harness, pinning_mode, raise_nofile
from harness import start_suts as start_suts
from harness import start_unbroken as start_unbroken
from http_loadgen import loadgen_main, mock_main
from http_measure import (
    BIG_BODY_KIB,
    FULL,
    PATHS,
    QUICK,
    TOOL_MARKER,
    Profile,
    aggregate_cpu,
    aggregate_latency,
    aggregate_memory,
    aggregate_throughput,
    big_body,
    cpu_rep,
    latency_rep,
    path_urls,
    rss_per_stream,
    throughput_rep,
)
from http_measure import PROTOCOLS as PROTOCOLS
from http_measure import mock_spec as mock_spec
from http_report import print_summary, render_markdown
from reporting import machine_info

# -------------------------------------------------------------------------------------
# main


def run(prof: Profile, quick: bool, argv: Sequence[str]) -> dict[str, Any]:
    pinning = pinning_mode()
    if pinning == "taskset":
        log("taskset found: SUT on CPU 0, mock + load generator on CPU 1")
    elif pinning == "sched_setaffinity":
        log("taskset NOT found: pinning with os.sched_setaffinity instead")
    else:
        log("fewer than 2 CPUs: NOT pinning anything; numbers will be harder to read")
    harness_cpu = pin_harness(pinning)

    # 500 streams x (client socket + upstream socket) per SUT, plus the mock's and client's.
    raised = raise_nofile(4 * prof.mem_streams + 1024)
    if raised:
        log(f"raised RLIMIT_NOFILE {raised[0]} -> {raised[1]} (inherited by the children)")

    machine = machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-bench-"))
    fleet = Fleet(workdir, pinning)
    ok = False
    try:
        me = str(Path(__file__).resolve())
        mock = fleet.start(
            "mock", [PY, me, "--mock"], cpu=harness_cpu, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen", [PY, me, "--loadgen"], cpu=harness_cpu, ready=None, pipe_stdio=True
        )
        log(f"mock {mock.url} (pid {mock.pid}); load generator pid {gen.pid}; logs in {workdir}")

        # Memory first, on fresh processes of their own.
        log(f"memory: idle and {prof.mem_streams} open streams")
        memory = aggregate_memory(
            [
                rss_per_stream(
                    fleet, gen, mock.url, f"mem{i}", prof.mem_streams, None, prof.settle_s
                )
                for i in range(prof.mem_reps)
            ]
        )
        body = big_body(BIG_BODY_KIB)
        log(f"memory: {prof.big_streams} open streams with a {len(body) // 1024} KiB request body")
        big_memory = aggregate_memory(
            [rss_per_stream(fleet, gen, mock.url, "big", prof.big_streams, body, prof.settle_s)]
        )

        ttfc_reps: list[dict[str, Any]] = []
        tool_reps: list[dict[str, Any]] = []
        tp_reps: list[dict[str, dict[str, Any]]] = []
        cpu_reps: list[dict[str, Any]] = []
        ttfc_spec = mock_spec("chat", {"deltas": 1, "chunk_delay_ms": 5})
        tool_spec = mock_spec("chat", {"reply": "tool", "chunk_delay_ms": 5})
        tp_spec = mock_spec("chat", {"deltas": 20})
        ns_spec = {
            "body": json.dumps(dict(PROTOCOLS["chat"]["body"], stream=False)),
            "headers": dict(tp_spec["headers"], accept="application/json"),
        }
        ns_reps: list[dict[str, dict[str, Any]]] = []
        big_spec = {**ttfc_spec, "body": body}
        big_reps: list[dict[str, Any]] = []
        for rep in range(prof.reps):
            suts = start_suts(fleet, mock.url, f"r{rep}")
            log(
                f"repetition {rep + 1}/{prof.reps}: fresh bare (pid {suts.bare.pid}) and "
                f"unbroken (pid {suts.unbroken.pid})"
            )
            urls = path_urls(mock.url, suts, "chat")
            for p in PATHS:
                gen.call(
                    {"op": "batch", "url": urls[p], "n": 16, "concurrency": 4, **tp_spec},
                    timeout=60,
                )

            r = latency_rep(gen, urls, ttfc_spec, PROTOCOLS["chat"]["text_marker"], prof.ttfc_n)
            ttfc_reps.append(r)
            log(
                "  TTFC (first text delta) p50/p99 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.3f}/{r[p]['p99']:.3f}" for p in PATHS)
            )

            r = latency_rep(gen, urls, big_spec, PROTOCOLS["chat"]["text_marker"], prof.big_n)
            big_reps.append(r)
            log(
                f"  TTFC with the {len(body) // 1024} KiB body, p50 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.3f}" for p in PATHS)
            )

            r = latency_rep(gen, urls, tool_spec, TOOL_MARKER, prof.tool_n)
            tool_reps.append(r)
            log(
                "  first tool-call byte p50 ms: "
                + ", ".join(f"{p} {r[p]['p50']:.2f}" for p in PATHS)
            )

            tp_reps.append(throughput_rep(gen, mock, urls, suts, tp_spec, prof, rep))
            ns_reps.append(throughput_rep(gen, mock, urls, suts, ns_spec, prof, rep, 32))
            cpu_reps.append(cpu_rep(gen, mock.url, suts, prof, rep))
            fleet.stop(suts.bare)
            fleet.stop(suts.unbroken)

        ttfc = aggregate_latency(ttfc_reps)
        tool = aggregate_latency(tool_reps)
        big = {
            "body_kib": len(body) / 1024,
            "ttfc": aggregate_latency(big_reps),
            "memory": big_memory,
        }
        throughput = aggregate_throughput(tp_reps)
        throughput_ns = aggregate_throughput(ns_reps)
        cpu = aggregate_cpu(cpu_reps)

        res = {
            "quick": quick,
            "machine": machine,
            "profile": prof.__dict__,
            "ttfc": ttfc,
            "tool": tool,
            "throughput": throughput,
            "throughput_ns": throughput_ns,
            "cpu": cpu,
            "memory": memory,
            "big_body": big,
            "loadavg_end": os.getloadavg(),
        }
        with contextlib.suppress(Exception):
            gen.call({"op": "quit"}, timeout=1)
        ok = True
        return res
    except (KeyboardInterrupt, SystemExit):
        ok = True  # interrupted, not broken: nothing worth keeping
        raise
    finally:
        fleet.stop_all()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")


def _iter_argv(args: argparse.Namespace) -> Iterator[str]:
    if args.quick:
        yield "--quick"
    if args.out:
        yield "--out"
        yield args.out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        loadgen_main()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--mock":
        mock_main()
        return 0
    parser = argparse.ArgumentParser(description="unbroken HTTP benchmark (see module docstring)")
    parser.add_argument("--quick", action="store_true", help="small counts, < 1 minute")
    parser.add_argument("--out", help="write the Markdown report here (e.g. docs/performance.md)")
    parser.add_argument("--json", help="also write the raw results as JSON here")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("http_bench: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    t0 = time.monotonic()
    try:
        res = run(QUICK if args.quick else FULL, args.quick, list(_iter_argv(args)))
    except KeyboardInterrupt:
        log("interrupted; all child processes stopped")
        return 130
    except SystemExit:
        log("terminated; all child processes stopped")
        raise
    res["elapsed_s"] = time.monotonic() - t0
    print_summary(res)
    print(f"  ({res['elapsed_s']:.0f} s)")
    if args.out:
        Path(args.out).write_text(render_markdown(res, list(_iter_argv(args))))
        log(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
