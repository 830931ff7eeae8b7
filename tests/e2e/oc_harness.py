"""Driving the real OpenCode CLI (npm ``opencode-ai``) against the mock provider.

Every OpenCode process gets its own scratch HOME, XDG directories and TMPDIR, with
autoupdate, the models fetch and sharing disabled, and ``PWD`` set to its project
(OpenCode takes its directory from ``PWD``).  No ``UNBROKEN_*`` variable and no
unbroken config reach the relay: ``unbroken run -- opencode`` runs with the defaults a
user gets.  Processes start in their own process group and are always killed, group
and all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from e2e.clis import PINNED, installed
from unbroken.mock import MockProvider, RecordedRequest

OPENCODE_VERSION = PINNED["opencode"].version
MODEL = "fake/fake-model"
#: OpenCode's built-in providers pointed at the mock, each with a model from its bundled
#: catalogue: ``openai`` speaks Responses (``/v1/responses``, ``store: false``) and
#: ``anthropic`` Messages (``/v1/messages``, no thinking for this model).
BUILTIN_MODELS = {"openai": "openai/gpt-4o-mini", "anthropic": "anthropic/claude-sonnet-4-5"}


def opencode_bin() -> Path:
    """The OpenCode binary the session installed (see clis.py)."""
    return installed("opencode")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fake_provider(base_url: str) -> dict[str, Any]:
    """A user's OpenCode config with one custom OpenAI-compatible provider."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "fake": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Fake",
                "options": {"baseURL": base_url, "apiKey": "sk-dummy"},
                "models": {
                    "fake-model": {
                        "name": "Fake",
                        "tool_call": True,
                        "limit": {"context": 128000, "output": 4096},
                    }
                },
            }
        },
    }


def builtin_provider(provider: str, base_url: str) -> dict[str, Any]:
    """A user's OpenCode config that points a built-in provider (``openai``,
    ``anthropic``) at ``base_url``, the way a user points it at a proxy: the bundled SDK
    and model catalogue stay OpenCode's own."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {provider: {"options": {"baseURL": base_url, "apiKey": "sk-dummy"}}},
    }


class Sandbox:
    """An isolated home for one OpenCode process, with a project directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs = {n: root / n for n in ("home", "config", "data", "cache", "state", "tmp")}
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        self.project = root / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OPENCODE", "XDG_", "UNBROKEN_"))
            and k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")
        }
        env.update(
            HOME=str(self.dirs["home"]),
            XDG_CONFIG_HOME=str(self.dirs["config"]),
            XDG_DATA_HOME=str(self.dirs["data"]),
            XDG_CACHE_HOME=str(self.dirs["cache"]),
            XDG_STATE_HOME=str(self.dirs["state"]),
            TMPDIR=str(self.dirs["tmp"]),
            PWD=str(self.project),
            OPENCODE_PURE="1",
        )
        for flag in (
            "AUTOUPDATE",
            "MODELS_FETCH",
            "SHARE",
            "DEFAULT_PLUGINS",
            "LSP_DOWNLOAD",
            "CLAUDE_CODE",
            "EXTERNAL_SKILLS",
        ):
            env[f"OPENCODE_DISABLE_{flag}"] = "1"
        self.env = env

    @property
    def global_config(self) -> Path:
        return self.dirs["config"] / "opencode" / "opencode.json"

    def write_global_config(self, data: Mapping[str, Any]) -> None:
        self.global_config.parent.mkdir(parents=True, exist_ok=True)
        self.global_config.write_text(json.dumps(data, indent=2) + "\n")


@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str
    elapsed: float

    def stream_errors(self) -> int:
        """Failures OpenCode itself saw (``--print-logs --log-level WARN``)."""
        return self.stderr.count('message="stream error"')


def unbroken_run(*opencode_args: str, options: Sequence[str] = ()) -> list[str]:
    """``unbroken run [options] -- opencode ...`` as an argv."""
    return [
        sys.executable,
        "-m",
        "unbroken",
        "run",
        *options,
        "--",
        str(opencode_bin()),
        *opencode_args,
    ]


def opencode(*args: str) -> list[str]:
    return [str(opencode_bin()), *args]


def run_args(*prompt: str, model: str = MODEL) -> list[str]:
    """``opencode run`` arguments for one headless turn (the fake model by default)."""
    return [
        "run",
        "--print-logs",
        "--log-level",
        "WARN",
        "--title",
        "e2e",
        "--model",
        model,
        *(prompt or ("say", "hi")),
    ]


#: Process groups started and not yet reaped (killed at the end of the session at the latest).
LIVE_GROUPS: set[int] = set()


