"""The pure helpers of ``unbroken.relay.upstream``: headers, URLs, bodies, redaction."""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from unbroken.config import Upstream
from unbroken.core.wire.redact import REDACTED, Redactor, redact
from unbroken.relay.upstream import (
    body_for,
    decoded_body,
    parse_body,
    request_headers,
    response_headers,
    upstream_url,
    via_entry,
)

KEY = "sk-injected-0123456789"
KEYED = Upstream(url="https://api.example.com/v1", api_key_env="K", api_key=KEY)
PLAIN = Upstream(url="https://api.example.com/v1")

VIA = via_entry()


def _h(**kv: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in kv.items()})


# -- credentials ---------------------------------------------------------------------------


def test_keyed_route_forwards_no_other_key() -> None:
    """Review finding: api-key and x-goog-api-key went upstream next to the injected key."""
    sent = _h(
        authorization="Bearer sk-client",
        x_api_key="sk-client2",
        api_key="sk-client3",
        x_goog_api_key="sk-client4",
        openai_beta="b",
    )
    out = request_headers(sent, KEYED, anthropic=False, via=VIA)
    assert out["Authorization"] == f"Bearer {KEY}"
    for h in ("x-api-key", "api-key", "x-goog-api-key"):
        assert h not in out
    assert "sk-client" not in json.dumps(list(out.items()))
    assert out["openai-beta"] == "b"


@pytest.mark.parametrize(
    ("sent", "anthropic", "target", "value"),
    [
        ({}, False, "authorization", f"Bearer {KEY}"),
        ({}, True, "x-api-key", KEY),
        ({"x-api-key": "c"}, False, "x-api-key", KEY),
        ({"authorization": "Bearer c"}, True, "authorization", f"Bearer {KEY}"),
        ({"authorization": "Bearer c", "x-api-key": "c"}, True, "x-api-key", KEY),
        ({"api-key": "c"}, False, "api-key", KEY),  # Azure style
        ({"x-goog-api-key": "c"}, False, "x-goog-api-key", KEY),
    ],
)
def test_key_goes_where_the_client_put_its_own(
    sent: dict[str, str], anthropic: bool, target: str, value: str
) -> None:
    out = request_headers(CIMultiDict(sent), KEYED, anthropic=anthropic, via=VIA)
    assert out[target] == value
    creds = [h for h in ("authorization", "x-api-key", "api-key", "x-goog-api-key") if h in out]
    assert creds == [target]


def test_declared_key_headers_are_dropped_too() -> None:
    up = Upstream(
        url="https://a.example", api_key_env="K", api_key=KEY, key_headers=("x-custom-key",)
    )
    out = request_headers(
        _h(x_custom_key="sk-client", authorization="Bearer c"), up, anthropic=False, via=VIA
    )
    assert "x-custom-key" not in out and out["Authorization"] == f"Bearer {KEY}"
    only = request_headers(_h(x_custom_key="sk-client"), up, anthropic=False, via=VIA)
    assert only["x-custom-key"] == KEY and "authorization" not in only


def test_without_injection_client_credentials_pass_and_token_never() -> None:
    sent = _h(authorization="Bearer sk-client", x_unbroken_token="tok-secret-0000000000")
    out = request_headers(sent, PLAIN, anthropic=False, via=VIA)
    assert out["Authorization"] == "Bearer sk-client"
    assert "x-unbroken-token" not in out
    assert "x-unbroken-token" not in request_headers(sent, KEYED, anthropic=False, via=VIA)


def test_upstream_cors_headers_are_dropped() -> None:
    up = {
        "Access-Control-Allow-Origin": "*",
        "access-control-allow-credentials": "true",
        "Content-Type": "application/json",
        "Content-Length": "5",
        "x-request-id": "r",
    }
    out = response_headers(up, keep_length=True)
    assert not [k for k in out if k.lower().startswith("access-control-")]
    assert out["content-length"] == "5" and out["x-request-id"] == "r"


# -- URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rest", "query", "want"),
    [
        ("chat/completions", "", "https://api.example.com/v1/chat/completions"),
        ("a%2Fb/c%20d", "x=%23y&z=1%262", "https://api.example.com/v1/a%2Fb/c%20d?x=%23y&z=1%262"),
        ("", "", "https://api.example.com/v1"),
        ("x", "q=a/b?c", "https://api.example.com/v1/x?q=a/b?c"),
    ],
)
def test_upstream_url_is_byte_for_byte(rest: str, query: str, want: str) -> None:
    url = upstream_url(PLAIN, rest, query)
    assert str(url) == want
    assert url.raw_path_qs == want.removeprefix("https://api.example.com")


def test_websocket_scheme_upstreams_give_their_http_form() -> None:
    assert str(upstream_url(Upstream(url="wss://h.example/api"), "v1/responses", "")) == (
        "https://h.example/api/v1/responses"
    )
    assert str(upstream_url(Upstream(url="ws://127.0.0.1:9"), "v1", "")) == "http://127.0.0.1:9/v1"


