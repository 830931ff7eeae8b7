"""Which continuation may finish a turn cut after commit, chosen once at its start (sans-IO).

With ``after_commit = "continue"`` on its route, a turn gets a `Strategy` (the
machine asks it after a cut: `core.turn.continuation`), or the reason none can
cover it (the machine records it, the log says it once per route); with the
setting off, neither (None):

* OpenAI Responses over HTTP, a streamed plain-JSON request the relay may patch:
  background mode (`core.turn.background.BackgroundResume`);
* Anthropic Messages, and Chat Completions on a route with a ``chat_prefix``: a
  prefill (`core.turn.prefill_continue.PrefillContinue`), built from the parsed
  request (a gzip body is sent decoded);
* a Responses turn over a WebSocket (`continuation_over_socket`): background mode,
  its attempts over HTTP, while the client keeps its socket.

A turn that is not streamed needs none: nothing is released before its body is whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unbroken.core.turn.background import BackgroundResume, background_patch_applies
from unbroken.core.turn.continuation import AfterCommit, ContinuationMemory, Refusal, Strategy
from unbroken.core.turn.prefill_continue import PrefillContinue, prefill_refusal
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES, Protocol
from unbroken.core.wire.protocols.anthropic_continue import AnthropicContinue
from unbroken.core.wire.protocols.chat_prefix import ChatPrefix
from unbroken.core.wire.protocols.prefill import PrefillRefusal

__all__ = ["continuation_for", "continuation_over_socket"]


def continuation_for(
    after_commit: str,
    protocol: Protocol,
    path: str,
    parsed: dict[str, Any] | None,
    *,
    streamed: bool,
    content_encoding: str | None,
    chat_prefix: str | None,
    anthropic_continue: str | None,
    keys: Sequence[str],
    memory: ContinuationMemory,
    max_splices: int,
) -> Strategy | Refusal | PrefillRefusal | None:
    """An HTTP turn's continuation strategy; None: ``after_commit`` (the route's) is not
    ``continue``, or the turn is not ``streamed``; a refusal: it is on, but no strategy
    can cover this turn.

    ``path``: the request's path under the route; ``parsed``: its body, parsed (None:
    not a JSON object); ``content_encoding``: the request's (a Responses body the
    relay would patch must be plain); ``chat_prefix``, ``anthropic_continue``: the
    route's settings; ``keys``: each upstream's health key; ``memory``: the upstreams
    that refused a mechanism; ``max_splices``: ``[stream] max_splices``."""
    if not streamed or after_commit != _AFTER_CONTINUE:
        return None
    if protocol is CHAT and chat_prefix is None:
        return PrefillRefusal.NO_OPTION
    if protocol is ANTHROPIC or protocol is CHAT:
        mode = ChatPrefix(chat_prefix) if chat_prefix and protocol is CHAT else None
        asks = AnthropicContinue(anthropic_continue or AnthropicContinue.PREFILL)
        refusal = prefill_refusal(parsed, mode, asks)
        if refusal is not None or parsed is None:
            return refusal or PrefillRefusal.BAD_REQUEST
        return PrefillContinue(
            path=path,
            request=parsed,
            keys=keys,
            memory=memory,
            max_splices=max_splices,
            mode=mode,
            anthropic_mode=asks,
        )
    if protocol is not RESPONSES or content_encoding:
        return Refusal.UNSUPPORTED
    if parsed is None:
        return PrefillRefusal.BAD_REQUEST
    if not background_patch_applies(parsed):
        return Refusal.UNSUPPORTED  # (background mode asked by the client itself)
    return BackgroundResume(path=path, keys=keys, memory=memory, max_splices=max_splices)


def continuation_over_socket(
    after_commit: str,
    path: str,
    *,
    keys: Sequence[str],
    memory: ContinuationMemory,
    max_splices: int,
) -> BackgroundResume | None:
    """A WebSocket turn's continuation strategy (Responses): background mode when
    ``after_commit`` is ``continue`` (its attempts then go over HTTP, and a cut one is
    resumed over HTTP), else None."""
    if after_commit != _AFTER_CONTINUE:
        return None
    return BackgroundResume(path=path, keys=keys, memory=memory, max_splices=max_splices)


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_AFTER_CONTINUE = AfterCommit.CONTINUE
