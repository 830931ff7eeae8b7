"""What redacting a keyed route's answers costs per upstream chunk (issue 25).

A benchmark, not a test.  A route that injects a key has every body it forwards
scanned for the relay's secrets (the key, the token): each upstream chunk goes
through `Redactor.feed` inside an async generator (``relay.http._redacted``) before
the turn machine sees it.  A route where the client brings its own key pays
nothing: the relay reads the upstream's chunks as before.

This times, in one process, the same stream of chunks read the way the relay reads
them, with and without that layer, and prints the difference per chunk:

    python bench/redact_cost.py [--chunks 200000] [--size 160] [--rounds 5]

``--size``: bytes per chunk (an SSE text-delta frame of a chat stream is ~160 bytes;
try 4096 for coalesced reads).  The minimum of ``--rounds`` is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from unbroken.relay.http import _redacted
from unbroken.relay.upstream import Redactor

KEY = "sk-proj-" + "x" * 156  # an OpenAI project key is ~164 characters
TOKEN = "t" * 43  # secrets.token_urlsafe(32)


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
        it = _redacted(it, Redactor([KEY, TOKEN]))
    t0 = time.perf_counter()
    await _drain(it)
    return time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    frame = b'data: {"choices":[{"delta":{"content":"some text, and more text"}}]}\n\n'
    body = (frame * (args.size // len(frame) + 1))[: args.size - 2] + b"\n\n"
    chunks = [body] * args.chunks
    plain = min([await _time(chunks, False) for _ in range(args.rounds)])
    keyed = min([await _time(chunks, True) for _ in range(args.rounds)])
    per = (keyed - plain) / args.chunks * 1e9
    print(
        f"{args.chunks} chunks of {args.size} B: read {plain / args.chunks * 1e9:.0f} ns/chunk, "
        f"read and redacted {keyed / args.chunks * 1e9:.0f} ns/chunk: "
        f"+{per:.0f} ns per chunk when a key is injected (0 otherwise)"
    )


if __name__ == "__main__":
    asyncio.run(main())