# -- bodies --------------------------------------------------------------------------------

CHAT = {"model": "m-1", "messages": [{"role": "user", "content": "héllo"}], "stream": True}
RENAMES = Upstream(url="https://a.example", models={"m-1": "vendor/m-1"})


def test_gzip_body_is_byte_identical_without_a_rename() -> None:
    gz = gzip.compress(json.dumps(CHAT).encode())
    assert body_for(gz, None, PLAIN) is gz
    parsed = parse_body(
        gz, {"content-type": "application/json", "content-encoding": "gzip"}, 1 << 20
    )
    assert parsed == CHAT
    assert body_for(gz, parsed, PLAIN, content_encoding="gzip") is gz


@pytest.mark.parametrize("encoding", ["gzip", "deflate", None])
def test_a_rename_is_re_encoded_in_the_same_encoding(encoding: str | None) -> None:
    raw = json.dumps(CHAT).encode()
    encode: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}
    body = encode.get(encoding or "", bytes)(raw)
    parsed = parse_body(
        body,
        {
            "content-type": "application/json",
            **({"content-encoding": encoding} if encoding else {}),
        },
        1 << 20,
    )
    assert parsed == CHAT
    out = body_for(body, parsed, RENAMES, content_encoding=encoding)
    decoded = decoded_body(out, encoding, 1 << 20)
    assert decoded is not None and json.loads(decoded)["model"] == "vendor/m-1"
    # the caller that forgot content_encoding still gets gzip for a gzip body
    if encoding == "gzip":
        assert gzip.decompress(body_for(body, parsed, RENAMES))


def test_decoding_is_bounded_and_never_raises() -> None:
    bomb = gzip.compress(b"{" + b" " * (10 << 20) + b"}")
    assert len(bomb) < 20_000
    assert decoded_body(bomb, "gzip", 1 << 20) is None  # larger than the limit decoded
    assert decoded_body(b"not gzip", "gzip", 100) is None
    assert decoded_body(b"x", "br", 100) is None
    assert decoded_body(gzip.compress(b"ab")[:-3], "gzip", 100) is None  # truncated
    assert (
        parse_body(b"x", {"content-type": "application/json", "content-encoding": "zstd"}, 10)
        is None
    )
    unknown = Upstream(url="https://a.example", models={"m-1": "x"})
    assert body_for(b"\x28\xb5", CHAT, unknown, content_encoding="zstd") == b"\x28\xb5"


# -- redaction -----------------------------------------------------------------------------


def test_redact_replaces_every_known_secret() -> None:
    body = f'{{"error": {{"message": "Incorrect API key provided: {KEY}. x {KEY}"}}}}'.encode()
    out = redact(body, [KEY, "short"])
    assert KEY.encode() not in out and out.count(REDACTED.encode()) == 2
    assert redact(b"nothing here", [KEY]) == b"nothing here"
    assert redact(b"a short text", ["short"]) == b"a short text"  # too short to search for


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.binary(max_size=40),
    suffix=st.binary(max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    times=st.integers(0, 3),
)
def test_streaming_redactor_equals_redact_whatever_the_chunking(
    prefix: bytes, suffix: bytes, cuts: list[int], times: int
) -> None:
    body = prefix + (KEY.encode() + b"|") * times + suffix
    r = Redactor([KEY, "tok-0123456789abcdefXYZ"])
    bounds = [0, *sorted({min(c, len(body)) for c in cuts}), len(body)]
    out = b"".join(r.feed(body[a:b]) for a, b in itertools.pairwise(bounds))
    out += r.flush()
    assert out == redact(body, [KEY, "tok-0123456789abcdefXYZ"])
    assert KEY.encode() not in out
    idle = Redactor([])
    assert not idle.active and idle.feed(b"abc") == b"abc" and idle.flush() == b""


def test_header_name_memos_decide_as_the_rules_and_stay_bounded() -> None:
    """`request_headers` and `response_headers` remember each name's verdict: the same
    headers go (or not) whatever the case, and a stream of new names cannot grow them."""
    from multidict import CIMultiDict

    from unbroken.relay import upstream as up

    incoming = CIMultiDict(
        [("Content-Length", "3"), ("ACCESS-CONTROL-ALLOW-ORIGIN", "*"), ("X-Kept", "1")]
    )
    for _ in range(2):  # learned, then remembered
        assert list(up.response_headers(incoming, keep_length=False).items()) == [("X-Kept", "1")]
        assert list(up.response_headers(incoming, keep_length=True).items()) == [
            ("Content-Length", "3"),
            ("X-Kept", "1"),
        ]
    for i in range(3 * up._MAX_NAMES):
        up.response_headers({f"x-new-{i}": "v"}, keep_length=False)
        up._request_name(f"X-New-{i}")
    assert up._response_name.cache_info().currsize <= up._MAX_NAMES
    assert up._request_name.cache_info().currsize <= up._MAX_NAMES
