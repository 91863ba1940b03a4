"""Prediction mode: the CPU engine reporting what a target GPU's caching allocator would show.

The figures follow the allocator's rules byte for byte (the model's own tests are in
``test_predict_allocator.py``); ``test_predict_zoo.py`` compares whole training steps with
the figures recorded on an H100.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run

from pytest_gpumem import make_engine, measure
from pytest_gpumem.predict import target

MiB = 1 << 20
H100 = target("h100")
#: the workspaces warm before every start reading on the H100: cuBLAS's on the caller's thread
#: and on autograd's device thread, cuBLASLt's (Linear with a bias) on the caller's
WORKSPACES = 2 * 32 * MiB + MiB


def test_measure_predicts_blocks_segments_and_workspaces() -> None:
    with measure("odd", predict="h100") as span:
        big = torch.empty(11 * MiB + 1, dtype=torch.uint8)  # a 12 MiB segment, the block not split
        del big
    m = span.measurement
    assert m.start >= WORKSPACES
    assert (m.cost("peak"), m.cost("allocated")) == (12 * MiB, 0)
    assert m.cost("reserved") == 12 * MiB  # a freed block stays reserved


def test_the_cpu_engine_counts_the_same_storages_without_the_allocator() -> None:
    with measure("odd", device="cpu", cuda_rounding=True) as span:
        big = torch.empty(11 * MiB + 1, dtype=torch.uint8)
        del big
    assert span.measurement.cost("peak") == 11 * MiB + 512
    assert span.measurement.reserved is None


def test_workspaces_are_warm_before_the_start_reading_and_made_by_a_threads_first_matmul() -> None:
    engine = make_engine("cpu", predict="h100")
    engine.clean()
    assert engine.workspaces == WORKSPACES
    before = engine.allocated()
    engine.release_workspaces()
    assert engine.allocated() == before - WORKSPACES
    engine.start()
    try:
        weight = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(8, 64)
        after_randn = engine.allocated()
        out = x @ weight  # mm on this thread: cuBLAS's workspace, and the 2 KiB output
        assert engine.allocated() == after_randn + 32 * MiB + 2048
        out.sum().backward()  # mm in backward: the device thread's own workspace
        assert engine.allocated() >= after_randn + 2 * 32 * MiB
        layer = torch.nn.Linear(64, 64)
        with_lt = engine.allocated()
        y = layer(x)  # addmm with a bias vector: cuBLASLt's workspace, and the 2 KiB output
        assert engine.allocated() - with_lt == MiB + 2048
        del y
    finally:
        engine.stop()


def test_a_session_predicts_and_keys_its_baselines_by_the_target(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_odd="""
import pytest
import torch

@pytest.mark.gpumem(peak="1GiB")
def test_odd():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)
    del big
"""
    )
    result = run(pytester, "--gpumem-predict=H100", "--gpumem-update-baselines", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "environment: predict | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch *",
            "*library workspaces kept on the device: 65.00 MiB*",
            "*call  peak *12.00 MiB*",
            "*call  reserved *12.00 MiB*",
        ]
    )
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    (key,) = data["environments"]
    assert key.startswith("predict | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch ")
    call = data["environments"][key]["tests"]["test_odd.py::test_odd"]["spans"]["call"]
    assert (call["peak"], call["reserved"]) == (12 * MiB, 12 * MiB)
    # the CPU engine's figures go elsewhere and are never compared with the prediction
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    assert sorted(k.split(" | ")[0] for k in data["environments"]) == ["cpu", "predict"]


def test_the_marker_predicts_one_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marker="""
import pytest
import torch

@pytest.mark.gpumem(peak="11MiB", predict="h100")
def test_over():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)  # 12 MiB on the H100

@pytest.mark.gpumem(peak="11.5MiB")
def test_under():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)  # 11 MiB + 512 B on the CPU engine
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "peak cost 12.00 MiB exceeds the limit 11.00 MiB (11MiB) by +1.00 MiB (+9.1%)",
            "figures on cpu (predict engine)",
            "call  reserved   66.00 MiB  78.00 MiB   12.00 MiB",
            "FAILED test_marker.py::test_over - peak cost 12.00 MiB exceeds*",
        ]
    )


def test_bad_predictions_are_errors_naming_the_test_or_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(predict="a100")
def test_unknown():
    pass

@pytest.mark.gpumem(predict="h100", observe="allocations")
def test_both():
    pass

@pytest.mark.gpumem(peak="1GiB")
def test_fine():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)  # the module's collection error names both tests
    result.stdout.fnmatch_lines(
        [
            "invalid gpumem marker on *::test_unknown: predict='a100' is not a known GPU: use one of 'h100'",
            "invalid gpumem marker on *::test_both: observe='allocations' cannot predict='h100': *",
        ]
    )
    bad = run(pytester, "--gpumem-predict=mi300")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpumem-predict / ini gpumem_predict: predict='mi300' is not a known GPU" in (
        bad.stderr.str() + bad.stdout.str()
    )


def test_the_runs_observe_option_yields_to_a_prediction(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(peak="1GiB", predict="h100")
def test_predicted(gpumem):
    assert type(gpumem.recorder.engine).__name__ == "PredictEngine"

@pytest.mark.gpumem(peak="1GiB", observe="allocations")
def test_observed(gpumem):
    assert type(gpumem.recorder.engine.tracker).__name__ == "AllocationTracker"
"""
    )
    run(pytester, "--gpumem-observe=allocations").assert_outcomes(passed=2)
    result = run(pytester, "--gpumem-predict=h100")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_observed*observe='allocations' cannot predict='h100'*"])


def test_make_engine_names_what_cannot_be_predicted() -> None:
    with pytest.raises(ValueError, match=r"predict='h100' needs observe='operators', not 'allocations'"):
        make_engine("cpu", predict="h100", observe="allocations")
    with pytest.raises(ValueError, match=r"predict='a100' is not a known GPU"):
        make_engine("cpu", predict="a100")
