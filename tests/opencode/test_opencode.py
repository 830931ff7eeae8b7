"""OpenCode integration without the real CLI: config discovery (JSONC, merge order),
provider placement, the relay config and OPENCODE_CONFIG_CONTENT, OpenCode's argv,
setup/undo (byte for byte, idempotent), and `unbroken run` with a stand-in binary."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from unbroken.config import parse_config
from unbroken.opencode import jsonc
from unbroken.opencode.discovery import (
    content_with_relay,
    discover,
    find_config_files,
    load_merged,
    merge,
    opencode_relay_config,
    route_name,
)
from unbroken.opencode.providers import OPENCODE_PROVIDERS
from unbroken.opencode.run import parse_opencode_args, run_opencode, server_args
from unbroken.opencode.setup import UndoResult, setup, undo


@pytest.fixture
def home(tmp_path: Path) -> dict[str, Any]:
    """A user: HOME, XDG config/data, and a git project with a subdirectory."""
    env = {
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }
    project = tmp_path / "work" / "repo"
    (project / ".git").mkdir(parents=True)
    (project / "sub").mkdir()
    (tmp_path / "config" / "opencode").mkdir(parents=True)
    return {"env": env, "project": project, "gdir": tmp_path / "config" / "opencode"}


def no_probe(url: str) -> bool:
    return False


# -- JSONC ------------------------------------------------------------------------------

COMMENTED = """{
  // providers I use
  "$schema": "https://opencode.ai/config.json", /* keep */
  "provider": {
    "fake": {
      "options": {"baseURL": "http://127.0.0.1:1/v1", "apiKey": "k",}, // trailing comma
    },
  },
  "model": "fake/m", // "not": "this"
}
"""


def test_jsonc_reads_comments_and_trailing_commas() -> None:
    assert jsonc.loads(COMMENTED) == {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"fake": {"options": {"baseURL": "http://127.0.0.1:1/v1", "apiKey": "k"}}},
        "model": "fake/m",
    }
    assert jsonc.loads('{"url": "http://x//y", "s": "/* no */"}') == {
        "url": "http://x//y",
        "s": "/* no */",
    }
    with pytest.raises(jsonc.JsoncError, match="line 2"):
        jsonc.loads('{\n  "a": }')


def test_jsonc_set_path_changes_only_what_it_must() -> None:
    replaced = jsonc.set_path(COMMENTED, ["provider", "fake", "options", "baseURL"], "http://r/f")
    assert replaced == COMMENTED.replace("http://127.0.0.1:1/v1", "http://r/f")
    added = jsonc.set_path(replaced, ["provider", "openai", "options", "baseURL"], "http://r/o")
    assert "// providers I use" in added and "/* keep */" in added and "// trailing comma" in added
    data = jsonc.loads(added)
    assert data["provider"]["openai"] == {"options": {"baseURL": "http://r/o"}}
    assert data["provider"]["fake"]["options"] == {"baseURL": "http://r/f", "apiKey": "k"}
    path = ["provider", "openai", "options", "baseURL"]
    assert jsonc.set_path(added, path, "http://r/o") == added
    assert jsonc.loads(jsonc.set_path("{}", ["a", "b"], 1)) == {"a": {"b": 1}}
    assert jsonc.loads(jsonc.set_path('{"a": 1}', ["a", "b"], 2)) == {"a": {"b": 2}}
    assert jsonc.loads(jsonc.set_path("", ["a"], 1)) == {"a": 1}


# -- discovery ------------------------------------------------------------------------------


def test_config_files_merge_global_then_project_root_most_first(home: dict[str, Any]) -> None:
    env, project, gdir = home["env"], home["project"], home["gdir"]
    (gdir / "opencode.jsonc").write_text('{"model": "g/m", // c\n "provider": {"g": {}}}')
    (project / "opencode.json").write_text('{"model": "p/m", "provider": {"p": {}}}')
    (project / "sub" / "opencode.json").write_text('{"small_model": "s/m"}')
    (project.parent / "opencode.json").write_text('{"model": "outside/m"}')  # above the repo
    files = find_config_files(project / "sub", env)
    assert files == [
        gdir / "opencode.jsonc",
        project / "opencode.json",
        project / "sub" / "opencode.json",
    ]
    merged, sources = load_merged(
        project / "sub", {**env, "OPENCODE_CONFIG_CONTENT": '{"provider": {"c": {}}}'}
    )
    assert merged["model"] == "p/m" and merged["small_model"] == "s/m"
    assert set(merged["provider"]) == {"g", "p", "c"}
    assert sources[-1].label == "OPENCODE_CONFIG_CONTENT"


def test_merge_is_deep() -> None:
    base = {"provider": {"a": {"options": {"apiKey": "k", "baseURL": "u"}}}, "x": [1]}
    over = {"provider": {"a": {"options": {"baseURL": "v"}}}, "x": [2]}
    assert merge(base, over) == {
        "provider": {"a": {"options": {"apiKey": "k", "baseURL": "v"}}},
        "x": [2],
    }


def test_discover_finds_every_provider_in_use_with_its_real_base_url(home: dict[str, Any]) -> None:
    env = {**home["env"], "ANTHROPIC_API_KEY": "sk-ant", "MY_URL": "http://10.0.0.5:8000/v1"}
    data = Path(env["XDG_DATA_HOME"]) / "opencode"
    data.mkdir(parents=True)
    (data / "auth.json").write_text(
        json.dumps(
            {
                "openrouter": {"type": "api", "key": "sk-or"},
                "github-copilot": {"type": "oauth", "refresh": "r"},
            }
        )
    )
    config = {
        "model": "deepseek/deepseek-chat",
        "agent": {"review": {"model": "groq/llama"}},
        "provider": {
            "local": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "{env:MY_URL}"}},
            "custom": {"npm": "@ai-sdk/openai-compatible", "api": "https://llm.example.com/v1/"},
            "nourl": {"npm": "@ai-sdk/openai-compatible"},
            "bedrock": {"npm": "@ai-sdk/amazon-bedrock"},
            "mistral": {"options": {"apiKey": "{env:MISTRAL_KEY}"}},
            "off": {"options": {"baseURL": "https://off.example.com"}},
        },
        "disabled_providers": ["off"],
    }
    found = {p.id: p for p in discover(config, env, model_arg="openai/gpt-5", probe=no_probe)}
    assert found["local"].url == "http://10.0.0.5:8000/v1"
    assert found["custom"].url == "https://llm.example.com/v1"
    assert found["mistral"].url == "https://api.mistral.ai/v1"
    assert found["deepseek"].url == "https://api.deepseek.com"
    assert found["groq"].url == "https://api.groq.com/openai/v1"
    assert found["openai"].url == "https://api.openai.com/v1"
    assert found["anthropic"].url == "https://api.anthropic.com/v1"
    assert found["openrouter"].url == "https://openrouter.ai/api/v1"
    assert found["nourl"].url is None and "no baseURL" in found["nourl"].problem
    assert found["bedrock"].url is None and "signed" in found["bedrock"].problem
    assert found["github-copilot"].url is None
    assert "off" not in found
    assert {p.why for p in found.values()} >= {"config", "model", "env", "auth"}


def test_discover_leaves_alone_what_already_goes_through_unbroken() -> None:
    config = {"provider": {"fake": {"options": {"baseURL": "http://127.0.0.1:4780/fake"}}}}
    [p] = discover(config, {}, probe=lambda url: True)
    assert p.url is None and "already goes through unbroken" in p.problem
    [p] = discover(config, {}, probe=no_probe)
    assert p.url == "http://127.0.0.1:4780/fake"


def test_openai_with_a_chatgpt_login_cannot_be_placed(home: dict[str, Any]) -> None:
    data = Path(home["env"]["XDG_DATA_HOME"]) / "opencode"
    data.mkdir(parents=True)
    (data / "auth.json").write_text('{"openai": {"type": "oauth"}}')
    [p] = discover({}, home["env"], probe=no_probe)
    assert p.id == "openai" and p.url is None


def test_builtin_table_is_sane() -> None:
    assert len(OPENCODE_PROVIDERS) > 150
    for pid, (url, env_vars) in OPENCODE_PROVIDERS.items():
        assert url.startswith(("http://", "https://", "${")) and not url.endswith("/"), pid
        assert env_vars and all(v == v.upper() for v in env_vars), pid


def test_relay_config_has_one_route_per_placed_provider() -> None:
    base = parse_config({"routes": {"openai": {"upstreams": ["https://my-gateway/v1"]}}}, env={})
    providers = discover(
        {
            "provider": {
                "fake": {"options": {"baseURL": "http://127.0.0.1:9/v1"}},
                "_odd/id": {"options": {"baseURL": "https://odd.example.com"}},
            }
        },
        {"OPENAI_API_KEY": "k"},
        probe=no_probe,
    )
    config, names = opencode_relay_config(base, providers)
    assert config.host == "127.0.0.1" and config.port == 0
    assert names == {"fake": "fake", "_odd/id": "odd-id", "openai": "openai"}
    assert config.routes["fake"].upstreams[0].url == "http://127.0.0.1:9/v1"
    assert config.routes["openai"].upstreams[0].url == "https://api.openai.com/v1"
    assert route_name("a", {"a"}) == "a-2"
    # one route_name for every launcher: a provider named like a relay endpoint
    # gets a route of its own, never the endpoint
    assert route_name("status", set()) == "status-provider"
    assert route_name("_x~y", set()) == "x-y"  # a valid [routes.<name>]: no _ first, no ~


def test_relay_config_keeps_the_users_route_settings() -> None:
    """``unbroken run -- opencode`` points the route at OpenCode's own base URL, but a
    user's ``[routes.NAME] after_commit`` / ``chat_prefix`` for that provider still apply
    (they were dropped: the per-route override of issue 23 did nothing under ``run``)."""
    base = parse_config(
        {
            "stream": {"after_commit": "error"},
            "routes": {
                "openai": {"upstreams": ["https://my-gateway/v1"], "after_commit": "continue"},
                "deepseek": {"upstreams": ["https://api.deepseek.com"], "chat_prefix": "prefix"},
            },
        },
        env={},
    )
    providers = discover(
        {"provider": {"fake": {"options": {"baseURL": "http://127.0.0.1:9/v1"}}}},
        {"OPENAI_API_KEY": "k", "DEEPSEEK_API_KEY": "k"},
        probe=no_probe,
    )
    config, names = opencode_relay_config(base, providers)
    openai, deepseek = config.routes[names["openai"]], config.routes[names["deepseek"]]
    assert openai.upstreams[0].url == "https://api.openai.com/v1"  # OpenCode's URL wins
    assert config.stream.after_commit_for(openai) == "continue"
    assert deepseek.chat_prefix == "prefix"
    assert config.stream.after_commit_for(config.routes[names["fake"]]) == "error"
    assert not openai.builtin


def test_config_content_merges_with_the_users_own() -> None:
    existing = '{"provider": {"fake": {"options": {"apiKey": "k"}}}, "model": "fake/m"}'
    content = json.loads(content_with_relay(existing, {"fake": "http://127.0.0.1:5/fake"}))
    assert content == {
        "provider": {"fake": {"options": {"apiKey": "k", "baseURL": "http://127.0.0.1:5/fake"}}},
        "model": "fake/m",
    }


# -- OpenCode's argv ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "sub", "project", "model", "port"),
    [
        ([], None, None, None, None),
        (["./proj", "-m", "openai/gpt-5"], None, "./proj", "openai/gpt-5", None),
        (["--model=a/b", "run", "say", "hi"], "run", None, "a/b", None),
        (["--log-level", "WARN", "serve", "--port", "4096"], "serve", None, None, 4096),
        (["-m", "serve/x", "run"], "run", None, "serve/x", None),  # a value is not a command
    ],
)
def test_parse_opencode_args(
    argv: list[str], sub: str | None, project: str | None, model: str | None, port: int | None
) -> None:
    parsed = parse_opencode_args(argv)
    assert (parsed.subcommand, parsed.project, parsed.model, parsed.port) == (
        sub,
        project,
        model,
        port,
    )


def test_server_args_expose_the_server_for_resume() -> None:
    args, url, _ = server_args([], parse_opencode_args([]))  # the TUI: gets a --port
    assert args[0] == "--port" and url == f"http://127.0.0.1:{args[1]}"
    args, url, _ = server_args(
        ["serve", "--port", "4096"], parse_opencode_args(["serve", "--port", "4096"])
    )
    assert args == ["serve", "--port", "4096"] and url == "http://127.0.0.1:4096"
    argv = ["web", "--hostname", "0.0.0.0"]
    args, url, _ = server_args(argv, parse_opencode_args(argv))
    assert "--port" in args and url is not None and url.startswith("http://127.0.0.1:")
    argv = ["serve", "--port", "0", "--print-logs"]
    args, url, _ = server_args(argv, parse_opencode_args(argv))
    assert args[:2] == ["serve", "--port"] and args[2] != "0" and args[3] == "--print-logs"
    assert url == f"http://127.0.0.1:{args[2]}"
    args, url, why = server_args(["run", "hi"], parse_opencode_args(["run", "hi"]))
    assert args == ["run", "hi"] and url is None and "no server" in why


# -- setup / undo -----------------------------------------------------------------------------


ROUTES = parse_config({"routes": {"fake": {"upstreams": ["http://127.0.0.1:9/v1"]}}}, env={}).routes
RELAY = "http://127.0.0.1:4780"


def test_setup_patches_keeps_a_backup_is_idempotent_and_undo_restores_bytes(
    home: dict[str, Any],
) -> None:
    env, project = {**home["env"], "OPENAI_API_KEY": "sk"}, home["project"]
    path = project / "opencode.json"
    original = (
        COMMENTED.replace("http://127.0.0.1:1/v1", "http://127.0.0.1:9/v1").replace("\n", "\r\n")
    ).encode()  # CRLF and comments must survive undo
    path.write_bytes(original)
    first = setup("project", relay_url=RELAY, routes=ROUTES, project=project, env=env)
    assert first.changed and first.path == path
    assert first.routed == {"fake": f"{RELAY}/fake", "openai": f"{RELAY}/openai/v1"}
    patched = path.read_bytes()
    assert b"// providers I use" in patched
    data = jsonc.loads(patched.decode())
    assert data["provider"]["fake"]["options"] == {"baseURL": f"{RELAY}/fake", "apiKey": "k"}
    assert (project / "opencode.json.unbroken-backup").read_bytes() == original

    second = setup("project", relay_url=RELAY, routes=ROUTES, project=project, env=env)
    assert not second.changed and sorted(second.already) == ["fake", "openai"]
    assert path.read_bytes() == patched
    assert (project / "opencode.json.unbroken-backup").read_bytes() == original

    done = undo("project", project=project, env=env)
    assert done == UndoResult(path, "restored")
    assert done.lines() == [
        f"restored {path} from opencode.json.unbroken-backup, the copy setup kept"
    ]
    assert path.read_bytes() == original
    assert not (project / "opencode.json.unbroken-backup").exists()
    again = undo("project", project=project, env=env)
    assert again == UndoResult(path, "nothing")
    assert again.lines() == [
        f"{path}: nothing to undo (no opencode.json.unbroken-backup or "
        "opencode.json.unbroken-created next to it)"
    ]


def test_setup_creates_a_missing_global_file_and_undo_removes_it(home: dict[str, Any]) -> None:
    env = {**home["env"], "ANTHROPIC_API_KEY": "sk"}
    result = setup(
        "global",
        relay_url=RELAY,
        routes=parse_config({}, env={}).routes,
        project=home["project"],
        env=env,
    )
    path = home["gdir"] / "opencode.json"
    assert result.changed and result.path == path
    assert jsonc.loads(path.read_text())["provider"]["anthropic"]["options"]["baseURL"] == (
        f"{RELAY}/anthropic/v1"  # the built-in route to https://api.anthropic.com
    )
    done = undo("global", project=home["project"], env=env)
    assert done == UndoResult(path, "removed")  # the directory existed before setup
    assert done.lines() == [f"removed {path}, which setup had created"]
    assert not path.exists() and home["gdir"].is_dir()


@pytest.mark.parametrize("left_behind", [False, True])
def test_undo_removes_the_directory_setup_created_once_it_is_empty_again(
    home: dict[str, Any], tmp_path: Path, left_behind: bool
) -> None:
    xdg = tmp_path / "fresh-config"  # neither it nor its opencode/ exist yet
    env = {**home["env"], "XDG_CONFIG_HOME": str(xdg), "ANTHROPIC_API_KEY": "sk"}
    routes = parse_config({}, env={}).routes
    result = setup("global", relay_url=RELAY, routes=routes, project=home["project"], env=env)
    path = xdg / "opencode" / "opencode.json"
    assert result.changed and result.path == path
    if left_behind:
        (xdg / "opencode" / "notes.txt").write_text("mine")  # the user put a file there
    done = undo("global", project=home["project"], env=env)
    assert not path.exists()
    if left_behind:
        assert done == UndoResult(path, "removed")
        assert (xdg / "opencode" / "notes.txt").read_text() == "mine"
        assert sorted(p.name for p in (xdg / "opencode").iterdir()) == ["notes.txt"]
    else:
        assert done == UndoResult(path, "removed", (xdg / "opencode", xdg))
        assert done.lines() == [
            f"removed {path}, which setup had created",
            f"removed the directory {xdg / 'opencode'}, which setup had created and which "
            "is empty again",
            f"removed the directory {xdg}, which setup had created and which is empty again",
        ]
        assert not xdg.exists() and tmp_path.is_dir()


def test_bare_opencode_command_prints_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main

    assert main(["opencode"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: unbroken opencode [-h] {setup,undo}")
    assert "setup" in err and "undo" in err and "opencode_command" not in err


def test_setup_names_providers_no_route_reaches(home: dict[str, Any]) -> None:
    project = home["project"]
    (project / "opencode.json").write_text(
        '{"provider": {"local": {"options": {"baseURL": "http://10.1.1.1:8000/v1"}}}}'
    )
    result = setup("project", relay_url=RELAY, routes=ROUTES, project=project, env=home["env"])
    assert not result.changed and result.routed == {}
    assert [p.id for p in result.missing] == ["local"]
    assert "no route" in result.missing[0].problem


def test_setup_cli_prints_what_it_did(
    home: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from unbroken.cli import main

    project = home["project"]
    (project / "opencode.json").write_text(
        '{"provider": {"local": {"options": {"baseURL": "http://10.1.1.1:8000/v1"}}}}'
    )
    for k, v in home["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("UNBROKEN_CONFIG", raising=False)
    monkeypatch.chdir(project)
    monkeypatch.setenv("PWD", str(project))
    assert main(["opencode", "setup", "--project", "--relay", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert "local: left alone" in out and "[routes.local]" in out
    assert 'url = "http://10.1.1.1:8000/v1"' in out
    assert "no unbroken relay answers" in out
    assert main(["opencode", "undo", "--project"]) == 1


# -- unbroken run, with a stand-in for the OpenCode binary -------------------------------------

STAND_IN = r'''#!{python}
"""Behaves like `opencode run`: one chat turn to provider "fake", then exits 3."""
import json, os, sys, urllib.request
content = json.loads(os.environ["OPENCODE_CONFIG_CONTENT"])
base = content["provider"]["fake"]["options"]["baseURL"]
body = json.dumps({{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
req = urllib.request.Request(base + "/chat/completions", data=body,
                             headers={{"content-type": "application/json",
                                      "authorization": "Bearer sk-user"}})
answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
print(answer["choices"][0]["message"]["content"])
print("argv:", json.dumps(sys.argv[1:]))
print("pwd:", os.environ.get("PWD"))
sys.exit(3)
'''


async def test_run_relays_the_providers_and_returns_opencodes_exit_code(
    mock: Any, home: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    stand_in = tmp_path / "bin" / "opencode"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    project = home["project"]
    (home["gdir"] / "opencode.json").write_text(
        json.dumps(
            {
                "provider": {
                    "fake": {
                        "npm": "@ai-sdk/openai-compatible",
                        "options": {"baseURL": f"{mock.url}/v1", "apiKey": "sk-user"},
                    }
                }
            }
        )
    )
    mock.script([{"status": 503}, {"fault": "reset", "after_frame": 0}])
    urls: list[str] = []
    env = {**home["env"], "PATH": os.environ.get("PATH", "")}
    base = parse_config({"retry": {"delay_ms": 5}}, env={})
    code = await run_opencode(
        [str(stand_in), "run", "hi"], base=base, env=env, cwd=project, ready=urls.append
    )
    assert code == 3
    out = capfd.readouterr().out
    assert "Hello from the mock provider." in out
    assert 'argv: ["run", "hi"]' in out  # `opencode run` exposes no server: no --port added
    assert f"pwd: {project}" in out
    assert len(mock.requests) == 3  # the relay absorbed a 503 and a reset
    assert all(r.path == "/v1/chat/completions" for r in mock.requests)
    assert mock.requests[-1].headers["authorization"] == "Bearer sk-user"  # the user's key
    port = int(urls[0].rsplit(":", 1)[1])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # the relay stopped with OpenCode


def test_run_sends_other_commands_to_the_agents_launcher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from unbroken.cli import main

    # any other command is unbroken.agents' (tests/agents): here only its dry run
    assert main(["run", "--print-env", "--", "python3", "-c", "pass"]) == 0
    assert "export OPENAI_BASE_URL=" in capsys.readouterr().out
    assert main(["run"]) == 2


def test_print_env_for_opencode_prints_the_config_that_points_it_at_serve(
    home: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run --print-env -- opencode`` printed one comment; it prints what OpenCode
    needs: OPENCODE_CONFIG_CONTENT with each provider in use pointed at the relay's
    route to its real URL (and the route to add for one the relay lacks)."""
    from unbroken.cli import main

    (home["gdir"] / "opencode.json").write_text(COMMENTED.replace("1/v1", "9/v1"))
    for key, value in {**home["env"], "ANTHROPIC_API_KEY": "sk"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OPENCODE_CONFIG_CONTENT", raising=False)
    monkeypatch.delenv("UNBROKEN_CONFIG", raising=False)
    monkeypatch.chdir(home["project"])
    assert main(["run", "--print-env", "--", "opencode", "-m", "anthropic/claude"]) == 0
    out = capsys.readouterr().out
    (export,) = [line for line in out.splitlines() if line.startswith("export ")]
    name, _, value = export.removeprefix("export ").partition("=")
    assert name == "OPENCODE_CONFIG_CONTENT"
    content = json.loads(shlex.split(value)[0])
    relay = "http://127.0.0.1:4780"
    assert content["provider"]["anthropic"]["options"]["baseURL"] == f"{relay}/anthropic/v1"
    assert content["provider"]["fake"]["options"]["baseURL"] == f"{relay}/fake"
    assert '#   upstreams = [{ url = "http://127.0.0.1:9/v1" }]' in out  # no route yet
    assert "opencode -m anthropic/claude" in out
    assert "unbroken opencode setup" in out


# -- unbroken run when OpenCode exits: the resumer shuts down cleanly ---------------------------

DYING_SERVER = r'''#!{python}
"""Behaves like an `opencode serve` that quits: {how}."""
import socket, sys, time
if {at_once}:
    sys.exit(4)
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
server = socket.create_server(("127.0.0.1", port))
while True:
    conn, _ = server.accept()
    request = conn.recv(65536).decode(errors="replace")
    path = request.split(" ")[1] if request.count(" ") >= 2 else ""
    if path == "/event":
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                     b'data: {{"type":"server.connected","properties":{{}}}}\n\n')
        conn.close()  # the stream ends; a reconnect is queued, never answered,
        time.sleep(1.5)  # while OpenCode takes its time to exit
        server.close()
        sys.exit(4)
    body = b'{{"healthy":true}}' if path == "/global/health" else b""
    status = b"200 OK" if body else b"404 Not Found"
    conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
    conn.close()
'''


@pytest.mark.parametrize("at_once", [True, False], ids=["at-once", "after-serving"])
async def test_the_resumer_shuts_down_cleanly_when_opencode_exits(
    home: dict[str, Any], tmp_path: Path, at_once: bool
) -> None:
    fake = tmp_path / "bin" / "opencode"
    fake.parent.mkdir()
    how = "it exits at once" if at_once else "it ends /event, stops answering, then exits"
    fake.write_text(DYING_SERVER.format(python=sys.executable, how=how, at_once=at_once))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "run.log"
    env = {
        **home["env"],
        "PATH": os.environ.get("PATH", ""),
        "UNBROKEN_RESUME_DELAY_MS": "10",
        "PYTHONDEVMODE": "1",
    }  # dev mode: unclosed resources are reported too
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "run",
        "--log",
        str(log),
        "--",
        str(fake),
        "serve",
        cwd=str(home["project"]),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = log.read_text()
    assert proc.returncode == 4, (out, err, text)  # OpenCode's exit code
    if not at_once:
        assert "resume: watching http://127.0.0.1:" in text, text
    everything = text + out.decode() + err.decode()
    for sign in (
        "Traceback",
        "Task exception was never retrieved",
        "Unclosed",
        "was never awaited",
        "Task was destroyed",
    ):
        assert sign not in everything, everything


def test_undo_removes_only_directories_above_the_file(home: dict[str, Any], tmp_path: Path) -> None:
    """The created-marker names directories; undo removes none but the file's own parents."""
    path = home["project"] / "opencode.json"
    path.write_text("{}")
    elsewhere = tmp_path / "unrelated-empty-dir"
    elsewhere.mkdir()
    marker = home["project"] / "opencode.json.unbroken-created"
    marker.write_text(json.dumps({"created_dirs": [str(elsewhere)]}))
    done = undo("project", project=home["project"], env=home["env"])
    assert done == UndoResult(path, "removed")
    assert elsewhere.is_dir() and not path.exists() and not marker.exists()
