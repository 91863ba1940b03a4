"""End to end: real pytest sessions (pytester) running real torch training steps on CPU."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from conftest import run, run_fresh
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

MLP = """
import pytest
import torch

def mlp(d=32, act=torch.nn.GELU, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), act(), torch.nn.Linear(4 * d, d)).to(dtype)
"""


@pytest.mark.slow
def test_limits_pass_and_fail_with_exact_message(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        MLP
        + """
@pytest.mark.gpumem(peak="1MiB", allocated=1048576)
def test_fits():
    x = torch.ones(1000)

@pytest.mark.gpumem(peak="100KB")
def test_too_big():
    x = torch.ones(100 * 1024 // 4 + 256)   # 100 KiB + 1 KiB
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    # cost 103424 bytes over a start of 0 bytes: exceeds 102400 by 1024 bytes (1.0%)
    result.stdout.fnmatch_lines(["*peak cost 101.00 KiB exceeds the limit 100.00 KiB (100KB) by +1.00 KiB (+1.0%)*"])
    result.stdout.fnmatch_lines(["*breakdown at peak*", "*parameters*gradients*optimizer_state*"])
    result.stdout.fnmatch_lines(["*= gpumem =*"])


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ('peak="4XB"', "peak='4XB'"),
        ('peak="-1GB"', "peak='-1GB'"),
        ('allocated="4GBxyz"', "allocated='4GBxyz'"),
        ('peak=""', "peak=''"),
        ("peak=1.5", "peak=1.5"),
        ('peek="4GB"', "unknown keyword 'peek'"),
        ('device="tpu"', "device='tpu'"),
        ('tolerance="abc"', "tolerance='abc'"),
        ("breakdown='yes'", "breakdown='yes'"),
        ('peak="16Ψ +"', "peak='16Ψ +'"),
    ],
)
def test_bad_marker_values_are_collection_errors(pytester: pytest.Pytester, keywords: str, words: str) -> None:
    pytester.makepyfile(
        f"""
import pytest

@pytest.mark.gpumem({keywords})
def test_marked():
    pass

def test_other():
    pass
"""
    )
    result = run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    text = result.stdout.str()
    assert "invalid gpumem marker on test_bad_marker_values_are_collection_errors.py::test_marked: " in text
    assert words in text
    result.stdout.fnmatch_lines(["ERROR *test_bad_marker_values_are_collection_errors.py - invalid gpumem marker*"])


@pytest.mark.slow
def test_bad_markers_under_xdist_are_the_same_collection_errors(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_unit="""
import pytest

@pytest.mark.gpumem(peak="4XB")
def test_bad_unit():
    pass

def test_other():
    pass
""",
        test_group="""
import pytest

class TestGroup:
    @pytest.mark.gpumem(device="tpu")
    def test_bad_device(self):
        pass
""",
    )
    with warm_workers(monkeypatch):
        result = run(pytester, "-n", "2")
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # xdist's exit status for collection errors
    assert "invalid gpumem marker on test_unit.py::test_bad_unit: peak='4XB'" in text
    assert "invalid gpumem marker on test_group.py::TestGroup::test_bad_device: device='tpu'" in text


