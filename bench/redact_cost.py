"""What redacting a keyed route's answers costs per upstream chunk (issue 25).

A benchmark, not a test.  A route that injects a key has every body it forwards
scanned for that key (the only secret its upstream was sent): each upstream chunk of
a streamed answer goes through `Redactor.feed` (``core.wire.redact``) inside an async generator
(``relay.upstream.redacted_chunks``) before the turn machine sees it.  A route where the
client brings its own key pays nothing: the relay reads the upstream's chunks as
before.

This reads the same stream of chunks the way the relay reads them, with and without
that layer, and prints the difference per chunk:

    python bench/redact_cost.py [--quick] [--chunks 200000] [--size 160] [--rounds 5]
                                [--instructions]

``--size``: bytes per chunk (an SSE text-delta frame of a chat stream is ~160 bytes;
try 4096 for coalesced reads).  Times: the minimum of ``--rounds`` (on a shared
machine they move by 2x between runs).  ``--instructions``: each variant in its own
process under ``valgrind --tool=callgrind``, which counts the instructions executed
whatever else the machine does; the difference of the two counts over the chunks is
what one chunk costs (compare: the relay's ~120k instructions per frame,
docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from unbroken.core.wire.redact import Redactor
from unbroken.relay.upstream import redacted_chunks

KEY = "sk-proj-" + "x" * 156  # an OpenAI project key is ~164 characters


async def _source(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


async def _drain(it: AsyncIterator[bytes]) -> int:
    n = 0
    async for c in it:
        n += len(c)
    return n


async def _time(chunks: list[bytes], redact: bool) -> float:
    it = _source(chunks)
    if redact:
        it = redacted_chunks(it, Redactor([KEY]))
    t0 = time.perf_counter()
    await _drain(it)
    return time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny counts (a smoke test)")
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument("--only", choices=("plain", "keyed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.rounds = 2000, 1
    if args.instructions:
        _count(args)
        return
    frame = b'data: {"choices":[{"delta":{"content":"some text, and more text"}}]}\n\n'
    body = (frame * (args.size // len(frame) + 1))[: args.size - 2] + b"\n\n"
    chunks = [body] * args.chunks
    if args.only is not None:  # one variant, once (under callgrind)
        await _time(chunks, args.only == "keyed")
        return
    plain = min([await _time(chunks, False) for _ in range(args.rounds)])
    keyed = min([await _time(chunks, True) for _ in range(args.rounds)])
    per = (keyed - plain) / args.chunks * 1e9
    print(
        f"{args.chunks} chunks of {args.size} B: read {plain / args.chunks * 1e9:.0f} ns/chunk, "
        f"read and redacted {keyed / args.chunks * 1e9:.0f} ns/chunk: "
        f"+{per:.0f} ns per chunk when a key is injected (0 otherwise)"
    )


def _count(args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("redact_cost: --instructions needs valgrind (apt install valgrind)")
    counts = {}
    for only in ("plain", "keyed"):
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                sys.executable,
                __file__,
                f"--chunks={args.chunks}",
                f"--size={args.size}",
                f"--only={only}",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        m = re.search(r"Collected : (\d+)", done.stderr)
        if m is None:
            raise SystemExit(f"redact_cost: no callgrind total in: {done.stderr[-500:]}")
        counts[only] = int(m.group(1))
    per = (counts["keyed"] - counts["plain"]) / args.chunks
    print(
        f"{args.chunks} chunks of {args.size} B: +{per:.0f} instructions per chunk when a key "
        "is injected (0 otherwise; callgrind)"
    )


if __name__ == "__main__":
    asyncio.run(main())
