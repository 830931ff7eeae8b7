"""``unbroken demo``: a storm against the mock provider, with and without the relay.

Needs no network and no keys.  Starts the fault-injecting mock provider and a relay in
front of it (both on loopback, ephemeral ports), then drives N concurrent agent-like
turns through the relay: each turn streams a tool call, "runs" it, and streams the
answer.  Every turn has its own scripted storm (503 bursts, a 429 with Retry-After,
resets before output, a reset mid-tool-arguments, a drop after output, a stall).  Then
the same storms run straight against the mock, with the same client, for contrast.

The client is the same both times, in an agent loop that retries a failed step once,
as agents do; a turn is *lost* when a step fails twice.  By default it is the official
``openai`` SDK with its defaults (two retries of its own) and a short read timeout
(the ``demo`` extra: ``pip install 'unbroken[demo]'``).  ``--protocol gemini`` runs the
Gemini API's own storms (``:streamGenerateContent?alt=sse``, a whole ``functionCall``,
Google RPC errors, ``RetryInfo``) and ``--protocol anthropic`` the same storms over
Messages, each with a plain aiohttp client that has no retries of its own.

Every completed stream is checked against the exact reply the mock sends
(``unbroken.mock.frames_for``): a frame delivered twice (a leaked replay) counts as a
duplicate, which must never happen.

The modules, top to bottom (the ``demo-layers`` contract): `entry` (the command),
`output` (the live table, the summary), `runner` (the mock, the relay, the accounting),
one agent per protocol (`chat_agent`, `gemini_agent`, `messages_agent`), and
`agent_loop` (the turn, its storm, and the loop they all run).
"""

from __future__ import annotations

from unbroken.demo.agent_loop import DemoTurn
from unbroken.demo.entry import register
from unbroken.demo.output import DEMO_STATE_STYLE, format_summary, render_run
from unbroken.demo.runner import DEMO_PROTOCOLS, STORMS, DemoRun, run_demo, storms

__all__ = [
    "DEMO_PROTOCOLS",
    "DEMO_STATE_STYLE",
    "STORMS",
    "DemoRun",
    "DemoTurn",
    "format_summary",
    "register",
    "render_run",
    "run_demo",
    "storms",
]
