"""Deterministic, fault-injecting fake LLM provider for tests, benchmarks and chaos-testing.

Serves OpenAI Chat Completions (``POST .../v1/chat/completions``), OpenAI
Responses (``POST .../v1/responses``), Anthropic Messages
(``POST .../v1/messages``), streamed (``"stream": true`` -> SSE) or not, and the
Gemini API (``POST .../v1beta/models/<model>:streamGenerateContent?alt=sse`` or
``:generateContent``), in the real wire formats. Quick start::

    async with MockProvider() as mock:          # 127.0.0.1, ephemeral port
        mock.script([{"status": 503}, {"fault": "reset", "after_frame": 3}])
        ...                                     # point a client at mock.url

Each provider request pops the next *action* from a FIFO (the queue named by the
``x-mock-key`` header, if any; an ``x-mock-action: <json>`` header applies an
action to that request only). An empty queue means the default action (a plain
OK reply unless changed with ``set_default``).

Action keys (all optional):

* reply shape: ``reply`` ("text" | "tool" | "tools"), ``text``, ``deltas`` (>= 1,
  number of text delta frames; also the max number of argument fragments per
  tool call), ``tool_name`` (str or list), ``tool_args`` (object or list),
  ``seed`` (changes the ids only);
* timing: ``chunk_delay_ms`` (between frames), ``delay_ms`` (before the headers);
* HTTP: ``status``, ``headers``, ``body`` (with ``status``);
* faults: ``fault`` = close_before_headers | reset_after_headers | reset | stall |
  end | error_event | malformed | close | connection_limit, with ``after_frame``
  (frames sent before the fault), ``seconds`` (stall), ``error`` (overloaded |
  server_error | rate_limit | invalid_request | context_length), ``error_style``
  (Responses: "failed" -> ``response.failed``, "error" -> ``error`` event), ``rst``
  (abort with a TCP RST), ``code`` (WebSocket close code 1000-4999 of ``close`` /
  ``connection_limit``). Over HTTP, ``close`` acts like ``end`` and
  ``connection_limit`` is a 400 with code ``websocket_connection_limit_reached``;
* ``count``: repeat the action N times in the queue. Keys starting with ``_`` are
  ignored (comments).

Frames are the SSE events of the reply, numbered from 1 (for Chat Completions
the usage chunk and ``data: [DONE]`` are frames too); a non-streamed body is two
frames (its two halves). :func:`frames_for` gives the exact bytes of a clean
reply, which are a function of the protocol, the reply-shape keys and the
request JSON only.

Responses WebSocket mode: a ``GET .../v1/responses`` with ``Upgrade: websocket``
first pops an *upgrade action* from a separate queue (``script_upgrades``; ``{}``
accepts, ``{"status": N}`` refuses, ``{"fault": "close_before_headers"}`` drops;
recorded in ``mock.upgrades``). Each ``response.create`` message on the socket
then pops a normal action (``x-mock-action`` on the upgrade applies to every
create) and is recorded in ``mock.requests`` with method ``"WS"`` and
``socket`` = the socket number. The reply is one TEXT message per event, byte-
identical to the SSE ``data:`` of ``POST /v1/responses`` with the body
``ws_request(message)`` (the message minus ``type``, plus ``"stream": true``);
frame k is the event with ``sequence_number`` k-1. Faults: ``reset`` (abort, the
client sees 1006), ``close`` (close frame, ``code`` default 1011), ``stall``
(then abort), ``end`` (socket stays open, idle), ``error_event`` (an ``error``
message with ``status`` and ``sequence_number`` k; the socket stays open),
``malformed`` (a broken JSON message after frame k, then the rest),
``connection_limit`` (``websocket_connection_limit_reached`` error, then close
with ``code`` default 1013); a non-2xx ``status`` sends an ``error`` message.
``previous_response_id`` must name a response completed on the same socket or
stored globally (HTTP replies unless ``store: false``; socket replies only with
``store: true``); otherwise the reply is a 400 ``previous_response_not_found``
error (over HTTP too).
"""

from unbroken.mock.actions import (
    ACTION_KEYS,
    ERROR_KINDS,
    FAULTS,
    REPLIES,
    Action,
    ActionError,
    expand_actions,
    parse_action,
)
from unbroken.mock.command import load_script, main_mock, serve_mock
from unbroken.mock.provider import MockProvider, RecordedRequest, RecordedUpgrade
from unbroken.mock.wire import (
    ANTHROPIC_NAME,
    CHAT_NAME,
    PROTOCOL_NAMES,
    RESPONSES_NAME,
    encode_sse,
    events_for,
    frames_for,
    responses_events,
    ws_messages_for,
    ws_request,
)

__all__ = [
    "ACTION_KEYS",
    "ANTHROPIC_NAME",
    "CHAT_NAME",
    "ERROR_KINDS",
    "FAULTS",
    "PROTOCOL_NAMES",
    "REPLIES",
    "RESPONSES_NAME",
    "Action",
    "ActionError",
    "MockProvider",
    "RecordedRequest",
    "RecordedUpgrade",
    "encode_sse",
    "events_for",
    "expand_actions",
    "frames_for",
    "load_script",
    "main_mock",
    "parse_action",
    "responses_events",
    "serve_mock",
    "ws_messages_for",
    "ws_request",
]
