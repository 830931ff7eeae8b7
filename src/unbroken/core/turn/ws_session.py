"""What a client WebSocket's session decides, sans-IO: the Responses API over a socket.

`relay.websocket` carries these decisions out; it decides nothing itself.

* **The HTTP fallback** (`Fallback`): an upstream that refuses the WebSocket upgrade
  for good (a verdict such as 404 or 426, or `REFUSALS_BEFORE_FALLBACK` refusals in a
  row: one transient 503 is a retryable failure, not a verdict), or answers
  ``websocket_connection_limit_reached``, is served over ``POST /v1/responses`` for
  ``[websocket] fallback_cooldown_s``; so is an attempt that asks for a body patch
  (background mode exists over HTTP only).
* **The warm-up** (`is_warmup`, `warmup_messages`): a ``response.create`` with
  ``generate: false`` (Codex sends one to warm a socket) asks for no output.  On an
  upstream socket it goes as it is; served over HTTP (a continuation, the fallback) it
  is never POSTed (HTTP has no ``generate``: a provider would generate, store and bill
  a whole answer, or refuse it with a 400).  The relay answers it itself, as OpenAI
  answers it on a socket: ``response.created`` then ``response.completed`` with an
  empty output and zero usage, naming a response id of its own; the history records
  it, so the next turn that chains from it (``previous_response_id``) is sent
  self-contained.
* **Response history** (`History`): with ``store: false``, ``previous_response_id``
  points at state held only by the upstream socket that produced it.  The history
  records, per client connection, the input and output items of every completed
  turn, so a turn replayed on a new socket (or over HTTP) is sent self-contained.
* **Late events** (`TurnResponses.is_other`): an upstream lifecycle event that names a
  response this connection already finished is not the current turn's (a late reply
  to a cancel, say): it goes to the client as it is and never reaches the turn's
  ledger.
* **The handshake timeout** (`handshake_failure`): no upgrade answer in time is a
  header timeout, as no response headers in time is for HTTP.

Time is passed in (``now``: the loop's monotonic clock).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.protocols.responses import error_code_of, lifecycle_of

__all__ = [
    "REFUSALS_BEFORE_FALLBACK",
    "WS_LIMIT_CODE",
    "Fallback",
    "History",
    "SessionResponses",
    "TurnResponses",
    "handshake_failure",
    "is_warmup",
    "refusal_is_verdict",
    "warmup_messages",
]

#: the upstream's error code that means "serve this over HTTP for a while"
WS_LIMIT_CODE = "websocket_connection_limit_reached"
#: transient refusals of the upgrade in a row (503, 429, ...) that start the fallback
REFUSALS_BEFORE_FALLBACK = 3


def refusal_is_verdict(status: int) -> bool:
    """Whether a refused upgrade answered ``status`` says the upstream has no WebSocket
    (404, 405, 426, a 200 without the upgrade, ...) rather than that it failed just now
    (408, 429, a 5xx other than 501/505: the same answers that are retried over HTTP)."""
    if status in (408, 425, 429):
        return False
    return not (500 <= status < 600 and status not in (501, 505))


def handshake_failure(failure: Failure, *, timed_out: bool) -> Failure:
    """The failure of an upstream socket that did not open: a handshake with no answer
    in time is a header timeout (as an HTTP request with no headers in time)."""
    if timed_out:
        return Failure(FailureClass.HEADER_TIMEOUT, "no handshake in time")
    return failure


@dataclass(slots=True)
class Fallback:
    """When a connection's turns go over HTTP instead of an upstream socket."""

    cooldown_s: float
    #: monotonic time until which turns go over HTTP
    until: float = 0.0
    #: transient refusals of the upgrade since the last socket that opened
    refusals: int = 0

    def active(self, now: float) -> bool:
        """Turns go over HTTP now."""
        return now < self.until

    def over_http(self, now: float, body_patch: bool) -> bool:
        """This attempt goes over HTTP: the fallback is on, or it needs a body patch
        (a resumable turn: no background mode over WebSocket)."""
        return body_patch or now < self.until

    def start(self, now: float) -> None:
        """The upstream refused WebSocket: HTTP for the cool-down from now."""
        self.until = now + self.cooldown_s
        self.refusals = 0

    def refused(self, now: float, status: int) -> bool:
        """The upstream refused the upgrade with ``status``: True when that starts the
        fallback (a verdict, or the `REFUSALS_BEFORE_FALLBACK`-th refusal in a row);
        False: a transient failure of this attempt, retried like any other."""
        self.refusals += 1
        if refusal_is_verdict(status) or self.refusals >= REFUSALS_BEFORE_FALLBACK:
            self.start(now)
            return True
        return False

    def opened(self) -> None:
        """An upstream socket opened: earlier transient refusals are forgotten."""
        self.refusals = 0

    def after_attempt(self, now: float, text: str, *, turn_ended: bool) -> bool:
        """An upstream socket's attempt ended on the message ``text``: True when that
        message starts the fallback (the connection limit, with the turn not over)."""
        if turn_ended or error_code_of(text) != WS_LIMIT_CODE:
            return False
        self.start(now)
        return True


