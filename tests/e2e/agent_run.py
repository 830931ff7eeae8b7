"""Running the real Codex CLI, Claude Code and Gemini CLI, alone or through `unbroken run`,
against the mock provider (tests/e2e/test_codex_e2e.py, test_claude_e2e.py,
test_gemini_e2e.py).

Every process gets its own HOME (and CODEX_HOME), runs from a scratch project
directory, with stdin from /dev/null, in its own process group, and is killed,
group and all, when the test ends or times out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e.clis import installed

if TYPE_CHECKING:
    import pytest

#: environment variables of the test process that must not reach an agent
_DROP = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CODEX_HOME",
    "UNBROKEN_CONFIG",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GOOGLE_GEMINI_BASE_URL",
    "GOOGLE_VERTEX_BASE_URL",
    "GOOGLE_GENAI_USE_VERTEXAI",
    "GOOGLE_GENAI_USE_GCA",
    "GEMINI_CLI_HOME",
    "GEMINI_CLI_SYSTEM_DEFAULTS_PATH",
    "GEMINI_CLI_SYSTEM_SETTINGS_PATH",
)
#: prefixes of variables that would change the relay's settings (``UNBROKEN_RETRY_*``
#: and their ``OPENCODE_RETRY_*`` aliases): the relay runs with the defaults a user gets
_DROP_PREFIXES = ("UNBROKEN_", "OPENCODE_RETRY_")


@dataclass
class Result:
    code: int | None
    stdout: str
    stderr: str
    seconds: float
    #: when the process started (``time.monotonic()``, the mock's ``RecordedRequest.at`` clock)
    started: float = 0.0

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines of stdout (``--json`` / ``stream-json``)."""
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


def base_env(home: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(_DROP_PREFIXES)
    }
    env["HOME"] = str(home)
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env["XDG_STATE_HOME"] = str(home / ".state")
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    return env


#: `[stream]` timers for a test about a stall: a silent upstream is replayed after 3 s
#: (the defaults wait 300 s for a first frame and 120 s between frames)
STALL_TIMERS: dict[str, float] = {"first_frame_timeout_s": 3, "idle_timeout_s": 3}


def relay_config(path: Path, journal: Path, **stream: Any) -> Path:
    """An unbroken config for `unbroken run --config`: the journal at ``journal`` and the
    ``[stream]`` keys given (numbers, booleans, lists of strings); the defaults for
    everything else (retries every 250 ms; breakers on, which a one-upstream storm
    gets through)."""
    lines = ["[stream]", *(f"{k} = {json.dumps(v)}" for k, v in stream.items()), ""]
    lines += ["[journal]", f"path = {json.dumps(str(journal))}", ""]
    path.write_text("\n".join(lines))
    return path


def through_unbroken(config: Path, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "unbroken", "run", "--config", str(config), "--", *argv]


def zero_config(argv: Sequence[str]) -> list[str]:
    """``unbroken run -- <agent>`` with no unbroken config: the defaults a user gets (the
    environment from `base_env` carries no ``UNBROKEN_*`` variable either)."""
    return [sys.executable, "-m", "unbroken", "run", "--", *argv]


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """One ``e2e: ...`` line of what a test measured, shown past pytest's capture."""
    with capsys.disabled():
        print(f"\n    e2e: {text}", flush=True)


async def run(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path, limit_s: float = 90.0
) -> Result:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env),
        cwd=str(cwd),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(limit_s):
            out, err = await proc.communicate()
    except TimeoutError:
        out, err = b"", b"timed out"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await proc.wait()
    return Result(
        proc.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
        time.monotonic() - t0,
        t0,
    )


def timeline(result: Result, requests: Sequence[Any]) -> str:
    """When the upstream requests arrived, from the start of the process: ``"first
    request at +1.5 s, last at +11.6 s"`` (``requests``: the mock's `RecordedRequest` s)."""
    if not requests:
        return "no upstream request"
    first, last = (requests[0].at - result.started, requests[-1].at - result.started)
    return f"first upstream request at +{first:.1f} s, last at +{last:.1f} s"


