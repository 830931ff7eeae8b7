"""Claude Code: ``ANTHROPIC_BASE_URL`` points at the relay's anthropic route.

The upstream is the user's own ``ANTHROPIC_BASE_URL`` when one is set (a gateway,
a proxy), else ``https://api.anthropic.com``.  ``ANTHROPIC_API_KEY`` and
``ANTHROPIC_AUTH_TOKEN`` are passed through untouched.  Claude Code posts to
``{base}/v1/messages?beta=true``, so the route's upstream is the bare base URL.
When the private relay has a token, Claude Code sends it as a header from
``ANTHROPIC_CUSTOM_HEADERS`` (newline-separated ``Name: value`` lines, the user's
own kept; read from Claude Code 2.1.328), not in its base URL.

Claude Code's own timers, when the environment sets them, go to the relay's
``claude-code`` client profile: ``API_TIMEOUT_MS`` is how long it waits for a
non-streamed answer (300 s without it; read from Claude Code 2.1.328), so the relay
waits as long (``client_nonstream_wait_s``).  ``CLAUDE_STREAM_IDLE_TIMEOUT_MS`` only
ever raises its 300 s stream idle timeout, which the relay's stall timers are
already inside, so it changes nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping

from unbroken.agents.plan import RELAY, TOKEN, Launch, header_list
from unbroken.config_values import ConfigError, validate_url
from unbroken.relay.access import TOKEN_HEADER

__all__ = ["ANTHROPIC_DEFAULT", "ELSEWHERE", "client_timers", "custom_headers", "elsewhere", "plan"]

ANTHROPIC_DEFAULT = "https://api.anthropic.com"


def plan(env: Mapping[str, str]) -> Launch:
    own = env.get("ANTHROPIC_BASE_URL") or ""
    url = own or ANTHROPIC_DEFAULT
    try:
        url = validate_url("ANTHROPIC_BASE_URL", url).rstrip("/")
    except ConfigError as exc:
        return Launch("claude", notes=(f"claude: not relaying: {exc}",))
    note = f"claude: relaying anthropic -> {url}" + (" (your ANTHROPIC_BASE_URL)" if own else "")
    timers = client_timers(env)
    return Launch(
        "claude",
        routes={"anthropic": url},
        env={"ANTHROPIC_BASE_URL": f"{RELAY}/anthropic"},
        clients={"claude-code": timers} if timers else {},
        notes=(note,),
        # Its custom headers go to whichever provider it uses: not to Bedrock, Vertex...
        token_env={} if elsewhere(env) else {"ANTHROPIC_CUSTOM_HEADERS": custom_headers(env)},
    )


#: the variables that send Claude Code (2.1.328) to a provider other than
#: ``ANTHROPIC_BASE_URL`` (each with a base URL of its own, which is not relayed)
ELSEWHERE = (
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "CLAUDE_CODE_USE_ANTHROPIC_AWS",
    "CLAUDE_CODE_USE_ANTHROPIC_GOOGLE_CLOUD",
    "CLAUDE_CODE_USE_MANTLE",
    "CLAUDE_CODE_USE_GATEWAY",
)


def elsewhere(env: Mapping[str, str]) -> bool:
    """Whether Claude Code talks to another provider than ``ANTHROPIC_BASE_URL``: then
    its ``ANTHROPIC_CUSTOM_HEADERS`` go there, and must not carry the relay's token."""
    return any(
        (env.get(name) or "").strip().lower() not in ("", "0", "false", "no", "off")
        for name in ELSEWHERE
    )


def custom_headers(env: Mapping[str, str]) -> str:
    """``ANTHROPIC_CUSTOM_HEADERS`` with the relay's token header added (`plan.TOKEN`):
    Claude Code sends each of its lines (``Name: value``) with every request."""
    return header_list(env.get("ANTHROPIC_CUSTOM_HEADERS"), f"{TOKEN_HEADER}: {TOKEN}", "\n")


def client_timers(env: Mapping[str, str]) -> dict[str, object]:
    """``[clients.claude-code]`` values for the timers Claude Code reads from ``env``."""
    raw = (env.get("API_TIMEOUT_MS") or "").strip()
    try:
        ms = int(raw)
    except ValueError:
        return {}  # unset or not an integer: Claude Code keeps its 300 s
    return {"client_nonstream_wait_s": ms / 1000.0} if ms > 0 else {}
