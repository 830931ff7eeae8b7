"""`unbroken run -- gemini`: the plan (routes, environment, the auth choice kept), its
``--print-env``, and a real run of a stand-in ``gemini`` executable through the
private relay to the mock (the real Gemini CLI: tests/e2e/test_gemini_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from unbroken.agents import gemini_cli
from unbroken.agents.launcher import agent_of, print_env
from unbroken.agents.plan import FILES, RELAY
from unbroken.config import parse_config


@pytest.mark.parametrize(
    ("argv0", "agent"),
    [("gemini", "gemini"), ("/x/node_modules/.bin/gemini", "gemini"), ("gemini-cli", "gemini")],
)
def test_agent_of(argv0: str, agent: str) -> None:
    assert agent_of([argv0]) == agent


def no_defaults(tmp_path: Path) -> dict[str, str]:
    return {"GEMINI_CLI_SYSTEM_DEFAULTS_PATH": str(tmp_path / "absent.json")}


def test_the_default_upstream_and_the_api_key_choice_kept(tmp_path: Path) -> None:
    launch = gemini_cli.plan({**no_defaults(tmp_path), "GEMINI_API_KEY": "k"})
    assert launch.routes == {"gemini": "https://generativelanguage.googleapis.com"}
    assert launch.env == {
        "GOOGLE_GEMINI_BASE_URL": f"{RELAY}/gemini",
        "GEMINI_CLI_SYSTEM_DEFAULTS_PATH": f"{FILES}/{gemini_cli.SYSTEM_DEFAULTS}",
    }
    settings = json.loads(launch.files[gemini_cli.SYSTEM_DEFAULTS])
    assert settings == {"security": {"auth": {"selectedType": "gemini-api-key"}}}
    assert launch.resolved_env("http://R", "/run")["GOOGLE_GEMINI_BASE_URL"] == "http://R/gemini"


def test_the_users_system_defaults_are_kept_and_their_choice_wins(tmp_path: Path) -> None:
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps({"ui": {"theme": "x"}, "security": {"folderTrust": {}}}))
    env = {"GEMINI_CLI_SYSTEM_DEFAULTS_PATH": str(path), "GEMINI_API_KEY": "k"}
    settings = json.loads(gemini_cli.plan(env).files[gemini_cli.SYSTEM_DEFAULTS])
    assert settings == {
        "ui": {"theme": "x"},
        "security": {"folderTrust": {}, "auth": {"selectedType": "gemini-api-key"}},
    }
    path.write_text(json.dumps({"security": {"auth": {"selectedType": "vertex-ai"}}}))
    launch = gemini_cli.plan(env)
    assert not launch.files and "GEMINI_CLI_SYSTEM_DEFAULTS_PATH" not in launch.env
    path.write_text("{not json")
    launch = gemini_cli.plan(env)
    assert not launch.files and any("not JSON" in n for n in launch.notes)


def test_the_users_own_base_url_is_the_upstream_and_their_gateway_choice(tmp_path: Path) -> None:
    env = {
        **no_defaults(tmp_path),
        "GOOGLE_GEMINI_BASE_URL": "https://gw.example.com/g/",
        "GEMINI_API_KEY": "k",
    }
    launch = gemini_cli.plan(env)
    assert launch.routes == {"gemini": "https://gw.example.com/g"}
    assert not launch.files  # a base URL of their own: the gateway is their choice
    assert any("your GOOGLE_GEMINI_BASE_URL" in n for n in launch.notes)
    bad = gemini_cli.plan({"GOOGLE_GEMINI_BASE_URL": "ftp://x"})
    assert not bad.routes and not bad.env


def test_vertex_and_google_login(tmp_path: Path) -> None:
    env = {
        **no_defaults(tmp_path),
        "GOOGLE_GENAI_USE_VERTEXAI": "true",
        "GOOGLE_CLOUD_PROJECT": "p",
        "GOOGLE_CLOUD_LOCATION": "us-central1",
    }
    launch = gemini_cli.plan(env)
    assert launch.routes["vertex"] == "https://us-central1-aiplatform.googleapis.com"
    assert launch.env["GOOGLE_VERTEX_BASE_URL"] == f"{RELAY}/vertex"
    assert json.loads(launch.files[gemini_cli.SYSTEM_DEFAULTS])["security"]["auth"] == {
        "selectedType": "vertex-ai"
    }
    express = gemini_cli.plan(
        {**no_defaults(tmp_path), "GOOGLE_GENAI_USE_VERTEXAI": "true", "GOOGLE_API_KEY": "k"}
    )
    assert express.routes["vertex"] == "https://aiplatform.googleapis.com"
    login = gemini_cli.plan({**no_defaults(tmp_path), "GOOGLE_GENAI_USE_GCA": "true"})
    assert "vertex" not in login.routes and any("Code Assist" in n for n in login.notes)


def test_print_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = parse_config({"server": {"port": 4999}}, env={})
    print_env(["gemini", "-p", "hi"], base, {**no_defaults(tmp_path), "GEMINI_API_KEY": "k"})
    out = capsys.readouterr().out
    assert "export GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:4999/gemini" in out
    assert "[routes." not in out  # the built-in gemini route fits as it is
    assert '#       "auth": {' in out and '"selectedType": "gemini-api-key"' in out
    assert "GEMINI_CLI_SYSTEM_DEFAULTS_PATH at a private file" in out
    assert "export GEMINI_CLI_SYSTEM_DEFAULTS_PATH" not in out


STAND_IN = """#!{python}
import json, os, sys, urllib.request
base = os.environ["GOOGLE_GEMINI_BASE_URL"]
path = os.environ.get("GEMINI_CLI_SYSTEM_DEFAULTS_PATH", "")
auth = json.load(open(path))["security"]["auth"]["selectedType"] if os.path.isfile(path) else "-"
text = "-"
if os.environ.get("STAND_IN_REQUEST"):
    req = urllib.request.Request(
        base + "/v1beta/models/gemini-2.5-flash:generateContent",
        data=json.dumps({{"contents": [{{"parts": [{{"text": "hi"}}]}}]}}).encode(),
        headers={{"content-type": "application/json",
                 "x-goog-api-key": os.environ["GEMINI_API_KEY"]}},
    )
    reply = json.load(urllib.request.urlopen(req))
    text = reply["candidates"][0]["content"]["parts"][0]["text"]
