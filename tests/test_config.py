"""Configuration: schema, errors that name their key, env overrides, routes, secrets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from unbroken.config import (
    BUILTIN_ROUTES,
    Config,
    ConfigError,
    bind_problem,
    load_config,
    parse_config,
)
from unbroken.config_values import validate_url
from unbroken.core.admission.policy import RetryPolicy

SECRET = "sk-live-0123456789abcdef-SECRET"


def parse(data: dict[str, Any], **env: str) -> Config:
    return parse_config(data, env=env)


def error_key(data: dict[str, Any], **env: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env=env)
    assert str(info.value).startswith(info.value.key + ":")
    return info.value.key


# ---------------------------------------------------------------------------
# Defaults


def test_defaults() -> None:
    config = parse({})
    assert config.host == "127.0.0.1"
    assert config.port == 4780
    assert config.grace_s == 30.0
    assert config.retry == RetryPolicy()
    assert config.retry.delay_ms == 250
    assert config.retry.backoff == "fixed"
    assert config.retry.max_delay_ms == 30_000
    assert config.retry.max_attempts == 0
    assert config.retry.honor_retry_after is True
    assert config.retry.max_retry_after_ms == 60_000
    assert config.verbose is True
    assert config.max_body_bytes == 32 * 1024 * 1024
    s = config.stream
    assert s.hold == ("control", "tool_calls")
    assert s.max_hold_bytes == 8 * 1024 * 1024
    assert (s.connect_timeout_s, s.header_timeout_s, s.first_frame_timeout_s) == (10, 120, 300)
    assert (s.idle_timeout_s, s.keepalive_s, s.early_headers_s) == (120, 15, 20)
    assert set(config.routes) == set(BUILTIN_ROUTES)


def test_load_config_without_file_is_defaults() -> None:
    assert load_config(None, env={}) == parse({})


def test_full_config_file(tmp_path: Path) -> None:
    path = tmp_path / "unbroken.toml"
    path.write_text(
        """
[server]
host = "0.0.0.0"
port = 8080
grace_s = 5

[retry]
delay_ms = 100
backoff = "exponential"
max_delay_ms = 4000
max_attempts = 7
honor_retry_after = false
max_retry_after_ms = 1000
verbose = false
max_body_mb = 1.5

[stream]
hold = ["control", "tool_calls", "reasoning"]
max_hold_bytes = 1024
connect_timeout_s = 1.5
header_timeout_s = 2
first_frame_timeout_s = 3
idle_timeout_s = 4
keepalive_s = 5
early_headers_s = 0

[[routes.work.upstreams]]
url = "https://api.example.com/"

[[routes.work.upstreams]]
url = "https://backup.example.com/api"
api_key_env = "BACKUP_KEY"
models = { "m-1" = "vendor/m-1" }

