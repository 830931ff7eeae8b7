"""`unbroken run -- codex|claude|<command>`: the plans (routes, environment, arguments)
and a real run of a Python script using the openai SDK through the private relay."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import textwrap
from pathlib import Path

import pytest

from turnfix import Report
from unbroken.agents import claude, codex
from unbroken.agents.launcher import agent_of, generic_plan, plan_for, print_env, relay_config
from unbroken.agents.plan import RELAY, route_name, split_version
from unbroken.cli import main
from unbroken.config import StreamSettings, parse_config
from unbroken.core.admission.policy import RetryPolicy, RetryState
from unbroken.core.profiles import Profile, profile_named
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import Open, TurnMachine
from unbroken.core.wire.protocols import RESPONSES
from unbroken.mock import MockProvider


@pytest.mark.parametrize(
    ("argv0", "agent"),
    [
        ("codex", "codex"),
        ("/usr/local/bin/codex", "codex"),
        ("claude", "claude"),
        ("/x/node_modules/.bin/claude", "claude"),
        ("python", "generic"),
        ("aider", "generic"),
    ],
)
def test_agent_of(argv0: str, agent: str) -> None:
    assert agent_of([argv0]) == agent


def test_codex_plan_relays_every_provider(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        textwrap.dedent("""
        model_provider = "fake"
        openai_base_url = "https://gw.example.com/openai/v1"
        [model_providers.fake]
        base_url = "http://127.0.0.1:9/v1"
        supports_websockets = true
        stream_idle_timeout_ms = 3000
        [model_providers."my provider"]
        base_url = "https://other.example.com/api"
        [model_providers.nourl]
        name = "x"
    """)
    )
    launch = codex.plan({"CODEX_HOME": str(tmp_path)})
    assert launch.routes == {
        "openai": "https://gw.example.com/openai",
        "fake": "http://127.0.0.1:9",
        "my-provider": "https://other.example.com/api",
    }
    assert launch.resolved_args("http://R") == [
        "-c",
        'openai_base_url="http://R/openai/v1"',
        "-c",
        'model_providers.fake.base_url="http://R/fake/v1"',
        "-c",
        'model_providers.my provider.base_url="http://R/my-provider"',
    ]
    # a keepalive three times per idle timeout; the relay's stall timers follow it
    assert launch.clients == {"codex": {"keepalive_s": 1.0, "client_idle_timeout_s": 3.0}}
    assert any("nourl" in n for n in launch.notes)
    assert launch.env == {}  # Codex 0.169 ignores OPENAI_BASE_URL: only -c


def test_codex_plan_without_a_config_relays_openai(tmp_path: Path) -> None:
    launch = codex.plan({"CODEX_HOME": str(tmp_path / "none")})
    assert launch.routes == {"openai": "https://api.openai.com"}
    assert launch.clients == {}
    (tmp_path / "config.toml").write_text("not = [toml")
    bad = codex.plan({"CODEX_HOME": str(tmp_path)})
    assert bad.routes == {"openai": "https://api.openai.com"} and "not valid TOML" in bad.notes[0]


def test_claude_plan_uses_the_users_base_url() -> None:
    assert claude.plan({}).routes == {"anthropic": "https://api.anthropic.com"}
    launch = claude.plan(
        {
            "ANTHROPIC_BASE_URL": "https://gw.example.com/anthropic/",
            "ANTHROPIC_API_KEY": "k",
            "ANTHROPIC_AUTH_TOKEN": "t",
        }
    )
    assert launch.routes == {"anthropic": "https://gw.example.com/anthropic"}
    assert launch.resolved_env("http://R") == {"ANTHROPIC_BASE_URL": "http://R/anthropic"}


def test_claude_plan_reads_its_nonstreamed_timeout() -> None:
    """API_TIMEOUT_MS is how long Claude Code waits for a non-streamed answer: the relay's
    claude-code profile is told, and waits as long."""
    launch = claude.plan({"API_TIMEOUT_MS": "600000"})
    assert launch.clients == {"claude-code": {"client_nonstream_wait_s": 600.0}}
    cfg = relay_config(parse_config({}, env={}), launch)
    profile = profile_named("claude-code", cfg.clients)
    assert _machine(profile, stream=False).start(0.0) == Open(0, 600.0)
    for raw in ("", "soon", "0", "-5"):
        assert claude.plan({"API_TIMEOUT_MS": raw}).clients == {}
    assert claude.plan({}).clients == {}


def test_the_private_relay_stalls_no_later_than_codex(tmp_path: Path) -> None:
    """Codex with stream_idle_timeout_ms = 20000 gets no early headers, so its idle timer
    never runs while the relay waits: the relay's first-frame and idle timeouts (300 s and
    120 s by default) come down to Codex's 20 s.  The user's own [clients.codex] stall
    timers still win."""
    (tmp_path / "config.toml").write_text(
        'model_provider = "fake"\n[model_providers.fake]\nbase_url = "http://127.0.0.1:9/v1"\n'
        "stream_idle_timeout_ms = 20000\n"
    )
    launch = codex.plan({"CODEX_HOME": str(tmp_path)})
    cfg = relay_config(parse_config({}, env={}), launch)
    m = _machine(profile_named("codex", cfg.clients))
    assert (m.timers.first_frame_timeout_s, m.timers.idle_timeout_s) == (20.0, 20.0)
    own = parse_config({"clients": {"codex": {"idle_timeout_s": 60}}}, env={})
    m = _machine(profile_named("codex", relay_config(own, launch).clients))
    assert (m.timers.first_frame_timeout_s, m.timers.idle_timeout_s) == (20.0, 60.0)
    # Codex's default idle timeout (300 s): nothing to tell the relay
    (tmp_path / "config.toml").write_text(
        'model_provider = "fake"\n[model_providers.fake]\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    assert codex.plan({"CODEX_HOME": str(tmp_path)}).clients == {}


def _machine(profile: Profile, *, stream: bool = True) -> TurnMachine:
    return TurnMachine(
        protocol=RESPONSES,
        hold=Hold(),
        timers=StreamSettings(),
        retry=RetryState(RetryPolicy(), 1, rng=random.Random(0)),
        stream=stream,
        now=0.0,
        report=Report(),
        profile=profile,
    )


def test_generic_plan_sets_the_sdk_variables() -> None:
    launch = generic_plan({"OPENAI_BASE_URL": "http://127.0.0.1:5/v1"})
    assert launch.routes == {
        "openai": "http://127.0.0.1:5",
        "anthropic": "https://api.anthropic.com",
    }
    assert launch.env == {
        "OPENAI_BASE_URL": f"{RELAY}/openai/v1",
        "OPENAI_API_BASE": f"{RELAY}/openai/v1",
        "ANTHROPIC_BASE_URL": f"{RELAY}/anthropic",
    }
    assert "OPENAI_BASE_URL" in launch.notes[-1]


def test_route_names_and_versions() -> None:
    taken: set[str] = set()
    assert [route_name(n, taken) for n in ("a b", "a-b", "status", "..")] == [
        "a-b",
        "a-b-2",
        "status-provider",
        "provider",
    ]
    assert split_version("https://api.openai.com/v1/") == ("https://api.openai.com", "/v1")
    assert split_version("https://api.anthropic.com") == ("https://api.anthropic.com", "")


def test_relay_config_user_clients_win(tmp_path: Path) -> None:
    base = parse_config({"clients": {"codex": {"keepalive_s": 5}}}, env={})
    launch = plan_for(["codex"], {"CODEX_HOME": str(tmp_path)})
    tuned = {"codex": {"keepalive_s": 1.0, "early_headers": False}}
    launch = type(launch)(launch.agent, routes=launch.routes, clients=tuned)
    cfg = relay_config(base, launch)
    assert cfg.clients["codex"] == {"keepalive_s": 5.0, "early_headers": False}
    assert cfg.port == 0 and cfg.host == "127.0.0.1"
    assert cfg.routes["openai"].upstreams[0].url == "https://api.openai.com"


def test_relay_config_keeps_the_users_route_settings(tmp_path: Path) -> None:
    """``unbroken run -- codex`` points the route at Codex's own base URL, but the user's
    ``[routes.openai] after_commit`` still applies (it was dropped)."""
    base = parse_config(
        {"routes": {"openai": {"upstreams": ["https://gw/v1"], "after_commit": "continue"}}},
        env={},
    )
    cfg = relay_config(base, plan_for(["codex"], {"CODEX_HOME": str(tmp_path)}))
    route = cfg.routes["openai"]
    assert route.upstreams[0].url == "https://api.openai.com"
    assert cfg.stream.after_commit_for(route) == "continue"


def test_print_env_for_claude_and_generic(capsys: pytest.CaptureFixture[str]) -> None:
    base = parse_config({"server": {"port": 4999}}, env={})
    print_env(["claude", "-p", "hi"], base, {})
    out = capsys.readouterr().out
    assert "export ANTHROPIC_BASE_URL=http://127.0.0.1:4999/anthropic" in out
    assert "[routes." not in out  # the built-in anthropic route fits as it is
    print_env(["python", "x.py"], base, {})
    out = capsys.readouterr().out
    assert "export OPENAI_BASE_URL=http://127.0.0.1:4999/openai/v1" in out


def test_run_without_a_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run"]) == 2
    assert "codex|claude" in capsys.readouterr().err


SCRIPT = """
import os, sys
from openai import OpenAI
client = OpenAI()  # OPENAI_BASE_URL from unbroken run; the key passes through
chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
print(chat.choices[0].message.content)
print(os.environ["OPENAI_BASE_URL"])
sys.exit(3)
"""


async def test_unbroken_run_a_python_script_with_the_openai_sdk(
    tmp_path: Path, mock: MockProvider
) -> None:
    """`unbroken run -- python script.py`: the openai SDK finds its base URL; a 503 storm
    is absorbed; the script's exit code comes back."""
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "u.toml").write_text(
        '[retry]\ndelay_ms = 10\nbackoff = "fixed"\n[journal]\nenabled = false\n'
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "UNBROKEN_"))
    }
    env.update(OPENAI_BASE_URL=f"{mock.url}/v1", OPENAI_API_KEY="sk-test", OPENAI_MAX_RETRIES="0")
    # a token set for `unbroken serve` must not lock the agent out of its private relay
    env["UNBROKEN_TOKEN"] = "a-token-for-serve-only-0123456789"
    mock.script([{"status": 503, "count": 5}])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "run",
        "--config",
        str(tmp_path / "u.toml"),
        "--",
        sys.executable,
        str(tmp_path / "script.py"),
        env=env,
        cwd=str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 3, err.decode()
    text, base = out.decode().splitlines()
    assert text == "Hello from the mock provider."
    assert base.startswith("http://127.0.0.1:") and base.endswith("/openai/v1")
    assert len(mock.requests) == 6
    assert mock.requests[-1].headers["authorization"] == "Bearer sk-test"
    assert "not a known agent; setting OPENAI_BASE_URL" in err.decode()
    assert json.loads(mock.requests[-1].body)["model"] == "m"
