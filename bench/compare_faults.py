"""compare.py's fault matrix: each fault through every path, judged by the bytes the client
received.
"""

from __future__ import annotations

import json
import re
from typing import Any

from compare_measure import CHAT_BODY, MSG_BODY, spec
from compare_suts import Suts, mock_call, unbroken_config
from harness import PY, ROOT, Fleet, Proc, log

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
    fleet: Fleet,
    gen: Proc,
    fault: Proc,
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
                log(
                    f"  fault {name:36s} {path:8s}: {outcome} ({detail}), "
                    f"{got['elapsed_ms']:.0f} ms"
                )
        return {"paths": paths, "cells": cells, "timeout_s": timeout}
    finally:
        for p in procs.values():
            fleet.stop(p)
