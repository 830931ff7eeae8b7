"""Issue 25 with each agent's real binary: `unbroken run` with a config whose route
injects a key gives its private relay a random token, which that route needs, and
only the launched agent gets it: the agent works through the relay, and the token
reaches neither the provider nor the log.  Issue 33: each of these agents gets it in
an ``x-unbroken-token`` header from its environment (Claude Code's
``ANTHROPIC_CUSTOM_HEADERS``, Gemini CLI's ``GEMINI_CLI_CUSTOM_HEADERS``, a Codex
custom provider's ``env_http_headers``, an OpenCode provider's ``options.headers``),
never in its base URLs, which a process may put on a command line other users can
read; ``test_*_sends_the_header_*`` runs each binary straight at the mock
with what the plan sets and checks the header arrives.
``tests/agents/test_run_token.py`` checks that a process without the token, another
Unix user's included, gets 401.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from e2e.agent_run import (
    agent_text,
    claude_argv,
    claude_env,
    claude_result,
    codex_argv,
    codex_home,
    gemini_argv,
    gemini_env,
    run,
    through_unbroken,
)
from e2e.oc_harness import Sandbox, fake_provider, opencode_bin, run_args, run_to_end, turn_requests
from unbroken.agents import claude, codex, gemini_cli
from unbroken.agents.plan import TOKEN_NOTE, Launch, TokenWay
from unbroken.mock import MockProvider
from unbroken.opencode.discovery import content_with_relay

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TEXT = "Hello from the mock provider."
SPARE_KEY = "sk-spare-key-0123456789abcdef"
TOKEN = "tok-e2e-0123456789abcdef0123"
#: the note `unbroken run` logs when the agent gets the token in a header
IN_HEADER = "in the agent's x-unbroken-token header"


def _keyed_config(tmp_path: Path, mock: MockProvider) -> Path:
    """A user's config with a route that injects a key (not one the agent uses)."""
    cfg = tmp_path / "unbroken.toml"
    cfg.write_text(
        "[journal]\nenabled = false\n"
        f'[routes.spare]\nupstreams = [{{ url = "{mock.url}", api_key_env = "SPARE_KEY" }}]\n'
    )
    return cfg


def _check(mock: MockProvider, log: str) -> None:
    """The relay had a token (a key is injected), given to the agent in a header;
    neither the provider nor the log saw it, nor the key."""
    assert TOKEN_NOTE in log, log[-3000:]
    assert IN_HEADER in log and "in the agent's base URLs" not in log, log[-3000:]
    assert re.search(r"relay on http://127\.0\.0\.1:\d+(\s|;|$)", log), log[-3000:]
    assert "/t/" not in log and SPARE_KEY not in log
    assert mock.requests
    for req in mock.requests:
        seen = req.path + json.dumps(dict(req.headers))
        assert "/t/" not in seen and SPARE_KEY not in seen


@pytest.mark.cli("claude")
async def test_claude_code_through_a_private_relay_with_a_token(
    tmp_path: Path, mock: MockProvider
) -> None:
    env = claude_env(tmp_path, mock.url, SPARE_KEY=SPARE_KEY)
    cfg = _keyed_config(tmp_path, mock)
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    result = claude_result(r)
    assert result.get("result") == TEXT and not result.get("is_error")
    assert [q.path for q in mock.requests] == ["/v1/messages"]
    _check(mock, r.stderr)


@pytest.mark.cli("codex")
async def test_codex_through_a_private_relay_with_a_token(
    tmp_path: Path, mock: MockProvider
) -> None:
    env = {**codex_home(tmp_path, mock.url), "SPARE_KEY": SPARE_KEY}
    cfg = _keyed_config(tmp_path, mock)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r).startswith(TEXT)
    assert [q.path for q in mock.requests] == ["/v1/responses"]
    _check(mock, r.stderr)  # its custom provider: env_http_headers (a variable's name)