# -- Codex -----------------------------------------------------------------------------------
def codex_bin() -> Path:
    return installed("codex")


def codex_home(root: Path, mock_url: str, **provider: Any) -> dict[str, str]:
    """A CODEX_HOME whose config has one custom provider ``fake`` at the mock; returns
    the environment to run Codex with."""
    home = root / "home"
    codex = root / "codex"
    for d in (home, codex, root / "project"):
        d.mkdir(parents=True, exist_ok=True)
    knobs = {
        "request_max_retries": 1,
        "stream_max_retries": 1,
        "stream_idle_timeout_ms": 20000,
        **provider,
    }
    lines = [
        'model = "fake-model"',
        'model_provider = "fake"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "",
        "[model_providers.fake]",
        'name = "fake"',
        f'base_url = "{mock_url}/v1"',
        'env_key = "FAKE_API_KEY"',
        'wire_api = "responses"',
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in knobs.items()]
    (codex / "config.toml").write_text("\n".join(lines) + "\n")
    env = base_env(home)
    env["CODEX_HOME"] = str(codex)
    env["FAKE_API_KEY"] = "sk-fake"
    return env


def codex_argv(root: Path, prompt: str) -> list[str]:
    return [
        str(codex_bin()),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--ephemeral",
        "-C",
        str(root / "project"),
        prompt,
    ]


def reconnects(result: Result) -> list[str]:
    return [
        e["message"]
        for e in result.events()
        if e.get("type") == "error" and "Reconnecting" in str(e.get("message"))
    ]


def agent_text(result: Result) -> str:
    return "".join(
        e["item"].get("text", "")
        for e in result.events()
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    )


# -- Claude Code -----------------------------------------------------------------------------
def claude_bin() -> Path:
    return installed("claude")


def claude_env(root: Path, base_url: str, **extra: str) -> dict[str, str]:
    home = root / "home"
    for d in (home, root / "project"):
        d.mkdir(parents=True, exist_ok=True)
    env = base_env(home)
    env.update(
        {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "sk-ant-fake",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
    )
    for var in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    ):
        env[var] = "fake-model"
    env.update(extra)
    return env


def claude_argv(prompt: str) -> list[str]:
    return [
        str(claude_bin()),
        "-p",
        prompt,
        "--output-format",
        "stream-json",
        "--verbose",
        "--allowedTools",
        "Bash",
        "--no-session-persistence",
    ]


def claude_result(result: Result) -> dict[str, Any]:
    for e in result.events():
        if e.get("type") == "result":
            return e
    return {}


# -- Gemini CLI ------------------------------------------------------------------------------
GEMINI_MODEL = "gemini-2.5-flash"


def gemini_bin() -> Path:
    return installed("gemini")


def gemini_env(root: Path, base_url: str, **extra: str) -> dict[str, str]:
    """HOME, settings and environment for a headless Gemini CLI with API-key auth at
    ``base_url`` (see /work/shared/notes/agents.md): its only connection is to it."""
    home = root / "home"
    for d in (home / ".gemini", root / "project", root / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings))
    env = base_env(home)
    env.update(
        {
            "GEMINI_API_KEY": "AIza-fake-key-for-tests",
            "GOOGLE_GEMINI_BASE_URL": base_url,
            "GEMINI_CLI_HOME": str(home),
            "TMPDIR": str(root / "tmp"),
            "GEMINI_TELEMETRY_ENABLED": "false",
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
            "NO_COLOR": "1",
            # no system defaults or settings of this machine's
            "GEMINI_CLI_SYSTEM_DEFAULTS_PATH": str(root / "no-system-defaults.json"),
            "GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(root / "no-system-settings.json"),
        }
    )
    env.update(extra)
    return env


def gemini_argv(prompt: str, *, yolo: bool = False) -> list[str]:
    argv = [str(gemini_bin()), "-p", prompt, "-m", GEMINI_MODEL]
    if yolo:
        argv += ["--approval-mode", "yolo"]
    return argv
