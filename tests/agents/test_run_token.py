"""Issue 25: `unbroken run`'s private relay, where it injects a key, has a token that
only the launched agent knows (in its base URL).  The real agent CLIs are checked in
tests/e2e (test_*_e2e.py: ``..._with_a_keyed_route``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from unbroken.agents.launcher import relay_config
from unbroken.agents.plan import Launch
from unbroken.config import parse_config
from unbroken.mock import MockProvider

KEY = "sk-spare-key-0123456789abcdef"

#: The launched "agent": a turn through its base URL, then what a process without the
#: token gets on the keyed route (this user, and another Unix user when root).
SCRIPT = r"""
import json, os, shutil, subprocess, sys, urllib.error, urllib.request
from openai import OpenAI

base = os.environ["OPENAI_BASE_URL"]
chat = OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
root, _, rest = base.partition("/t/")
token = rest.split("/", 1)[0]
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

def post(url):
    req = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

out = {
    "text": chat.choices[0].message.content,
    "base": base.replace(token, "TOKEN"),
    "with_token": post(f"{root}/t/{token}/spare/v1/chat/completions"),
    "without": post(f"{root}/spare/v1/chat/completions"),
}
if os.geteuid() == 0 and shutil.which("setpriv"):
    curl = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "curl", "-s",
         "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "-H",
         "content-type: application/json", "--data", body.decode(),
         f"{root}/spare/v1/chat/completions"],
        capture_output=True, text=True)
    out["stranger"] = int(curl.stdout)
print(json.dumps(out))
print(token, file=sys.stderr)
"""


async def test_the_private_relay_of_a_keyed_config_has_a_token_only_the_agent_knows(
    tmp_path: Path, mock: MockProvider
) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "u.toml").write_text(
        "[journal]\nenabled = false\n"
        f'[routes.spare]\nupstreams = [{{ url = "{mock.url}", api_key_env = "SPARE_KEY" }}]\n'
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "UNBROKEN_"))
    }
    env.update(
        OPENAI_BASE_URL=f"{mock.url}/v1",
        OPENAI_API_KEY="sk-own",
        SPARE_KEY=KEY,
        OPENAI_MAX_RETRIES="0",
    )
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
    assert proc.returncode == 0, err.decode()
    got = json.loads(out.decode())
    lines = err.decode().splitlines()
    token = next(ln for ln in lines if " " not in ln and len(ln) >= 32)
    relay_log = "\n".join(ln for ln in lines if ln != token)
    assert got["text"] == "Hello from the mock provider."
    assert got["base"].startswith("http://127.0.0.1:") and got["base"].endswith(
        "/t/TOKEN/openai/v1"
    )
    assert got["with_token"] == 200 and got["without"] == 401
    if os.geteuid() == 0:
        assert got["stranger"] == 401
    # the key went upstream only for the request with the token; the token never in a log
    keyed = [r for r in mock.requests if r.headers.get("Authorization") == f"Bearer {KEY}"]
    assert len(keyed) == 1 and len(mock.requests) == 2
    assert mock.requests[0].headers["Authorization"] == "Bearer sk-own"
    assert token not in relay_log and "run: relay on http://127.0.0.1:" in relay_log
    assert "this run's own token (in the agent's base URLs)" in relay_log
    assert not [r for r in mock.requests if token in json.dumps(dict(r.headers)) + r.path]


def test_no_token_when_no_route_injects_a_key() -> None:
    launch = Launch("generic", routes={"openai": "https://api.openai.com"})
    plain = relay_config(parse_config({}, env={"UNBROKEN_TOKEN": "s" * 20}), launch)
    assert plain.token is None and plain.key_token is None  # serve's token is not the agent's
    keyed = parse_config(
        {"routes": {"k": {"upstreams": [{"url": "https://x.example", "api_key_env": "K"}]}}},
        env={"K": KEY},
    )
    one, two = relay_config(keyed, launch), relay_config(keyed, launch)
    # the keyed route's token (the agent's own routes need none): new for every run
    assert one.key_token is not None and two.key_token is not None
    assert one.key_token != two.key_token and len(one.key_token) >= 32
    assert one.token is None
