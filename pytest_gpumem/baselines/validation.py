"""Errors in a baseline file, located by line and column: :class:`BaselineFileError` and the type checks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.canonical import SCHEMA_VERSION
from pytest_gpumem.baselines.environment import KEYED_FIELDS, check_key_text, check_label
from pytest_gpumem.data.metrics import COUNT_METRICS, METRIC_INFO, METRICS
from pytest_gpumem.data.site_figures import parse_stored_site
from pytest_gpumem.units import MAX_BYTES, shown

__all__ = ["FILE", "MAX_DEPTH", "BaselineFileError", "Node", "check_span", "json_schema", "position", "validate"]

#: How deep a value under an unknown key may nest: the layout goes 8 levels; deeper files are refused.
MAX_DEPTH = 32

HINT_RESTORE = (
    "Restore it from version control (e.g. `git checkout -- {path}`), or delete it and record the "
    "baselines again with `pytest --gpumem-update-baselines`."
)


class BaselineFileError(Exception):
    """A baseline file that cannot be read or must not be written: ``path:line:column: problem`` and what to do."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        problem: str,
        *,
        line: int | None = None,
        column: int | None = None,
        hint: str = "",
    ) -> None:
        self.path = Path(path)
        self.problem = problem
        self.line = line
        self.column = column
        self.hint = hint
        location = "".join(f":{number}" for number in (line, column) if number is not None)  # no column without a line
        super().__init__(f"{path}{location}: {problem}" + (f"\n{hint}" if hint else ""))


@dataclass(frozen=True)
class Node:
    """One value of a baseline file: its JSON type, its keys and the check beyond its type (:data:`FILE`: the file)."""

    type: str = ""  #: "object", "integer" or "string"; "": any JSON value (nested at most MAX_DEPTH levels)
    expected: str = ""  #: how an error names the type: "an object"
    description: str = ""
    nullable: bool = False
    keys: Mapping[str, Node] = field(default_factory=dict)
    each: Node | None = None  #: what a key not in ``keys`` holds; None: anything
    required: tuple[str, ...] = ()
    fill: tuple[str, ...] = ()  #: keys that may be left out, added as empty objects
    signed: bool | None = None  #: an integer here lies within ±(2**63 - 1) (True), or 0 to that (False)
    check: Callable[[str, Any], object] | None = None  #: (key, value): raises ValueError saying the problem
    const: Any = None  #: the only value (for the published schema; ``check`` refuses others)


class _Refused(ValueError):
    """A problem with its own advice."""

    def __init__(self, problem: str, advice: str) -> None:
        super().__init__(problem)
        self.advice = advice


def _check_version(_key: str, value: Any) -> None:
    if type(value) is not int:
        raise ValueError(f"the schema version must be an integer, found {_json_type(value)}")
    if value != SCHEMA_VERSION:
        newer = value > SCHEMA_VERSION
        raise _Refused(
            f"schema version {value} cannot be read by this release of pytest-gpumem (it reads version "
            f"{SCHEMA_VERSION}); the file was written by {'a newer' if newer else 'an older'} release",
            ("Upgrade pytest-gpumem to the release that wrote it" if newer else _RECORD_AGAIN)
            + "; the file was left untouched.",
        )


_RECORD_AGAIN = "Record the baselines again with `pytest --gpumem-update-baselines`"


def _check_counts(_key: str, value: Any) -> None:
    bad = [(k, v) for k, v in value.items() if type(v) is not int] if isinstance(value, dict) else []
    if bad:
        raise ValueError(f"expected an object of integer byte counts or null; {bad[0][0]!r} is {_json_type(bad[0][1])}")


def _object(description: str, keys: Mapping[str, Node] | None = None, each: Node | None = None, **more: Any) -> Node:
    return Node("object", more.pop("expected", "an object"), description, keys=keys or {}, each=each, **more)


def _figure(description: str, signed: bool) -> Node:
    return Node("integer", "an integer number of bytes or null", description, nullable=True, signed=signed)