def test_a_conftest_that_removes_the_marker_after_collection_leaves_the_test_unmeasured(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(
        """
def pytest_collection_modifyitems(items):
    for item in items:
        if item.name == "test_unmarked":
            item.own_markers[:] = [m for m in item.own_markers if m.name != "gpumem"]
"""
    )
    pytester.makepyfile(
        """
import pytest

import torch

@pytest.mark.gpumem(peak="1KiB")
def test_unmarked():
    assert torch.ones(2**20).sum() == 2**20  # 4 MiB: over its (removed) limit if it were measured

@pytest.mark.gpumem(peak="1GiB")
def test_measured():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=2)
    text = result.stdout.str()
    assert "test_measured" in text and "test_unmarked" not in text  # no row in the summary


def test_help_lists_every_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--help")
    assert result.ret == pytest.ExitCode.OK
    text = result.stdout.str()
    assert "GPU memory guards (pytest-gpumem)" in text
    assert (
        "(default: exact for peak, allocated and max_microbatch; 2% or 1.00 MiB for reserved; "
        "reserved never closer than 20.00 MiB)"
    ) in " ".join(text.split())
    for option in ("device", "update-baselines", "tolerance", "device-limit", "snapshot", "artifacts-all"):
        assert f"--gpumem-{option}" in text
    assert "gpumem_tolerance" in text  # the ini settings


def test_marker_is_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem
def test_plain():
    pass
"""
    )
    run(pytester, "--strict-markers").assert_outcomes(passed=1)
    result = pytester.runpytest_inprocess("--markers")
    result.stdout.fnmatch_lines(["*@pytest.mark.gpumem(peak=None, allocated=None, reserved=None, retained=None*"])


def test_train_step_figures_are_exact_on_cpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        MLP
        + """
def test_step(gpumem):
    model = mlp().to(gpumem.device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8, 32, device=gpumem.device)
    m = gpumem.train_step(model, opt, (x, torch.zeros(4, 8, 32)), torch.nn.functional.mse_loss)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert m.name == "step" and m.engine == "cpu" and m.device == "cpu"
    assert m.psi == n == gpumem.psi
    assert list(m.phases) == ["forward", "backward", "optimizer"]
    for phase in m.phases.values():
        assert phase.peak <= m.peak
    assert max(p.peak for p in m.phases.values()) == m.peak
    assert sum(m.breakdown.values()) == m.peak
    assert m.breakdown["parameters"] == 4 * n
    # Adam state: exp_avg + exp_avg_sq + one float32 step counter per tensor (CPU)
    assert m.breakdown["optimizer_state"] == 8 * n + 4 * len(params)
    # GELU MLP in fp32 saves 9 * 4 * b*s*d bytes; mse_loss saves its input and target too
    bsd = 4 * 8 * 32
    assert m.saved_activations == 36 * bsd + 2 * 4 * bsd
    # after the step: parameters, gradients and Adam state stay allocated, with the batch
    assert m.allocated == 16 * n + 4 * len(params) + 2 * 4 * bsd
    assert gpumem.spans == [m]
"""
    )
    run(pytester).assert_outcomes(passed=1)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_train_step_amp(pytester: pytest.Pytester, amp: str) -> None:
    pytester.makepyfile(
        MLP
        + f"""
def test_step(gpumem):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 32), torch.randn(4, 32))
    m = gpumem.train_step(model, opt, batch, lambda out, y: (out.float() - y).pow(2).mean(), amp="{amp}", warmup=2)
    assert set(m.phases) == {{"forward", "backward", "optimizer"}}
    n = sum(p.numel() for p in model.parameters())
    assert m.saved_activations > 0
    assert sum(m.breakdown.values()) == m.peak
    # at the peak (in backward) the first layer's gradients are not computed yet
    assert 0 < m.breakdown["gradients"] < 4 * n
    # steady state: the step leaves what it found (fp32 parameters and gradients)
    assert m.cost("allocated") == 0
    assert m.allocated >= 8 * n
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_train_step_rejects_bad_arguments(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        MLP
        + """
def test_amp(gpumem):
    model = mlp()
    with pytest.raises(ValueError, match="amp='fp8'"):
        gpumem.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 32), amp="fp8")

def test_not_a_loss(gpumem):
    model = mlp()
    with pytest.raises(ValueError, match="not a scalar loss"):
        gpumem.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 32))
"""
    )
    run(pytester).assert_outcomes(passed=2)


def test_train_step_usage_errors_show_the_test_not_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        MLP
        + """
def test_triple(gpumem):
    model = mlp()
    batch = (torch.randn(2, 32), torch.randn(2, 32), torch.randn(2, 32))
    gpumem.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, torch.nn.functional.mse_loss)

def test_not_a_model(gpumem):
    gpumem.train_step(torch.randn(3, 3), None, torch.randn(2, 32))
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    assert "batch must be an (inputs, target) pair, a tensor or a mapping; got a tuple of 3: " in text
    assert "(a float32 tensor of shape (2, 32), a float32 tensor of shape (2, 32), a float32 tensor" in text
    assert "expected a torch.nn.Module, got a float32 tensor of shape (3, 3)" in text
    assert "pytest_gpumem/" not in text and "fixture.py" not in text  # the plugin's frames are hidden
    assert "tensor([[" not in text  # no tensor is dumped


