"""The one rule that decides a figure against a reference: a limit, or a baseline within a tolerance."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pytest_gpumem.data.findings import Tolerance
from pytest_gpumem.data.metrics import METRIC_TABLE, MetricInfo, metric_info

__all__ = [
    "DEFAULT_TOLERANCES",
    "BaselineStatus",
    "baseline_status",
    "default_tolerance",
    "describe_default_tolerances",
    "exceeds",
    "tolerance_for",
    "worse_by",
]

#: How a figure compares with its baseline: beyond the tolerance on the bad side, on the good side, or within.
BaselineStatus = Literal["regressed", "improved", "ok"]


def worse_by(metric: str, measured: int, reference: int) -> int:
    """How much worse ``measured`` is than ``reference``, in the metric's unit; negative when it is better."""
    return reference - measured if metric_info(metric).higher_is_better else measured - reference


def exceeds(metric: str, measured: int, bound: int) -> bool:
    """Whether ``measured`` breaks the limit ``bound`` (a minimum where higher is better)."""
    return worse_by(metric, measured, bound) > 0


def tolerance_for(metric: str, given: Tolerance | None) -> Tolerance:
    """The tolerance of ``metric`` when ``given`` is set (None: its default): absolute part in bytes, floored."""
    if given is None:
        return default_tolerance(metric)
    info = metric_info(metric)
    if info.unit != "bytes" and given.absolute:
        given = Tolerance(given.relative)
    return _floored(info, given)


def _floored(info: MetricInfo, tolerance: Tolerance) -> Tolerance:
    floor = info.tolerance_floor
    return tolerance if tolerance.absolute >= floor else Tolerance(tolerance.relative, floor)


_EXACT = Tolerance()
#: The tolerance of each baseline figure when nothing sets one: the metric table's, with its floor; made once, so each
#: keeps the ratio :meth:`Tolerance.allowed` caches.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {info.name: _floored(info, Tolerance(*info.tolerance)) for info in METRIC_TABLE}
)


def default_tolerance(metric: str) -> Tolerance:
    """The tolerance ``metric`` is compared with when nothing sets one (exact where the table has none)."""
    return DEFAULT_TOLERANCES.get(metric, _EXACT)


def baseline_status(metric: str, measured: int, reference: int, tolerance: Tolerance) -> BaselineStatus:
    """``measured`` against its baseline ``reference``: ``"regressed"``, ``"improved"`` or ``"ok"`` (within)."""
    worse = worse_by(metric, measured, reference)
    allowed = tolerance.allowed(reference)
    return "regressed" if worse > allowed else "improved" if -worse > allowed else "ok"


def describe_default_tolerances() -> str:
    """The default tolerances and floors of the baseline figures, in words, for the options' help."""
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
