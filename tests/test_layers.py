"""The package's layers are import-linter contracts, and docs/architecture.md says the same.

The contracts live in pyproject.toml (``[tool.importlinter]``): a layers contract for
the whole package, an allow-list for the sans-IO core (the standard library and
msgspec, nothing else), and no import cycles at any depth.  Function-level imports
count: a cycle or a layer broken inside a function is still broken.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


#: ``lint-imports``, with this interpreter
_MAIN = "import sys; from importlinter.cli import lint_imports_command as m; sys.exit(m())"


def _lint_imports(
    cwd: Path, *args: str, pythonpath: list[Path]
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [sys.executable, "-c", _MAIN, "--no-cache", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT, pythonpath=[ROOT / "src"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in out


def test_the_contracts_see_function_level_imports(tmp_path: Path) -> None:
    """Each contract type breaks on an import made inside a function: a cycle, a
    layer imported upwards, a library the allow-list does not name."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high.py").write_text("import pkg.low.a\n")
    (pkg / "low" / "a.py").write_text(
        "import json\n\ndef f():\n    import pkg.high\n    import email\n    return pkg.high\n"
    )
    (pkg / "low" / "b.py").write_text("def g():\n    import pkg.low.c\n")
    (pkg / "low" / "c.py").write_text("def h():\n    import pkg.low.b\n")
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_package = pkg
            include_external_packages = True
            contract_types =
                allow_only: tools.import_contracts.AllowOnlyContract

            [importlinter:contract:layers]
            name = layers
            type = layers
            containers = pkg
            layers =
                high
                low

            [importlinter:contract:allow]
            name = allow
            type = allow_only
            source_modules = pkg.low.a
            allowed_modules = json

            [importlinter:contract:cycles]
            name = cycles
            type = acyclic_siblings
            ancestors = pkg
            """
        )
    )
    result = _lint_imports(tmp_path, ".importlinter", pythonpath=[tmp_path, ROOT])
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Contracts: 0 kept, 3 broken." in out, out
    assert "pkg.low.a is not allowed to import pkg.high" in out  # the allow-list
    assert "pkg.low.a:4: import pkg.high" in out  # the line, inside the function
    assert "pkg.low.a is not allowed to import email" not in out  # stdlib is fine


_NAME = re.compile(r"`([A-Za-z_]\w*)(?:/|\.py)?`")


def _doc_table() -> dict[str, tuple[int, set[str]]]:
    """docs/architecture.md's layer table: module -> (layer, the names it may import)."""
    rows: dict[str, tuple[int, set[str]]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        module = _NAME.fullmatch(cells[1])
        assert module is not None, line
        rows[module.group(1)] = (int(cells[0]), set(_NAME.findall(cells[3])))
    return rows


def _contract_table() -> dict[str, tuple[int, set[str]]]:
    """The same table, from the contracts: each layer may import every layer below it,
    and an allow-list's modules what it names."""
    (layers,) = [c for c in _contracts() if c["type"] == "layers" and c["id"] == "layers"]
    assert layers["containers"] == ["unbroken"]
    levels = [[m.strip() for m in layer.split("|")] for layer in layers["layers"]]
    allowed = {
        source.removeprefix("unbroken."): set(c.get("allowed_modules", []))
        for c in _contracts()
        if c["type"] == "allow_only"
        for source in c["source_modules"]
    }
    out: dict[str, tuple[int, set[str]]] = {}
    for n, level in enumerate(levels):
        below = {m for lower in levels[n + 1 :] for m in lower}
        for module in level:
            out[module] = (n + 1, below | allowed.get(module, set()))
    return out


def test_the_architecture_table_is_the_layers_contract() -> None:
    doc = _doc_table()
    assert len(doc) >= 10
    assert doc == _contract_table()


def test_every_module_of_the_package_is_in_a_layer() -> None:
    src = ROOT / "src" / "unbroken"
    tops = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    tops |= {p.parent.name for p in src.glob("*/__init__.py")}
    assert tops == set(_contract_table())


def test_the_commands_cli_imports_by_name_sit_below_it() -> None:
    """`cli` imports each command's module by its name (importlib), which no import
    graph sees: they must sit in layers below `cli`, as an import statement would."""
    from unbroken.cli import COMMAND_MODULES, COMMAND_OF

    table = _contract_table()
    cli_layer, below = table["cli"]
    for name in {*COMMAND_MODULES, *COMMAND_OF.values()}:
        top = name.split(".")[1]
        assert top in below and table[top][0] > cli_layer, name
