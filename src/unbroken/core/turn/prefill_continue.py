"""The `core.turn.continuation.Strategy` of a continuation by prefill (sans-IO).

Anthropic Messages (`protocols.anthropic_prefill`) and Chat Completions with a
provider's documented prefix mode (`protocols.chat_prefix`): after a cut, the
continuation request is the client's request with what the client already has as
an assistant prefix, and its frames are spliced into the client's stream.  For
Anthropic models that refuse prefill, a route may ask for the documented
user-message continuation instead (`protocols.anthropic_continue`: the same
strategy, another request, an answer that must repeat a quoted anchor first).

* It reads back what the turn *released* (`released`, fed by the turn machine,
  ``wants_released``), never what it received: the committed text, and whether
  anything but text reached the client (a refusal: the turn ends as today).
* A cut while nothing was released is no continuation (`Refusal.NO_HANDLE`): the
  machine replays it as always.
* The continuation goes to the same upstream, as a plain JSON ``POST`` to the
  client's path (a gzip body is sent decoded).
* A final answer to a continuation (Claude 4.6 models answer 400: "This model does
  not support assistant message prefill") ends the turn with the native error, and
  that upstream and model are remembered (`ContinuationMemory`): their later cuts
  end as today without asking again.
* At most ``max_splices`` continuations a turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from unbroken.core.turn.continuation import ContinuationMemory, JoinBroken, Refusal, Resume
from unbroken.core.turn.ledger import Ledger, LedgerState
from unbroken.core.wire.protocols import anthropic_prefill as anthropic
from unbroken.core.wire.protocols import chat_prefix as chat
from unbroken.core.wire.protocols.anthropic_continue import (
    AnthropicContinue,
    plan_user_message,
    user_message_refusal,
)
from unbroken.core.wire.protocols.chat_prefix import ChatPrefix
from unbroken.core.wire.protocols.prefill import MAX_COMMITTED_BYTES, JoinError, PrefillRefusal
from unbroken.core.wire.sse import Event, SSESplitter

__all__ = [
    "ANTHROPIC_PREFILL",
    "ANTHROPIC_USER_MESSAGE",
    "PrefillContinue",
    "PrefillSplicer",
    "prefill_refusal",
]

#: the mechanism's name for Anthropic Messages (metrics, `ContinuationMemory`)
ANTHROPIC_PREFILL = "anthropic_prefill"
#: ... and for its user-message continuation (``anthropic_continue = "user_message"``)
ANTHROPIC_USER_MESSAGE = "anthropic_user_message"
#: final statuses of a continuation that say the upstream refuses prefill for the model
_REFUSING = frozenset({400, 422})


def prefill_refusal(
    request: dict[str, Any] | None,
    mode: ChatPrefix | None,
    anthropic_mode: AnthropicContinue = AnthropicContinue.PREFILL,
) -> PrefillRefusal | None:
    """Why a turn's request can never be continued (checked once), or None."""
    if request is None:
        return PrefillRefusal.BAD_REQUEST
    if mode is None:
        if anthropic_mode is AnthropicContinue.USER_MESSAGE:
            return user_message_refusal(request)
        return anthropic.request_refusal(request)
    return chat.request_refusal(request, mode)


class PrefillSplicer:
    """`core.turn.continuation.Splicer` over a protocol splicer (a list of frames each)."""

    __slots__ = ("_feed", "progressed")

    def __init__(self, feed: Any) -> None:
        self._feed = feed
        self.progressed = False

    def splice(self, event: Event) -> Sequence[Event]:
        if event.data is not None:
            self.progressed = True
        try:
            out: list[Event] = self._feed(event)
        except JoinError as exc:
            raise JoinBroken(str(exc)) from None
        return out


