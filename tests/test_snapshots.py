"""Memory snapshots from every engine: the pickle PyTorch's memory_viz opens, read by its own functions."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

from tests.conftest import run

SUITE = """
import pytest, torch

def step():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

@pytest.mark.gpumem
def test_cpu():
    step()

@pytest.mark.gpumem(predict="h100")
def test_predicted():
    step()

@pytest.mark.gpumem(predict="h100", fake=True)
def test_fake():
    step()
"""


def _snapshots(pytester: pytest.Pytester) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    pytester.makepyfile(test_snapshot_steps=SUITE)
    result = run(
        pytester, "--gpumem-snapshot", "--gpumem-artifacts=art", "--gpumem-artifacts-all", "--gpumem-json=r.json"
    )
    result.assert_outcomes(passed=3)
    found = {}
    for path in (pytester.path / "art").glob("*.snapshot.pickle"):
        name = path.name.split("-")[0].removeprefix("test_snapshot_steps.py_")
        data = path.read_bytes()
        # nothing but builtins: the pickle opens where this package is not installed (memory_viz's page)
        assert not [op.name for op, _, _ in pickletools.genops(data) if "GLOBAL" in op.name or op.name == "REDUCE"]
        found[name] = pickle.loads(data)
    report = json.loads((pytester.path / "r.json").read_text())
    calls = {test["nodeid"].split("::")[1]: test["measurements"][0] for test in report["tests"]}
    return found, calls


def _trace_peak(snapshot: dict[str, Any]) -> int:
    """The highest bytes allocated during the trace, above what was allocated when it began."""
    current = peak = 0
    for entry in snapshot["device_traces"][0]:
        if entry["action"] == "alloc":
            current += entry["size"]
            peak = max(peak, current)
        elif entry["action"] == "free_completed":
            current -= entry["size"]
    return peak


def test_every_cpu_run_engine_writes_a_snapshot_that_memory_viz_reads(pytester: pytest.Pytester) -> None:
    snapshots, calls = _snapshots(pytester)
    assert sorted(snapshots) == ["test_cpu", "test_fake", "test_predicted"]
    for name, snapshot in snapshots.items():
        call = calls[name]
        # the trace's allocations and frees add up to the figures measured: exactly the call's peak cost
        assert _trace_peak(snapshot) == call["peak"] - call["start"], name
        actions = {entry["action"] for entry in snapshot["device_traces"][0]}
        assert {"alloc", "free_requested", "free_completed"} <= actions
        # memory_viz's own functions read it (they render without a GPU)
        assert "entries" in _memory_viz.trace(snapshot)
        assert "total_reserved" in _memory_viz.segsum(snapshot)  # asserts its segments add up
        flame = _memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)
        _memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)
        with contextlib.redirect_stdout(io.StringIO()):
            _memory_viz.compare([], snapshot["segments"], format_flamegraph=lambda lines: lines)
        assert "Active Memory Timeline" in _memory_viz.trace_plot(snapshot)
        assert "Allocator State History" in _memory_viz.segment_plot(snapshot)
        # each allocation has the Python stack that made it, innermost first, the test's line among them
        alloc = next(e for e in snapshot["device_traces"][0] if e["action"] == "alloc" and e["frames"])
        names = [(Path(f["filename"]).name, f["name"]) for f in alloc["frames"]]
        assert ("test_snapshot_steps.py", "step") in names and ("test_snapshot_steps.py", name) in names
        assert not any("pytest_gpumem" in f["filename"] for f in alloc["frames"])
        if name == "test_cpu":
            assert snapshot["segments"] == [] and flame == ""  # nothing is alive once the step is over
    # prediction: the predicted allocator's segments and blocks, its workspaces (made before the test) alive
    predicted = snapshots["test_predicted"]
    reserved = sum(segment["total_size"] for segment in predicted["segments"])
    allocated = sum(segment["allocated_size"] for segment in predicted["segments"])
    assert allocated == calls["test_predicted"]["allocated"]  # absolute, as the allocator's segments are
    assert reserved % (2 << 20) == 0 and reserved >= allocated
    for segment in predicted["segments"]:
        assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]
        offsets = [block["address"] - segment["address"] for block in segment["blocks"]]
        assert offsets == sorted(offsets) and offsets[0] == 0
    assert [s["total_size"] for s in snapshots["test_fake"]["segments"]] == [
        s["total_size"] for s in predicted["segments"]
    ]


def test_snapshot_of_storages_alive_at_the_end_names_their_category(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_kept="""
        import pytest, torch

        kept = []

        @pytest.mark.gpumem
        def test_keep(gpumem):
            model = torch.nn.Linear(128, 128)
            gpumem.track(model)
            kept.append(model)
            kept.append(torch.ones(1000))
        """
    )
    run(pytester, "--gpumem-snapshot", "--gpumem-artifacts=art", "--gpumem-artifacts-all").assert_outcomes(passed=1)
    (path,) = (pytester.path / "art").glob("*.snapshot.pickle")
    snapshot = pickle.loads(path.read_bytes())
    blocks = [block for segment in snapshot["segments"] for block in segment["blocks"]]
    sizes = sorted((block["size"], block.get("category")) for block in blocks)
    assert sizes == [(512, "parameters"), (4000, "temporaries"), (65536, "parameters")]
    assert "test_kept.py" in _memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)


def test_no_snapshot_is_recorded_unless_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_snapshot_steps=SUITE)
    run(pytester, "--gpumem-artifacts=art", "--gpumem-artifacts-all").assert_outcomes(passed=3)
    assert not list((pytester.path / "art").glob("*.pickle"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_leaves_a_users_history_recording_on(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import torch
        torch.cuda.memory._record_memory_history(max_entries=1000)
        def pytest_sessionfinish(session):
            session.config.history_on = torch._C._cuda_isHistoryEnabled()
            print("history on at the end:", session.config.history_on)
        """
    )
    pytester.makepyfile(
        test_gpu="""
        import pytest, torch
        @pytest.mark.gpumem
        def test_step():
            torch.ones(1000, device="cuda")
        """
    )
    result = run(pytester, "--gpumem-snapshot", "--gpumem-artifacts=art", "--gpumem-artifacts-all", "-s", device=None)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*history on at the end: True*"])
    assert list((pytester.path / "art").glob("*.snapshot.pickle"))


