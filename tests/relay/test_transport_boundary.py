"""Transports carry out the core's decisions: they read and write none of its state.

An AST walk over ``relay/``: on the turn machine, the retry state and a ledger (any
expression named ``machine``, ``retry``, ``ledger`` or ``attempt_ledger``, config
sections aside) a transport may call methods and read properties, never write an
attribute and never read a plain field (`PUBLISHED` would list an exception: it is
empty).  A ledger is the machine's own: a transport never reaches one.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import unbroken.relay
from unbroken.core.admission.policy import RetryState
from unbroken.core.turn.ledger import Ledger
from unbroken.core.turn.machine import TurnMachine

RELAY = Path(unbroken.relay.__file__).resolve().parent

#: the core objects a transport holds, by the names it holds them under
OBJECTS: dict[str, type] = {
    "machine": TurnMachine,
    "retry": RetryState,
    "ledger": Ledger,
    "attempt_ledger": Ledger,
}
#: plain fields a transport may read: none (what the machine publishes, the cancels
#: to send, the outcome, the first frame, the profile, are properties and methods)
PUBLISHED: dict[type, frozenset[str]] = {}
#: a config section named like a core object (``config.retry``) is not one
_CONFIG = {"config", "cfg"}


def _interface(cls: type) -> frozenset[str]:
    """What a transport may use of ``cls``: its public methods and properties."""
    if cls is Ledger:
        return frozenset()  # the machine's own: nothing of it for a transport
    names = {
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }
    return frozenset(names | PUBLISHED.get(cls, frozenset()))


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def violations(source: str, where: str = "<source>") -> list[str]:
    """Each access in ``source`` that reads or writes a core object's state."""
    interfaces = {name: _interface(cls) for name, cls in OBJECTS.items()}
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        path = _dotted(node.value)
        if not path or path[-1] not in OBJECTS or _CONFIG & set(path):
            continue
        holder = path[-1]
        what = f"{where}:{node.lineno}: {'.'.join(path)}.{node.attr}"
        if not isinstance(node.ctx, ast.Load):
            out.append((node.lineno, node.col_offset, f"{what} (written)"))
        elif node.attr not in interfaces[holder]:
            out.append((node.lineno, node.col_offset, f"{what} (a field, read)"))
    return [what for _, _, what in sorted(out)]


def test_no_transport_reads_or_writes_core_state() -> None:
    files = sorted(RELAY.rglob("*.py"))
    assert len(files) >= 10
    found = [
        v
        for f in files
        for v in violations(f.read_text(encoding="utf-8"), str(f.relative_to(RELAY)))
    ]
    assert found == []


def test_the_walk_sees_each_kind_of_reach() -> None:
    sample = "\n".join(
        [
            "self.machine.last_rx = now",  # a write
            "t = machine.last_rx",  # a field read
            "retry.current = 2",  # a write on the retry state
            "key = self.retry.keys[0]",  # a retry field read
            "done = self.machine.attempt_ledger.state",  # a ledger reached
            "ledger.held_bytes",  # a ledger's field
            "self.machine.feed_chunk(now, b'')",  # a method: fine
            "self.machine.ended",  # a property: fine
            "self.retry.admitted",  # a property: fine
            "self.config.retry.max_body_mb",  # a config section: not the retry state
            "machine.outcome",  # a property: fine
            "machine.reply",  # a sub-state: a field
            "machine._cancels",  # the cancels: only through take_cancels / has_cancels
        ]
    )
    got = violations(sample)
    assert [g.split(": ", 1)[1] for g in got] == [
        "self.machine.last_rx (written)",
        "machine.last_rx (a field, read)",
        "retry.current (written)",
        "self.retry.keys (a field, read)",
        "self.machine.attempt_ledger (a field, read)",
        "self.machine.attempt_ledger.state (a field, read)",
        "ledger.held_bytes (a field, read)",
        "machine.reply (a field, read)",
        "machine._cancels (a field, read)",
    ]
