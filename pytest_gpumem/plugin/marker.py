"""The ``gpumem`` marker: its keywords, their help, and :func:`parse_marker`, which validates them without torch."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from pytest_gpumem.data.findings import Tolerance
from pytest_gpumem.data.metrics import METRIC_TABLE, METRICS
from pytest_gpumem.data.site_figures import parse_sites_mode
from pytest_gpumem.judge.limits import LimitSpec, SpecError, parse_limit, parse_tolerance_keyword
from pytest_gpumem.measurement.observe import observe_conflict, parse_observe
from pytest_gpumem.units import MAX_BYTES, SizeError, parse_size, shown

__all__ = [
    "MARKER_KEYWORDS",
    "MARKER_KEYWORD_HELP",
    "SETUP_KEYWORDS",
    "GpumemSpec",
    "closest_first",
    "late_marker_problems",
    "marker_help",
    "parse_device",
    "parse_marker",
    "parse_predict",
]

#: Keywords the ``gpumem`` marker accepts, each with what it means (the marker's help is made from it).
MARKER_KEYWORD_HELP: dict[str, str] = {
    **{info.name: info.meaning for info in METRIC_TABLE if info.meaning},  # the limits, in METRICS order
    "device": "'auto', 'cpu', 'cuda' or 'cuda:N' (overrides --gpumem-device)",
    "breakdown": "True/False: the full breakdown by category (activations told apart; the storage tracker on CUDA)",
    "observe": "CPU engine: 'operators' (default) or 'allocations' (compiled code runs as compiled)",
    "predict": "CPU engine: report what this GPU would show (e.g. 'h100'); ignored on a GPU",
    "fake": "True/False: with a prediction, run the test on fake tensors (shapes, no data); ignored on a GPU",
    "tolerance": "baseline tolerance of this test: '2%', '1MiB' or '2%,1MiB'",
    "device_limit": "run as if the device had this much memory: '24GiB'",
    "min_microbatch": "the largest microbatch gpumem.max_microbatch() finds must be at least this (an int)",
    "sites": "'rerun', 'always' or 'off': when this test records where its bytes were made (overrides "
    "--gpumem-sites; 'off' for a test whose state a second run of its call would find changed)",
}
MARKER_KEYWORDS: tuple[str, ...] = tuple(MARKER_KEYWORD_HELP)
assert MARKER_KEYWORDS[: len(METRICS)] == METRICS, "the limits come first, in METRICS order"
#: The keywords that choose how a test is measured, read before its fixtures (the others are judged after the call).
SETUP_KEYWORDS: tuple[str, ...] = ("device", "breakdown", "observe", "predict", "fake", "device_limit")


@dataclass(frozen=True)
class GpumemSpec:
    """The validated ``gpumem`` marker of one test."""

    limits: tuple[LimitSpec, ...] = ()
    device: str | None = None
    breakdown: bool | None = None
    observe: str | None = None
    predict: str | None = None
    fake: bool | None = None
    tolerance: Tolerance | None = None
    device_limit: int | None = None
    min_microbatch: int | None = None
    sites: str | None = None


T = TypeVar("T")

#: torch keeps a device index in 8 bits (``cuda:128`` is ``cuda:-128``) and refuses leading zeros
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(?::(?:0|[1-9][0-9]{0,2}))?)$")
_MAX_DEVICE_INDEX = 127


def parse_device(value: object) -> str:
    """Validate a device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or such a ``torch.device``, without torch."""
    if type(value).__name__ == "device" and type(value).__module__ == "torch":
        value = str(value)
    text = value.strip() if isinstance(value, str) else None
    if text is None or _DEVICE_RE.match(text) is None or int(text.partition(":")[2] or 0) > _MAX_DEVICE_INDEX:
        raise SpecError(
            f"device={shown(value)} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N' "
            f"(N from 0 to {_MAX_DEVICE_INDEX}, without leading zeros)"
        )
    return text


def _spec_error(parse: Callable[[Any], T]) -> Callable[[object], T]:
    """``parse``, whose ``ValueError`` is a :class:`SpecError` with its message."""

    def parsed(value: object) -> T:
        try:
            return parse(value)
        except ValueError as exc:
            raise SpecError(str(exc)) from None

    return parsed


def parse_predict(value: object) -> str:
    """The canonical name of the prediction target ``value`` names, else a :class:`SpecError` naming it."""
    from pytest_gpumem.targets import parse_predict as parse_target

    return _spec_error(parse_target)(value)


def _size(name: str, value: object) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise SpecError(f"{name}={shown(value)}: {exc}") from None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BYTES:
        raise SpecError(f"{name}={shown(value)} must be a positive int (a microbatch size) of at most 2**63 - 1")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{name}={shown(value)} must be True or False")
    return value


#: how each keyword but the limits is validated, in the order a bad one is reported
_PARSERS: dict[str, Callable[[object], Any]] = {
    "device": parse_device,
    "breakdown": partial(_bool, "breakdown"),
    "observe": _spec_error(parse_observe),
    "predict": parse_predict,
    "fake": partial(_bool, "fake"),
    "tolerance": parse_tolerance_keyword,
    "device_limit": partial(_size, "device_limit"),
    "min_microbatch": partial(_positive_int, "min_microbatch"),
    "sites": _spec_error(parse_sites_mode),
}
assert tuple(_PARSERS) == MARKER_KEYWORDS[len(METRICS) :], "every other keyword is parsed, in its order"


def marker_help() -> str:
    """The ``gpumem`` marker's line in ``pytest --markers``, made from :data:`MARKER_KEYWORD_HELP`."""
    signature = ", ".join(f"{name}=None" for name in MARKER_KEYWORDS)
    keywords = "; ".join(f"{name}: {text}" for name, text in MARKER_KEYWORD_HELP.items())
    return (
        f"gpumem({signature}): measure the test's device memory and fail when a figure exceeds its "
        "limit or regresses from its baseline. Limits are bytes (int), sizes ('4GB' = 4 GiB, '512 MiB') or "
        f"budget expressions ('16Ψ + 2GiB'). {keywords}. See pytest-gpumem's README."
    )