print(text)
print(auth)
print(path or "-")
print(base)
sys.exit(4)
"""


async def run_stand_in(tmp_path: Path, **extra: str) -> list[str]:
    exe = tmp_path / "bin" / "gemini"
    if not exe.exists():
        exe.parent.mkdir()
        exe.write_text(STAND_IN.format(python=sys.executable))
        exe.chmod(0o755)
        (tmp_path / "u.toml").write_text("[retry]\ndelay_ms = 10\n[journal]\nenabled = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update(GEMINI_API_KEY="AIza-test", GEMINI_CLI_SYSTEM_DEFAULTS_PATH=str(tmp_path / "no"))
    env.update(extra)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "run",
        "--config",
        str(tmp_path / "u.toml"),
        "--",
        str(exe),
        "-p",
        "hi",
        env=env,
        cwd=str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 4, err.decode()
    return out.decode().splitlines()


async def test_unbroken_run_keeps_the_auth_choice_in_a_private_file(tmp_path: Path) -> None:
    text, auth, path, base = await run_stand_in(tmp_path)
    assert (text, auth) == ("-", "gemini-api-key")
    assert base.startswith("http://127.0.0.1:") and base.endswith("/gemini")
    assert path.endswith("/gemini-system-defaults.json")
    assert not await asyncio.to_thread(os.path.exists, path)  # it went with the run


async def test_unbroken_run_relays_to_the_users_base_url(tmp_path: Path, mock) -> None:  # type: ignore[no-untyped-def]
    mock.script([{"status": 503, "count": 3}])
    text, auth, path, base = await run_stand_in(
        tmp_path, GOOGLE_GEMINI_BASE_URL=mock.url, STAND_IN_REQUEST="1"
    )
    assert text == "Hello from the mock provider." and base.endswith("/gemini")
    assert path.endswith("/no") and auth == "-"  # their gateway: their choice, untouched
    assert len(mock.requests) == 4
    assert mock.requests[-1].headers["x-goog-api-key"] == "AIza-test"
