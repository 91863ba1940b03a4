"""The file's canonical form: key order and JSON text, so the same baselines always give the same bytes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pytest_gpumem.baselines.environment import Environment, allocator_rank
from pytest_gpumem.data.metrics import CATEGORIES, METRICS

__all__ = ["CALL_SPAN", "SCHEMA_VERSION", "STORED_CATEGORIES", "json_bytes", "stored_breakdown"]

#: Version of the file layout this release writes and the only one it reads; adding keys does not change it.
SCHEMA_VERSION = 1

#: The span that covers a whole test call; other spans are ``gpumem.measure(name)`` blocks.
CALL_SPAN = "call"


#: The breakdown categories a baseline keeps: those the test's own code decides. ``other`` and a span's ``start`` depend
#: on the tests that ran before, so a serial, ``-n 4`` and a shuffled run write the same bytes without them.
STORED_CATEGORIES = tuple(category for category in CATEGORIES if category != "other")


def stored_breakdown(breakdown: Mapping[str, int] | None) -> dict[str, int] | None:
    """What a baseline keeps of a span's peak ``breakdown``: :data:`STORED_CATEGORIES` (0 where absent) and unknown
    categories."""
    if breakdown is None:
        return None
    kept = {category: int(breakdown.get(category, 0)) for category in STORED_CATEGORIES}
    kept.update((c, int(v)) for c, v in breakdown.items() if c not in kept and c != "other")
    return kept


#: A span's keys in the file's order; keys not listed come after, sorted (at every level).
SPAN_ORDER = (*METRICS, "start", "breakdown")
ENV_ORDER = ("environment", "tests")
_ENVIRONMENT_ORDER = tuple(f.name for f in fields(Environment))


def render(tree: Mapping[str, Any]) -> bytes:
    """The bytes of a file whose canonical tree is ``tree``; ``ValueError`` for NaN or infinity."""
    return json_bytes(json.dumps(tree, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def json_bytes(text: str) -> bytes:
    """The UTF-8 bytes of JSON ``text``, a lone surrogate (:pep:`383` file names) as the escape ``json`` reads back."""
    return text.encode("utf-8", "backslashreplace")


def span_items(spans: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Spans in file order: ``call`` first, then the others by name."""
    return sorted(spans.items(), key=lambda item: (item[0] != CALL_SPAN, item[0]))


def canonical_top(top: Mapping[str, Any]) -> dict[str, Any]:
    """The whole file tree in canonical order (``top`` is a validated tree)."""
    raw_envs: Mapping[str, Any] = top.get("environments", {})
    envs = {key: canonical_env(raw_envs[key]) for key in sorted(raw_envs)}
    return ordered(top, ("schema", "environments"), {"schema": SCHEMA_VERSION, "environments": envs})


def canonical_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """One environment's object in canonical order."""
    described = env.get("environment") or {}
    known = {k: sorted_json(described[k]) for k in _ENVIRONMENT_ORDER if k in described}
    allocator = described.get("allocator")
    if isinstance(allocator, dict):
        known["allocator"] = {name: allocator[name] for name in sorted(allocator, key=allocator_rank)}
    raw_tests: Mapping[str, Any] = env.get("tests", {})
    tests = {test: canonical_test(raw_tests[test]) for test in sorted(raw_tests)}
    return ordered(env, ENV_ORDER, {"environment": ordered(described, _ENVIRONMENT_ORDER, known), "tests": tests})


def canonical_test(test: Mapping[str, Any]) -> dict[str, Any]:
    """One test's object in canonical order."""
    spans = {name: canonical_span(span) for name, span in span_items(test.get("spans", {}))}
    return ordered(test, ("spans",), {"spans": spans})


def canonical_span(span: Mapping[str, Any]) -> dict[str, Any]:
    """One span's object in canonical order: :data:`SPAN_ORDER`, ``breakdown`` by category, the rest sorted."""
    result = ordered(span, SPAN_ORDER, span)
    breakdown = result.get("breakdown")
    if breakdown is not None:
        result["breakdown"] = ordered(breakdown, CATEGORIES, breakdown)
    return result


def sorted_json(value: Any) -> Any:
    """A JSON value with every object's keys sorted (for keys this release does not know)."""
    if isinstance(value, dict):
        return {key: sorted_json(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sorted_json(item) for item in value]
    return value


def ordered(raw: Mapping[str, Any], order: tuple[str, ...], known: Mapping[str, Any]) -> dict[str, Any]:
    """``known`` keys in ``order``, then the other keys of ``raw`` sorted, their values in canonical form."""
    result: dict[str, Any] = {key: known[key] for key in order if key in known}
    if not raw.keys() <= result.keys():
        result.update((key, sorted_json(raw[key])) for key in sorted(raw.keys() - result.keys()))
    return result
