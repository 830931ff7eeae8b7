"""soak.py's verdict on a run (RSS drift, per-worker slopes) and its Markdown section."""

from __future__ import annotations

import platform
import re
import textwrap
from pathlib import Path

from soak_run import SHAPE, SoakReport, slope_per_hour, worker_series

HEADING = "## Soak: 200 streams under faults"
WORKERS_HEADING = "## Soak: --workers 2 with Redis, per-worker RSS"


def command(r: SoakReport) -> str:
    """The command line that reproduces ``r``."""
    parts = ["python bench/soak.py"]
    if r.workers > 1:
        parts.append(f"--workers {r.workers}")
        if r.redis:
            parts.append("--redis")
        if r.duration_s != 1800:
            parts.append(f"--duration {r.duration_s:g}")
    elif r.duration_s != 600:
        parts.append(f"--duration {r.duration_s:g}")
    return " ".join([*parts, "--out docs/performance.md"])


def render_workers(r: SoakReport) -> list[str]:
    """Each worker's RSS over time, and its growth after warm-up."""
    after = [s for s in r.samples if s["t"] >= r.warmup_s]
    series = worker_series(r.samples)
    pids = sorted(series, key=lambda pid: series[pid][0][0])
    lines = [
        "| t (s) | turns | " + " | ".join(f"worker {i} RSS MiB" for i in range(len(pids))) + " |",
        "|---:|---:|" + "---:|" * len(pids),
    ]
    rows = r.samples[:: max(1, len(r.samples) // 15)]
    for s in rows + [x for x in r.samples[-1:] if x not in rows]:
        w = s.get("workers") or {}
        cells = " | ".join(f"{w[pid]:.1f}" if pid in w else "" for pid in pids)
        lines.append(f"| {s['t']:.0f} | {s['turns']} | {cells} |")
    growth = []
    for i, pid in enumerate(pids):
        pts = [(t, v) for t, v in series[pid] if t >= r.warmup_s] or series[pid]
        if not pts:
            continue
        first, last = pts[0][1], pts[-1][1]
        growth.append(
            f"worker {i} (pid {pid}): {first:.1f} -> {last:.1f} MiB after warm-up "
            f"({100 * (last / first - 1):+.1f} %), peak {max(v for _, v in pts):.1f}, "
            f"least-squares slope {slope_per_hour(pts):+.1f} MiB/h"
        )
    stores = sorted({str(s.get("store")) for s in after})
    text = "; ".join(growth) + f". Health store state seen: {', '.join(stores)}."
    lines += ["", *textwrap.wrap(text, 92, break_on_hyphens=False)]
    return lines


def render(r: SoakReport) -> str:
    c = r.counts
    after = [s for s in r.samples if s["t"] >= r.warmup_s] or r.samples
    rss = [s["rss_mib"] for s in after]
    relay = (
        f"`unbroken serve --workers {r.workers}`"
        + (" sharing health through a private redis-server" if r.redis else "")
        + " (journal on, token required)"
        if r.workers > 1
        else "`unbroken serve` (journal on, token required)"
    )
    intro = (
        f"`bench/soak.py`: {r.streams} concurrent streamed turns, back to back, for "
        f"{r.duration_s / 60:.3g} min ({r.started}, Python {platform.python_version()}, the shared "
        f"2-core VM described above; load average {r.load_start:.1f} at the start, "
        f"{r.load_end:.1f} at the end, this run included). A real {relay}, default settings "
        "otherwise, in front of the mock provider; Chat Completions, Responses and "
        f"Messages in turn, {SHAPE['deltas']} text deltas {SHAPE['chunk_delay_ms']} ms apart; "
        f"{100 * r.fault_rate:g} % of the turns get one injected fault of a random kind on their "
        "first attempt, 3 % of the clients abort mid-stream, 5 % read slowly. Every turn is "
        "checked against the exact bytes of the fault-free reply. To reproduce: "
        f"`{command(r)}`."
    )
    lines = [
        WORKERS_HEADING if r.workers > 1 else HEADING,
        "",
        *textwrap.wrap(intro, 92, break_on_hyphens=False),
        "",
        "| turns | clean | recovered | ended with the error event | client aborts | "
        "slow readers | faults injected | duplicates | unexpected | hangs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c.turns} | {c.clean} | {c.recovered} | {c.ended_with_error} | {c.aborted} | "
        f"{c.slow} | {c.faults} | {c.duplicates} | {c.unexpected} | {c.hangs} |",
        "",
        "| t (s) | turns | RSS MiB | open fds | tasks | client connections | journal KiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r.samples[:: max(1, len(r.samples) // 12)]:
        lines.append(
            f"| {s['t']:.0f} | {s['turns']} | {s['rss_mib']:.1f} | {s['fds']} | "
            f"{s['tasks']} | {s['connections']} | {s['journal_kib']:.0f} |"
        )
    spread = f"{min(rss):.1f}-{max(rss):.1f} MiB" if rss else "n/a"
    outro = (
        f"After the {r.warmup_s:.0f} s warm-up RSS stayed within {spread}; idle before the load: "
        f"{r.idle_before['tasks']} tasks, {r.idle_before['fds']} fds; after it: "
        f"{r.idle_after['tasks']} tasks, {r.idle_after['fds']} fds (the upstream keep-alive "
        "pool holds the difference). Verdict: "
        + ("**PASS**." if r.ok else "**FAIL**: " + "; ".join(r.failures) + ".")
    )
    lines += ["", *textwrap.wrap(outro, 92, break_on_hyphens=False), ""]
    if r.workers > 1:
        note = (
            "With workers, the table's RSS is the larger worker's, open fds are summed over "
            "the workers (from /proc), and tasks and client connections are those of the "
            "worker that answered `/status` (not judged). Each worker's RSS:"
        )
        lines += [*textwrap.wrap(note, 92, break_on_hyphens=False), ""]
        lines += [*render_workers(r), ""]
    return "\n".join(lines)


def replace_section(path: Path, section: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    heading = section.split("\n", 1)[0]
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")
