"""http_bench's report: issue 13's targets, the Markdown page and the console summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from http_measure import PATHS, PROTOCOLS, SUT_NAMES
from reporting import fnum, ratio, reflow

# Issue 13's targets, each against the bare pass-through measured in the same run
# (memory: no worse than when the issue was filed, in absolute terms).
TARGETS = {
    "ttfc_added_over_bare_ms": 0.15,  # unbroken's added TTFC p50 - bare's
    "rps_per_core_vs_bare": 0.8,  # streamed (c=64) and non-streamed (c=32)
    "cpu_per_frame_vs_bare": 1.3,
    "idle_rss_mib": 44.0,
    "kib_per_stream": 26.7,
}


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's targets: each row's ``value`` is what the target is about (a ratio or
    a difference against bare from the same run, or an absolute size)."""
    t = res["ttfc"]
    tp, ns = res["throughput"], res["throughput_ns"]
    cpu = res["cpu"]
    mem = res["memory"]
    lim = TARGETS
    rows: list[tuple[str, str, str, float, float, float, str, bool, int]] = [
        # (metric, short, target, unbroken, bare, value, value unit, pass, decimals)
        (
            "added TTFC p50 (chat, c=1)",
            "added-TTFC",
            f"≤ bare + {lim['ttfc_added_over_bare_ms']} ms",
            t["unbroken"]["added_p50"],
            t["bare"]["added_p50"],
            t["unbroken"]["added_p50"] - t["bare"]["added_p50"],
            "ms over bare",
            t["unbroken"]["added_p50"] - t["bare"]["added_p50"] <= lim["ttfc_added_over_bare_ms"],
            3,
        ),
        (
            "streamed req/s per core, c=64 (*)",
            "streamed-req/s",
            f"≥ {lim['rps_per_core_vs_bare']}× bare",
            tp["unbroken"]["per_core"],
            tp["bare"]["per_core"],
            tp["per_core_ratio"],
            "× bare",
            tp["per_core_ratio"] >= lim["rps_per_core_vs_bare"],
            0,
        ),
        (
            "non-streamed req/s per core, c=32 (*)",
            "non-streamed-req/s",
            f"≥ {lim['rps_per_core_vs_bare']}× bare",
            ns["unbroken"]["per_core"],
            ns["bare"]["per_core"],
            ns["per_core_ratio"],
            "× bare",
            ns["per_core_ratio"] >= lim["rps_per_core_vs_bare"],
            0,
        ),
    ]
    for proto in PROTOCOLS:
        d = cpu[proto]
        rows.append(
            (
                f"CPU per frame ({proto}), µs",
                f"CPU-per-frame-{proto}",
                f"≤ {lim['cpu_per_frame_vs_bare']}× bare",
                d["unbroken"]["us_per_frame"],
                d["bare"]["us_per_frame"],
                d["ratio"],
                "× bare",
                d["ratio"] <= lim["cpu_per_frame_vs_bare"],
                1,
            )
        )
    rows += [
        (
            "idle RSS, MiB",
            "idle-RSS",
            f"≤ {lim['idle_rss_mib']} MiB",
            mem["unbroken"]["idle_mib"],
            mem["bare"]["idle_mib"],
            mem["unbroken"]["idle_mib"] - mem["bare"]["idle_mib"],
            "MiB over bare",
            mem["unbroken"]["idle_mib"] <= lim["idle_rss_mib"],
            1,
        ),
        (
            "RSS per open stream, KiB",
            "RSS-per-stream",
            f"≤ {lim['kib_per_stream']} KiB",
            mem["unbroken"]["kib_per_stream"],
            mem["bare"]["kib_per_stream"],
            mem["unbroken"]["kib_per_stream"] - mem["bare"]["kib_per_stream"],
            "KiB over bare",
            mem["unbroken"]["kib_per_stream"] <= lim["kib_per_stream"],
            1,
        ),
    ]
    return [
        {
            "metric": m,
            "short": short,
            "target": tgt,
            "unbroken": u,
            "bare": b,
            "value": v,
            "value_unit": vu,
            "pass": ok and v == v,
            "nd": nd,
        }
        for m, short, tgt, u, b, v, vu, ok, nd in rows
    ]


