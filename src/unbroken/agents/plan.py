"""What `unbroken run` sets up for one agent: routes, environment, arguments."""

from __future__ import annotations

import enum
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from unbroken.config import Route

__all__ = [
    "FILES",
    "RELAY",
    "RUN_TOKEN_ENV",
    "TOKEN",
    "TOKEN_NOTE",
    "Launch",
    "TokenWay",
    "header_list",
    "private_token",
    "relay_base",
    "route_name",
    "split_version",
    "token_note",
]

#: stands for the relay's base URL (``http://127.0.0.1:PORT``) in `Launch` values
RELAY = "{relay}"
#: stands for the run's private directory, where `Launch.files` are written
FILES = "{files}"
#: stands for the private relay's token in `Launch.token_env` values
TOKEN = "{token}"
#: the variable that holds the token for an agent that names a header's variable
#: (Codex's ``env_http_headers``): only the name goes on its command line
RUN_TOKEN_ENV = "UNBROKEN_RUN_TOKEN"


class TokenWay(enum.StrEnum):
    """How the launched agent gets its private relay's token (a route injects a key)."""

    #: an ``x-unbroken-token`` header set from its environment (`Launch.token_env`):
    #: its base URLs carry no token, so a process that puts one on its command line
    #: (readable by other users in /proc/<pid>/cmdline) shows none
    HEADER = "header"
    #: the ``/t/<token>`` prefix of its base URLs, in its environment (an agent with no
    #: header setting: the openai/anthropic SDKs and the tools built on them)
    URL = "url"
    #: none: its base URLs are on its command line and it has no header setting
    NONE = "none"


_RESERVED = frozenset({"t", "healthz", "status", "metrics"})


@dataclass(frozen=True)
class Launch:
    """How to run one agent through a relay."""

    agent: str  # codex | claude | gemini | generic
    #: route name -> the upstream base URL it relays to
    routes: Mapping[str, str] = field(default_factory=dict)
    #: environment variables to set; `RELAY` in a value is the relay's URL
    env: Mapping[str, str] = field(default_factory=dict)
    #: arguments inserted right after the program name; `RELAY` as in ``env``
    args: tuple[str, ...] = ()
    #: the user's own arguments as the agent gets them (None: as given); a flag that
    #: the relay's own arguments replace is left out
    user_args: tuple[str, ...] | None = None
    #: ``[clients.<name>]`` overrides for this run (the agent's own timers, read from
    #: its config), merged over the user's
    clients: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    #: one line each, logged at start (what was relayed, what was left alone)
    notes: tuple[str, ...] = ()
    #: file name -> text, written into a private directory for the run (`FILES` in an
    #: ``env`` value is its path); the directory is removed when the agent exits
    files: Mapping[str, str] = field(default_factory=dict)
    #: with a token (a route injects a key), the environment variables that make the
    #: agent send it as ``x-unbroken-token`` (`TOKEN` in a value), set over ``env``;
    #: empty: the agent has no such setting
    token_env: Mapping[str, str] = field(default_factory=dict)
    #: with a token, arguments after ``args`` that make the agent send the header
    #: (they may name a variable of ``token_env``, never hold the token)
    token_args: tuple[str, ...] = ()

    def token_way(self, token: str | None) -> TokenWay:
        """How the agent gets ``token`` (None: there is none to give)."""
        if token is None:
            return TokenWay.NONE
        if self.token_env:
            return TokenWay.HEADER
        if any(RELAY in a for a in self.args):
            return TokenWay.NONE  # a base URL on its command line: no token there
        return TokenWay.URL

    def resolved_env(
        self, relay: str, files: str = FILES, token: str | None = None
    ) -> dict[str, str]:
        """``env`` filled in; with a ``token`` given by header, ``token_env`` too."""
        out = {k: v.replace(RELAY, relay).replace(FILES, files) for k, v in self.env.items()}
        if token is not None and self.token_way(token) is TokenWay.HEADER:
            out.update({k: v.replace(TOKEN, token) for k, v in self.token_env.items()})
        return out

    def resolved_args(self, relay: str, token: str | None = None) -> list[str]:
        """``args`` filled in; with a ``token`` given by header, ``token_args`` after."""
        out = [a.replace(RELAY, relay) for a in self.args]
        if token is not None and self.token_way(token) is TokenWay.HEADER:
            out += self.token_args
        return out

    def argv(self, command: Sequence[str], relay: str, token: str | None = None) -> list[str]:
        """The agent's whole command line: the program, the relay's arguments (with a
        ``token`` given by header, `token_args` too), then the user's (less any the
        relay's replace)."""
        rest = self.user_args if self.user_args is not None else tuple(command[1:])
        return [command[0], *self.resolved_args(relay, token), *rest]


def route_name(wanted: str, taken: set[str]) -> str:
    """A route name for a provider id: ``[A-Za-z0-9._-]+`` not starting with ``_`` (a
    valid ``[routes.<name>]``), not reserved, not taken."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", wanted).lstrip("._").rstrip(".") or "provider"
    if name in _RESERVED:
        name = f"{name}-provider"
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    taken.add(candidate)
    return candidate


def split_version(url: str) -> tuple[str, str]:
    """``https://api.openai.com/v1`` -> (``https://api.openai.com``, ``/v1``): the route
    relays to the host part and the client's base URL keeps the version, so the
    built-in routes of ``unbroken serve`` (``/openai/v1``) fit as they are."""
    url = url.rstrip("/")
    m = re.search(r"/v\d+(?:beta)?$", url)
    if m is None or "/" not in url[: m.start()].split("://", 1)[-1] + "/":
        return url, ""
    return url[: m.start()], m.group(0)


#: logged when `unbroken run`'s private relay has a token (a route injects a key)
TOKEN_NOTE = "a route injects a key: it answers only requests with this run's own token"


def token_note(way: TokenWay) -> str:
    """`TOKEN_NOTE`, and who has the token and how (never the token itself)."""
    if way is TokenWay.HEADER:
        return (
            f"{TOKEN_NOTE} (in the agent's x-unbroken-token header, set from its "
            "environment; its base URLs carry none); other processes get 401 there"
        )
    if way is TokenWay.URL:
        return f"{TOKEN_NOTE} (in the agent's base URLs); other processes get 401 there"
    return (
        f"{TOKEN_NOTE}, which no one is given: the agent's base URLs are on its command "
        "line, which other users can read, and it does not use that route"
    )


def header_list(existing: str | None, line: str, sep: str) -> str:
    """A header variable's value (``Name: value`` entries joined by ``sep``) with
    ``line`` added after the user's own entries."""
    own = (existing or "").strip()
    return f"{own}{sep}{line}" if own else line


def private_token(routes: Mapping[str, Route]) -> str | None:
    """The token of `unbroken run`'s private relay (its ``key_token``: the routes that
    inject a key need it, the agent's own routes do not): random, when a route injects
    a key of the relay's (no local stranger may spend it), else None."""
    if any(r.injects_key for r in routes.values()):
        return secrets.token_urlsafe(32)
    return None


def relay_base(url: str, token: str | None) -> str:
    """The base URL the launched agent gets: the relay's, with the ``/t/<token>``
    prefix when it has a token (only the agent learns it; never logged)."""
    return f"{url}/t/{token}" if token else url
