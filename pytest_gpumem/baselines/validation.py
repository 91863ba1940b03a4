"""Errors in a baseline file, located by line and column: :class:`BaselineFileError` and the type checks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.canonical import SCHEMA_VERSION
from pytest_gpumem.baselines.environment import KEYED_FIELDS, check_key_text, check_label
from pytest_gpumem.data.metrics import COUNT_METRICS, METRIC_TABLE, METRICS
from pytest_gpumem.data.sites import parse_stored_site
from pytest_gpumem.units import MAX_BYTES, shown

__all__ = ["MAX_DEPTH", "BaselineFileError"]

#: How deep a value under a key this release does not know may nest arrays and objects. The
#: layout this release writes goes 8 levels deep; a file nested deeper than Python can parse or
#: write back is refused like any other file that cannot be read.
MAX_DEPTH = 32

# Span keys whose type this release checks (bytes or null) when loading.
_SPAN_INT_KEYS = frozenset((*METRICS, *COUNT_METRICS, "start"))
# Span keys this release knows that never hold a number below 0 (allocated and retained may: a
# cost that ends below its span's start); keys a later release added may.
_UNSIGNED_KEYS = _SPAN_INT_KEYS - frozenset(info.name for info in METRIC_TABLE if info.signed)

HINT_RESTORE = (
    "Restore it from version control (e.g. `git checkout -- {path}`), or delete it and record the "
    "baselines again with `pytest --gpumem-update-baselines`."
)


class BaselineFileError(Exception):
    """A baseline file that cannot be read or must not be written.

    The message names the file, the line and column where the problem is known
    (``path:line:column: problem``) and what to do about it. The parts are also
    available as attributes.
    """

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
        location = str(path)
        if line is not None:
            location += f":{line}"
            if column is not None:
                location += f":{column}"
        message = f"{location}: {problem}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


def validate(tree: Any, text: str, path: str | os.PathLike[str], *, hint: str | None = None) -> None:
    """Check the types of everything this release reads; raise :class:`BaselineFileError` on the first problem.

    ``text`` is the JSON ``tree`` was read from, to find the line of a
    problem (``""``: no lines). ``hint`` replaces the default advice (restore
    the file from version control). Adds the ``tests`` and ``spans`` objects
    that may be left out.
    """

    def fail(keys: tuple[str, ...], problem: str, advice: str = "") -> BaselineFileError:
        where = "".join(f"[{json.dumps(k, ensure_ascii=False)}]" for k in keys)
        default = f"Correct it by hand, or {lower_first(HINT_RESTORE.format(path=path))}" if hint is None else hint
        return BaselineFileError(
            path,
            f"{where or 'top level'}: {problem}",
            line=_locate(text, keys) if keys else None,
            hint=advice or default,
        )

    def check_unknown(keys: tuple[str, ...], value: Any) -> None:
        if isinstance(value, (dict, list)) and _too_deep(value):
            raise fail(keys, f"a value nested too deeply (more than {MAX_DEPTH} levels)")

    if not isinstance(tree, dict):
        raise fail((), f"expected a JSON object, found {_json_type(tree)}; this is not a pytest-gpumem baseline file")
    for top_key, value in tree.items():
        if top_key not in ("schema", "environments"):
            check_unknown((top_key,), value)
    schema = tree.get("schema")
    if "schema" not in tree:
        raise fail((), 'no "schema" version; this is not a pytest-gpumem baseline file')
    if type(schema) is not int:
        raise fail(("schema",), f"the schema version must be an integer, found {_json_type(schema)}")
    if schema != SCHEMA_VERSION:
        newer = schema > SCHEMA_VERSION
        raise fail(
            ("schema",),
            f"schema version {schema} cannot be read by this release of pytest-gpumem (it reads version "
            f"{SCHEMA_VERSION}); the file was written by {'a newer' if newer else 'an older'} release",
            advice=(
                "Upgrade pytest-gpumem to the release that wrote it"
                if newer
                else "Record the baselines again with `pytest --gpumem-update-baselines`"
            )
            + "; the file was left untouched.",
        )
    envs = tree.get("environments", {})
    if not isinstance(envs, dict):
        raise fail(("environments",), f"expected an object, found {_json_type(envs)}")
    for key, env in envs.items():
        if not isinstance(env, dict):
            raise fail(("environments", key), f"expected an object, found {_json_type(env)}")
        described = env.get("environment", {})
        if described is not None and not isinstance(described, dict):
            raise fail(("environments", key, "environment"), f"expected an object, found {_json_type(described)}")
        for env_key, value in env.items():
            check_unknown(("environments", key, env_key), value if env_key != "tests" else None)
        labels = (described or {}).get("labels")
        if labels is not None:
            where = ("environments", key, "environment", "labels")
            if not isinstance(labels, dict):
                raise fail(where, f"expected an object of strings, found {_json_type(labels)}")
            for name, value in labels.items():
                try:
                    check_label(name, value)
                except ValueError as exc:
                    raise fail((*where, name), str(exc)) from None
        for field_name in KEYED_FIELDS:  # a key reads one way only
            part = (described or {}).get(field_name)
            if isinstance(part, str):
                try:
                    check_key_text(field_name, part, shows_none=field_name != "engine")
                except ValueError as exc:
                    raise fail(("environments", key, "environment", field_name), str(exc)) from None
        tests = env.setdefault("tests", {})
        if not isinstance(tests, dict):
            raise fail(("environments", key, "tests"), f"expected an object, found {_json_type(tests)}")
        for test, raw in tests.items():
            if not isinstance(raw, dict):
                raise fail(("environments", key, "tests", test), f"expected an object, found {_json_type(raw)}")
            spans = raw.setdefault("spans", {})
            if not isinstance(spans, dict):
                raise fail(
                    ("environments", key, "tests", test, "spans"), f"expected an object, found {_json_type(spans)}"
                )
            if len(raw) > 1:
                for test_key, value in raw.items():
                    if test_key != "spans":
                        check_unknown(("environments", key, "tests", test, test_key), value)
            for name, span in spans.items():
                if not isinstance(span, dict):
                    raise fail(
                        ("environments", key, "tests", test, "spans", name),
                        f"expected an object, found {_json_type(span)}",
                    )
                ints = _SPAN_INT_KEYS.intersection(span)
                if len(span) > len(ints) + ("breakdown" in span):
                    for span_key, value in span.items():
                        if span_key != "breakdown" and span_key not in ints:
                            check_unknown(("environments", key, "tests", test, "spans", name, span_key), value)
                for field_name in ints:
                    value = span[field_name]
                    if value is not None and type(value) is not int:
                        raise fail(
                            ("environments", key, "tests", test, "spans", name, field_name),
                            f"expected an integer number of bytes or null, found {_json_type(value)}",
                        )
                for span_key, value in span.items():  # in range (figures a later release added too)
                    if type(value) is int and not 0 <= value <= MAX_BYTES:
                        problem = _out_of_range(value, signed=span_key not in _UNSIGNED_KEYS)
                        if problem:
                            raise fail(("environments", key, "tests", test, "spans", name, span_key), problem)
                if "sites" in span:
                    _check_sites(span["sites"], ("environments", key, "tests", test, "spans", name, "sites"), fail)
                breakdown = span.get("breakdown")
                if breakdown is not None and not (
                    isinstance(breakdown, dict) and all(type(v) is int for v in breakdown.values())
                ):
                    raise fail(
                        ("environments", key, "tests", test, "spans", name, "breakdown"),
                        "expected an object of integer byte counts or null",
                    )
                for category, value in (breakdown or {}).items():
                    if not 0 <= value <= MAX_BYTES:
                        problem = _out_of_range(value, signed=False) or ""
                        raise fail(("environments", key, "tests", test, "spans", name, "breakdown", category), problem)


def _out_of_range(value: Any, *, signed: bool) -> str | None:
    """Why an integer figure no memory can have is refused (beyond 2**63 - 1 either way; below 0
    unless ``signed``), or None: fine, or not an integer (checked elsewhere)."""
    if type(value) is not int:
        return None
    if abs(value) > MAX_BYTES:
        return f"{shown(value)} is beyond 2**63 - 1: no memory holds that many bytes"
    if value < 0 and not signed:
        return f"{value} is negative: this figure is never below 0"
    return None


def _check_sites(sites: Any, where: tuple[str, ...], fail: Callable[..., BaselineFileError]) -> None:
    """A span's ``sites``: an object of site key → ``"peak=<bytes> end=<bytes> n=<count> ..."``."""
    if not isinstance(sites, dict):
        raise fail(where, f"expected an object of site figures, found {_json_type(sites)}")
    for site, value in sites.items():
        try:
            parse_stored_site(site, value)
        except ValueError as exc:
            raise fail((*where, site), str(exc)) from None


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests arrays and objects more than :data:`MAX_DEPTH` levels (without recursing)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def _locate(text: str, keys: Iterable[str]) -> int | None:
    """The line of the last of ``keys`` (a path of object keys), searching for each after the previous one."""
    position = 0
    found: int | None = None
    for key in keys:
        match = re.compile(re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:").search(text, position)
        if match is None:
            break
        position = match.end()
        found = match.start()
    return None if found is None else text.count("\n", 0, found) + 1


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