def _throughput_rows(tp: dict[str, Any]) -> list[str]:
    """A throughput window's table, one row per path."""
    rows = [
        "| path | req/s | min – max | vs direct | SUT CPU | per SUT core | harness CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in PATHS:
        r = tp[p]
        sut = "—" if r["sut_util"] is None else f"{r['sut_util']:.0%}"
        core = "—" if r["per_core"] is None else fnum(r["per_core"], 0)
        rows.append(
            f"| {p} | {fnum(r['rps'], 0)} | {fnum(r['rps_min'], 0)} – {fnum(r['rps_max'], 0)} | "
            f"{ratio(r['rps'], tp['direct']['rps'])} | {sut} | {core} | "
            f"{r['harness_util']:.0%} |"
        )
    return rows


def _throughput_errors(tp: dict[str, Any]) -> list[str]:
    errs = {p: tp[p]["errors"] for p in PATHS if tp[p]["errors"]}
    return [f"Errors during the runs: {errs}."] if errs else []


def render_markdown(res: dict[str, Any], argv: Sequence[str]) -> str:
    m = res["machine"]
    prof: dict[str, Any] = res["profile"]
    t, tool, tp, cpu, mem = (
        res["ttfc"],
        res["tool"],
        res["throughput"],
        res["cpu"],
        res["memory"],
    )
    reps = prof["reps"]
    cmd = "python bench/http_bench.py" + "".join(f" {a}" for a in argv)
    L: list[str] = []
    a = L.append
    a("# Performance")
    a("")
    a("What the relay costs on the request path, measured by `bench/http_bench.py` against two")
    a("baselines in the same run: **direct** (client → mock provider) and **bare**, a bare")
    a("aiohttp pass-through proxy (`bench/bare_proxy.py`: one server, one ClientSession,")
    a("`iter_any` → `write`, no logic), the floor for any aiohttp-based relay.")
    a("")
    a("This file is generated by the benchmark. To reproduce (Linux, from the repository root,")
    a("with the package installed; 6-7 minutes on this machine):")
    a("")
    a("```")
    a(cmd)
    a("```")
    a("")
    a("`--quick` (under a minute, small counts) only smoke-tests the harness; its numbers mean")
    a("little. `--json FILE` also writes every raw run.")
    a("")
    a("## Machine and setup")
    a("")
    a(
        f"* {m['date']}; unbroken {m['unbroken']} at commit `{m['commit'] or 'unknown'}`"
        f"{'; **quick run**' if res['quick'] else ''}; {res['elapsed_s']:.0f} s."
    )
    a(
        f"* nproc {m['nproc']} ({m['cpu_model'] or 'unknown CPU'}, a KVM guest), Linux "
        f"{m['kernel']}; a shared, noisy machine: load average {m['loadavg_start'][0]:.2f} at "
        f"the start, {res['loadavg_end'][0]:.2f} at the end."
    )
    a(f"* Python {m['python']}, aiohttp {m['aiohttp']}.")
    pin = {
        "taskset": "`taskset -c 0` for the system under test (SUT), `taskset -c 1` for the "
        "mock and the load generator",
        "sched_setaffinity": "taskset was not found: pinned with `os.sched_setaffinity` "
        "instead (SUT on CPU 0, mock and load generator on CPU 1)",
        "none": "**nothing pinned** (fewer than 2 CPUs)",
    }[m["pinning"]]
    a(f"* Pinning: {pin}. The SUT has a core to itself; mock and load generator share the")
    a("  other, so **direct** measures the harness's own ceiling on that core.")
    a("* Processes: the mock provider (`unbroken.mock.MockProvider` in its own process, its")
    a("  request log switched off so its memory stays flat), the bare proxy, `python -m")
    a("  unbroken serve` (`[retry] verbose = false`, every other setting at its default, e.g.")
    a("  `[stream] hold` = control + tool calls; the turn journal, if the build has one, writes")
    a("  to a temporary directory), and one aiohttp load-generator process. Loopback only,")
    a("  ephemeral ports, keep-alive connections on every hop.")
    a(f"* {reps} repetitions, each on **freshly started** bare and unbroken processes (on this")
    a("  VM two processes of the same code can differ by 10-30 % in CPU per frame for their")
    a("  whole life), paths interleaved within each; every number below is the median across")
    a("  the repetitions. Ratios are taken against direct (or bare) from the same repetition.")
    a("")
    a("## Targets")
    a("")
    a("Issue 13's targets, each against the bare pass-through measured in the same run (the")
    a("ratios and differences are paired within each repetition, then the median; memory is")
    a("absolute: no worse than when the issue was filed).")
    a("")
    a("| metric | target | unbroken | bare proxy (floor) | unbroken vs bare | verdict |")
    a("|---|---|---:|---:|---:|---|")
    for r in evaluate_targets(res):
        nd = r["nd"]
        vnd = 2 if r["value_unit"] == "× bare" else (3 if r["nd"] == 3 else 1)
        sign = "" if r["value_unit"] == "× bare" else ("+" if r["value"] >= 0 else "")
        a(
            f"| {r['metric']} | {r['target']} | {fnum(r['unbroken'], nd)} | "
            f"{fnum(r['bare'], nd)} | "
            f"{sign}{fnum(r['value'], vnd)} {r['value_unit']} | {_verdict(r['pass'])} |"
        )
    a("")
    a("(*) Requests completed per CPU-second of the SUT process in the window: its rate on")
    a("one fully used core. It equals the measured rate when the SUT saturates its core; when")
    a("it does not (the mock and load generator on the other core are the limit), it is the")
    a("rate a busy core would sustain. Measured rates are under the throughput sections.")
    a("")
    # -- TTFC
    a("## Added time to first chunk (TTFC)")
    a("")
    a("Concurrency 1, streamed chat (`/v1/chat/completions`); the upstream sends one frame")
    a("every 5 ms (`chunk_delay_ms: 5`: the role chunk at once, the first text delta 5 ms")
    a("later). TTFC = request sent → first **text delta** at the client, on every path")
    a("(unbroken holds the role chunk, and the response headers, until the first output, so")
    a(
        '"first byte" would not compare like with like). Per repetition '
        f"{prof['ttfc_n']} requests per path, p50 and p99; added = path − direct, same"
    )
    a("percentile, same repetition.")
    a("")
    a("| path | TTFC p50 ms | TTFC p99 ms | added p50 ms | added p99 ms | p50 vs direct |")
    a("|---|---:|---:|---:|---:|---:|")
    for p in PATHS:
        r = t[p]
        added50 = "—" if p == "direct" else fnum(r["added_p50"], 3)
        added99 = "—" if p == "direct" else fnum(r["added_p99"], 3)
        a(
            f"| {p} | {fnum(r['p50'], 3)} | {fnum(r['p99'], 3)} | {added50} | {added99} | "
            f"{ratio(r['p50'], t['direct']['p50'])} |"
        )
    a("")
    a(
        f"unbroken adds {ratio(t['unbroken']['added_p50'], t['bare']['added_p50'])} what the "
        "bare proxy adds at p50 "
        f"({fnum(t['unbroken']['added_p50'] - t['bare']['added_p50'], 3)} ms "
        "more)."
    )
    if any(t["errors"].values()):
        a(f"Errors: {t['errors']} (last: `{t['last_error']}`).")
    a("")
    # -- throughput
    a("## Streamed requests per second (concurrency 64)")
    a("")
    a(
        f"Streamed chat, 20 text deltas, no delay ({fnum(tp['unbroken']['frames_per_req'], 0)} SSE "
        "frames a response), 64 concurrent clients, the SUT pinned to one core; per repetition"
    )
    a(
        f"one {prof['rps_duration_s']:g} s window (after {prof['rps_warmup_s']:g} s warm-up) per "
        "path. *SUT CPU* and *harness CPU* are the share of a core used in the window"
    )
    a("(utime+stime / wall) by the SUT and by mock + load generator (together on the other")
    a("core). *Per SUT core* = req/s ÷ SUT CPU: the rate one fully used core would sustain.")
    a("")
    L += _throughput_rows(tp)
    a("")
    a(
        f"unbroken / bare: {ratio(tp['unbroken']['rps'], tp['bare']['rps'])} measured, "
        f"{ratio(tp['unbroken']['per_core'], tp['bare']['per_core'])} per SUT core; CPU per "
        f"request {fnum(1e6 / tp['unbroken']['per_core'], 0)} µs vs "
        f"{fnum(1e6 / tp['bare']['per_core'], 0)} µs."
    )
    L += _throughput_errors(tp)
    a("")
    # -- non-streamed throughput
    ns = res["throughput_ns"]
    a("## Non-streamed requests per second (concurrency 32)")
    a("")
    a('The same chat turn with `"stream": false` (one JSON body of the 20 deltas\' text), 32')
    a("concurrent clients, one window per path per repetition as above.")
    a("")
    L += _throughput_rows(ns)
    a("")
    a(
        f"unbroken / bare per SUT core: {fnum(ns['per_core_ratio'], 2)}× (paired by repetition); "
        f"CPU per request {fnum(1e6 / ns['unbroken']['per_core'], 0)} µs vs "
        f"{fnum(1e6 / ns['bare']['per_core'], 0)} µs."
    )
    L += _throughput_errors(ns)
    a("")
    # -- CPU per chunk
    a("## CPU per chunk")
    a("")
    a(
        f"utime+stime of the SUT process (`/proc/PID/stat`, 10 ms ticks, all threads) over "
        f"{prof['cpu_requests']} streamed requests of {prof['cpu_deltas']} deltas"
    )
    a(
        f"(concurrency {prof['cpu_concurrency']}, `chunk_delay_ms: {prof['cpu_delay_ms']:g}`, so "
        "each frame travels on its own as with a real model), divided by the SSE frames the"
    )
    a("client received. Nothing is subtracted: per-request work (accept, headers, upstream")
    a(
        "request, per-turn bookkeeping) is included, spread over "
        f"~{cpu['chat']['unbroken']['frames_per_req']:.0f} frames."
    )
    a("")
    a(
        "| protocol | frames/response | bare µs/frame | unbroken µs/frame | unbroken − bare | "
        "unbroken / bare | client reads/frame |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|")
    for proto in PROTOCOLS:
        d = cpu[proto]
        b, u = d["bare"], d["unbroken"]
        a(
            f"| {proto} (`/{PROTOCOLS[proto]['path']}`) | {u['frames_per_req']:.0f} | "
            f"{fnum(b['us_per_frame'], 1)} | {fnum(u['us_per_frame'], 1)} | "
            f"{fnum(d['extra_us'], 1)} | {d['ratio']:.2f}× | {u['reads_per_frame']:.2f} |"
        )
    a("")
    a("Direct has no relay process, so it has no column here. The difference and the ratio")
    a("are paired within each repetition, then the median.")
    a("*Client reads/frame* near 1.00 means the frames were not coalesced on the way (one read")
    a("and one write per frame in the SUT); well below 1, batching would make the per-frame")
    a("cost look smaller than it is for a paced, real stream.")
    a("")
    # -- memory
    a("## Memory")
    a("")
    a(
        "RSS (`VmRSS`) of freshly started SUTs after one warm-up request (idle), and with "
        f"{prof['mem_streams']}"
    )
    a("open slow streams (`chunk_delay_ms: 1000`; every client has its first bytes and keeps")
    a("the stream open). Per stream = (RSS with streams − idle RSS) / streams. The mock and")
    a(
        f"the clients are other processes (so direct has no row). Median of {prof['mem_reps']} "
        "fresh start(s)."
    )
    a("")
    a("| path | idle RSS MiB | RSS with streams MiB | streams | KiB per open stream |")
    a("|---|---:|---:|---:|---:|")
    for name in SUT_NAMES:
        r = mem[name]
        a(
            f"| {name} | {fnum(r['idle_mib'], 1)} | {fnum(r['loaded_mib'], 1)} | {r['streams']} | "
            f"{fnum(r['kib_per_stream'], 1)} |"
        )
    a("")
    a(
        f"unbroken / bare: idle {ratio(mem['unbroken']['idle_mib'], mem['bare']['idle_mib'])}, "
        f"per stream {ratio(mem['unbroken']['kib_per_stream'], mem['bare']['kib_per_stream'])}."
    )
    a("")
    # -- tool gate
    a("## Dispatch gate: when a streamed tool call becomes visible")
    a("")
    a('A streamed chat tool call (`x-mock-action: {"reply": "tool", "chunk_delay_ms": 5}`:')
    a("role chunk, tool-call start, 8 argument deltas, finish, `[DONE]`, 5 ms apart). Time from")
    a('the request to the first byte of the tool call (`"tool_calls"`) at the client, per')
    a(f"repetition {prof['tool_n']} requests per path. Direct and bare stream the call as it is")
    a("generated; unbroken holds it until it is complete (the dispatch gate) and releases it")
    a("whole, so the difference is the time the model spent streaming the arguments.")
    a("")
    a(
        "| path | first tool-call byte p50 ms | p99 ms | end of stream p50 ms | "
        "first byte − direct |"
    )
    a("|---|---:|---:|---:|---:|")
    for p in PATHS:
        r = tool[p]
        added = "—" if p == "direct" else fnum(r["added_p50"], 2)
        a(
            f"| {p} | {fnum(r['p50'], 2)} | {fnum(r['p99'], 2)} | "
            f"{fnum(r['end_p50'], 2)} | {added} |"
        )
    a("")
    before_end = tool["unbroken"]["end_p50"] - tool["unbroken"]["p50"]
    end_delta = tool["unbroken"]["end_p50"] - tool["direct"]["end_p50"]
    a(
        f"Through unbroken the call arrives {fnum(tool['unbroken']['added_p50'], 1)} ms later than "
        f"directly and {fnum(before_end, 1)} ms before the end of the stream: the gate costs the"
    )
    a(
        "argument-streaming time, not the turn: the stream ends "
        f"{fnum(end_delta, 2)} ms after direct's."
    )
    a("")
    # -- large body supplement
    bb = res["big_body"]
    bt, bm = bb["ttfc"], bb["memory"]
    a(f"## Supplement: a {bb['body_kib']:.0f} KiB request body")
    a("")
    a("The tables above use a tiny request. A coding agent late in a session sends its whole")
    a(
        "history every turn, so here the same chat request carries a "
        f"{bb['body_kib']:.0f} KiB body (system prompt, a long"
    )
    a(
        "conversation, tool outputs). Added TTFC as above (c=1, 5 ms/chunk, "
        f"{prof['big_n']} requests per path per repetition), and RSS per open stream"
    )
    a(f"({prof['big_streams']} streams, fresh processes, one start).")
    a("")
    a(
        "| path | TTFC p50 ms | added p50 ms | idle RSS MiB | RSS with streams MiB | "
        "KiB per open stream |"
    )
    a("|---|---:|---:|---:|---:|---:|")
    for p in PATHS:
        r = bt[p]
        added = "—" if p == "direct" else fnum(r["added_p50"], 3)
        if p == "direct":
            a(f"| {p} | {fnum(r['p50'], 3)} | {added} | — | — | — |")
        else:
            mm = bm[p]
            a(
                f"| {p} | {fnum(r['p50'], 3)} | {added} | {fnum(mm['idle_mib'], 1)} | "
                f"{fnum(mm['loaded_mib'], 1)} | {fnum(mm['kib_per_stream'], 1)} |"
            )
    a("")
    a(
        "With this body unbroken adds "
        f"{fnum(bt['unbroken']['added_p50'] - bt['bare']['added_p50'], 2)}"
        f" ms more than the bare proxy to TTFC (tiny body: "
        f"{fnum(t['unbroken']['added_p50'] - t['bare']['added_p50'], 2)} ms) and holds "
        f"{ratio(bm['unbroken']['kib_per_stream'], bm['bare']['kib_per_stream'])} the bare "
        "proxy's memory per open stream."
    )
    a("")
    a("## Interpretation")
    a("")
    for line in interpretation(res):
        a(f"* {line}")
    a("")
    a("## WebSocket")
    a("")
    a("(added by the WebSocket issue)")
    a("")
    return reflow("\n".join(L))


def interpretation(res: dict[str, Any]) -> list[str]:
    t, tp, cpu, mem = res["ttfc"], res["throughput"], res["cpu"], res["memory"]
    out: list[str] = []
    u, b = t["unbroken"], t["bare"]
    out.append(
        f"**Latency.** unbroken adds {fnum(u['added_p50'], 2)} ms at p50 over direct; the bare "
        f"aiohttp hop alone adds {fnum(b['added_p50'], 2)} ms, so the relay's own work on the "
        f"first text delta costs {fnum(u['added_p50'] - b['added_p50'], 2)} ms. Part of that is "
        "by design: unbroken sends the response headers together with the first output (so "
        "an attempt that dies first stays invisible and a final failure can still be a real "
        "HTTP status), so its client parses the headers when the text arrives, while bare "
        "and direct clients parsed them 5 ms earlier. The p99 differences are dominated by "
        "scheduler noise on this shared VM (the mock's 5 ms timer jitter is common to all "
        "paths but does not cancel exactly); read them as orders of magnitude."
    )
    d, ub, bb = tp["direct"], tp["unbroken"], tp["bare"]
    parts = []
    for name, r in (("bare", bb), ("unbroken", ub)):
        if r["sut_util"] >= 0.9:
            parts.append(
                f"{name} saturates its core ({r['sut_util']:.0%} CPU), so the SUT is the limit"
            )
        else:
            parts.append(
                f"{name} uses {r['sut_util']:.0%} of its core while mock + load "
                f"generator use {r['harness_util']:.0%} of theirs, so the harness is "
                "(at least partly) the limit"
            )
    out.append(
        f"**Throughput.** Direct reaches {fnum(d['rps'], 0)} req/s with mock and load generator "
        "on one core: the harness ceiling on this machine (a relay in between can even raise "
        "it, because it hands the client coalesced chunks that are cheaper to read, which is "
        f"why bare can beat direct). {'; '.join(parts)}. Normalised "
        f"to one busy core, unbroken sustains {fnum(ub['per_core'], 0)} req/s against the bare "
        f"proxy's {fnum(bb['per_core'], 0)} ({ratio(ub['per_core'], bb['per_core'])}): "
        f"{fnum(1e6 / ub['per_core'] - 1e6 / bb['per_core'], 0)} µs more CPU per "
        f"{fnum(ub['frames_per_req'], 0)}-frame request: the gate's proof of each frame and the "
        'relay\'s per-turn work (see "Where the per-turn floor is" below for a profile; '
        "this window's ratio moves by ±0.1 between runs of the same code)."
    )
    cu = cpu["chat"]
    protos = ", ".join(f"{p} +{fnum(cpu[p]['extra_us'], 1)} µs" for p in PROTOCOLS)
    out.append(
        f"**CPU per chunk.** Of unbroken's {fnum(cu['unbroken']['us_per_frame'], 1)} µs per chat "
        f"frame, {fnum(cu['bare']['us_per_frame'], 1)} µs is the aiohttp read + write that the "
        f"bare proxy pays too; the relay's logic adds {protos}. Chat chunks carry no event "
        "name, so each one is JSON-parsed to classify it; Responses and Messages frames are "
        "classified by their event name and parse only item starts, errors and the like."
    )
    big = res["big_body"]
    bt, bm = big["ttfc"], big["memory"]
    out.append(
        f"**Large bodies.** With a {big['body_kib']:.0f} KiB request, unbroken's extra TTFC over "
        f"the bare proxy grows to {fnum(bt['unbroken']['added_p50'] - bt['bare']['added_p50'], 2)} "
        f"ms and its memory per open stream to {fnum(bm['unbroken']['kib_per_stream'], 0)} KiB "
        f"(bare {fnum(bm['bare']['kib_per_stream'], 0)} KiB): the relay parses the whole request "
        "body as JSON before it opens the upstream request, and keeps the raw bytes for the "
        "life of the turn for a replay (the parsed object only when an upstream renames "
        "models). The tiny-request tables understate both costs for real agent traffic."
    )
    mu, mb = mem["unbroken"], mem["bare"]
    out.append(
        f"**Memory.** Idle RSS {fnum(mu['idle_mib'], 1)} MiB against {fnum(mb['idle_mib'], 1)} MiB "
        "for the bare proxy: the interpreter, aiohttp and unbroken's modules. Per open stream "
        f"{fnum(mu['kib_per_stream'], 1)} KiB against {fnum(mb['kib_per_stream'], 1)} KiB: most of "
        "it is the two connections' aiohttp state (client side and upstream side) that any "
        "relay pays; unbroken adds its per-turn state (ledger, classifier, watchdog, "
        'turn and attempt records) and more coroutines per turn (see "Where the per-turn '
        'floor is").'
    )
    return out


def print_summary(res: dict[str, Any]) -> None:
    print("\nunbroken HTTP benchmark" + (" (QUICK: smoke test only)" if res["quick"] else ""))
    t, tp = res["ttfc"], res["throughput"]
    print(
        f"  TTFC c=1 added p50/p99: bare {t['bare']['added_p50']:+.3f}/"
        f"{t['bare']['added_p99']:+.3f} ms, unbroken {t['unbroken']['added_p50']:+.3f}/"
        f"{t['unbroken']['added_p99']:+.3f} ms"
    )
    for label, r in (("req/s c=64", tp), ("non-streamed req/s c=32", res["throughput_ns"])):
        print(
            f"  {label}: direct {r['direct']['rps']:.0f}, bare {r['bare']['rps']:.0f} "
            f"({r['bare']['per_core']:.0f} per SUT core), unbroken {r['unbroken']['rps']:.0f} "
            f"({r['unbroken']['per_core']:.0f} per SUT core)"
        )
    for proto, d in res["cpu"].items():
        print(
            f"  CPU/frame {proto:9s}: bare {d['bare']['us_per_frame']:.1f} µs, "
            f"unbroken {d['unbroken']['us_per_frame']:.1f} µs ({d['extra_us']:+.1f})"
        )
    mem = res["memory"]
    print(
        f"  RSS idle: bare {mem['bare']['idle_mib']:.1f} MiB, unbroken "
        f"{mem['unbroken']['idle_mib']:.1f} MiB; per stream: bare "
        f"{mem['bare']['kib_per_stream']:.1f} KiB, unbroken "
        f"{mem['unbroken']['kib_per_stream']:.1f} KiB"
    )
    big = res["big_body"]
    print(
        f"  {big['body_kib']:.0f} KiB body: added TTFC p50 bare "
        f"{big['ttfc']['bare']['added_p50']:+.3f} ms, unbroken "
        f"{big['ttfc']['unbroken']['added_p50']:+.3f} ms; per stream bare "
        f"{big['memory']['bare']['kib_per_stream']:.0f} KiB, unbroken "
        f"{big['memory']['unbroken']['kib_per_stream']:.0f} KiB"
    )
    tool = res["tool"]
    print(
        f"  first tool-call byte p50: direct {tool['direct']['p50']:.1f} ms, bare "
        f"{tool['bare']['p50']:.1f} ms, unbroken {tool['unbroken']['p50']:.1f} ms"
    )
    print("  targets:")
    for r in evaluate_targets(res):
        print(
            f"    {'PASS' if r['pass'] else 'MISS'}  {r['metric']:38s} {r['target']:16s} "
            f"{fnum(r['value'], 3)} {r['value_unit']} (unbroken {fnum(r['unbroken'], r['nd'])}, "
            f"bare {fnum(r['bare'], r['nd'])})"
        )
