"""OpenTelemetry (`unbroken.observe.otel`) against a real OTLP/HTTP receiver.

The relay's own exporters (the SDK's OTLP/HTTP ones, configured by the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``) send to an aiohttp server started here, which decodes
the protobuf requests with ``opentelemetry-proto``: the receiver speaks the protocol,
nothing in the relay is replaced.  The mock scripts the faults.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from relayfix import make_config, start_relay
from unbroken.config import parse_config
from unbroken.core.wire.protocols import model_answered, model_asked
from unbroken.mock import MockProvider
from unbroken.observe.otel import otel_from_env, provider_name

PATH = "v1/responses"
BODY: dict[str, Any] = {"model": "gpt-test", "input": "hi", "stream": True}
TEXT = "The quick brown fox jumps over the lazy dog, twice over."
#: frames before the first text delta in background mode (tests/relay/test_continuation_relay)
FIRST_DELTA = 6


@dataclass
class Receiver:
    """An OTLP/HTTP receiver: what the exporters sent, decoded."""

    url: str = ""
    spans: list[tuple[dict[str, Any], Span]] = field(default_factory=list)  # (resource, span)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    content_types: set[str] = field(default_factory=set)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    got = Receiver()

    async def body(request: web.Request) -> bytes:
        got.content_types.add(request.content_type)
        raw = await request.read()
        if request.headers.get("content-encoding") == "gzip":
            raw = gzip.decompress(raw)
        return raw

    async def traces(request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest.FromString(await body(request))
        for rs in req.resource_spans:
            resource = attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                got.spans.extend((resource, span) for span in ss.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def metrics(request: web.Request) -> web.Response:
        got.metrics.append(ExportMetricsServiceRequest.FromString(await body(request)))
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    got.url = f"http://127.0.0.1:{port}"
    yield got
    await runner.cleanup()


@pytest.fixture
def otlp_env(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> Receiver:
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")  # only when flushed
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    return receiver


def _names(spans: list[tuple[dict[str, Any], Span]]) -> list[str]:
    return [s.name for _, s in spans]


async def test_a_retried_parked_and_continued_turn_shows_every_attempt(
    mock: MockProvider, otlp_env: Receiver
) -> None:
    receiver = otlp_env
    mock.script(
        [
            {"status": 503},  # replayed
            {  # rate-limited: the relay learns the budget and the turn waits in its line
                "status": 429,
                "headers": {
                    "x-ratelimit-limit-requests": "600",
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": "200ms",
                },
            },
            # cut after output: continued in place (a background resume)
            {"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 2},
        ]
    )
    cfg = make_config(
        [{"url": mock.url}],
        stream={
            "first_frame_timeout_s": 2,
            "idle_timeout_s": 2,
            "keepalive_s": 30,
            "after_commit": "continue",
            "resume_queued_s": 0.5,
        },
    )
    server, rec = await start_relay(cfg)
    try:
        assert server.otel is not None
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{server.url}/mock/{PATH}", json=BODY, headers={"x-session-id": "s-1"}) as r,
        ):
            assert r.status == 200
            got = await r.read()
        assert got.count(b'"type":"response.completed"') == 1
        [turn] = await rec.wait_turns(1)
        assert turn.outcome == "resumed"
        await asyncio.to_thread(server.otel.force_flush)
    finally:
        await server.stop()

    spans = receiver.spans
    assert receiver.content_types == {"application/x-protobuf"}
    [(resource, root)] = [(r, s) for r, s in spans if not s.parent_span_id]
    assert resource["service.name"] == "unbroken" and resource["service.instance.id"]
    assert root.name == "chat gpt-test"
    assert root.kind == Span.SpanKind.SPAN_KIND_CLIENT
    a = attrs(root.attributes)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == "gpt-test"
    assert a["gen_ai.response.model"]  # the mock's answer names its model
    assert a["gen_ai.conversation.id"] == "s-1"
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == mock.port
    assert a["unbroken.outcome"] == "resumed"
    assert a["unbroken.replayed"] is True
    assert a["unbroken.continued"] is True and a["unbroken.splices"] == 1
    assert a["unbroken.parked"] is True and "ratelimit" in a["unbroken.parked_for"]
    assert a["unbroken.rate_limited"] is True
    assert a["unbroken.continuation"] == "spliced"
    assert "error.type" not in a  # the turn itself succeeded

    # every attempt, in order, each a child of the turn's span and inside it
    children = sorted(
        (s for _, s in spans if s.parent_span_id == root.span_id),
        key=lambda s: s.start_time_unix_nano,
    )
    per = [attrs(s.attributes) for s in children]
    assert [p["unbroken.attempt.number"] for p in per] == list(range(1, len(per) + 1))
    assert len(per) == 4, [(s.name, p) for s, p in zip(children, per, strict=True)]
    assert all(s.trace_id == root.trace_id for s in children)
    assert all(
        root.start_time_unix_nano
        <= s.start_time_unix_nano
        <= s.end_time_unix_nano
        <= root.end_time_unix_nano
        for s in children
    )
    first, limited, cut, resumed = per
    assert first["error.type"] == "503" and first["http.response.status_code"] == 503
    assert first["unbroken.attempt.wait_s"] >= 0 and first["unbroken.attempt.phase"]
    assert children[0].status.code == children[0].status.STATUS_CODE_ERROR
    assert limited["error.type"] == "429" and limited["unbroken.attempt.replay"] is True
    assert cut["unbroken.attempt.parked_for"] == "ratelimit"
    assert cut["unbroken.attempt.queued_s"] > 0
    assert cut["unbroken.attempt.phase"] == "committed"  # cut after output
    assert cut["unbroken.attempt.frames_released"] > 0
    assert resumed["unbroken.attempt.splice"] is True
    assert resumed["unbroken.attempt.outcome"] == "ok"
    assert all(p["server.address"] == "127.0.0.1" for p in per)

    # the GenAI client metrics (the flush's export; the stop exports them once more)
    points: dict[str, list[Any]] = {}
    for req in receiver.metrics[:1]:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points.setdefault(m.name, []).extend(m.histogram.data_points)
    [duration] = points["gen_ai.client.operation.duration"]
    assert duration.count == 1 and duration.sum > 0
    d = attrs(duration.attributes)
    assert d["gen_ai.request.model"] == "gpt-test" and d["gen_ai.provider.name"] == "openai"
    assert "error.type" not in d
    [ttfc] = points["gen_ai.client.operation.time_to_first_chunk"]
    assert ttfc.count == 1 and 0 < ttfc.sum <= duration.sum


async def test_token_usage_is_measured_by_type(mock: MockProvider, otlp_env: Receiver) -> None:
    mock.script([{"text": TEXT}])
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        assert server.otel is not None
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{server.url}/mock/v1/chat/completions", json=body) as r,
        ):
            answer = json.loads(await r.read())
        await rec.wait_turns(1)
        await asyncio.to_thread(server.otel.force_flush)
    finally:
        await server.stop()
    usage = answer["usage"]
    by_type = {}
    for req in otlp_env.metrics[:1]:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "gen_ai.client.token.usage":
                        assert m.unit == "{token}"
                        for p in m.histogram.data_points:
                            by_type[attrs(p.attributes)["gen_ai.token.type"]] = p.sum
    assert by_type == {"input": usage["prompt_tokens"], "output": usage["completion_tokens"]}
    [(_, root)] = [(r, s) for r, s in otlp_env.spans if not s.parent_span_id]
    a = attrs(root.attributes)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["unbroken.replayed"] is False and a["unbroken.parked"] is False


async def test_a_turn_that_ends_in_an_error_says_its_type(
    mock: MockProvider, otlp_env: Receiver
) -> None:
    mock.script([{"status": 400}])
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        assert server.otel is not None
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{server.url}/mock/{PATH}", json=BODY) as r,
        ):
            assert r.status == 400
        await rec.wait_turns(1)
        await asyncio.to_thread(server.otel.force_flush)
    finally:
        await server.stop()
    [(_, root)] = [(r, s) for r, s in otlp_env.spans if not s.parent_span_id]
    assert attrs(root.attributes)["error.type"] == "400"
    assert root.status.code == root.status.STATUS_CODE_ERROR


def test_off_unless_an_endpoint_is_named() -> None:
    cfg = parse_config({}, env={})
    assert otel_from_env(cfg, {}) is None
    assert otel_from_env(cfg, {"OTEL_SERVICE_NAME": "x"}) is None
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    assert otel_from_env(cfg, {**on, "OTEL_SDK_DISABLED": "true"}) is None
    both_off = {**on, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    assert otel_from_env(cfg, both_off) is None
    hooks = otel_from_env(cfg, {**on, "OTEL_METRICS_EXPORTER": "none"})
    assert hooks is not None and hooks.tracer is not None and hooks.instruments is None
    assert hooks.described == "traces over OTLP/HTTP to http://127.0.0.1:9"
    hooks.shutdown()
    one = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://u:secret@127.0.0.1:9/v1/metrics"}
    hooks = otel_from_env(cfg, one)
    assert hooks is not None and hooks.tracer is None and hooks.instruments is not None
    assert hooks.described == "metrics over OTLP/HTTP to https://127.0.0.1:9"
    hooks.shutdown()


def test_grpc_is_refused_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse_config({}, env={})
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    assert otel_from_env(cfg, env) is None
    assert any("only http/protobuf" in r.getMessage() for r in caplog.records)


def test_without_the_variables_nothing_of_opentelemetry_is_imported() -> None:
    """Zero cost when not configured: a relay and a turn's observers load no OTel module."""
    code = (
        "import sys, os\n"
        "for k in list(os.environ):\n"
        "    k.startswith('OTEL_') and os.environ.pop(k)\n"
        "from unbroken.config import parse_config\n"
        "from unbroken.relay.server import RelayServer\n"
        "s = RelayServer(parse_config({}, env={}))\n"
        "assert s.otel is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')"
        " or m.startswith('opentelemetry.exporter')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_provider_names_and_models() -> None:
    assert provider_name("chat") == provider_name("responses") == "openai"
    assert provider_name("anthropic") == "anthropic"
    assert provider_name("gemini") == "gcp.gemini"
    assert provider_name("generic") == "_OTHER"
    assert model_asked({"model": "claude-x"}, "v1/messages") == "claude-x"
    path = "v1beta/models/gemini-2.5-pro:streamGenerateContent"
    assert model_asked(None, path) == "gemini-2.5-pro"
    assert model_asked({"model": "bad name\n"}, "") == ""
    assert model_asked({"model": 3}, "") == ""
    frame = b'data: {"type":"message_start","message":{"id":"m","model":"claude-y"}}\n\n'
    assert model_answered(frame) == "claude-y"
    assert model_answered(b'{"modelVersion": "gemini-2.5-pro-001"}') == "gemini-2.5-pro-001"
    assert model_answered(b'{"instructions": "say \\"model\\": x", "model": "gpt-z"}') == "gpt-z"
    assert model_answered(b'{"text": "no"}') == ""


def test_without_the_extra_one_warning_and_the_relay_runs_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    cfg = parse_config({}, env={})
    assert otel_from_env(cfg, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9"}) is None
    [line] = [r.getMessage() for r in caplog.records if "OpenTelemetry" in r.getMessage()]
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set" in line and ".[otel]" in line


def test_time_to_first_chunk_is_never_early_headers() -> None:
    from unbroken.observe.hooks import AttemptInfo, TurnRecord
    from unbroken.observe.otel import _first_chunk_s

    turn = TurnRecord(route="r", path="p", protocol="chat", stream=True, started=100.0)
    failed = AttemptInfo(number=1, upstream="u", started=100.0, ended=100.5)
    answered = AttemptInfo(number=2, upstream="u", started=130.0, ended=131.0, frames_released=3)
    turn.attempt_log = [failed, answered]
    turn.first_byte_at = 120.0  # early headers, during the wait before attempt 2
    assert _first_chunk_s(turn) == 30.0
    turn.first_byte_at = 130.4  # headers with the first frame
    assert _first_chunk_s(turn) == pytest.approx(30.4)
    answered.frames_released = 0  # no frame reached the client: no first chunk
    assert _first_chunk_s(turn) is None
    answered.frames_released, turn.stream = 3, False  # not streamed
    assert _first_chunk_s(turn) is None
