"""Side by side: direct vs a bare aiohttp pass-through vs unbroken vs the LiteLLM proxy.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/compare.py                 # the full run; writes docs/benchmarks.md + docs/img/
    python bench/compare.py --quick --no-litellm --out /tmp/b.md --img /tmp/img   # smoke test

One interleaved session, each repetition on freshly started processes, all on loopback:
the mock provider and the load generator pinned to CPU 1, each system under test (SUT)
pinned to CPU 0 (the harness of ``bench/http_bench.py``, imported from there).  LiteLLM
runs from its own virtual environment, which this script creates once in
``~/.cache/unbroken-bench/litellm-venv`` (``$XDG_CACHE_HOME``; ``--litellm-venv``):
litellm 1.110.2 plus the dependencies of its ``proxy`` extra (the extra itself cannot be
installed: its ``litellm-proxy`` pin is not on the package index).  It runs offline
(``LITELLM_OFFLINE_MODE=true``, ``LITELLM_LOCAL_MODEL_COST_MAP=True``).  ``--no-litellm``
leaves it out, and the report says so; without that flag a LiteLLM that cannot be
installed or started is an error, never a silent omission.

Metrics: time to first text delta at c=1; streamed (c=64) and non-streamed (c=32) req/s
per SUT core; SUT CPU per SSE frame; RSS idle and per open stream; failover time from a
refused primary; and one fault matrix through every path, judged by the bytes the client
received.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compare_faults import fault_matrix
from compare_measure import (
    CHAT_BODY,
    FULL,
    QUICK,
    CompareGen,
    Profile,
    measure_cpu,
    measure_failover,
    measure_memory,
    measure_rps,
    measure_ttfc,
    spec,
)
from compare_report import aggregate, plots, render
from compare_suts import Suts, litellm_config, litellm_venv, mock_call, refused_port
from harness import PY, ROOT, Fleet, log, pin_harness, pinning_mode, raise_nofile
from http_loadgen import loadgen_main
from reporting import machine_info

# =====================================================================================
# main


def run(prof: Profile, quick: bool, litellm_exe: Path | None) -> dict[str, Any]:
    pinning = pinning_mode()
    harness = pin_harness(pinning)
    raise_nofile(4 * max(prof.mem_points) + 1024)
    machine = machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-compare-"))
    fleet = Fleet(workdir, pinning)
    held = [refused_port(), refused_port()]
    refused = [p for _, p in held]
    ok = False
    try:
        hbpy = str(ROOT / "bench" / "http_bench.py")
        mock = fleet.start(
            "mock", [PY, hbpy, "--mock"], cpu=harness, ready=r"listening on (http://\S+)"
        )
        fault = fleet.start(
            "fault-mock", [PY, hbpy, "--mock"], cpu=harness, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen",
            [PY, str(Path(__file__).resolve()), "--loadgen"],
            cpu=harness,
            ready=None,
            pipe_stdio=True,
        )
        log(f"mock {mock.url}, fault mock {fault.url}; logs in {workdir}")
        reps: list[dict[str, Any]] = []
        names: list[str] = []
        for rep in range(prof.reps):
            suts = Suts(
                fleet,
                f"r{rep}",
                mock_url=mock.url,
                fault_url=fault.url,
                refused=refused,
                litellm=litellm_exe,
            )
            names = suts.names()
            log(
                f"round {rep + 1}/{prof.reps}: fresh "
                + ", ".join(f"{n} (pid {p.pid})" for n, p in suts.procs.items())
            )
            try:
                mock_call(mock.url, "default", {"deltas": 20})
                for n in names:  # one warm-up request each, then idle memory
                    gen.call(
                        {
                            "op": "batch",
                            "url": suts.url(n),
                            "n": 1,
                            "concurrency": 1,
                            **spec(CHAT_BODY),
                        },
                        timeout=60,
                    )
                time.sleep(prof.settle_s)
                r: dict[str, Any] = {"memory": measure_memory(gen, mock.url, suts, prof)}
                r["ttfc"] = measure_ttfc(gen, mock.url, suts, prof)
                r["rps_stream"] = measure_rps(gen, mock, suts, prof, rep, True)
                r["rps_plain"] = measure_rps(gen, mock, suts, prof, rep, False)
                r["cpu"] = measure_cpu(gen, mock.url, suts, prof)
                r["failover"] = measure_failover(gen, mock.url, suts, prof)
                reps.append(r)
                if rep == prof.reps - 1:
                    log("fault matrix")
                    matrix = fault_matrix(
                        fleet,
                        gen,
                        fault,
                        refused,
                        suts if litellm_exe else None,
                        prof.fault_timeout_s,
                    )
            finally:
                suts.stop()
        res = {
            "quick": quick,
            "machine": machine,
            "profile": prof.__dict__,
            "litellm": litellm_exe is not None,
            "agg": aggregate(reps, names),
            "matrix": matrix,
            "loadavg_end": os.getloadavg(),
            "litellm_config": litellm_config(
                "http://127.0.0.1:MOCK", "http://127.0.0.1:FAULTS", [1111, 2222]
            )
            .replace(":1111", ":REFUSED1")
            .replace(":2222", ":REFUSED2"),
        }
        with contextlib.suppress(Exception):
            gen.call({"op": "quit"}, timeout=1)
        ok = True
        return res
    finally:
        fleet.stop_all()
        for s, _ in held:
            s.close()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        loadgen_main(CompareGen)  # http_bench's loop, with cmd_fetch
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    parser.add_argument(
        "--no-litellm", action="store_true", help="leave LiteLLM out (said in the report)"
    )
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument(
        "--litellm-venv", type=Path, default=cache / "unbroken-bench" / "litellm-venv"
    )
    parser.add_argument(
        "--out", help="Markdown report (default docs/benchmarks.md; none with --quick unless given)"
    )
    parser.add_argument("--img", help="PNG directory (default: img/ next to --out)")
    parser.add_argument("--json", help="also write the aggregated results here")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="render the report and plots again from a --json file; no run",
    )
    args = parser.parse_args()
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        write_report(
            res,
            args.out or str(ROOT / "docs" / "benchmarks.md"),
            args.img,
            quick=res["quick"],
            no_litellm=not res["litellm"],
        )
        return 0
    if not sys.platform.startswith("linux"):
        print("compare: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2
    out = args.out or (None if args.quick else str(ROOT / "docs" / "benchmarks.md"))
    exe = None if args.no_litellm else litellm_venv(args.litellm_venv)
    t0 = time.monotonic()
    try:
        res = run(QUICK if args.quick else FULL, args.quick, exe)
    except KeyboardInterrupt:
        log("interrupted; all child processes stopped")
        return 130
    res["elapsed_s"] = time.monotonic() - t0
    agg = res["agg"]
    print("\nunbroken comparison" + (" (QUICK: smoke test only)" if args.quick else ""))
    for p, x in agg["ttfc"].items():
        line = f"  {p:8s} TTFC p50 {x['p50']:.2f} ms (added {x['added_p50']:+.2f})"
        if p != "direct":
            line += (
                f"; per core: streamed {agg['rps_stream'][p]['per_core']:.0f}, non-streamed "
                f"{agg['rps_plain'][p]['per_core']:.0f}; {agg['cpu'][p]['us_per_frame']:.1f} "
                f"µs/frame; idle {agg['memory'][p]['idle_mib']:.1f} MiB, "
                f"{agg['memory'][p]['kib_per_stream']:.1f} KiB/stream"
            )
        print(line)
    for case, row in res["matrix"]["cells"].items():
        print(f"  {case:36s} " + "  ".join(f"{p}: {c['outcome']}" for p, c in row.items()))
    if not res["litellm"]:
        print("  LiteLLM: left out (--no-litellm)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if out:
        write_report(res, out, args.img, quick=args.quick, no_litellm=args.no_litellm)
    return 0


def write_report(
    res: dict[str, Any], out: str, img_dir: str | None, *, quick: bool, no_litellm: bool
) -> None:
    outp = Path(out).resolve()
    img = Path(img_dir).resolve() if img_dir else outp.parent / "img"
    plots(res["agg"], res["matrix"], img)
    cmd = (
        "python bench/compare.py"
        + (" --quick" if quick else "")
        + (" --no-litellm" if no_litellm else "")
    )
    outp.write_text(render(res, os.path.relpath(img, outp.parent), cmd) + "\n")
    log(f"wrote {outp} and 4 plots in {img}")


if __name__ == "__main__":
    sys.exit(main())
