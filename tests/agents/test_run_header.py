"""Issue 33 item 8: `unbroken run` gives the token in a header where the agent has a
setting for one, so its base URLs carry none.

Before, the private relay's token went into the agent's base URLs
(``http://127.0.0.1:PORT/t/<token>/anthropic``): any process that put a base URL
on its command line (a tool the agent runs, a script it writes) showed the token
to every local user in ``/proc/<pid>/cmdline``.  Claude Code
(``ANTHROPIC_CUSTOM_HEADERS``), Gemini CLI (``GEMINI_CLI_CUSTOM_HEADERS``), Codex's
custom providers (``env_http_headers``) and OpenCode (a provider's
``options.headers``) now send it as ``x-unbroken-token`` from their environment;
the openai/anthropic SDKs (no such setting) keep the ``/t/<token>`` prefix.
The real binaries: tests/e2e/test_run_token_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import textwrap
from pathlib import Path

from unbroken.agents import claude, codex, gemini_cli
from unbroken.agents.launcher import generic_plan
from unbroken.agents.plan import RUN_TOKEN_ENV, TokenWay
from unbroken.mock import MockProvider
from unbroken.opencode.discovery import content_with_relay

TOKEN = "tok-0123456789abcdef0123456789"
RELAY = "http://127.0.0.1:4999"
KEY = "sk-spare-key-0123456789abcdef"


def test_claude_code_gets_the_token_in_its_custom_headers() -> None:
    launch = claude.plan({"ANTHROPIC_CUSTOM_HEADERS": "x-team: a\nx-other: b"})
    assert launch.token_way(TOKEN) is TokenWay.HEADER
    env = launch.resolved_env(RELAY, token=TOKEN)
    assert env["ANTHROPIC_BASE_URL"] == f"{RELAY}/anthropic"  # no /t/<token>
    assert env["ANTHROPIC_CUSTOM_HEADERS"] == f"x-team: a\nx-other: b\nx-unbroken-token: {TOKEN}"
    assert launch.resolved_args(RELAY, TOKEN) == []
    # no token: the user's own headers are left alone
    assert launch.token_way(None) is TokenWay.NONE
    assert "ANTHROPIC_CUSTOM_HEADERS" not in launch.resolved_env(RELAY)
    alone = claude.plan({}).resolved_env(RELAY, token=TOKEN)
    assert alone["ANTHROPIC_CUSTOM_HEADERS"] == f"x-unbroken-token: {TOKEN}"
    # on Bedrock (and the like) its custom headers go to AWS: never the token
    bedrock = claude.plan({"CLAUDE_CODE_USE_BEDROCK": "1"})
    assert "ANTHROPIC_CUSTOM_HEADERS" not in bedrock.resolved_env(RELAY, token=TOKEN)
    assert claude.plan({"CLAUDE_CODE_USE_VERTEX": "0"}).token_way(TOKEN) is TokenWay.HEADER


def test_gemini_cli_gets_the_token_in_its_custom_headers() -> None:
    launch = gemini_cli.plan({"GEMINI_API_KEY": "k", "GEMINI_CLI_CUSTOM_HEADERS": "x-a: 1"})
    env = launch.resolved_env(RELAY, "/run", token=TOKEN)
    assert env["GOOGLE_GEMINI_BASE_URL"] == f"{RELAY}/gemini"
    assert env["GEMINI_CLI_CUSTOM_HEADERS"] == f"x-a: 1, x-unbroken-token: {TOKEN}"
    assert "GEMINI_CLI_CUSTOM_HEADERS" not in launch.resolved_env(RELAY, "/run")
    # Google login sends these headers to Code Assist (not relayed): never the token
    for google in ({"GOOGLE_GENAI_USE_GCA": "true"}, {"CLOUD_SHELL": "true"}):
        login = gemini_cli.plan(google)
        assert "GEMINI_CLI_CUSTOM_HEADERS" not in login.resolved_env(RELAY, "/run", TOKEN)
        assert login.token_way(TOKEN) is TokenWay.URL


def test_codex_custom_providers_get_the_token_from_a_variable(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        textwrap.dedent("""
        model_provider = "fake"
        [model_providers.fake]
        base_url = "http://127.0.0.1:9/v1"
        env_http_headers = { "x-team" = "TEAM" }
        """)
    )
    launch = codex.plan({"CODEX_HOME": str(tmp_path)})
    assert launch.token_way(TOKEN) is TokenWay.HEADER
    args = launch.resolved_args(RELAY, TOKEN)
    assert args == [
        "-c",
        f'openai_base_url="{RELAY}/openai/v1"',
        "-c",
        f'model_providers.fake.base_url="{RELAY}/fake/v1"',
        "-c",
        f'model_providers.fake.env_http_headers.x-unbroken-token="{RUN_TOKEN_ENV}"',
    ]
    assert not [a for a in args if TOKEN in a]  # only the variable's name on its command line
    assert launch.resolved_env(RELAY, token=TOKEN) == {RUN_TOKEN_ENV: TOKEN}
    assert launch.resolved_args(RELAY) == args[:4]  # no token: no header
    assert launch.resolved_env(RELAY) == {}
    # the built-in openai provider alone takes no header, and its URL is in argv
    only = codex.plan({"CODEX_HOME": str(tmp_path / "none")})
    assert only.token_way(TOKEN) is TokenWay.NONE
    assert not [a for a in only.resolved_args(RELAY, TOKEN) if TOKEN in a]


def test_the_sdks_keep_the_token_in_the_url() -> None:
    launch = generic_plan({})
    assert launch.token_way(TOKEN) is TokenWay.URL
    assert launch.token_env == {} and launch.token_args == ()


def test_opencode_gets_the_token_in_each_providers_headers() -> None:
    existing = '{"provider": {"fake": {"options": {"headers": {"x-team": "a"}}}}}'
    got = json.loads(
        content_with_relay(existing, {"fake": f"{RELAY}/fake"}, {"x-unbroken-token": TOKEN})
    )
    assert got["provider"]["fake"]["options"] == {
        "baseURL": f"{RELAY}/fake",
        "headers": {"x-team": "a", "x-unbroken-token": TOKEN},
    }
    plain = json.loads(content_with_relay(existing, {"fake": f"{RELAY}/fake"}))
    assert plain["provider"]["fake"]["options"]["headers"] == {"x-team": "a"}


#: a stand-in for Claude Code (named ``claude``, so `unbroken run` plans for it): it
#: reports its base URL, and tries the relay's keyed route with the header it was
#: given, and without it
FAKE_CLAUDE = r"""#!{python}
import json, os, urllib.error, urllib.request

