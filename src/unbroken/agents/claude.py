"""Claude Code: ``ANTHROPIC_BASE_URL`` points at the relay's anthropic route.

The upstream is the user's own ``ANTHROPIC_BASE_URL`` when one is set (a gateway,
a proxy), else ``https://api.anthropic.com``.  ``ANTHROPIC_API_KEY`` and
``ANTHROPIC_AUTH_TOKEN`` are passed through untouched.  Claude Code posts to
``{base}/v1/messages?beta=true``, so the route's upstream is the bare base URL.
"""

from __future__ import annotations

from collections.abc import Mapping

from unbroken.agents.plan import RELAY, Launch
from unbroken.config import ConfigError, validate_url

__all__ = ["ANTHROPIC_DEFAULT", "plan"]

ANTHROPIC_DEFAULT = "https://api.anthropic.com"


def plan(env: Mapping[str, str]) -> Launch:
    own = env.get("ANTHROPIC_BASE_URL") or ""
    url = own or ANTHROPIC_DEFAULT
    try:
        url = validate_url("ANTHROPIC_BASE_URL", url).rstrip("/")
    except ConfigError as exc:
        return Launch("claude", notes=(f"claude: not relaying: {exc}",))
    note = f"claude: relaying anthropic -> {url}" + (" (your ANTHROPIC_BASE_URL)" if own else "")
    return Launch(
        "claude",
        routes={"anthropic": url},
        env={"ANTHROPIC_BASE_URL": f"{RELAY}/anthropic"},
        notes=(note,),
    )
