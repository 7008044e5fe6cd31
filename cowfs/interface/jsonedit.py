"""Edit JSON settings files in place, keeping every byte of what is not
changed: the user's formatting, key order, comments (JSONC, as Gemini CLI
reads its settings) and escapes.

`parse` reads a document into nodes that know where they stand in the text;
`append` adds a value at the end of an array or a member at the end of an
object, laid out like its neighbours; `remove` takes out exactly what
`append` put in, so adding and then removing gives the original text back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class JSONTextError(ValueError):
    """The text is not a JSON document (the message says where)."""


@dataclass
class Node:
    """A value in the text: ``text[start:end]``.  Objects have ``members``
    (key, key start, value), arrays ``items``; ``value`` is the Python value."""

    kind: str  # "object", "array" or "scalar"
    start: int
    end: int
    value: Any = None
    members: list[tuple[str, int, Node]] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)

    def get(self, key: str) -> Node | None:
        for k, _, node in self.members:
            if k == key:
                return node
        return None

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each element: a member from its key on."""
        if self.kind == "object":
            return [(kstart, node.end) for _, kstart, node in self.members]
        return [(node.start, node.end) for node in self.items]


_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"', re.S)
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class _Parser:
    def __init__(self, text: str, comments: bool):
        self.text = text
        self.comments = comments
        self.pos = 0

    def fail(self, what: str) -> JSONTextError:
        line = self.text.count("\n", 0, self.pos) + 1
        col = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        return JSONTextError(f"{what} at line {line} column {col}")

    def skip(self) -> None:
        t = self.text
        while self.pos < len(t):
            c = t[self.pos]
            if c in " \t\r\n\ufeff":
                self.pos += 1
            elif self.comments and t.startswith("//", self.pos):
                nl = t.find("\n", self.pos)
                self.pos = len(t) if nl < 0 else nl + 1
            elif self.comments and t.startswith("/*", self.pos):
                close = t.find("*/", self.pos + 2)
                if close < 0:
                    raise self.fail("an unterminated comment")
                self.pos = close + 2
            else:
                return

    def value(self, depth: int = 0) -> Node:
        if depth > 200:
            raise self.fail("nesting too deep")
        self.skip()
        t, start = self.text, self.pos
        if start >= len(t):
            raise self.fail("a value expected")
        c = t[start]
        if c == "{":
            return self.elements(
                Node("object", start, start, {}), "}", lambda node: self.member(node, depth)
            )
        if c == "[":
            return self.elements(
                Node("array", start, start, []), "]", lambda node: self.item(node, depth)
            )
        m = _STRING.match(t, start) if c == '"' else _SCALAR.match(t, start)
        if not m:
            raise self.fail("a value expected")
        self.pos = m.end()
        return Node("scalar", start, self.pos, json.loads(m.group()))

    def elements(self, node: Node, bracket: str, element: Callable[[Node], None]) -> Node:
        """The rest of a container: *element(node)* for each element, up to
        the closing *bracket*."""
        self.pos += 1
        self.skip()
        if self.text.startswith(bracket, self.pos):
            self.pos += 1
        else:
            while True:
                element(node)
                if self.close(bracket):
                    break
        node.end = self.pos
        return node

    def member(self, node: Node, depth: int) -> None:
        self.skip()
        kstart = self.pos
        m = _STRING.match(self.text, self.pos)
        if not m:
            raise self.fail("a string key expected")
        key = json.loads(m.group())
        self.pos = m.end()
        self.skip()
        if not self.text.startswith(":", self.pos):
            raise self.fail("':' expected")
        self.pos += 1
        value = self.value(depth + 1)
        node.members.append((key, kstart, value))
        node.value[key] = value.value

    def item(self, node: Node, depth: int) -> None:
        value = self.value(depth + 1)
        node.items.append(value)
        node.value.append(value.value)

    def close(self, bracket: str) -> bool:
        """After an element: a comma (more follow) or *bracket* (the end)."""
        self.skip()
        if self.text.startswith(",", self.pos):
            self.pos += 1
            return False
        if self.text.startswith(bracket, self.pos):
            self.pos += 1
            return True
        raise self.fail(f"',' or '{bracket}' expected")


def parse(text: str, comments: bool = False) -> Node:
    """The document in *text* (with *comments*: // and /* */ allowed)."""
    p = _Parser(text, comments)
    node = p.value()
    p.skip()
    if p.pos != len(text):
        raise p.fail("text after the document")
    return node


def _line_indent(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    line = text[start:pos]
    return line[: len(line) - len(line.lstrip(" \t"))]


def indent_unit(text: str) -> str:
    """The document's indentation step: a tab, or its narrowest run of
    leading spaces (two when nothing is indented)."""
    widths = []
    for line in text.splitlines():
        lead = line[: len(line) - len(line.lstrip(" \t"))]
        if lead.startswith("\t"):
            return "\t"
        if lead and line.strip():
            widths.append(len(lead))
    return " " * min(widths) if widths else "  "


def _render(value: Any, unit: str, indent: str, multiline: bool) -> str:
    if not multiline:
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, indent=unit, ensure_ascii=False).replace("\n", "\n" + indent)


def append(text: str, container: Node, value: Any, key: str | None = None) -> str:
    """*text* with *value* added at the end of *container* (an array; or an
    object, as member *key*), indented like the container's elements."""
    unit = indent_unit(text)
    spans = container.spans()
    prefix = "" if key is None else json.dumps(key, ensure_ascii=False) + ": "
    if spans:
        first, last = spans[0][0], spans[-1][1]
        gap = text[container.start + 1 : first]
        if gap.strip():  # a comment before the first element
            gap = "\n" + _line_indent(text, first) if "\n" in gap else " "
        multiline = "\n" in gap
        indent = gap[gap.rfind("\n") + 1 :] if multiline else ""
        new = "," + (gap or " ") + prefix + _render(value, unit, indent, multiline)
        return text[:last] + new + text[last:]
    outer = _line_indent(text, container.start)
    inner = outer + unit
    new = "\n" + inner + prefix + _render(value, unit, inner, True) + "\n" + outer
    at = container.start + 1
    return text[:at] + new + text[at:]


def remove(text: str, container: Node, index: int) -> str:
    """*text* without element *index* of *container*: the exact inverse of
    `append` when the element is the one it added last."""
    spans = container.spans()
    start, end = spans[index]
    if len(spans) > 1:
        if index == len(spans) - 1:
            start = spans[index - 1][1]  # the comma and gap before it
        else:
            end = spans[index + 1][0]  # it, its comma and the gap after
        return text[:start] + text[end:]
    start = container.start + 1
    rest = text[end:]
    tail = "\n" + _line_indent(text, container.start)
    if rest.startswith(tail):
        rest = rest[len(tail) :]
    return text[:start] + rest
