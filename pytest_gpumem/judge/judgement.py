"""The judge: a measured test's limits and budgets checked, its figures compared with baselines (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pytest_gpumem.baselines import BaselineEntry, BaselineStore, Environment
from pytest_gpumem.baselines.canonical import stored_breakdown
from pytest_gpumem.budgets.expressions import BudgetError, parse_budget
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding, Limit, Tolerance
from pytest_gpumem.data.metrics import BASELINE_METRICS, MEASURED_BASELINE_METRICS, METRIC_INFO, metric_info
from pytest_gpumem.judge.limits import LimitSpec
from pytest_gpumem.judge.record import TestRecord, memory_failed
from pytest_gpumem.judge.rule import tolerance_for
from pytest_gpumem.judge.site_changes import SiteDiff, diff_sites
from pytest_gpumem.judge.verdict import check_limits, compare_baseline

__all__ = ["Decision", "JudgeOptions", "baseline_metrics", "decide", "judge", "limits_of", "metric_tolerances"]

#: What ``--gpumem-leak-check`` asks of every test whose marker does not bound ``retained``.
LEAK_CHECK = LimitSpec("retained", "0B (gpumem_leak_check)", parse_budget("0"))


@dataclass(frozen=True)
class JudgeOptions:
    """What the run asks of every judgement: ``--gpumem-tolerance`` (None: each metric's default), ``--gpumem-strict``
    and ``--gpumem-update-baselines`` (then no baseline is compared)."""

    tolerance: Tolerance | None = None
    strict: bool = False
    update: bool = False


@dataclass(frozen=True)
class Decision:
    """What the judge decides of a record, without changing it: its findings in span order (limits first), the sites
    that changed against the baselines (None where none were compared), budget errors, and the reports it adds."""

    findings: tuple[Finding, ...]
    site_changes: dict[str, SiteDiff] | None
    errors: tuple[str, ...]
    reports: tuple[str, ...]

    def fails(self, record: TestRecord) -> bool:
        """Whether ``record`` fails on memory once decided (see :attr:`TestRecord.failed`)."""
        return memory_failed((*record.errors, *self.errors), self.findings)


def decide(record: TestRecord, baselines: BaselineStore | None = None, options: JudgeOptions | None = None) -> Decision:
    """Decide ``record`` and change nothing; none of its limits are checked where its code failed."""
    options = options or JudgeOptions()
    findings: list[Finding] = []
    errors: list[str] = []
    changes: dict[str, SiteDiff] | None = None
    if record.passed:
        for measurement in record.measurements:
            findings.extend(_check(record, measurement, limits_of(record, measurement.name), errors))
        if baselines is not None and record.environment is not None and not options.update:
            compared, changes = _compare(record, baselines, options)
            findings.extend(compared)
    leak = record.leak_report
    failed = any(f.failed and f.metric == "retained" for f in findings)
    reports = (leak,) if leak and leak not in record.reports and failed else ()
    return Decision(tuple(findings), changes, tuple(errors), reports)


def judge(
    record: TestRecord, baselines: BaselineStore | None = None, options: JudgeOptions | None = None
) -> TestRecord:
    """:func:`decide` ``record``: the record with what was decided on it (``record`` is not changed)."""
    decision = decide(record, baselines, options)
    return replace(
        record,
        findings=list(decision.findings),
        errors=[*record.errors, *decision.errors],
        reports=[*record.reports, *decision.reports],
        site_changes=record.site_changes if decision.site_changes is None else decision.site_changes,
    )


def limits_of(record: TestRecord, span: str) -> list[LimitSpec]:
    """The limits ``span`` of ``record`` asked for, in order, with the call's leak check and ``min_microbatch``."""
    limits = list(record.asked.get(span, ()))
    if not record.measurements or span != record.measurements[0].name:
        return limits
    if record.ranks_measured:
        limits = [limit for limit in limits if not metric_info(limit.metric).span_limit]
    if record.leak_check and not any(limit.metric == LEAK_CHECK.metric for limit in limits):
        limits.append(LEAK_CHECK)
    if record.min_microbatch is not None:
        text = f"min_microbatch={record.min_microbatch}"
        limits.append(LimitSpec("max_microbatch", text, parse_budget(str(record.min_microbatch))))
    return limits


def _check(
    record: TestRecord, measurement: Measurement, specs: Iterable[LimitSpec], errors: list[str]
) -> list[Finding]:
    limits: list[Limit] = []
    for spec in specs:
        try:
            limits.append(spec.resolve(measurement.psi))
        except BudgetError as exc:
            where = "marker" if measurement.name == "call" else f"span {measurement.name!r}"
            # only a missing Ψ is cured by tracking; a negative budget or 1/Ψ with Ψ=0 is the expression's own
            hint = " (track the model with gpumem.track(model, optimizer))" if measurement.psi is None else ""
            errors.append(f"{where}: {spec.metric}={spec.text!r}: {exc}{hint}")
    return check_limits(record.nodeid, measurement, limits)


def _compare(
    record: TestRecord, store: BaselineStore, options: JudgeOptions
) -> tuple[list[Finding], dict[str, SiteDiff]]:
    """The findings of ``record`` against its baselines, and by span the sites that changed against their profiles."""
    assert record.environment is not None
    env = Environment.from_dict(record.environment)
    others = store.environments_with(record.nodeid, exclude=env.key)
    findings: list[Finding] = []
    site_changes: dict[str, SiteDiff] = {}
    for measurement in record.measurements:
        metrics = baseline_metrics(measurement)
        entry = store.entry(env.key, record.nodeid, measurement.name)
        if entry is not None and entry.sites is not None and measurement.sites is not None:
            site_changes[measurement.name] = diff_sites(measurement.name, entry.sites, measurement.sites)
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
    return findings, site_changes


def _unmeasured(record: TestRecord, recorded: Mapping[str, BaselineEntry], strict: bool) -> list[Finding]:
    """A ``stale`` finding for each recorded span or figure (of this rank) that the run did not produce."""
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
    """The tolerance of each metric's baseline comparison when ``tolerance`` (or None) is the one set."""
    return {metric: tolerance_for(metric, tolerance) for metric in metrics}


def baseline_metrics(measurement: Measurement) -> tuple[str, ...]:
    """The figures a baseline keeps for ``measurement``: those it always keeps, and those it keeps when measured."""
    measured = tuple(m for m in MEASURED_BASELINE_METRICS if measurement.figure(m) is not None)
    return BASELINE_METRICS + measured
