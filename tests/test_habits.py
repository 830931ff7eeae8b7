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

#: the module globals that are changed after import, each on purpose: the mock's
#: bounded render memos (pure functions of a digest).  (The turn machine's testing
#: switch is a `contextvars.ContextVar`: scoped to a context, restored by its token.)
ALLOWED = {
    "mock/wire/render.py: _cache",
    "mock/wire/ws_replies.py: _ws_cache",
}


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