@pytest.mark.cli("gemini")
async def test_gemini_cli_through_a_private_relay_with_a_token(
    tmp_path: Path, mock: MockProvider
) -> None:
    env = gemini_env(tmp_path, mock.url, SPARE_KEY=SPARE_KEY)
    cfg = _keyed_config(tmp_path, mock)
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    assert len(mock.requests) == 1 and mock.requests[0].path.endswith(":streamGenerateContent")
    _check(mock, r.stderr)


@pytest.mark.cli("opencode")
async def test_opencode_through_a_private_relay_with_a_token(
    tmp_path: Path, mock: MockProvider
) -> None:
    box = Sandbox(tmp_path / "box")
    box.write_global_config(fake_provider(mock.url + "/v1"))
    cfg = _keyed_config(tmp_path, mock)
    argv = [sys.executable, "-m", "unbroken", "run", "--config", str(cfg), "--"]
    finished = await run_to_end(
        [*argv, str(opencode_bin()), *run_args()],
        box,
        limit_s=120,
        extra_env={"SPARE_KEY": SPARE_KEY},
    )
    assert finished.code == 0, finished.stderr[-3000:]
    assert finished.stdout.strip().endswith(TEXT)
    assert len(turn_requests(mock)) == 1
    _check(mock, finished.stderr)


# -- each binary sends the header the plan sets (straight at the mock) -------------------------


def _token_env(launch: Launch) -> dict[str, str]:
    """The variables the plan sets to give the agent ``TOKEN`` in a header."""
    assert launch.token_way(TOKEN) is TokenWay.HEADER
    return {k: v.replace("{token}", TOKEN) for k, v in launch.token_env.items()}


def _tokens(mock: MockProvider) -> list[str | None]:
    return [q.headers.get("x-unbroken-token") for q in mock.requests]


@pytest.mark.cli("claude")
async def test_claude_code_sends_the_header_the_plan_sets(
    tmp_path: Path, mock: MockProvider
) -> None:
    env = claude_env(tmp_path, mock.url, ANTHROPIC_CUSTOM_HEADERS="x-team: a")
    env.update(_token_env(claude.plan(env)))
    r = await run(claude_argv("say hi"), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert _tokens(mock) == [TOKEN]
    assert mock.requests[0].headers.get("x-team") == "a"  # the user's own header kept


@pytest.mark.cli("codex")
async def test_codex_sends_the_header_the_plan_sets(tmp_path: Path, mock: MockProvider) -> None:
    env = codex_home(tmp_path, mock.url)
    launch = codex.plan(env)
    env.update(_token_env(launch))
    argv = codex_argv(tmp_path, "say hi")
    r = await run([argv[0], *launch.token_args, *argv[1:]], env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r).startswith(TEXT)
    assert _tokens(mock) == [TOKEN]


@pytest.mark.cli("gemini")
async def test_gemini_cli_sends_the_header_the_plan_sets(
    tmp_path: Path, mock: MockProvider
) -> None:
    env = gemini_env(tmp_path, mock.url, GEMINI_CLI_CUSTOM_HEADERS="x-team: a")
    env.update(_token_env(gemini_cli.plan(env)))
    r = await run(gemini_argv("say hi"), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    assert _tokens(mock) == [TOKEN]
    assert mock.requests[0].headers.get("x-team") == "a"


@pytest.mark.cli("opencode")
async def test_opencode_sends_the_header_the_launcher_sets(
    tmp_path: Path, mock: MockProvider
) -> None:
    box = Sandbox(tmp_path / "box")
    box.write_global_config(fake_provider(mock.url + "/v1"))
    content = content_with_relay(None, {"fake": mock.url + "/v1"}, {"x-unbroken-token": TOKEN})
    finished = await run_to_end(
        [str(opencode_bin()), *run_args()],
        box,
        limit_s=120,
        extra_env={"OPENCODE_CONFIG_CONTENT": content},
    )
    assert finished.code == 0, finished.stderr[-3000:]
    assert finished.stdout.strip().endswith(TEXT)
    turns = turn_requests(mock)
    assert len(turns) == 1 and turns[0].headers.get("x-unbroken-token") == TOKEN
