"""What a span asks for: its limits, budgets and tolerance, validated where they are written."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpumem.budgets.expressions import BudgetError, BudgetExpr, parse_budget
from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.data.findings import Limit, Tolerance, parse_tolerance
from pytest_gpumem.data.metrics import SPAN_METRICS
from pytest_gpumem.units import SizeError, parse_size, shown

__all__ = [
    "SPAN_KEYWORDS",
    "LimitExceeded",
    "LimitSpec",
    "SpecError",
    "check_span_name",
    "parse_limit",
    "parse_span_limits",
    "parse_tolerance_keyword",
]

#: Keywords ``gpumem.measure(name, ...)`` accepts.
SPAN_KEYWORDS: tuple[str, ...] = (*SPAN_METRICS, "tolerance")


class SpecError(ValueError):
    """A marker or span keyword with a bad name or value."""


class LimitExceeded(AssertionError):
    """A span measured outside pytest broke one of its limits."""


@dataclass(frozen=True)
class LimitSpec(Coded):
    """A limit as written: a size in bytes, or a budget expression using Ψ."""

    metric: str
    text: str
    expression: BudgetExpr = field(metadata=coded(write=lambda e: e.text, read=parse_budget))

    def resolve(self, psi: int | None) -> Limit:
        """The limit in bytes, Ψ being the tracked trainable parameter count."""
        kind = "budget" if self.expression.uses_psi else "limit"
        return Limit(metric=self.metric, value=self.expression.evaluate(psi), source=self.text, kind=kind)


def parse_limit(metric: str, value: object) -> LimitSpec:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            parse_size(value)  # raises the precise message (float, bool, other types)
        assert isinstance(value, (int, str))
        expression = parse_budget(value)
        if not expression.uses_psi:
            expression.evaluate(None)  # constant limits must evaluate now: no negatives, no 1/0
    except (SizeError, BudgetError) as exc:
        raise SpecError(f"{metric}={shown(value)}: {exc}") from None
    return LimitSpec(metric, str(value), expression)


def parse_tolerance_keyword(value: object) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if not isinstance(value, str):
        raise SpecError(f"tolerance={shown(value)} is not a tolerance: use a string like '2%', '1MiB' or '2%,1MiB'")
    try:
        return parse_tolerance(value)
    except ValueError as exc:
        raise SpecError(f"tolerance={shown(value)}: {exc}") from None


def check_span_name(name: object) -> str:
    """``name`` if it can name a span in a measured test: a non-empty string of plain text but ``"call"``."""
    if not isinstance(name, str) or not name or name == "call":
        raise SpecError(f"span name {name!r} must be a non-empty string other than 'call' (the whole test)")
    _plain_text(name)
    return name


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _plain_text(name: str) -> None:
    control = _CONTROL.search(name)
    if control is not None:
        raise SpecError(f"span name {name!r} contains the control character {control.group()!r}: use plain text")


def parse_span_limits(name: object, limits: Mapping[str, Any]) -> tuple[tuple[LimitSpec, ...], Tolerance | None]:
    """Validate the keywords of ``measure(name, **limits)``: each limit once, into a :class:`LimitSpec`."""
    if not isinstance(name, str) or not name:
        raise SpecError(f"span name {name!r} must be a non-empty string")
    _plain_text(name)
    unknown = sorted(set(limits) - set(SPAN_KEYWORDS))
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise SpecError(f"span {name!r}: unknown keyword {names}; expected one of {', '.join(SPAN_KEYWORDS)}")
    try:
        specs = tuple(
            parse_limit(metric, value)
            for metric, value in limits.items()
            if metric != "tolerance" and value is not None
        )
        tolerance = None if limits.get("tolerance") is None else parse_tolerance_keyword(limits["tolerance"])
    except SpecError as exc:
        raise SpecError(f"span {name!r}: {exc}") from None
    return specs, tolerance
