"""The rules of a verdict: a measurement's costs against limits, budgets and baselines, as findings (pure); a limit
on a figure the engine cannot know is an ``"n/a"`` that fails: a guard that cannot be checked must not pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

from pytest_gpumem.baselines import BaselineEntry, StaleEntry
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding, Kind, Limit, Status, Tolerance
from pytest_gpumem.data.metrics import BASELINE_METRICS, CATEGORIES, COUNT_METRICS, METRICS, metric_info
from pytest_gpumem.judge.rule import DEFAULT_TOLERANCES, baseline_status, default_tolerance, exceeds

__all__ = [
    "DEFAULT_TOLERANCES",
    "changed_categories",
    "check_limits",
    "check_values",
    "compare_baseline",
    "compare_values",
    "default_tolerance",
    "stale_findings",
]

_EXACT = Tolerance()


def check_limits(test: str, measurement: Measurement, limits: Iterable[Limit]) -> list[Finding]:
    """Compare the costs of ``measurement`` with each limit or budget, in order: ``exceeded``, ``ok`` or ``n/a``."""
    figures = {metric: measurement.cost(metric) for metric in METRICS + COUNT_METRICS}
    return check_values(test, measurement.name, figures, limits, engine=measurement.engine)


def check_values(
    test: str,
    span: str,
    figures: Mapping[str, int | None],
    limits: Iterable[Limit],
    *,
    engine: str | None = None,
) -> list[Finding]:
    """:func:`check_limits` for figures given by name; ``engine`` only words the explanation of an ``n/a``."""
    findings: list[Finding] = []
    for limit in limits:
        kind: Kind = "budget" if limit.kind == "budget" else "limit"
        measured = figures.get(limit.metric)
        status: Status
        if measured is None:
            status = "n/a"
            detail = _unknown_figure(limit.metric, span, engine, known=limit.metric in figures)
        else:
            status = "exceeded" if exceeds(limit.metric, measured, limit.value) else "ok"
            detail = limit.source
        findings.append(Finding(test, span, limit.metric, kind, status, measured, limit.value, detail=detail))
    return findings


def _unknown_figure(metric: str, span: str, engine: str | None, *, known: bool) -> str:
    if not known:
        return f"this span has no figure named {metric!r}"
    info = metric_info(metric)
    if info.allocator and engine == "cpu":
        return "the cpu engine has no caching allocator"
    if info.whole_call and span != "call":
        return f"{metric} is measured for the whole test call only"
    where = f" on the {engine} engine" if engine else ""
    return f"not known{where}"


def compare_baseline(
    test: str,
    measurement: Measurement,
    entry: BaselineEntry | None,
    tolerance: Tolerance | Mapping[str, Tolerance],
    *,
    other_environments: Iterable[str] = (),
    strict: bool = False,
    metrics: Iterable[str] = BASELINE_METRICS,
) -> list[Finding]:
    """Compare the costs of ``measurement`` with its baseline ``entry``, one finding per metric; ``tolerance`` is one
    for all or one per metric (exact where missing)."""
    costs = {metric: measurement.cost(metric) for metric in metrics}
    return compare_values(
        test,
        measurement.name,
        costs,
        entry,
        tolerance,
        breakdown=measurement.breakdown,
        other_environments=other_environments,
        strict=strict,
    )


def compare_values(
    test: str,
    span: str,
    costs: Mapping[str, int | None],
    entry: BaselineEntry | None,
    tolerance: Tolerance | Mapping[str, Tolerance],
    *,
    breakdown: Mapping[str, int] | None = None,
    other_environments: Iterable[str] = (),
    strict: bool = False,
) -> list[Finding]:
    """:func:`compare_baseline` for costs given by name."""
    others = tuple(other_environments)
    single = tolerance if isinstance(tolerance, Tolerance) else None
    findings: list[Finding] = []
    for metric, measured in costs.items():
        tol = single or cast(Mapping[str, Tolerance], tolerance).get(metric) or _EXACT
        reference = None if entry is None else entry.costs.get(metric)
        if reference is None:
            if measured is None:
                continue
            status: Status
            if entry is None and others:
                status, detail = "other-environment", "baselines only for: " + "; ".join(others)
            elif entry is None:
                status, detail = "new", "no baseline for this test in this environment"
            else:
                status, detail = "new", "no baseline figure"
            findings.append(Finding(test, span, metric, "baseline", status, measured, None, tol, {}, detail, strict))
            continue
        if measured is None:
            findings.append(Finding(test, span, metric, "baseline", "n/a", None, reference, tol, {}, "not measured"))
            continue
        status = baseline_status(metric, measured, reference, tol)
        changed: Mapping[str, int] = {}
        # the breakdown is the peak's: it explains a peak, not what stayed allocated at the end
        before = None if entry is None else entry.breakdown
        if status == "regressed" and metric == "peak" and breakdown is not None and before is not None:
            changed = changed_categories(before, breakdown)
        findings.append(Finding(test, span, metric, "baseline", status, measured, reference, tol, changed, "", strict))
    return findings


def changed_categories(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Categories whose bytes changed from ``before`` to ``after``, grown then shrunk, largest first."""
    names = [c for c in CATEGORIES if c in before or c in after]
    names += sorted(set(before).union(after).difference(CATEGORIES))
    change = [(name, after.get(name, 0) - before.get(name, 0)) for name in names]
    moved = [(name, delta) for name, delta in change if delta]
    return dict(sorted(moved, key=lambda item: (item[1] < 0, -abs(item[1]))))  # stable: ties keep order


def stale_findings(stale: Iterable[StaleEntry], *, strict: bool = False) -> list[Finding]:
    """One ``"stale"`` finding per baseline whose test no longer exists (span and metric ``"*"``)."""
    return [
        Finding(
            entry.test,
            "*",
            "*",
            "baseline",
            "stale",
            detail=f"{entry.environment} (spans: {', '.join(entry.spans) or 'none'})",
            strict=strict,
        )
        for entry in stale
    ]