_SPAN = _object(
    "The figures of one span: each metric's cost (bytes, or a count; null when unknown); keys a later "
    "release adds are kept.",
    {
        **{name: _figure(METRIC_INFO[name].about, METRIC_INFO[name].signed) for name in (*METRICS, *COUNT_METRICS)},
        "start": _figure("allocated bytes when the span began (files of earlier releases)", False),
        "breakdown": _object(
            "Bytes by category at the peak.",
            each=Node("integer", "an integer byte count", signed=False),
            expected="an object of integer byte counts or null",
            nullable=True,
            check=_check_counts,
        ),
        "sites": _object(
            "Where the bytes alive at the peak were made: 'file:function+offset category' → "
            "'peak=<bytes> end=<bytes> n=<count> <category> <phase> [examples] [| code]'.",
            each=Node("string", "a string", check=parse_stored_site),
            expected="an object of site figures",
        ),
    },
    Node(signed=True),
)
_KEY_PART = "A part of the environment's key: a string without '|', line breaks or surrounding spaces; null: unknown."
_ENVIRONMENT = _object(
    "Where the baselines were recorded (pytest_gpumem.baselines.Environment); its key is made from it.",
    {
        **{name: Node(description=_KEY_PART, check=check_key_text) for name in KEYED_FIELDS},
        "total_memory": Node(description="The device's memory in bytes (read as null unless an integer)."),
        "allocator": Node(description="The caching allocator's settings, name → value (null unless an object)."),
        "cuda_rounding": Node(description="CPU engine: storages rounded up to CUDA's 512-byte blocks (else null)."),
        "labels": _object(
            "Labels a pytest_gpumem_environment hook added, name → value: parts of the key.",
            each=Node("string", "a string", check=check_label),
            expected="an object of strings",
        ),
    },
    nullable=True,
)
_TEST = _object("", {"spans": _object("The spans by name ('call': the whole test).", each=_SPAN)}, fill=("spans",))
FILE = _object(
    "The baselines of a test suite: for each environment, the figures of each test's spans.",
    {
        "schema": Node("integer", description="The file layout's version.", check=_check_version, const=SCHEMA_VERSION),
        "environments": _object(
            "The environments by key (pytest_gpumem.baselines.Environment.key).",
            each=_object(
                "",
                {"environment": _ENVIRONMENT, "tests": _object("The tests by node id.", each=_TEST)},
                fill=("tests",),
            ),
        ),
    },
    expected="a JSON object",
    required=("schema",),
)


def validate(tree: Any, text: str, path: str | os.PathLike[str], *, hint: str | None = None) -> None:
    """Check ``tree``, read from ``text``, against :data:`FILE` (adding the objects it may leave out); raise
    :class:`BaselineFileError` at the first problem, with ``hint`` (when given) as the advice."""

    def fail(keys: tuple[str, ...], problem: str, advice: str = "") -> BaselineFileError:
        where = "".join(f"[{json.dumps(k, ensure_ascii=False)}]" for k in keys)
        default = f"Correct it by hand, or {lower_first(HINT_RESTORE.format(path=path))}" if hint is None else hint
        line, column = position(text, keys)
        return BaselineFileError(
            path, f"{where or 'top level'}: {problem}", line=line, column=column, hint=advice or default
        )

    if not isinstance(tree, dict):
        raise fail((), f"expected a JSON object, found {_json_type(tree)}; this is not a pytest-gpumem baseline file")
    if "schema" not in tree:
        raise fail((), 'no "schema" version; this is not a pytest-gpumem baseline file')
    _walk(FILE, tree, (), fail)


def check_span(where: str, value: Mapping[str, Any]) -> None:
    """Refuse the figures of one span (as written to the file) that loading the file would refuse: a ValueError that
    starts with ``where``."""

    def fail(keys: tuple[str, ...], problem: str, advice: str = "") -> ValueError:
        return ValueError(f"{where}{''.join(f' {k}' for k in keys)}: {problem}")

    _walk(_SPAN, dict(value), (), fail)


_TYPES: Mapping[str, type] = {"object": dict, "integer": int, "string": str}


