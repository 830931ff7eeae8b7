"""The README and docs say what the code does: checked against the code, not by eye.

The demo and stats samples are checked in tests/test_demo.py, the status samples
in tests/observe/test_status.py, the OpenCode numbers by the e2e tests.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from docsamples import (
    README,
    ROOT,
    STORM,
    STORM_PLACES,
    block_after,
    code_blocks,
    doc_files,
    documented_storm_seconds,
    section,
)
from unbroken import config as config_module
from unbroken.config import parse_config

# -- the configuration block ---------------------------------------------------------------
CONFIG_MARKER = "One TOML file, from `--config FILE` or `UNBROKEN_CONFIG`."


def _documented_keys(block: str) -> dict[str, set[str]]:
    """Section -> keys in the README's config block, set or shown commented out."""
    keys: dict[str, set[str]] = {}
    current = ""
    for line in block.splitlines():
        head = re.match(r"^(?:# )?\[([a-z_]+)(?:\.[A-Za-z_.-]+)?\]", line)
        if head:
            current = head.group(1)
            keys.setdefault(current, set())
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key and current:
            keys[current].add(key.group(1))
    return keys


def _schema() -> dict[str, set[str]]:
    """Section -> its keys, from the code (``[clients.NAME]``: a client profile's)."""
    out = {}
    for name in config_module.SECTIONS - {"routes"}:
        if name == "clients":
            from unbroken.core.profiles import CLIENT_KEYS

            out[name] = set(CLIENT_KEYS)
            continue
        table = getattr(config_module, f"{name.upper()}_KEYS", None)
        assert table is not None, f"no key table for [{name}]: teach this test where it is"
        out[name] = set(table)
    return out


def test_the_config_block_documents_every_section_and_key() -> None:
    block = block_after(README, CONFIG_MARKER, "toml")
    documented = _documented_keys(block)
    schema = _schema()
    assert set(documented) - {"routes"} == set(schema)
    for name, keys in schema.items():
        assert documented[name] == keys, (name, sorted(keys ^ documented[name]))
    in_block = set(re.findall(r"[{,] *([a-z_]+) = ", block.split("[routes.NAME]")[1]))
    assert in_block <= config_module.UPSTREAM_KEYS
    text = section(README, "Configuration")
    for key in config_module.UPSTREAM_KEYS:
        assert f"`{key}" in text or key in in_block, f"upstream key {key} is not documented"


def test_the_config_block_shows_the_defaults() -> None:
    """Every value in the block is the default, except the examples (path, routes)."""
    data: dict[str, Any] = tomllib.loads(block_after(README, CONFIG_MARKER, "toml"))
    data.pop("routes")
    data["journal"].pop("path")
    assert parse_config(data, env={}) == parse_config({}, env={})


# -- troubleshooting ----------------------------------------------------------------------
#: The modules whose log lines the Troubleshooting section explains.
LOGGED = {
    "src/unbroken/observe/hooks.py": None,  # every line
    "src/unbroken/observe/journal.py": None,
    "src/unbroken/opencode/resume.py": (
        "resume: cannot reach",
        "resume: watching",
        "resume: lost",
        "resume session=%s attempt",
        "resumed session=",
        "no resume session=",
    ),
}


def _log_formats(path: str) -> list[str]:
    tree = ast.parse((ROOT / path).read_text())
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("warning", "info", "error")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "log"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append(node.args[0].value)
    return out


def _pattern(fmt: str) -> re.Pattern[str]:
    parts = re.split(r"(%(?:\.\d+)?[sdrfg])", fmt)
    regex = ""
    for part in parts:
        if re.fullmatch(r"%(?:\.\d+)?[sdrfg]", part):
            regex += r"-?\d+" if part == "%d" else ".+?"
        else:
            regex += re.escape(part)
    return re.compile(rf"(?:INFO|WARNING|ERROR) {regex}$")


def _explained() -> list[tuple[str, str]]:
    formats = []
    for path, only in LOGGED.items():
        for fmt in _log_formats(path):
            if only is None or fmt.startswith(only):
                formats.append((path, fmt))
    return formats


def test_the_log_lines_are_found_where_expected() -> None:
    kinds = {fmt.split(" ")[0] for _, fmt in _explained()}
    assert {"retry", "giving", "stream", "hold", "journal", "resume:"} <= kinds, kinds


@pytest.mark.parametrize(("path", "fmt"), _explained(), ids=lambda v: str(v)[:40])
def test_troubleshooting_explains_every_log_line(path: str, fmt: str) -> None:
    samples = [
        line
        for block in code_blocks(section(README, "Troubleshooting"))
        for line in block.splitlines()
    ]
    pattern = _pattern(fmt)
    assert any(pattern.search(line) for line in samples), (
        f"README Troubleshooting has no sample of this log line from {path}: {fmt!r}"
    )


def test_troubleshooting_says_what_a_stall_and_a_degraded_journal_are() -> None:
    text = section(README, "Troubleshooting")
    for words in (
        "reason=stall",
        "**A stall.**",
        "**The journal is degraded.**",
        "**A retry.**",
        "**A stream cut after output.**",
        "**Giving up.**",
        "**The hold limit.**",
    ):
        assert words in text, words


# -- the README's small promises -----------------------------------------------------------
def test_the_quickstart_snippet_passes_the_key() -> None:
    [snippet] = code_blocks(section(README, "Quickstart"), "python")
    assert 'api_key=os.environ["OPENAI_API_KEY"]' in snippet
    assert 'api_key=os.environ["ANTHROPIC_API_KEY"]' in snippet
    compile(snippet, "README Quickstart", "exec")


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    setup = section(README, "Set-up")
    assert "pip install -e '.[test]' && pytest" in setup
    assert "pytest -m 'not e2e'" in setup
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "pip install -e '.[test]' && pytest"


# -- names and paths in the docs exist -----------------------------------------------------
#: paths the docs quote from other projects' source trees
FOREIGN = ("src/chat/", "src/openai-", "tests/Fixtures/", "docs/api-reference/", "docs/guides/")


def _mentions(pattern: str) -> list[tuple[str, str]]:
    found = []
    for doc in doc_files():
        for m in re.finditer(pattern, doc.read_text()):
            found.append((doc.name, m.group(0)))
    return sorted(set(found))


@pytest.mark.parametrize(
    ("doc", "path"),
    _mentions(r"(?<![\w/.-])(?:src|tests|docs|bench|tools)/[A-Za-z0-9_./-]*[A-Za-z0-9_/]"),
)
def test_every_path_the_docs_name_exists(doc: str, path: str) -> None:
    if path.startswith(FOREIGN):
        return
    assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


@pytest.mark.parametrize(
    ("doc", "name"), _mentions(r"(?<=`)unbroken\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]")
)
def test_every_python_name_the_docs_give_exists(doc: str, name: str) -> None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"{doc} names {name}: no {attr}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{doc} names {name}, which cannot be imported")


# -- one measured number, the same everywhere -------------------------------------------------
def test_the_opencode_storm_time_is_the_same_everywhere() -> None:
    counts = {p.name: len(STORM.findall(p.read_text())) for p in STORM_PLACES}
    assert all(counts.values()), counts
    assert 40 < documented_storm_seconds() < 120


def test_docsamples_reads_markdown(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# A\ntext\n```toml\nk = 1\n```\n## B\nmore\n```\nplain\n```\n# C\n")
    assert code_blocks(section(doc, "A"), "toml") == ["k = 1\n"]
    assert code_blocks(section(doc, "B")) == ["plain\n"]
    assert block_after(doc, "more") == "plain\n"
