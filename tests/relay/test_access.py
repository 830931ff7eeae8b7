"""The pure access rules and request-target parsing (``unbroken.relay.access``)."""

from __future__ import annotations

import pytest

from unbroken.config import parse_config
from unbroken.relay.access import Access, Denied, Target, parse_target

TOKEN = "tok-0123456789abcdef-XYZ"


def _access(
    port: int = 4780, host: str = "127.0.0.1", token: str | None = None, **server: object
) -> Access:
    env = {"UNBROKEN_TOKEN": token} if token else {}
    cfg = parse_config({"server": {"host": host, **server}}, env=env)
    return Access(cfg, port)


# -- request-targets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "name", "rest", "query", "token"),
    [
        ("/mock/v1/chat/completions", "mock", "v1/chat/completions", "", None),
        ("/mock/v1/x?a=%23&b=c%20d", "mock", "v1/x", "a=%23&b=c%20d", None),
        ("/mock/v1/a%2Fb/c%3F", "mock", "v1/a%2Fb/c%3F", "", None),  # never decoded
        ("/mock/", "mock", "", "", None),
        ("/mock//v1", "mock", "/v1", "", None),
        (f"/t/{TOKEN}/mock/v1/messages?beta=true", "mock", "v1/messages", "beta=true", TOKEN),
        (f"/t/{TOKEN}/healthz", "healthz", "", "", TOKEN),
        ("/healthz", "healthz", "", "", None),
        ("/mock/v1/x?q=a/b?c", "mock", "v1/x", "q=a/b?c", None),
        ("/mock/v1/..x/x..", "mock", "v1/..x/x..", "", None),
        ("/mock/v1/a;b=c/..x;y", "mock", "v1/a;b=c/..x;y", "", None),  # a parameter, no dots
    ],
)
def test_targets_split_raw(raw: str, name: str, rest: str, query: str, token: str | None) -> None:
    t = parse_target(raw)
    assert isinstance(t, Target)
    assert (t.name, t.rest, t.query, t.token) == (name, rest, query, token)


@pytest.mark.parametrize(
    "raw",
    [
        "/mock/v1/chat%00",  # a NUL gave a 500 and a traceback
        "/mock/v1/%0d%0aX-Injected:%201",
        "/mock/v1/%7f",
        "/mock/v1/a b",
        "/mock/v1/\x01",
        "/mock/v1/x#frag",
        "/mock/v1/x?a=#b",
        "/mock/../../etc",
        "/mock/v1/%2e%2e/secret",
        "/mock/v1/.%2E/secret",
        "/mock/v1/./x",
        "/mock/..%2f..%2fadmin",  # decodes to ../.. upstream: the base path escape
        "/mock/v1/..%2Fadmin",
        # path parameters: Tomcat and friends strip ";..." and then see "..": traversal
        "/mock/..;/admin",
        "/mock/v1/..;x=1/..;/admin",
        "/mock/v1/.;/x",
        "/mock/v1/%2e%2e;/admin",
        "/mock/v1/..%3b/admin",
        "/mock/v1/..%3B/..%3Bjsessionid=x/admin",
        "/mock/v1/..;%2fadmin",
        "/mock/v1/caf\u00e9",
        "/mock/v1/%zz",
        "/mock/v1/%4",
        "/mock/v1/<script>",
        "http://evil.example/mock/v1",
        "*",
        "//evil.example/mock",
        "",
    ],
)
def test_bad_targets_are_400(raw: str) -> None:
    d = parse_target(raw)
    assert isinstance(d, Denied) and d.status == 400


# -- Host ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:4780", True),
        ("localhost:4780", True),
        ("LOCALHOST:4780", True),
        ("[::1]:4780", True),
        ("127.0.0.1:4781", False),  # another port
        ("localhost", False),  # no port: only on port 80
        ("attacker-rebind.example:4780", False),  # DNS rebinding
        ("127.0.0.1.evil.example:4780", False),
        ("evil.example", False),
        ("", False),
        (None, False),
        ("a b:4780", False),
        ("user@127.0.0.1:4780", False),
    ],
)
def test_host_allow_list_on_loopback(host: str | None, ok: bool) -> None:
    assert _access().host_ok(host) is ok


