"""Gemini CLI: ``GOOGLE_GEMINI_BASE_URL`` points at the relay's gemini route.

The upstream is the user's own ``GOOGLE_GEMINI_BASE_URL`` when one is set, else
``https://generativelanguage.googleapis.com``.  Gemini CLI posts to
``{base}/v1beta/models/<model>:streamGenerateContent?alt=sse``, so the route's
upstream is the bare base URL.  ``GEMINI_API_KEY`` passes through untouched (it
goes upstream in ``x-goog-api-key``).

**Its auth choice.** Gemini CLI 0.61 takes its auth type from
``security.auth.selectedType`` in its settings, else from the environment, in this
order: ``GOOGLE_GENAI_USE_GCA`` (Google login), ``GOOGLE_GENAI_USE_VERTEXAI``,
``GOOGLE_GEMINI_BASE_URL`` (a "gateway": measured, it exits 41 with "Invalid auth
method selected."), ``GEMINI_API_KEY``.  So setting the base URL would turn a user
who relies on ``GEMINI_API_KEY`` into a gateway user.  The launcher keeps the choice
the user would have had: it points ``GEMINI_CLI_SYSTEM_DEFAULTS_PATH`` at a private
copy of the user's system defaults (the lowest-precedence settings file, so every
``selectedType`` of the user's own still wins) with that choice added.  A user who
set ``GOOGLE_GEMINI_BASE_URL`` chose the gateway: nothing is added.

**Vertex AI** (``GOOGLE_GENAI_USE_VERTEXAI=true``) is served the same way:
``GOOGLE_VERTEX_BASE_URL`` points at a ``vertex`` route whose upstream is the
user's own, else the regional endpoint of ``GOOGLE_CLOUD_LOCATION``.  Vertex
streams the same ``GenerateContentResponse`` events; its bearer token passes
through.  **Google login** (``oauth-personal``) talks to Code Assist
(``cloudcode-pa.googleapis.com``), which no base URL variable moves: not relayed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unbroken.agents.plan import FILES, RELAY, TOKEN, Launch, header_list
from unbroken.config_values import ConfigError, validate_url
from unbroken.relay.access import TOKEN_HEADER

__all__ = ["GEMINI_DEFAULT", "SYSTEM_DEFAULTS", "auth_from_env", "plan"]

GEMINI_DEFAULT = "https://generativelanguage.googleapis.com"
#: the private settings file the launcher writes (in its run directory)
SYSTEM_DEFAULTS = "gemini-system-defaults.json"


def auth_from_env(env: Mapping[str, str]) -> str | None:
    """The auth type Gemini CLI picks from the environment when its settings name none,
    leaving out ``GOOGLE_GEMINI_BASE_URL`` (the variable the launcher sets)."""
    if env.get("GOOGLE_GENAI_USE_GCA") == "true":
        return "oauth-personal"
    if env.get("GOOGLE_GENAI_USE_VERTEXAI") == "true":
        return "vertex-ai"
    if env.get("GEMINI_API_KEY"):
        return "gemini-api-key"
    if env.get("CLOUD_SHELL") == "true" or env.get("GEMINI_CLI_USE_COMPUTE_ADC") == "true":
        return "compute-default-credentials"
    return None


def _system_defaults_path(env: Mapping[str, str]) -> Path:
    own = env.get("GEMINI_CLI_SYSTEM_DEFAULTS_PATH")
    if own:
        return Path(own)
    settings = env.get("GEMINI_CLI_SYSTEM_SETTINGS_PATH")
    if settings:
        return Path(settings).parent / "system-defaults.json"
    return Path("/etc/gemini-cli/system-defaults.json")


def _defaults_with(env: Mapping[str, str], auth: str) -> tuple[str | None, str | None]:
    """The user's system defaults with ``selectedType`` set when they set none (JSON),
    or None when theirs already name one; and a problem reading them."""
    path = _system_defaults_path(env)
    data: dict[str, Any] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"gemini: cannot read {path} ({exc}); its auth choice is left alone"
    if text.strip():
        try:
            loaded = json.loads(text)
        except ValueError:
            return None, f"gemini: {path} is not JSON; its auth choice is left alone"
        if not isinstance(loaded, dict):
            return None, f"gemini: {path} is not a JSON object; its auth choice is left alone"
        data = loaded
    security = data.setdefault("security", {})
    auth_table = security.setdefault("auth", {}) if isinstance(security, dict) else None
    if not isinstance(auth_table, dict):
        return None, f"gemini: {path} has no usable security.auth; its auth choice is left alone"
    if auth_table.get("selectedType"):
        return None, None
    auth_table["selectedType"] = auth
    return json.dumps(data, indent=2) + "\n", None


def _vertex_url(env: Mapping[str, str]) -> str:
    own = env.get("GOOGLE_VERTEX_BASE_URL")
    if own:
        return own
    location = env.get("GOOGLE_CLOUD_LOCATION") or "global"
    if location == "global" or not env.get("GOOGLE_CLOUD_PROJECT"):
        return "https://aiplatform.googleapis.com"  # global, and express mode (API key)
    return f"https://{location}-aiplatform.googleapis.com"


def plan(env: Mapping[str, str]) -> Launch:
    own = env.get("GOOGLE_GEMINI_BASE_URL") or ""
    notes: list[str] = []
    routes: dict[str, str] = {}
    out_env: dict[str, str] = {}
    files: dict[str, str] = {}
    auth = auth_from_env(env)
    try:
        url = validate_url("GOOGLE_GEMINI_BASE_URL", own or GEMINI_DEFAULT).rstrip("/")
    except ConfigError as exc:
        return Launch("gemini", notes=(f"gemini: not relaying: {exc}",))
    routes["gemini"] = url
    out_env["GOOGLE_GEMINI_BASE_URL"] = f"{RELAY}/gemini"
    notes.append(
        f"gemini: relaying gemini -> {url}" + (" (your GOOGLE_GEMINI_BASE_URL)" if own else "")
    )
    if auth == "vertex-ai":
        try:
            vertex = validate_url("GOOGLE_VERTEX_BASE_URL", _vertex_url(env)).rstrip("/")
        except ConfigError as exc:
            notes.append(f"gemini: not relaying vertex: {exc}")
        else:
            routes["vertex"] = vertex
            out_env["GOOGLE_VERTEX_BASE_URL"] = f"{RELAY}/vertex"
            notes.append(f"gemini: relaying vertex -> {vertex}")
    elif auth == "oauth-personal":
        notes.append("gemini: Google login talks to Code Assist, which is not relayed")
    if not own and auth is not None:
        text, problem = _defaults_with(env, auth)
        if problem:
            notes.append(problem)
        elif text is not None:
            files[SYSTEM_DEFAULTS] = text
            out_env["GEMINI_CLI_SYSTEM_DEFAULTS_PATH"] = os.path.join(FILES, SYSTEM_DEFAULTS)
            notes.append(f"gemini: keeping its auth choice ({auth}) with the base URL set")
    # The token, when the relay has one, in a header (comma-separated ``Name: value``
    # entries, the user's own kept; read from Gemini CLI 0.61), not in the base URL.
    # Gemini CLI sends these headers with every model request: for Google login and
    # compute credentials to Code Assist, which is not relayed, so not for those (the
    # token would go to Google; it stays in the base URL they do not use).
    token_env: dict[str, str] = {}
    if auth not in ("oauth-personal", "compute-default-credentials"):
        own_headers = env.get("GEMINI_CLI_CUSTOM_HEADERS")
        token_env["GEMINI_CLI_CUSTOM_HEADERS"] = header_list(
            own_headers, f"{TOKEN_HEADER}: {TOKEN}", ", "
        )
    return Launch(
        "gemini",
        routes=routes,
        env=out_env,
        files=files,
        notes=tuple(notes),
        token_env=token_env,
    )
