"""Instructions per turn of the turn machine alone (no sockets, no aiohttp), counted by
callgrind: what the sans-IO core costs, apart from the transports and the journal.

A benchmark, not a test.  One turn: a streamed Chat Completions answer (a role chunk,
6 text deltas, the finish chunk, ``[DONE]``) fed as the HTTP transport feeds it
(`TurnMachine.feed_verbatim`, one chunk a frame, a write notified around each), then
the body's end.  Each tree runs twice under ``valgrind --tool=callgrind``, with
``--few`` and ``--many`` turns; (instructions of many - those of few) / (many - few) is
one turn's, free of the interpreter's start-up.

    python bench/turn_machine_instr.py [--few 200] [--many 1200] TREE [TREE ...]

``TREE``: a source tree with ``src/unbroken`` and ``tests/turnfix.py`` (a worktree).
Needs valgrind.  ``--turns N`` (internal): run N turns in this process and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_TOTAL = re.compile(r"Collected : (\d+)")


def _turns(n: int) -> None:
    from turnfix import Report, Timers  # (the tree's own, on sys.path)
    from unbroken.core.admission.policy import RetryPolicy, RetryState
    from unbroken.core.turn.ledger import Hold
    from unbroken.core.turn.machine import TurnMachine
    from unbroken.core.wire.protocols import CHAT

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return b"data: " + json.dumps({"id": "c1", "choices": [choice]}).encode() + b"\n\n"

    frames = [chunk({"role": "assistant"})]
    frames += [chunk({"content": f"w{i} "}) for i in range(6)]
    frames += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    for _ in range(n):
        retry = RetryState(RetryPolicy(delay_ms=100, backoff="fixed"), 1, rng=random.Random(0))
        m = TurnMachine(
            protocol=CHAT,
            hold=Hold(),
            timers=Timers(),
            retry=retry,
            stream=True,
            now=0.0,
            report=Report(),
        )
        m.start(0.0)
        m.answered(0.1, 200, sse=True)
        t = 0.2
        for f in frames:
            m.feed_verbatim(t, f)
            m.write_started(t)
            m.wrote(t)
            t += 0.01
        m.body_ended(t)


def _count(tree: Path, n: int) -> int:
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        PYTHONPATH=os.pathsep.join([str(tree / "src"), str(tree / "tests")]),
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/cg.out",
                sys.executable,
                __file__,
                "--turns",
                str(n),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    match = _TOTAL.search(out.stderr)
    if match is None:
        raise SystemExit(f"turn_machine_instr: no count from callgrind:\n{out.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--few", type=int, default=200)
    ap.add_argument("--many", type=int, default=1200)
    ap.add_argument("trees", nargs="*", type=Path)
    args = ap.parse_args()
    if args.turns is not None:
        _turns(args.turns)
        return
    if not args.trees or args.many <= args.few:
        ap.error("name at least one TREE, and --many > --few")
    for tree in args.trees:
        few, many = _count(tree, args.few), _count(tree, args.many)
        per_turn = (many - few) / (args.many - args.few)
        print(f"{tree}: {per_turn / 1000:,.1f} k instructions per turn (machine alone)")


if __name__ == "__main__":
    main()