def test_train_step_with_an_unsupervised_loss(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        MLP
        + """
def test_step(gpumem):
    model = mlp()
    x = torch.randn(4, 32)
    m = gpumem.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, lambda out: out.pow(2).mean())
    assert list(m.phases) == ["forward", "backward", "optimizer"]
    m = gpumem.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), {"input": x}, lambda out: out.sum(),
                          name="mapping")
    assert m.saved_activations > 0
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_spans_with_their_own_limits(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import torch

def test_spans(gpumem):
    keep = torch.ones(1024)                       # 4 KiB alive before the spans
    with gpumem.measure("small", peak="8KiB") as small:
        a = torch.ones(512)                       # costs 2 KiB (peak 6 KiB with what was there)
    with gpumem.measure("big", peak="8KiB") as big:
        b = torch.ones(2304)                      # costs 9 KiB: over its limit
    assert small.cost("peak") == 2048 and small.peak == small.start + 2048
    assert big.cost("allocated") == 9216
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]big[]] peak cost 9.00 KiB exceeds the limit 8.00 KiB (8KiB) by +1.00 KiB*"])
    assert "small" not in "".join(line for line in result.outlines if "exceeds" in line)


def test_duplicate_span_name_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

def test_twice(gpumem):
    with gpumem.measure("step"):
        pass
    with pytest.raises(ValueError, match="span name 'step' is used twice"):
        gpumem.measure("step")
    with pytest.raises(Exception, match="unknown keyword 'pek'"):
        gpumem.measure("other", pek="1GB")
"""
    )
    run(pytester).assert_outcomes(passed=1)


@pytest.mark.slow
def test_allocated_is_read_as_the_test_returns(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(allocated="64KiB", retained="0B")
def test_keeps_a_local():
    big = torch.ones(32 * 1024)     # 128 KiB alive until the test returns
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*allocated cost 128.00 KiB exceeds the limit 64.00 KiB (64KiB) by +64.00 KiB (+100.0%)*"]
    )
    # the local dies with the frame: nothing retained
    assert not any("retained" in line and "exceeds" in line for line in result.outlines)


def test_the_return_watch_traces_no_call_of_the_test_body(pytester: pytest.Pytester) -> None:
    """Reading ``allocated`` as the test returns must not leave a tracer over the test's body:
    one asked at every Python call made each operator of a training step ~3 µs slower."""
    pytester.makepyfile(
        """
import sys, pytest, torch

def helper():
    return sys.gettrace()

@pytest.mark.gpumem(allocated="64KiB")
def test_untraced():
    x = torch.ones(256)
    assert sys.gettrace() is None and helper() is None
"""
    )
    run(pytester).assert_outcomes(passed=1)


@pytest.mark.slow
def test_measuring_does_not_import_torchdynamo(pytester: pytest.Pytester) -> None:
    """torch wraps a dispatch mode's handler in TorchDynamo's ``disable``, which imports TorchDynamo
    (0.8 s) at the first operator; the tracker's mode turns TorchDynamo's frame hook off itself."""
    pytester.makepyfile(
        """
import sys, pytest, torch

@pytest.mark.gpumem(peak="1MiB")
def test_step():
    model = torch.nn.Linear(16, 16)
    model(torch.randn(4, 16)).sum().backward()

def test_after():
    assert "torch._dynamo" not in sys.modules
"""
    )
    run_fresh(pytester, "-p", "no:randomly").assert_outcomes(passed=2)


