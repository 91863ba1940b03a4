"""Findings: a figure compared with a limit, a budget or a baseline, and the words for it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from functools import cached_property
from typing import Literal

from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.data.metrics import COST_METRICS, MetricInfo, metric_info
from pytest_gpumem.units import MAX_BYTES, SizeError, format_delta, format_percent, parse_size, shown

__all__ = [
    "MAX_PERCENT",
    "Finding",
    "Kind",
    "Limit",
    "Status",
    "Tolerance",
    "failure_message",
    "parse_tolerance",
]

Kind = Literal["limit", "budget", "baseline"]
Status = Literal["ok", "exceeded", "regressed", "improved", "new", "other-environment", "stale", "n/a"]

#: The largest percentage a tolerance may hold: 10,000 times the baseline (a figure may grow that much).
MAX_PERCENT = 1_000_000

_PERCENT_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%$")


@dataclass(frozen=True)
class Tolerance(Coded):
    """How far a cost may move from its baseline: the larger of ``relative`` × baseline and ``absolute``."""

    relative: float = 0.0
    absolute: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.relative) and self.relative >= 0):
            raise ValueError(f"invalid tolerance: relative {self.relative!r} must be a finite fraction >= 0")
        if isinstance(self.absolute, bool) or not isinstance(self.absolute, int) or self.absolute < 0:
            raise ValueError(f"invalid tolerance: absolute {shown(self.absolute)} must be a whole number of bytes >= 0")
        if self.absolute > MAX_BYTES or self.relative > MAX_PERCENT / 100:
            raise ValueError(
                f"invalid tolerance: {shown(self.relative)}, {shown(self.absolute)} is too large "
                f"(at most {MAX_PERCENT:,}% and 8 EiB)"
            )

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
        parts = [f"{(Decimal(repr(self.relative)) * 100).normalize():f}%"] if self.relative else []
        if self.absolute:
            parts.append((info or MetricInfo("")).format(self.absolute))
        if len(parts) == 2:
            return f"{parts[0]} or {parts[1]}, whichever is larger"
        return parts[0] if parts else "0 (exact)"

    def __str__(self) -> str:
        return self.describe()


def parse_tolerance(text: str) -> Tolerance:
    """Read a tolerance: ``"2%"``, ``"1MiB"``, ``"2%,1MiB"`` (either order) or ``"0"``; else ``ValueError`` naming
    it."""
    if not isinstance(text, str):
        raise ValueError(f"invalid tolerance {shown(text)}: expected a string like '2%', '1MiB' or '2%,1MiB'")
    if not text.strip():
        raise ValueError(f"invalid tolerance {text!r}: the string is empty; write e.g. '2%', '1MiB' or '2%,1MiB'")
    invalid = f"invalid tolerance {shown(text)}"
    relative: Decimal | None = None
    absolute: int | None = None
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            raise ValueError(f"{invalid}: empty part; write e.g. '2%,1MiB'")
        if part.endswith("%"):
            match = _PERCENT_RE.match(part)
            if match is None:
                raise ValueError(f"{invalid}: {shown(part)} is not a percentage such as '2%' or '0.5%'")
            if relative is not None:
                raise ValueError(f"{invalid}: more than one percentage")
            if len(match[1].partition(".")[0].lstrip("0")) > 7 or Decimal(match[1]) > MAX_PERCENT:
                raise ValueError(f"{invalid}: {shown(part)} is too large (at most {MAX_PERCENT:,}%)")
            relative = Decimal(match[1]) / 100
        else:
            try:
                size = parse_size(part)
            except SizeError as exc:
                raise ValueError(f"{invalid}: {exc}") from None
            if absolute is not None:
                raise ValueError(f"{invalid}: more than one size")
            absolute = size
    return Tolerance(relative=float(relative or 0), absolute=absolute or 0)


@dataclass(frozen=True)
class Limit:
    """A stated bound on one figure of a span: ``value`` in the metric's unit, ``source`` as written, ``kind``
    ``"limit"`` or ``"budget"``."""

    metric: str
    value: int
    source: str
    kind: str = "limit"

    def __post_init__(self) -> None:
        if self.kind not in ("limit", "budget"):
            raise ValueError(f"invalid limit kind {self.kind!r}: expected 'limit' or 'budget'")


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


#: The figures a finding's data carries after ``reference``, for the reports' readers (not read back).
_DERIVED: dict[str, Callable[[Finding], object]] = {
    "delta": lambda f: f.delta,
    "delta_pct": lambda f: _rounded(f.delta_pct, 4),
    "ratio": lambda f: _rounded(f.ratio, 6),
}


@dataclass(frozen=True)
class Finding(Coded):
    """The outcome of comparing one figure (its cost) of one span with one reference; ``changed``: the categories a
    peak regression changed by; ``strict`` makes the informative statuses fail."""

    test: str
    span: str
    metric: str
    kind: Kind
    status: Status = field(metadata=coded(then={"failed": lambda f: f.failed}))
    measured: int | None = None
    reference: int | None = field(default=None, metadata=coded(then=_DERIVED))
    tolerance: Tolerance | None = field(
        default=None,
        metadata=coded(then={"tolerance_text": lambda f: None if f.tolerance is None else str(f.tolerance)}),
    )
    changed: Mapping[str, int] = field(default_factory=dict, hash=False)
    detail: str = ""
    strict: bool = False

    @property
    def delta(self) -> int | None:
        """``measured - reference`` (in the metric's unit); ``None`` when either is unknown."""
        return None if self.measured is None or self.reference is None else self.measured - self.reference

    @property
    def delta_pct(self) -> float | None:
        """:attr:`delta` as a percentage of :attr:`reference`; ``None`` when unknown or the reference is 0."""
        delta = self.delta
        return None if delta is None or not self.reference else 100.0 * delta / self.reference

    @property
    def ratio(self) -> float | None:
        """``measured / reference`` (for budgets: measured over theory); ``None`` when unknown or reference is 0."""
        return None if self.measured is None or not self.reference else self.measured / self.reference

    @property
    def failed(self) -> bool:
        """True when this finding fails the test: exceeded, regressed, n/a on a limit or budget; the rest when
        strict."""
        if self.status == "n/a":
            return self.kind != "baseline"
        informative = ("improved", "new", "other-environment", "stale")
        return self.status in ("exceeded", "regressed") or (self.strict and self.status in informative)


def failure_message(findings: Iterable[Finding]) -> str:
    """The text attached to a failing test: one line per failed finding, in order ("" when none failed)."""
    return "\n".join(_line(finding) for finding in findings if finding.failed)


def _factor(ratio: float) -> str:
    """A ratio with two decimals, more when those would read 1.00 for a ratio that is not 1."""
    for digits in (2, 3, 4, 5, 6):
        text = f"{ratio:.{digits}f}"
        if float(text) != 1.0 or ratio == 1.0:
            return text
    return text


def _line(f: Finding) -> str:
    info = metric_info(f.metric)
    where = "" if f.span in ("call", "*") else f"[{f.span}] "
    excess = f"{info.format_delta(f.delta)} ({format_percent(f.delta, f.reference)})"
    if f.status == "stale" and f.span != "*":  # a part of a test's baselines that the run did not produce
        redo = "record the test again with --gpumem-update-baselines"
        if f.metric == "*":
            return f"stale baseline: the span {f.span!r} of {f.test} was recorded, not measured by this run; {redo}"
        recorded = f"{f.metric} {info.format(f.reference)}" + (f" of the span {f.span!r}" if f.span != "call" else "")
        return f"stale baseline: {recorded} was recorded for {f.test}, not measured by this run; {redo}"
    if f.status == "stale":
        return f"stale baseline: {f.test} no longer exists; baselines kept for {f.detail}; prune them"
    measured, reference = info.format_pair(f.measured, f.reference)  # never the same text for two values
    compared = f"{f.metric} cost" if f.metric in COST_METRICS else f.metric  # retained and counts as they are
    cost = f"{where}{compared} {measured}"
    if f.kind in ("limit", "budget"):
        bound = f"{f.kind} {reference}" + (f" ({f.detail})" if f.status != "n/a" and f.detail else "")
        if f.status == "n/a":
            return (
                f"{where}{f.metric} is n/a ({f.detail}), so the {bound} cannot be checked: "
                "remove it where this figure cannot be measured"
            )
        verb = "is below the minimum" if info.higher_is_better else "exceeds the"
        text = f"{cost} {verb} {bound} by {excess}"
        if f.kind == "budget" and f.ratio is not None:
            text += f", {_factor(f.ratio)}x the theory"
        return text
    tolerance = ""
    if f.tolerance is not None and f.reference is not None:
        allowed = f.tolerance.allowed(f.reference)
        tolerance = f", tolerance {f.tolerance.describe(info)}" + (f" (±{info.format(allowed)})" if allowed else "")
    if f.status == "regressed":
        text = f"{cost} regressed from baseline {reference} by {excess}{tolerance}"
        if f.changed:
            text += "; by category at the peak: " + ", ".join(f"{c} {format_delta(d)}" for c, d in f.changed.items())
            moved = sum(f.changed.values()) - (f.delta or 0)
            if moved:  # the categories are absolute, the cost is from the span's start
                text += f" (the span's start moved by {format_delta(moved)})"
        return text
    if f.status == "improved":
        return (
            f"{cost} improved on baseline {reference} by {excess}{tolerance}; refresh it with --gpumem-update-baselines"
        )
    if f.status == "other-environment":
        return f"{cost} has no baseline in this environment ({f.detail}); record one with --gpumem-update-baselines"
    if f.status == "new":
        return f"{cost} has no baseline ({f.detail}); record one with --gpumem-update-baselines"
    return f"{cost}: {f.status} {f.detail}".rstrip()  # pragma: no cover - statuses that never fail
