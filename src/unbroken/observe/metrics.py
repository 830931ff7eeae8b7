"""Prometheus metrics for ``GET /metrics``: counters from the hooks, gauges read at scrape.

Each `Metrics` owns its own `CollectorRegistry` (never the global one), so
several relays in one process keep separate numbers.  Labels carry only
route names, upstream base URLs, failure labels, phases and outcomes: never a
header value, a key or content.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from unbroken.core.admission.policy import Failure
from unbroken.core.turn.machine import NOT_FAILURES
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "held_bytes"]

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFB_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def held_bytes(turn: TurnRecord) -> int:
    """Bytes the turn's ledger holds right now (0 when it does not stream)."""
    return turn.held() if turn.held is not None else 0


class _Live:
    """Gauges computed at scrape time from the relay's live state."""

    def __init__(
        self,
        inflight: Callable[[], Iterable[TurnRecord]],
        upstreams: Callable[[], list[dict[str, Any]]],
        fleet: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.inflight = inflight
        self.upstreams = upstreams
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        turns = list(self.inflight())
        yield GaugeMetricFamily("unbroken_inflight_turns", "Turns in flight now.", value=len(turns))
        yield GaugeMetricFamily(
            "unbroken_held_bytes",
            "Bytes of frames held back from clients now (not yet safe to release).",
            value=sum(held_bytes(t) for t in turns),
        )
        up = GaugeMetricFamily(
            "unbroken_upstream_up",
            "1 unless the upstream's last three attempts failed.",
            labels=["route", "upstream"],
        )
        cool = GaugeMetricFamily(
            "unbroken_upstream_cooloff_seconds",
            "Seconds the upstream still asked (Retry-After) to be left alone.",
            labels=["route", "upstream"],
        )
        state = GaugeMetricFamily(
            "unbroken_upstream_state",
            "The upstream's circuit breaker: 1 for its current state.",
            labels=["route", "upstream", "state"],
        )
        line = GaugeMetricFamily(
            "unbroken_pacer_waiting",
            "Retries waiting in the upstream's line (its pacer, breaker or cool-off).",
            labels=["route", "upstream"],
        )
        tokens = GaugeMetricFamily(
            "unbroken_pacer_tokens",
            "Retries the upstream's pacer would let go at once now.",
            labels=["route", "upstream"],
        )
        waited = CounterMetricFamily(
            "unbroken_pacer_waited",
            "Retries that had to wait in the upstream's line.",
            labels=["route", "upstream"],
        )
        for h in self.upstreams():
            labels = [h["route"], h["upstream"]]
            up.add_metric(labels, 1.0 if h["up"] else 0.0)
            cool.add_metric(labels, float(h["cooloff_s"]))
            current = h.get("breaker", "closed")
            for s in ("closed", "open", "half_open"):
                state.add_metric([*labels, s], 1.0 if s == current else 0.0)
            pacer = h.get("pacer") or {}
            line.add_metric(labels, float(pacer.get("waiting", 0)))
            tokens.add_metric(labels, float(pacer.get("tokens", 0.0)))
            waited.add_metric(labels, float(pacer.get("waited_total", 0)))
        yield up
        yield cool
        yield state
        yield line
        yield tokens
        yield waited
        yield GaugeMetricFamily(
            "unbroken_parked_turns",
            "Turns parked now: waiting in an upstream's line (pacer, breaker, cool-off).",
            value=sum(1 for t in turns if t.state == "parked"),
        )
        yield from _rate_metrics(self.upstreams())
        if self.fleet is not None:
            yield from _fleet_metrics(self.fleet())

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _rate_metrics(upstreams: list[dict[str, Any]]) -> Iterator[Metric]:
    """The providers' rate limits the relay learned, per upstream and credential hash."""
    labels = ["route", "upstream", "credential"]
    limit = GaugeMetricFamily(
        "unbroken_ratelimit_limit",
        "A budget the provider reports for the key (requests, tokens, output), per window.",
        labels=[*labels, "bucket"],
    )
    left = GaugeMetricFamily(
        "unbroken_ratelimit_remaining",
        "What the relay reckons is left of that budget now.",
        labels=[*labels, "bucket"],
    )
    waiting = GaugeMetricFamily(
        "unbroken_ratelimit_waiting",
        "Turns waiting at the relay for the key's rate limit.",
        labels=labels,
    )
    window = GaugeMetricFamily(
        "unbroken_ratelimit_window",
        "The adaptive concurrency window after 429s (absent while unbounded).",
        labels=labels,
    )
    throttle = GaugeMetricFamily(
        "unbroken_ratelimit_throttle_per_s",
        "The request rate the provider's 429s allow the key (absent until a 429).",
        labels=labels,
    )
    waited = CounterMetricFamily(
        "unbroken_ratelimit_waited",
        "Turns that waited at the relay for the key's rate limit.",
        labels=labels,
    )
    limited = CounterMetricFamily(
        "unbroken_ratelimit_limited", "429 answers for the key.", labels=labels
    )
    for h in upstreams:
        for rl in h.get("ratelimits") or ():
            ls = [h["route"], h["upstream"], str(rl.get("credential", ""))]
            for name, b in (rl.get("buckets") or {}).items():
                limit.add_metric([*ls, name], float(b.get("limit", 0)))
                left.add_metric([*ls, name], float(b.get("left", 0.0)))
            waiting.add_metric(ls, float(rl.get("waiting", 0)))
            if rl.get("window") is not None:
                window.add_metric(ls, float(rl["window"]))
            per_s = (rl.get("throttle") or {}).get("per_s")
            if per_s is not None:
                throttle.add_metric(ls, float(per_s))
            waited.add_metric(ls, float(rl.get("waited_total", 0)))
            limited.add_metric(ls, float(rl.get("limited_total", 0)))
    yield from (limit, left, waiting, window, throttle, waited, limited)


def _fleet_metrics(fleet: dict[str, Any]) -> Iterator[Metric]:
    """Breaker transitions, the health store and the worker."""
    trans = CounterMetricFamily(
        "unbroken_breaker_transitions",
        "Circuit breaker transitions, by the state entered (open, half_open, close).",
        labels=["route", "upstream", "to"],
    )
    for (route, upstream, kind), n in sorted(fleet.get("transitions", {}).items()):
        trans.add_metric([route, upstream, kind], float(n))
    yield trans
    store = fleet.get("store") or {}
    up = GaugeMetricFamily(
        "unbroken_store_up",
        "1 while the health store (memory, workers channel or redis) is reachable.",
        labels=["kind"],
    )
    up.add_metric([str(store.get("kind", "memory"))], 1.0 if store.get("state") == "ok" else 0.0)
    yield up
    worker = fleet.get("worker")
    if worker is not None:
        info = GaugeMetricFamily(
            "unbroken_worker",
            "The worker process that answered this scrape.",
            labels=["worker", "pid"],
        )
        info.add_metric([str(worker.get("id")), str(worker.get("pid"))], 1.0)
        yield info


class Metrics(Hooks):
    def __init__(
        self,
        inflight: Callable[[], Iterable[TurnRecord]] = tuple,
        upstreams: Callable[[], list[dict[str, Any]]] = list,
        fleet: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # What the hooks counted since the last scrape, added to the prometheus_client
        # children when one comes (`_flush`): a turn's counts are dictionary updates,
        # not a lock and a bucket walk each (three per turn).
        self._incs: dict[Any, float] = {}  # counter child -> amount
        self._observed: dict[Any, list[float]] = {}  # histogram child -> bucket counts, sum
        r = self.registry
        self.turns = Counter(
            "unbroken_turns", "Turns by final outcome.", ["route", "outcome"], registry=r
        )
        self.attempts = Counter(
            "unbroken_attempts",
            "Upstream attempts by result (ok, or the failure: 503, connection_reset, stall, ...).",
            ["route", "upstream", "reason"],
            registry=r,
        )
        self.replays = Counter(
            "unbroken_replays",
            "Requests replayed after a failure, by the phase the failure happened in.",
            ["phase"],
            registry=r,
        )
        self.wasted = Counter(
            "unbroken_wasted_output_tokens",
            "Estimated output tokens generated by attempts that died before commit.",
            ["route"],
            registry=r,
        )
        self.continuations = Counter(
            "unbroken_continuations",
            "Cuts after commit finished in place (result spliced) or not (refused_<reason>),"
            " with after_commit = continue.",
            ["protocol", "result"],
            registry=r,
        )
        self.saved = Counter(
            "unbroken_saved_output_tokens",
            "Estimated output tokens a redo would have sampled again, saved by continuations.",
            ["route"],
            registry=r,
        )
        self.retry_wait = Histogram(
            "unbroken_retry_wait_seconds",
            "Wait before each retry.",
            ["route"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.queued = Histogram(
            "unbroken_ratelimit_queued_seconds",
            "Time each turn waited at the relay for the provider's rate limit.",
            ["route"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "unbroken_time_to_first_byte_seconds",
            "From the client's request to the first byte sent back, retries included.",
            ["route"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        r.register(_Live(inflight, upstreams, fleet))

    def expose(self) -> bytes:
        self._flush()
        return generate_latest(self.registry)

    def _inc(self, metric: Any, labels: tuple[str, ...], amount: float = 1.0) -> None:
        child = self._child(metric, *labels)
        incs = self._incs
        incs[child] = incs.get(child, 0.0) + amount

    def _observe(self, metric: Any, labels: tuple[str, ...], amount: float) -> None:
        child = self._child(metric, *labels)
        if not math.isfinite(amount):
            child.observe(amount)  # (as prometheus_client itself files it)
            return
        tally = self._observed.get(child)
        if tally is None:
            tally = self._observed[child] = [0.0] * (len(child._upper_bounds) + 1)
        # the first bucket whose bound is >= amount, as `Histogram.observe` files it
        tally[bisect.bisect_left(child._upper_bounds, amount)] += 1
        tally[-1] += amount

    def _flush(self) -> None:
        """Add what the hooks counted to the registry's children."""
        incs, self._incs = self._incs, {}
        for child, amount in incs.items():
            child.inc(amount)
        observed, self._observed = self._observed, {}
        for child, tally in observed.items():
            child._sum.inc(tally[-1])
            for bucket, n in zip(child._buckets, tally, strict=False):
                if n:
                    bucket.inc(n)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: label sets are few, lookups are per turn."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- hooks ---------------------------------------------------------------------------
    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        if wait_s is None:
            return
        if phase != "committed":  # a committed attempt is continued, never replayed
            self._inc(self.replays, (phase or "unknown",))
        self._observe(self.retry_wait, (turn.route,), wait_s)

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        reason = attempt.reason or "unknown"
        self._inc(self.attempts, (turn.route, attempt.upstream, reason))
        if reason not in NOT_FAILURES and attempt.phase != "committed":
            if attempt.est_output_tokens:
                self._inc(self.wasted, (turn.route,), attempt.est_output_tokens)

    def continuation(self, turn: TurnRecord, result: str) -> None:
        self._inc(self.continuations, (turn.protocol, result))

    def turn_ended(self, turn: TurnRecord) -> None:
        self._inc(self.turns, (turn.route, turn.outcome or "unknown"))
        if turn.saved_tokens:
            self._inc(self.saved, (turn.route,), turn.saved_tokens)
        if turn.queued_s:
            self._observe(self.queued, (turn.route,), turn.queued_s)
        if turn.first_byte_at is not None:
            self._observe(self.ttfb, (turn.route,), max(0.0, turn.first_byte_at - turn.started))