base = os.environ["ANTHROPIC_BASE_URL"]
lines = os.environ.get("ANTHROPIC_CUSTOM_HEADERS", "").splitlines()
headers = dict(line.split(": ", 1) for line in lines if ": " in line)
root = base.rsplit("/", 1)[0]
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

def post(extra):
    req = urllib.request.Request(
        f"{root}/spare/v1/chat/completions", body, {"content-type": "application/json", **extra}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

print(json.dumps({
    "base": base,
    "names": sorted(headers),
    "with_header": post(headers),
    "without": post({}),
}))
"""


async def test_run_gives_claude_code_the_token_in_a_header_not_its_base_url(
    tmp_path: Path, mock: MockProvider
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "claude"
    fake.write_text(FAKE_CLAUDE.replace("{python}", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "u.toml").write_text(
        "[journal]\nenabled = false\n"
        f'[routes.spare]\nupstreams = [{{ url = "{mock.url}", api_key_env = "SPARE_KEY" }}]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "UNBROKEN_"))}
    env.update(SPARE_KEY=KEY, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "run",
        "--config",
        str(tmp_path / "u.toml"),
        "--",
        str(fake),
        env=env,
        cwd=str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    got = json.loads(out.decode())
    assert "/t/" not in got["base"] and got["base"].endswith("/anthropic")  # no token there
    assert got["names"] == ["x-unbroken-token"]
    assert got["with_header"] == 200 and got["without"] == 401
    log = err.decode()
    assert "in the agent's x-unbroken-token header" in log and "/t/" not in log
    # the key went upstream for the request with the header only; the token never did
    assert [r.headers.get("Authorization") for r in mock.requests] == [f"Bearer {KEY}"]
    assert "x-unbroken-token" not in {h.lower() for h in mock.requests[0].headers}


def test_print_env_gives_the_header_way_and_never_prints_the_users_headers() -> None:
    """``--print-env`` for `unbroken serve` with a token: Claude Code's token goes in its
    header variable as a shell expansion, and the user's own lines of that variable (a
    gateway's credentials, say) are kept by expansion too, never printed."""
    import io
    import subprocess

    from unbroken.agents.launcher import print_env
    from unbroken.config import parse_config

    own = "Authorization: Bearer gw-secret-0123456789\nx-b: 2"
    base = parse_config({}, env={"UNBROKEN_TOKEN": TOKEN})
    out = io.StringIO()
    print_env(["claude"], base, {"ANTHROPIC_CUSTOM_HEADERS": own}, out=out)
    text = out.getvalue()
    assert "gw-secret" not in text and TOKEN not in text and "/t/" not in text
    exports = [ln for ln in text.splitlines() if ln.startswith("export ")]
    shell = subprocess.run(
        ["bash", "-c", "\n".join([*exports, 'printf %s "$ANTHROPIC_CUSTOM_HEADERS"'])],
        env={**os.environ, "ANTHROPIC_CUSTOM_HEADERS": own, "UNBROKEN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shell.stdout == f"{own}\nx-unbroken-token: {TOKEN}"
