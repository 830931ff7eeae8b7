"""http_bench's measurements: the protocols, the profiles, and one repetition of each
metric (latency, throughput, CPU per frame, RSS per stream) with its aggregation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from harness import Fleet, Proc, SUTs, cpu_seconds, log, med, pct, rss_kib, start_suts

PROTOCOLS: dict[str, dict[str, Any]] = {
    # path after the route, request body, marker of the first text delta in the bytes
    "chat": {
        "path": "v1/chat/completions",
        "body": {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        "text_marker": '"delta":{"content":"',
    },
    "responses": {
        "path": "v1/responses",
        "body": {"model": "bench", "stream": True, "input": "hi"},
        "text_marker": "response.output_text.delta",
    },
    "messages": {
        "path": "v1/messages",
        "body": {
            "model": "bench",
            "stream": True,
            "max_tokens": 1024,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "text_marker": '"text_delta"',
    },
}
TOOL_MARKER = '"tool_calls"'
BIG_BODY_KIB = 256  # an agent turn late in a session: long history, tool outputs


@dataclass(frozen=True)
class Profile:
    reps: int  # repetitions, each on freshly started SUT processes
    ttfc_n: int  # sequential requests per path per repetition
    tool_n: int
    rps_duration_s: float
    rps_warmup_s: float
    cpu_requests: int  # streamed requests per CPU run
    cpu_concurrency: int
    cpu_deltas: int
    cpu_delay_ms: float
    mem_streams: int
    mem_reps: int
    big_n: int  # TTFC requests per path per repetition with the large body
    big_streams: int  # open streams with the large body
    settle_s: float = 1.0  # a pause for RSS to settle before it is read


FULL = Profile(
    reps=5,
    ttfc_n=300,
    tool_n=40,
    rps_duration_s=5.0,
    rps_warmup_s=1.0,
    cpu_requests=96,
    cpu_concurrency=16,
    cpu_deltas=200,
    cpu_delay_ms=2.0,
    mem_streams=500,
    mem_reps=2,
    big_n=60,
    big_streams=100,
)
QUICK = Profile(
    reps=1,
    ttfc_n=30,
    tool_n=6,
    rps_duration_s=0.8,
    rps_warmup_s=0.3,
    cpu_requests=16,
    cpu_concurrency=8,
    cpu_deltas=200,
    cpu_delay_ms=2.0,
    mem_streams=200,
    mem_reps=1,
    big_n=10,
    big_streams=40,
    settle_s=0.2,
)


def _headers(action: dict[str, Any]) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "x-mock-action": json.dumps(action, separators=(",", ":")),
    }


def mock_spec(protocol: str, action: dict[str, Any]) -> dict[str, Any]:
    p = PROTOCOLS[protocol]
    return {"body": json.dumps(p["body"]), "headers": _headers(action)}


def path_urls(mock_url: str, suts: SUTs, protocol: str) -> dict[str, str]:
    path = PROTOCOLS[protocol]["path"]
    return {
        "direct": f"{mock_url}/{path}",
        "bare": f"{suts.bare.url}/mock/{path}",
        "unbroken": f"{suts.unbroken.url}/mock/{path}",
    }


# -------------------------------------------------------------------------------------
# The measurements.  Each repetition runs on freshly started SUT processes: on this VM two
# processes of the same code can differ persistently by 10-30 % in CPU per frame (memory
# layout, cache placement), so a single long-lived instance would bias every number.


PATHS = ("direct", "bare", "unbroken")
SUT_NAMES = ("bare", "unbroken")


def latency_rep(
    gen: Proc, urls: dict[str, str], spec: dict[str, Any], marker: str, n: int
) -> dict[str, Any]:
    """One repetition: n sequential requests per path, interleaved; p50/p99 of the marker."""
    r = gen.call(
        {"op": "ttfc", "targets": [[p, urls[p]] for p in PATHS], "n": n, "marker": marker, **spec},
        timeout=120 + n * 3,
    )
    rep: dict[str, Any] = {"errors": r["errors"], "last_error": r["last_error"]}
    for p in PATHS:
        first, end = r["first_ms"][p], r["end_ms"][p]
        rep[p] = {
            "p50": pct(first, 50),
            "p99": pct(first, 99),
            "end_p50": pct(end, 50),
            "n": len(first),
        }
    return rep


def aggregate_latency(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across repetitions; added = path - direct of the same percentile and rep."""
    out: dict[str, Any] = {
        "per_rep": reps,
        "errors": {p: sum(r["errors"][p] for r in reps) for p in PATHS},
        "last_error": next((r["last_error"] for r in reps if r["last_error"]), ""),
    }
    for p in PATHS:
        out[p] = {k: med([r[p][k] for r in reps]) for k in ("p50", "p99", "end_p50")}
        out[p]["added_p50"] = med([r[p]["p50"] - r["direct"]["p50"] for r in reps])
        out[p]["added_p99"] = med([r[p]["p99"] - r["direct"]["p99"] for r in reps])
        out[p]["samples"] = sum(int(r[p]["n"]) for r in reps)
    return out


