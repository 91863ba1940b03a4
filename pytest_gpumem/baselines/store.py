"""The baselines of one file in memory: :class:`BaselineStore` and its entries."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.canonical import (
    CALL_SPAN,
    ENV_ORDER,
    SCHEMA_VERSION,
    canonical_span,
    canonical_top,
    render,
    span_items,
    stored_breakdown,
)
from pytest_gpumem.baselines.environment import Environment
from pytest_gpumem.baselines.validation import BaselineFileError, check_span, validate
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import BASELINE_METRICS, METRIC_INFO
from pytest_gpumem.data.site_figures import SITES_BUDGET, SiteProfile

__all__ = [
    "BaselineEntry",
    "BaselineStore",
    "Change",
    "EnvironmentRemoved",
    "Fingerprint",
    "Recorded",
    "Removed",
    "StaleEntry",
]

#: What changes with a file's bytes, as ``os.stat`` tells it (:func:`~pytest_gpumem.baselines.loading.fingerprint`).
Fingerprint = tuple[int, int, int, int]


@dataclass(frozen=True)
class BaselineEntry:
    """The baseline of one span of one test in one environment: each metric's cost (``None``: unknown), ``start`` (from
    older files, for information), the ``breakdown`` without ``other``, and keys this release does not know verbatim."""

    costs: Mapping[str, int | None]
    start: int | None = None
    breakdown: Mapping[str, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_measurement(
        cls,
        measurement: Measurement,
        metrics: Iterable[str] = BASELINE_METRICS,
        *,
        extra_costs: Mapping[str, int | None] | None = None,
        sites_budget: int = SITES_BUDGET,
    ) -> BaselineEntry:
        """The entry that records ``measurement``'s cost of each of ``metrics`` plus ``extra_costs``, and its site
        profile in at most ``sites_budget`` characters."""
        costs: dict[str, int | None] = {metric: measurement.cost(metric) for metric in metrics}
        if extra_costs:
            costs.update(extra_costs)
        extra = {} if measurement.sites is None else {"sites": measurement.sites.to_stored(sites_budget)}
        return cls(costs=costs, breakdown=stored_breakdown(measurement.breakdown), extra=extra)

    @property
    def sites(self) -> SiteProfile | None:
        """The site profile recorded with this baseline, or None; ``ValueError`` for one the file holds wrong."""
        raw = self.extra.get("sites")
        return None if raw is None else SiteProfile.from_stored(raw)

    def cost(self, metric: str) -> int | None:
        """The recorded cost of ``metric``; ``None`` when unknown or not recorded."""
        return self.costs.get(metric)

    def to_dict(self) -> dict[str, Any]:
        """The span object as the file stores it (canonical key order, ``breakdown`` absent when ``None``)."""
        return canonical_span(self._raw())

    def _raw(self) -> dict[str, Any]:
        """:meth:`to_dict` without the canonical ordering (the store orders when it writes)."""
        data: dict[str, Any] = {**self.extra, **self.costs}
        data.pop("breakdown", None)
        if self.start is not None:
            data["start"] = self.start
        if self.breakdown is not None:
            data["breakdown"] = dict(self.breakdown)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaselineEntry:
        """Read a span object: integers and nulls are costs, the keys this release does not know ``extra``."""
        costs: dict[str, int | None] = {}
        extra: dict[str, Any] = {}
        start: int | None = None
        breakdown: Mapping[str, int] | None = None
        for key, value in data.items():
            if key == "start":
                start = value if type(value) is int else None
            elif key == "breakdown":
                breakdown = None if value is None else dict(value)
            elif value is None or type(value) is int:
                costs[key] = value
            else:
                extra[key] = value
        return cls(costs, start, breakdown, extra)


@dataclass(frozen=True)
class Recorded:
    """A change of a store: the baselines of ``test`` in ``environment`` recorded (:meth:`BaselineStore.record`)."""

    environment: Environment
    test: str
    entries: Mapping[str, BaselineEntry]

    def apply(self, store: BaselineStore) -> None:
        store.record(self.environment, self.test, self.entries)


@dataclass(frozen=True)
class Removed:
    """A change of a store: every baseline of ``test`` in the environment keyed ``environment`` removed."""

    environment: str
    test: str

    def apply(self, store: BaselineStore) -> None:
        store.remove(self.environment, self.test)


@dataclass(frozen=True)
class EnvironmentRemoved:
    """A change of a store: the environment keyed ``environment`` removed with everything in it."""

    environment: str

    def apply(self, store: BaselineStore) -> None:
        store.remove_environment(self.environment)


#: One change of a store, as its journal (:attr:`BaselineStore.changes`) keeps it.
Change = Recorded | Removed | EnvironmentRemoved


@dataclass(frozen=True)
class StaleEntry:
    """A test that has baselines in ``environment`` but no longer exists; ``spans`` are its recorded spans."""

    environment: str
    test: str
    spans: tuple[str, ...]


class BaselineStore:
    """All baselines of one file, in memory: the JSON tree it was read from (unknown keys survive a rewrite), and the
    journal of its changes since, that a save applies onto the file as another run left it."""

    def __init__(self) -> None:
        self._top: dict[str, Any] = {"schema": SCHEMA_VERSION, "environments": {}}
        self._envs: dict[str, Any] = self._top["environments"]
        self.path: Path | None = None  #: the file this store was loaded from or last saved to
        self.fingerprint: Fingerprint | None = None  #: the file's when this store last read or wrote it
        self.digest: bytes | None = None  #: of the file's bytes when this store last read or wrote them
        self._described: set[str] = set()  # environments whose description record() completed
        self._changes: list[Change] = []

    def __len__(self) -> int:
        """Number of (environment, test) pairs with baselines."""
        return sum(len(env.get("tests", {})) for env in self._envs.values())

    def environment_keys(self) -> tuple[str, ...]:
        """Keys of every environment in the store, sorted."""
        return tuple(sorted(self._envs))

    def environment(self, key: str) -> Environment | None:
        """The environment stored under ``key``; ``None`` when there is none."""
        env = self._envs.get(key)
        return None if env is None else Environment.from_dict(env.get("environment") or {})

    def tests(self, environment: str) -> tuple[str, ...]:
        """Node ids with baselines in the environment keyed ``environment``, sorted."""
        return tuple(sorted(self._envs.get(environment, {}).get("tests", {})))

    def spans(self, environment: str, test: str) -> dict[str, BaselineEntry]:
        """Every span baseline of ``test`` in ``environment``: span name → entry (empty when none)."""
        return {name: BaselineEntry.from_dict(span) for name, span in span_items(self._raw_spans(environment, test))}

    def span_names(self, environment: str, test: str) -> tuple[str, ...]:
        """The names of ``test``'s span baselines in ``environment``, in the file's order (empty when none)."""
        return tuple(name for name, _ in span_items(self._raw_spans(environment, test)))

    def entry(self, environment: str, test: str, span: str = CALL_SPAN) -> BaselineEntry | None:
        """The baseline of ``span`` of ``test`` in ``environment``; ``None`` when there is none."""
        data = self._raw_spans(environment, test).get(span)
        return None if data is None else BaselineEntry.from_dict(data)

    def environments_with(self, test: str, *, exclude: str | None = None) -> tuple[str, ...]:
        """Keys of the environments that have baselines for ``test`` (sorted), leaving out ``exclude``."""
        return tuple(sorted(k for k, env in self._envs.items() if k != exclude and test in env.get("tests", {})))

    def _raw_spans(self, environment: str, test: str) -> dict[str, Any]:
        """The span objects of ``test`` in ``environment`` as the tree holds them (empty when none)."""
        spans: dict[str, Any] = self._envs.get(environment, {}).get("tests", {}).get(test, {}).get("spans", {})
        return spans

    def record(
        self,
        environment: Environment,
        test: str,
        spans: Iterable[Measurement] | Mapping[str, BaselineEntry],
    ) -> None:
        """Replace the span baselines of ``test`` with ``spans``, its measurements (or entries by span name), keeping
        the unknown keys."""
        entries: dict[str, BaselineEntry] = {}
        if isinstance(spans, Mapping):
            entries = dict(spans)
        else:
            for measurement in spans:
                if measurement.name in entries:
                    raise ValueError(f"{test}: two measurements of the span {measurement.name!r}")
                entries[measurement.name] = BaselineEntry.from_measurement(measurement)
        key = environment.key
        env = self._envs.setdefault(key, {"tests": {}})
        if key not in self._described:
            # values already there win: machines that share a key may differ in what it rounds (total memory in GiB).
            env["environment"] = {**environment.to_dict(), **(env.get("environment") or {})}
            self._described.add(key)
        old_test: dict[str, Any] = env["tests"].get(test) or {}
        old_spans: dict[str, Any] = old_test.get("spans") or {}
        new_spans: dict[str, Any] = {}
        for name, entry in entries.items():
            _check_entry(test, name, entry)
            written = entry._raw()
            check_span(f"{test} [{name}]", written)  # nothing the file could not be loaded with
            # keep unknown keys; drop a breakdown, sites, a figure it no longer has and an old release's start
            old = old_spans.get(name) or {}
            kept = {k: v for k, v in old.items() if k not in written and k not in _REPLACED and k not in METRIC_INFO}
            new_spans[name] = {**kept, **written}
        env["tests"][test] = {**old_test, "spans": new_spans}
        self._changes.append(Recorded(environment, test, entries))

    def remove(self, environment: str, test: str) -> bool:
        """Remove every baseline of ``test`` in ``environment``, and the environment if nothing is left; True if any."""
        env = self._envs.get(environment)
        if env is None or test not in env.get("tests", {}):
            return False
        del env["tests"][test]
        if not env["tests"] and set(env) <= set(ENV_ORDER):
            del self._envs[environment]
        self._changes.append(Removed(environment, test))
        return True

    def stale(
        self,
        collected: Iterable[str],
        environment: str | None,
        *,
        roots: Iterable[str] | None = None,
    ) -> list[StaleEntry]:
        """The baselines, by environment then node id, of tests not in ``collected`` (every collected node id), in
        ``environment`` (None: all) and under the node-id prefixes ``roots`` (None: the whole suite)."""
        ids = collected if isinstance(collected, (set, frozenset)) else set(collected)
        prefixes = None if roots is None else [_normalize_root(root) for root in roots]
        keys = sorted(self._envs) if environment is None else [environment]
        found: list[StaleEntry] = []
        for key in keys:
            for test in sorted(self._envs.get(key, {}).get("tests", {})):
                if test in ids or (prefixes is not None and not any(_under(test, p) for p in prefixes)):
                    continue
                found.append(StaleEntry(key, test, self.span_names(key, test)))
        return found

    def prune(self, stale: Iterable[StaleEntry]) -> int:
        """Remove the baselines :meth:`stale` reported; returns how many tests were removed."""
        return sum(self.remove(entry.environment, entry.test) for entry in stale)

    def remove_environment(self, environment: str) -> int:
        """Remove the environment keyed ``environment`` with everything in it; returns how many tests it had."""
        env = self._envs.pop(environment, None)
        if env is None:
            return 0
        self._changes.append(EnvironmentRemoved(environment))
        return len(env.get("tests", {}))

    @property
    def changes(self) -> tuple[Change, ...]:
        """What this store changed since it was loaded or saved, in order (:meth:`commit` empties it)."""
        return tuple(self._changes)

    def apply_changes(self, onto: BaselineStore) -> None:
        """Make on ``onto`` the changes this store made since it read or wrote the file."""
        for change in self._changes:
            change.apply(onto)

    def commit(
        self,
        path: Path,
        fingerprint: Fingerprint | None = None,
        digest: bytes | None = None,
        *,
        merged: BaselineStore | None = None,
    ) -> None:
        """This store is now what the file at ``path`` holds (with ``merged``: the baselines of that store)."""
        if merged is not None:
            self._top = merged._top
            self._envs = merged._envs
            self._described |= merged._described
        self._changes = []
        self.path = path
        self.fingerprint = fingerprint
        self.digest = digest

    def to_dict(self) -> dict[str, Any]:
        """The whole file as a new JSON-ready dict in canonical order (see :mod:`pytest_gpumem.baselines`)."""
        return canonical_top(self._top)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> BaselineStore:
        """A store holding a copy of ``data``; :class:`BaselineFileError` naming ``source`` for what load refuses."""
        try:
            text = json.dumps(data, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise BaselineFileError(source, f"not JSON data: {exc}") from None
        tree = json.loads(text)
        validate(tree, "", source, hint="")
        return cls._from_tree(tree)

    def dumps(self) -> bytes:
        """The file's bytes: canonical JSON, so the same baselines give the same bytes whatever order they were
        recorded in; ``ValueError`` for a NaN or infinity in an unknown key."""
        return render(self.to_dict())

    @classmethod
    def _from_tree(cls, tree: dict[str, Any]) -> BaselineStore:
        """A store that adopts ``tree`` (validated, not copied): for :func:`~pytest_gpumem.baselines.parse`."""
        store = cls()
        tree.setdefault("environments", {})
        store._top = tree
        store._envs = tree["environments"]
        return store


#: The keys of an old span that a new record replaces: besides the metrics, those its entry may drop.
_REPLACED = ("breakdown", "sites", "start")


def _check_entry(test: str, span: str, entry: BaselineEntry) -> None:
    """Refuse values the file could not hold as integer bytes (floats, bools, strings)."""
    for metric, value in entry.costs.items():
        if metric in ("start", "breakdown"):
            raise ValueError(f"{test} [{span}]: {metric!r} is not a metric name")
        if value is not None and type(value) is not int:
            raise TypeError(f"{test} [{span}] {metric}: expected an int or None, got {value!r}")
    if entry.start is not None and type(entry.start) is not int:
        raise TypeError(f"{test} [{span}] start: expected an int or None, got {entry.start!r}")
    if entry.breakdown is not None and not all(type(v) is int for v in entry.breakdown.values()):
        raise TypeError(f"{test} [{span}] breakdown: expected int bytes per category, got {dict(entry.breakdown)!r}")


def _normalize_root(root: str) -> str:
    root = root.replace(os.sep, "/").strip()
    while root.startswith("./"):
        root = root[2:]
    return "" if root in ("", ".") else root.rstrip("/")


def _under(test: str, root: str) -> bool:
    return not root or test == root or (test.startswith(root) and test[len(root)] in "/:[")
