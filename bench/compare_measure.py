"""compare.py's measurements, one repetition each on the same fresh systems: memory, time to
first text delta, req/s, CPU per frame and failover; and its load generator (http_bench's,
plus one command that keeps what the client received).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from compare_suts import LITELLM_KEY, Suts, mock_call, tree_cpu, tree_pids, tree_rss
from harness import Proc, log, med, pct
from http_loadgen import LoadGen

CHAT_BODY = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
MSG_BODY = {
    "model": "claude-bench",
    "stream": True,
    "max_tokens": 1024,
    "messages": [{"role": "user", "content": "hi"}],
}
TEXT_MARKER = '"content":"Hel'  # the first text delta (LiteLLM's role chunk has "content":"")
HEADERS = {
    "content-type": "application/json",
    "accept": "text/event-stream",
    "authorization": f"Bearer {LITELLM_KEY}",
}  # LiteLLM's key; the others ignore it


@dataclass(frozen=True)
class Profile:
    reps: int
    ttfc_n: int
    rps_duration_s: float
    rps_warmup_s: float
    cpu_requests: int
    cpu_requests_litellm: int
    mem_points: tuple[int, ...]
    failover_n: int
    fault_timeout_s: float  # how long the fault-matrix client waits for a whole reply
    settle_s: float = 1.0  # a pause for RSS to settle before it is read


FULL = Profile(
    reps=3,
    ttfc_n=200,
    rps_duration_s=5.0,
    rps_warmup_s=1.0,
    cpu_requests=96,
    cpu_requests_litellm=16,
    mem_points=(100, 250, 500),
    failover_n=5,
    fault_timeout_s=20.0,
)
QUICK = Profile(
    reps=1,
    ttfc_n=20,
    rps_duration_s=0.8,
    rps_warmup_s=0.3,
    cpu_requests=16,
    cpu_requests_litellm=4,
    mem_points=(40, 100),
    failover_n=2,
    fault_timeout_s=3.0,
    settle_s=0.2,
)


# =====================================================================================
# The load generator: http_bench's, plus one command that keeps what the client received


class CompareGen(LoadGen):
    async def cmd_fetch(self, c: dict[str, Any]) -> dict[str, Any]:
        """``n`` sequential requests; per request: status, bytes (if asked), error, times."""
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        marker = c.get("marker", "").encode()
        out = []
        for _ in range(c.get("n", 1)):
            t0 = time.perf_counter()
            data = bytearray()
            status: int | None = None
            error = ""
            first: float | None = None
            try:
                async with asyncio.timeout(c["timeout"]):
                    async with self.session.post(url, data=body, headers=headers) as resp:
                        status = resp.status
                        async for chunk in resp.content.iter_any():
                            data += chunk
                            if first is None and marker and marker in data:
                                first = time.perf_counter() - t0
            except TimeoutError:
                error = f"no complete answer within {c['timeout']:g} s"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
            out.append(
                {
                    "status": status,
                    "error": error,
                    "elapsed_ms": (time.perf_counter() - t0) * 1000,
                    "first_ms": None if first is None else first * 1000,
                    "body": data.decode("latin-1") if c.get("keep_body") else None,
                }
            )
        return {"results": out}


# Measurements (one repetition each, on the same fresh SUTs)


def spec(body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"body": json.dumps({**body, **kw}), "headers": HEADERS}


def measure_memory(gen: Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
    mock_call(mock_url, "default", {"deltas": 100000, "chunk_delay_ms": 1000})
    s = spec(CHAT_BODY)
    out: dict[str, Any] = {}
    for name in suts.names():
        pid = suts.procs[name].pid
        idle = tree_rss(pid)
        points = [(0, idle)]
        for n in prof.mem_points:
            h = gen.call(
                {"op": "hold", "url": suts.url(name), "n": n, "timeout": 120, **s}, timeout=150
            )
            time.sleep(prof.settle_s)
            samples = []
            for _ in range(3):
                samples.append(tree_rss(pid))
                time.sleep(prof.settle_s * 0.3)
            loaded = max(samples)
            gen.call({"op": "release"}, timeout=120)
            points.append((h["ready"], loaded))
            time.sleep(prof.settle_s * 0.5)
        n_max, top = points[-1]
        out[name] = {
            "idle_mib": idle / 1024,
            "points": points,
            "kib_per_stream": (top - idle) / max(n_max, 1),
        }
        log(
            f"  memory {name:8s}: idle {idle / 1024:.1f} MiB; "
            + ", ".join(f"{n} streams {k / 1024:.1f} MiB" for n, k in points[1:])
        )
    return out


def measure_ttfc(gen: Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
    mock_call(mock_url, "default", {"deltas": 1, "chunk_delay_ms": 5})
    targets = [["direct", f"{mock_url}/v1/chat/completions"]]
    targets += [[n, suts.url(n)] for n in suts.names()]
    r = gen.call(
        {
            "op": "ttfc",
            "targets": targets,
            "n": prof.ttfc_n,
            "marker": TEXT_MARKER,
            **spec(CHAT_BODY),
        },
        timeout=300 + prof.ttfc_n * 2,
    )
    log("  TTFC p50 ms: " + ", ".join(f"{n} {pct(v, 50):.2f}" for n, v in r["first_ms"].items()))
    return {"first_ms": r["first_ms"], "errors": r["errors"], "last_error": r["last_error"]}


def measure_rps(
    gen: Proc, mock: Proc, suts: Suts, prof: Profile, rep: int, stream: bool
) -> dict[str, Any]:
    mock_call(mock.url, "default", {"deltas": 20})
    conc = 64 if stream else 32
    s = spec(CHAT_BODY, stream=stream)
    paths = ["direct", *suts.names()]
    k = rep % len(paths)
    out: dict[str, Any] = {}
    for name in paths[k:] + paths[:k]:
        url = f"{mock.url}/v1/chat/completions" if name == "direct" else suts.url(name)
        sut = [] if name == "direct" else tree_pids(suts.procs[name].pid)
        # LiteLLM needs seconds per request at this concurrency: a longer warm-up and window
        slow = 3.0 if name == "litellm" else 1.0
        r = gen.call(
            {
                "op": "throughput",
                "url": url,
                "concurrency": conc,
                "warmup": prof.rps_warmup_s * slow,
                "duration": prof.rps_duration_s * slow,
                "cpu_pids": [mock.pid, gen.pid, *sut],
                **s,
            },
            timeout=300,
        )
        util = sum(r["cpu_util"][str(p)] for p in sut) if sut else None
        r["sut_util"] = util
        r["per_core"] = r["rps"] / util if util else None
        out[name] = r
        log(
            f"  {'streamed' if stream else 'non-streamed'} c={conc} {name:8s}: "
            f"{r['rps']:7.1f} req/s, errors {r['errors']}"
            + (f", SUT CPU {util:.0%} -> {r['per_core']:.0f} per core" if util else "")
        )
    return out


def measure_cpu(gen: Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
    mock_call(mock_url, "default", {"deltas": 200, "chunk_delay_ms": 2})
    s = spec(CHAT_BODY)
    out: dict[str, Any] = {}
    for name in suts.names():
        gen.call({"op": "batch", "url": suts.url(name), "n": 2, "concurrency": 2, **s}, timeout=120)
        n = prof.cpu_requests_litellm if name == "litellm" else prof.cpu_requests
        pid = suts.procs[name].pid
        before = tree_cpu(pid)
        r = gen.call(
            {"op": "batch", "url": suts.url(name), "n": n, "concurrency": 16, **s}, timeout=600
        )
        used = tree_cpu(pid) - before
        r["us_per_frame"] = used / r["frames"] * 1e6 if r["frames"] else float("nan")
        out[name] = r
        log(
            f"  CPU {name:8s}: {r['us_per_frame']:.1f} µs/frame ({used:.2f} s, "
            f"{r['frames']} frames, errors {r['errors']})"
        )
    return out


def measure_failover(gen: Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
    mock_call(mock_url, "default", {"deltas": 1})
    out: dict[str, Any] = {}
    for name in suts.names():
        if name == "bare":
            continue  # one upstream, no failover
        clean = gen.call(
            {
                "op": "fetch",
                "url": suts.url(name),
                "n": 3,
                "timeout": 60,
                "marker": TEXT_MARKER,
                **spec(CHAT_BODY),
            },
            timeout=120,
        )["results"]
        if name == "litellm":
            s = spec(CHAT_BODY, model="bench-failover")
            url = suts.url(name)
        else:
            s, url = spec(CHAT_BODY), suts.url(name, route="failover")
        res = gen.call(
            {
                "op": "fetch",
                "url": url,
                "n": prof.failover_n,
                "marker": TEXT_MARKER,
                "timeout": 60,
                **s,
            },
            timeout=600,
        )["results"]
        ok = [r for r in res if r["status"] == 200 and not r["error"]]
        base = med([r["elapsed_ms"] for r in clean])
        out[name] = {
            "first_ms": res[0]["elapsed_ms"] - base if res[0] in ok else None,
            "later_ms": med([r["elapsed_ms"] - base for r in ok[1:]]) if ok[1:] else None,
            "clean_ms": base,
            "failed": len(res) - len(ok),
            "errors": [r["error"] or r["status"] for r in res if r not in ok][:2],
        }
        x = out[name]
        log(
            f"  failover {name:8s}: first {x['first_ms']} ms, later {x['later_ms']} ms over "
            f"a clean {base:.1f} ms; failed {x['failed']}"
        )
    return out


# =====================================================================================
