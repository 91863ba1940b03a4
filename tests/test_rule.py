"""One rule per figure: the plugin's judge and ``python -m pytest_gpumem baselines diff
--fail-on-growth`` decide a figure against its baseline alike, for every figure a baseline
keeps, with and without a tolerance (the metric table is read here, so a new figure is
checked too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import H100_ENV
from pytest_gpumem.baselines import BaselineEntry, BaselineStore, save
from pytest_gpumem.cli import main
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Tolerance, parse_tolerance
from pytest_gpumem.data.metrics import METRIC_INFO, METRIC_TABLE
from pytest_gpumem.judge.judgement import baseline_metrics
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.rule import baseline_status, describe_default_tolerances, exceeds, tolerance_for
from pytest_gpumem.plugin.session import BaselineOptions, BaselineSession

MiB = 1 << 20

#: every figure a baseline keeps (always, or when measured)
KEPT = [info.name for info in METRIC_TABLE if info.baseline]


def measurement(metric: str, cost: int) -> Measurement:
    """A CUDA measurement whose ``metric`` costs ``cost`` (it starts from 0); its other figures are 0."""
    fields: dict[str, object] = {"name": "call", "engine": "cuda", "device": "cuda:0", "start": 0, "peak": 0}
    fields["allocated"] = 0
    fields[metric] = cost
    start = METRIC_INFO[metric].cost
    if start:
        fields[start] = 0
    return Measurement(**fields)  # type: ignore[arg-type]


def figures(metric: str) -> list[int]:
    """Values around a reference across the edges of every rule: a step, 2%, 1 MiB, 20 MiB, ×8 and ÷8."""
    reference = 64 if METRIC_INFO[metric].unit == "count" else 100 * MiB
    steps = [1, 2, reference // 50, reference // 50 + 1, MiB, MiB + 1, 2 * MiB + 1, 20 * MiB, 20 * MiB + 1]
    values = {reference, reference // 8, reference * 8}
    values |= {reference + step for step in steps} | {reference - step for step in steps if step <= reference}
    return [reference, *sorted(values - {reference})]


def baseline_file(path: Path, metric: str, values: dict[str, int]) -> Path:
    """A real baseline file with one test per value of ``metric`` (the test id names it)."""
    store = BaselineStore()
    for test, value in values.items():
        m = measurement(metric, value)
        store.record(H100_ENV, test, {"call": BaselineEntry.from_measurement(m, baseline_metrics(m))})
    path.unlink(missing_ok=True)  # a new file each time: save() refuses to overwrite one it did not load
    save(store, path)
    return path


@pytest.mark.parametrize("tolerance", [None, "2%,1MiB", "5%", "1MiB", "0"])
@pytest.mark.parametrize("metric", KEPT)
def test_the_command_line_and_the_plugin_give_the_same_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metric: str, tolerance: str | None
) -> None:
    reference, *others = figures(metric)
    tests = {f"t.py::test[{value}]": value for value in others}
    old = baseline_file(tmp_path / "old.json", metric, dict.fromkeys(tests, reference))
    new = baseline_file(tmp_path / "new.json", metric, tests)
    # the command line, as a review job runs it
    argv = ["baselines", "diff", str(old), str(new), "--fail-on-growth"]
    code = main(argv + ([] if tolerance is None else ["--tolerance", tolerance]))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    worse = {line.split(" [")[0].strip() for line in err.splitlines()[1:]}
    assert code == (1 if worse else 0), err
    # the plugin's judge, with the old file as the baselines and the run's --gpumem-tolerance
    session = BaselineSession(BaselineOptions(old, None if tolerance is None else parse_tolerance(tolerance)))
    regressed = set()
    for test, value in tests.items():
        record = TestRecord(test, [measurement(metric, value)], environment=H100_ENV.to_dict())
        findings = [f for f in session.judge(record) if f.metric == metric]
        assert [f.reference for f in findings] == [reference]
        if findings[0].status == "regressed":
            regressed.add(test)
    assert worse == regressed
    assert regressed and len(regressed) < len(tests)  # the values cross the rule's edge


def run_diff(tmp_path: Path, metric: str, old: int, new: int, *options: str) -> int:
    before = baseline_file(tmp_path / "old.json", metric, {"t.py::test": old})
    after = baseline_file(tmp_path / "new.json", metric, {"t.py::test": new})
    return main(["baselines", "diff", str(before), str(after), "--fail-on-growth", *options])


def test_a_size_in_the_tolerance_does_not_bound_a_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``max_microbatch`` falling from 64 to 8 got through ``--tolerance 2%,1MiB``: the 1 MiB
    was taken as 1,048,576 microbatches."""
    assert run_diff(tmp_path, "max_microbatch", 64, 8, "--tolerance", "2%,1MiB") == 1
    assert "max_microbatch: 64 -> 8 (tolerance 2%)" in capsys.readouterr().err
    assert run_diff(tmp_path, "max_microbatch", 64, 63, "--tolerance", "2%,1MiB") == 0  # 2% of 64 is 1


def test_reserved_is_compared_within_one_segment_without_a_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--tolerance`` a ``reserved`` growth of 1 MiB failed the review job, where the
    plugin lets a reserved cost move by one 20 MiB allocator segment."""
    assert run_diff(tmp_path, "reserved", 100 * MiB, 101 * MiB) == 0
    assert run_diff(tmp_path, "reserved", 100 * MiB, 120 * MiB + 1) == 1
    assert "reserved: 100.00 MiB -> 120.00 MiB (tolerance 2% or 20.00 MiB, whichever is larger)" in (
        capsys.readouterr().err
    )
    assert run_diff(tmp_path, "reserved", 100 * MiB, 101 * MiB, "--tolerance", "0") == 0  # the floor holds
    assert run_diff(tmp_path, "peak", 100 * MiB, 100 * MiB + 1) == 1  # peak: exact


def test_the_tolerance_of_each_figure() -> None:
    assert tolerance_for("peak", None) == tolerance_for("allocated", None) == Tolerance()
    assert tolerance_for("reserved", None) == Tolerance(0.02, 20 * MiB)
    assert tolerance_for("reserved", Tolerance(0.5, 0)) == Tolerance(0.5, 20 * MiB)
    assert tolerance_for("peak", Tolerance(0.02, MiB)) == Tolerance(0.02, MiB)
    assert tolerance_for("max_microbatch", Tolerance(0.02, MiB)) == Tolerance(0.02, 0)
    assert tolerance_for("max_microbatch", None) == Tolerance()
    assert tolerance_for("some_future_bytes", Tolerance(0, 5)) == Tolerance(0, 5)  # bytes, no floor
    assert describe_default_tolerances() == (
        "exact for peak, allocated and max_microbatch; 2% or 1.00 MiB for reserved; "
        "reserved never closer than 20.00 MiB"
    )


def test_which_way_is_worse() -> None:
    assert exceeds("peak", 11, 10) and not exceeds("peak", 10, 10)
    assert exceeds("max_microbatch", 7, 8) and not exceeds("max_microbatch", 9, 8)
    assert baseline_status("peak", 110, 100, Tolerance(0.1)) == "ok"
    assert baseline_status("peak", 111, 100, Tolerance(0.1)) == "regressed"
    assert baseline_status("peak", 89, 100, Tolerance(0.1)) == "improved"
    assert baseline_status("max_microbatch", 89, 100, Tolerance(0.1)) == "regressed"
    assert baseline_status("max_microbatch", 111, 100, Tolerance(0.1)) == "improved"
