"""Verdicts: tolerances, limits, baselines, messages (pure, no I/O)."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpumem.baselines import BaselineEntry, StaleEntry
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding, Limit, Tolerance, failure_message, parse_tolerance
from pytest_gpumem.data.metrics import CATEGORIES, metric_info
from pytest_gpumem.judge.verdict import (
    changed_categories,
    check_limits,
    check_values,
    compare_baseline,
    compare_values,
    stale_findings,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TEST = "tests/test_train.py::test_step"


def breakdown(**values: int) -> dict[str, int]:
    return {category: values.get(category, 0) for category in CATEGORIES}


def measurement(
    *, name: str = "call", start: int = 0, peak: int, allocated: int = 0, reserved: int | None = None, **kw: object
) -> Measurement:
    engine = "cuda" if reserved is not None else "cpu"
    return Measurement(
        name=name,
        engine=engine,
        device="cuda:0" if engine == "cuda" else "cpu",
        start=start,
        peak=peak,
        allocated=allocated,
        reserved=reserved,
        start_reserved=None if reserved is None else 0,
        **kw,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- tolerance


@pytest.mark.parametrize(
    ("text", "relative", "absolute"),
    [
        ("2%", 0.02, 0),
        ("0.5%", 0.005, 0),
        ("1MiB", 0.0, MiB),
        ("1MB", 0.0, MiB),  # 1024-based, like every size in pytest-gpumem
        ("512", 0.0, 512),
        ("2%,1MiB", 0.02, MiB),
        ("1MiB,2%", 0.02, MiB),
        (" 2 % ,  1 MiB ", 0.02, MiB),
        ("0", 0.0, 0),
        ("0%", 0.0, 0),
        ("100%", 1.0, 0),
    ],
)
def test_parse_tolerance(text: str, relative: float, absolute: int) -> None:
    assert parse_tolerance(text) == Tolerance(relative=relative, absolute=absolute)


@pytest.mark.parametrize(
    "text",
    ["", "  ", "2", "%", "2%%", "-2%", "+2%", "2%,3%", "1MiB,2MiB", "abc", "2%,", ",1MiB", "nan%", "inf%", "1.5",
     "2% 1MiB", "-1MiB", "1XB"],
)  # fmt: skip
def test_parse_tolerance_rejects_bad_text_naming_it(text: str) -> None:
    if text == "2":  # a plain number is a byte count: valid
        assert parse_tolerance(text) == Tolerance(absolute=2)
        return
    with pytest.raises(ValueError, match="invalid tolerance") as info:
        parse_tolerance(text)
    assert repr(text) in str(info.value)


def test_parse_tolerance_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match=r"invalid tolerance 0\.02"):
        parse_tolerance(0.02)  # type: ignore[arg-type]


@pytest.mark.parametrize(("relative", "absolute"), [(-0.01, 0), (math.inf, 0), (math.nan, 0), (0.0, -1)])
def test_tolerance_rejects_negative_or_non_finite(relative: float, absolute: int) -> None:
    with pytest.raises(ValueError, match="invalid tolerance"):
        Tolerance(relative=relative, absolute=absolute)


def test_allowed_is_the_larger_of_percent_and_floor() -> None:
    tolerance = parse_tolerance("2%,1MiB")
    assert tolerance.allowed(10 * MiB) == MiB  # 2% = 0.2 MiB: the floor wins
    assert tolerance.allowed(100 * MiB) == 2 * MiB  # 2% = 2 MiB: the percentage wins
    assert tolerance.allowed(-100 * MiB) == 2 * MiB  # of |baseline|
    assert tolerance.allowed(0) == MiB
    assert parse_tolerance("2%").allowed(0) == 0
    assert parse_tolerance("0").allowed(GiB) == 0


def test_allowed_uses_the_decimal_percentage_not_the_float() -> None:
    # 0.29 * 100 is 28.999999999999996 in floats; 29% of 100 bytes is 29 bytes
    assert Tolerance(relative=0.29).allowed(100) == 29
    assert parse_tolerance("7%").allowed(100) == 7


@given(
    st.integers(min_value=0, max_value=10_000).map(lambda n: n / 100),
    st.integers(min_value=0, max_value=1 << 40),
    st.integers(min_value=-(1 << 50), max_value=1 << 50),
)
def test_allowed_matches_exact_arithmetic(percent: float, absolute: int, baseline: int) -> None:
    tolerance = parse_tolerance(f"{percent}%,{absolute}")
    exact = Fraction(str(percent)) / 100 * abs(baseline)
    assert tolerance.allowed(baseline) == max(math.floor(exact), absolute)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("2%", "2%"),
        ("0.5%", "0.5%"),
        ("1MiB", "1.00 MiB"),
        ("2%,1MiB", "2% or 1.00 MiB, whichever is larger"),
        ("0", "0 (exact)"),
    ],
)
def test_tolerance_describe(text: str, shown: str) -> None:
    assert parse_tolerance(text).describe() == shown
    assert str(parse_tolerance(text)) == shown


# --------------------------------------------------------------------------- limits


def test_limit_exceeded_and_ok() -> None:
    m = measurement(peak=5 * GiB, allocated=GiB)
    peak_limit = Limit("peak", 4 * GiB, "4GB")
    allocated_limit = Limit("allocated", 4 * GiB, "4GiB")
    exceeded, ok = check_limits(TEST, m, [peak_limit, allocated_limit])
    assert exceeded == Finding(TEST, "call", "peak", "limit", "exceeded", 5 * GiB, 4 * GiB, detail="4GB")
    assert exceeded.failed and exceeded.delta == GiB and exceeded.delta_pct == 25.0
    assert ok.status == "ok" and not ok.failed


def test_limit_at_exactly_the_value_passes() -> None:
    (finding,) = check_limits(TEST, measurement(peak=4 * GiB), [Limit("peak", 4 * GiB, "4GiB")])
    assert finding.status == "ok"


def test_limits_compare_costs() -> None:
    # start 3 GiB + cost 2 GiB: the absolute peak (5 GiB) is over 4 GiB, its cost (2 GiB) is not
    (finding,) = check_limits(TEST, measurement(start=3 * GiB, peak=5 * GiB), [Limit("peak", 4 * GiB, "4GiB")])
    assert finding.status == "ok" and finding.measured == 2 * GiB
    (finding,) = check_limits(TEST, measurement(start=3 * GiB, peak=5 * GiB), [Limit("peak", GiB, "1GiB")])
    assert finding.status == "exceeded" and finding.measured == 2 * GiB
    assert failure_message([finding]) == "peak cost 2.00 GiB exceeds the limit 1.00 GiB (1GiB) by +1.00 GiB (+100.0%)"
    m = dataclasses.replace(measurement(peak=GiB, reserved=3 * GiB), start_reserved=GiB)
    (finding,) = check_limits(TEST, m, [Limit("reserved", GiB, "1GiB")])
    assert finding.measured == 2 * GiB and finding.status == "exceeded"


def test_limit_on_unknowable_figure_is_na_and_fails() -> None:
    m = measurement(peak=MiB)  # cpu engine: reserved is None
    (finding,) = check_limits(TEST, m, [Limit("reserved", GiB, "1GiB")])
    assert finding.status == "n/a" and finding.failed
    assert finding.measured is None and finding.reference == GiB
    assert "cpu engine" in finding.detail
    assert failure_message([finding]) == (
        "reserved is n/a (the cpu engine has no caching allocator), so the limit 1.00 GiB cannot be checked: "
        "remove it where this figure cannot be measured"
    )


def test_retained_limit_on_named_span_is_na() -> None:
    (finding,) = check_limits(TEST, measurement(name="step", peak=MiB), [Limit("retained", 0, "0")])
    assert finding.status == "n/a" and finding.failed
    assert "whole test call" in finding.detail


def test_limit_on_retained_of_call() -> None:
    m = measurement(peak=MiB, retained=4 * KiB)
    (finding,) = check_limits(TEST, m, [Limit("retained", 0, "0B")])
    assert finding.status == "exceeded"
    assert failure_message([finding]) == "retained 4.00 KiB exceeds the limit 0 B (0B) by +4.00 KiB (n/a)"


def test_budget_finding_has_ratio_and_expression() -> None:
    m = measurement(peak=20 * MiB, allocated=17 * MiB)
    (finding,) = check_limits(TEST, m, [Limit("allocated", 16 * MiB, "16Ψ", kind="budget")])
    assert finding.kind == "budget" and finding.status == "exceeded"
    assert finding.ratio == pytest.approx(17 / 16)
    assert failure_message([finding]) == (
        "allocated cost 17.00 MiB exceeds the budget 16.00 MiB (16Ψ) by +1.00 MiB (+6.2%), 1.06x the theory"
    )


def test_limit_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="invalid limit kind 'baseline'"):
        Limit("peak", 1, "1", kind="baseline")


def test_check_values_for_a_later_metric_where_higher_is_better() -> None:
    limit = Limit("max_microbatch", 8, "8")
    (low,) = check_values(TEST, "call", {"max_microbatch": 4}, [limit])
    (high,) = check_values(TEST, "call", {"max_microbatch": 16}, [limit])
    (missing,) = check_values(TEST, "call", {}, [limit])
    assert (low.status, high.status, missing.status) == ("exceeded", "ok", "n/a")
    assert failure_message([low]) == "max_microbatch 4 is below the minimum limit 8 (8) by -4 (-50.0%)"
    assert "no figure named 'max_microbatch'" in missing.detail


def test_named_span_is_shown_in_messages() -> None:
    (finding,) = check_limits(TEST, measurement(name="step", peak=2 * MiB), [Limit("peak", MiB, "1MiB")])
    assert failure_message([finding]).startswith("[step] peak cost 2.00 MiB exceeds the limit 1.00 MiB (1MiB)")


# --------------------------------------------------------------------------- baselines


def entry(peak: int, allocated: int = 0, reserved: int | None = None, **kw: object) -> BaselineEntry:
    return BaselineEntry({"peak": peak, "allocated": allocated, "reserved": reserved}, **kw)  # type: ignore[arg-type]


TOL = parse_tolerance("2%,1MiB")


def by_metric(findings: list[Finding]) -> dict[str, Finding]:
    return {f.metric: f for f in findings}


def test_baseline_regressed_improved_ok() -> None:
    m = measurement(start=GiB, peak=GiB + 100 * MiB, allocated=GiB + 10 * MiB)  # costs: 100 MiB, 10 MiB
    findings = by_metric(compare_baseline(TEST, m, entry(peak=90 * MiB, allocated=10 * MiB + 512 * KiB), TOL))
    assert set(findings) == {"peak", "allocated"}  # reserved unknown on both sides: no finding
    peak, allocated = findings["peak"], findings["allocated"]
    assert peak.status == "regressed" and peak.measured == 100 * MiB and peak.reference == 90 * MiB
    assert peak.tolerance == TOL and peak.failed
    assert allocated.status == "ok" and not allocated.failed
    (improved,) = compare_baseline(TEST, m, entry(peak=200 * MiB), TOL, metrics=["peak"])
    assert improved.status == "improved" and not improved.failed


def test_baseline_boundaries_are_inclusive() -> None:
    tolerance = Tolerance(absolute=MiB)
    base = entry(peak=10 * MiB)
    at_edge = compare_baseline(TEST, measurement(peak=11 * MiB), base, tolerance, metrics=["peak"])
    over = compare_baseline(TEST, measurement(peak=11 * MiB + 1), base, tolerance, metrics=["peak"])
    low_edge = compare_baseline(TEST, measurement(peak=9 * MiB), base, tolerance, metrics=["peak"])
    under = compare_baseline(TEST, measurement(peak=9 * MiB - 1), base, tolerance, metrics=["peak"])
    assert [f[0].status for f in (at_edge, over, low_edge, under)] == ["ok", "regressed", "ok", "improved"]


def test_baselines_compare_costs_not_absolute_figures() -> None:
    # the same step after a 3 GiB session fixture: start moved, cost did not
    m = measurement(start=3 * GiB, peak=3 * GiB + 10 * MiB, allocated=3 * GiB)
    findings = compare_baseline(TEST, m, entry(peak=10 * MiB, allocated=0), Tolerance())
    assert [f.status for f in findings] == ["ok", "ok"]


def test_reserved_cost_is_compared_when_known() -> None:
    m = measurement(peak=10 * MiB, allocated=0, reserved=40 * MiB)
    findings = by_metric(compare_baseline(TEST, m, entry(peak=10 * MiB, reserved=20 * MiB), TOL))
    assert findings["reserved"].status == "regressed"
    assert findings["reserved"].measured == 40 * MiB


def test_baseline_figure_unknown_in_this_run_is_na_and_passes() -> None:
    m = measurement(peak=10 * MiB)  # cpu: reserved unknown
    findings = by_metric(compare_baseline(TEST, m, entry(peak=10 * MiB, reserved=20 * MiB), TOL, strict=True))
    assert findings["reserved"].status == "n/a" and not findings["reserved"].failed


def test_new_and_other_environment() -> None:
    m = measurement(peak=10 * MiB, allocated=MiB)
    new = compare_baseline(TEST, m, None, TOL)
    assert [(f.metric, f.status, f.measured, f.reference) for f in new] == [
        ("peak", "new", 10 * MiB, None),
        ("allocated", "new", MiB, None),
    ]
    assert not any(f.failed for f in new)
    other = compare_baseline(TEST, m, None, TOL, other_environments=["cuda | A100", "cpu | torch 2.4"])
    assert {f.status for f in other} == {"other-environment"}
    assert other[0].detail == "baselines only for: cuda | A100; cpu | torch 2.4"
    strict = compare_baseline(TEST, m, None, TOL, other_environments=["cuda | A100"], strict=True)
    assert all(f.failed for f in strict)
    assert failure_message(strict).splitlines()[0] == (
        "peak cost 10.00 MiB has no baseline in this environment (baselines only for: cuda | A100); "
        "record one with --gpumem-update-baselines"
    )


def test_metric_missing_from_entry_is_new() -> None:
    m = measurement(peak=10 * MiB, allocated=MiB)
    findings = by_metric(compare_baseline(TEST, m, BaselineEntry({"peak": 10 * MiB}), TOL))
    assert findings["allocated"].status == "new" and findings["allocated"].detail == "no baseline figure"
    assert findings["peak"].status == "ok"


def test_strict_fails_improved_and_new() -> None:
    m = measurement(peak=10 * MiB)
    (improved,) = compare_baseline(TEST, m, entry(peak=100 * MiB), TOL, strict=True, metrics=["peak"])
    (new,) = compare_baseline(TEST, m, None, TOL, strict=True, metrics=["peak"])
    (ok,) = compare_baseline(TEST, m, entry(peak=10 * MiB), TOL, strict=True, metrics=["peak"])
    assert improved.failed and new.failed and not ok.failed
    assert failure_message([improved]) == (
        "peak cost 10.00 MiB improved on baseline 100.00 MiB by -90.00 MiB (-90.0%), "
        "tolerance 2% or 1.00 MiB, whichever is larger (±2.00 MiB); refresh it with --gpumem-update-baselines"
    )


def test_a_peak_regression_names_every_category_that_changed_and_they_add_up() -> None:
    before = breakdown(parameters=4 * MiB, gradients=0, activations=2 * MiB, temporaries=MiB)
    after = breakdown(parameters=4 * MiB, gradients=4 * MiB, activations=3 * MiB, temporaries=0)
    m = measurement(peak=sum(after.values()), allocated=20 * MiB, breakdown=after)
    base = entry(peak=sum(before.values()), allocated=10 * MiB, breakdown=before)
    findings = by_metric(compare_baseline(TEST, m, base, TOL))
    peak = findings["peak"]
    assert peak.status == "regressed"
    assert list(peak.changed.items()) == [("gradients", 4 * MiB), ("activations", MiB), ("temporaries", -MiB)]
    assert sum(peak.changed.values()) == peak.delta
    assert failure_message([peak]) == (
        "peak cost 11.00 MiB regressed from baseline 7.00 MiB by +4.00 MiB (+57.1%), "
        "tolerance 2% or 1.00 MiB, whichever is larger (±1.00 MiB); "
        "by category at the peak: gradients +4.00 MiB, activations +1.00 MiB, temporaries -1.00 MiB"
    )
    # the breakdown is the peak's: it does not explain what stayed allocated at the end
    assert findings["allocated"].status == "regressed" and findings["allocated"].changed == {}


def test_gradient_checkpointing_disabled_names_the_shrunk_temporaries_too() -> None:
    """Activations +9.32 MiB, temporaries -4.29 MiB: the peak grew by their sum, +5.03 MiB."""
    before = breakdown(parameters=8 * MiB, activations=2 * MiB, temporaries=6 * MiB)
    after = breakdown(parameters=8 * MiB, activations=2 * MiB + 9_772_728, temporaries=6 * MiB - 4_498_391)
    m = measurement(peak=sum(after.values()), breakdown=after)
    (peak,) = compare_baseline(TEST, m, entry(peak=sum(before.values()), breakdown=before), TOL, metrics=["peak"])
    assert peak.delta == 9_772_728 - 4_498_391
    assert failure_message([peak]).endswith("by category at the peak: activations +9.32 MiB, temporaries -4.29 MiB")


def test_a_moved_start_is_said_when_the_categories_do_not_add_up_to_the_cost() -> None:
    before = breakdown(parameters=4 * MiB, activations=2 * MiB)
    after = breakdown(parameters=5 * MiB, activations=4 * MiB)  # 1 MiB more parameters were there at the start
    m = measurement(start=MiB, peak=sum(after.values()), breakdown=after)
    (peak,) = compare_baseline(TEST, m, entry(peak=sum(before.values()), breakdown=before), TOL, metrics=["peak"])
    assert peak.delta == 2 * MiB
    assert failure_message([peak]).endswith(
        "by category at the peak: activations +2.00 MiB, parameters +1.00 MiB (the span's start moved by +1.00 MiB)"
    )


def test_no_categories_without_both_breakdowns() -> None:
    m = measurement(peak=20 * MiB, breakdown=breakdown(gradients=20 * MiB))
    (finding,) = compare_baseline(TEST, m, entry(peak=MiB), TOL, metrics=["peak"])
    assert finding.status == "regressed" and finding.changed == {}
    assert "category" not in failure_message([finding])


def test_changed_categories_order_and_unknown_categories() -> None:
    changed = changed_categories(
        {"gradients": 1, "zeta": 0, "activations": 7, "temporaries": 3},
        {"parameters": 5, "gradients": 6, "other": 5, "zeta": 9, "activations": 4, "temporaries": 0},
    )
    # grown largest first (ties keep CATEGORIES order; unknown categories after), then shrunk
    assert list(changed.items()) == [
        ("zeta", 9),
        ("parameters", 5),
        ("gradients", 5),
        ("other", 5),
        ("activations", -3),
        ("temporaries", -3),
    ]


def test_per_metric_tolerance() -> None:
    m = measurement(peak=15 * MiB, allocated=15 * MiB)
    findings = by_metric(
        compare_baseline(TEST, m, entry(peak=10 * MiB, allocated=10 * MiB), {"peak": parse_tolerance("50%")})
    )
    assert findings["peak"].status == "ok"
    assert findings["allocated"].status == "regressed"  # no tolerance given: exact
    assert findings["allocated"].tolerance == Tolerance()


def test_later_metric_where_dropping_is_a_regression() -> None:
    base = BaselineEntry({"max_microbatch": 16})
    (dropped,) = compare_values(TEST, "call", {"max_microbatch": 8}, base, Tolerance(absolute=2))
    (rose,) = compare_values(TEST, "call", {"max_microbatch": 32}, base, Tolerance(absolute=2))
    (same,) = compare_values(TEST, "call", {"max_microbatch": 15}, base, Tolerance(absolute=2))
    assert (dropped.status, rose.status, same.status) == ("regressed", "improved", "ok")
    assert failure_message([dropped]) == (
        "max_microbatch 8 regressed from baseline 16 by -8 (-50.0%), tolerance 2 (±2)"
    )
    assert metric_info("max_microbatch").higher_is_better
    assert not metric_info("some_future_bytes").higher_is_better


# --------------------------------------------------------------------------- findings and messages


def test_finding_properties() -> None:
    f = Finding(TEST, "call", "peak", "baseline", "regressed", measured=150, reference=100)
    assert (f.delta, f.delta_pct, f.ratio) == (50, 50.0, 1.5)
    unknown = Finding(TEST, "call", "peak", "baseline", "new", measured=150)
    assert (unknown.delta, unknown.delta_pct, unknown.ratio) == (None, None, None)
    zero = Finding(TEST, "call", "peak", "limit", "exceeded", measured=1, reference=0)
    assert (zero.delta, zero.delta_pct, zero.ratio) == (1, None, None)


@pytest.mark.parametrize(
    ("kind", "status", "lenient", "strict"),
    [
        ("limit", "ok", False, False),
        ("limit", "exceeded", True, True),
        ("budget", "exceeded", True, True),
        ("limit", "n/a", True, True),
        ("budget", "n/a", True, True),
        ("baseline", "n/a", False, False),
        ("baseline", "ok", False, False),
        ("baseline", "regressed", True, True),
        ("baseline", "improved", False, True),
        ("baseline", "new", False, True),
        ("baseline", "other-environment", False, True),
        ("baseline", "stale", False, True),
    ],
)
def test_failed(kind: str, status: str, lenient: bool, strict: bool) -> None:
    assert Finding(TEST, "call", "peak", kind, status).failed is lenient  # type: ignore[arg-type]
    assert Finding(TEST, "call", "peak", kind, status, strict=True).failed is strict  # type: ignore[arg-type]


def test_findings_are_hashable_and_frozen() -> None:
    args = (TEST, "call", "peak", "baseline", "regressed", 2, 1, TOL, {"gradients": 1}, "", False)
    one, two = Finding(*args), Finding(*args)  # type: ignore[arg-type]
    assert one == two and hash(one) == hash(two)
    with pytest.raises(AttributeError):
        one.status = "ok"  # type: ignore[misc]


def test_failure_message_lists_only_failures_in_order() -> None:
    m = measurement(peak=5 * GiB, allocated=GiB)
    limits = check_limits(TEST, m, [Limit("peak", 4 * GiB, "4GB"), Limit("allocated", 2 * GiB, "2GiB")])
    baseline = compare_baseline(TEST, m, entry(peak=3 * GiB, allocated=GiB), TOL)
    message = failure_message(limits + baseline)
    assert message.splitlines() == [
        "peak cost 5.00 GiB exceeds the limit 4.00 GiB (4GB) by +1.00 GiB (+25.0%)",
        "peak cost 5.00 GiB regressed from baseline 3.00 GiB by +2.00 GiB (+66.7%), "
        "tolerance 2% or 1.00 MiB, whichever is larger (±61.44 MiB)",
    ]
    assert failure_message(check_limits(TEST, m, [Limit("peak", 8 * GiB, "8GB")])) == ""


def test_stale_findings() -> None:
    stale = [StaleEntry("cpu | torch 2.13 | cuda_rounding off", "tests/test_gone.py::test_x", ("call", "step"))]
    (lenient,) = stale_findings(stale)
    (strict,) = stale_findings(stale, strict=True)
    assert lenient.status == "stale" and lenient.span == "*" and lenient.metric == "*"
    assert not lenient.failed and strict.failed
    assert failure_message([strict]) == (
        "stale baseline: tests/test_gone.py::test_x no longer exists; baselines kept for "
        "cpu | torch 2.13 | cuda_rounding off (spans: call, step); prune them"
    )


# --------------------------------------------------------------------------- which limits apply


def test_the_judge_decides_which_limits_apply_to_the_call() -> None:
    from pytest_gpumem.judge.judgement import judge, limits_of
    from pytest_gpumem.judge.limits import parse_limit
    from pytest_gpumem.judge.record import TestRecord

    call = measurement(peak=MiB, allocated=0, retained=0)
    step = measurement(name="step", peak=MiB)
    asked = {"call": [parse_limit("peak", "2MiB")]}
    record = TestRecord(TEST, [call, step], asked=asked, leak_check=True, min_microbatch=8)
    assert [(s.metric, s.text) for s in limits_of(record, "call")] == [
        ("peak", "2MiB"),
        ("retained", "0B (gpumem_leak_check)"),
        ("max_microbatch", "min_microbatch=8"),
    ]
    assert limits_of(record, "step") == []  # the run's and the marker's checks are the call's
    record = dataclasses.replace(
        record, asked={**record.asked, "call": [*record.asked["call"], parse_limit("retained", "1KiB")]}
    )  # the marker's bound wins over the run's 0
    assert [s.text for s in limits_of(record, "call") if s.metric == "retained"] == ["1KiB"]
    # with ranks measured, each rank's span asked for the marker's span limits: the call keeps the rest
    record = dataclasses.replace(record, ranks_measured=True)
    assert [s.metric for s in limits_of(record, "call")] == ["retained", "max_microbatch"]
    # under torchrun the call span is named for its rank: the first span is still the call
    renamed = TestRecord(TEST, [dataclasses.replace(call, name="call@rank1-of-2")], leak_check=True)
    assert [s.metric for s in limits_of(renamed, "call@rank1-of-2")] == ["retained"]
    assert [f.status for f in judge(renamed).findings] == ["ok"]


def test_the_leak_report_joins_a_failure_of_the_retained_check_only() -> None:
    from pytest_gpumem.judge.judgement import judge
    from pytest_gpumem.judge.limits import parse_limit
    from pytest_gpumem.judge.record import TestRecord

    def record(bound: str, retained: int) -> TestRecord:
        call = measurement(peak=MiB, retained=retained)
        return TestRecord(TEST, [call], asked={"call": [parse_limit("retained", bound)]}, leak_report="leaked: x")

    made = record("1KiB", 2 * KiB)
    leaked = judge(judge(made))  # judged again: the report once
    assert leaked.reports == ["leaked: x"] and leaked.failed
    assert made.reports == [] and made.findings == []  # the record judged is not changed
    within = judge(record("1KiB", KiB))
    assert within.reports == [] and not within.failed
    unknown = judge(record("16Ψ", 2 * KiB))  # Ψ unknown: an error, not a bound of 0
    assert unknown.reports == [] and unknown.findings == [] and unknown.errors
