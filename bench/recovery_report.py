"""recovery_bench's targets, plots and Markdown report."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from compare_suts import LITELLM_ENV, LITELLM_VERSION
from recovery_sut import COLORS, DELAY_S, LABELS, LITELLM_NUM_RETRIES, SYSTEMS, litellm_yaml
from recovery_turns import describe
from reporting import fnum, reflow

# =====================================================================================
# Targets


def find(
    results: list[dict[str, Any]],
    system: str,
    scenario: str,
    param: float | None = None,
    turns: int | None = None,
) -> dict[str, Any] | None:
    for r in results:
        if (
            (r["system"], r["scenario"]) == (system, scenario)
            and (param is None or r["param"] == param)
            and (turns is None or r["turns"] == turns)
        ):
            return r
    return None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's targets, each met, missed, or not measured in this run."""
    results, prof = res["results"], res["profile"]
    rows: list[dict[str, Any]] = []

    def add(
        target: str, r: dict[str, Any] | None, measured: str, ok: bool | None, why: str = ""
    ) -> None:
        if r is None:
            rows.append(
                {"target": target, "measured": why or "not measured in this run", "verdict": None}
            )
        elif "not_run" in r:
            rows.append({"target": target, "measured": f"not run: {r['not_run']}", "verdict": None})
        else:
            rows.append({"target": target, "measured": measured, "verdict": ok})

    for n in prof["counts"]:
        bound = 1.1 * n * DELAY_S + 1.0
        r = find(results, "defaults", "count", float(n), 1)
        t = r["total"]["max"] if r and "not_run" not in r and r["completed"] else None
        cut = (
            f" (the outage was cut at {prof['count_cap_s']:g} s with {r['served_503']} of "
            f"{n} 503s served)"
            if r and r.get("capped")
            else ""
        )
        add(
            f"lone turn, defaults, {n} × 503: completes within 1.1·{n}·0.25 s + 1 s = "
            f"{bound:.2f} s",
            r,
            (f"{fnum(t)} s" if t is not None else "did not complete") + cut,
            t is not None and t <= bound and not cut,
        )
    for d in prof["outages"]:
        r = find(results, "defaults", "time", float(d), 1)
        rc = r["recovery"] if r and "not_run" not in r else None
        ok = bool(
            rc and r and r["completed"] == r["turns"] and rc["p50"] <= 0.3 and rc["max"] <= 1.0
        )
        add(
            f"lone turn, defaults, {d:g} s outage: recovery p50 ≤ 0.3 s and max ≤ 1 s",
            r,
            f"p50 {fnum(rc['p50'])} s, max {fnum(rc['max'])} s, "
            f"{r['completed']}/{r['turns']} completed"
            if rc and r and rc["n"]
            else "did not complete",
            ok,
        )
    many = prof["turns"]
    for system in ("defaults", "redis"):
        who = "one relay" if system == "defaults" else "two relays + Redis"
        r = find(results, system, "time", 30.0, many)
        why = "" if 30.0 in prof["outages"] else "no 30 s outage in this run (--outages)"
        add(
            f"{many} turns, 30 s outage, {who}: ≤ 10 upstream requests/s beyond first attempts",
            r,
            f"{fnum(r['rps_rest'])} req/s" if r and "not_run" not in r else "",
            bool(r and "not_run" not in r and r["rps_rest"] is not None and r["rps_rest"] <= 10.0),
            why,
        )
        rc = r["recovery"] if r and "not_run" not in r else None
        add(
            f"{many} turns, 30 s outage, {who}: every turn completes within 2 s of recovery",
            r,
            f"{r['completed']}/{r['turns']} completed, max {fnum(rc['max'])} s" if rc and r else "",
            bool(
                rc
                and r
                and r["completed"] == r["turns"]
                and rc["max"] is not None
                and rc["max"] <= 2.0
            ),
            why,
        )
    r = find(results, "defaults", "busy")
    w = r["waits"] if r and "not_run" not in r else None
    why = "" if prof["busy_seconds"] > 0 else "no busy scenario in this run"
    add(
        f"busy, defaults: mean wait before a retry ≤ 1.2 × 250 ms = {1.2 * DELAY_S:.2f} s",
        r,
        f"{fnum(w['mean'])} s over {w['n']} retries" if w else "",
        bool(w and w["mean"] is not None and w["mean"] <= 1.2 * DELAY_S),
        why,
    )
    add(
        "busy, defaults: no retry waits more than 1 s",
        r,
        f"max {fnum(w['max'])} s ({r['waits_over_1s']} waits over 1 s)" if w and r else "",
        bool(w and r and w["n"] and r["waits_over_1s"] == 0),
        why,
    )
    return rows


