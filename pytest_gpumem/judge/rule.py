"""The one rule that decides a figure against a reference: a limit, or a baseline within a tolerance.

Everything that decides whether a figure got worse calls it: the judge (limits, budgets and
baselines of the plugin, :func:`pytest_gpumem.measure`, ``gpumem.distributed``'s ranks and
runs under ``torchrun``) and ``python -m pytest_gpumem baselines diff --fail-on-growth``.
What differs per figure is a field of the metric table
(:data:`~pytest_gpumem.data.metrics.METRIC_TABLE`): which way is better, its unit, its default
tolerance and its tolerance floor. Pure: no I/O, no torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pytest_gpumem.data.findings import Tolerance
from pytest_gpumem.data.metrics import METRIC_TABLE, MetricInfo, metric_info

__all__ = [
    "BaselineStatus",
    "baseline_status",
    "describe_default_tolerances",
    "exceeds",
    "tolerance_for",
    "worse_by",
]

#: How a figure compares with its baseline: beyond the tolerance on the bad side, on the good side, or within.
BaselineStatus = Literal["regressed", "improved", "ok"]


def worse_by(metric: str, measured: int, reference: int) -> int:
    """How much worse ``measured`` is than ``reference``, in the metric's unit: ``measured - reference``,
    or ``reference - measured`` for a figure where higher is better; negative when it is better."""
    return reference - measured if metric_info(metric).higher_is_better else measured - reference


def exceeds(metric: str, measured: int, bound: int) -> bool:
    """Whether ``measured`` breaks the limit ``bound``: above it, or below it for a figure where
    higher is better (a limit on such a figure is a minimum)."""
    return worse_by(metric, measured, bound) > 0


def tolerance_for(metric: str, given: Tolerance | None) -> Tolerance:
    """The tolerance a baseline of ``metric`` is compared with, when ``given`` is what the user set
    (a span's, the marker's or the run's ``tolerance``; None: nothing, the metric's own default).

    A given tolerance's absolute part is bytes: a figure in another unit (a count) keeps only
    its relative part. Then the absolute part is at least the metric's tolerance floor.
    """
    if given is None:
        return _DEFAULTS.get(metric) or _EXACT
    info = metric_info(metric)
    absolute = given.absolute if info.unit == "bytes" else 0
    absolute = max(absolute, info.tolerance_floor)
    return given if absolute == given.absolute else Tolerance(given.relative, absolute)


def _floored(info: MetricInfo, tolerance: Tolerance) -> Tolerance:
    floor = info.tolerance_floor
    return tolerance if tolerance.absolute >= floor else Tolerance(tolerance.relative, floor)


_EXACT = Tolerance()
#: Each figure's tolerance when none is set (its default, at least its floor); made once, so that
#: each keeps the exact ratio :meth:`Tolerance.allowed` computes on first use.
_DEFAULTS: Mapping[str, Tolerance] = MappingProxyType(
    {info.name: _floored(info, Tolerance(*info.tolerance)) for info in METRIC_TABLE}
)


def baseline_status(metric: str, measured: int, reference: int, tolerance: Tolerance) -> BaselineStatus:
    """``measured`` against its baseline ``reference`` within ``tolerance`` (the one
    :func:`tolerance_for` gives): ``"regressed"`` when it is worse by more than the tolerance
    allows (:meth:`Tolerance.allowed`), ``"improved"`` when better by more, ``"ok"`` within."""
    worse = worse_by(metric, measured, reference)
    allowed = tolerance.allowed(reference)
    return "regressed" if worse > allowed else "improved" if -worse > allowed else "ok"


def describe_default_tolerances() -> str:
    """What every figure a baseline keeps is compared with when no tolerance is set, and the floors
    that hold whatever is set, in words (for the options' help): ``"exact for peak, allocated and
    max_microbatch; 2% or 1.00 MiB for reserved; reserved never closer than 20.00 MiB"``."""
    groups: dict[str, list[str]] = {}
    floors: list[str] = []
    for info in METRIC_TABLE:
        if not info.baseline:
            continue
        default = Tolerance(*info.tolerance)
        text = "exact" if default == Tolerance() else default.describe(info).replace(", whichever is larger", "")
        groups.setdefault(text, []).append(info.name)
        if info.tolerance_floor:
            floors.append(f"{info.name} never closer than {info.format(info.tolerance_floor)}")
    return "; ".join([*(f"{text} for {_listed(names)}" for text, names in groups.items()), *floors])


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