[[routes.work.upstreams]]
url = "http://127.0.0.1:4781"
""",
        encoding="utf-8",
    )
    config = load_config(path, env={"BACKUP_KEY": SECRET})
    assert (config.host, config.port, config.grace_s) == ("0.0.0.0", 8080, 5.0)
    assert config.retry == RetryPolicy(
        delay_ms=100,
        backoff="exponential",
        max_delay_ms=4000,
        max_attempts=7,
        honor_retry_after=False,
        max_retry_after_ms=1000,
    )
    assert config.verbose is False
    assert config.max_body_bytes == int(1.5 * 1024 * 1024)
    assert config.stream.hold == ("control", "tool_calls", "reasoning")
    assert config.stream.max_hold_bytes == 1024
    assert config.stream.early_headers_s == 0
    route = config.routes["work"]
    assert not route.builtin
    assert [u.url for u in route.upstreams] == [
        "https://api.example.com",
        "https://backup.example.com/api",
        "http://127.0.0.1:4781",
    ]
    assert route.upstreams[1].api_key == SECRET
    assert route.upstreams[1].api_key_env == "BACKUP_KEY"
    assert dict(route.upstreams[1].models) == {"m-1": "vendor/m-1"}
    assert route.upstreams[0].api_key is None
    assert SECRET not in repr(config) and SECRET not in str(config)


def test_load_config_from_unbroken_config_env(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[retry]\ndelay_ms = 42\n", encoding="utf-8")
    assert load_config(None, env={"UNBROKEN_CONFIG": str(path)}).retry.delay_ms == 42
    assert load_config(None, env={"UNBROKEN_CONFIG": ""}) == parse({})


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml", env={})
    assert info.value.key == "--config"


def test_load_config_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[retry\ndelay_ms = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == str(path)
    assert "TOML" in str(info.value)


def test_load_config_error_names_nested_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[routes.backup]\nupstreams = ["https://a.example", "ftp://b"]\n', encoding="utf-8"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == "routes.backup.upstreams[1].url"


# ---------------------------------------------------------------------------
# Unknown keys and wrong types


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"retry": {"delai_ms": 1}}, "retry.delai_ms"),
        ({"server": {"hots": "x"}}, "server.hots"),
        ({"stream": {"hold_bytes": 1}}, "stream.hold_bytes"),
        ({"websocket": {"cooldown": 1}}, "websocket.cooldown"),
        ({"retries": {}}, "retries"),
        ({"routes": {"r": {"upstream": ["https://a.example"]}}}, "routes.r.upstream"),
        (
            {"routes": {"r": {"upstreams": [{"url": "https://a.example", "key": "x"}]}}},
            "routes.r.upstreams[0].key",
        ),
    ],
)
def test_unknown_keys_are_named(data: dict[str, Any], key: str) -> None:
    assert error_key(data) == key


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"server": {"port": "4780"}}, "server.port"),
        ({"server": {"port": 4780.0}}, "server.port"),
        ({"server": {"port": True}}, "server.port"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"port": -1}}, "server.port"),
        ({"server": {"host": 127}}, "server.host"),
        ({"server": {"grace_s": "30"}}, "server.grace_s"),
        ({"server": {"grace_s": -1}}, "server.grace_s"),
        ({"retry": {"delay_ms": 1.5}}, "retry.delay_ms"),
        ({"retry": {"delay_ms": -1}}, "retry.delay_ms"),
        ({"retry": {"delay_ms": "250"}}, "retry.delay_ms"),
        ({"retry": {"max_attempts": False}}, "retry.max_attempts"),
        ({"retry": {"honor_retry_after": "yes"}}, "retry.honor_retry_after"),
        ({"retry": {"honor_retry_after": 1}}, "retry.honor_retry_after"),
        ({"retry": {"verbose": "true"}}, "retry.verbose"),
        ({"retry": {"backoff": "linear"}}, "retry.backoff"),
        ({"retry": {"backoff": 2}}, "retry.backoff"),
        ({"retry": {"max_body_mb": "big"}}, "retry.max_body_mb"),
        ({"stream": {"hold": "control"}}, "stream.hold"),
        ({"stream": {"hold": ["control", 1]}}, "stream.hold"),
        ({"stream": {"hold": ["control", "everything"]}}, "stream.hold"),
        ({"stream": {"max_hold_bytes": 1.5}}, "stream.max_hold_bytes"),
        ({"stream": {"connect_timeout_s": 0}}, "stream.connect_timeout_s"),
        ({"stream": {"header_timeout_s": 0}}, "stream.header_timeout_s"),
        ({"stream": {"first_frame_timeout_s": 0}}, "stream.first_frame_timeout_s"),
        ({"stream": {"idle_timeout_s": -5}}, "stream.idle_timeout_s"),
        ({"stream": {"keepalive_s": 0}}, "stream.keepalive_s"),
        ({"stream": {"early_headers_s": "20"}}, "stream.early_headers_s"),
        ({"websocket": {"fallback_cooldown_s": "5"}}, "websocket.fallback_cooldown_s"),
        ({"server": 5}, "server"),
        ({"retry": ["delay_ms"]}, "retry"),
        ({"routes": []}, "routes"),
        ({"routes": {"r": "https://a.example"}}, "routes.r"),
        ({"routes": {"r": {}}}, "routes.r.upstreams"),
        ({"routes": {"r": {"upstreams": []}}}, "routes.r.upstreams"),
        ({"routes": {"r": {"upstreams": "https://a.example"}}}, "routes.r.upstreams"),
        ({"routes": {"r": {"upstreams": [5]}}}, "routes.r.upstreams[0]"),
        ({"routes": {"r": {"upstreams": [{}]}}}, "routes.r.upstreams[0].url"),
        ({"routes": {"r": {"upstreams": [{"url": 5}]}}}, "routes.r.upstreams[0].url"),
        (
            {"routes": {"r": {"upstreams": [{"url": "https://a.example", "api_key_env": 5}]}}},
            "routes.r.upstreams[0].api_key_env",
        ),
        (
            {"routes": {"r": {"upstreams": [{"url": "https://a.example", "models": "m"}]}}},
            "routes.r.upstreams[0].models",
        ),
        (
            {"routes": {"r": {"upstreams": [{"url": "https://a.example", "models": {"a": 1}}]}}},
            "routes.r.upstreams[0].models.a",
        ),
        ({"routes": {"": {"upstreams": ["https://a.example"]}}}, "routes."),
        ({"routes": {"a/b": {"upstreams": ["https://a.example"]}}}, "routes.a/b"),
        ({"routes": {"_mock": {"upstreams": ["https://a.example"]}}}, "routes._mock"),
    ],
)
def test_wrong_values_are_named(data: dict[str, Any], key: str) -> None:
    assert error_key(data) == key


def test_valid_edge_values() -> None:
    config = parse(
        {
            "server": {"port": 0},
            "retry": {"delay_ms": 0, "max_attempts": 1},
            "stream": {"hold": ["all"], "max_hold_bytes": 0},
        }
    )
    assert config.port == 0
    assert config.retry.delay_ms == 0
    assert config.stream.hold == ("all",)
    assert parse({"stream": {"hold": []}}).stream.hold == ()


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("stream", "idle_timeout_s", math.nan),
        ("stream", "connect_timeout_s", math.nan),
        ("server", "grace_s", math.nan),
        ("retry", "max_body_mb", math.inf),
        ("retry", "max_body_mb", math.nan),
    ],
)
def test_non_finite_numbers_rejected(section: str, key: str, value: float) -> None:
    assert error_key({section: {key: value}}) == f"{section}.{key}"


# ---------------------------------------------------------------------------
# URLs


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("https://api.example.com", "https://api.example.com"),
        ("https://api.example.com/", "https://api.example.com"),
        ("https://api.example.com/v1//", "https://api.example.com/v1"),
        ("http://127.0.0.1:4781", "http://127.0.0.1:4781"),
        ("http://[::1]:8080/api", "http://[::1]:8080/api"),
        ("HTTPS://API.EXAMPLE.COM", "HTTPS://API.EXAMPLE.COM"),
        ("ws://api.example.com", "ws://api.example.com"),
        ("wss://api.example.com/v1/", "wss://api.example.com/v1"),
        ("https://api.example.com/a%20b/~x", "https://api.example.com/a%20b/~x"),
    ],
)
def test_good_urls(url: str, normalised: str) -> None:
    assert validate_url("k", url) == normalised
    route = parse({"routes": {"r": {"upstreams": [url]}}}).routes["r"]
    assert route.upstreams[0].url == normalised


@pytest.mark.parametrize(
    "url",
    [
        "api.example.com",
        "ftp://api.example.com",
        "https://",
        "https:///path",
        "https://api.example.com?x=1",
        "https://api.example.com/v1#frag",
        "https://api.example.com:99999",
        "https://api.example.com:port",
        "",
        "file:///etc/passwd",
        # hostile-input review: each of these was accepted, or crashed with a traceback
        "http://[::1",
        "http://[nothost]:80",
        "https://api.example.com/v1\r\nX-Injected: 1",
        "https://api.example.com/v1\n",
        "https://api.example.com/v1\x00",
        "https://api.example.com/a b",
        "https://api.exa mple.com",
        " https://api.example.com",
        "https://api.example.com/\u200bv1",
        "https://user:pw@api.example.com",
        "https://user@api.example.com",
        "https://api.example.com:0",
        "https://api.example.com:",
        "https://api.example.com/%zz",
        "https://api.example.com/caf\u00e9",
        "https://exa\u00e9mple.com",
        "https://api.example.com/a?",
    ],
)
def test_bad_urls(url: str) -> None:
    assert error_key({"routes": {"r": {"upstreams": [{"url": url}]}}}) == (
        "routes.r.upstreams[0].url"
    )
    with pytest.raises(ConfigError) as info:
        validate_url("k", url)
    assert "\n" not in str(info.value)  # one line, whatever the URL held


def test_url_credentials_never_in_logs() -> None:
    try:
        config = parse({"routes": {"r": {"upstreams": ["https://user:s3cr3t@example.com/v1"]}}})
    except ConfigError:
        return  # rejecting userinfo is fine too
    upstream = config.routes["r"].upstreams[0]
    assert "s3cr3t" not in upstream.name
    assert "s3cr3t" not in repr(config)


# ---------------------------------------------------------------------------
# Environment overrides

ENV_CASES = [
    ("DELAY_MS", "1234", "delay_ms", 1234),
    ("MAX_ATTEMPTS", "9", "max_attempts", 9),
    ("HONOR_RETRY_AFTER", "false", "honor_retry_after", False),
    ("MAX_RETRY_AFTER_MS", "5000", "max_retry_after_ms", 5000),
]


@pytest.mark.parametrize(("suffix", "raw", "field", "value"), ENV_CASES)
@pytest.mark.parametrize("prefix", ["UNBROKEN_RETRY_", "OPENCODE_RETRY_"])
def test_env_overrides(prefix: str, suffix: str, raw: str, field: str, value: Any) -> None:
    config = parse(
        {"retry": {"delay_ms": 1, "max_attempts": 2, "max_retry_after_ms": 3}},
        **{prefix + suffix: raw},
    )
    assert getattr(config.retry, field) == value


@pytest.mark.parametrize(("suffix", "raw", "field", "value"), ENV_CASES)
def test_unbroken_name_wins_over_alias(suffix: str, raw: str, field: str, value: Any) -> None:
    other = "true" if raw == "false" else "77"
    config = parse({}, **{"UNBROKEN_RETRY_" + suffix: raw, "OPENCODE_RETRY_" + suffix: other})
    assert getattr(config.retry, field) == value


def test_env_verbose() -> None:
    assert parse({}, UNBROKEN_RETRY_VERBOSE="0").verbose is False
    assert parse({"retry": {"verbose": False}}, OPENCODE_RETRY_VERBOSE="yes").verbose is True
    assert parse({}, OPENCODE_RETRY_VERBOSE="off", UNBROKEN_RETRY_VERBOSE="on").verbose is True


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", " True "])
def test_env_bool_true(raw: str) -> None:
    assert parse({}, UNBROKEN_RETRY_HONOR_RETRY_AFTER=raw).retry.honor_retry_after is True


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "OFF"])
def test_env_bool_false(raw: str) -> None:
    assert parse({}, UNBROKEN_RETRY_HONOR_RETRY_AFTER=raw).retry.honor_retry_after is False


def test_empty_env_value_is_ignored() -> None:
    config = parse(
        {"retry": {"delay_ms": 5}}, UNBROKEN_RETRY_DELAY_MS="", OPENCODE_RETRY_DELAY_MS="7"
    )
    assert config.retry.delay_ms == 7


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("UNBROKEN_RETRY_DELAY_MS", "fast"),
        ("UNBROKEN_RETRY_DELAY_MS", "-5"),
        ("UNBROKEN_RETRY_DELAY_MS", "1.5"),
        ("OPENCODE_RETRY_MAX_ATTEMPTS", "many"),
        ("UNBROKEN_RETRY_HONOR_RETRY_AFTER", "maybe"),
        ("OPENCODE_RETRY_VERBOSE", "2"),
    ],
)
def test_bad_env_values_name_the_variable(var: str, raw: str) -> None:
    assert error_key({}, **{var: raw}) == var


def test_env_overrides_are_not_read_from_process_env_when_env_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNBROKEN_RETRY_DELAY_MS", "999")
    assert parse_config({}, env={}).retry.delay_ms == 250
    assert parse_config({}).retry.delay_ms == 999  # default env is os.environ


# ---------------------------------------------------------------------------
# Routes and secrets


def test_builtin_routes() -> None:
    routes = parse({}).routes
    for name, url in BUILTIN_ROUTES.items():
        route = routes[name]
        assert route.builtin
        assert route.name == name
        assert [u.url for u in route.upstreams] == [url]
        assert route.upstreams[0].api_key is None
    assert {"openai", "anthropic"} <= set(routes)


def test_config_route_replaces_builtin_of_same_name() -> None:
    routes = parse(
        {
            "routes": {
                "openai": {
                    "upstreams": ["https://proxy.example.com/openai", "https://api.openai.com"]
                }
            }
        }
    ).routes
    assert not routes["openai"].builtin
    assert [u.url for u in routes["openai"].upstreams] == [
        "https://proxy.example.com/openai",
        "https://api.openai.com",
    ]
    assert routes["anthropic"].builtin  # the others stay


def test_api_key_env_missing_or_empty() -> None:
    data = {"routes": {"r": {"upstreams": [{"url": "https://a.example", "api_key_env": "MY_KEY"}]}}}
    assert error_key(data) == "routes.r.upstreams[0].api_key_env"
    assert error_key(data, MY_KEY="") == "routes.r.upstreams[0].api_key_env"
    with pytest.raises(ConfigError, match="MY_KEY"):
        parse(data)
    assert parse(data, MY_KEY=SECRET).routes["r"].upstreams[0].api_key == SECRET


def test_api_key_never_in_repr_or_errors() -> None:
    data = {
        "routes": {
            "r": {
                "upstreams": [
                    {"url": "https://a.example", "api_key_env": "K1"},
                    {"url": "https://b.example", "api_key_env": "K2", "models": {"x": "y"}},
                ]
            }
        }
    }
    config = parse(data, K1=SECRET, K2=SECRET + "2")
    for text in (
        repr(config),
        str(config),
        repr(config.routes),
        repr(config.routes["r"]),
        repr(config.routes["r"].upstreams[0]),
        config.routes["r"].upstreams[0].name,
    ):
        assert SECRET not in text
    # a later error in the same config does not leak an earlier key either
    bad = {
        "routes": {
            "r": {"upstreams": [{"url": "https://a.example", "api_key_env": "K1"}, {"url": "nope"}]}
        }
    }
    with pytest.raises(ConfigError) as info:
        parse(bad, K1=SECRET)
    assert SECRET not in str(info.value)


def test_api_key_does_not_affect_equality() -> None:
    data = {"routes": {"r": {"upstreams": [{"url": "https://a.example", "api_key_env": "K"}]}}}
    assert parse(data, K="one").routes["r"] == parse(data, K="two").routes["r"]


# ---------------------------------------------------------------------------
# Route names, access control, limits, file encoding (issue 10)


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "a b?#",
        "a b",
        "a?b",
        "a#b",
        "a%2fb",
        "é",
        "a\x00",
        "t",
        "healthz",
        "status",
        "metrics",
        "_x",
    ],
)
def test_bad_route_names(name: str) -> None:
    assert error_key({"routes": {name: {"upstreams": ["https://a.example"]}}}) == (f"routes.{name}")


@pytest.mark.parametrize("name", ["a", "my-route", "v1.2", "A_b-C.d", "..x", "x.."])
def test_good_route_names(name: str) -> None:
    assert name in parse({"routes": {name: {"upstreams": ["https://a.example"]}}}).routes


TOKEN = "tok-0123456789abcdef-XYZ"


def test_token_from_unbroken_token_env() -> None:
    config = parse({}, UNBROKEN_TOKEN=TOKEN)
    assert config.token == TOKEN and config.token_env == "UNBROKEN_TOKEN"
    assert TOKEN not in repr(config)
    assert TOKEN in config.secrets()
    assert parse({}).token is None
    assert parse({}, UNBROKEN_TOKEN="").token is None


def test_token_env_names_the_variable() -> None:
    config = parse({"server": {"token_env": "MY_TOK"}}, MY_TOK=TOKEN, UNBROKEN_TOKEN="x" * 20)
    assert config.token == TOKEN and config.token_env == "MY_TOK"
    assert error_key({"server": {"token_env": "MY_TOK"}}) == "server.token_env"
    assert error_key({"server": {"token_env": 5}}) == "server.token_env"


@pytest.mark.parametrize("bad", ["short", "has space in it!!", "x" * 15, "tok\nen-0123456789ab"])
def test_weak_or_unsafe_tokens_are_refused_without_echo(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse({}, UNBROKEN_TOKEN=bad)
    assert info.value.key == "UNBROKEN_TOKEN"
    assert bad not in str(info.value)


def test_server_access_and_limit_keys() -> None:
    config = parse(
        {
            "server": {
                "allowed_hosts": ["Relay.Example.com", "box:8080", "*"],
                "allowed_origins": ["https://App.Example.com:443", "http://localhost:3000"],
                "header_read_timeout_s": 2,
                "keepalive_timeout_s": 30,
                "max_connections": 5,
            },
            "stream": {"max_event_bytes": 2048},
            "websocket": {"max_queued_messages": 4},
        }
    )
    assert config.allowed_hosts == ("relay.example.com", "box:8080", "*")
    assert config.allowed_origins == ("https://app.example.com", "http://localhost:3000")
    assert (config.header_read_timeout_s, config.keepalive_timeout_s) == (2.0, 30.0)
    assert config.max_connections == 5
    assert config.stream.max_event_bytes == 2048
    assert config.websocket_max_queued_messages == 4
    d = parse({})
    assert (d.header_read_timeout_s, d.keepalive_timeout_s, d.max_connections) == (10, 75, 1024)
    assert d.stream.max_event_bytes == 16 * 1024 * 1024
    assert d.allowed_hosts == () and d.allowed_origins == ()


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"server": {"allowed_hosts": "x"}}, "server.allowed_hosts"),
        ({"server": {"allowed_hosts": ["a b"]}}, "server.allowed_hosts[0]"),
        ({"server": {"allowed_hosts": ["ok", "http://x"]}}, "server.allowed_hosts[1]"),
        ({"server": {"allowed_hosts": ["x:99999"]}}, "server.allowed_hosts[0]"),
        ({"server": {"allowed_origins": ["app.example.com"]}}, "server.allowed_origins[0]"),
        ({"server": {"allowed_origins": ["https://a.example/path"]}}, "server.allowed_origins[0]"),
        ({"server": {"header_read_timeout_s": 0}}, "server.header_read_timeout_s"),
        ({"server": {"keepalive_timeout_s": -1}}, "server.keepalive_timeout_s"),
        ({"server": {"max_connections": 0}}, "server.max_connections"),
        ({"server": {"max_connections": 1.5}}, "server.max_connections"),
        ({"server": {"host": "a b"}}, "server.host"),
        ({"server": {"host": "http://x"}}, "server.host"),
        ({"stream": {"max_event_bytes": 10}}, "stream.max_event_bytes"),
        ({"websocket": {"max_queued_messages": 0}}, "websocket.max_queued_messages"),
        (
            {
                "routes": {
                    "r": {
                        "upstreams": [{"url": "https://a.example", "key_headers": ["bad header"]}]
                    }
                }
            },
            "routes.r.upstreams[0].key_headers",
        ),
    ],
)
def test_access_and_limit_errors_are_named(data: dict[str, Any], key: str) -> None:
    assert error_key(data) == key


def test_key_headers_are_lower_case() -> None:
    data = {
        "routes": {
            "r": {"upstreams": [{"url": "https://a.example", "key_headers": ["X-Custom-Key"]}]}
        }
    }
    assert parse(data).routes["r"].upstreams[0].key_headers == ("x-custom-key",)


@pytest.mark.parametrize("host", ["", " ", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_token(host: str) -> None:
    config = parse({"server": {"host": host}})
    assert bind_problem(config) is None
    assert config.host.strip() != ""  # "" never means "every interface"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_non_loopback_bind_needs_a_token(host: str) -> None:
    problem = bind_problem(parse({"server": {"host": host}}))
    assert problem is not None and "UNBROKEN_TOKEN" in problem and "\n" not in problem
    assert bind_problem(parse({"server": {"host": host}}, UNBROKEN_TOKEN=TOKEN)) is None


def test_config_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[server]\nhost = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == "--config" and "UTF-8" in str(info.value)


def test_secrets_lists_keys_and_token_longest_first() -> None:
    data = {
        "routes": {
            "r": {
                "upstreams": [
                    {"url": "https://a.example", "api_key_env": "K1"},
                    {"url": "https://b.example", "api_key_env": "K2"},
                ]
            }
        }
    }
    config = parse(data, K1="sk-short-000000", K2="sk-longer-key-0000000", UNBROKEN_TOKEN=TOKEN)
    assert config.secrets() == (TOKEN, "sk-longer-key-0000000", "sk-short-000000")


def test_after_commit_defaults_to_error_and_routes_override_it() -> None:
    cfg = parse_config(
        {
            "stream": {"after_commit": "continue"},
            "routes": {
                "a": {"upstreams": ["http://a"]},
                "b": {"after_commit": "error", "upstreams": ["http://b"]},
            },
        },
        env={},
    )
    assert cfg.stream.after_commit_for(cfg.routes["a"]) == "continue"
    assert cfg.stream.after_commit_for(cfg.routes["b"]) == "error"
    default = parse_config({"routes": {"a": {"upstreams": ["http://a"]}}}, env={})
    assert default.stream.after_commit_for(default.routes["a"]) == "error"
    assert default.stream.after_commit_for(default.routes["openai"]) == "error"


@pytest.mark.parametrize("mode", ["prefix", "prefix_echo", "partial"])
def test_a_route_names_its_chat_prefix_mode(mode: str) -> None:
    cfg = parse_config({"routes": {"ds": {"chat_prefix": mode, "upstreams": ["http://a"]}}}, env={})
    assert cfg.routes["ds"].chat_prefix == mode
    default = parse_config({"routes": {"a": {"upstreams": ["http://a"]}}}, env={})
    assert default.routes["a"].chat_prefix is None


@pytest.mark.parametrize("bad", ["yes", True, 1, ""])
def test_a_bad_chat_prefix_names_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"routes\.ds\.chat_prefix"):
        parse_config({"routes": {"ds": {"chat_prefix": bad, "upstreams": ["http://a"]}}}, env={})