# =====================================================================================
# Report


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "**met**" if ok else "**missed**"


def plots(res: dict[str, Any], img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    results = [r for r in res["results"] if "not_run" not in r]
    systems = [s for s in res["systems"] if any(r["system"] == s for r in results)]
    files: list[str] = []

    # 1. recovery latency per system per scenario (outages by time)
    groups = sorted({(r["param"], r["turns"]) for r in results if r["scenario"] == "time"})
    if groups:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(groups) + 2), 4.5))
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            data, pos = [], []
            for g, (d, n) in enumerate(groups):
                r = find(results, s, "time", d, n)
                if r and r["recovery_s"]:
                    data.append([max(x, 1e-3) for x in r["recovery_s"]])
                    pos.append(g + (j - (len(systems) - 1) / 2) * width)
            if data:
                bp = ax.boxplot(
                    data,
                    positions=pos,
                    widths=width * 0.85,
                    whis=(0, 100),
                    patch_artist=True,
                    manage_ticks=False,
                )
                for box in bp["boxes"]:
                    box.set(facecolor=COLORS[s], alpha=0.6)
                for med in bp["medians"]:
                    med.set(color="black")
                rng = random.Random(0)
                for x, ys in zip(pos, data, strict=True):
                    ax.scatter(
                        [x + (rng.random() - 0.5) * width * 0.6 for _ in ys],
                        ys,
                        s=6,
                        color=COLORS[s],
                        edgecolors="black",
                        linewidths=0.3,
                        zorder=3,
                    )
            ax.plot([], [], color=COLORS[s], linewidth=8, alpha=0.6, label=LABELS[s])
        ax.set_xticks(
            range(len(groups)),
            [f"{d:g} s outage\n{n} turn{'s' if n > 1 else ''}" for d, n in groups],
        )
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0.3, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("completion − recovery, s (log; whiskers: min–max)")
        ax.set_title("Recovery latency after a timed outage\n(dashed 0.3 s, dotted 1 s)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "recovery_latency.png", dpi=110)
        plt.close(fig)
        files.append("recovery_latency.png")

    # 2. upstream requests per second over time, the 30 s outage with many turns
    many = [r for r in results if r["scenario"] == "time" and r["turns"] > 1]
    if many:
        d = 30.0 if any(r["param"] == 30.0 for r in many) else max(r["param"] for r in many)
        rows = [r for s in systems if (r := find(many, s, "time", d)) is not None]
        fig, axes = plt.subplots(
            len(rows), 1, figsize=(9, 1.9 * len(rows) + 1.2), sharex=True, squeeze=False
        )
        top = max(
            max(
                (f + r_) / r["series"]["bin_s"]
                for f, r_ in zip(r["series"]["first"], r["series"]["rest"], strict=True)
            )
            for r in rows
        )
        for ax, r in zip(axes[:, 0], rows, strict=True):
            ser, s = r["series"], r["system"]
            b = ser["bin_s"]
            xs = [k * b for k in range(len(ser["rest"]))]
            first = [v / b for v in ser["first"]]
            rest = [v / b for v in ser["rest"]]
            ax.bar(xs, rest, b, align="edge", color=COLORS[s], label="retries + probes")
            ax.bar(
                xs,
                first,
                b,
                bottom=rest,
                align="edge",
                color=COLORS[s],
                alpha=0.3,
                label="first attempts",
            )
            ax.axvline(d, color="black", linestyle="--", linewidth=1)
            ax.axhline(10, color="grey", linestyle=":", linewidth=1)
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(0, max(20.0, top * 1.5))
            ax.set_title(
                f"{LABELS[s]}: {fnum(r['rps_rest'], 1)} retries + probes/s during the outage",
                fontsize=9,
                loc="left",
            )
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
        axes[-1, 0].set_xlabel(
            f"seconds since the outage began (dashed: recovery; dotted: "
            f"10 requests/s; {res['profile']['bin_s']:g} s bins)"
        )
        fig.supylabel("upstream requests per second (symlog)", fontsize=9)
        fig.suptitle(f"What the provider sees: {rows[0]['turns']} turns, {d:g} s outage")
        fig.tight_layout()
        fig.savefig(img / "outage_requests.png", dpi=110)
        plt.close(fig)
        files.append("outage_requests.png")

    # 3. lone turn, outage by count: total time against the target's bound
    counts = sorted({r["param"] for r in results if r["scenario"] == "count"})
    if counts:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, ys = [], []
            for g, c in enumerate(counts):
                r = find(results, s, "count", c, 1)
                if r and r["total_s"]:
                    xs.append(g + (j - (len(systems) - 1) / 2) * width)
                    ys.append(r["total_s"][0])
            if xs:
                ax.bar(xs, ys, width * 0.9, color=COLORS[s], label=LABELS[s])
        for g, c in enumerate(counts):
            b = 1.1 * c * DELAY_S + 1
            ax.hlines(b, g - 0.45, g + 0.45, color="black", linestyle="--")
        ax.set_xticks(range(len(counts)), [f"{c:g} × 503" for c in counts])
        ax.set_yscale("log")
        ax.set_ylabel("turn time, s (log); dashed: 1.1·N·0.25 s + 1 s")
        ax.set_title("A lone turn through N × 503")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "count_turn_time.png", dpi=110)
        plt.close(fig)
        files.append("count_turn_time.png")

    # 4. busy: the distribution of waits before a retry
    busy = [r for r in results if r["scenario"] == "busy" and r["waits_s"]]
    if busy:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in busy:
            xs = sorted(r["waits_s"])
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                color=COLORS[r["system"]],
                label=f"{LABELS[r['system']]} (mean {r['waits']['mean']:.3f} s)",
            )
        ax.axvline(1.2 * DELAY_S, color="grey", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("wait before a retry, s (log; dashed 0.3 s, dotted 1 s)")
        ax.set_ylabel("fraction of retries")
        ax.set_title("Busy and partly failing: wait before each retry")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "busy_retry_waits.png", dpi=110)
        plt.close(fig)
        files.append("busy_retry_waits.png")
    return files