def closest_first(marks: Sequence[T], parameter_marks: Sequence[object]) -> list[T]:
    """``marks`` with the test's parameters' marks first: the closest, though pytest lists them after the function's."""
    first = [mark for mark in marks if any(mark is other for other in parameter_marks)]
    return first + [mark for mark in marks if not any(mark is other for other in parameter_marks)]


def late_marker_problems(
    markers: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    late: Sequence[bool],
    before: GpumemSpec,
    now: GpumemSpec,
) -> list[str]:
    """What is wrong with markers added late: a keyword a closer one overrides, a setup keyword changed."""
    problems = []
    for (_, kwargs), is_late in zip(markers, late, strict=True):
        if not is_late:
            continue
        for key, value in kwargs.items():
            winner = next(other for _, other in markers if key in other)
            if winner is not kwargs and winner[key] != value:
                problems.append(
                    f"the gpumem marker added after collection sets {key}={value!r}, but {key}={winner[key]!r} "
                    "of a closer marker wins (the closest marker wins, keyword by keyword): remove one of them, "
                    "or add the marker with add_marker(..., append=False) to make it the closest"
                )
    for key in SETUP_KEYWORDS:
        if getattr(before, key) != getattr(now, key):
            value = next((kwargs[key] for _, kwargs in markers if key in kwargs), None)
            problems.append(
                f"{key}={value!r} was added to the gpumem marker too late: the test was set up to be measured "
                "without it. Mark the test itself, or add the marker in pytest_collection_modifyitems"
            )
    return problems


def parse_marker(markers: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> GpumemSpec:
    """Merge and validate ``gpumem`` markers, closest first (its keywords win); :class:`SpecError` names a bad one."""
    merged: dict[str, Any] = {}
    for args, kwargs in markers:
        if args:
            raise SpecError(
                f"positional arguments {tuple(args)!r} are not accepted: use keywords ({', '.join(MARKER_KEYWORDS)})"
            )
        for key, value in kwargs.items():
            merged.setdefault(key, value)
    unknown = sorted(set(merged) - set(MARKER_KEYWORDS))
    if unknown:
        raise SpecError(
            f"unknown keyword {', '.join(map(repr, unknown))}; expected one of {', '.join(MARKER_KEYWORDS)}"
        )
    limits = tuple(parse_limit(metric, merged[metric]) for metric in METRICS if merged.get(metric) is not None)
    limit = merged.get("device_limit")
    conflict = observe_conflict(
        merged.get("observe"),
        predict=merged.get("predict"),
        limit=None if limit is None else f"device_limit={shown(limit)}",
    )
    if conflict is not None:
        raise SpecError(conflict)
    parsed = {key: parse(merged[key]) for key, parse in _PARSERS.items() if merged.get(key) is not None}
    return GpumemSpec(limits=limits, **parsed)


def parse_seconds(text: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {text!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"expected a number of seconds (0 or more), got {text!r}")
    return seconds