def _walk(node: Node, value: Any, keys: tuple[str, ...], fail: Callable[..., Exception]) -> None:
    """Check ``value`` (at ``keys``) against ``node``, and what it holds against theirs."""
    if node.check is not None:
        try:
            node.check(keys[-1] if keys else "", value)
        except ValueError as exc:
            raise fail(keys, str(exc), getattr(exc, "advice", "")) from None
    if value is None and node.nullable:
        return
    if node.type and (type(value) is not _TYPES[node.type] or isinstance(value, bool)):
        raise fail(keys, f"expected {node.expected}, found {_json_type(value)}")
    if node.signed is not None and type(value) is int:  # a figure no memory can have
        if abs(value) > MAX_BYTES:
            raise fail(keys, f"{shown(value)} is beyond 2**63 - 1: no memory holds that many bytes")
        if value < 0 and not node.signed:
            raise fail(keys, f"{value} is negative: this figure is never below 0")
    if not node.type and isinstance(value, (dict, list)) and _too_deep(value):
        raise fail(keys, f"a value nested too deeply (more than {MAX_DEPTH} levels)")
    if node.type == "object":
        for key in node.fill:
            value.setdefault(key, {})
        for key in [*(k for k in node.keys if k in value), *(k for k in value if k not in node.keys)]:
            child = node.keys.get(key, node.each or Node())
            _walk(child, value[key], (*keys, key), fail)


def json_schema() -> dict[str, Any]:
    """:data:`FILE` as a JSON Schema (draft 2020-12): ``pytest_gpumem/schema/baselines.schema.json``."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/pytest-gpumem/pytest-gpumem/blob/main/pytest_gpumem/schema/baselines.schema.json",
        "title": "pytest-gpumem baseline file",
        **_json_schema(FILE),
    }


def _json_schema(node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {"description": node.description} if node.description else {}
    if node.type:
        out["type"] = [node.type, "null"] if node.nullable else node.type
    if node.const is not None:
        out["const"] = node.const
    if node.signed is not None:
        bounds = {"minimum": -MAX_BYTES if node.signed else 0, "maximum": MAX_BYTES}
        out.update(bounds if node.type == "integer" else {"if": {"type": "integer"}, "then": bounds})
    if node.keys:
        out["properties"] = {key: _json_schema(child) for key, child in node.keys.items()}
    if node.each is not None:
        out["additionalProperties"] = _json_schema(node.each)
    if node.required:
        out["required"] = list(node.required)
    return out


def _too_deep(value: Any, depth: int = 1) -> bool:
    """Whether ``value`` nests arrays and objects more than :data:`MAX_DEPTH` levels (recursing no deeper)."""
    children = value.values() if isinstance(value, dict) else value
    return any(isinstance(c, (dict, list)) and (depth >= MAX_DEPTH or _too_deep(c, depth + 1)) for c in children)


_SPACE = re.compile(r"[ \t\n\r]*")


def position(text: str, keys: tuple[str, ...]) -> tuple[int | None, int | None]:
    """The line and column (from 1) of the value at ``keys`` in ``text`` (the deepest found), or (None, None)."""
    decoder = json.JSONDecoder()
    at, found = _SPACE.match(text).end(), None  # type: ignore[union-attr]
    try:
        for key in keys:
            if not text.startswith("{", at):
                break
            at, value_at = _SPACE.match(text, at + 1).end(), None  # type: ignore[union-attr]
            while text.startswith('"', at):  # each member: the last of a repeated key is the one read
                name, at = decoder.raw_decode(text, at)
                at = _SPACE.match(text, _SPACE.match(text, at).end() + 1).end()  # type: ignore[union-attr]
                if name == key:
                    value_at = at
                at = _SPACE.match(text, decoder.raw_decode(text, at)[1]).end()  # type: ignore[union-attr]
                if text.startswith(",", at):
                    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
            if value_at is None:
                break
            at = found = value_at
    except ValueError:  # text that is not the tree's (it was read from it: only a stale text)
        pass
    if found is None:
        return None, None
    return text.count("\n", 0, found) + 1, found - text.rfind("\n", 0, found)


def lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, list):
        return "an array"
    return "an object"
