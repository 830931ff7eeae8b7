"""OpenTelemetry: a trace per turn, a child span per attempt, the GenAI client metrics.

Off unless the standard OTLP variables name an endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT`` for one signal);
then the ``otel`` extra's packages are imported, and only then: a relay without them
configured imports and calls nothing of OpenTelemetry.  The SDK's OTLP/HTTP exporters
read the rest of the standard variables themselves (headers, timeout, compression,
certificates); ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the service
(``unbroken`` by default); ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER=none`` turn it (or one signal) off.

The spans are made when a turn ends, from its record (`TurnRecord` and its attempts),
with the start and end times the record holds: nothing is called while the turn runs.
The attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``,
``server.*``, ``error.type``); ``unbroken.*`` ones say what the relay did.  No attribute
carries a header, a key, a prompt or an answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from unbroken.config import Config
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord

if TYPE_CHECKING:  # the extra's packages, for the types only
    from opentelemetry.metrics import Histogram
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

__all__ = ["OTEL_ENDPOINT_VARS", "OtelHooks", "otel_from_env", "provider_name"]

log = logging.getLogger("unbroken")

#: the variables that turn it on (any one of them, not empty)
OTEL_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
_OPERATION = "chat"
#: ``gen_ai.provider.name`` by the protocol a turn speaks (semantic conventions' values)
_PROVIDERS = {
    "chat": "openai",
    "responses": "openai",
    "responses-ws": "openai",
    "anthropic": "anthropic",
    "gemini": "gcp.gemini",
}
#: outcomes that are the operation ending in an error (``error.type`` is set)
_ERRORS = frozenset({"ended_with_error", "passed_through_error", "aborted_by_client"})
_ERRORS_INTERNAL = "internal_error"
#: the buckets the semantic conventions advise: seconds, and tokens
_SECONDS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TOKENS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 67108864


def provider_name(protocol: str) -> str:
    """``gen_ai.provider.name`` for a route's protocol (``_OTHER`` for any other API)."""
    return _PROVIDERS.get(protocol, "_OTHER")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _wanted(env: Mapping[str, str], signal: str) -> bool:
    """Whether ``signal`` (TRACES, METRICS) is to be exported, by the variables."""
    if (env.get(f"OTEL_{signal}_EXPORTER") or "otlp").strip().lower() == "none":
        return False
    return bool(
        (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
        or (env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or "").strip()
    )


def _protocol_ok(env: Mapping[str, str], signal: str) -> bool:
    protocol = (
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol.strip() == "http/protobuf":
        return True
    log.warning(
        "OpenTelemetry: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported, only http/protobuf "
        "(a collector's port 4318): no %s are exported",
        protocol.strip()[:40],
        signal.lower(),
    )
    return False


def otel_from_env(config: Config, env: Mapping[str, str] | None = None) -> OtelHooks | None:
    """The OpenTelemetry observer the variables ask for, or None (nothing configured,
    disabled, or the ``otel`` extra is not installed: then one warning says so)."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return None
    traces, metrics = _wanted(env, "TRACES"), _wanted(env, "METRICS")
    if not (traces or metrics):
        return None
    traces = traces and _protocol_ok(env, "TRACES")
    metrics = metrics and _protocol_ok(env, "METRICS")
    if not (traces or metrics):
        return None
    try:
        tracer_provider, meter_provider = _providers(env, traces=traces, metrics=metrics)
    except ImportError as e:
        log.warning(
            "OpenTelemetry: %s is set but its packages are not installed (%s): "
            "pip install -e '.[otel]' in unbroken's clone; nothing is exported",
            next(name for name in OTEL_ENDPOINT_VARS if (env.get(name) or "").strip()),
            e.name,
        )
        return None
    hooks = OtelHooks(config, tracer_provider, meter_provider)
    signals = [name for name, on in (("traces", traces), ("metrics", metrics)) if on]
    ends = {_where(env.get(f"OTEL_EXPORTER_OTLP_{s.upper()}_ENDPOINT") or "") for s in signals}
    hooks.described = f"{' and '.join(signals)} over OTLP/HTTP to " + ", ".join(
        sorted(end or _where(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "") for end in ends)
    )
    return hooks


def _where(url: str) -> str:
    """An endpoint as a log may show it: scheme, host and port (no credentials, path)."""
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return "?"
    if not host:
        return ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def _providers(
    env: Mapping[str, str], *, traces: bool, metrics: bool
) -> tuple[TracerProvider | None, MeterProvider | None]:
    """The SDK's providers with OTLP/HTTP exporters (imported here, and only here)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from unbroken import __version__

    given = env.get("OTEL_RESOURCE_ATTRIBUTES") or ""
    # Each process is an instance of its own (``serve --workers N``: a backend tells
    # the workers' series apart); the variables win over these defaults.
    ours: dict[str, str] = {}
    if "service.version=" not in given:
        ours["service.version"] = __version__
    if not ((env.get("OTEL_SERVICE_NAME") or "").strip() or "service.name=" in given):
        ours["service.name"] = "unbroken"
    if "service.instance.id=" not in given:
        ours["service.instance.id"] = str(uuid.uuid4())
    resource = Resource.create(ours)
    tracer_provider = meter_provider = None
    if traces:
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if metrics:
        # (OTEL_METRIC_EXPORT_INTERVAL sets how often; 60 s by default)
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    return tracer_provider, meter_provider


@dataclass(frozen=True, slots=True)
class _Instruments:
    duration: Histogram
    tokens: Histogram
    first_chunk: Histogram


def _server(url: str) -> tuple[str, int] | None:
    """``server.address`` and ``server.port`` of an upstream URL."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return host, port or (443 if parts.scheme in ("https", "wss") else 80)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class OtelHooks(Hooks):
    """Makes each ended turn's spans and measurements (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
    ) -> None:
        from unbroken import __version__

        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        #: what is exported where, for the relay's start-up line
        self.described = "OpenTelemetry"
        #: (route, upstream name) -> (server.address, server.port)
        self._servers: dict[tuple[str, str], tuple[str, int]] = {}
        for route in config.routes.values():
            for up in route.upstreams:
                server = _server(up.url)
                if server is not None:
                    self._servers[route.name, up.name] = server
        self.tracer: Tracer | None = None
        if tracer_provider is not None:
            self.tracer = tracer_provider.get_tracer("unbroken", __version__)
        self.instruments: _Instruments | None = None
        if meter_provider is not None:
            meter = meter_provider.get_meter("unbroken", __version__)
            self.instruments = _Instruments(
                duration=meter.create_histogram(
                    "gen_ai.client.operation.duration",
                    unit="s",
                    description="GenAI operation duration",
                    explicit_bucket_boundaries_advisory=_SECONDS,
                ),
                tokens=meter.create_histogram(
                    "gen_ai.client.token.usage",
                    unit="{token}",
                    description="Number of input and output tokens used",
                    explicit_bucket_boundaries_advisory=_TOKENS,
                ),
                first_chunk=meter.create_histogram(
                    "gen_ai.client.operation.time_to_first_chunk",
                    unit="s",
                    description="Time to receive the first chunk of a streamed answer",
                    explicit_bucket_boundaries_advisory=_SECONDS,
                ),
            )

    # -- the hook ------------------------------------------------------------------------
    def turn_ended(self, turn: TurnRecord) -> None:
        if turn.ended is None:
            return
        common = self._common(turn)
        if self.tracer is not None:
            self._trace(self.tracer, turn, common)
        if self.instruments is not None:
            self._measure(self.instruments, turn, common)

    # -- what is said of a turn --------------------------------------------------------------
    def _common(self, turn: TurnRecord) -> dict[str, Any]:
        """The attributes the turn's span and its measurements share."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": _OPERATION,
            "gen_ai.provider.name": provider_name(turn.protocol),
        }
        if turn.model:
            attrs["gen_ai.request.model"] = turn.model
        answered = next(
            (a.response_model for a in reversed(turn.attempt_log) if a.response_model), ""
        )
        if answered:
            attrs["gen_ai.response.model"] = answered
        server = self._servers.get((turn.route, turn.upstream))
        if server is not None:
            attrs["server.address"], attrs["server.port"] = server
        error = _error_type(turn)
        if error is not None:
            attrs["error.type"] = error
        return attrs

    def _trace(self, tracer: Tracer, turn: TurnRecord, common: dict[str, Any]) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        assert turn.ended is not None
        attempts = turn.attempt_log
        replayed = any(a.wait_s is not None and a.phase != "committed" for a in attempts[:-1])
        # (the turn's own ``parked_for`` too: a turn can end while it waits in a line)
        reasons = {a.parked_for for a in attempts if a.parked_for}
        if turn.parked_for:
            reasons.add(turn.parked_for)
        parked = sorted(reasons)
        attrs = {**common, **_turn_facts(turn)}
        attrs["unbroken.replayed"] = replayed
        attrs["unbroken.continued"] = turn.splices > 0
        attrs["unbroken.parked"] = bool(parked)
        if parked:
            attrs["unbroken.parked_for"] = parked
        attrs["unbroken.rate_limited"] = turn.queued_s > 0 or any(
            a.status == 429 or a.parked_for == "ratelimit" for a in attempts
        )
        usage_in, usage_out = _usage(attempts)
        if usage_in is not None:
            attrs["gen_ai.usage.input_tokens"] = usage_in
        if usage_out is not None:
            attrs["gen_ai.usage.output_tokens"] = usage_out
        name = f"{_OPERATION} {turn.model}" if turn.model else _OPERATION
        span = tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes=attrs, start_time=_ns(turn.started)
        )
        context = set_span_in_context(span)
        before: AttemptInfo | None = None
        for a in attempts:
            child = tracer.start_span(
                f"attempt {a.number} {a.upstream}",
                context=context,
                kind=SpanKind.INTERNAL,
                attributes=self._attempt_attrs(turn, a, before),
                start_time=_ns(a.started),
            )
            if a.reason != "ok":
                child.set_status(Status(StatusCode.ERROR, a.reason))
            child.end(end_time=_ns(a.ended if a.ended is not None else turn.ended))
            before = a
        if "error.type" in common:
            span.set_status(Status(StatusCode.ERROR, str(common["error.type"])))
        span.end(end_time=_ns(turn.ended))

    def _attempt_attrs(
        self, turn: TurnRecord, a: AttemptInfo, before: AttemptInfo | None
    ) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": _OPERATION,
            "gen_ai.provider.name": provider_name(turn.protocol),
            "unbroken.attempt.number": a.number,
            "unbroken.upstream": a.upstream,
            "unbroken.attempt.outcome": a.reason or "unknown",
            # this attempt replays the request (nothing was released before it), or
            # continues a turn cut after output in place (a splice)
            "unbroken.attempt.replay": before is not None and before.phase != "committed",
            "unbroken.attempt.splice": before is not None and before.phase == "committed",
            "unbroken.attempt.frames_received": a.frames_received,
            "unbroken.attempt.frames_released": a.frames_released,
            "unbroken.attempt.bytes_received": a.bytes_received,
            "unbroken.attempt.bytes_released": a.bytes_released,
            "unbroken.attempt.hold_s": a.hold_seconds,
        }
        if turn.model:
            attrs["gen_ai.request.model"] = turn.model
        if a.response_model:
            attrs["gen_ai.response.model"] = a.response_model
        server = self._servers.get((turn.route, a.upstream))
        if server is not None:
            attrs["server.address"], attrs["server.port"] = server
        if a.choice:
            attrs["unbroken.attempt.choice"] = a.choice
        if a.status is not None:
            attrs["http.response.status_code"] = a.status
        if a.reason and a.reason != "ok":
            attrs["error.type"] = a.reason
            if a.phase:
                attrs["unbroken.attempt.phase"] = a.phase
        if a.wait_s is not None:
            attrs["unbroken.attempt.wait_s"] = a.wait_s
        if a.parked_for:
            attrs["unbroken.attempt.parked_for"] = a.parked_for
            attrs["unbroken.attempt.queued_s"] = a.queued_s
        if a.input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = a.input_tokens
        if a.output_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = a.output_tokens
        if a.reason != "ok" and a.est_output_tokens:
            attrs["unbroken.attempt.est_output_tokens"] = a.est_output_tokens
        return attrs

    def _measure(self, inst: _Instruments, turn: TurnRecord, common: dict[str, Any]) -> None:
        assert turn.ended is not None
        inst.duration.record(max(0.0, turn.ended - turn.started), common)
        usage_in, usage_out = _usage(turn.attempt_log)
        if usage_in is not None:
            inst.tokens.record(usage_in, {**common, "gen_ai.token.type": "input"})
        if usage_out is not None:
            inst.tokens.record(usage_out, {**common, "gen_ai.token.type": "output"})
        first_chunk = _first_chunk_s(turn)
        if first_chunk is not None:
            inst.first_chunk.record(first_chunk, common)

    # -- the relay's life --------------------------------------------------------------------
    async def aclose(self, timeout_s: float = 5.0) -> None:
        """`shutdown` in a thread of its own, waited for at most ``timeout_s``: a
        collector that does not answer never holds the relay's stop for longer."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self.shutdown()
            except Exception:
                log.exception("OpenTelemetry: the shutdown failed")
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

        threading.Thread(target=run, name="unbroken-otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            log.warning(
                "OpenTelemetry: the last spans and metrics were not exported within %.0f s",
                timeout_s,
            )

    def shutdown(self) -> None:
        """Export what is pending and stop (blocking: run it in a thread)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()

    def force_flush(self) -> None:
        """Export what is pending now (blocking: run it in a thread)."""
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()
        if self.meter_provider is not None:
            self.meter_provider.force_flush()


def _turn_facts(turn: TurnRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "unbroken.route": turn.route,
        "unbroken.outcome": turn.outcome or "unknown",
        "unbroken.attempts": len(turn.attempt_log),
        "unbroken.stream": turn.stream,
        "unbroken.splices": turn.splices,
        "unbroken.queued_s": turn.queued_s,
        "unbroken.waited_s": turn.waited_s,
    }
    if turn.client:
        attrs["unbroken.client"] = turn.client
    if turn.session_id:
        attrs["gen_ai.conversation.id"] = turn.session_id
    if turn.continuation:
        attrs["unbroken.continuation"] = turn.continuation
    if turn.saved_tokens:
        attrs["unbroken.saved_tokens"] = turn.saved_tokens
    if turn.last_failure:
        attrs["unbroken.last_failure"] = turn.last_failure
    if turn.first_byte_at is not None:
        attrs["unbroken.first_byte_s"] = max(0.0, turn.first_byte_at - turn.started)
    return attrs


def _first_chunk_s(turn: TurnRecord) -> float | None:
    """Seconds from a streamed turn's request to its first chunk to the client: when
    the relay sent its first bytes, or, if those were early headers sent before the
    attempt that released the first frames began, that attempt's start (a lower
    bound; early headers come only after ``early_headers_s``, 20 s by default).
    None for a turn that sent no frame."""
    if not turn.stream or turn.first_byte_at is None:
        return None
    releasing = next((a for a in turn.attempt_log if a.frames_released), None)
    if releasing is None:
        return None
    return max(0.0, max(turn.first_byte_at, releasing.started) - turn.started)


def _error_type(turn: TurnRecord) -> str | None:
    """``error.type`` of a turn that ended in an error: the status code of a final answer
    passed through, else the last failure's label (a status code, ``stall``,
    ``server_disconnected``...), or the outcome."""
    if turn.outcome == _ERRORS_INTERNAL:
        return "_OTHER"
    if turn.outcome not in _ERRORS:
        return None
    if turn.outcome == "aborted_by_client":
        return "aborted_by_client"
    last = turn.attempt_log[-1] if turn.attempt_log else None
    if turn.outcome == "passed_through_error" and last is not None and last.status is not None:
        return str(last.status)  # the provider's final answer (a 400, a 401...)
    return turn.last_failure or turn.outcome


def _usage(attempts: list[AttemptInfo]) -> tuple[int | None, int | None]:
    """The tokens the provider reported over the turn's attempts (each attempt is
    billed: a replay's prompt counts again), None where none reported any."""
    ins = [a.input_tokens for a in attempts if a.input_tokens is not None]
    outs = [a.output_tokens for a in attempts if a.output_tokens is not None]
    return (sum(ins) if ins else None, sum(outs) if outs else None)
