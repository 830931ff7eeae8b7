"""Side by side: direct vs a bare aiohttp pass-through vs unbroken vs the LiteLLM proxy.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/compare.py                 # the full run; writes docs/benchmarks.md + docs/img/
    python bench/compare.py --quick --no-litellm --out /tmp/b.md --img /tmp/img   # smoke test

One interleaved session, each repetition on freshly started processes, all on loopback:
the mock provider and the load generator pinned to CPU 1, each system under test (SUT)
pinned to CPU 0 (the harness of ``bench/http_bench.py``, imported from there).  LiteLLM
runs from its own virtual environment, which this script creates once in
``~/.cache/unbroken-bench/litellm-venv`` (``$XDG_CACHE_HOME``; ``--litellm-venv``):
litellm 1.110.2 plus the dependencies of its ``proxy`` extra (the extra itself cannot be
installed: its ``litellm-proxy`` pin is not on the package index).  It runs offline
(``LITELLM_OFFLINE_MODE=true``, ``LITELLM_LOCAL_MODEL_COST_MAP=True``).  ``--no-litellm``
leaves it out, and the report says so; without that flag a LiteLLM that cannot be
installed or started is an error, never a silent omission.

Metrics: time to first text delta at c=1; streamed (c=64) and non-streamed (c=32) req/s
per SUT core; SUT CPU per SSE frame; RSS idle and per open stream; failover time from a
refused primary; and one fault matrix through every path, judged by the bytes the client
received.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_bench as hb  # the harness: processes, pinning, /proc, load generator

ROOT = hb.ROOT
PY = hb.PY
LITELLM_VERSION = "1.110.2"
LITELLM_KEY = "sk-bench-0123456789abcdef0123456789abcdef"  # a local-only master key
LITELLM_ENV = {
    "LITELLM_OFFLINE_MODE": "true",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_MASTER_KEY": LITELLM_KEY,
    "LITELLM_LOG": "ERROR",
}
# The proxy extra's own packages: litellm-proxy is not on the index; the other two are
# pinned to versions that are not published either.  Everything else of the extra is installed.
LITELLM_NOT_INSTALLABLE = ("litellm-proxy", "litellm-proxy-extras", "litellm-enterprise")
STREAM_TIMEOUT_S = 2.0  # stall detection, configured the same on unbroken and LiteLLM

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

# name, description, protocol, queued mock actions ("refused" uses the refused-primary route)
FAULTS: list[tuple[str, str, str, list[dict[str, Any]]]] = [
    ("503 storm", "six 503s, then a clean reply", "chat", [{"status": 503, "count": 6}]),
    (
        "429 + Retry-After",
        "429 with Retry-After: 1, then a clean reply",
        "chat",
        [{"status": 429, "headers": {"Retry-After": "1"}}],
    ),
    ("refused primary", "first upstream refuses the connection; a second one is fine", "chat", []),
    (
        "reset before output",
        "role chunk, then a connection reset",
        "chat",
        [{"fault": "reset", "after_frame": 1}],
    ),
    (
        "reset after output",
        "role chunk + 2 text deltas, then a reset",
        "chat",
        [{"fault": "reset", "after_frame": 3}],
    ),
    (
        "clean end after output",
        "role chunk + 2 text deltas, then a clean end of body",
        "chat",
        [{"fault": "end", "after_frame": 3}],
    ),
    (
        "stall before output",
        "role chunk, then 30 s of silence",
        "chat",
        [{"fault": "stall", "after_frame": 1, "seconds": 30}],
    ),
    (
        "reset mid tool arguments",
        "a streamed tool call cut after 2 argument fragments",
        "tool",
        [{"fault": "reset", "after_frame": 4, "reply": "tool"}, {"reply": "tool"}],
    ),
    (
        "in-stream error",
        "role chunk, then an `overloaded` error event",
        "chat",
        [{"fault": "error_event", "after_frame": 1, "error": "overloaded"}],
    ),
    (
        "Anthropic reset after message_start",
        "`message_start`, then a reset",
        "messages",
        [{"fault": "reset", "after_frame": 1}],
    ),
]
OUTCOMES = ("complete", "spliced", "truncated, shown as success", "error")


# =====================================================================================
# The load generator: http_bench's, plus one command that keeps what the client received


class CompareGen(hb._Gen):
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


# =====================================================================================
# Processes


def _refused_port() -> tuple[socket.socket, int]:
    """A bound, never-listening socket: connecting to its port is refused (RST) at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, int(s.getsockname()[1])


