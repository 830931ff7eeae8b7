"""Recovery benchmark: how fast a turn completes once its provider comes back, and how
much load the relay puts on the provider while it is down (issue 22).

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/recovery_bench.py --out docs/recovery.md --img docs/img --json /tmp/recovery.json
    python bench/recovery_bench.py --outages 5,30 --counts 30 --no-litellm   # a shorter trial
    python bench/recovery_bench.py --quick                   # smoke run, < 60 s; report to stdout

The first is the full run (about 40 minutes, plus a one-time install of LiteLLM).

Everything is on loopback.  This process runs the fault-injecting mock provider
(``unbroken.mock.MockProvider``, which timestamps every request it receives) and the
clients; each system under test runs in processes of its own (pinned to CPU 0 when
there are two CPUs, this process to CPU 1), started afresh for every run together
with a fresh mock, and warmed with one clean turn before the fault starts.

Turns are streamed OpenAI Chat Completions (``stream: true``); each carries its own id
in the message text, so the mock's log tells which turn every upstream request
belongs to (LiteLLM re-encodes the body but keeps the messages).

Scenarios:

* **outage by time**: the upstream answers 503 to everything for ``--outages`` seconds
  (default 5, 30 and 120), then recovers.  Recovery = the moment it recovers.
* **outage by count**: the first N upstream requests (``--counts``, default 30 and 100)
  answer 503, then it recovers.  Recovery = the moment the N-th 503 is served.  A count
  outage that has not served its N 503s after ``--count-cap`` seconds is ended there.
* both with **1 turn** and with **``--turns`` (200) concurrent turns**, all started when
  the outage starts;
* **busy and partly failing**: ``--busy-rate`` (100) turns per second for
  ``--busy-seconds`` (10) against an upstream where ``--busy-fail`` (30 %) of attempts,
  drawn from a seeded RNG, answer 503.

Systems: (a) ``defaults``: unbroken with its defaults (``parse_config`` of the route
alone, ``[retry] verbose = false``, the journal in a temporary directory); (b) ``fixed``:
the same plus ``[retry] backoff = "fixed"``, ``delay_ms = 250`` and ``[health] breakers =
false``; (c) ``litellm``: the LiteLLM proxy (version and offline install as in
``bench/compare.py``) with the retry settings in ``LITELLM_SETTINGS``; (d) ``redis``:
two unbroken relays with defaults sharing a real ``redis-server`` (``[health] store``),
turns alternating between them (many-turn and busy runs only).

Measured per run: recovery latency (each turn's completion time minus the recovery
time: p50, p99, max), turns completed (a turn not finished ``--tail`` = 60 s after
recovery is cut and counts as not completed), upstream requests per second during the
outage split into first attempts and the rest (retries and probes), and for count
outages each turn's total time.  Busy runs: the wait before each retry (a failed
attempt's arrival at the mock to the next attempt of the same turn), turns completed,
turn latency.  The targets of issue 22 are printed with a met/missed verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from compare_suts import LITELLM_VERSION, litellm_venv
from harness import Fleet, log, pin_harness, pinning_mode, raise_nofile, redis_server_binary
from recovery_report import plots, render, targets, verdict
from recovery_sut import (
    FULL,
    QUICK,
    SYSTEMS,
    Context,
    Profile,
    now,
    relay_main,
)
from recovery_turns import plan, run_all, summary_line
from reporting import machine_info

# =====================================================================================
# main


def run(
    prof: Profile,
    systems: list[str],
    litellm: Path | None,
    litellm_reason: str,
    command: str,
    quick: bool,
    keep_logs: bool = False,
) -> dict[str, Any]:
    pinning = pinning_mode()
    pin_harness(pinning)
    raise_nofile(8 * prof.turns + 4096)
    machine = machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-recovery-"))
    fleet = Fleet(workdir, pinning)
    binary, why = redis_server_binary() if "redis" in systems else (None, "")
    ctx = Context(prof, workdir, fleet, litellm, litellm_reason, binary, why)
    ok = False
    t0 = now()
    try:
        runs = plan(prof, systems)
        log(f"{len(runs)} runs; logs in {workdir}")
        results = asyncio.run(run_all(ctx, runs))
        ok = True
    finally:
        fleet.stop_all()
        if ctx.redis is not None:
            ctx.redis.stop()
        if ok and not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"logs kept in {workdir}")
    res: dict[str, Any] = {
        "quick": quick,
        "command": command,
        "machine": machine,
        "profile": dataclasses.asdict(prof),
        "systems": systems,
        "litellm": litellm is not None,
        "litellm_reason": litellm_reason,
        "litellm_version": LITELLM_VERSION,
        "results": results,
        "loadavg_end": os.getloadavg(),
        "elapsed_s": now() - t0,
    }
    res["targets"] = targets(res)
    return res


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--relay":
        return relay_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 s outage, 3 × 503, 20 turns, a short busy phase, "
        "no LiteLLM unless --litellm",
    )
    ap.add_argument("--outages", type=floats, help="outages by time, seconds (default 5,30,120)")
    ap.add_argument(
        "--counts",
        type=lambda s: tuple(int(x) for x in floats(s)),
        help="outages by count (default 30,100)",
    )
    ap.add_argument("--turns", type=int, help="the concurrent turns of the many-turn runs (200)")
    ap.add_argument("--tail", type=float, help="a turn is cut this long after recovery (60 s)")
    ap.add_argument(
        "--count-cap",
        type=float,
        help="a count outage ends after this long even if not all its 503s were served (120 s)",
    )
    ap.add_argument("--busy-rate", type=float, help="busy turns per second (100)")
    ap.add_argument("--busy-seconds", type=float, help="busy phase length; 0: none (10)")
    ap.add_argument("--busy-fail", type=float, help="share of busy attempts that answer 503 (0.3)")
    ap.add_argument("--seed", type=int, help="the busy phase's RNG seed (22)")
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    ap.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out (reported)")
    ap.add_argument("--litellm", action="store_true", help="with --quick: include LiteLLM")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    ap.add_argument("--litellm-venv", type=Path, default=cache / "unbroken-bench" / "litellm-venv")
    ap.add_argument("--out", help="the Markdown report (default: stdout)")
    ap.add_argument(
        "--img", help="PNG directory (default: img/ next to --out; none without --out unless given)"
    )
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--from-json", type=Path, help="render the report again from a --json file")
    ap.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the work directory (configs, journals, the relays' logs)",
    )
    args = ap.parse_args()

    if args.from_json:
        res = json.loads(args.from_json.read_text())
        res["targets"] = targets(res)
        write_outputs(res, args)
        return 0
    if not sys.platform.startswith("linux"):
        print("recovery_bench: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2
    base = QUICK if args.quick else FULL
    over = {
        k: v
        for k, v in {
            "outages": args.outages,
            "counts": args.counts,
            "turns": args.turns,
            "tail_s": args.tail,
            "count_cap_s": args.count_cap,
            "busy_rate": args.busy_rate,
            "busy_seconds": args.busy_seconds,
            "busy_fail": args.busy_fail,
            "seed": args.seed,
        }.items()
        if v is not None
    }
    prof = dataclasses.replace(base, **over)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system {bad[0]!r} (known: {', '.join(SYSTEMS)})")
    want_litellm = "litellm" in systems and not args.no_litellm and (args.litellm or not args.quick)
    litellm: Path | None = None
    reason = ""
    if "litellm" in systems and not want_litellm:
        reason = (
            "left out (--no-litellm)" if args.no_litellm else "left out (--quick without --litellm)"
        )
    if want_litellm:
        try:
            litellm = litellm_venv(args.litellm_venv)
        except Exception as exc:  # reported as "not run", with the reason
            reason = " ".join(f"could not be installed: {type(exc).__name__}: {exc}".split())[:300]
            log(f"LiteLLM {reason}")
    command = "python bench/recovery_bench.py" + (
        "" if len(sys.argv) < 2 else " " + shlex.join(sys.argv[1:])
    )

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    try:
        res = run(prof, systems, litellm, reason, command, args.quick, args.keep_logs)
    except KeyboardInterrupt:
        log("interrupted; all child processes stopped")
        return 130
    write_outputs(res, args)
    return 0


def write_outputs(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    img: Path | None = None
    if args.img:
        img = Path(args.img).resolve()
    elif args.out:
        img = Path(args.out).resolve().parent / "img"
    files = plots(res, img) if img is not None else []
    if args.out:
        outp = Path(args.out).resolve()
        rel = os.path.relpath(img, outp.parent) if img is not None else None
        outp.parent.mkdir(parents=True, exist_ok=True)
        outp.write_text(render(res, rel, files) + "\n")
        log(f"wrote {outp}" + (f" and {len(files)} plots in {img}" if img else ""))
        print(
            "unbroken recovery benchmark"
            + (" (QUICK: smoke test only)" if res["quick"] else "")
            + f", {res['elapsed_s']:.0f} s:"
        )
        for r in res["results"]:
            print("  " + summary_line(r))
        print("targets:")
        for t in res["targets"]:
            print(f"  [{verdict(t['verdict']).strip('*')}] {t['target']}: {t['measured']}")
    else:
        sys.stdout.write(render(res, str(img) if img is not None else None, files) + "\n")
        sys.stdout.flush()
        if img is not None:
            log(f"wrote {len(files)} plots in {img}")


if __name__ == "__main__":
    sys.exit(main())
