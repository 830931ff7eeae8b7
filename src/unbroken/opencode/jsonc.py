"""JSON with comments (OpenCode's ``opencode.jsonc``): read it, and edit it in place.

`loads` accepts ``//`` and ``/* */`` comments and trailing commas.  `set_path`
changes one value and leaves every other byte of the file as it was, comments
and formatting included, so a patched config still reads like the user's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JsoncError", "loads", "set_path", "strip"]


class JsoncError(ValueError):
    """The text is not JSON with comments; the message gives the line and column."""


@dataclass
class _Node:
    """A parsed value with its byte span; objects keep their members' spans."""

    start: int
    end: int  # exclusive
    kind: str  # object | array | string | number | literal
    members: dict[str, tuple[int, _Node]] = field(default_factory=dict)  # key -> (key start, value)
    order: list[str] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> JsoncError:
        at = self.pos if pos is None else pos
        line = self.text.count("\n", 0, at) + 1
        col = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return JsoncError(f"{message} at line {line} column {col}")

    def skip(self) -> None:
        """Skip whitespace and comments."""
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t\r\n\ufeff":
                self.pos += 1
            elif text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end + 1
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.error("unterminated comment")
                self.pos = end + 2
            else:
                return

    def value(self) -> _Node:
        self.skip()
        if self.pos >= len(self.text):
            raise self.error("unexpected end of input")
        c = self.text[self.pos]
        if c == "{":
            return self.obj()
        if c == "[":
            return self.arr()
        if c == '"':
            start = self.pos
            self.string()
            return _Node(start, self.pos, "string")
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",:]} \t\r\n/":
            self.pos += 1
        word = self.text[start : self.pos]
        if word in ("true", "false", "null"):
            return _Node(start, self.pos, "literal")
        try:
            float(word)
        except ValueError:
            raise self.error(f"unexpected {word[:20] or self.text[start]!r}", start) from None
        return _Node(start, self.pos, "number")

    def string(self) -> str:
        start = self.pos
        self.pos += 1
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c == "\\":
                self.pos += 2
            elif c == '"':
                self.pos += 1
                try:
                    result: str = json.loads(text[start : self.pos])
                except ValueError:
                    raise self.error("bad string", start) from None
                return result
            elif c == "\n":
                break
            else:
                self.pos += 1
        raise self.error("unterminated string", start)

    def obj(self) -> _Node:
        node = _Node(self.pos, self.pos, "object")
        self.pos += 1
        while True:
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == "}":
                self.pos += 1
                node.end = self.pos
                return node
            if self.pos >= len(self.text) or self.text[self.pos] != '"':
                raise self.error("expected a key or '}'")
            key_start = self.pos
            key = self.string()
            self.skip()
            if self.pos >= len(self.text) or self.text[self.pos] != ":":
                raise self.error("expected ':'")
            self.pos += 1
            child = self.value()
            if key not in node.members:
                node.order.append(key)
            node.members[key] = (key_start, child)  # the last duplicate wins, as in JSON.parse
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == ",":
                self.pos += 1
            elif self.pos >= len(self.text) or self.text[self.pos] != "}":
                raise self.error("expected ',' or '}'")

    def arr(self) -> _Node:
        node = _Node(self.pos, self.pos, "array")
        self.pos += 1
        while True:
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == "]":
                self.pos += 1
                node.end = self.pos
                return node
            self.value()
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == ",":
                self.pos += 1
            elif self.pos >= len(self.text) or self.text[self.pos] != "]":
                raise self.error("expected ',' or ']'")

    def document(self) -> _Node:
        root = self.value()
        self.skip()
        if self.pos != len(self.text):
            raise self.error("unexpected text after the value")
        return root


def _parse(text: str) -> _Node:
    return _Parser(text).document()


def strip(text: str) -> str:
    """Plain JSON: comments blanked out and trailing commas removed (positions kept)."""
    out: list[str] = []
    parser = _Parser(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            parser.pos = i
            parser.string()
            out.append(text[i : parser.pos])
            i = parser.pos
        elif text.startswith("//", i) or text.startswith("/*", i):
            parser.pos = i
            parser.skip()
            out.append("".join(ch if ch == "\n" else " " for ch in text[i : parser.pos]))
            i = parser.pos
        elif c == ",":
            parser.pos = i + 1
            parser.skip()
            if parser.pos < n and text[parser.pos] in "]}":
                out.append(" ")
            else:
                out.append(",")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def loads(text: str) -> Any:
    """Parse JSON with comments and trailing commas."""
    _parse(text)  # precise error positions for bad input
    try:
        return json.loads(strip(text).lstrip("\ufeff"))
    except ValueError as exc:
        raise JsoncError(str(exc)) from None


def _line_indent(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = start
    while end < len(text) and text[end] in " \t":
        end += 1
    return text[start:end]


def _nest(path: Sequence[str], value: Any) -> Any:
    for key in reversed(path):
        value = {key: value}
    return value


def set_path(text: str, path: Sequence[str], value: Any) -> str:
    """Set ``path`` (keys of nested objects) to ``value``, changing only the bytes needed.

    Missing objects along the path are created; an existing non-object in the way
    is replaced.  Setting a value to what it already is returns ``text`` unchanged.
    """
    if not path:
        raise ValueError("empty path")
    if not text.strip():
        return json.dumps(_nest(path, value), indent=2) + "\n"
    node = _parse(text)
    if node.kind != "object":
        raise JsoncError("the top level is not an object")
    for depth, key in enumerate(path):
        entry = node.members.get(key)
        last = depth == len(path) - 1
        if entry is not None:
            child = entry[1]
            if last or child.kind != "object":
                new = json.dumps(value if last else _nest(path[depth + 1 :], value))
                try:
                    if json.loads(strip(text[child.start : child.end])) == json.loads(new):
                        return text
                except ValueError:
                    pass
                return text[: child.start] + new + text[child.end :]
            node = child
            continue
        member = f"{json.dumps(key)}: {json.dumps(_nest(path[depth + 1 :], value))}"
        if node.order:
            _, lastnode = node.members[node.order[-1]]
            first_key = node.members[node.order[0]][0]
            multiline = "\n" in text[node.start : first_key]
            sep = f",\n{_line_indent(text, first_key)}" if multiline else ", "
            return text[: lastnode.end] + sep + member + text[lastnode.end :]
        inner = text[node.start + 1 : node.end - 1]
        if inner.strip():  # only comments inside: keep them, add after
            return text[: node.end - 1] + " " + member + " " + text[node.end - 1 :]
        indent = _line_indent(text, node.start)
        return text[: node.start + 1] + f"\n{indent}  {member}\n{indent}" + text[node.end - 1 :]
    return text  # pragma: no cover - the loop always returns
