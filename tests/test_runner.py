"""One measured test without pytest: TestRun on the CPU engine with real torch steps."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import forget_last_failure
from pytest_gpumem.baselines import Environment
from pytest_gpumem.judge.judgement import judge
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement import gcfunctions
from pytest_gpumem.measurement.active import measure
from pytest_gpumem.measurement.engines import make_engine
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.plugin.marker import parse_marker
from pytest_gpumem.plugin.plan import PlanError, RunOptions, TestPlan, choose_device
from pytest_gpumem.plugin.run_engines import Engines, Freezer
from pytest_gpumem.plugin.runner import TestRun
from pytest_gpumem.report.details import failure_text

F32 = 4
ENV = Environment.detect("cpu").to_dict()


@pytest.fixture
def engine() -> Engine:
    forget_last_failure()
    return make_engine("cpu")


def run(engine: Engine, function: object, options: RunOptions | None = None, **marker: object) -> TestRecord:
    """One test run as the plugin runs it, then judged (no baseline file)."""
    spec = parse_marker([((), marker)])
    plan = TestPlan("tests/test_x.py::test_y", spec, options=options or RunOptions())
    record = TestRun(plan, engine, environment=ENV).run(function)  # type: ignore[arg-type]
    return judge(record)


def test_a_passing_test_gives_its_figures_and_checks_its_limits(engine: Engine) -> None:
    def body() -> None:
        kept = torch.ones(1024)  # 4 KiB alive as the test returns
        torch.ones(2048)  # 8 KiB freed at once
        assert kept.numel() == 1024

    record = run(engine, body, peak="16KiB", allocated="2KiB")
    call = record.measurements[0]
    assert record.passed and record.environment == ENV
    assert (call.cost("peak"), call.cost("allocated"), call.retained) == (12 * 1024, 4 * 1024, 0)
    assert [(f.metric, f.status) for f in record.findings] == [("peak", "ok"), ("allocated", "exceeded")]
    assert record.failed and not record.recordable
    assert "allocated" in failure_text(record) and "exceeds" in failure_text(record)


def test_a_failing_test_is_recorded_but_not_judged(engine: Engine) -> None:
    def body() -> None:
        raise ValueError("the test's own failure")

    record = run(engine, body, peak="1B")
    assert not record.passed and record.findings == [] and not record.failed


@pytest.mark.slow
def test_an_oom_under_the_device_limit_gets_a_report_and_is_released(engine: Engine) -> None:
    holder: list[torch.Tensor] = []

    def body() -> None:
        holder.append(torch.ones(1024))  # 4 KiB: fits
        torch.ones(1024 * 1024)  # 4 MiB: over the 64 KiB limit

    record = run(engine, body, device_limit="64KiB")
    assert not record.passed and record.device_limit == 64 * 1024
    (report,) = record.reports
    assert report.startswith("out of memory on cpu")
    assert "limit:     64.00 KiB (65536 B)" in report
    holder.clear()
    gc.collect()
    assert engine.memory_limit() is None  # the limit ends with the test


@pytest.mark.slow
def test_the_leak_check_names_what_a_test_left_behind(engine: Engine) -> None:
    cache: list[torch.Tensor] = []

    def body() -> None:
        cache.append(torch.ones(4096))

    record = run(engine, body, retained="0B")
    call = record.measurements[0]
    assert call.retained == 4096 * F32
    assert [(f.metric, f.status) for f in record.findings] == [("retained", "exceeded")]
    assert "memory leak confirmed on cpu: 16.00 KiB" in record.reports[0]
    cache.clear()


@pytest.mark.slow
def test_leak_check_option_applies_to_every_test(engine: Engine) -> None:
    cache: list[torch.Tensor] = []
    record = run(engine, lambda: cache.append(torch.ones(256)), RunOptions(leak_check=True))
    assert [(f.metric, f.detail, f.status) for f in record.findings] == [
        ("retained", "0B (gpumem_leak_check)", "exceeded")
    ]
    cache.clear()


@pytest.mark.slow
def test_a_retained_budget_without_its_psi_stays_an_error_with_no_leak_report(engine: Engine) -> None:
    """A retained budget that cannot be resolved is an error on the record, not a bound of 0:
    the leaked tensors are not reported as beyond a limit nobody could compute."""
    cache: list[torch.Tensor] = []
    record = run(engine, lambda: cache.append(torch.ones(4096)), RunOptions(leak_check=True), retained="16Ψ")
    assert record.measurements[0].retained == 4096 * F32  # the leak check ran and confirmed it
    assert record.errors == [
        "marker: retained='16Ψ': '16Ψ' uses Ψ but the number of trainable parameters is unknown "
        "(track the model with gpumem.track(model, optimizer))"
    ]
    assert record.findings == [] and record.reports == [] and record.failed
    assert record.leak_report is not None and "memory leak confirmed on cpu: 16.00 KiB" in record.leak_report
    cache.clear()


@pytest.mark.slow
def test_a_leak_within_the_retained_limit_gets_no_report(engine: Engine) -> None:
    cache: list[torch.Tensor] = []
    record = run(engine, lambda: cache.append(torch.ones(4096)), retained="16KiB")
    assert [(f.metric, f.status) for f in record.findings] == [("retained", "ok")]
    assert record.reports == [] and not record.failed
    cache.clear()


def test_the_record_says_what_was_asked_and_the_judge_decides(engine: Engine) -> None:
    """The run's leak check and the marker's min_microbatch travel as asked, not as limits
    made before the judge sees them."""
    record = run(engine, lambda: None, RunOptions(leak_check=True), peak="1MiB", min_microbatch=4)
    assert [spec.text for spec in record.asked["call"]] == ["1MiB"]
    assert (record.leak_check, record.min_microbatch) == (True, 4)
    assert [(f.metric, f.detail, f.status) for f in record.findings] == [
        ("peak", "1MiB", "ok"),
        ("retained", "0B (gpumem_leak_check)", "ok"),
        ("max_microbatch", "not known on the cpu engine", "n/a"),  # the test searched for none
    ]
    assert TestRecord.from_dict(record.to_dict()) == record


def test_spans_and_their_tolerances_travel_in_the_record(engine: Engine) -> None:
    def body() -> None:
        with measure("step", peak="1KiB", tolerance="5%"):
            torch.ones(1024)

    record = run(engine, body, tolerance="1MiB")
    assert [m.name for m in record.measurements] == ["call", "step"]
    assert record.tolerances == {
        "call": {"relative": 0.0, "absolute": 1048576},
        "step": {"relative": 0.05, "absolute": 0},
    }
    assert [(f.span, f.status) for f in record.findings] == [("step", "exceeded")]
    assert TestRecord.from_dict(record.to_dict()) == record


def test_a_psi_budget_without_tracking_is_an_error_on_the_record(engine: Engine) -> None:
    record = run(engine, lambda: None, allocated="16Ψ")
    assert record.errors == [
        "marker: allocated='16Ψ': '16Ψ' uses Ψ but the number of trainable parameters is unknown "
        "(track the model with gpumem.track(model, optimizer))"
    ]


def test_a_negative_budget_with_the_model_tracked_gives_no_tracking_hint(engine: Engine) -> None:
    model = torch.nn.Linear(4, 4)  # Ψ = 20

    def body() -> None:
        from pytest_gpumem.measurement.active import _ACTIVE

        recorder = _ACTIVE.get()
        assert recorder is not None
        recorder.track(model)

    record = run(engine, body, allocated="16Ψ - 1GB")
    assert record.errors == [
        "marker: allocated='16Ψ - 1GB': '16Ψ - 1GB' is negative (-1024.00 MiB with Ψ=20): "
        "a size or budget cannot be below 0 bytes"
    ]


def test_a_division_by_a_constant_zero_is_refused_with_the_marker() -> None:
    from pytest_gpumem.judge.limits import SpecError

    with pytest.raises(SpecError) as info:
        parse_marker([((), {"peak": "16Ψ/0"})])
    assert str(info.value) == "peak='16Ψ/0': '16Ψ/0': division by zero"


def test_choose_device() -> None:
    assert choose_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert choose_device("auto") == torch.device("cpu")
        with pytest.raises(PlanError) as skipped:
            choose_device("cuda:1")
        assert skipped.value.skip and "not available (0 CUDA devices visible)" in skipped.value.reason
        with pytest.raises(PlanError) as failed:
            choose_device("auto", require_gpu=True)
        assert not failed.value.skip


def test_engines_are_made_once_per_device() -> None:
    engines = Engines()
    cpu = engines.cpu()
    assert engines.get(torch.device("cpu"), breakdown=True) is cpu
    assert cpu.tracker is not None


@pytest.mark.usefixtures("nothing_frozen")
def test_the_freezer_keeps_older_objects_out_and_engines_still_see_frozen_tensors() -> None:
    before = torch.ones(1000)  # alive before the freeze
    freezer = Freezer()
    freezer.start()
    try:
        assert freezer.active and gcfunctions.get_freeze_count() > 0
        assert all(obj is not before for obj in gcfunctions.get_objects())  # frozen: out of the collector's sight
        engine = Engines(freezer=freezer).cpu()  # its first scan counts the remembered frozen tensors
        assert engine.tracker is not None and engine.tracker.category_of(before) == "other"
        assert all(obj is not before for obj in gcfunctions.get_objects())  # without unfreezing them
    finally:
        freezer.stop()
    assert gcfunctions.get_freeze_count() == 0  # the run's own frozen objects go back when it ends


@pytest.mark.usefixtures("nothing_frozen")
def test_the_freezer_leaves_objects_someone_else_froze_and_freezes_nothing_more() -> None:
    gc.freeze()  # as a conftest or an enclosing session would
    frozen_before = gcfunctions.get_freeze_count()
    made_after = torch.ones(10)
    freezer = Freezer()
    freezer.start()
    try:
        assert not freezer.active
        assert gcfunctions.get_freeze_count() <= frozen_before  # frozen objects may die; none are added
        assert any(obj is made_after for obj in gcfunctions.get_objects())
    finally:
        freezer.stop()
    assert gcfunctions.get_freeze_count() > 0  # someone else's frozen objects stay frozen
