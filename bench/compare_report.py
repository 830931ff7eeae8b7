"""compare.py's report: the aggregation over repetitions, the plots and the Markdown page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compare_faults import FAULTS, OUTCOMES, short_error
from compare_suts import LITELLM_VERSION, STREAM_TIMEOUT_S
from harness import med, pct
from reporting import fnum, ratio, reflow

# =====================================================================================
# Aggregation


def aggregate(reps: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    paths = ["direct", *names]
    ttfc: dict[str, Any] = {}
    for p in paths:
        p50s = [pct(r["ttfc"]["first_ms"][p], 50) for r in reps]
        p99s = [pct(r["ttfc"]["first_ms"][p], 99) for r in reps]
        added = [
            pct(r["ttfc"]["first_ms"][p], 50) - pct(r["ttfc"]["first_ms"]["direct"], 50)
            for r in reps
        ]
        added99 = [
            pct(r["ttfc"]["first_ms"][p], 99) - pct(r["ttfc"]["first_ms"]["direct"], 99)
            for r in reps
        ]
        # every sample minus its repetition's direct p50: the added-TTFC distribution
        dist = [
            x - pct(r["ttfc"]["first_ms"]["direct"], 50)
            for r in reps
            for x in r["ttfc"]["first_ms"][p]
        ]
        ttfc[p] = {
            "p50": med(p50s),
            "p99": med(p99s),
            "added_p50": med(added),
            "added_p99": med(added99),
            "dist": dist,
            "errors": sum(r["ttfc"]["errors"][p] for r in reps),
        }
    out: dict[str, Any] = {"ttfc": ttfc}
    for key in ("rps_stream", "rps_plain"):
        d: dict[str, Any] = {}
        for p in paths:
            runs = [r[key][p] for r in reps]
            d[p] = {
                "rps": med([x["rps"] for x in runs]),
                "per_core": med([x["per_core"] for x in runs]) if p != "direct" else None,
                "sut_util": med([x["sut_util"] for x in runs]) if p != "direct" else None,
                "errors": sum(x["errors"] for x in runs),
            }
        for p in names:  # paired with bare in the same repetition
            d[p]["vs_bare"] = med(
                [r[key][p]["per_core"] / r[key]["bare"]["per_core"] for r in reps]
            )
        out[key] = d
    out["cpu"] = {
        p: {
            "us_per_frame": med([r["cpu"][p]["us_per_frame"] for r in reps]),
            "vs_bare": med(
                [r["cpu"][p]["us_per_frame"] / r["cpu"]["bare"]["us_per_frame"] for r in reps]
            ),
            "frames_per_req": med(
                [r["cpu"][p]["frames"] / max(r["cpu"][p]["ok"], 1) for r in reps]
            ),
            "errors": sum(r["cpu"][p]["errors"] for r in reps),
        }
        for p in names
    }
    mem: dict[str, Any] = {}
    for p in names:
        runs = [r["memory"][p] for r in reps]
        npts = len(runs[0]["points"])
        mem[p] = {
            "idle_mib": med([x["idle_mib"] for x in runs]),
            "kib_per_stream": med([x["kib_per_stream"] for x in runs]),
            "points": [
                (
                    med([x["points"][i][0] for x in runs]),
                    med([x["points"][i][1] for x in runs]) / 1024,
                )
                for i in range(npts)
            ],
        }
    out["memory"] = mem
    fo: dict[str, Any] = {}
    for p in names:
        if p == "bare":
            continue
        runs = [r["failover"][p] for r in reps]
        firsts = [x["first_ms"] for x in runs if x["first_ms"] is not None]
        laters = [x["later_ms"] for x in runs if x["later_ms"] is not None]
        fo[p] = {
            "first_ms": med(firsts) if firsts else None,
            "later_ms": med(laters) if laters else None,
            "failed": sum(x["failed"] for x in runs),
            "errors": [e for x in runs for e in x["errors"]][:2],
        }
    out["failover"] = fo
    return out


# =====================================================================================
# Plots and report


def plots(agg: dict[str, Any], matrix: dict[str, Any], img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    img.mkdir(parents=True, exist_ok=True)
    colors = {"direct": "#777777", "bare": "#1f77b4", "unbroken": "#2ca02c", "litellm": "#d62728"}
    names = [p for p in agg["ttfc"] if p != "direct"]
    files = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in names:
        xs = sorted(agg["ttfc"][p]["dist"])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(
            xs,
            ys,
            where="post",
            color=colors[p],
            label=f"{p} (p50 +{agg['ttfc'][p]['added_p50']:.2f} ms)",
        )
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("added time to first text delta, ms (sample − direct p50 of its round)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Added TTFC, streamed chat, concurrency 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(img / "ttfc.png", dpi=110)
    plt.close(fig)
    files.append("ttfc.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, (key, label) in enumerate(
        (("rps_stream", "streamed, c=64"), ("rps_plain", "non-streamed, c=32"))
    ):
        vals = [agg[key][p]["per_core"] or 0 for p in names]
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars = ax.bar(
            xs,
            vals,
            width,
            label=label,
            color=[colors[p] for p in names],
            alpha=1.0 if i == 0 else 0.55,
            edgecolor="black",
        )
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(
                f"{v:,.0f}",
                (b.get_x() + b.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("requests per SUT CPU-second (log)")
    ax.set_title("Requests per SUT core\n(solid: streamed, c=64; light: non-streamed, c=32)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(img / "rps_per_core.png", dpi=110)
    plt.close(fig)
    files.append("rps_per_core.png")

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for p in names:
        pts = agg["memory"][p]["points"]
        ax.plot(
            [n for n, _ in pts],
            [m for _, m in pts],
            marker="o",
            color=colors[p],
            label=f"{p} ({agg['memory'][p]['kib_per_stream']:.0f} KiB/stream)",
        )
        ax2.plot(
            [n for n, _ in pts],
            [m - pts[0][1] for _, m in pts],
            marker="o",
            color=colors[p],
            label=p,
        )
    ax.set_yscale("log")
    ax.set_xlabel("open streams")
    ax.set_ylabel("RSS, MiB (log)")
    ax.set_title("RSS vs open streams")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax2.set_xlabel("open streams")
    ax2.set_ylabel("RSS − idle RSS, MiB")
    ax2.set_title("Growth over idle")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(img / "memory.png", dpi=110)
    plt.close(fig)
    files.append("memory.png")

    paths, rows = matrix["paths"], list(matrix["cells"])
    palette = ["#4caf50", "#9c27b0", "#ff9800", "#e57373"]
    grid = [[OUTCOMES.index(matrix["cells"][r][p]["outcome"]) for p in paths] for r in rows]
    fig, ax = plt.subplots(figsize=(2.0 + 1.9 * len(paths), 0.5 * len(rows) + 1.6))
    ax.imshow(grid, cmap=ListedColormap(palette), vmin=0, vmax=3, aspect="auto")
    for i, r in enumerate(rows):
        for j, p in enumerate(paths):
            ax.text(
                j,
                i,
                matrix["cells"][r][p]["outcome"].replace(", ", ",\n"),
                ha="center",
                va="center",
                fontsize=8,
            )
    ax.set_xticks(range(len(paths)), paths)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_title("What the client received", pad=24)
    ax.set_xticks([x - 0.5 for x in range(1, len(paths))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    fig.tight_layout()
    fig.savefig(img / "fault_matrix.png", dpi=110)
    plt.close(fig)
    files.append("fault_matrix.png")
    return files


def headline(agg: dict[str, Any], matrix: dict[str, Any], names: list[str]) -> list[str]:
    """The summary table in words: unbroken against the floor, and against LiteLLM."""
    t, c, m = agg["ttfc"], agg["cpu"], agg["memory"]
    rs, rp = agg["rps_stream"], agg["rps_plain"]
    u = "unbroken"
    out = [
        f"**unbroken vs the bare floor** (same rounds): {rs[u]['vs_bare']:.2f}× its streamed and "
        f"{rp[u]['vs_bare']:.2f}× its non-streamed requests per core, {c[u]['vs_bare']:.2f}× its "
        f"CPU per frame, {t[u]['added_p50'] - t['bare']['added_p50']:+.2f} ms added TTFC p50 "
        f"beyond the bare hop's, {m[u]['idle_mib'] - m['bare']['idle_mib']:+.1f} MiB idle RSS."
    ]
    if "litellm" in names:
        x = "litellm"
        out.append(
            f"**unbroken vs LiteLLM**: {rs[u]['per_core'] / rs[x]['per_core']:.0f}× the streamed "
            f"and {rp[u]['per_core'] / rp[x]['per_core']:.0f}× the non-streamed requests per "
            f"core, {c[x]['us_per_frame'] / c[u]['us_per_frame']:.0f}× less CPU per frame, "
            f"{t[x]['added_p50'] / t[u]['added_p50']:.0f}× less added TTFC, "
            f"{m[x]['idle_mib'] / m[u]['idle_mib']:.1f}× less idle memory and "
            f"{m[x]['kib_per_stream'] / m[u]['kib_per_stream']:.1f}× less per open stream."
        )
    cells = matrix["cells"]
    for p in matrix["paths"]:
        done = [k for k in cells if cells[k][p]["outcome"] == "complete"]
        bad = [
            k for k in cells if cells[k][p]["outcome"] in ("spliced", "truncated, shown as success")
        ]
        out.append(
            f"**fault matrix, {p}**: {len(done)} of {len(cells)} cases complete"
            + (
                f"; spliced or silently truncated: {', '.join(bad)}"
                if bad
                else "; nothing spliced or silently truncated"
            )
            + "."
        )
    return out


def render(res: dict[str, Any], img_rel: str, cmd: str) -> str:
    agg, matrix, m, prof = res["agg"], res["matrix"], res["machine"], res["profile"]
    f = fnum
    names = [p for p in agg["ttfc"] if p != "direct"]
    L: list[str] = []
    a = L.append
    a("# Benchmarks: unbroken side by side")
    a("")
    a("Regenerate this page, its plots and every number in it with one command (Linux, from")
    a(
        "the repository root, `pip install -e '.[bench]'`; "
        f"{res['elapsed_s'] / 60:.1f} minutes here, plus a one-time install of LiteLLM into"
    )
    a("`~/.cache/unbroken-bench/litellm-venv`):")
    a("")
    a("```")
    a(cmd)
    a("```")
    a("")
    a("`bench/compare.py --quick` is the smoke test the test suite runs; its numbers mean")
    a("little. The per-protocol and target tables of the relay itself are in")
    a("[performance.md](performance.md) (`bench/http_bench.py`).")
    a("")
    a("**Read ratios, not absolute numbers.** The machine is a shared, noisy VM: absolute")
    a("rates move by tens of percent from one hour to the next. Every ratio below is taken")
    a("against the baselines measured in the same run, the same round, on freshly started")
    a("processes: **direct** (client → mock provider, no hop) and **bare** (a bare aiohttp")
    a("pass-through proxy, `bench/bare_proxy.py`, no logic: the floor for any aiohttp relay).")
    a("")
    a("## Setup")
    a("")
    lite = (
        f"LiteLLM proxy {LITELLM_VERSION} in its own virtual environment (litellm plus "
        "the dependencies of its `proxy` extra; the extra's `litellm-proxy` pin is not on "
        "the package index), offline (`LITELLM_OFFLINE_MODE=true`, "
        "`LITELLM_LOCAL_MODEL_COST_MAP=True`), one worker, a master key, every other setting "
        "at its default except `num_retries: 3` and, for the fault runs, the fallbacks and "
        f"`stream_timeout: {STREAM_TIMEOUT_S:g}` shown below"
        if res["litellm"]
        else "**LiteLLM left out** (`--no-litellm`)"
    )
    a(
        f"* {m['date']}; unbroken {m['unbroken']} at commit `{m['commit'] or 'unknown'}`"
        f"{'; **quick run**' if res['quick'] else ''}; {res['elapsed_s']:.0f} s."
    )
    a(
        f"* nproc {m['nproc']} ({m['cpu_model'] or 'unknown CPU'}), Linux {m['kernel']}; load "
        f"average {m['loadavg_start'][0]:.2f} at the start, {res['loadavg_end'][0]:.2f} at the end;"
        f" Python {m['python']}, aiohttp {m['aiohttp']}."
    )
    a(
        f"* Pinning: {m['pinning']}: each SUT on CPU 0, the mock provider and the load generator "
        "on CPU 1 (so **direct** is the harness's own ceiling)."
    )
    a(
        "* SUTs: the bare proxy; `python -m unbroken serve` with `[retry] verbose = false`, all "
        "else default (ledger, journal in a temporary directory, default hold rules); " + lite + "."
    )
    a(
        f"* {prof['reps']} round(s); each round starts every SUT afresh and runs memory, TTFC, "
        "streamed and non-streamed throughput, CPU per frame and failover, the paths interleaved "
        "(TTFC request by request, throughput windows in a rotated order). Every number is the "
        "median over the rounds; each ratio is paired within a round, then the median."
    )
    a("")
    a("## Summary")
    a("")
    hdr = "| metric | direct | " + " | ".join(names) + " |"
    a(hdr)
    a("|---|---:|" + "---:|" * len(names))
    t = agg["ttfc"]

    def vs_bare(p: str, text: str) -> str:
        return "" if p == "bare" else f" ({text} bare)"

    a(
        "| added TTFC p50, c=1 | — | "
        + " | ".join(
            f"+{f(t[p]['added_p50'], 2)} ms"
            + vs_bare(p, ratio(t[p]["added_p50"], t["bare"]["added_p50"]))
            for p in names
        )
        + " |"
    )
    for key, label in (
        ("rps_stream", "streamed req/s per core, c=64"),
        ("rps_plain", "non-streamed req/s per core, c=32"),
    ):
        d = agg[key]
        a(
            f"| {label} | ({f(d['direct']['rps'], 0)} req/s, harness) | "
            + " | ".join(
                f"{f(d[p]['per_core'], 0)}" + vs_bare(p, f"{d[p]['vs_bare']:.2f}×") for p in names
            )
            + " |"
        )
    c = agg["cpu"]
    a(
        "| CPU per SSE frame | — | "
        + " | ".join(
            f"{f(c[p]['us_per_frame'], 1)} µs" + vs_bare(p, f"{c[p]['vs_bare']:.2f}×")
            for p in names
        )
        + " |"
    )
    mm = agg["memory"]
    a("| idle RSS | — | " + " | ".join(f"{f(mm[p]['idle_mib'], 1)} MiB" for p in names) + " |")
    a(
        "| RSS per open stream | — | "
        + " | ".join(f"{f(mm[p]['kib_per_stream'], 1)} KiB" for p in names)
        + " |"
    )
    fo = agg["failover"]

    def fo_cell(p: str) -> str:
        if p == "bare":
            return "— (one upstream: error)"
        x = fo[p]
        if x["first_ms"] is None:
            return f"failed ({x['errors'][0] if x['errors'] else '?'})"
        later = "n/a" if x["later_ms"] is None else f"{x['later_ms']:+.1f} ms"
        return f"{x['first_ms']:+.1f} ms (later: {later})"

    a(
        "| failover from a refused primary | — (error) | "
        + " | ".join(fo_cell(p) for p in names)
        + " |"
    )
    a("")
    for line in headline(agg, matrix, names):
        a(f"* {line}")
    a("")
    a(f"![req/s per core]({img_rel}/rps_per_core.png)")
    a("")
    # -- TTFC
    a("## Time to first text delta, concurrency 1")
    a("")
    a("Streamed chat; the mock sends the role chunk at once and the text 5 ms later. TTFC is")
    a("request sent → first text delta at the client (not the first byte: unbroken holds the")
    a(f"role chunk until output). {prof['ttfc_n']} requests per path per round, interleaved")
    a("request by request; added = path − direct, same percentile, same round.")
    a("")
    a("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |")
    a("|---|---:|---:|---:|---:|---:|")
    for p in ["direct", *names]:
        x = t[p]
        a(
            f"| {p} | {f(x['p50'], 3)} | {f(x['p99'], 3)} | "
            f"{'—' if p == 'direct' else f(x['added_p50'], 3)} | "
            f"{'—' if p == 'direct' else f(x['added_p99'], 3)} | {x['errors']} |"
        )
    a("")
    a(f"![added TTFC distribution]({img_rel}/ttfc.png)")
    a("")
    # -- throughput
    a("## Requests per second per core")
    a("")
    a(f"Chat with 20 text deltas (no delay), one {prof['rps_duration_s']:g} s window per path per")
    a(f"round after {prof['rps_warmup_s']:g} s of warm-up; streamed at 64 concurrent clients,")
    a("non-streamed at 32. *Per core* = completed requests per CPU-second of the SUT process")
    a("tree in the window (what one busy core sustains, harness limits aside). Direct has no")
    a("SUT; its rate is the harness ceiling.")
    a("")
    a(
        "| path | streamed req/s | SUT CPU | per core | vs bare | non-streamed req/s | SUT CPU | "
        "per core | vs bare |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in ["direct", *names]:
        cells = []
        for key in ("rps_stream", "rps_plain"):
            x = agg[key][p]
            cells += [
                f(x["rps"], 1),
                "—" if x["sut_util"] is None else f"{x['sut_util']:.0%}",
                "—" if x["per_core"] is None else f(x["per_core"], 0),
                f"{x['vs_bare']:.2f}×" if "vs_bare" in x else "—",
            ]
        a(f"| {p} | " + " | ".join(cells) + " |")
    errs = {
        f"{k}/{p}": agg[k][p]["errors"]
        for k in ("rps_stream", "rps_plain")
        for p in ["direct", *names]
        if agg[k][p]["errors"]
    }
    if errs:
        a("")
        a(f"Client errors in the windows: {errs}.")
    a("")
    # -- CPU
    a("## CPU per SSE frame")
    a("")
    a(f"utime+stime of the SUT process tree over {prof['cpu_requests']} streamed requests of 200")
    a(f"deltas ({prof['cpu_requests_litellm']} through LiteLLM), concurrency 16, one frame every 2")
    a("ms, divided by the SSE frames the client received; per-request work included.")
    a("")
    a("| path | frames/response | µs per frame | vs bare |")
    a("|---|---:|---:|---:|")
    for p in names:
        x = c[p]
        a(f"| {p} | {x['frames_per_req']:.0f} | {f(x['us_per_frame'], 1)} | {x['vs_bare']:.2f}× |")
    a("")
    # -- memory
    a("## Memory")
    a("")
    a("RSS (`VmRSS`, whole process tree) after one warm-up request (idle), then with N open")
    a("slow streams (one frame a second; every client has its first bytes). Per stream = (RSS")
    a("at the largest N − idle) / N, with N the streams actually open (LiteLLM may not open")
    a("them all within 120 s).")
    a("")
    pts = [n for n, _ in mm[names[0]]["points"]]
    a(
        "| path | "
        + " | ".join("idle MiB" if n == 0 else f"{n:.0f} streams MiB" for n in pts)
        + " | KiB per stream |"
    )
    a("|---|" + "---:|" * (len(pts) + 1))
    for p in names:
        a(
            f"| {p} | "
            + " | ".join(
                f(x, 1) + ("" if n == want else f" ({n:.0f} open)")
                for (n, x), want in zip(mm[p]["points"], pts, strict=True)
            )
            + f" | {f(mm[p]['kib_per_stream'], 1)} |"
        )
    a("")
    a(f"![memory vs open streams]({img_rel}/memory.png)")
    a("")
    # -- failover
    a("## Failover from a refused primary")
    a("")
    a("The route's first upstream is a loopback port that refuses connections; the second is")
    a("the mock. unbroken: one route with both upstreams. LiteLLM: a model group on the refused")
    a("address with a fallback to a group on the mock (`num_retries: 3`). Time of a streamed")
    a("request to its end, minus the same path's time for a clean request; the first request")
    a(f"after start, then the median of the {prof['failover_n'] - 1} that follow (health state")
    a("and cool-downs may skip the primary by then). The bare proxy has one upstream.")
    a("")
    a("| path | first request, added ms | later requests, added ms | failed |")
    a("|---|---:|---:|---:|")
    for p, x in fo.items():
        a(f"| {p} | {f(x['first_ms'], 1)} | {f(x['later_ms'], 1)} | {x['failed']} |")
    a("")
    # -- faults
    paths = matrix["paths"]
    a("## Fault matrix")
    a("")
    a("One streamed request per case and path against a mock scripted for that case (then")
    a(
        f"clean), the client waiting up to {prof['fault_timeout_s']:g} s. Stall detection is "
        f"{STREAM_TIMEOUT_S:g} s on both relays"
    )
    a("(unbroken `[stream] first_frame_timeout_s` / `idle_timeout_s`; LiteLLM `stream_timeout`).")
    a("Each outcome is judged from the bytes the client received, against the same path's")
    a("reply to the clean request:")
    a("")
    a("* **complete**: HTTP 200, the whole reply, byte-identical to the clean one (LiteLLM")
    a("  re-encodes every chunk and stamps its own `created`, which is masked);")
    a("* **spliced**: a reply stitched from two attempts: a second role chunk or")
    a("  `message_start`, a model change mid-stream, or output longer than the clean reply;")
    a("* **truncated, shown as success**: HTTP 200 and a normal end of body, but the reply is")
    a("  cut (no terminal frame) or differs, and nothing tells the client;")
    a("* **error**: an HTTP error status, an in-stream error event, or a broken connection /")
    a("  timeout the client sees. After output has reached the client this is the correct")
    a("  outcome: the agent can retry the step, while a replay would splice.")
    a("")
    a("| case | what the mock does | " + " | ".join(paths) + " |")
    a("|---|---|" + "---|" * len(paths))

    def took(ms: float) -> str:
        return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"

    for name, desc, _k, _a in FAULTS:
        row = matrix["cells"][name]
        a(
            f"| {name} | {desc} | "
            + " | ".join(
                f"**{row[p]['outcome']}** ({short_error(row[p]['detail'])}; "
                f"{took(row[p]['elapsed_ms'])})"
                for p in paths
            )
            + " |"
        )
    a("")
    a(
        "Outcomes per path (of "
        + str(len(FAULTS))
        + " cases): "
        + "; ".join(
            f"**{p}** "
            + ", ".join(
                f"{n} {o}"
                for o in OUTCOMES
                if (n := sum(matrix["cells"][c][p]["outcome"] == o for c in matrix["cells"]))
            )
            for p in paths
        )
        + "."
    )
    a("")
    a(f"![fault matrix]({img_rel}/fault_matrix.png)")
    a("")
    if res["litellm"]:
        a("LiteLLM configuration used (addresses are this run's ephemeral ports):")
        a("")
        a("```yaml")
        a(res["litellm_config"].rstrip())
        a("```")
        a("")
    return reflow("\n".join(L))
