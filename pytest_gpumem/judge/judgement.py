"""The judge: one entry, :func:`judge`, that decides a measured test.

From what was measured (a :class:`~pytest_gpumem.judge.record.TestRecord`: its spans'
figures and what each span asked for), the baseline file (a
:class:`~pytest_gpumem.baselines.BaselineStore`) and the run's options, it makes the
findings: each limit and budget resolved with the span's Ψ and checked, then each figure
compared with its baseline. The outcome is :attr:`TestRecord.failed
<pytest_gpumem.judge.record.TestRecord.failed>`. The pytest plugin, :func:`pytest_gpumem.measure`,
``gpumem.distributed`` (each rank a span) and runs under ``torchrun`` (each rank's spans
renamed before they arrive) all call it. Pure: no I/O, no torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pytest_gpumem.baselines import BaselineEntry, BaselineStore, Environment
from pytest_gpumem.baselines.canonical import stored_breakdown
from pytest_gpumem.budgets.expressions import BudgetError
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding, Limit, Tolerance
from pytest_gpumem.data.metrics import BASELINE_METRICS, METRIC_INFO
from pytest_gpumem.judge.limits import LimitSpec
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.verdict import check_limits, compare_baseline, default_tolerance

__all__ = ["RESERVED_TOLERANCE_FLOOR", "JudgeOptions", "baseline_metrics", "judge", "metric_tolerances"]


#: The least tolerance a ``reserved`` baseline is compared with: one of the caching allocator's
#: 20 MiB segments (the segment size of requests between 1 and 10 MiB). What the cache holds
#: depends on the process's allocation history (segments that hold a live block cannot be
#: returned), so the same step twice in one process can reserve a segment more or less
#: (seen on an H100: 622,854,144 vs 639,631,360 B, 16 MiB apart).
RESERVED_TOLERANCE_FLOOR = 20 * 2**20


@dataclass(frozen=True)
class JudgeOptions:
    """What the run asks of every judgement (see the plugin's ``--gpumem-*`` options)."""

    #: the run's baseline tolerance (``--gpumem-tolerance``); None: each metric's default
    tolerance: Tolerance | None = None
    #: ``--gpumem-strict``: new, improved and other-environment baselines fail too
    strict: bool = False
    #: ``--gpumem-update-baselines``: baselines are being recorded, none is compared
    update: bool = False


def judge(
    record: TestRecord, baselines: BaselineStore | None = None, options: JudgeOptions | None = None
) -> list[Finding]:
    """Decide ``record``: its findings (also set on it, with any error) in span order, limits first.

    Nothing is judged for a test whose own code failed. Each span's limits and budgets are
    resolved with its Ψ (a budget in Ψ with nothing tracked is an error on the record) and
    checked; then, when ``baselines`` are given, the test measured, and baselines are not
    being updated, each figure is compared with its baseline in the record's environment.
    Each span's tolerance is its own, else the marker's, else the run's (per metric:
    :func:`metric_tolerances`).
    """
    options = options or JudgeOptions()
    findings: list[Finding] = []
    if record.passed:
        for measurement in record.measurements:
            findings.extend(_check(record, measurement, record.asked.get(measurement.name, ())))
        if baselines is not None and record.environment is not None and not options.update:
            findings.extend(_compare(record, baselines, options))
    record.findings = findings
    return findings


def _check(record: TestRecord, measurement: Measurement, specs: Iterable[LimitSpec]) -> list[Finding]:
    limits: list[Limit] = []
    for spec in specs:
        try:
            limits.append(spec.resolve(measurement.psi))
        except BudgetError as exc:
            where = "marker" if measurement.name == "call" else f"span {measurement.name!r}"
            # only a missing Ψ is cured by tracking; a negative budget or 1/Ψ with Ψ=0 is the expression's own
            hint = " (track the model with gpumem.track(model, optimizer))" if measurement.psi is None else ""
            record.errors.append(f"{where}: {spec.metric}={spec.text!r}: {exc}{hint}")
    return check_limits(record.nodeid, measurement, limits)


def _compare(record: TestRecord, store: BaselineStore, options: JudgeOptions) -> list[Finding]:
    assert record.environment is not None
    env = Environment.from_dict(record.environment)
    others = store.environments_with(record.nodeid, exclude=env.key)
    findings: list[Finding] = []
    for measurement in record.measurements:
        metrics = baseline_metrics(measurement)
        entry = store.entry(env.key, record.nodeid, measurement.name)
        if entry is not None and measurement.breakdown is not None:  # the categories a baseline keeps, on both sides
            measurement = replace(measurement, breakdown=stored_breakdown(measurement.breakdown))
            entry = replace(entry, breakdown=stored_breakdown(entry.breakdown))
        findings.extend(
            compare_baseline(
                record.nodeid,
                measurement,
                entry,
                metric_tolerances(metrics, record.tolerance(measurement.name) or options.tolerance),
                other_environments=others,
                strict=options.strict,
                metrics=metrics,
            )
        )
    findings.extend(_unmeasured(record, store.spans(env.key, record.nodeid), options.strict))
    return findings


def _unmeasured(record: TestRecord, recorded: Mapping[str, BaselineEntry], strict: bool) -> list[Finding]:
    """A ``stale`` finding for each baseline of the test that the run did not produce: a recorded
    span none of its measurements has (a ``measure()`` block renamed or removed), a recorded
    figure its span did not measure this time (``max_microbatch`` of a test that no longer
    searches). Under ``torchrun`` each rank judges its own spans (``…@rankR-of-N``) only."""
    measured = {measurement.name: measurement for measurement in record.measurements}
    own = _rank_suffix(record.measurements[0].name) if record.measurements else ""
    findings: list[Finding] = []
    for name, entry in recorded.items():
        if _rank_suffix(name) != own:
            continue
        measurement = measured.get(name)
        if measurement is None:
            detail = "recorded span, not measured by this run"
            findings.append(Finding(record.nodeid, name, "*", "baseline", "stale", detail=detail, strict=strict))
            continue
        kept = baseline_metrics(measurement)
        for metric, value in entry.costs.items():
            if value is not None and metric in METRIC_INFO and metric not in kept:
                detail = "recorded figure, not measured by this run"
                stale = Finding(record.nodeid, name, metric, "baseline", "stale", None, value, None, {}, detail, strict)
                findings.append(stale)
    return findings


def _rank_suffix(span: str) -> str:
    """``"@rank1-of-2"`` of a span a ``torchrun`` rank named (``call@rank1-of-2``), else ``""``."""
    at = span.rfind("@rank")
    return span[at:] if at >= 0 else ""


def metric_tolerances(metrics: Iterable[str], tolerance: Tolerance | None) -> dict[str, Tolerance]:
    """The tolerance of each metric's baseline comparison: ``tolerance`` for bytes, at least
    :data:`RESERVED_TOLERANCE_FLOOR` for ``reserved``, only its relative part for a count
    (``max_microbatch``: its absolute floor is bytes). ``None`` (nothing set one): each
    metric's :func:`~pytest_gpumem.judge.verdict.default_tolerance`, with the same floor for ``reserved``."""
    per_metric = {}
    for metric in metrics:
        if tolerance is None:
            per_metric[metric] = _floored(metric, default_tolerance(metric))
        elif metric == "reserved":
            per_metric[metric] = _floored(metric, tolerance)
        elif metric in BASELINE_METRICS:
            per_metric[metric] = tolerance
        else:
            per_metric[metric] = Tolerance(tolerance.relative, 0)
    return per_metric


def _floored(metric: str, tolerance: Tolerance) -> Tolerance:
    if metric != "reserved":
        return tolerance
    return Tolerance(tolerance.relative, max(tolerance.absolute, RESERVED_TOLERANCE_FLOOR))


def baseline_metrics(measurement: Measurement) -> tuple[str, ...]:
    """The figures a baseline keeps: the byte costs, and the largest microbatch when the test searched it."""
    return BASELINE_METRICS + (("max_microbatch",) if measurement.max_microbatch is not None else ())
