"""OpenAI Responses background mode: the exact resume of a cut stream (sans-IO).

A response created with ``background: true`` (which needs ``store: true``) and
``stream: true`` keeps running at the provider when the connection drops;
``GET {base}/responses/{id}?stream=true&starting_after=N`` streams its events
after sequence number N.  Nothing is sampled twice, nothing is paid twice.

`BackgroundResume` is the `core.turn.continuation.Strategy` for it:

* a fresh attempt sets ``background`` and ``store`` in the request (the only
  rewrite of a request, and only with ``after_commit = "continue"``), unless the
  upstream refused background mode before (`ContinuationMemory`); a final 4xx
  that names ``background`` or ``store`` is such a refusal, and so is a 400/422 in
  other words when the same request without them then succeeds (the turn asks once
  more as the client sent it: a wording is no proof, a structure is).  **A
  client's ``store: false`` becomes ``store: true``**: the provider keeps the
  response (OpenAI: 30 days by default).  The relay says so where it is decided: a
  warning at start-up for the routes that may do it (`store_override_routes`,
  `STORE_OVERRIDE`) and once per route when it first does (`store_override_note`);
* after a cut it continues from the response id the ledger's classifier saw in
  ``response.created`` and the last sequence number *fed to the ledger* (held
  frames included: they stay held, so nothing is skipped and nothing repeats);
* `SequenceSplicer` checks the join: the first event is number N+1, numbers
  strictly increase, and every lifecycle event names the same response; nothing
  of a resumed stream is released before a frame of it names that response;
* the response id goes into URLs only if it is a plain token (`RESPONSE_ID`);
* a response given up (a replay, a refusal, a broken join, the client gone) is
  cancelled (``POST {base}/responses/{id}/cancel``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from unbroken.core.turn.continuation import Cancel, JoinBroken, Refusal, Resume
from unbroken.core.turn.ledger import Ledger
from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.sse import Event

__all__ = [
    "MECHANISM",
    "RESPONSE_ID",
    "STORE_OVERRIDE",
    "BackgroundResume",
    "SequenceSplicer",
    "background_patch_applies",
    "refuses_background",
    "store_override_note",
    "store_override_routes",
]

MECHANISM = "responses_background"

#: a response id that may go into a URL path: OpenAI's are ``resp_`` and hex
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: lifecycle events that say the response waits or runs, and nothing more
_WAITING = frozenset({"response.queued", "response.in_progress"})
#: a final answer to the background request that may refuse it in other words
_MAYBE_REFUSALS = frozenset({400, 422})
#: a 4xx whose error names one of these as its ``param`` refuses background mode
_REFUSAL_PARAMS = frozenset({"background", "store"})


def refuses_background(status: int, body: bytes) -> bool:
    """Whether a final answer to a background request refuses background mode: a 4xx
    whose error names ``background`` or ``store`` as its ``param``, or whose message
    speaks of background mode (a bare "store" in a message is too common a word)."""
    if not 400 <= status < 500 or status in (408, 429):
        return False
    obj = loads_object(body[:65536].decode("utf-8", "replace"))
    err: Any = obj.get("error") if obj is not None else None
    if isinstance(err, dict):
        if err.get("param") in _REFUSAL_PARAMS:
            return True
        message = err.get("message")
        return isinstance(message, str) and "background" in message.lower()
    return b"background" in body[:65536].lower()


def _payload(raw: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE frame (its ``data:`` lines) or WebSocket message."""
    text = raw.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        return loads_object(text.strip())  # a WebSocket message
    lines = [ln[5:].lstrip() for ln in text.splitlines() if ln.startswith("data:")]
    return loads_object("\n".join(lines).strip()) if lines else None


def _seq_of(raw: bytes) -> int | None:
    """The top-level ``sequence_number`` of one SSE frame (or WebSocket message)."""
    obj = _payload(raw)
    seq = obj.get("sequence_number") if obj is not None else None
    return seq if type(seq) is int else None