def throughput_rep(
    gen: Proc,
    mock: Proc,
    urls: dict[str, str],
    suts: SUTs,
    spec: dict[str, Any],
    prof: Profile,
    rep: int,
    concurrency: int = 64,
) -> dict[str, dict[str, Any]]:
    sut_pid = {"direct": None, "bare": suts.bare.pid, "unbroken": suts.unbroken.pid}
    out: dict[str, dict[str, Any]] = {}
    for p in PATHS[rep % 3 :] + PATHS[: rep % 3]:
        pid = sut_pid[p]
        pids = [mock.pid, gen.pid] + ([pid] if pid else [])
        r = gen.call(
            {
                "op": "throughput",
                "url": urls[p],
                "concurrency": concurrency,
                "warmup": prof.rps_warmup_s,
                "duration": prof.rps_duration_s,
                "cpu_pids": pids,
                **spec,
            },
            timeout=120,
        )
        util = r["cpu_util"]
        r["mock_util"] = util[str(mock.pid)]
        r["gen_util"] = util[str(gen.pid)]
        r["sut_util"] = util[str(pid)] if pid else None
        # Requests per CPU-second of the SUT: its capacity on one core, harness limits aside.
        r["per_core"] = r["rps"] / r["sut_util"] if r["sut_util"] else None
        out[p] = r
        log(
            f"  c={concurrency} {p:8s}: {r['rps']:6.0f} req/s, errors {r['errors']}"
            + (
                f", SUT CPU {r['sut_util']:.0%} -> {r['per_core']:5.0f} req per SUT CPU-s"
                if pid
                else ""
            )
            + f", mock {r['mock_util']:.0%} + loadgen {r['gen_util']:.0%}"
        )
    return out


