"""SSE splitter benchmark: time to split one event of 1 to 64 MB (issue 10).

A benchmark, not a test: it measures and reports.  The 50 MB single-line event
of the hostile-input review cost the old splitter 14.8 s of CPU, because it
re-scanned and re-concatenated its whole pending buffer on every chunk
(quadratic).  The splitter now keeps a scan offset and one growing buffer, so
the time must grow linearly with the event size.

    python bench/sse_bench.py [--out docs/performance.md] [--chunk 65536] [--reps 3]

For each size, one event ``data: <size bytes>`` + blank line (LF, CRLF or CR
line endings) is fed in ``--chunk``-byte pieces (aiohttp hands the relay at
most 64 KiB at a time), with ``max_event_bytes`` above the size; the best of
``--reps`` runs is reported, with the time per MB.  ``--out`` replaces (or
appends) the "SSE splitter" section of the given Markdown file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from unbroken.core.wire.sse import SSESplitter  # noqa: E402

SIZES_MB = (1, 2, 4, 8, 16, 32, 64)
ENDINGS = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}
HEADING = "## SSE splitter: one huge event"


def split_time(size: int, eol: bytes, chunk: int) -> float:
    body = b"x" * size
    splitter = SSESplitter(max_event_bytes=size + 1024)
    t0 = time.perf_counter()
    events = splitter.feed(b"data: ")
    for i in range(0, size, chunk):
        events += splitter.feed(body[i : i + chunk])
    events += splitter.feed(eol + eol + b"data: next")  # the CR case needs a next byte
    elapsed = time.perf_counter() - t0
    assert len(events) == 1 and len(events[0].raw) == size + 6 + 2 * len(eol), len(events)
    return elapsed


def measure(chunk: int, reps: int) -> dict[str, dict[int, float]]:
    split_time(4 << 20, b"\n", chunk)  # warm-up: allocator arenas, code paths
    out: dict[str, dict[int, float]] = {}
    for name, eol in ENDINGS.items():
        out[name] = {}
        for mb in SIZES_MB:
            out[name][mb] = min(split_time(mb << 20, eol, chunk) for _ in range(reps))
            print(f"{name:5} {mb:3} MB  {out[name][mb]:.3f} s", file=sys.stderr)
    return out


def render(res: dict[str, dict[int, float]], chunk: int, reps: int) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    intro = (
        "`bench/sse_bench.py` (a benchmark, no assertions beyond correctness): one SSE event "
        "`data: <N bytes>` + blank line, fed to `SSESplitter` in "
        f"{chunk // 1024} KiB pieces (what aiohttp hands the relay at most), best of {reps}; "
        f"{now}, Python {platform.python_version()}, on the shared 2-core VM described above "
        f"(load average {os.getloadavg()[0]:.1f} at the start). "
        "To reproduce: `python bench/sse_bench.py --out docs/performance.md`."
    )
    lines = [
        HEADING,
        "",
        *textwrap.wrap(intro, 92, break_on_hyphens=False),
        "",
        "| event size | " + " | ".join(f"{n} s" for n in ENDINGS) + " | LF s per MB |",
        "|---:|" + "---:|" * (len(ENDINGS) + 1),
    ]
    for mb in SIZES_MB:
        cells = " | ".join(f"{res[n][mb]:.3f}" for n in ENDINGS)
        lines.append(f"| {mb} MB | {cells} | {res['LF'][mb] / mb * 1000:.1f} ms |")
    per_mb = {mb: min(res[n][mb] for n in ENDINGS) / mb for mb in SIZES_MB}
    ratio = per_mb[64] / per_mb[16]
    outro = (
        f"Per MB (best line ending), 64 MB costs {ratio:.1f}× what 16 MB costs, both far "
        "beyond the CPU caches; a quadratic splitter would pay 4× per MB (each chunk "
        "rescanning an event four times larger). The smaller rows are cheaper per MB because "
        "more of the event stays in the caches while it is copied. "
        "The splitter it replaced re-scanned and re-copied its pending buffer on every "
        "chunk: 4 / 8 / 16 MB took 0.20 / 0.74 / 2.88 s and one 50 MB line 14.8 s of relay "
        "CPU (the hostile-input review of issue 10). In the relay an event above "
        "`[stream] max_event_bytes` (16 MiB by default) is refused as soon as the pending "
        "bytes pass the limit, so no event costs more than the 16 MB row."
    )
    lines += ["", *textwrap.wrap(outro, 92, break_on_hyphens=False), ""]
    return "\n".join(lines)


def replace_section(path: Path, section: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="Markdown file whose section to replace")
    parser.add_argument("--chunk", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    res = measure(args.chunk, args.reps)
    section = render(res, args.chunk, args.reps)
    print(section)
    if args.out:
        replace_section(args.out, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