def is_warmup(create: dict[str, Any]) -> bool:
    """A ``response.create`` that asks for no output (``generate: false``)."""
    return create.get("generate") is False


def warmup_messages(
    create: dict[str, Any], response_id: str, created_at: int
) -> tuple[bytes, bytes]:
    """The relay's own answer to a warm-up served over HTTP, as OpenAI answers one on a
    socket: ``response.created`` (in progress) then ``response.completed`` (empty output,
    zero usage), both naming ``response_id``.  ``created_at``: Unix seconds."""
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": create.get("model"),
        "output": [],
        "previous_response_id": create.get("previous_response_id"),
        "usage": None,
    }
    created = {"type": "response.created", "sequence_number": 0, "response": response}
    done = {
        **response,
        "status": "completed",
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        },
    }
    completed = {"type": "response.completed", "sequence_number": 1, "response": done}
    return (
        json.dumps(created, separators=(",", ":")).encode(),
        json.dumps(completed, separators=(",", ":")).encode(),
    )


def _as_items(value: Any) -> list[Any]:
    """Normalise a Responses ``input`` to a list of items."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    return [value]


@dataclass
class History:
    """Per client connection: what each completed response's state consists of.

    ``turns[rid]`` keeps the link to the previous response and this turn's own
    input and output items, so the full item list behind a response is the
    chain walked back to its start.  ``where[rid]`` says which upstream socket
    holds that response's state (``None``: none, e.g. an HTTP fallback turn).
    At most ``limit`` responses are kept (oldest dropped first).
    """

    limit: int = 512
    turns: dict[str, tuple[str | None, list[Any], list[Any]]] = field(default_factory=dict)
    where: dict[str, int | None] = field(default_factory=dict)

    def record(self, create: dict[str, Any], response: dict[str, Any], socket: int | None) -> None:
        rid = response.get("id")
        if not isinstance(rid, str):
            return
        prev = create.get("previous_response_id")
        output = response.get("output")
        self.turns[rid] = (
            prev if isinstance(prev, str) else None,
            _as_items(create.get("input")),
            list(output) if isinstance(output, list) else [],
        )
        self.where[rid] = socket
        while len(self.turns) > self.limit:
            oldest = next(iter(self.turns))
            del self.turns[oldest], self.where[oldest]

    def items(self, rid: str) -> list[Any] | None:
        """Every item of the conversation up to and including response ``rid``."""
        chain: list[tuple[list[Any], list[Any]]] = []
        cur: str | None = rid
        while cur is not None:
            entry = self.turns.get(cur)
            if entry is None:
                return None  # the chain starts somewhere we never saw
            prev, inputs, outputs = entry
            chain.append((inputs, outputs))
            cur = prev
        return [item for inputs, outputs in reversed(chain) for item in (*inputs, *outputs)]

    def request_for(self, create: dict[str, Any], socket: int | None) -> dict[str, Any]:
        """The request to send on ``socket``: as it is, or rebuilt self-contained."""
        prev = create.get("previous_response_id")
        if not isinstance(prev, str) or prev not in self.turns:
            return create
        if socket is not None and self.where.get(prev) == socket:
            return create  # that socket still holds the state
        items = self.items(prev)
        if items is None:
            return create
        rebuilt = {k: v for k, v in create.items() if k != "previous_response_id"}
        rebuilt["input"] = [*items, *_as_items(create.get("input"))]
        return rebuilt


@dataclass
class SessionResponses:
    """Per client connection: the responses it finished and their history."""

    history: History = field(default_factory=History)
    #: ids of responses that ended on this connection (their late events are not the
    #: current turn's)
    finished: deque[str] = field(default_factory=lambda: deque(maxlen=64))

    def turn(self, create: dict[str, Any]) -> TurnResponses:
        """The responses of one ``response.create``."""
        return TurnResponses(self, create)


class TurnResponses:
    """One turn's response: which upstream events are its own, and its history entry."""

    __slots__ = ("completed", "create", "response_id", "session", "socket")

    def __init__(self, session: SessionResponses, create: dict[str, Any]) -> None:
        self.session = session
        self.create = create
        #: the response this turn's current attempt produces, once an event names it
        self.response_id: str | None = None
        #: the upstream socket of the current attempt (None: over HTTP)
        self.socket: int | None = None
        self.completed = False

    def over_socket(self, socket: int) -> dict[str, Any]:
        """A new attempt on upstream socket ``socket``: the request to send there
        (rebuilt self-contained when that socket lacks the state).

        On a replay, the failed attempt's response is over: late events of it are
        not this attempt's, and the new attempt names its own response.
        """
        if self.response_id is not None:
            self.session.finished.append(self.response_id)
            self.response_id = None
        self.socket = socket
        return self.session.history.request_for(self.create, socket)

    def over_http(self) -> dict[str, Any]:
        """A new attempt over HTTP (the fallback): the request, self-contained."""
        self.socket = None
        return self.session.history.request_for(self.create, None)

    def warmup_answer(self, response_id: str, created_at: int) -> tuple[bytes, bytes] | None:
        """Over HTTP: the relay's own answer when this turn is a warm-up (never POSTed:
        `warmup_messages`, naming ``response_id``), else None (the request goes)."""
        if not is_warmup(self.create):
            return None
        return warmup_messages(self.create, response_id, created_at)

    def is_other(self, text: str, data: bytes) -> bool:
        """An upstream message that is a lifecycle event of another response (a late
        reply to a cancel, say): the client's as it is, not this turn's.

        The turn's own response is the one its first ``response.created`` names (ids
        may repeat across turns: some upstreams reuse them).  Before that, a lifecycle
        event naming a response that already ended on this connection is a late one.
        """
        if data.find(b'"response"') < 0:
            return False
        found = lifecycle_of(text)
        if found is None:
            return False
        etype, rid = found
        if self.response_id is None:
            if etype == "response.created" or rid not in self.session.finished:
                self.response_id = rid
                return False
        elif rid == self.response_id:
            return False
        return True

    def released(self, texts: Iterable[str]) -> None:
        """Messages released to the client: learn this turn's response id, and record
        the conversation once the response completed."""
        if self.completed:
            return
        for text in texts:
            if not text or '"response"' not in text:
                continue
            obj = loads_object(text)
            response = obj.get("response") if obj is not None else None
            if not isinstance(response, dict):
                continue
            rid = response.get("id")
            if isinstance(rid, str) and self.response_id is None:
                self.response_id = rid
            if obj is not None and obj.get("type") == "response.completed":
                self.completed = True
                self.session.history.record(self.create, response, self.socket)

    def ended(self) -> None:
        """The turn is over: its response's late events are not the next turn's."""
        if self.response_id is not None:
            self.session.finished.append(self.response_id)
