"""The README and docs say what the code does: checked against the code, not by eye.

The demo and stats samples are checked in tests/test_demo.py, the status samples
in tests/observe/test_status.py, the OpenCode numbers by the e2e tests. The README
is a front page: short, its sections in a fixed order, and each figure in it
found in a docs section that names the command that measures it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from docsamples import (
    CONFIGURATION,
    DOCS,
    README,
    ROOT,
    STORM,
    STORM_PLACES,
    TROUBLESHOOTING,
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
    block = block_after(CONFIGURATION, CONFIG_MARKER, "toml")
    documented = _documented_keys(block)
    schema = _schema()
    assert set(documented) - {"routes"} == set(schema)
    for name, keys in schema.items():
        assert documented[name] == keys, (name, sorted(keys ^ documented[name]))
    in_block = set(re.findall(r"[{,] *([a-z_]+) = ", block.split("[routes.NAME]")[1]))
    assert in_block <= config_module.UPSTREAM_KEYS
    text = section(CONFIGURATION, "Configuration")
    for key in config_module.UPSTREAM_KEYS:
        assert f"`{key}" in text or key in in_block, f"upstream key {key} is not documented"


def test_the_config_block_shows_the_defaults() -> None:
    """Every value in the block is the default, except the examples (path, routes)."""
    data: dict[str, Any] = tomllib.loads(block_after(CONFIGURATION, CONFIG_MARKER, "toml"))
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
        for block in code_blocks(section(TROUBLESHOOTING, "Troubleshooting"))
        for line in block.splitlines()
    ]
    pattern = _pattern(fmt)
    assert any(pattern.search(line) for line in samples), (
        f"docs/troubleshooting.md has no sample of this log line from {path}: {fmt!r}"
    )


def test_troubleshooting_says_what_a_stall_and_a_degraded_journal_are() -> None:
    text = section(TROUBLESHOOTING, "Troubleshooting")
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


# -- the docs' small promises -------------------------------------------------------------
def test_the_quickstart_snippet_passes_the_key() -> None:
    [snippet] = code_blocks(section(CONFIGURATION, "Quickstart"), "python")
    assert 'api_key=os.environ["OPENAI_API_KEY"]' in snippet
    assert 'api_key=os.environ["ANTHROPIC_API_KEY"]' in snippet
    compile(snippet, "docs/configuration.md Quickstart", "exec")


def test_the_quickstart_mock_recipe_runs_when_pasted(tmp_path: Path) -> None:
    """Issue 35: the offline recipe ran ``unbroken serve`` in the foreground before its
    curls, so pasted into a terminal it blocked there.  Now it runs the mock and the
    relay in the background, waits for both, and stops them: run as one script (on
    free ports), it ends by itself, and the client got one clean stream."""
    import os
    import signal
    import socket
    import subprocess

    text = section(CONFIGURATION, "Quickstart")
    recipe = code_blocks(text[text.index("Try it offline") :], "sh")[0]
    assert "unbroken serve" in recipe and "kill $RELAY $MOCK" in recipe

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port

    mock_port, relay_port = free_port(), free_port()
    script = (
        recipe.replace("4781", str(mock_port))
        .replace("4780", str(relay_port))
        .replace("/tmp/unbroken.toml", str(tmp_path / "unbroken.toml"))
    )
    assert script.count(str(relay_port)) >= 3  # the serve, the wait, the request
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    env |= {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # the pipes close when the script and both servers it started have ended
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert out.rstrip().endswith("data: [DONE]"), out
    assert '"finish_reason":"stop"' in out
    assert err.count("WARNING retry route=mock") == 4, err  # "the relay logs four retries"
    assert "outcome=recovered" in err


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    setup = section(README, "Set-up")
    assert "pip install -e '.[test]' -c constraints.txt && pytest" in setup
    assert "pytest -m 'not e2e'" in setup
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "pip install -e '.[test]' -c constraints.txt && pytest"


def test_the_readme_test_commands_print_the_pass_fail_count(tmp_path: Path) -> None:
    """Issue 35: pyproject's ``addopts = "-q"`` plus a ``-q`` on the command line is
    ``-qq``, which hides pytest's summary line (``2501 passed in ...``): a run said
    nothing of how many tests passed or failed.  Each of the README's test commands,
    with the project's pytest settings, prints it."""
    import shlex
    import subprocess
    import sys

    setup = section(README, "Set-up")
    commands = [m.group(1) for m in re.finditer(r"&& (pytest[^#\n]*)", setup)]
    commands += re.findall(r"`(pytest [^`]*)`", setup)
    assert len(commands) >= 2, commands
    (tmp_path / "test_one.py").write_text("def test_one() -> None:\n    pass\n")
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "pytest", command
        settings = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
        done = subprocess.run(
            [sys.executable, "-m", *argv, *settings, "-p", "no:cacheprovider", "test_one.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.search(r"^=* ?1 passed\b", done.stdout, re.M), (command, done.stdout)


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


#: the ``unbroken.*`` span attributes `unbroken.observe.otel` sets (the docs name them)
OTEL_ATTRIBUTES = frozenset(
    re.findall(r'"(unbroken\.[a-z_.]+)"', (ROOT / "src/unbroken/observe/otel.py").read_text())
)


@pytest.mark.parametrize(
    ("doc", "name"), _mentions(r"(?<=`)unbroken\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]")
)
def test_every_python_name_the_docs_give_exists(doc: str, name: str) -> None:
    if name in OTEL_ATTRIBUTES:  # a span attribute (observability.md), not a Python name
        return
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


def _decision_table() -> list[tuple[str, str, str]]:
    """(question, module path, name) for each name in architecture.md's "Where a
    decision lives" table."""
    text = section(ROOT / "docs" / "architecture.md", "Where a decision lives")
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| the question"):
            continue
        question, where = line.strip("| ").split(" | ")
        module = ""
        for token in re.findall(r"`([^`]+)`", where):
            if token.endswith((".py", "/")):
                module = token
            else:
                rows.append((question, module, token))
    return rows


def test_where_a_decision_lives_names_only_what_exists() -> None:
    rows = _decision_table()
    assert len(rows) >= 20
    for question, path, name in rows:
        assert (ROOT / "src" / "unbroken" / path).exists(), (question, path)
        module = "unbroken." + path.removesuffix(".py").removesuffix("/").replace("/", ".")
        module = module.removesuffix(".__init__")
        obj: object = importlib.import_module(module)
        for attr in name.split("."):
            assert hasattr(obj, attr), f"{question}: {module} has no {name}"
            obj = getattr(obj, attr)


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


# -- the front page -------------------------------------------------------------------------
#: The README's sections, in this order (a short section may come between them).
FRONT_PAGE = (
    "What it is",
    "Set-up",
    "Protecting an agent",
    "What happens on each failure",
    "Where to read more",
)
MAX_README_LINES = 250
MAX_SECURITY_LINES = 8


def _headings(path: Path, level: int) -> list[str]:
    """The headings of one level, outside code blocks."""
    out = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#" * level + " "):
            out.append(line[level + 1 :].strip())
    return out


def test_the_readme_is_a_short_front_page_with_its_sections_in_order() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    headings = _headings(README, 2)
    assert headings[0] == FRONT_PAGE[0], headings
    assert headings[-1] == FRONT_PAGE[-1], headings
    assert [h for h in headings if h in FRONT_PAGE] == list(FRONT_PAGE), headings
    security = section(README, "Security").strip().splitlines()
    assert len(security) <= MAX_SECURITY_LINES, security
    assert "(docs/security.md)" in "".join(security)


def test_the_readme_set_up_gives_the_python_version_pyproject_requires() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    version = re.fullmatch(r">=\s*(\d+\.\d+)", requires)
    assert version, requires
    assert f"Python ≥ {version.group(1)}" in section(README, "Set-up")


def test_the_readme_installs_from_a_clone_not_from_an_index() -> None:
    """unbroken is not on a package index: every install the docs give is ``-e .``."""
    for doc in doc_files():
        for m in re.finditer(r"pip install (?:-U )?'?unbroken\b", doc.read_text()):
            pytest.fail(f"{doc.name}: {m.group(0)!r}: install from a clone (pip install -e .)")


def test_where_to_read_more_points_to_where_a_decision_lives() -> None:
    text = section(README, "Where to read more")
    assert "[docs/architecture.md](docs/architecture.md): where a decision lives" in text


# -- the README's figures -------------------------------------------------------------------
#: A figure: a number with a unit of time, size, rate or count ("about"/"~" dropped).
FIGURE = re.compile(
    r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:[–-]\d[\d,]*(?:\.\d+)?)?"
    r"(?: (?:min \d+ s|min|ms|s|h|MB|GB|requests/s|tests|requests|retries)|%)(?![\w/])"
)
#: A default, given with the key it is the default of: "`[retry] delay_ms` (250 ms)".
DEFAULT = re.compile(r"`\[([a-z_]+)\] ([a-z_]+)` \((\d+(?:\.\d+)?) (ms|s)\)")
#: A command that measures or checks a figure, named in backticks in a docs section.
COMMAND = re.compile(r"`(?:CI=true bash \.ci/run|pytest\b|python (?:bench|tools)/)[^`]*`")


def _prose(text: str) -> str:
    """The text without its code blocks, with runs of whitespace made one space."""
    text = re.sub(r"^```.*?^```\s*$", " ", text, flags=re.M | re.S)
    return re.sub(r"\s+", " ", text)


def _chunks(path: Path) -> list[str]:
    """A page cut at every heading (any level), each piece as prose."""
    pieces: list[list[str]] = [[]]
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#+ ", line):
            pieces.append([])
        pieces[-1].append(line)
    return ["\n".join(p) for p in pieces]


def _measured(figure: str) -> list[str]:
    """The docs sections that give this figure and name a command that measures it."""
    return [
        f"{doc.name}: {COMMAND.search(chunk).group(0)}"  # type: ignore[union-attr]
        for doc in sorted(DOCS.glob("*.md"))
        for chunk in _chunks(doc)
        if COMMAND.search(chunk) and figure in _prose(chunk)
    ]


def _readme_figures() -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """The README's defaults (section, key, value, unit) and its other figures."""
    text = _prose(README.read_text())
    defaults = DEFAULT.findall(text)
    return defaults, FIGURE.findall(DEFAULT.sub(" ", text))


def test_the_readme_has_figures_to_check() -> None:
    defaults, figures = _readme_figures()
    assert len(defaults) >= 3 and len(figures) >= 8, (defaults, figures)
    # the test command's time and count (whatever the last measurement gave)
    assert any(re.fullmatch(r"\d+ min \d+ s", f) for f in figures), figures
    assert any(re.fullmatch(r"[\d,]+ tests", f) for f in figures), figures


@pytest.mark.parametrize("figure", _readme_figures()[1])
def test_each_readme_figure_is_in_a_docs_section_that_names_its_command(figure: str) -> None:
    assert _measured(figure), (
        f"README gives {figure!r}: no docs section gives it with the command that measures it"
    )


@pytest.mark.parametrize(("table", "key", "value", "unit"), _readme_figures()[0])
def test_each_readme_default_is_the_documented_default(
    table: str, key: str, value: str, unit: str
) -> None:
    defaults: dict[str, Any] = tomllib.loads(block_after(CONFIGURATION, CONFIG_MARKER, "toml"))
    assert key.endswith(f"_{unit}"), f"README gives [{table}] {key} in {unit}"
    assert float(defaults[table][key]) == float(value), (table, key, defaults[table][key])


def test_the_figure_check_sees_figures_and_commands() -> None:
    found = FIGURE.findall(
        "took 11 min 33 s, about 74 s, 482 MB and 1.3 GB; 6 requests; 2,049 tests"
    )
    assert found == ["11 min 33 s", "74 s", "482 MB", "1.3 GB", "6 requests", "2,049 tests"]
    assert not FIGURE.findall("Python ≥ 3.11, port 4780, opencode-ai@1.18.33, 30 × 503, 429s")
    assert DEFAULT.findall("after `[retry] delay_ms` (250 ms)") == [
        ("retry", "delay_ms", "250", "ms")
    ]
    assert COMMAND.search("run `python bench/x.py --repeat 2` to")
    assert not COMMAND.search("see `tests/e2e/clis.py`")


# -- links between the pages ------------------------------------------------------------------
def _slugs(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    seen: dict[str, int] = {}
    out = set()
    for level in range(1, 7):
        for heading in _headings(path, level):
            slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links() -> list[tuple[str, str]]:
    found = []
    for doc in doc_files():
        for m in re.finditer(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
            target = m.group(1)
            if not re.match(r"[a-z]+:", target):
                found.append((str(doc.relative_to(ROOT)), target))
    return sorted(set(found))


@pytest.mark.parametrize(("doc", "target"), _links())
def test_every_link_between_the_pages_resolves(doc: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    page = (ROOT / doc).parent / path if path else ROOT / doc
    assert page.exists(), f"{doc} links to {target}: no such file"
    if anchor:
        assert page.suffix == ".md", f"{doc} links to an anchor in {path}"
        assert anchor in _slugs(page), f"{doc} links to {target}: no such heading"


def test_where_to_read_more_lists_every_docs_page() -> None:
    text = section(README, "Where to read more")
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in text, f"README does not point to docs/{page.name}"