def test_the_trace_is_recorded_only_inside_the_block_and_the_observer_is_put_back(tmp_path: Path) -> None:
    from pytest_gpumem.measurement.engines.cpu import CpuEngine
    from pytest_gpumem.measurement.engines.predict import PredictEngine
    from pytest_gpumem.targets import target

    for engine in (CpuEngine(), PredictEngine(target("h100"))):
        before = engine.tracker.observer
        engine.clean()
        engine.start()
        try:
            torch.ones(250)  # made and freed before the block: not in the trace
            with engine.record_history(str(tmp_path / "s.pickle")) as path:
                assert engine.tracker.observer is not before
                x = torch.ones(1000)
                del x
            torch.ones(250)
        finally:
            engine.stop()
        assert engine.tracker.observer is before
        assert path == str(tmp_path / "s.pickle")
        snapshot = pickle.loads((tmp_path / "s.pickle").read_bytes())
        events = [(e["action"], e["size"]) for e in snapshot["device_traces"][0] if "segment" not in e["action"]]
        assert events == [("alloc", 4096 if engine.predicts else 4000)] + [
            (action, 4096 if engine.predicts else 4000) for action in ("free_requested", "free_completed")
        ]


@pytest.mark.slow
def test_a_snapshot_from_the_profilers_allocation_reports(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_snapshot_steps=SUITE)
    args = ("--gpumem-observe=allocations", "--gpumem-snapshot", "--gpumem-artifacts=art", "--gpumem-artifacts-all")
    run(pytester, *args, "--gpumem-json=r.json", "-k", "test_cpu").assert_outcomes(passed=1)
    (path,) = (pytester.path / "art").glob("*.snapshot.pickle")
    snapshot = pickle.loads(path.read_bytes())
    call = json.loads((pytester.path / "r.json").read_text())["tests"][0]["measurements"][0]
    assert _trace_peak(snapshot) == call["peak"] - call["start"]
    assert "total_reserved" in _memory_viz.segsum(snapshot)
    assert all(entry["frames"] == [] for entry in snapshot["device_traces"][0])  # read after the operators ran


def test_a_snapshot_that_cannot_be_written_is_a_warning_and_nothing_else(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_snapshot_steps=SUITE)
    from pytest_gpumem.report.artifacts import artifact_path

    blocked = artifact_path(pytester.path / "art", "test_snapshot_steps.py::test_cpu", ".snapshot.pickle")
    blocked.mkdir(parents=True)  # a folder at the snapshot's name
    result = run(pytester, "--gpumem-snapshot", "--gpumem-artifacts=art", "--gpumem-artifacts-all", "-k", "test_cpu")
    result.assert_outcomes(passed=1)
    text = " ".join(result.stdout.str().split())
    assert f"could not write the memory snapshot {blocked}" in text and "INTERNALERROR" not in text
    assert blocked.is_dir() and not [p for p in blocked.parent.iterdir() if p.name.endswith(".tmp")]
