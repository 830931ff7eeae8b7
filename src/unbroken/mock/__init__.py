"""Deterministic, fault-injecting fake LLM provider for tests, benchmarks and chaos-testing.

Serves OpenAI Chat Completions (``POST .../v1/chat/completions``), OpenAI
Responses (``POST .../v1/responses``) and Anthropic Messages
(``POST .../v1/messages``), streamed (``"stream": true`` -> SSE) or not, in the
real wire formats. Quick start::

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
  end | error_event | malformed, with ``after_frame`` (frames sent before the
  fault), ``seconds`` (stall), ``error`` (overloaded | server_error | rate_limit |
  invalid_request | context_length), ``error_style`` (Responses: "failed" ->
  ``response.failed``, "error" -> ``error`` event), ``rst`` (abort with a TCP RST);
* ``count``: repeat the action N times in the queue. Keys starting with ``_`` are
  ignored (comments).

Frames are the SSE events of the reply, numbered from 1 (for Chat Completions
the usage chunk and ``data: [DONE]`` are frames too); a non-streamed body is two
frames (its two halves). :func:`frames_for` gives the exact bytes of a clean
reply, which are a function of the protocol, the reply-shape keys and the
request JSON only.
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
from unbroken.mock.cli import load_script, main_mock, serve_mock
from unbroken.mock.server import MockProvider, RecordedRequest
from unbroken.mock.wire import (
    ANTHROPIC,
    CHAT,
    PROTOCOLS,
    RESPONSES,
    encode_sse,
    events_for,
    frames_for,
    responses_events,
)

__all__ = [
    "ACTION_KEYS",
    "ANTHROPIC",
    "CHAT",
    "ERROR_KINDS",
    "FAULTS",
    "PROTOCOLS",
    "REPLIES",
    "RESPONSES",
    "Action",
    "ActionError",
    "MockProvider",
    "RecordedRequest",
    "encode_sse",
    "events_for",
    "expand_actions",
    "frames_for",
    "load_script",
    "main_mock",
    "parse_action",
    "responses_events",
    "serve_mock",
]