def aggregate_throughput(reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": {p: [r[p] for r in reps] for p in PATHS}}
    # paired within a repetition (same minute, same noise), then the median
    out["per_core_ratio"] = med([r["unbroken"]["per_core"] / r["bare"]["per_core"] for r in reps])
    for p in PATHS:
        rr = out["runs"][p]
        sut = p != "direct"
        out[p] = {
            "rps": med([r["rps"] for r in rr]),
            "rps_min": min(r["rps"] for r in rr),
            "rps_max": max(r["rps"] for r in rr),
            "errors": sum(r["errors"] for r in rr),
            "sut_util": med([r["sut_util"] for r in rr]) if sut else None,
            "per_core": med([r["per_core"] for r in rr]) if sut else None,
            "harness_util": med([r["mock_util"] + r["gen_util"] for r in rr]),
            "frames_per_req": med([r["frames_per_req"] for r in rr]),
        }
    return out


def cpu_rep(gen: Proc, mock_url: str, suts: SUTs, prof: Profile, rep: int) -> dict[str, Any]:
    """Per protocol: SUT utime+stime over a batch of streamed requests / SSE frames."""
    action = {"deltas": prof.cpu_deltas, "chunk_delay_ms": prof.cpu_delay_ms}
    out: dict[str, Any] = {}
    for proto in PROTOCOLS:
        spec = mock_spec(proto, action)
        urls = path_urls(mock_url, suts, proto)
        order = suts.items() if rep % 2 == 0 else suts.items()[::-1]
        for name, _proc in order:  # warm-up: first-use imports, pools, caches
            gen.call(
                {"op": "batch", "url": urls[name], "n": 2, "concurrency": 2, **spec}, timeout=120
            )
        for name, proc in order:
            before = cpu_seconds(proc.pid)
            r = gen.call(
                {
                    "op": "batch",
                    "url": urls[name],
                    "n": prof.cpu_requests,
                    "concurrency": prof.cpu_concurrency,
                    **spec,
                },
                timeout=300,
            )
            used = cpu_seconds(proc.pid) - before
            frames = r["frames"]
            r.update(cpu_s=used, us_per_frame=used / frames * 1e6 if frames else float("nan"))
            out.setdefault(proto, {})[name] = r
            log(
                f"  cpu {proto:9s} {name:8s}: {r['us_per_frame']:5.1f} µs/frame "
                f"({used:.2f} s / {frames} frames; client reads/frame "
                f"{r['reads'] / max(frames, 1):.2f}; errors {r['errors']})"
            )
    return out


def aggregate_cpu(reps: list[dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for proto in PROTOCOLS:
        res[proto] = {}
        for name in SUT_NAMES:
            runs = [r[proto][name] for r in reps]
            res[proto][name] = {
                "runs": runs,
                "us_per_frame": med([r["us_per_frame"] for r in runs]),
                "frames_per_req": med([r["frames"] / max(r["ok"], 1) for r in runs]),
                "reads_per_frame": med([r["reads"] / max(r["frames"], 1) for r in runs]),
                "errors": sum(r["errors"] for r in runs),
            }
        # paired within a repetition (same minute, same noise), then the median
        res[proto]["ratio"] = med(
            [r[proto]["unbroken"]["us_per_frame"] / r[proto]["bare"]["us_per_frame"] for r in reps]
        )
        res[proto]["extra_us"] = med(
            [r[proto]["unbroken"]["us_per_frame"] - r[proto]["bare"]["us_per_frame"] for r in reps]
        )
    return res


def big_body(kib: int) -> str:
    """A deterministic agent-like chat request of about ``kib`` KiB: a long conversation."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40}]
    size = 0
    i = 0
    while size < kib * 1024:
        i += 1
        if i % 3 == 0:
            content = json.dumps({"stdout": f"line {i}\n" * 30, "exit_code": 0})
            msgs.append({"role": "tool", "tool_call_id": f"call_{i:06d}", "content": content})
        else:
            msgs.append(
                {
                    "role": "user" if i % 3 == 1 else "assistant",
                    "content": f"step {i}: " + "lorem ipsum dolor sit amet " * 20,
                }
            )
        size += len(json.dumps(msgs[-1]))
    return json.dumps({"model": "bench", "stream": True, "messages": msgs})


def rss_per_stream(
    fleet: Fleet,
    gen: Proc,
    mock_url: str,
    tag: str,
    n: int,
    body: str | None,
    settle_s: float = 1.0,
) -> dict[str, Any]:
    """Fresh SUTs: idle RSS after one warm-up request, then with ``n`` open slow streams."""
    suts = start_suts(fleet, mock_url, tag)
    out: dict[str, Any] = {}
    try:
        warm = mock_spec("chat", {"deltas": 4})
        slow = mock_spec("chat", {"deltas": 600, "chunk_delay_ms": 1000})
        if body is not None:
            warm["body"] = slow["body"] = body
        urls = path_urls(mock_url, suts, "chat")
        for name, _proc in suts.items():
            gen.call(
                {"op": "batch", "url": urls[name], "n": 1, "concurrency": 1, **warm}, timeout=30
            )
        time.sleep(settle_s)
        idle = {name: rss_kib(proc.pid) for name, proc in suts.items()}
        for name, proc in suts.items():
            h = gen.call(
                {"op": "hold", "url": urls[name], "n": n, "timeout": 60, **slow}, timeout=90
            )
            time.sleep(settle_s)
            samples = []
            for _ in range(3):
                samples.append(rss_kib(proc.pid))
                time.sleep(settle_s * 0.5)
            gen.call({"op": "release"}, timeout=60)
            loaded = max(samples)
            per = (loaded - idle[name]) / max(h["ready"], 1)
            out[name] = {
                "idle_kib": idle[name],
                "loaded_kib": loaded,
                "streams": h["ready"],
                "failed": h["failed"],
                "kib_per_stream": per,
                "last_error": h["last_error"],
            }
            log(
                f"  memory {tag} {name:8s}: idle {idle[name] / 1024:.1f} MiB, "
                f"{h['ready']} open streams {loaded / 1024:.1f} MiB -> {per:.1f} KiB/stream"
                + (f" ({h['failed']} failed: {h['last_error']})" if h["failed"] else "")
            )
            time.sleep(settle_s * 0.5)
    finally:
        fleet.stop(suts.bare)
        fleet.stop(suts.unbroken)
    return out


def aggregate_memory(runs: list[dict[str, Any]]) -> dict[str, Any]:
    memory: dict[str, Any] = {}
    for name in SUT_NAMES:
        rs = [r[name] for r in runs]
        memory[name] = {
            "idle_mib": med([r["idle_kib"] for r in rs]) / 1024,
            "loaded_mib": med([r["loaded_kib"] for r in rs]) / 1024,
            "kib_per_stream": med([r["kib_per_stream"] for r in rs]),
            "streams": min(r["streams"] for r in rs),
            "runs": rs,
        }
    return memory