def mock_call(mock_url: str, path: str, payload: dict[str, Any] | None = None) -> None:
    req = urllib.request.Request(
        f"{mock_url}/_mock/{path}",
        data=json.dumps(payload or {}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


def litellm_venv(path: Path) -> Path:
    """Create (once) LiteLLM's own venv; return its ``litellm`` executable."""
    exe = path / "bin" / "litellm"
    stamp = path / f".ok-{LITELLM_VERSION}"
    if stamp.exists() and exe.exists():
        return exe
    hb.log(
        f"installing litellm {LITELLM_VERSION} + its proxy extra's dependencies into {path} "
        "(once; a few minutes)"
    )
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"litellm=={LITELLM_VERSION}"], check=True)
    lister = (
        "import importlib.metadata as m\n"
        "from packaging.requirements import Requirement\n"
        "for r in m.distribution('litellm').requires or []:\n"
        "    q = Requirement(r)\n"
        "    if q.marker and q.marker.evaluate({'extra': 'proxy'})"
        " and not q.marker.evaluate({'extra': ''}):\n"
        "        print(str(q).split(';')[0].strip())\n"
    )
    reqs = subprocess.run(
        [str(path / "bin" / "python"), "-c", lister], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    keep = [r for r in reqs if r and re.split(r"[<>=!~ \[]", r)[0] not in LITELLM_NOT_INSTALLABLE]
    subprocess.run([*pip, *keep], check=True)
    stamp.write_text("\n".join(keep) + "\n")
    return exe


def litellm_config(mock_url: str, fault_url: str, refused: list[int]) -> str:
    def dep(group: str, model: str, base: str, extra: str = "") -> str:
        return (
            f"  - model_name: {group}\n    litellm_params:\n      model: {model}\n"
            f"      api_base: {base}\n      api_key: sk-bench\n{extra}"
        )

    stall = f"      stream_timeout: {STREAM_TIMEOUT_S:g}\n      timeout: 10\n"
    return (
        "model_list:\n"
        + dep("bench", "openai/bench", f"{mock_url}/v1")
        + dep("bench-failover", "openai/bench", f"http://127.0.0.1:{refused[0]}/v1")
        + dep("bench-faults", "openai/bench", f"{fault_url}/v1", stall)
        + dep("bench-refused", "openai/bench", f"http://127.0.0.1:{refused[1]}/v1", stall)
        + dep("claude-faults", "anthropic/claude-bench", fault_url, stall)
        + "litellm_settings:\n  num_retries: 3\n"
        + '  fallbacks: [{"bench-failover": ["bench"]}, {"bench-refused": ["bench-faults"]}]\n'
    )


def unbroken_config(upstreams: dict[str, list[str]], stall: bool) -> str:
    text = "[server]\ngrace_s = 1.0\n\n[retry]\nverbose = false\n\n"
    if stall:
        text += (
            f"[stream]\nfirst_frame_timeout_s = {STREAM_TIMEOUT_S:g}\n"
            f"idle_timeout_s = {STREAM_TIMEOUT_S:g}\n\n"
        )
    for route, urls in upstreams.items():
        ups = ", ".join(f'{{ url = "{u}" }}' for u in urls)
        text += f"[routes.{route}]\nupstreams = [{ups}]\n\n"
    return text


class Suts:
    """One fresh set of systems under test: {name: (Proc, base URL for the chat path)}."""

    def __init__(
        self,
        fleet: hb.Fleet,
        tag: str,
        *,
        mock_url: str,
        fault_url: str,
        refused: list[int],
        litellm: Path | None,
    ) -> None:
        self.fleet = fleet
        self.procs: dict[str, hb.Proc] = {}
        wd = fleet.workdir
        self.procs["bare"] = fleet.start(
            f"bare-{tag}",
            [PY, str(ROOT / "bench" / "bare_proxy.py"), "--upstream", mock_url],
            cpu=fleet.sut_cpu,
            ready=r"listening on (http://\S+)",
        )
        state = wd / f"state-{tag}"
        state.mkdir(exist_ok=True)
        cfg = wd / f"unbroken-{tag}.toml"
        cfg.write_text(
            unbroken_config(
                {"mock": [mock_url], "failover": [f"http://127.0.0.1:{refused[0]}", mock_url]},
                stall=False,
            )
        )
        self.procs["unbroken"] = fleet.start(
            f"unbroken-{tag}",
            [PY, "-m", "unbroken", "serve", "--config", str(cfg), "--port", "0"],
            cpu=fleet.sut_cpu,
            ready=r"relaying on (http://\S+)",
            env={"XDG_STATE_HOME": str(state), "HOME": str(state)},
        )
        if litellm is not None:
            lcfg = wd / f"litellm-{tag}.yaml"
            lcfg.write_text(litellm_config(mock_url, fault_url, refused))
            port = hb_free_port()
            p = fleet.start(
                f"litellm-{tag}",
                [str(litellm), "--config", str(lcfg), "--host", "127.0.0.1", "--port", str(port)],
                cpu=fleet.sut_cpu,
                ready=None,
                env={**LITELLM_ENV, "HOME": str(state)},
            )
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", p, 120)
            p.url = f"http://127.0.0.1:{port}"
            self.procs["litellm"] = p

    def names(self) -> list[str]:
        return list(self.procs)

    def url(self, name: str, protocol: str = "chat", route: str = "mock") -> str:
        path = {"chat": "v1/chat/completions", "messages": "v1/messages"}[protocol]
        if name == "litellm":
            return f"{self.procs[name].url}/{path}"
        return f"{self.procs[name].url}/{route}/{path}"

    def stop(self) -> None:
        for p in self.procs.values():
            self.fleet.stop(p)


def hb_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: hb.Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            break
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"{proc.name} did not start:\n{proc.err_path.read_text()[-3000:]}\n"
        f"{proc.out_path.read_text()[-2000:]}"
    )


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants (LiteLLM may fork workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
    return out


def tree_cpu(pid: int) -> float:
    return sum(hb.cpu_seconds(p) for p in tree_pids(pid))


def tree_rss(pid: int) -> int:
    return sum(hb.rss_kib(p) for p in tree_pids(pid))


# =====================================================================================
# Measurements (one repetition each, on the same fresh SUTs)


def spec(body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"body": json.dumps({**body, **kw}), "headers": HEADERS}


def measure_memory(gen: hb.Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
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
        hb.log(
            f"  memory {name:8s}: idle {idle / 1024:.1f} MiB; "
            + ", ".join(f"{n} streams {k / 1024:.1f} MiB" for n, k in points[1:])
        )
    return out


def measure_ttfc(gen: hb.Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
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
    hb.log(
        "  TTFC p50 ms: " + ", ".join(f"{n} {hb.pct(v, 50):.2f}" for n, v in r["first_ms"].items())
    )
    return {"first_ms": r["first_ms"], "errors": r["errors"], "last_error": r["last_error"]}


def measure_rps(
    gen: hb.Proc, mock: hb.Proc, suts: Suts, prof: Profile, rep: int, stream: bool
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
        hb.log(
            f"  {'streamed' if stream else 'non-streamed'} c={conc} {name:8s}: "
            f"{r['rps']:7.1f} req/s, errors {r['errors']}"
            + (f", SUT CPU {util:.0%} -> {r['per_core']:.0f} per core" if util else "")
        )
    return out


def measure_cpu(gen: hb.Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
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
        hb.log(
            f"  CPU {name:8s}: {r['us_per_frame']:.1f} µs/frame ({used:.2f} s, "
            f"{r['frames']} frames, errors {r['errors']})"
        )
    return out


def measure_failover(gen: hb.Proc, mock_url: str, suts: Suts, prof: Profile) -> dict[str, Any]:
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
        base = hb.med([r["elapsed_ms"] for r in clean])
        out[name] = {
            "first_ms": res[0]["elapsed_ms"] - base if res[0] in ok else None,
            "later_ms": hb.med([r["elapsed_ms"] - base for r in ok[1:]]) if ok[1:] else None,
            "clean_ms": base,
            "failed": len(res) - len(ok),
            "errors": [r["error"] or r["status"] for r in res if r not in ok][:2],
        }
        x = out[name]
        hb.log(
            f"  failover {name:8s}: first {x['first_ms']} ms, later {x['later_ms']} ms over "
            f"a clean {base:.1f} ms; failed {x['failed']}"
        )
    return out


# =====================================================================================
# The fault matrix


def parse_stream(body: str, protocol: str) -> dict[str, Any]:
    """What a client makes of the bytes: text, tool args, roles, models, terminal, error."""
    text, args = [], []
    roles, models, terminal, error = 0, [], False, False
    event = ""
    for line in body.split("\n"):
        line = line.rstrip("\r")
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            terminal = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        kind = obj.get("type", event)
        if "error" in obj or kind == "error":
            error = True
        if protocol == "messages":
            if kind == "message_start":
                roles += 1
                models.append(obj.get("message", {}).get("model"))
            elif kind == "content_block_delta":
                d = obj.get("delta", {})
                text.append(d.get("text", ""))
                args.append(d.get("partial_json", ""))
            elif kind == "message_stop":
                terminal = True
            continue
        if obj.get("model") is not None and obj.get("model") not in models:
            models.append(obj.get("model"))
        for ch in obj.get("choices") or []:
            d = ch.get("delta") or {}
            if "role" in d:
                roles += 1
            text.append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                args.append((tc.get("function") or {}).get("arguments") or "")
    return {
        "text": "".join(text),
        "args": "".join(args),
        "roles": roles,
        "models": len(set(models)),
        "terminal": terminal,
        "error": error,
    }


_VOLATILE = re.compile(r'"created":\s*\d+')


def short_error(error: str) -> str:
    """A client-side exception in a few words (for the matrix)."""
    if "identical to this path's clean reply" in error:  # the wording of older runs
        return "same bytes as its clean reply; re-encoded vs direct"
    if "Cannot connect" in error or "Connect call failed" in error:
        return "connection refused"
    if "no complete answer" in error:
        return re.sub(r".*(no complete answer within \S+ s).*", r"\1", error)
    if "ClientPayloadError" in error or "ServerDisconnected" in error:
        return "connection broke mid-body"
    return error[:60]


def judge(got: dict[str, Any], ref: dict[str, Any] | None, protocol: str) -> tuple[str, str]:
    """(outcome, detail) of one fault-matrix cell, from what the client received."""
    if got["status"] != 200:
        return "error", f"HTTP {got['status']}" if got["status"] else short_error(got["error"])
    p = parse_stream(got["body"], protocol)
    if got["error"]:
        return "error", short_error(got["error"])
    if p["error"]:
        return "error", "in-stream error event"
    if p["roles"] > 1 or p["models"] > 1:
        what = "role chunks" if protocol != "messages" else "message_start events"
        return "spliced", (f"{p['roles']} {what}" if p["roles"] > 1 else "model changed")
    if ref:
        r = parse_stream(ref["body"], protocol)
        if _VOLATILE.sub("", got["body"]) == _VOLATILE.sub("", ref["body"]):
            return "complete", "byte-identical"
        if len(p["text"]) > len(r["text"]) or len(p["args"]) > len(r["args"]):
            return "spliced", "duplicated output"
        if p["terminal"] and (p["text"], p["args"]) == (r["text"], r["args"]):
            return "complete", "same content, bytes differ"
    if not p["terminal"]:
        return "truncated, shown as success", "no terminal frame, no error"
    return "truncated, shown as success", "content differs from the clean reply"


def fault_matrix(
    fleet: hb.Fleet,
    gen: hb.Proc,
    fault: hb.Proc,
    refused: list[int],
    litellm: Suts | None,
    timeout: float,
) -> dict[str, Any]:
    """Each case through each path, on a mock of its own; references are clean replies."""
    wd = fleet.workdir
    state = wd / "state-faults"
    state.mkdir(exist_ok=True)
    cfg = wd / "unbroken-faults.toml"
    refused_url = f"http://127.0.0.1:{refused[1]}"
    cfg.write_text(
        unbroken_config({"mock": [fault.url], "refused": [refused_url, fault.url]}, stall=True)
    )
    procs = {
        "bare": fleet.start(
            "bare-faults",
            [PY, str(ROOT / "bench" / "bare_proxy.py"), "--upstream", fault.url],
            cpu=fleet.sut_cpu,
            ready=r"listening on (http://\S+)",
        ),
        "bare-refused": fleet.start(
            "bare-refused",
            [PY, str(ROOT / "bench" / "bare_proxy.py"), "--upstream", refused_url],
            cpu=fleet.sut_cpu,
            ready=r"listening on (http://\S+)",
        ),
        "unbroken": fleet.start(
            "unbroken-faults",
            [PY, "-m", "unbroken", "serve", "--config", str(cfg), "--port", "0"],
            cpu=fleet.sut_cpu,
            ready=r"relaying on (http://\S+)",
            env={"XDG_STATE_HOME": str(state), "HOME": str(state)},
        ),
    }
    paths = ["direct", "bare", "unbroken"] + (["litellm"] if litellm else [])

    def target(path: str, proto: str, refused_case: bool) -> tuple[str, dict[str, Any]]:
        body = MSG_BODY if proto == "messages" else CHAT_BODY
        rel = "v1/messages" if proto == "messages" else "v1/chat/completions"
        s = spec(body)
        if path == "direct":
            base = refused_url if refused_case else fault.url
            return f"{base}/{rel}", s
        if path == "bare":
            p = procs["bare-refused" if refused_case else "bare"]
            return f"{p.url}/mock/{rel}", s
        if path == "unbroken":
            return f"{procs['unbroken'].url}/{'refused' if refused_case else 'mock'}/{rel}", s
        assert litellm is not None
        model = (
            "claude-faults"
            if proto == "messages"
            else "bench-refused"
            if refused_case
            else "bench-faults"
        )
        return litellm.url("litellm", proto), spec(body, model=model)

    def fetch(url: str, s: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
        mock_call(fault.url, "reset")
        if actions:
            mock_call(fault.url, "script", {"actions": actions})
        r = gen.call(
            {"op": "fetch", "url": url, "keep_body": True, "timeout": timeout, **s},
            timeout=timeout + 30,
        )
        res: dict[str, Any] = r["results"][0]
        return res

    try:
        for path in paths:  # warm every path once (imports, pools)
            url, s = target(path, "chat", False)
            fetch(url, s, [])
        cells: dict[str, dict[str, Any]] = {}
        refs: dict[tuple[str, str], dict[str, Any]] = {}
        for name, _desc, kind, actions in FAULTS:
            proto = "messages" if kind == "messages" else "chat"
            clean = [{"reply": "tool"}] if kind == "tool" else []
            cells[name] = {}
            for path in paths:
                key = (path, kind)
                if key not in refs:
                    url, s = target(path, proto, False)
                    refs[key] = fetch(url, s, clean)
                url, s = target(path, proto, name == "refused primary")
                got = fetch(url, s, actions)
                outcome, detail = judge(got, refs[key], proto)
                if (
                    outcome == "complete"
                    and path != "direct"
                    and got["body"] != refs[("direct", kind)]["body"]
                    and detail == "byte-identical"
                ):
                    detail = "same bytes as its clean reply; re-encoded vs direct"
                cells[name][path] = {
                    "outcome": outcome,
                    "detail": detail,
                    "elapsed_ms": got["elapsed_ms"],
                    "status": got["status"],
                }
                hb.log(
                    f"  fault {name:36s} {path:8s}: {outcome} ({detail}), "
                    f"{got['elapsed_ms']:.0f} ms"
                )
        return {"paths": paths, "cells": cells, "timeout_s": timeout}
    finally:
        for p in procs.values():
            fleet.stop(p)


# =====================================================================================
# Aggregation


def aggregate(reps: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    med, pct = hb.med, hb.pct
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
    f, ratio = hb._f, hb._ratio
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
    return hb.reflow("\n".join(L))


# =====================================================================================
# main


def run(prof: Profile, quick: bool, litellm_exe: Path | None) -> dict[str, Any]:
    ncpu = len(os.sched_getaffinity(0))
    pinning = "none" if ncpu < 2 else "taskset" if shutil.which("taskset") else "sched_setaffinity"
    harness = None if pinning == "none" else hb.HARNESS_CPU
    if harness is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {harness})
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * max(prof.mem_points) + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (want if hard == resource.RLIM_INFINITY else min(want, hard), hard),
        )
    machine = hb.machine_info(pinning)
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-compare-"))
    fleet = hb.Fleet(workdir, pinning)
    held = [_refused_port(), _refused_port()]
    refused = [p for _, p in held]
    ok = False
    try:
        hbpy = str(ROOT / "bench" / "http_bench.py")
        mock = fleet.start(
            "mock", [PY, hbpy, "--mock"], cpu=harness, ready=r"listening on (http://\S+)"
        )
        fault = fleet.start(
            "fault-mock", [PY, hbpy, "--mock"], cpu=harness, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen",
            [PY, str(Path(__file__).resolve()), "--loadgen"],
            cpu=harness,
            ready=None,
            pipe_stdio=True,
        )
        hb.log(f"mock {mock.url}, fault mock {fault.url}; logs in {workdir}")
        reps: list[dict[str, Any]] = []
        names: list[str] = []
        for rep in range(prof.reps):
            suts = Suts(
                fleet,
                f"r{rep}",
                mock_url=mock.url,
                fault_url=fault.url,
                refused=refused,
                litellm=litellm_exe,
            )
            names = suts.names()
            hb.log(
                f"round {rep + 1}/{prof.reps}: fresh "
                + ", ".join(f"{n} (pid {p.pid})" for n, p in suts.procs.items())
            )
            try:
                mock_call(mock.url, "default", {"deltas": 20})
                for n in names:  # one warm-up request each, then idle memory
                    gen.call(
                        {
                            "op": "batch",
                            "url": suts.url(n),
                            "n": 1,
                            "concurrency": 1,
                            **spec(CHAT_BODY),
                        },
                        timeout=60,
                    )
                time.sleep(prof.settle_s)
                r: dict[str, Any] = {"memory": measure_memory(gen, mock.url, suts, prof)}
                r["ttfc"] = measure_ttfc(gen, mock.url, suts, prof)
                r["rps_stream"] = measure_rps(gen, mock, suts, prof, rep, True)
                r["rps_plain"] = measure_rps(gen, mock, suts, prof, rep, False)
                r["cpu"] = measure_cpu(gen, mock.url, suts, prof)
                r["failover"] = measure_failover(gen, mock.url, suts, prof)
                reps.append(r)
                if rep == prof.reps - 1:
                    hb.log("fault matrix")
                    matrix = fault_matrix(
                        fleet,
                        gen,
                        fault,
                        refused,
                        suts if litellm_exe else None,
                        prof.fault_timeout_s,
                    )
            finally:
                suts.stop()
        res = {
            "quick": quick,
            "machine": machine,
            "profile": prof.__dict__,
            "litellm": litellm_exe is not None,
            "agg": aggregate(reps, names),
            "matrix": matrix,
            "loadavg_end": os.getloadavg(),
            "litellm_config": litellm_config(
                "http://127.0.0.1:MOCK", "http://127.0.0.1:FAULTS", [1111, 2222]
            )
            .replace(":1111", ":REFUSED1")
            .replace(":2222", ":REFUSED2"),
        }
        with contextlib.suppress(Exception):
            gen.call({"op": "quit"}, timeout=1)
        ok = True
        return res
    finally:
        fleet.stop_all()
        for s, _ in held:
            s.close()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            hb.log(f"logs kept in {workdir}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        hb._Gen = CompareGen  # type: ignore[misc]  # http_bench's loop, with cmd_fetch
        hb.loadgen_main()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    parser.add_argument(
        "--no-litellm", action="store_true", help="leave LiteLLM out (said in the report)"
    )
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument(
        "--litellm-venv", type=Path, default=cache / "unbroken-bench" / "litellm-venv"
    )
    parser.add_argument(
        "--out", help="Markdown report (default docs/benchmarks.md; none with --quick unless given)"
    )
    parser.add_argument("--img", help="PNG directory (default: img/ next to --out)")
    parser.add_argument("--json", help="also write the aggregated results here")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="render the report and plots again from a --json file; no run",
    )
    args = parser.parse_args()
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        write_report(
            res,
            args.out or str(ROOT / "docs" / "benchmarks.md"),
            args.img,
            quick=res["quick"],
            no_litellm=not res["litellm"],
        )
        return 0
    if not sys.platform.startswith("linux"):
        print("compare: needs Linux (/proc, CPU pinning)", file=sys.stderr)
        return 2
    out = args.out or (None if args.quick else str(ROOT / "docs" / "benchmarks.md"))
    exe = None if args.no_litellm else litellm_venv(args.litellm_venv)
    t0 = time.monotonic()
    try:
        res = run(QUICK if args.quick else FULL, args.quick, exe)
    except KeyboardInterrupt:
        hb.log("interrupted; all child processes stopped")
        return 130
    res["elapsed_s"] = time.monotonic() - t0
    agg = res["agg"]
    print("\nunbroken comparison" + (" (QUICK: smoke test only)" if args.quick else ""))
    for p, x in agg["ttfc"].items():
        line = f"  {p:8s} TTFC p50 {x['p50']:.2f} ms (added {x['added_p50']:+.2f})"
        if p != "direct":
            line += (
                f"; per core: streamed {agg['rps_stream'][p]['per_core']:.0f}, non-streamed "
                f"{agg['rps_plain'][p]['per_core']:.0f}; {agg['cpu'][p]['us_per_frame']:.1f} "
                f"µs/frame; idle {agg['memory'][p]['idle_mib']:.1f} MiB, "
                f"{agg['memory'][p]['kib_per_stream']:.1f} KiB/stream"
            )
        print(line)
    for case, row in res["matrix"]["cells"].items():
        print(f"  {case:36s} " + "  ".join(f"{p}: {c['outcome']}" for p, c in row.items()))
    if not res["litellm"]:
        print("  LiteLLM: left out (--no-litellm)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if out:
        write_report(res, out, args.img, quick=args.quick, no_litellm=args.no_litellm)
    return 0


def write_report(
    res: dict[str, Any], out: str, img_dir: str | None, *, quick: bool, no_litellm: bool
) -> None:
    outp = Path(out).resolve()
    img = Path(img_dir).resolve() if img_dir else outp.parent / "img"
    plots(res["agg"], res["matrix"], img)
    cmd = (
        "python bench/compare.py"
        + (" --quick" if quick else "")
        + (" --no-litellm" if no_litellm else "")
    )
    outp.write_text(render(res, os.path.relpath(img, outp.parent), cmd) + "\n")
    hb.log(f"wrote {outp} and 4 plots in {img}")


if __name__ == "__main__":
    sys.exit(main())
