"""Per-request actions of the mock provider: parsing, validation and normalisation.

An action is a plain dict (so it can come from JSON or TOML script files) that
chooses the reply shape and, optionally, a fault. ``parse_action`` validates it
once and returns an immutable :class:`Action` the server uses on the hot path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "ACTION_KEYS",
    "DEFAULT_TEXT",
    "ERROR_KINDS",
    "FAULTS",
    "REPLIES",
    "UPGRADE_KEYS",
    "WS_DEFAULT_CLOSE_CODE",
    "WS_LIMIT_CLOSE_CODE",
    "Action",
    "ActionError",
    "expand_actions",
    "expand_upgrade_actions",
    "parse_action",
    "parse_upgrade_action",
]

DEFAULT_TEXT: Final = "Hello from the mock provider."
DEFAULT_DELTAS: Final = 8
DEFAULT_STALL_SECONDS: Final = 3600.0
MAX_DELTAS: Final = 1_000_000

#: ``text_tool``: the text, then one tool call (Anthropic Messages and Chat Completions;
#: the other protocols send the call alone)
REPLIES: Final = ("text", "tool", "tools", "text_tool")
FAULTS: Final = (
    "close_before_headers",
    "reset_after_headers",
    "reset",
    "stall",
    "end",
    "error_event",
    "malformed",
    "close",
    "connection_limit",
)
#: Faults that take ``after_frame``.
FRAME_FAULTS: Final = frozenset({"reset", "stall", "end", "error_event", "malformed", "close"})
#: Faults that take ``code`` (a WebSocket close code).
CODE_FAULTS: Final = frozenset({"close", "connection_limit"})
#: Default close code of the WebSocket ``close`` fault (1011 "internal error").
WS_DEFAULT_CLOSE_CODE: Final = 1011
#: Default close code of the ``connection_limit`` fault. OpenAI documents the
#: ``websocket_connection_limit_reached`` error but not the close code that follows
#: it, so the mock uses 1013 "try again later" (a code the openai SDK's
#: ``on_reconnecting`` treats as reconnectable).
WS_LIMIT_CLOSE_CODE: Final = 1013
ERROR_KINDS: Final = (
    "overloaded",
    "server_error",
    "rate_limit",
    "invalid_request",
    "context_length",
)
ERROR_STYLES: Final = ("failed", "error")

#: Keys that shape a successful reply. Only these (plus the request) feed the ids,
#: so a faulted reply is a byte-exact prefix of the clean reply to the same request
#: (and timing keys such as chunk_delay_ms do not change the bytes either).
SHAPE_KEYS: Final = ("reply", "text", "deltas", "tool_name", "tool_args", "seed")

ACTION_KEYS: Final = frozenset(
    {
        *SHAPE_KEYS,
        "chunk_delay_ms",
        "delay_ms",
        "status",
        "headers",
        "body",
        "fault",
        "after_frame",
        "after_deltas",
        "seconds",
        "error",
        "error_style",
        "rst",
        "count",
        "code",
        # Responses background mode (`mock.background_store`)
        "refuse_background",
        "resume",
        # the response id a Responses reply names (a hostile upstream's: "../x")
        "response_id",
        # Chat prefix continuation: the answer starts with the prefix (Mistral's)
        "prefix_echo",
        # a prefill continuation repeats the prefix's last N characters first
        "echo_tail",
        # a continuation (prefill or user message) starts with this text (a comment)
        "preamble",
        # Anthropic: a request ending with an assistant message gets 400 (Claude 4.6)
        "refuse_prefill",
    }
)
#: ``resume``: how a background resume (``GET .../responses/{id}?stream=true``) is answered
RESUME_FAULTS: Final = (
    "not_found",
    "bad_request",
    "other_id",
    "other_response",
    "backwards",
    "queued",
)

#: Keys allowed in a WebSocket upgrade action (``script_upgrades``).
UPGRADE_KEYS: Final = frozenset({"status", "headers", "body", "fault", "delay_ms", "rst", "count"})
#: The only fault an upgrade action may use.
UPGRADE_FAULTS: Final = ("close_before_headers",)


class ActionError(ValueError):
    """An action (or script) is invalid. The message names the offending key."""


@dataclass(frozen=True, slots=True)
class Action:
    """A validated, normalised action. Build it with :func:`parse_action`."""

    raw: Mapping[str, Any] = field(default_factory=dict)
    reply: str = "text"
    text: str = DEFAULT_TEXT
    deltas: int = DEFAULT_DELTAS
    tool_names: tuple[str, ...] = ()
    tool_args: tuple[Mapping[str, Any], ...] = ()
    seed: str | None = None
    chunk_delay: float = 0.0
    delay: float = 0.0
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: str | None = None
    fault: str | None = None
    after_frame: int = 0
    #: cut after this many delta frames of the reply's first run (text deltas, or a
    #: tool call's argument fragments), whatever comes before them; None: after_frame
    after_deltas: int | None = None
    seconds: float = DEFAULT_STALL_SECONDS
    error: str = "server_error"
    error_style: str = "failed"
    rst: bool = False
    count: int = 1
    code: int | None = None
    #: a Chat prefix continuation answers with the prefix first, as Mistral's does
    prefix_echo: bool = False
    #: a prefill continuation starts with the prefix's last N characters (a provider
    #: that repeats the end of what it was given)
    echo_tail: int = 0
    #: a continuation (prefill or user message) starts with this text first (a model
    #: that comments or rephrases before it continues)
    preamble: str = ""
    #: Anthropic Messages: a request whose last message is an assistant message (a
    #: prefill) is answered 400, as Claude 4.6 and later answer it
    refuse_prefill: bool = False
    shape_key: str = ""
    #: Responses background mode: a ``background: true`` request gets a 400 naming it
    refuse_background: bool = False
    #: the answer to a background resume (`RESUME_FAULTS`); None: the events after N
    resume: str | None = None
    #: the response id a Responses reply names instead of its own (any string)
    response_id: str | None = None

    @property
    def is_error_status(self) -> bool:
        """True when the action asks for a complete non-2xx response."""
        return self.status is not None and not 200 <= self.status < 300


def _where(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _int(value: Any, name: str, *, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ActionError(f"{name}: expected an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ActionError(f"{name}: must be {bound}, got {value}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ActionError(f"{name}: expected a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result) or result < 0:
        raise ActionError(f"{name}: must be a finite number >= 0, got {value!r}")
    return result


def _choice(value: Any, name: str, options: Iterable[str]) -> str:
    opts = tuple(options)
    if value not in opts:
        raise ActionError(f"{name}: must be one of {', '.join(opts)}; got {value!r}")
    return str(value)


def _tool_names(value: Any, name: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ActionError(f"{name}: must not be an empty list")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ActionError(f"{name}: expected a non-empty string or a list of them")
    return tuple(items)


def _tool_args(value: Any, name: str) -> tuple[Mapping[str, Any], ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ActionError(f"{name}: must not be an empty list")
    for item in items:
        if not isinstance(item, dict):
            raise ActionError(f"{name}: expected a JSON object or a list of them, got {item!r}")
        try:
            json.dumps(item)
        except (TypeError, ValueError) as exc:
            raise ActionError(f"{name}: not JSON-serialisable: {exc}") from None
    return tuple(items)


def _headers(value: Any, name: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise ActionError(f"{name}: expected an object of header names to values")
    out: list[tuple[str, str]] = []
    for hname, hvalue in value.items():
        if not isinstance(hname, str) or not hname:
            raise ActionError(f"{name}: header names must be non-empty strings")
        if isinstance(hvalue, bool) or not isinstance(hvalue, (str, int, float)):
            raise ActionError(f"{name}.{hname}: header values must be strings or numbers")
        text = str(hvalue)
        if any(c in text for c in "\r\n\x00") or any(c in hname for c in "\r\n\x00: "):
            raise ActionError(f"{name}.{hname}: illegal character in header")
        out.append((hname, text))
    return tuple(out)


def parse_action(data: Mapping[str, Any] | Action | None, *, where: str = "") -> Action:
    """Validate ``data`` and return an :class:`Action`.

    ``None`` or ``{}`` is the plain OK reply. Keys starting with ``_`` are ignored
    (comments in script files). Raises :class:`ActionError` naming the bad key;
    ``where`` prefixes key names in messages (e.g. ``"actions[2]"``).
    """
    if isinstance(data, Action):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ActionError(f"{where or 'action'}: expected an object, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ActionError(f"{where or 'action'}: keys must be strings, got {key!r}")
        if key not in ACTION_KEYS and not key.startswith("_"):
            known = ", ".join(sorted(ACTION_KEYS))
            raise ActionError(f"{_where(where, key)}: unknown action key (known keys: {known})")

    kw: dict[str, Any] = {}
    get = data.get

    if "reply" in data:
        kw["reply"] = _choice(get("reply"), _where(where, "reply"), REPLIES)
    if "text" in data:
        if not isinstance(get("text"), str):
            raise ActionError(f"{_where(where, 'text')}: expected a string")
        kw["text"] = get("text")
    if "deltas" in data:
        kw["deltas"] = _int(get("deltas"), _where(where, "deltas"), lo=1, hi=MAX_DELTAS)
    if "tool_name" in data:
        kw["tool_names"] = _tool_names(get("tool_name"), _where(where, "tool_name"))
    if "tool_args" in data:
        kw["tool_args"] = _tool_args(get("tool_args"), _where(where, "tool_args"))
    if "seed" in data:
        seed = get("seed")
        if isinstance(seed, bool) or not isinstance(seed, (str, int)):
            raise ActionError(f"{_where(where, 'seed')}: expected a string or integer")
        kw["seed"] = str(seed)
    if "chunk_delay_ms" in data:
        kw["chunk_delay"] = _number(get("chunk_delay_ms"), _where(where, "chunk_delay_ms")) / 1000
    if "delay_ms" in data:
        kw["delay"] = _number(get("delay_ms"), _where(where, "delay_ms")) / 1000
    if "status" in data:
        kw["status"] = _int(get("status"), _where(where, "status"), lo=200, hi=599)
    if "headers" in data:
        kw["headers"] = _headers(get("headers"), _where(where, "headers"))
    if "body" in data:
        if not isinstance(get("body"), str):
            raise ActionError(f"{_where(where, 'body')}: expected a string")
        kw["body"] = get("body")
    fault: str | None = None
    if "fault" in data and get("fault") is not None:
        fault = _choice(get("fault"), _where(where, "fault"), FAULTS)
        kw["fault"] = fault
    if "after_frame" in data:
        if fault not in FRAME_FAULTS:
            raise ActionError(
                f"{_where(where, 'after_frame')}: only valid with fault "
                f"{', '.join(sorted(FRAME_FAULTS))}"
            )
        kw["after_frame"] = _int(get("after_frame"), _where(where, "after_frame"), lo=0)
    if "after_deltas" in data:
        if fault not in FRAME_FAULTS or "after_frame" in data:
            raise ActionError(
                f"{_where(where, 'after_deltas')}: only valid with fault "
                f"{', '.join(sorted(FRAME_FAULTS))}, and not with after_frame"
            )
        kw["after_deltas"] = _int(get("after_deltas"), _where(where, "after_deltas"), lo=0)
    if "seconds" in data:
        if fault != "stall" and get("resume") != "queued":
            raise ActionError(
                f"{_where(where, 'seconds')}: only valid with fault 'stall' or resume 'queued'"
            )
        seconds = _number(get("seconds"), _where(where, "seconds"))
        kw["seconds"] = seconds
    if "error" in data:
        if fault != "error_event":
            raise ActionError(f"{_where(where, 'error')}: only valid with fault 'error_event'")
        kw["error"] = _choice(get("error"), _where(where, "error"), ERROR_KINDS)
    if "error_style" in data:
        if fault != "error_event":
            raise ActionError(
                f"{_where(where, 'error_style')}: only valid with fault 'error_event'"
            )
        kw["error_style"] = _choice(get("error_style"), _where(where, "error_style"), ERROR_STYLES)
    if "rst" in data:
        if not isinstance(get("rst"), bool):
            raise ActionError(f"{_where(where, 'rst')}: expected true or false")
        kw["rst"] = get("rst")
    if "count" in data:
        kw["count"] = _int(get("count"), _where(where, "count"), lo=1, hi=1_000_000)
    if "prefix_echo" in data:
        if not isinstance(get("prefix_echo"), bool):
            raise ActionError(f"{_where(where, 'prefix_echo')}: expected true or false")
        kw["prefix_echo"] = get("prefix_echo")
    if "echo_tail" in data:
        kw["echo_tail"] = _int(get("echo_tail"), _where(where, "echo_tail"), lo=1)
    if "preamble" in data:
        if not isinstance(get("preamble"), str) or not get("preamble"):
            raise ActionError(f"{_where(where, 'preamble')}: expected a non-empty string")
        kw["preamble"] = get("preamble")
    if "refuse_prefill" in data:
        if not isinstance(get("refuse_prefill"), bool):
            raise ActionError(f"{_where(where, 'refuse_prefill')}: expected true or false")
        kw["refuse_prefill"] = get("refuse_prefill")
    if "code" in data:
        if fault not in CODE_FAULTS:
            raise ActionError(
                f"{_where(where, 'code')}: only valid with fault {', '.join(sorted(CODE_FAULTS))}"
            )
        kw["code"] = _int(get("code"), _where(where, "code"), lo=1000, hi=4999)

    if "refuse_background" in data:
        if not isinstance(get("refuse_background"), bool):
            raise ActionError(f"{_where(where, 'refuse_background')}: expected true or false")
        kw["refuse_background"] = get("refuse_background")
    if "resume" in data and get("resume") is not None:
        kw["resume"] = _choice(get("resume"), _where(where, "resume"), RESUME_FAULTS)
    if "response_id" in data:
        if not isinstance(get("response_id"), str) or not get("response_id"):
            raise ActionError(f"{_where(where, 'response_id')}: expected a non-empty string")
        kw["response_id"] = get("response_id")

    status = kw.get("status")
    if fault == "error_event" and status is not None and not 200 <= status < 300:
        raise ActionError(
            f"{_where(where, 'fault')}: 'error_event' cannot be combined with a non-2xx status"
        )
    if "body" in kw and status is None:
        raise ActionError(f"{_where(where, 'body')}: only valid together with 'status'")

    # Normalised, so {} and {"deltas": 8} (the default) give the same ids.
    shape = [
        kw.get("reply", "text"),
        kw.get("text", DEFAULT_TEXT),
        kw.get("deltas", DEFAULT_DELTAS),
        list(kw.get("tool_names", ())),
        list(kw.get("tool_args", ())),
        kw.get("seed"),
    ]
    if kw.get("prefix_echo"):  # it shapes the reply too (only when set: ids stay as they were)
        shape.append("prefix_echo")
    if kw.get("echo_tail"):
        shape.append({"echo_tail": kw["echo_tail"]})
    if kw.get("preamble"):
        shape.append({"preamble": kw["preamble"]})
    if kw.get("response_id"):  # so does a response id of the script's
        shape.append({"response_id": kw["response_id"]})
    kw["shape_key"] = json.dumps(shape, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Action(raw=dict(data), **kw)


def parse_upgrade_action(data: Mapping[str, Any] | Action | None, *, where: str = "") -> Action:
    """Validate a WebSocket upgrade action.

    ``{}`` accepts the upgrade; ``{"status": N}`` refuses it with HTTP status N
    (optionally ``headers`` / ``body``); ``{"fault": "close_before_headers"}``
    drops the connection without an answer (``rst`` for a TCP RST). ``delay_ms``
    and ``count`` work as for request actions.
    """
    if isinstance(data, Action):
        return data
    if isinstance(data, Mapping):
        for key in data:
            if isinstance(key, str) and key not in UPGRADE_KEYS and not key.startswith("_"):
                known = ", ".join(sorted(UPGRADE_KEYS))
                raise ActionError(
                    f"{_where(where, key)}: not valid in an upgrade action (known keys: {known})"
                )
        fault = data.get("fault")
        if fault is not None and fault not in UPGRADE_FAULTS:
            raise ActionError(
                f"{_where(where, 'fault')}: an upgrade action only supports "
                f"{', '.join(UPGRADE_FAULTS)}; got {fault!r}"
            )
    return parse_action(data, where=where)


def expand_upgrade_actions(
    items: Iterable[Mapping[str, Any] | Action], *, where: str = ""
) -> list[Action]:
    """Parse a list of upgrade actions, expanding ``count: N`` into N queue entries."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise ActionError(f"{where or 'upgrades'}: expected a list of upgrade actions")
    out: list[Action] = []
    for index, item in enumerate(items):
        action = parse_upgrade_action(item, where=f"{where or 'upgrades'}[{index}]")
        out.extend([action] * action.count)
    return out


def expand_actions(items: Iterable[Mapping[str, Any] | Action], *, where: str = "") -> list[Action]:
    """Parse a list of actions, expanding ``count: N`` into N queue entries."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise ActionError(f"{where or 'actions'}: expected a list of actions")
    out: list[Action] = []
    for index, item in enumerate(items):
        action = parse_action(item, where=f"{where or 'actions'}[{index}]")
        out.extend([action] * action.count)
    return out
