"""Deterministic wire formats of the provider protocols, one module per protocol.

Every reply is described as a list of *events* ``(event_name | None, payload)``
where ``payload`` is a JSON-able dict (or the raw string ``"[DONE]"`` for Chat
Completions). :func:`events_for` returns that list (reusable by non-SSE
transports such as a Responses WebSocket); :func:`frames_for` returns the exact
SSE bytes. The byte path is optimised: the many small delta frames are rendered
from a pre-encoded template instead of one ``json.dumps`` per frame, and whole
replies are cached by request digest.

The modules: `frames` (protocol names, SSE encoding, delta runs), `reply` (the
reply model), `chat_api`, `responses_api`, `messages_api` (Anthropic), `gemini_api`
(each API's frames and bodies), `error_replies` (each protocol's errors), `render` (a
reply in its protocol, cached; which protocol a path speaks), `ws_replies` (Responses
WebSocket mode).  This package re-exports the API the tests and tools use.

Ids and timestamps are derived only from the protocol, the reply-shape keys of
the action and the request JSON, so identical requests give byte-identical
replies, and a faulted reply is a byte-exact prefix of the clean one.
"""

from unbroken.mock.wire.error_replies import (
    BODY_GARBAGE,
    garbage_frame,
    kind_error_body,
    kind_error_frame,
    status_error_body,
)
from unbroken.mock.wire.frames import (
    ANTHROPIC_NAME,
    CHAT_NAME,
    CREATED,
    GEMINI_NAME,
    PROTOCOL_NAMES,
    RESPONSES_NAME,
    Event,
    encode_sse,
)
from unbroken.mock.wire.render import (
    Rendered,
    events_for,
    frames_for,
    protocol_name_for_path,
    render_reply,
    responses_events,
)
from unbroken.mock.wire.reply import MockReply, canonical_json, make_reply, split_exact
from unbroken.mock.wire.ws_replies import (
    WS_GARBAGE,
    ws_error,
    ws_messages,
    ws_messages_for,
    ws_request,
)

__all__ = [
    "ANTHROPIC_NAME",
    "BODY_GARBAGE",
    "CHAT_NAME",
    "CREATED",
    "GEMINI_NAME",
    "PROTOCOL_NAMES",
    "RESPONSES_NAME",
    "WS_GARBAGE",
    "Event",
    "MockReply",
    "Rendered",
    "canonical_json",
    "encode_sse",
    "events_for",
    "frames_for",
    "garbage_frame",
    "kind_error_body",
    "kind_error_frame",
    "make_reply",
    "protocol_name_for_path",
    "render_reply",
    "responses_events",
    "split_exact",
    "status_error_body",
    "ws_error",
    "ws_messages",
    "ws_messages_for",
    "ws_request",
]
