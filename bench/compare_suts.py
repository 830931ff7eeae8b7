"""compare.py's systems under test: unbroken, the bare proxy and the LiteLLM proxy (its
virtual environment, version and offline settings, its config), started fresh each round,
and the /proc readings of a process tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import PY, ROOT, Fleet, Proc, cpu_seconds, free_port, log, rss_kib

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


# =====================================================================================
# Processes


def refused_port() -> tuple[socket.socket, int]:
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
    log(
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
        fleet: Fleet,
        tag: str,
        *,
        mock_url: str,
        fault_url: str,
        refused: list[int],
        litellm: Path | None,
    ) -> None:
        self.fleet = fleet
        self.procs: dict[str, Proc] = {}
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
            port = free_port()
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


def wait_http(url: str, proc: Proc, timeout: float) -> None:
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
    return sum(cpu_seconds(p) for p in tree_pids(pid))


def tree_rss(pid: int) -> int:
    return sum(rss_kib(p) for p in tree_pids(pid))


# =====================================================================================