def render(res: dict[str, Any], img_rel: str | None, files: list[str]) -> str:
    prof, m, results = res["profile"], res["machine"], res["results"]
    L: list[str] = []
    a = L.append
    a("# Recovery benchmark: how fast a turn recovers, what the provider sees meanwhile")
    a("")
    a(
        "Reproduce this report (Linux, from the repository root, `pip install -e '.[bench]'`; "
        f"{res['elapsed_s'] / 60:.1f} minutes here):"
    )
    a("")
    a("```")
    a(res["command"])
    a("```")
    a("")
    if res["quick"]:
        a(
            "**Quick run** (`--quick`): a smoke test with small outages and few turns; its "
            "numbers mean little."
        )
        a("")
    a("## Setup")
    a("")
    a(
        f"* {m['date']}; unbroken {m['unbroken']} at commit `{m['commit'] or 'unknown'}`; "
        f"nproc {m['nproc']} ({m['cpu_model'] or 'unknown CPU'}), Linux {m['kernel']}, Python "
        f"{m['python']}, aiohttp {m['aiohttp']}; load average {m['loadavg_start'][0]:.2f} at the "
        f"start, {res['loadavg_end'][0]:.2f} at the end."
    )
    a(
        f"* Pinning: {m['pinning']}"
        + (
            ""
            if m["pinning"] == "none"
            else ": the systems under test on CPU 0; the mock provider, the clients and "
            "redis-server on CPU 1"
        )
        + ". All on loopback. Every run starts a fresh mock and fresh systems "
        "under test, and sends one clean turn through each before the fault starts."
    )
    a(
        "* Turns: streamed OpenAI Chat Completions (`stream: true`, 8 text deltas); each turn "
        "carries its id in its message, so the mock's log tells which turn every upstream "
        "request belongs to. A turn is *completed* when the client got HTTP 200 and the whole "
        "stream up to `data: [DONE]` with no error event."
    )
    a(
        f"* Outages by time: the upstream answers 503 (no `Retry-After`) to everything for "
        f"{', '.join(f'{d:g}' for d in prof['outages'])} s, then serves every request; "
        "*recovery* is that moment. Outages by count: the first "
        f"{' or '.join(str(c) for c in prof['counts'])} upstream requests answer 503; "
        f"*recovery* is when the last of them is served (cut at {prof['count_cap_s']:g} s if "
        "they are not all served by then). Both with 1 turn and with "
        f"{prof['turns']} concurrent turns, all started when the outage starts."
    )
    a(
        f"* *Recovery latency*: a completed turn's end minus the recovery time (for count "
        "outages, over the turns that received a 503). *Requests during the outage*: what the "
        "mock received between the start and the recovery, per second, split into *first "
        "attempts* (a turn's first request) and *the rest* (retries and breaker probes). A "
        f"turn not finished {prof['tail_s']:g} s after recovery is cut and counts as not "
        "completed."
    )
    a(
        f"* Busy and partly failing: {prof['busy_rate']:g} turns per second for "
        f"{prof['busy_seconds']:g} s; each upstream attempt answers 503 with probability "
        f"{prof['busy_fail']:g} (seed {prof['seed']}). *Wait before a retry*: from a failed "
        "attempt's arrival at the mock to the arrival of the same turn's next attempt. Each "
        f"turn is cut after {prof['busy_timeout_s']:g} s."
    )
    a("")
    # -- systems
    a("## Systems")
    a("")
    a("| system | what it is |")
    a("|---|---|")
    chosen = res["systems"]
    ll_rows = [r for r in results if r["system"] == "litellm"]
    ll_ran = [r for r in ll_rows if "not_run" not in r]
    desc = {
        "defaults": "unbroken; its config is `parse_config` of the route alone, plus `[retry] "
        "verbose = false` and `[journal] path` in a temporary directory: nothing else set, "
        "what a user gets",
        "fixed": 'unbroken; the same plus `[retry] backoff = "fixed"`, `delay_ms = 250` and '
        "`[health] breakers = false`",
        "litellm": f"LiteLLM proxy {res.get('litellm_version', LITELLM_VERSION)} in its own "
        "virtual environment, offline, one worker (as in `bench/compare.py`), with the retry "
        f"settings below: `num_retries: {LITELLM_NUM_RETRIES}`, `retry_after: 0`, "
        "`disable_cooldowns: true`, `max_retries: 0` on the deployment",
        "redis": "two unbroken relays with the defaults plus `[health] store = "
        '"redis://127.0.0.1:PORT/0"`, sharing one real `redis-server` (flushed before each '
        "run); turn *i* goes to relay *i* mod 2; many-turn and busy runs only",
    }
    if not res["litellm"]:
        desc["litellm"] = f"**not run**: {res['litellm_reason']}"
    elif ll_rows and not ll_ran:
        desc["litellm"] = f"**not run**: {ll_rows[0]['not_run']}"
    redis_rows = [r for r in results if r["system"] == "redis"]
    if redis_rows and all("not_run" in r for r in redis_rows):
        desc["redis"] = f"**not run**: {redis_rows[0]['not_run']}"
    for system in SYSTEMS:
        a(f"| {system} | {desc[system] if system in chosen else 'not in this run (--systems)'} |")
    a("")
    if res["litellm"] and (ll_ran or not ll_rows):
        a(
            "LiteLLM's settings, chosen for this job: `num_retries` high enough never to run out "
            "(in `litellm_settings` and `router_settings`; a turn is cut "
            f"{prof['tail_s']:g} s after recovery anyway); `retry_after: 0`, the router's minimum "
            "wait before a retry, the smallest allowed; `disable_cooldowns: true`, so its only "
            'deployment is never taken out of rotation (a cool-down would fail turns with "no '
            'deployments available"); `max_retries: 0` on the deployment, so the OpenAI SDK '
            "inside does not add retries of its own (the router retries). The wait between "
            "retries is not configurable in this version: its Rust router core waits 0.5 s, "
            "doubling up to 8 s, plus up to 0.75 s of jitter (measured: 0.7, 1.5, 2.2, 4.3, "
            "8.2, 8.6 s); the `INITIAL_RETRY_DELAY`, `MAX_RETRY_DELAY` and `JITTER` variables of "
            "`litellm/constants.py` are not read by that core (set to 0.25, 0.25 and 0 they "
            "changed nothing), so they are left at their defaults. Started with "
            + ", ".join(f"`{k}={v}`" for k, v in LITELLM_ENV.items() if k != "LITELLM_MASTER_KEY")
            + " and a local master key; the config "
            "(the mock's address is each run's own):"
        )
        a("")
        a("```yaml")
        a(litellm_yaml("http://127.0.0.1:MOCK").rstrip())
        a("```")
        a("")
    # -- targets
    a("## Targets")
    a("")
    a("| target | measured | verdict |")
    a("|---|---|---|")
    for t in res["targets"]:
        a(f"| {t['target']} | {t['measured']} | {verdict(t['verdict'])} |")
    a("")
    # -- outage by time
    a("## Outage by time")
    a("")
    a(
        "| outage | turns | system | completed | recovery p50 s | p99 s | max s | first attempts/s "
        "during outage | retries + probes/s during outage | requests after recovery |"
    )
    a("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "time":
            continue
        head = f"| {r['param']:g} s | {r['turns']} | {r['system']} |"
        if "not_run" in r:
            a(f"{head} not run: {r['not_run']} | | | | | | |")
            continue
        rc = r["recovery"]
        a(
            f"{head} {r['completed']}/{r['turns']} | {fnum(rc['p50'], 3)} | {fnum(rc['p99'], 3)} | "
            f"{fnum(rc['max'], 3)} | {fnum(r['rps_first'])} | {fnum(r['rps_rest'])} | "
            f"{r['after_recovery']} |"
        )
    errs = [
        f"{r['system']} {describe(r)}: " + "; ".join(f"{n} × {e}" for e, n in r["errors"].items())
        for r in results
        if r["scenario"] in ("time", "count") and r.get("errors")
    ]
    a("")
    for f in files:
        if f == "recovery_latency.png" and img_rel is not None:
            a(f"![recovery latency]({img_rel}/{f})")
            a("")
        if f == "outage_requests.png" and img_rel is not None:
            a(f"![upstream requests per second]({img_rel}/{f})")
            a("")
    # -- outage by count
    a("## Outage by count")
    a("")
    a(
        "| 503s | turns | system | outage lasted s | completed | turns that got a 503 | "
        "recovery p50 s | p99 s | max s | turn time p50 s | max s | bound 1.1·N·0.25 + 1 s | "
        "first attempts during outage (/s) | retries + probes during outage (/s) |"
    )
    a("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "count":
            continue
        head = f"| {r['param']:g} | {r['turns']} | {r['system']} |"
        if "not_run" in r:
            a(f"{head} not run: {r['not_run']} | | | | | | | | | | |")
            continue
        rc, tt = r["recovery"], r["total"]
        lasted = f"{r['outage_s']:.2f}" + (
            f" (cut: {r['served_503']} of {r['param']:g} served)" if r["capped"] else ""
        )
        a(
            f"{head} {lasted} | {r['completed']}/{r['turns']} | {r['hit']} | "
            f"{fnum(rc['p50'], 3)} | {fnum(rc['p99'], 3)} | {fnum(rc['max'], 3)} | "
            f"{fnum(tt['p50'], 3)} | {fnum(tt['max'], 3)} | "
            f"{1.1 * r['param'] * DELAY_S + 1:.2f} | {r['first']} ({fnum(r['rps_first'])}) | "
            f"{r['rest']} ({fnum(r['rps_rest'])}) |"
        )
    a("")
    if "count_turn_time.png" in files and img_rel is not None:
        a(f"![lone turn through N 503s]({img_rel}/count_turn_time.png)")
        a("")
    if errs:
        a("Turns not completed, by what the client saw: " + " · ".join(errs) + ".")
        a("")
    # -- busy
    a("## Busy and partly failing")
    a("")
    a(
        "| system | turns | completed | latency p50 s | p99 s | attempts | failed | retries seen | "
        "wait mean s | p50 s | p99 s | max s | waits > 1 s |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"] != "busy":
            continue
        if "not_run" in r:
            a(f"| {r['system']} | not run: {r['not_run']} | | | | | | | | | | | |")
            continue
        w, lat = r["waits"], r["latency"]
        a(
            f"| {r['system']} | {r['turns']} | {r['completed']} | {fnum(lat['p50'], 3)} | "
            f"{fnum(lat['p99'], 3)} | {r['attempts']} | {r['failed_attempts']} | {w['n']} | "
            f"{fnum(w['mean'], 3)} | {fnum(w['p50'], 3)} | {fnum(w['p99'], 3)} | "
            f"{fnum(w['max'], 3)} | "
            f"{r['waits_over_1s']} |"
        )
    a("")
    berrs = [
        f"{r['system']}: " + "; ".join(f"{n} × {e}" for e, n in r["errors"].items())
        for r in results
        if r["scenario"] == "busy" and r.get("errors")
    ]
    if berrs:
        a("Busy turns not completed: " + " · ".join(berrs) + ".")
        a("")
    if ll_ran:
        a(
            "LiteLLM serves far fewer streamed requests per CPU-second than unbroken (about 18 "
            "per core on this VM: `docs/benchmarks.md`), so with many turns, and in the busy "
            "run, its times include its own queueing, on top of its backoff."
        )
        a("")
    if "busy_retry_waits.png" in files and img_rel is not None:
        a(f"![busy retry waits]({img_rel}/busy_retry_waits.png)")
        a("")
    return reflow("\n".join(L))
