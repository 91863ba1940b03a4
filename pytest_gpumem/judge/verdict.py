"""Verdicts: a measurement against limits, budgets and baselines, as :class:`Finding` objects.

Pure functions, no I/O. Every size is bytes unless a metric says otherwise
(:class:`MetricInfo`). Limits, budgets and baselines all compare *costs*: a
figure minus its span's start (:meth:`Measurement.cost`), what the test or span
itself added, so test order, shared fixtures, the CUDA context and library
workspaces do not move them. Whether the whole process fits a device of a given
size is what an emulated device limit answers (``device_limit=``).

A limit or budget on a figure the engine cannot know (``reserved`` on the CPU
engine, ``retained`` on a named span) gives an ``"n/a"`` finding that FAILS:
a guard that cannot be checked must not pass silently. Remove the limit for
that engine, or run where the figure exists. A baseline figure that is unknown
on one side is ``"n/a"`` too but does not fail (nothing was promised).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from functools import cached_property
from typing import Literal, cast

from pytest_gpumem.baselines import BASELINE_METRICS, BaselineEntry, StaleEntry
from pytest_gpumem.data.figures import CATEGORIES, COUNT_METRICS, METRICS, Measurement
from pytest_gpumem.units import SizeError, format_delta, format_percent, format_size, parse_size

__all__ = [
    "COST_METRICS",
    "DEFAULT_TOLERANCES",
    "METRIC_INFO",
    "Finding",
    "Kind",
    "Limit",
    "MetricInfo",
    "Status",
    "Tolerance",
    "changed_categories",
    "check_limits",
    "check_values",
    "compare_baseline",
    "compare_values",
    "default_tolerance",
    "failure_message",
    "metric_info",
    "parse_tolerance",
    "stale_findings",
]

Kind = Literal["limit", "budget", "baseline"]
Status = Literal["ok", "exceeded", "regressed", "improved", "new", "other-environment", "stale", "n/a"]


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class MetricInfo:
    """How to compare and show a metric.

    ``higher_is_better`` flips every comparison: a limit becomes a minimum and
    a regression is the value dropping (e.g. the largest microbatch that fits).
    ``unit`` is ``"bytes"`` (shown with :func:`~pytest_gpumem.units.format_size`)
    or ``"count"`` (shown as a plain integer); a :class:`Tolerance`'s absolute
    floor is in this unit.
    """

    name: str
    higher_is_better: bool = False
    unit: Literal["bytes", "count"] = "bytes"

    def format(self, value: int | None) -> str:
        """``value`` for people: ``"1.50 MiB"`` for bytes, ``"8"`` for counts, ``"n/a"`` for ``None``."""
        if value is None:
            return "n/a"
        return format_size(value) if self.unit == "bytes" else str(value)

    def format_delta(self, value: int | None) -> str:
        """A signed difference: ``"+1.50 MiB"`` for bytes, ``"-2"`` for counts."""
        if value is None:
            return "n/a"
        return format_delta(value) if self.unit == "bytes" else f"{value:+d}"


#: Metrics this release knows how to compare; any other name is bytes, lower is better.
METRIC_INFO: Mapping[str, MetricInfo] = {
    **{name: MetricInfo(name) for name in METRICS},
    "max_microbatch": MetricInfo("max_microbatch", higher_is_better=True, unit="count"),
}


_HIGHER_IS_BETTER = frozenset(name for name, info in METRIC_INFO.items() if info.higher_is_better)


def metric_info(metric: str) -> MetricInfo:
    """The :class:`MetricInfo` of ``metric`` (bytes, lower is better, when not in :data:`METRIC_INFO`)."""
    return METRIC_INFO.get(metric) or MetricInfo(metric)


# --------------------------------------------------------------------------- tolerance

_PERCENT_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%$")


@dataclass(frozen=True)
class Tolerance:
    """How far a cost may move from its baseline before it counts as changed.

    ``relative`` is a fraction of the baseline (``0.02`` for 2%), ``absolute``
    a floor in the metric's unit (bytes). The allowed change is the larger of
    the two: :meth:`allowed`. ``Tolerance()`` demands exact equality.
    """

    relative: float = 0.0
    absolute: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.relative) and self.relative >= 0):
            raise ValueError(f"invalid tolerance: relative {self.relative!r} must be a finite fraction >= 0")
        if isinstance(self.absolute, bool) or not isinstance(self.absolute, int) or self.absolute < 0:
            raise ValueError(f"invalid tolerance: absolute {self.absolute!r} must be a whole number of bytes >= 0")

    @cached_property
    def _ratio(self) -> tuple[int, int]:
        """``relative`` as the exact decimal fraction it was written as (0.29 is 29/100, not the float)."""
        exact = Fraction(repr(self.relative))
        return exact.numerator, exact.denominator

    def allowed(self, baseline: int) -> int:
        """``max(relative * |baseline|, absolute)``, rounded down (exact for comparing whole bytes)."""
        numerator, denominator = self._ratio
        return max(numerator * abs(baseline) // denominator, self.absolute)

    def describe(self, info: MetricInfo | None = None) -> str:
        """``"2%"``, ``"1.00 MiB"``, ``"2% or 1.00 MiB, whichever is larger"`` or ``"0 (exact)"``."""
        info = info or MetricInfo("")
        percent = f"{(Decimal(repr(self.relative)) * 100).normalize():f}%"
        if self.relative and self.absolute:
            return f"{percent} or {info.format(self.absolute)}, whichever is larger"
        if self.relative:
            return percent
        if self.absolute:
            return info.format(self.absolute)
        return "0 (exact)"

    def __str__(self) -> str:
        return self.describe()


_EXACT = Tolerance()

#: The tolerance of each baseline figure when no ``tolerance=`` (span, marker) and no
#: ``--gpumem-tolerance`` sets one. ``peak`` and ``allocated`` are exact: every engine counts
#: them to the byte (the CPU tracker counts storages; on CUDA the caching allocator's counters
#: gave identical bytes for identical steps on an H100), so any change is a change in what the
#: code allocates, and a percentage would hide a real regression at every scale (2% of a 12 MiB
#: step let a +476 KiB float64 loss through; 2% of a 20 GiB step is a 400 MiB activation copy).
#: ``reserved`` depends on the cache's history and keeps "2% or 1 MiB" (and at least one 20 MiB
#: segment, see the gate). A figure not named here is exact.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "peak": _EXACT,
    "allocated": _EXACT,
    "reserved": Tolerance(0.02, 2**20),
}


def default_tolerance(metric: str) -> Tolerance:
    """The tolerance ``metric`` is compared with when nothing sets one: :data:`DEFAULT_TOLERANCES`."""
    return DEFAULT_TOLERANCES.get(metric, _EXACT)


def parse_tolerance(text: str) -> Tolerance:
    """Read a tolerance: ``"2%"``, ``"1MiB"``, ``"2%,1MiB"`` (either order, spaces allowed) or ``"0"``.

    Sizes follow :func:`~pytest_gpumem.units.parse_size` (``"1MB"`` is 2**20
    bytes). Raises ``ValueError`` naming the value for anything else: an
    empty part, a negative or non-finite number, two percentages or two sizes.
    """
    if not isinstance(text, str):
        raise ValueError(f"invalid tolerance {text!r}: expected a string like '2%', '1MiB' or '2%,1MiB'")
    if not text.strip():
        raise ValueError(f"invalid tolerance {text!r}: the string is empty; write e.g. '2%', '1MiB' or '2%,1MiB'")
    relative: Decimal | None = None
    absolute: int | None = None
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            raise ValueError(f"invalid tolerance {text!r}: empty part; write e.g. '2%,1MiB'")
        if part.endswith("%"):
            match = _PERCENT_RE.match(part)
            if match is None:
                raise ValueError(f"invalid tolerance {text!r}: {part!r} is not a percentage such as '2%' or '0.5%'")
            if relative is not None:
                raise ValueError(f"invalid tolerance {text!r}: more than one percentage")
            relative = Decimal(match[1]) / 100
        else:
            try:
                size = parse_size(part)
            except SizeError as exc:
                raise ValueError(f"invalid tolerance {text!r}: {exc}") from None
            if absolute is not None:
                raise ValueError(f"invalid tolerance {text!r}: more than one size")
            absolute = size
    return Tolerance(relative=float(relative or 0), absolute=absolute or 0)


# --------------------------------------------------------------------------- limits and findings


@dataclass(frozen=True)
class Limit:
    """A stated bound on one figure of a span.

    Attributes:
        metric: the figure it bounds: one of :data:`~pytest_gpumem.data.figures.METRICS`
            or a later metric name.
        value: the bound in the metric's unit (bytes for figures).
        source: the bound as the user wrote it (``"4GB"``, ``"16Ψ + 2GiB"``).
        kind: ``"limit"`` (a size the user stated) or ``"budget"`` (a bound
            computed from theory, e.g. bytes per parameter); anything else
            raises ``ValueError``.
    """

    metric: str
    value: int
    source: str
    kind: str = "limit"

    def __post_init__(self) -> None:
        if self.kind not in ("limit", "budget"):
            raise ValueError(f"invalid limit kind {self.kind!r}: expected 'limit' or 'budget'")


@dataclass(frozen=True)
class Finding:
    """The outcome of comparing one figure of one span with one reference.

    Attributes:
        test: the pytest node id.
        span: ``"call"`` or a ``gpumem.measure(name)`` name (``"*"`` for a
            stale baseline: all its spans).
        metric: the compared figure (``"*"`` for a stale baseline).
        kind: ``"limit"``, ``"budget"`` or ``"baseline"``.
        status: ``"ok"``; ``"exceeded"`` (a limit or budget broken);
            ``"regressed"`` / ``"improved"`` (beyond the tolerance of the
            baseline); ``"new"`` (no baseline yet); ``"other-environment"``
            (baselines exist only for other environments, named in
            ``detail``); ``"stale"`` (a baseline whose test is gone); ``"n/a"``
            (the figure or its reference is unknown).
        measured: the compared figure: its cost (:meth:`Measurement.cost`) for
            byte figures, ``retained`` and counts as they are; ``None`` when unknown.
        reference: the limit, budget or baseline value; ``None`` when none.
        tolerance: the tolerance a baseline comparison used.
        changed: for a ``peak`` regression where both sides have a breakdown at the
            peak: category → bytes it changed by, every category that changed
            (grown largest first, then shrunk), so they add up to the change of
            the peak (:func:`changed_categories`).
        detail: free text: the limit as written, the budget expression, the
            other environments' keys, why a figure is n/a.
        strict: whether ``improved``, ``new``, ``other-environment`` and
            ``stale`` fail (they only inform otherwise).
    """

    test: str
    span: str
    metric: str
    kind: Kind
    status: Status
    measured: int | None = None
    reference: int | None = None
    tolerance: Tolerance | None = None
    changed: Mapping[str, int] = field(default_factory=dict, hash=False)
    detail: str = ""
    strict: bool = False

    @property
    def delta(self) -> int | None:
        """``measured - reference`` (in the metric's unit); ``None`` when either is unknown."""
        if self.measured is None or self.reference is None:
            return None
        return self.measured - self.reference

    @property
    def delta_pct(self) -> float | None:
        """:attr:`delta` as a percentage of :attr:`reference`; ``None`` when unknown or the reference is 0."""
        delta = self.delta
        if delta is None or not self.reference:
            return None
        return 100.0 * delta / self.reference

    @property
    def ratio(self) -> float | None:
        """``measured / reference`` (for budgets: measured over theory); ``None`` when unknown or reference is 0."""
        if self.measured is None or not self.reference:
            return None
        return self.measured / self.reference

    @property
    def failed(self) -> bool:
        """True when this finding fails the test.

        ``exceeded`` and ``regressed`` always fail, and so does ``n/a`` on a
        limit or budget; ``improved``, ``new``, ``other-environment`` and
        ``stale`` fail only when :attr:`strict`.
        """
        if self.status in ("exceeded", "regressed"):
            return True
        if self.status == "n/a":
            return self.kind != "baseline"
        if self.status in ("improved", "new", "other-environment", "stale"):
            return self.strict
        return False


def check_limits(test: str, measurement: Measurement, limits: Iterable[Limit]) -> list[Finding]:
    """Compare the costs of ``measurement`` with each limit or budget, in order.

    ``exceeded`` when the cost is above the limit (below it for a metric where
    higher is better, such as ``max_microbatch``), ``ok`` otherwise; ``n/a``
    (which fails) when the figure is unknown. Apply ``retained`` limits to the
    ``"call"`` span only.
    """
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
    """:func:`check_limits` for figures given by name (for metrics a :class:`Measurement` does not carry).

    ``engine`` only words the explanation of an ``n/a``.
    """
    findings: list[Finding] = []
    for limit in limits:
        info = metric_info(limit.metric)
        kind: Kind = "budget" if limit.kind == "budget" else "limit"
        measured = figures.get(limit.metric)
        status: Status
        if measured is None:
            status = "n/a"
            detail = _unknown_figure(limit.metric, span, engine, known=limit.metric in figures)
        else:
            broken = measured < limit.value if info.higher_is_better else measured > limit.value
            status = "exceeded" if broken else "ok"
            detail = limit.source
        findings.append(Finding(test, span, limit.metric, kind, status, measured, limit.value, detail=detail))
    return findings


def _unknown_figure(metric: str, span: str, engine: str | None, *, known: bool) -> str:
    if not known:
        return f"this span has no figure named {metric!r}"
    if metric in ("reserved",) and engine == "cpu":
        return "the cpu engine has no caching allocator"
    if metric == "retained" and span != "call":
        return "retained is measured for the whole test call only"
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
    """Compare the costs of ``measurement`` with its baseline ``entry``, one finding per metric.

    ``regressed`` when a cost is above ``baseline + allowed`` (below
    ``baseline - allowed`` for a metric where higher is better), ``improved``
    beyond the other side, ``ok`` within. Without an entry every known cost is
    ``new``, or ``other-environment`` when ``other_environments`` (their keys)
    have baselines for this test. A metric unknown on both sides gives no
    finding. ``tolerance`` is one :class:`Tolerance` for every metric or one
    per metric name (exact for a metric not in the mapping). Regressions carry
    the breakdown categories that grew when both sides have a breakdown.
    """
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
    """:func:`compare_baseline` for costs given by name (for metrics a :class:`Measurement` does not carry)."""
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
        allowed = tol.allowed(reference)
        worse = reference - measured if metric in _HIGHER_IS_BETTER else measured - reference
        status = "regressed" if worse > allowed else "improved" if -worse > allowed else "ok"
        changed: Mapping[str, int] = {}
        # the breakdown is the peak's: it explains a peak, not what stayed allocated at the end
        before = None if entry is None else entry.breakdown
        if status == "regressed" and metric == "peak" and breakdown is not None and before is not None:
            changed = changed_categories(before, breakdown)
        findings.append(Finding(test, span, metric, "baseline", status, measured, reference, tol, changed, "", strict))
    return findings


# compare_values builds findings with ``Finding(...)``. A shortcut that filled a frozen Finding's
# ``__dict__`` built them 2.5x faster, but measured at a realistic size that is 0.8 µs a finding:
# 4.6 ms over the 6,000 comparisons of a 1,000-test suite (7.1 ms instead of 11.7 ms; 74 ms
# instead of 118 ms for 10,000 tests; 2-core VM), not worth a second way to build a Finding.


def changed_categories(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Categories whose bytes changed from ``before`` to ``after``: category → change.

    The grown first, largest first, then the shrunk, largest shrink first; every category that
    changed is there, so the changes add up to the change of the total. Ties keep the order of
    :data:`~pytest_gpumem.data.figures.CATEGORIES` (unknown categories after, by name).
    """
    names = [c for c in CATEGORIES if c in before or c in after]
    names += sorted(set(before).union(after).difference(CATEGORIES))
    change = [(name, after.get(name, 0) - before.get(name, 0)) for name in names]
    grown = sorted(((n, d) for n, d in change if d > 0), key=lambda item: -item[1])  # stable: ties keep order
    shrunk = sorted(((n, d) for n, d in change if d < 0), key=lambda item: item[1])
    return dict(grown + shrunk)


def stale_findings(stale: Iterable[StaleEntry], *, strict: bool = False) -> list[Finding]:
    """One ``"stale"`` finding per baseline whose test no longer exists (span and metric ``"*"``).

    ``detail`` names the environment key and the recorded spans.
    """
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


# --------------------------------------------------------------------------- messages


#: Figures whose limits and baselines compare the cost (figure minus the span's start).
COST_METRICS: tuple[str, ...] = ("peak", "allocated", "reserved")


def _compared(metric: str) -> str:
    """How a message names what was compared: ``"peak cost"``; ``retained`` and counts as they are."""
    return f"{metric} cost" if metric in COST_METRICS else metric


def failure_message(findings: Iterable[Finding]) -> str:
    """The text attached to a failing test: one line per failed finding, in order ("" when none failed).

    Each line names the span (when not the whole call), the metric, the
    measured figure, the limit / budget / baseline, the excess in bytes and
    percent, the tolerance, and the breakdown categories that grew.
    """
    return "\n".join(_line(finding) for finding in findings if finding.failed)


def _line(f: Finding) -> str:
    info = metric_info(f.metric)
    where = "" if f.span in ("call", "*") else f"[{f.span}] "
    excess = f"{info.format_delta(f.delta)} ({format_percent(f.delta, f.reference)})"
    if f.status == "stale":
        return f"stale baseline: {f.test} no longer exists; baselines kept for {f.detail}; prune them"
    if f.kind in ("limit", "budget"):
        bound = f"{f.kind} {info.format(f.reference)}" + (f" ({f.detail})" if f.status != "n/a" and f.detail else "")
        if f.status == "n/a":
            return (
                f"{where}{f.metric} is n/a ({f.detail}), so the {bound} cannot be checked: "
                "remove it where this figure cannot be measured"
            )
        verb = "is below the minimum" if info.higher_is_better else "exceeds the"
        text = f"{where}{_compared(f.metric)} {info.format(f.measured)} {verb} {bound} by {excess}"
        if f.kind == "budget" and f.ratio is not None:
            text += f", {f.ratio:.2f}x the theory"
        return text
    tolerance = ""
    if f.tolerance is not None and f.reference is not None:
        allowed = f.tolerance.allowed(f.reference)
        tolerance = f", tolerance {f.tolerance.describe(info)}" + (f" (±{info.format(allowed)})" if allowed else "")
    cost = f"{where}{_compared(f.metric)} {info.format(f.measured)}"
    if f.status == "regressed":
        text = f"{cost} regressed from baseline {info.format(f.reference)} by {excess}{tolerance}"
        if f.changed:
            text += "; by category at the peak: " + ", ".join(f"{c} {format_delta(d)}" for c, d in f.changed.items())
            moved = sum(f.changed.values()) - (f.delta or 0)
            if moved:  # the categories are absolute, the cost is from the span's start
                text += f" (the span's start moved by {format_delta(moved)})"
        return text
    if f.status == "improved":
        return (
            f"{cost} improved on baseline {info.format(f.reference)} by {excess}{tolerance}; "
            "refresh it with --gpumem-update-baselines"
        )
    if f.status == "other-environment":
        return f"{cost} has no baseline in this environment ({f.detail}); record one with --gpumem-update-baselines"
    if f.status == "new":
        return f"{cost} has no baseline ({f.detail}); record one with --gpumem-update-baselines"
    return f"{cost}: {f.status} {f.detail}".rstrip()  # pragma: no cover - statuses that never fail
