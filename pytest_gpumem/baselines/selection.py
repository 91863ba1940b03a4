"""Which tests of a baseline file a name selects (``python -m pytest_gpumem baselines prune``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pytest_gpumem.baselines.staleness import file_of
from pytest_gpumem.baselines.store import BaselineStore

__all__ = ["SelectionError", "environment_named", "listed", "matches_anything", "tests_missing", "tests_named"]


class SelectionError(ValueError):
    """A name that selects no test, or a pattern that selects every test: the message says which."""


def listed(keys: Sequence[str]) -> str:
    """Environment keys for a message."""
    return "; ".join(repr(key) for key in keys) if keys else "(none: the file has no baselines)"


def environment_named(store: BaselineStore, text: str) -> str:
    """The key ``text`` names: the key itself, or the only key that contains it (case-insensitive)."""
    keys = store.environment_keys()
    if text in keys:
        return text
    chosen = [key for key in keys if text.casefold() in key.casefold()]
    if len(chosen) == 1:
        return chosen[0]
    if not chosen:
        raise SelectionError(f"--env {text!r} matches no environment; the keys are: {listed(keys)}")
    raise SelectionError(f"--env {text!r} matches {len(chosen)} environments, name one: {listed(chosen)}")


def tests_named(
    store: BaselineStore, keys: Sequence[str], names: Sequence[str], *, everything: bool = False
) -> dict[str, list[str]]:
    """Tests of ``keys`` that ``names`` (node ids or path prefixes) name; raises for a name that matches none and,
    unless ``everything``, for a pattern that matches every test."""
    every = {(key, test) for key in store.environment_keys() for test in store.tests(key)}
    doomed: dict[str, set[str]] = {}
    for name in names:
        found = [entry for key in keys for entry in store.stale((), key, roots=[name])]
        matched = {(entry.environment, entry.test) for entry in found}
        exact = any(entry.test == name for entry in found)
        if not everything and not exact and (matched == every or matches_anything(name)):
            raise SelectionError(
                f"TEST {name!r} matches every test in the file{' (patterns are not globs)' if '*' in name else ''}: "
                "name the tests to remove, or pass --all to remove every baseline; nothing removed"
            )
        if not found:
            raise SelectionError(
                f"TEST {name!r} matches no baseline (give a node id or a path prefix); nothing removed"
            )
        for entry in found:
            doomed.setdefault(entry.environment, set()).add(entry.test)
    return {key: sorted(tests) for key, tests in doomed.items()}


def matches_anything(name: str) -> bool:
    """Whether ``name`` is no pattern at all: empty, the current or root folder, a glob of nothing."""
    return not name.strip().replace("\\", "/").strip("./*?")


def tests_missing(store: BaselineStore, keys: Sequence[str], rootdir: Path) -> dict[str, list[str]]:
    """Tests of ``keys`` whose file does not exist under ``rootdir`` (when none exists, ``rootdir`` is wrong)."""
    if not rootdir.is_dir():
        raise SelectionError(f"--rootdir {str(rootdir)!r}: no such folder")
    tests = {key: store.tests(key) for key in keys}
    exists = {path: (rootdir / path).exists() for path in {file_of(test) for found in tests.values() for test in found}}
    if exists and not any(exists.values()):
        raise SelectionError(
            f"none of the {len(exists)} test file{'' if len(exists) == 1 else 's'} exists under {rootdir}: "
            "is it the rootdir? "
            "Pass --rootdir DIR, or name the tests to remove; nothing removed"
        )
    doomed = {key: [test for test in found if not exists[file_of(test)]] for key, found in tests.items()}
    return {key: found for key, found in doomed.items() if found}
