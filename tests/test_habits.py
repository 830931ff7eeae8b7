"""Habits of the code base that a reviewer would otherwise have to remember."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "unbroken"

_CONTAINERS = {"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter"}
_MUTATORS = {
    "append",
    "extend",
    "add",
    "update",
    "pop",
    "popitem",
    "clear",
    "insert",
    "remove",
    "discard",
    "setdefault",
}

#: the module globals that are changed after import, each on purpose: none.  A memo is
#: `functools.lru_cache` on a pure function, never a dict; the turn machine's testing
#: switch is a `contextvars.ContextVar` (scoped to a context, restored by its token).
ALLOWED: set[str] = set()


def mutated_globals(path: Path, name: str) -> set[str]:
    """What a module changes of its own globals from inside a function: names it
    rebinds (``global``) and module-level containers it mutates."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    containers: set[str] = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        literal = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp))
        made = isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in (
            _CONTAINERS | {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary"}
        )
        if literal or made:
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found |= {f"{name}: global {g}" for g in n.names}
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id in containers
                and n.func.attr in _MUTATORS
            ):
                found.add(f"{name}: {n.func.value.id}")
            elif isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = [n.target] if isinstance(n, ast.AugAssign) else n.targets
                for t in targets:
                    if (
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in containers
                    ):
                        found.add(f"{name}: {t.value.id}")
    return found


def test_no_module_changes_its_globals_but_the_listed_ones() -> None:
    found: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        found |= mutated_globals(path, str(path.relative_to(SRC)))
    assert found == ALLOWED


def test_the_scan_sees_each_kind_of_change(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "_n = 0\n_seen = set()\n_by = {}\n_ok = []\n"
        "def f():\n    global _n\n    _n += 1\n    _seen.add(1)\n    _by['k'] = 2\n"
        "    mine = []\n    mine.append(_ok)\n"
    )
    assert mutated_globals(sample, "m") == {"m: global _n", "m: _seen", "m: _by"}


# -- one name, one meaning ------------------------------------------------------------

_PREFILL = {"core/wire/protocols/anthropic_prefill.py", "core/wire/protocols/chat_prefix.py"}
_PROTOCOLS = {f"core/wire/protocols/{p}.py" for p in ("anthropic", "chat", "gemini", "responses")}
_AGENTS = {f"agents/{a}.py" for a in ("claude", "codex", "gemini_cli")}
_COMMANDS = {
    "demo.py",
    "observe/stats.py",
    "observe/status.py",
    "opencode/resume.py",
    "opencode/run.py",
    "opencode/setup.py",
}

#: public top-level names (functions, classes, UPPER_CASE constants) defined in more
#: than one module on purpose, with the modules that define them: one role, one module
#: per implementation, each called through its module (``anthropic.read_committed``,
#: ``claude.plan``, ``chat.error_frame``).  A value two modules share is defined once
#: and imported, never listed here.
SHARED_NAMES: dict[str, tuple[set[str], str]] = {
    # prefill continuation's two protocol halves (core/turn/prefill_continue.py calls each)
    "Committed": (_PREFILL, "what the client has, read back from the released bytes"),
    "read_committed": (_PREFILL, "reads that back (or refuses)"),
    "request_refusal": (_PREFILL, "why a request can never be continued by prefill"),
    "Plan": (_PREFILL, "a continuation request and how its frames join"),
    "plan_continuation": (_PREFILL, "builds that request (or refuses)"),
    "FrameSplicer": (_PREFILL, "the continuation's frames as the client's stream goes on"),
    "error_frame": (_PROTOCOLS, "each protocol's retryable error that ends a cut turn"),
    "EVENTS": (
        {"core/wire/protocols/anthropic.py", "core/wire/protocols/responses.py"},
        "each protocol's table of SSE event names to frame kinds (where the name decides)",
    ),
    "plan": (_AGENTS, "each agent's `unbroken run` launch plan (agents/launcher.py)"),
    "register": (_COMMANDS, "each command's argparse set-up (cli.COMMAND_MODULES)"),
    "main": ({"cli.py", "core/turn/turn_table.py"}, "a command-line entry point"),
}


def modules(root: Path) -> list[Path]:
    """The package's modules but ``__init__`` and ``__main__``, which every package has."""
    return [p for p in sorted(root.rglob("*.py")) if p.stem not in ("__init__", "__main__")]


def shared_basenames(root: Path) -> dict[str, set[str]]:
    """Module file names that more than one module of ``root`` has."""
    seen: dict[str, set[str]] = {}
    for path in modules(root):
        seen.setdefault(path.name, set()).add(str(path.relative_to(root)))
    return {name: where for name, where in seen.items() if len(where) > 1}


def public_names(node: ast.stmt) -> list[str]:
    """The public names a module's top-level statement defines: a function, a class, or
    an UPPER_CASE constant (``NAME = ...``, ``NAME: T = ...``, ``A, B = ...``)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names = [node.name]
    elif isinstance(node, ast.Assign):
        targets = [
            e
            for t in node.targets
            for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        ]
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        names = [node.target.id] if node.target.id.isupper() else []
    else:
        names = []
    return [name for name in names if not name.startswith("_")]


def shared_names(root: Path) -> dict[str, set[str]]:
    """Public top-level functions, classes and constants that more than one module
    defines."""
    seen: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            for name in public_names(node):
                seen.setdefault(name, set()).add(str(path.relative_to(root)))
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    """`mock/server.py` beside `relay/server.py` makes a reader ask which: each module's
    name says what it is, once in the package."""
    assert shared_basenames(SRC) == {}


def test_no_public_name_is_defined_twice_but_the_listed_ones() -> None:
    """A public function, class or constant name means one thing in the package: a
    value two modules need is defined once and imported, and two different values
    get names that say which (``HEALTH_KEY_PREFIX``, ``RATE_KEY_PREFIX``); the
    exceptions are one role implemented per protocol, agent or command
    (`SHARED_NAMES`)."""
    assert shared_names(SRC) == {name: where for name, (where, _) in SHARED_NAMES.items()}


def test_the_name_scans_see_a_clash(tmp_path: Path) -> None:
    for folder, body in (("a", "def plan():\n    pass\n"), ("b", "class plan:\n    pass\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "cli.py").write_text(body + "def _own():\n    pass\n")
    (tmp_path / "c.py").write_text(
        "async def plan():\n    pass\ndef once():\n    pass\n"
        "LIMIT = 1\nTTL: float = 2.0\nA, B = 3, 4\n_OWN = 5\nlog = 6\n"
    )
    (tmp_path / "d.py").write_text(
        "LIMIT: int = 7\nX = TTL = 8.0\n_OWN = 9\nlog = 10\nA, B = 11, 12\n"
        "def f():\n    LIMIT = 13\n"
    )
    assert shared_basenames(tmp_path) == {"cli.py": {"a/cli.py", "b/cli.py"}}
    assert shared_names(tmp_path) == {
        "plan": {"a/cli.py", "b/cli.py", "c.py"},
        "LIMIT": {"c.py", "d.py"},
        "TTL": {"c.py", "d.py"},
        "A": {"c.py", "d.py"},
        "B": {"c.py", "d.py"},
    }