def kill_leftovers() -> None:
    for pgid in list(LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        LIVE_GROUPS.discard(pgid)


async def _kill_group(proc: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    if proc.returncode is not None:
        LIVE_GROUPS.discard(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the leader left behind
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await proc.wait()
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
    LIVE_GROUPS.discard(proc.pid)


async def run_to_end(
    argv: Sequence[str],
    box: Sandbox,
    *,
    limit_s: float = 200.0,
    extra_env: Mapping[str, str] = {},
) -> Finished:
    """Run a command to completion in the sandbox (killed after ``limit_s``)."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=str(box.project),
        env={**box.env, **extra_env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    LIVE_GROUPS.add(proc.pid)
    try:
        async with asyncio.timeout(limit_s):
            out, err = await proc.communicate()
    finally:
        await _kill_group(proc)
    assert proc.returncode is not None
    return Finished(
        proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        time.monotonic() - start,
    )


class Background:
    """A long-running command (``opencode serve`` or ``unbroken run -- opencode serve``)."""

    def __init__(self, argv: Sequence[str], box: Sandbox, extra_env: Mapping[str, str] = {}):
        self.argv = list(argv)
        self.box = box
        self.extra_env = dict(extra_env)
        self.proc: asyncio.subprocess.Process | None = None
        self.log = box.root / "background.log"

    async def __aenter__(self) -> Background:
        self._log = self.log.open("wb")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=str(self.box.project),
            env={**self.box.env, **self.extra_env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            start_new_session=True,
        )
        LIVE_GROUPS.add(self.proc.pid)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None:
            await _kill_group(self.proc)
        self._log.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Events:
    """Everything an OpenCode server's ``GET /event`` sent, with arrival times."""

    items: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def of(self, kind: str, session: str | None = None) -> list[dict[str, Any]]:
        out = []
        for _, e in self.items:
            props = e.get("properties") or {}
            if e.get("type") == kind and (session is None or props.get("sessionID") == session):
                out.append(e)
        return out

    async def wait_for(self, predicate: Callable[[], Any], limit_s: float) -> Any:
        async with asyncio.timeout(limit_s):
            while True:
                result = predicate()
                if result:
                    return result
                self.changed.clear()
                await self.changed.wait()


class OpenCodeClient:
    """Plain-HTTP client of an OpenCode server (the PyPI SDK does not match 1.18)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = aiohttp.ClientSession()
        self.events = Events()
        self._task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.http.close()

    async def wait_healthy(
        self, limit_s: float = 90.0, alive: Callable[[], bool] = lambda: True
    ) -> None:
        async with asyncio.timeout(limit_s):
            while True:
                assert alive(), "the OpenCode process exited before its server came up"
                try:
                    async with self.http.get(
                        f"{self.base_url}/global/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)

    async def subscribe(self) -> None:
        connected = asyncio.Event()

        async def follow() -> None:
            async with self.http.get(
                f"{self.base_url}/event", timeout=aiohttp.ClientTimeout(total=None)
            ) as r:
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    self.events.items.append((time.monotonic(), event))
                    self.events.changed.set()
                    if event.get("type") == "server.connected":
                        connected.set()

        self._task = asyncio.create_task(follow())
        async with asyncio.timeout(30):
            await connected.wait()

    async def create_session(self) -> str:
        async with self.http.post(f"{self.base_url}/session", json={"title": "e2e"}) as r:
            assert r.status == 200, await r.text()
            sid: str = (await r.json())["id"]
            return sid

    async def prompt_async(self, sid: str, text: str, model: str = MODEL) -> None:
        provider, _, model_id = model.partition("/")
        body = {
            "model": {"providerID": provider, "modelID": model_id},
            "parts": [{"type": "text", "text": text}],
        }
        async with self.http.post(f"{self.base_url}/session/{sid}/prompt_async", json=body) as r:
            assert r.status in (200, 204), await r.text()

    async def messages(self, sid: str) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base_url}/session/{sid}/message") as r:
            data: list[dict[str, Any]] = await r.json()
            return data


class TimedMock(MockProvider):
    """The mock provider, also noting when each request arrived (``times``, monotonic)."""

    def __init__(self) -> None:
        super().__init__(host="127.0.0.1", port=0)
        self.times: list[float] = []

    def _record(self, rec: RecordedRequest) -> None:
        self.times.append(time.monotonic())
        super()._record(rec)


def turn_requests(mock: MockProvider) -> list[RecordedRequest]:
    """The provider requests that carry a user turn (not title generation)."""
    out = []
    for r in mock.requests:
        if not r.path.endswith("/chat/completions"):
            continue
        try:
            messages = r.json().get("messages") or []
        except ValueError:
            continue
        system = " ".join(
            m.get("content", "")
            for m in messages
            if m.get("role") == "system" and isinstance(m.get("content"), str)
        )
        if "title generator" in system:
            continue
        out.append(r)
    return out


def is_title_request(rec: RecordedRequest) -> bool:
    """OpenCode's separate title-generation call (any protocol)."""
    return b"You are a title generator" in rec.body


def is_continuation(rec: RecordedRequest) -> bool:
    """A request the relay made to finish a turn in place, not one OpenCode sent: a
    Responses resume (``GET /responses/{id}?stream=true&starting_after=N``), or a
    Messages request whose last message is the assistant's committed text (prefill)."""
    if rec.method != "POST":
        return True
    if rec.path.endswith("/messages"):
        try:
            messages = rec.json().get("messages") or []
        except (ValueError, AttributeError):
            return False
        return bool(messages) and messages[-1].get("role") == "assistant"
    return False


def step_requests(mock: MockProvider) -> list[RecordedRequest]:
    """The model requests OpenCode itself sent (through the relay, one each): no title
    generation and no continuation the relay made."""
    return [
        r
        for r in mock.requests
        if r.path.endswith(("/responses", "/messages", "/chat/completions"))
        and not is_title_request(r)
        and not is_continuation(r)
    ]


def max_per_second(times: Sequence[float]) -> int:
    """The most requests that arrived within any one-second window."""
    best = 0
    ordered = sorted(times)
    j = 0
    for i, t in enumerate(ordered):
        while ordered[j] < t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best