def test_allowed_hosts_and_wildcard_bind() -> None:
    a = _access(host="0.0.0.0", token=TOKEN, allowed_hosts=["relay.example.com", "box:9000"])
    assert a.host_ok("relay.example.com")  # no port: behind a reverse proxy
    assert a.host_ok("relay.example.com:4780")
    assert a.host_ok("box:9000") and not a.host_ok("box:4780")
    assert a.host_ok("192.168.1.20:4780")  # an IP literal cannot come from rebinding
    assert not a.host_ok("192.168.1.20:80")
    assert not a.host_ok("other.example.com:4780")
    assert not a.host_ok("0.0.0.0.nip.io:4780")
    bound = _access(host="192.168.1.20", token=TOKEN)
    assert bound.host_ok("192.168.1.20:4780")
    assert not bound.host_ok("10.0.0.1:4780")  # bound to one address: only that one
    assert _access(allowed_hosts=["*"]).host_ok("anything.example")
    assert _access(port=80).host_ok("localhost")


# -- Origin and token ----------------------------------------------------------------------


def test_origin_needs_the_allow_list() -> None:
    a = _access(allowed_origins=["https://app.example.com"])
    assert a.origin_ok("https://app.example.com")
    assert a.origin_ok("HTTPS://APP.EXAMPLE.COM:443")
    assert not a.origin_ok("https://evil.example")
    assert not a.origin_ok("null")
    assert not a.origin_ok("https://app.example.com.evil.example")
    assert not _access().origin_ok("http://127.0.0.1:4780")


def _check(a: Access, raw: str, headers: dict[str, str], open_path: bool = False) -> int | None:
    t = parse_target(raw)
    assert isinstance(t, Target)
    d = a.check(t, headers, open_path=open_path)
    return None if d is None else d.status


def test_check_order_and_token() -> None:
    a = _access(token=TOKEN)
    good = {"host": "127.0.0.1:4780"}
    assert _check(a, "/mock/v1/x", good) == 401
    assert _check(a, "/mock/v1/x", {**good, "x-unbroken-token": TOKEN}) is None
    assert _check(a, "/mock/v1/x", {**good, "x-unbroken-token": TOKEN + "x"}) == 401
    assert _check(a, "/mock/v1/x", {**good, "x-unbroken-token": TOKEN[:-1]}) == 401
    assert _check(a, "/mock/v1/x", {**good, "x-unbroken-token": "é" * 20}) == 401
    assert _check(a, f"/t/{TOKEN}/mock/v1/x", good) is None
    assert _check(a, "/t/wrong-token-000000000/mock/v1/x", good) == 401
    assert _check(a, "/healthz", good, open_path=True) is None
    # Host before Origin before token: a rebinding page learns nothing about the token
    assert _check(a, "/mock/v1/x", {"host": "evil.example:4780"}) == 421
    assert (
        _check(
            a, "/mock/v1/x", {**good, "origin": "https://evil.example", "x-unbroken-token": TOKEN}
        )
        == 403
    )
    # without a token configured, no token is asked for
    assert _check(_access(), "/mock/v1/x", good) is None


def test_token_compare_is_constant_time() -> None:
    import inspect

    from unbroken.relay import access

    # every token check (the configured token, the keyed routes' token) goes through _same
    assert "compare_digest" in inspect.getsource(access._same)
    assert "_same(" in inspect.getsource(access.Access.token_ok)
    assert inspect.getsource(access.Access.check).count("_same(") == 2


def test_denials_never_echo_the_token() -> None:
    a = _access(token=TOKEN)
    t = parse_target(f"/t/{TOKEN}x/mock/v1")
    assert isinstance(t, Target)
    d = a.check(t, {"host": "127.0.0.1:4780"}, open_path=False)
    assert d is not None and TOKEN not in d.message
    assert TOKEN not in repr(t) and TOKEN not in t.path