class SequenceSplicer:
    """The join check of a background resume: the response id, the open output
    item's id, and sequence numbers that go on from N+1 and strictly increase.

    Output items follow each other in a response: a frame that names an item
    (``item_id``, or the item of ``output_item.done``) names the one open at the
    cut until ``output_item.added`` opens the next, so the deltas of another
    response are refused at once, not at its ``response.completed``.

    Item ids and numbers may match another response's (a proxy that serves the wrong
    stored response): the resumed stream is *held* until its first frame that names
    a response (``response.completed`` at the latest) names this one; a frame that
    names another refuses the splice before anything of it was released.  Held
    frames are never fed: a cut while holding resumes from the same cursor (the
    held frames come again), and more than ``max_held_bytes`` held is a broken join.
    """

    __slots__ = (
        "_first",
        "fed_item",
        "held",
        "held_bytes",
        "item",
        "last",
        "max_held_bytes",
        "progressed",
        "response_id",
        "verified",
    )

    def __init__(
        self,
        response_id: str,
        after: int,
        item: str | None = None,
        *,
        max_held_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.response_id = response_id
        self.last = after
        self.item = item
        #: the open item as of the last frame fed to the ledger (the next cursor's)
        self.fed_item = item
        self._first = True
        self.progressed = False
        #: a frame of this stream named this response: what follows is fed at once
        self.verified = False
        self.held: list[Event] = []
        self.held_bytes = 0
        self.max_held_bytes = max_held_bytes

    def splice(self, event: Event) -> Event | list[Event] | None:
        data = event.data
        if data is None:
            # A comment: the ledger ignores it; while holding, it is not fed either (a
            # fed frame without a number would hide the cursor from the next resume).
            return event if self.verified else None
        obj = loads_object(data)
        if obj is None:
            raise JoinBroken("a continuation frame is not a JSON object")
        etype = obj.get("type")
        if not isinstance(etype, str) and event.name is not None:
            etype = event.name
        if etype == "error":
            self._drop_held()  # never vouched for: the provider's error ends the turn
            return event  # the provider's own error: the ledger ends the turn with it
        seq = obj.get("sequence_number")
        if type(seq) is not int:
            raise JoinBroken(f"a continuation frame ({etype}) has no sequence number")
        if self._first and seq != self.last + 1:
            raise JoinBroken(f"the continuation starts at {seq}, not {self.last + 1}")
        if seq <= self.last:
            raise JoinBroken(f"sequence numbers went back ({self.last} then {seq})")
        resp = obj.get("response")
        if isinstance(resp, dict):
            rid = resp.get("id")
            if rid != self.response_id:
                raise JoinBroken("the continuation is another response")
            self.verified = True
        item = _item_of(obj)
        if item is not None:
            if etype == "response.output_item.added" or self.item is None:
                self.item = item
            elif item != self.item:
                raise JoinBroken("the continuation names another output item")
        self._first = False
        self.last = seq
        if etype not in _WAITING:
            self.progressed = True
        if not self.verified:
            self.held.append(event)
            self.held_bytes += len(event.raw)
            if self.held_bytes > self.max_held_bytes:
                raise JoinBroken(
                    f"no frame of the continuation named its response within "
                    f"{self.max_held_bytes} bytes"
                )
            return None
        self.fed_item = self.item
        if self.held:
            out, self.held, self.held_bytes = [*self.held, event], [], 0
            return out
        return event

    def _drop_held(self) -> None:
        self.held, self.held_bytes = [], 0


class BackgroundResume:
    """`Strategy` of OpenAI Responses over HTTP: background mode, resumed by cursor."""

    name = MECHANISM
    #: the resume needs no read-back of what was released
    wants_released = False
    #: a provider's error event failed the response: nothing to resume
    continues_errors = False

    __slots__ = (
        "_cancelled",
        "_counted",
        "_keys",
        "_memory",
        "_resumable",
        "_saved",
        "_splicer",
        "_suspects",
        "_unpatched",
        "last_seq",
        "max_splices",
        "path",
        "splices",
    )

    def __init__(
        self,
        *,
        path: str,
        keys: Sequence[str],
        memory: Any,
        max_splices: int,
    ) -> None:
        """``path``: the client's request path relative to the upstream base
        (``v1/responses``); ``keys``: each upstream's health key; ``memory``: the
        relay's `ContinuationMemory`."""
        self.path = path.rstrip("/")
        self._keys = keys
        self._memory = memory
        self.max_splices = max_splices
        self.splices = 0
        self.last_seq: int | None = None
        self._resumable: set[int] = set()  # upstreams whose current attempt is background
        self._cancelled: set[str] = set()
        self._saved = 0
        self._counted: object = None  # the attempt whose output frames are counted saved
        self._splicer: SequenceSplicer | None = None
        #: upstreams this turn asks as the client sent them (after a refusal)
        self._unpatched: set[int] = set()
        #: upstreams whose 400 to the background request may have been a refusal
        self._suspects: set[int] = set()

    def released(self, data: bytes) -> None:
        """Not asked for (``wants_released`` is False)."""

    def rewind(self) -> None:
        """The resume goes on exactly where the stream was cut: nothing to rewind."""
        return None

    # -- fresh attempts --------------------------------------------------------------
    def body_patch(self, upstream: int) -> tuple[tuple[str, object], ...]:
        self.last_seq = None
        if upstream in self._unpatched or self._memory.refused(MECHANISM, self._key(upstream)):
            self._resumable.discard(upstream)
            return ()
        self._resumable.add(upstream)
        return (("background", True), ("store", True))

    def refused(self, upstream: int, status: int, body: bytes) -> bool:
        """A final 4xx to the background request: one that names background mode is
        its refusal (remembered); any other 400/422 may be one in other words, so the
        turn asks once more as the client sent it (nothing was released) and
        `answered` remembers it if that succeeds; a 400 again is the provider's
        answer to the client's own request."""
        if upstream not in self._resumable or self.last_seq is not None:
            return False  # (not the background request: a resume's answer)
        if refuses_background(status, body):
            self._memory.remember(MECHANISM, self._key(upstream))
        elif status in _MAYBE_REFUSALS and upstream not in self._unpatched:
            self._suspects.add(upstream)
        else:
            return False
        self._unpatched.add(upstream)
        self._resumable.discard(upstream)
        return True

    def answered(self, upstream: int, status: int) -> None:
        if upstream in self._suspects and 200 <= status < 300:
            self._suspects.discard(upstream)
            self._memory.remember(MECHANISM, self._key(upstream))

    # -- cuts ------------------------------------------------------------------------
    def plan(self, upstream: int, ledger: Ledger, timeout_s: float) -> Resume | Refusal:
        if upstream not in self._resumable:
            return Refusal.NOT_RESUMABLE
        rid = _response_id(ledger)
        if rid is None:
            return Refusal.NO_HANDLE
        if self.splices >= self.max_splices:
            return Refusal.LIMIT
        seq = _last_seq(ledger)
        if seq is None:
            seq = self.last_seq if ledger.stats.received_frames == 0 else None
        if seq is None:
            return Refusal.NO_CURSOR
        item = _last_item(ledger)
        previous = self._splicer
        if item is None and previous is not None and previous.response_id == rid:
            item = previous.fed_item
        self.splices += 1
        if ledger.stats is not self._counted:  # once per cut attempt
            self._counted = ledger.stats
            self._saved += ledger.stats.output_frames
        self.last_seq = seq
        self._splicer = SequenceSplicer(rid, seq, item, max_held_bytes=ledger.max_hold_bytes)
        return Resume(
            upstream,
            "GET",
            f"{self.path}/{rid}",
            f"stream=true&starting_after={seq}",
            b"",
            (("Accept", "text/event-stream"),),
            ("content-type", "content-encoding"),
            timeout_s,
        )

    def splicer(self) -> SequenceSplicer:
        assert self._splicer is not None
        return self._splicer

    def abandon(self, upstream: int, ledger: Ledger) -> Sequence[Cancel]:
        if upstream not in self._resumable:
            return ()
        rid = _response_id(ledger)
        if rid is None or rid in self._cancelled:
            return ()
        self._cancelled.add(rid)
        return (Cancel(upstream, "POST", f"{self.path}/{rid}/cancel"),)

    @property
    def saved_frames(self) -> int:
        return self._saved

    def _key(self, upstream: int) -> str:
        keys = self._keys
        return keys[upstream] if 0 <= upstream < len(keys) else str(upstream)


def _item_of(obj: dict[str, Any]) -> str | None:
    """The output item a Responses event names, if any."""
    item_id = obj.get("item_id")
    if isinstance(item_id, str):
        return item_id
    item = obj.get("item")
    if isinstance(item, dict):
        found = item.get("id")
        return found if isinstance(found, str) else None
    return None


def _last_item(ledger: Ledger) -> str | None:
    """The output item the last frames fed to the ledger name (the one open at a cut)."""
    for raw in reversed(ledger.stats.recent):
        obj = _payload(raw)
        if obj is not None:
            item = _item_of(obj)
            if item is not None:
                return item
    return None


def _response_id(ledger: Ledger) -> str | None:
    """The response id the upstream named, if it is one that may go into a URL path
    (`RESPONSE_ID`): checked as strictly as a client's path, since it goes into the
    resume GET and the cancel POST (``..``, ``#frag``, ``%2F..`` never do)."""
    snapshot = getattr(ledger.classifier, "snapshot", None)
    rid = snapshot.get("id") if isinstance(snapshot, dict) else None
    return rid if isinstance(rid, str) and RESPONSE_ID.fullmatch(rid) else None


def _last_seq(ledger: Ledger) -> int | None:
    """The sequence number of the last frame this attempt fed to the ledger."""
    for raw in reversed(ledger.stats.recent):
        seq = _seq_of(raw)
        if seq is not None:
            return seq
        if raw.strip() and not raw.lstrip().startswith(b":"):
            return None  # a frame without a number: the cursor is unknown
    return None


def background_patch_applies(parsed: dict[str, Any] | None) -> bool:
    """Whether a Responses request can be made a background one: a streamed JSON
    request that did not ask for background mode itself."""
    return (
        parsed is not None and parsed.get("stream") is True and parsed.get("background") is not True
    )


# -- what it costs the client's privacy ---------------------------------------------------

#: what continue mode does to a client's privacy choice (`BackgroundResume.body_patch`)
STORE_OVERRIDE = (
    "OpenAI Responses requests are sent in background mode with store: true, overriding "
    "a client's store: false: the provider keeps each response (OpenAI: 30 days by default)"
)
#: upstream hosts (and their subdomains) that serve no OpenAI Responses API
_NOT_RESPONSES = ("anthropic.com", "googleapis.com")


def store_override_routes(continued: Mapping[str, Iterable[str]]) -> list[str]:
    """Of the routes with ``after_commit = "continue"`` (route name -> its upstream
    URLs), those that may send a Responses request in background mode: all but the
    routes whose every upstream is a provider with no Responses API (Anthropic,
    Google).  Sorted: one start-up warning names them."""
    out = []
    for name, urls in continued.items():
        hosts = [(urlsplit(u).hostname or "") for u in urls]
        if not hosts or not all(_no_responses(h) for h in hosts):
            out.append(name)
    return sorted(out)


def _no_responses(host: str) -> bool:
    return any(host == d or host.endswith(f".{d}") for d in _NOT_RESPONSES)


def store_override_note(route: str) -> str:
    """The log line of the first turn on ``route`` that continue mode sends in
    background mode (once per route)."""
    return (
        f"route {route}: after_commit = continue sent a Responses request with "
        f"background: true, store: true (a client's store: false is overridden): the "
        "provider keeps the response (OpenAI: 30 days by default); said once per route"
    )
