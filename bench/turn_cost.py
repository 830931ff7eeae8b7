"""Per-turn CPU: what one short streamed turn costs the relay, against the bare floor.

A benchmark, not a test.  It measures CPU time, not wall time, so it reads well on a
shared machine: every number is the system under test's own utime + stime (from
/proc) over a batch of turns, divided by the turns, and compared with the bare
aiohttp pass-through measured in the same round.

    python bench/turn_cost.py [--quick] [--turns 3000] [--rounds 5] [--concurrency 64]
                              [--deltas 6] [--profile FILE] [--non-streamed]
                              [--also NAME=SRC_TREE ...]

Processes are those of ``bench/http_bench.py`` (its mock, load generator, bare proxy
and ``unbroken serve`` with default settings, the journal on), pinned the same way.
Each round starts every system afresh and takes their batches in turn.

``--profile FILE`` runs ``unbroken serve`` under cProfile for one extra batch and
writes the stats to FILE, then prints the relay's own functions by self time
(``python -m pstats FILE`` reads it further).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import http_bench as hb


def _batch(
    gen: hb.Proc, proc: hb.Proc, url: str, spec: dict[str, Any], n: int, c: int
) -> tuple[float, float]:
    """(CPU, of which system time) a turn of a batch of ``n``, in µs."""
    user0, sys0 = hb.cpu_times(proc.pid)
    r = gen.call({"op": "batch", "url": url, "n": n, "concurrency": c, **spec}, timeout=600)
    user1, sys1 = hb.cpu_times(proc.pid)
    if r["errors"]:
        raise RuntimeError(f"{proc.name}: {r['errors']} errors, last {r['last_error']}")
    ok: int = r["ok"]
    return (user1 - user0 + sys1 - sys0) / ok * 1e6, (sys1 - sys0) / ok * 1e6


def _named_tree(value: str) -> tuple[str, Path]:
    name, _, src = value.partition("=")
    root = Path(src).resolve()
    if not name or not (root / "src" / "unbroken").is_dir():
        raise SystemExit(f"turn_cost: --also {value!r}: want NAME=<tree with src/unbroken>")
    return name, root


def _start_tree(
    fleet: hb.Fleet, mock_url: str, tag: str, root: Path, extra_config: str = ""
) -> hb.Proc:
    """``unbroken serve`` from another source tree, set up as `hb.start_suts` does
    (with the same ``--config-extra``)."""
    path = os.pathsep.join(filter(None, (str(root / "src"), os.environ.get("PYTHONPATH"))))
    return hb.start_unbroken(
        fleet, mock_url, tag, extra_config=extra_config, env={"PYTHONPATH": path}
    )


def request_spec(args: argparse.Namespace) -> dict[str, Any]:
    spec = hb.mock_spec("chat", {"deltas": args.deltas})
    if args.non_streamed:
        body = dict(hb.PROTOCOLS["chat"]["body"], stream=False)
        spec["body"] = json.dumps(body)
        spec["headers"] = dict(spec["headers"], accept="application/json")
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3000, help="turns per batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--interleave",
        type=int,
        default=1,
        metavar="K",
        help="split each batch into K slices taken in turn across systems",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--deltas", type=int, default=6, help="text deltas per turn")
    parser.add_argument("--non-streamed", action="store_true", help="stream=false turns")
    parser.add_argument("--profile", help="also cProfile unbroken for one batch, stats here")
    parser.add_argument("--top", type=int, default=40, help="profile rows to print")
    parser.add_argument(
        "--config-extra",
        default="",
        help="TOML appended to unbroken's config (e.g. to switch the journal off)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=5.0,
        help="--ttfc: idle time before each request (the systems under test "
        "share a CPU; without it one's end-of-turn work delays the next's "
        "request)",
    )
    parser.add_argument(
        "--ttfc",
        type=int,
        default=0,
        metavar="N",
        help="also N sequential requests per system per round (c=1, one text "
        "delta after 5 ms): time to first text delta, added over direct",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="also measure unbroken from another source tree (e.g. a git "
        "worktree of an older commit), as NAME, in the same rounds",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny counts (a smoke test: the numbers mean nothing)"
    )
    args = parser.parse_args()
    if args.quick:
        args.turns, args.rounds, args.interleave = 100, 1, 2
        args.ttfc = args.ttfc or 10
    if not sys.platform.startswith("linux"):
        print("turn_cost: needs Linux (/proc)", file=sys.stderr)
        return 2
    pinning = (
        "taskset"
        if shutil.which("taskset") and os.cpu_count() and (len(os.sched_getaffinity(0)) >= 2)
        else "none"
    )
    harness = None if pinning == "none" else hb.HARNESS_CPU
    if harness is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {harness})
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-turncost-"))
    fleet = hb.Fleet(workdir, pinning)
    spec = request_spec(args)
    also = dict(_named_tree(v) for v in args.also)
    names = ["bare", "unbroken", *also]
    results: dict[str, list[float]] = {name: [] for name in names}
    system: dict[str, list[float]] = {name: [] for name in names}  # of it, the kernel's
    ttfc: dict[str, list[float]] = {name: [] for name in names}
    try:
        me = str(Path(hb.__file__).resolve())
        mock = fleet.start(
            "mock", [hb.PY, me, "--mock"], cpu=harness, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen", [hb.PY, me, "--loadgen"], cpu=harness, ready=None, pipe_stdio=True
        )
        path = hb.PROTOCOLS["chat"]["path"]
        for rnd in range(args.rounds):
            suts = hb.start_suts(fleet, mock.url, f"r{rnd}", extra_config=args.config_extra)
            procs = dict(suts.items())
            for name, src in also.items():
                procs[name] = _start_tree(fleet, mock.url, f"{name}-r{rnd}", src, args.config_extra)
            k = rnd % len(names)
            order = names[k:] + names[:k]
            for name in order:  # warm-up: imports, pools, caches
                _batch(
                    gen, procs[name], f"{procs[name].url}/mock/{path}", spec, 200, args.concurrency
                )
            line = []
            # Each system's batch in --interleave slices, taken in turn: a slow spell
            # of the machine then falls on every system alike.
            used = dict.fromkeys(order, 0.0)
            in_kernel = dict.fromkeys(order, 0.0)
            part = max(1, args.turns // args.interleave)
            for _ in range(args.interleave):
                for name in order:
                    url = f"{procs[name].url}/mock/{path}"
                    cpu, kernel = _batch(gen, procs[name], url, spec, part, args.concurrency)
                    used[name] += cpu * part
                    in_kernel[name] += kernel * part
            for name in order:
                us = used[name] / (part * args.interleave)
                results[name].append(us)
                system[name].append(in_kernel[name] / (part * args.interleave))
                line.append(f"{name} {us:7.1f} µs/turn")
            hb.log(f"round {rnd + 1}/{args.rounds}: " + ", ".join(line))
            if args.ttfc:
                urls = {"direct": f"{mock.url}/{path}"} | {
                    name: f"{procs[name].url}/mock/{path}" for name in order
                }
                r = gen.call(
                    {
                        "op": "ttfc",
                        "targets": [[n, u] for n, u in urls.items()],
                        "n": args.ttfc,
                        "marker": hb.PROTOCOLS["chat"]["text_marker"],
                        "gap_ms": args.gap_ms,
                        **hb.mock_spec("chat", {"deltas": 1, "chunk_delay_ms": 5}),
                    },
                    timeout=120 + args.ttfc * 3,
                )
                direct = hb.pct(r["first_ms"]["direct"], 50)
                for name in order:
                    ttfc[name].append(hb.pct(r["first_ms"][name], 50) - direct)
                hb.log(
                    "  added TTFC p50 ms: "
                    + ", ".join(f"{name} {ttfc[name][-1]:+.3f}" for name in order)
                )
            for proc in procs.values():
                fleet.stop(proc)
        bare = statistics.median(results["bare"])
        kind = "non-streamed" if args.non_streamed else f"streamed ({args.deltas} deltas)"
        print(
            f"\n{kind} turns, c={args.concurrency}, {args.turns} per batch, "
            f"{args.rounds} rounds, median CPU per turn:"
        )
        print(
            f"  {'bare':12s} {bare:7.1f} µs  (system time "
            f"{statistics.median(system['bare']):.1f} µs)"
        )
        for name in names[1:]:
            ours = statistics.median(results[name])
            ratios = [u / b for u, b in zip(results[name], results["bare"], strict=True)]
            print(
                f"  {name:12s} {ours:7.1f} µs  (+{ours - bare:.1f} µs; "
                f"{statistics.median(ratios):.2f}x bare, median of the rounds' ratios "
                + ", ".join(f"{r:.2f}" for r in ratios)
                + f"; req/s per core "
                f"{1e6 / ours:,.0f} = {bare / ours:.2f}x bare; system time "
                f"{statistics.median(system[name]):.1f} µs)"
            )
        if args.ttfc:
            print(
                f"  added TTFC p50 over direct (median of {args.rounds} rounds of {args.ttfc}): "
                + ", ".join(f"{n} {statistics.median(ttfc[n]):+.3f} ms" for n in names)
            )
        if args.profile:
            _profile(fleet, gen, mock, spec, args)
        return 0
    finally:
        fleet.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def _profile(
    fleet: hb.Fleet, gen: hb.Proc, mock: hb.Proc, spec: dict[str, Any], args: argparse.Namespace
) -> None:
    out = str(Path(args.profile).resolve())
    proc = hb.start_unbroken(fleet, mock.url, "prof", python_args=("-m", "cProfile", "-o", out))
    url = f"{proc.url}/mock/{hb.PROTOCOLS['chat']['path']}"
    _batch(gen, proc, url, spec, 200, args.concurrency)
    _batch(gen, proc, url, spec, args.turns, args.concurrency)
    fleet.stop(proc)
    stats = pstats.Stats(out)
    print(
        f"\ncProfile of unbroken serve, {args.turns + 200} turns; "
        f"unbroken's own functions by self time (all: python -m pstats {args.profile}):"
    )
    rows = []
    total = 0.0
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += tt
        if "/unbroken/" in file:
            rows.append((tt, ct, nc, f"{file.split('/unbroken/')[-1]}:{line}({fn})"))
    rows.sort(reverse=True)
    ours = sum(r[0] for r in rows)
    print(f"  unbroken self time {ours:.3f} s of {total:.3f} s profiled")
    for tt, ct, nc, name in rows[: args.top]:
        print(f"  {tt:7.3f} s self {ct:7.3f} s incl {nc:8d} calls  {name}")


if __name__ == "__main__":
    sys.exit(main())
