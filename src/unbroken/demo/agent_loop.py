"""The demo's agent, written once: a turn, its storm, and the loop every protocol runs.

Each turn is two steps, as an agent's are: a streamed tool call, then (with the
tool's result in the history) the streamed answer.  A failed step is retried once,
as agents do; a turn is *lost* when a step fails twice.  Every completed stream is
checked against the exact reply the mock sends (`unbroken.mock.frames_for`): a frame
delivered twice (a leaked replay) counts as a duplicate, which must never happen;
other text or tool arguments count as corrupted.

What differs between the protocols is the `Agent`: how it builds a request, reads a
stream, and adds the tool call and its result to the history (`chat_agent`,
`gemini_agent`, `messages_agent`), and its storms and words (`DemoProtocol`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

__all__ = [
    "AGENT_RETRIES",
    "MODEL",
    "SYSTEM_PROMPT",
    "TEXT_REPLY",
    "TOOL_REPLY",
    "Agent",
    "DemoProtocol",
    "DemoTurn",
    "StepReply",
    "Storm",
    "agent_turn",
    "demo_session",
    "task_prompt",
]

MODEL = "mock-coder-1"
AGENT_RETRIES = 1  # the agent loop retries a failed step once
SYSTEM_PROMPT = "You are a coding agent. Use the bash tool."
#: the mock's reply to a demo turn's two steps: a tool call, then its answer
TOOL_REPLY: dict[str, Any] = {"reply": "tool"}
TEXT_REPLY: dict[str, Any] = {"reply": "text"}
#: the one tool, ``bash``: its description and its arguments' JSON schema (each protocol
#: declares it in its own shape)
BASH_TOOL = "bash"
BASH_DESCRIPTION = "Run a shell command."
BASH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}


@dataclass(frozen=True)
class Storm:
    name: str
    #: the turn's queue at the mock: faults and the replies of its two steps, in order
    script: tuple[dict[str, Any], ...]

    @property
    def faults(self) -> int:
        return sum(int(a.get("count", 1)) for a in self.script if "fault" in a or "status" in a)


@dataclass
class DemoTurn:
    """One agent turn as the client lived it."""

    number: int
    storm: str
    key: str
    step: int = 0  # 0: the tool call, 1: the answer, 2: done
    state: str = "queued"  # queued | requesting | streaming | retrying | done | LOST
    errors: int = 0  # errors that reached the agent
    last_error: str | None = None
    chunks: int = 0
    duplicates: int = 0  # chunks of a completed stream beyond the exact reply
    corrupted: int = 0  # completed streams whose text or tool call differs from the reply
    completed: bool = False
    lost: bool = False

    @property
    def session(self) -> str:
        """The agent session the turn's requests name (``x-session-id``)."""
        return f"demo-session-{self.number}"


def task_prompt(turn: DemoTurn) -> str:
    return f"Task {turn.number}: say hello from the shell."


@dataclass(frozen=True)
class StepReply:
    """What one step's stream brought, or what the mock's clean reply holds."""

    frames: int  # what the protocol counts to find a duplicate (chunks, events, starts)
    text: str
    args: str  # the tool call's arguments, as the protocol carries them
    call_id: str = ""
    calls: tuple[dict[str, Any], ...] = ()


class Agent(Protocol):
    """One turn's agent over one protocol: its history, and how it talks."""

    #: the replies of the turn's two steps, the tool call first
    shapes: tuple[dict[str, Any], dict[str, Any]]
    #: what the agent sees as a failed step (and retries)
    failures: tuple[type[BaseException], ...]

    def request(self) -> dict[str, Any]:
        """The next step's request body, from the history."""

    def expected(self, shape: dict[str, Any], request: dict[str, Any]) -> StepReply:
        """The clean reply the mock sends for ``shape`` to ``request``."""

    async def stream(self, request: dict[str, Any], turn: DemoTurn) -> StepReply:
        """One streamed call, read as the protocol's client reads it; raises on a failure."""

    def duplicates(self, got: StepReply, want: StepReply) -> int:
        """Frames of a completed stream beyond the exact reply."""

    def took_tool(self, got: StepReply) -> None:
        """Add the tool call and its result to the history."""


async def agent_turn(agent: Agent, turn: DemoTurn, retries: int = AGENT_RETRIES) -> None:
    """The demo's agent loop: the tool call, its result, the answer; a failed step is
    retried ``retries`` times, and the turn is lost when a step fails every time."""
    for step, shape in enumerate(agent.shapes):
        turn.step = step
        request = agent.request()
        want = agent.expected(shape, request)
        for _try in range(1 + retries):
            turn.state = "requesting"
            try:
                got = await agent.stream(request, turn)
            except agent.failures as exc:  # what an agent sees: errors, read timeouts, resets
                turn.errors += 1
                turn.last_error = type(exc).__name__
                turn.state = "retrying"
                continue
            turn.duplicates += agent.duplicates(got, want)
            if got.text != want.text or got.args != want.args:
                turn.corrupted += 1
            break
        else:
            turn.state = "LOST"
            turn.lost = True
            return
        if shape is TOOL_REPLY:
            agent.took_tool(got)
    turn.step = 2
    turn.state = "done"
    turn.completed = True


@contextlib.asynccontextmanager
async def demo_session(timeout_s: float) -> AsyncIterator[aiohttp.ClientSession]:
    """The plain (aiohttp) clients' session: no retries of its own, a short read timeout."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s),
        headers={"User-Agent": "unbroken-demo"},
    ) as session:
        yield session


def _nothing_missing() -> str | None:
    return None


#: a protocol's agents: ``(base_url, client_timeout_s)`` -> a context whose value makes
#: each turn's agent (one client for all of them, closed at the end)
AgentsFor = Callable[[str, float], AbstractAsyncContextManager[Callable[[DemoTurn], Agent]]]


@dataclass(frozen=True)
class DemoProtocol:
    """One wire protocol the demo's agent can speak: its storms, agents and words."""

    name: str
    #: ``(retry_after_s, stall_s)`` -> the storm of each kind of turn
    storms: Callable[[float, float], list[Storm]]
    agents: AgentsFor
    #: the introduction's words for it ("" for Chat, the default)
    over: str
    #: the summary's line about the client
    client: str
    #: the demo route's keys with ``--after-commit continue`` (None: the protocol has
    #: no way to continue a cut answer)
    continue_route: dict[str, str] | None
    #: what the agent needs that is not installed, as one line (None: nothing)
    missing: Callable[[], str | None] = _nothing_missing
