"""Anthropic Messages: finish a cut turn with a user message, for models that refuse
prefill (sans-IO).

Claude 4.6 and later answer an assistant message last (a prefill) with ``400``.
Anthropic's streaming documentation ("Error recovery", Claude 4.6 and later) gives
their continuation: "instead of placing the partial response in an assistant
message, add a user message that instructs the model to continue from where it left
off", e.g. "Your previous response was interrupted and ended with
[previous_response]. Continue from where you left off."  A route opts in with
``[routes.NAME] anthropic_continue = "user_message"`` (`AnthropicContinue`).

A model asked to continue may rephrase, restate or comment; nothing in its answer
says where it picks up.  So the join is made checkable: the request is the client's,
then an assistant message with the committed text (trailing whitespace trimmed: the
model's own interrupted turn), then a user message that quotes the committed text's
end, the *anchor* (`anchor_of`: its last `ANCHOR_WORDS` words, at most
`MAX_ANCHOR_CHARS`), and asks the model to start its reply with exactly that text,
then go on.  The splice (`anthropic_prefill.FrameSplicer`, with the anchor as the
`prefill.TextJoin` echo) then requires the answer to begin with exactly the anchor,
drops it, and refuses what follows if it repeats the end of the committed text.  An
answer that starts any other way (a preamble, a rephrased restart, a tool call, a
thinking block) breaks the join: the turn ends with the native retryable error,
never with that text.

Everything else is the prefill's (`anthropic_prefill`): what the client has is read
back from the released bytes and must be text only; the request must not enable
thinking or force a tool; a client's own assistant message last is refused here
(``client_prefill``: such a model would refuse it anyway).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from unbroken.core.wire.protocols.anthropic_prefill import Committed, Plan, request_refusal
from unbroken.core.wire.protocols.prefill import PrefillRefusal, split_trailing_ws

__all__ = [
    "ANCHOR_TAG",
    "ANCHOR_WORDS",
    "MAX_ANCHOR_CHARS",
    "AnthropicContinue",
    "anchor_of",
    "continue_instruction",
    "plan_user_message",
    "user_message_refusal",
]


class AnthropicContinue(enum.StrEnum):
    """``[routes.NAME] anthropic_continue``: how a cut Messages turn is continued."""

    PREFILL = "prefill"  # an assistant message last (Claude 4.5 and earlier): the default
    USER_MESSAGE = "user_message"  # a user message asking to continue (Claude 4.6 and later)


#: words of the committed text's end the model is asked to repeat first
ANCHOR_WORDS = 8
#: ... at most this many characters of it
MAX_ANCHOR_CHARS = 120
#: the tag the instruction quotes the anchor in (on lines of their own)
ANCHOR_TAG = "interrupted_response_end"

_INSTRUCTION = (
    "Your previous response was interrupted and ended with:\n"
    "<{tag}>\n{anchor}\n</{tag}>\n"
    "Continue from where you left off. Start your reply with exactly the text between "
    "those tags, repeated once, character for character, then go straight on with the "
    "rest of your previous response. Write nothing before it: no preamble, no comment "
    "on the interruption, no restatement of what you already wrote."
)


def anchor_of(text: str) -> str:
    """The end of ``text`` (no trailing whitespace) the continuation must repeat: from
    the start of its `ANCHOR_WORDS`-th last word, or from the first word start within
    its last `MAX_ANCHOR_CHARS` characters (its last characters when none is)."""
    window = text[-(MAX_ANCHOR_CHARS + 1) :]
    whole = len(window) == len(text)
    starts = [
        i
        for i, ch in enumerate(window)
        if not ch.isspace()
        and ((i == 0 and whole) or (i > 0 and window[i - 1].isspace()))
        and len(window) - i <= MAX_ANCHOR_CHARS
    ]
    if not starts:
        return text[-MAX_ANCHOR_CHARS:]
    return window[starts[max(0, len(starts) - ANCHOR_WORDS)] :]


def continue_instruction(anchor: str) -> str:
    """The user message's text: the anchor, quoted, and how to continue."""
    return _INSTRUCTION.format(tag=ANCHOR_TAG, anchor=anchor)


def user_message_refusal(request: Mapping[str, Any]) -> PrefillRefusal | None:
    """None when the request allows a user-message continuation, else why not."""
    refusal = request_refusal(request)
    if refusal is not None:
        return refusal
    if request["messages"][-1].get("role") == "assistant":
        return PrefillRefusal.CLIENT_PREFILL  # a client's own prefill: refused by such a model
    return None


def plan_user_message(request: Mapping[str, Any], committed: Committed) -> Plan | PrefillRefusal:
    """The continuation request for ``request`` after ``committed`` (or why not): the
    client's messages, the committed text as the assistant's interrupted turn, and
    the user message that asks to continue from its anchor (the splice's echo)."""
    refusal = user_message_refusal(request)
    if refusal is not None:
        return refusal
    kept, shown_ws = split_trailing_ws(committed.text)
    body = dict(request)
    if not kept:
        # whitespace only: nothing to continue from, the client's request as it is
        return Plan(body, committed, committed.text, "")
    anchor = anchor_of(kept)
    body["messages"] = [
        *request["messages"],
        {"role": "assistant", "content": kept},
        {"role": "user", "content": continue_instruction(anchor)},
    ]
    return Plan(body, committed, shown_ws, kept, echo=anchor)