class PrefillContinue:
    """One turn's prefill continuations (`core.turn.continuation.Strategy`)."""

    __slots__ = (
        "_asks",
        "_keys",
        "_memory",
        "_mode",
        "_model",
        "_over",
        "_plan",
        "_released",
        "_saved",
        "_size",
        "max_splices",
        "name",
        "path",
        "request",
        "splices",
    )

    #: the continuation is built from what the client has
    wants_released = True
    #: a provider's retryable error event after output (``overloaded_error``) is a cut
    #: like a reset: the continuation is a new request for the rest
    continues_errors = True

    def __init__(
        self,
        *,
        path: str,
        request: dict[str, Any],
        keys: Sequence[str],
        memory: ContinuationMemory,
        max_splices: int,
        mode: ChatPrefix | None = None,
        anthropic_mode: AnthropicContinue = AnthropicContinue.PREFILL,
    ) -> None:
        self.path = path
        self.request = request
        self._mode = mode
        #: Anthropic: a user message asks to continue (no prefill)
        self._asks = mode is None and anthropic_mode is AnthropicContinue.USER_MESSAGE
        if mode is not None:
            self.name = f"chat_{mode.value}"
        else:
            self.name = ANTHROPIC_USER_MESSAGE if self._asks else ANTHROPIC_PREFILL
        self._keys = tuple(keys)
        self._memory = memory
        model = request.get("model")
        self._model = model if isinstance(model, str) else ""
        self.max_splices = max_splices
        self.splices = 0
        self._released: list[bytes] = []
        self._size = 0
        self._over = False  # more than MAX_COMMITTED_BYTES released: refused
        self._plan: anthropic.Plan | chat.Plan | None = None
        self._saved = 0

    def _key(self, upstream: int) -> str:
        key = self._keys[upstream] if 0 <= upstream < len(self._keys) else str(upstream)
        return f"{key}|{self._model}"

    # -- what the client has ---------------------------------------------------------
    def released(self, data: bytes) -> None:
        if self._over:
            return
        self._size += len(data)
        if self._size > MAX_COMMITTED_BYTES:
            self._over = True
            self._released = []
            return
        self._released.append(data)

    # -- fresh attempts: the client's request as it is ----------------------------------
    def body_patch(self, upstream: int) -> tuple[tuple[str, object], ...]:
        return ()

    def answered(self, upstream: int, status: int) -> None:
        """Nothing to learn: fresh attempts go as the client sent them."""

    def refused(self, upstream: int, status: int, body: bytes) -> bool:
        """A final answer to a continuation: remembered for the upstream and model."""
        if status not in _REFUSING:
            return False
        self._memory.remember(self.name, self._key(upstream))
        return True

    # -- cuts ------------------------------------------------------------------------
    def plan(
        self, upstream: int, ledger: Ledger, timeout_s: float
    ) -> Resume | Refusal | PrefillRefusal:
        if ledger.state is LedgerState.PENDING:
            return Refusal.NO_HANDLE  # nothing reached the client: a replay, as always
        if self._memory.refused(self.name, self._key(upstream)):
            return Refusal.NOT_RESUMABLE
        if self.splices >= self.max_splices:
            return Refusal.LIMIT
        if self._over:
            return PrefillRefusal.TOO_LARGE
        released = b"".join(self._released)
        self._released = [released] if released else []
        mode = self._mode
        plan: anthropic.Plan | chat.Plan | PrefillRefusal
        if mode is None:
            committed = anthropic.read_committed(released)
            if isinstance(committed, PrefillRefusal):
                return committed
            if self._asks:
                plan = plan_user_message(self.request, committed)
            else:
                plan = anthropic.plan_continuation(self.request, committed)
        else:
            chat_committed = chat.read_committed(released)
            if isinstance(chat_committed, PrefillRefusal):
                return chat_committed
            plan = chat.plan_continuation(self.request, chat_committed, mode)
        if isinstance(plan, PrefillRefusal):
            return plan
        self._plan = plan
        self._saved = plan.committed.deltas
        self.splices += 1
        body = json.dumps(plan.body, ensure_ascii=False, separators=(",", ":")).encode()
        return Resume(
            upstream=upstream,
            method="POST",
            path=self.path,
            query="",
            body=body,
            set_headers=(("content-type", "application/json"),),
            drop_headers=("content-encoding", "content-length"),
            timeout_s=timeout_s,
        )

    def rewind(self) -> list[Event]:
        """The client's frames so far: the continuation restarts from them (a tool call
        the ledger held when the cut came is dropped; the client never had it)."""
        return SSESplitter(MAX_COMMITTED_BYTES + 1).feed(b"".join(self._released))

    def splicer(self) -> PrefillSplicer:
        plan = self._plan
        assert plan is not None, "splicer() follows a plan"
        if isinstance(plan, anthropic.Plan):
            return PrefillSplicer(anthropic.FrameSplicer(plan).feed)
        assert self._mode is not None
        return PrefillSplicer(chat.FrameSplicer(plan, self._mode).feed)

    def abandon(self, upstream: int, ledger: Ledger) -> Sequence[Any]:
        return ()  # nothing runs at the provider after a cut: nothing to cancel

    @property
    def saved_frames(self) -> int:
        """Text frames the client had at the last cut: what a redo would sample again."""
        return self._saved
