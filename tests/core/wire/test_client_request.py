"""What a client's request says of itself (`core.wire.client_request`), with plain
values: streamed or not, its session and sticky keys, each upstream's credential."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from unbroken.core.wire.client_request import (
    CREDENTIAL_HEADERS,
    client_credential,
    credentials_of,
    is_streamed,
    session_id_of,
    sticky_key,
)
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, GEMINI, GENERIC, RESPONSES, Protocol

GEMINI_STREAM = "v1beta/models/gemini-2.5-pro:streamGenerateContent"
GEMINI_PLAIN = "v1beta/models/gemini-2.5-pro:generateContent"


@pytest.mark.parametrize(
    ("path", "query", "streamed"),
    [
        (GEMINI_STREAM, "alt=sse", True),
        (GEMINI_STREAM, "key=k&alt=sse", True),
        (GEMINI_STREAM + "/", "alt=sse", True),
        (GEMINI_STREAM, "", False),  # a JSON array: relayed as a plain body
        (GEMINI_STREAM, "alt=json", False),
        (GEMINI_STREAM, "alt=sse2", False),  # a parameter, not a substring
        (GEMINI_STREAM, "xalt=sse", False),
        (GEMINI_PLAIN, "alt=sse", False),  # the method says it first
    ],
)
def test_a_gemini_request_is_streamed_by_its_method_and_alt_sse(
    path: str, query: str, streamed: bool
) -> None:
    # The body and the Accept header say nothing for the Gemini API.
    headers = {"accept": "text/event-stream"}
    assert is_streamed(GEMINI, path, query, {"stream": True}, headers) is streamed
    assert is_streamed(GEMINI, path, query, None, {}) is streamed


@pytest.mark.parametrize("protocol", [CHAT, ANTHROPIC, RESPONSES, GENERIC])
@pytest.mark.parametrize(
    ("parsed", "accept", "streamed"),
    [
        ({"stream": True}, "", True),
        ({"stream": True}, "application/json", True),
        ({"stream": False}, "text/event-stream", False),  # the body decides when it parses
        ({}, "text/event-stream", False),
        ({"stream": "true"}, "", False),  # only the JSON true
        ({"stream": 1}, "", False),
        (None, "text/event-stream", True),  # no JSON body: the Accept header
        (None, "application/json, text/event-stream", True),
        (None, "", False),
        (None, "application/json", False),
    ],
)
def test_any_other_request_is_streamed_by_its_body_else_its_accept_header(
    protocol: Protocol, parsed: dict[str, Any] | None, accept: str, streamed: bool
) -> None:
    headers = CIMultiDict({"Accept": accept} if accept else {})
    path = "v1/chat/completions"
    assert is_streamed(protocol, path, "alt=sse", parsed, headers) is streamed


def test_the_session_key_is_the_first_session_header_set() -> None:
    def sid(h: dict[str, str], body: dict[str, Any] | None = None) -> str | None:
        return session_id_of(CIMultiDict(h), body)

    assert sid({"x-session-id": "a", "session-id": "b"}) == "a"
    assert sid({"session-id": "b", "x-session-affinity": "o"}) == "o"  # order, not position
    assert sid({"X-Claude-Code-Session-Id": "cc"}) == "cc"
    assert sid({"x-session-id": "", "session-id": "b"}) == "b"  # an empty one is not set
    assert sid({"thread-id": "t"}) is None  # stickiness only
    assert sid({"thread-id": "t"}, {"prompt_cache_key": "p"}) == "p"
    assert sid({"session-id": "b"}, {"prompt_cache_key": "p"}) == "b"  # a header first
    assert sid({}, {"prompt_cache_key": ""}) is None
    assert sid({}, {"prompt_cache_key": 7}) is None
    assert sid({}, None) is None


def test_the_sticky_key_also_takes_codex_thread_id() -> None:
    def key(h: dict[str, str], body: dict[str, Any] | None = None) -> str | None:
        return sticky_key(CIMultiDict(h), body)

    assert key({"thread-id": "t"}) == "t"
    assert key({"thread-id": "t", "session-id": "s"}) == "s"  # a session header first
    assert key({"thread-id": "t"}, {"prompt_cache_key": "p"}) == "t"
    assert key({}, {"prompt_cache_key": "p"}) == "p"
    assert key({"Thread-Id": ""}, {}) is None


def test_the_client_credential_is_its_first_credential_header_else_a_key_parameter() -> None:
    assert CREDENTIAL_HEADERS[0] == "authorization"
    both = CIMultiDict({"X-Api-Key": "x", "Authorization": "Bearer a"})
    assert client_credential(both) == "Bearer a"
    assert client_credential({"x-goog-api-key": "AIza-h"}, "alt=sse&key=AIza-q") == "AIza-h"
    assert client_credential({}, "alt=sse&key=AIza-q") == "AIza-q"
    assert client_credential({}, "key=&key=AIza-2") == "AIza-2"  # an empty one is not set
    assert client_credential({}, "alt=sse&monkey=x") == ""
    assert client_credential({"authorization": ""}, "") == ""


def test_each_upstream_counts_its_injected_key_else_the_clients_own() -> None:
    headers = {"authorization": "Bearer client"}
    assert credentials_of([None, "sk-own", ""], headers) == (
        "Bearer client",
        "sk-own",
        "Bearer client",
    )
    assert credentials_of(["sk-1", "sk-2"], headers) == ("sk-1", "sk-2")
    assert credentials_of([None], {}, "key=AIza-q") == ("AIza-q",)
    assert credentials_of([None], {}) == ("",)
    assert credentials_of([], headers) == ()


def test_session_keys_are_the_session_id_and_the_sticky_key_in_one_look() -> None:
    from itertools import product

    from multidict import CIMultiDict, CIMultiDictProxy

    from unbroken.core.wire.client_request import (
        SESSION_HEADERS,
        session_id_of,
        session_keys,
        sticky_key,
    )

    names = [SESSION_HEADERS[0], SESSION_HEADERS[-1], "thread-id"]
    bodies: list[dict[str, object] | None] = [
        None,
        {},
        {"prompt_cache_key": "pck"},
        {"prompt_cache_key": ""},
        {"prompt_cache_key": 3},
    ]
    for values in product([None, "", "v"], repeat=len(names)):
        headers = CIMultiDict(
            (n.upper(), v) for n, v in zip(names, values, strict=True) if v is not None
        )
        proxy = CIMultiDictProxy(headers)
        for body in bodies:
            assert session_keys(proxy, body) == (
                session_id_of(proxy, body),
                sticky_key(proxy, body),
            )