@pytest.mark.slow
def test_retained_catches_a_leak(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

CACHE = []

@pytest.mark.gpumem(retained="0B")
def test_leaks():
    CACHE.append(torch.ones(256))

@pytest.mark.gpumem(retained="0B")
def test_clean():
    x = torch.ones(256)
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*retained 1.00 KiB exceeds the limit 0 B (0B) by +1.00 KiB*"])


def test_own_errors_are_kept_without_noise(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1KiB")
def test_raises():
    x = torch.ones(100_000)
    raise KeyError("the test's own error")
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(['*KeyError: "the test\'s own error"*'])
    assert not any("exceeds the limit" in line for line in result.outlines)


@pytest.mark.slow
def test_cuda_device_is_skipped_or_failed_without_a_gpu(pytester: pytest.Pytester) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(device="cuda", peak="1GB")
def test_on_gpu():
    raise AssertionError("must not run")

@pytest.mark.gpumem(peak="1GB")
def test_auto():
    pass
"""
    )
    result = run(pytester, "-rs", device=None)
    result.assert_outcomes(skipped=1, passed=1)
    result.stdout.fnmatch_lines(["*gpumem: device 'cuda' is not available (0 CUDA devices visible)*"])
    strict = run(pytester, "--gpumem-require-gpu", device=None)
    strict.assert_outcomes(errors=2)
    strict.stdout.fnmatch_lines(["*--gpumem-require-gpu*"])
    text = strict.stdout.str()
    assert "During handling of the above exception" not in text  # said once, not chained
    assert text.count("test_auto: --gpumem-require-gpu: no CUDA device is available") == 1


def test_psi_budget_without_tracking_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(allocated="16Ψ")
def test_untracked():
    x = torch.ones(10)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*allocated='16Ψ'*gpumem.track(model, optimizer)*"])


@pytest.mark.slow
def test_options_fall_back_to_ini(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem
def test_rounding(gpumem):
    with gpumem.measure("one") as span:
        x = torch.ones(1, dtype=torch.uint8)
    print("COST", span.cost("allocated"), gpumem.device)
"""
    )
    plain = run(pytester, "-s")
    plain.stdout.fnmatch_lines(["*COST 1 cpu"])
    pytester.makeini("[pytest]\ngpumem_cuda_rounding = true\ngpumem_device = cpu\n")
    rounded = run(pytester, "-s", device=None)
    rounded.stdout.fnmatch_lines(["*COST 512 cpu"])
    pytester.makeini("[pytest]\ngpumem_device = tpu\n")
    bad = run(pytester, device=None)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpumem-device / ini gpumem_device: device='tpu'" in bad.stderr.str()
    overridden = run(pytester, "--gpumem-device=cpu")
    overridden.assert_outcomes(passed=1)


@pytest.mark.slow
def test_junit_xml_shows_the_failure_and_the_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1KiB")
def test_big():
    x = torch.ones(1024)
"""
    )
    run(pytester, "--junitxml=out.xml")
    tree = ET.parse(pytester.path / "out.xml")
    case = tree.find(".//testcase")
    assert case is not None
    failure = case.find("failure")
    assert failure is not None
    assert "peak cost 4.00 KiB exceeds the limit 1.00 KiB" in (failure.text or "") + failure.get("message", "")
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["gpumem.peak"] == "4096"
    assert properties["gpumem.retained"] == "0"


@pytest.mark.slow
def test_quiet_summary_shows_only_problems(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1KiB")
def test_big():
    x = torch.ones(1024)

@pytest.mark.gpumem(peak="1MiB")
def test_small():
    x = torch.ones(4)
"""
    )
    quiet = run(pytester, "-q")
    summary = quiet.stdout.str().split("= gpumem =")[1]
    assert "test_big" in summary and "test_small" not in summary
    loud = run(pytester)
    summary = loud.stdout.str().split("= gpumem =")[1]
    assert "test_big" in summary and "test_small" in summary
    # problems first
    assert summary.index("test_big") < summary.index("test_small")


def test_class_marker_merges_with_function_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1KiB", allocated="1MiB")
class TestSuite:
    @pytest.mark.gpumem(peak="1MiB")
    def test_method(self):
        x = torch.ones(1024)
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_measure_outside_pytest_raises_on_a_broken_limit() -> None:
    torch = pytest.importorskip("torch")
    from pytest_gpumem import measure
    from pytest_gpumem.judge.limits import LimitExceeded

    with measure("ok", device="cpu", peak="1MiB") as span:
        x = torch.ones(10)
    assert span.cost("peak") == 40
    with pytest.raises(LimitExceeded, match=re.escape("peak")), measure("big", device="cpu", peak="1KiB"):
        y = torch.ones(1024)
    del x, y
