"""``observe="allocations"``: the CPU engine's figures from the CPU allocator's reports to PyTorch's profiler.

On eager code the figures equal the storage tracker's, category by category, except for
allocations the dispatcher never shows as an operator's output (explained where they
occur). On ``torch.compile``'d code they are the compiled program's, and they equal the
running sum of PyTorch's own allocation events for that step.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from conftest import run
from pytest_gpumem import CompiledCodeNotMeasured, Measurement, device_limit, make_engine, measure
from pytest_gpumem.budgets.formulas import count_parameters
from pytest_gpumem.measurement.engines.allocations import AllocationTracker

pytestmark = pytest.mark.usefixtures("forget_compiled_code")


def _figures(m: Measurement) -> tuple[Any, ...]:
    phases = {name: (p.start, p.peak, p.end, p.count) for name, p in m.phases.items()}
    return (m.start, m.peak, m.allocated, m.breakdown, m.allocated_breakdown, m.saved_activations, phases, m.psi)


def _measure_step(observe: str, build: Callable[[], tuple[Any, Any, torch.Tensor]]) -> Measurement:
    # The figures count every live storage, garbage that waits for the collector too: an earlier
    # test's cycle, collected between the two engines' steps, would make their starts differ.
    gc.collect()
    torch.manual_seed(0)
    model, optimizer, x = build()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()

    step()  # warm-up: optimizer state
    with measure("step", device="cpu", observe=observe, track=(model, optimizer)) as span:
        step()
    return span.measurement


def _block(optimizer: type[torch.optim.Optimizer], **options: Any) -> Callable[[], tuple[Any, Any, torch.Tensor]]:
    def build() -> tuple[Any, Any, torch.Tensor]:
        model = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
        return model, optimizer(model.parameters(), **options), torch.randn(4, 64, 128)

    return build


def _mlp(optimizer: type[torch.optim.Optimizer], **options: Any) -> Callable[[], tuple[Any, Any, torch.Tensor]]:
    def build() -> tuple[Any, Any, torch.Tensor]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        return model, optimizer(model.parameters(), **options), torch.randn(32, 64)

    return build


#: Optimizers pass Python floats to operators: each becomes a 0-dim float64 tensor (8 B) before
#: dispatch, which aten::to copies to float32 (4 B); at the optimizer's peak one of each is alive.
#: The allocator reports them; the storage tracker, which sees operators' outputs, does not.
WRAPPED_SCALARS = 8 + 4


@pytest.mark.parametrize(
    "build",
    [
        _block(torch.optim.AdamW),
        _block(torch.optim.SGD, lr=0.1, momentum=0.9),
        _mlp(torch.optim.AdamW),
        _mlp(torch.optim.SGD, lr=0.1, momentum=0.9),
    ],
    ids=["transformer-block-adamw", "transformer-block-sgd", "mlp-adamw", "mlp-sgd"],
)
def test_eager_figures_equal_the_storage_trackers_but_for_python_numbers_wrapped_into_tensors(build: Any) -> None:
    operators = _measure_step("operators", build)
    allocations = _measure_step("allocations", build)
    assert operators.breakdown is not None and allocations.breakdown is not None
    at_peak = WRAPPED_SCALARS if operators.phases["optimizer"].peak == operators.peak else 0
    assert allocations.peak == operators.peak + at_peak
    assert allocations.breakdown == {**operators.breakdown, "temporaries": operators.breakdown["temporaries"] + at_peak}
    assert allocations.breakdown["activations"] > 0 or at_peak
    optimizer = operators.phases["optimizer"]
    expected_phases = {**operators.phases, "optimizer": replace(optimizer, peak=optimizer.peak + WRAPPED_SCALARS)}
    assert allocations.phases == expected_phases
    for figure in ("start", "allocated", "allocated_breakdown", "saved_activations", "psi"):
        assert getattr(allocations, figure) == getattr(operators, figure), figure


@pytest.mark.parametrize(
    "build",
    [_block(torch.optim.AdamW), _mlp(torch.optim.SGD, lr=0.1, momentum=0.9)],
    ids=["transformer-block-adamw", "mlp-sgd"],
)
def test_the_profiler_limited_to_user_scopes_gives_the_figures_of_every_scope(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profiler's sessions record memory events only (no operator events): the figures, the
    breakdown at the peak, the phases and the timeline are those of a profiler that records all."""

    def measured() -> tuple[dict[str, Any], Any]:
        gc.collect()
        torch.manual_seed(0)
        model, optimizer, x = build()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            optimizer.step()

        step()
        with measure("step", device="cpu", observe="allocations", track=(model, optimizer), timeline=True) as span:
            step()
        return span.measurement.to_dict(), None if span.timeline is None else span.timeline.to_dict(10_000)

    scoped, scoped_timeline = measured()
    monkeypatch.setattr(AllocationTracker, "user_scopes_only", False)
    every, every_timeline = measured()
    assert scoped == every
    assert scoped_timeline == every_timeline and scoped_timeline is not None


def test_model_states_after_an_fp32_adamw_step_are_16_psi_plus_the_step_counters() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 128)
    psi = count_parameters(model).trainable
    with measure("first step", device="cpu", observe="allocations", track=(model, optimizer)) as span:
        model(x).pow(2).mean().backward()
        optimizer.step()
    parts = span.allocated_breakdown
    assert parts is not None
    counters = 4 * len(list(model.parameters()))  # one float32 step counter per parameter tensor
    assert parts["parameters"] + parts["gradients"] + parts["optimizer_state"] == 16 * psi + counters
    assert parts["gradients"] == 4 * psi and parts["optimizer_state"] == 8 * psi + counters


def test_a_compiled_function_is_not_reported_as_run_eagerly() -> None:
    w = torch.randn(64, requires_grad=True)
    compiled = torch.compile(lambda x: (torch.sin(x * w) + torch.cos(x)).sum(), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledCodeNotMeasured)
        with measure("compiled", device="cpu", observe="allocations") as span:
            compiled(torch.randn(4, 64)).backward()
    assert span.cost("peak") > 0


def test_a_fake_tensor_alive_at_the_end_of_the_span_is_not_read() -> None:
    """torch.compile traces with fake tensors, and Inductor keeps some alive after compiling (in
    its graphs' metadata); the span's end must not read their data pointer: it means nothing,
    and torch warns "almost definitely a bug in your code" when it is read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with measure("traced", device="cpu", observe="allocations") as span:
            with FakeTensorMode():
                fake = torch.empty(1024)  # what a compile leaves alive
            real = torch.ones(256)
    assert [str(w.message) for w in seen if "FakeTensor" in str(w.message)] == []
    assert span.cost("allocated") == real.numel() * 4  # the fake tensor owns no memory
    del fake


def test_a_running_profiler_is_a_clear_error() -> None:
    expected = "observe='allocations' reads allocations through PyTorch's profiler"
    running = profile(activities=[ProfilerActivity.CPU])
    with running, pytest.raises(RuntimeError, match=expected), measure("step", device="cpu", observe="allocations"):
        pass


def test_a_profiler_started_inside_the_measurement_is_a_clear_error() -> None:
    expected = "the measured code stopped PyTorch's profiler"
    with pytest.raises(RuntimeError, match=expected), measure("step", device="cpu", observe="allocations"):
        with profile(activities=[ProfilerActivity.CPU]):
            torch.ones(100).sum()
        torch.ones(100)


def test_an_emulated_device_limit_needs_the_operator_tracker() -> None:
    engine = make_engine("cpu", observe="allocations")
    expected = "an emulated device limit needs observe='operators'"
    with pytest.raises(ValueError, match=expected), device_limit(engine, "1GiB"):
        pass


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_bad_observe_values_are_errors_naming_the_value(device: str) -> None:
    with pytest.raises(ValueError, match="observe='ops' is not a way of observing memory"):
        make_engine(device, observe="ops")


def test_allocations_on_a_cuda_device_are_refused_with_the_reason() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the refusal comes after the device is resolved")
    with pytest.raises(ValueError, match="implemented for the CPU engine"):
        make_engine("cuda", observe="allocations")


def test_the_marker_keyword_and_the_option_choose_the_observer(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch
from pytest_gpumem import measure

def _observed(gpumem):
    return type(gpumem.recorder.engine.tracker).__name__

@pytest.mark.gpumem(peak="1GiB", observe="allocations")
def test_marker(gpumem):
    assert _observed(gpumem) == "AllocationTracker"
    torch.ones(1024).sum()

@pytest.mark.gpumem(peak="1GiB")
def test_option(gpumem, request):
    expected = "AllocationTracker" if request.config.getoption("gpumem_observe") == "allocations" else "StorageTracker"
    assert _observed(gpumem) == expected
    torch.ones(1024).sum()
"""
    )
    run(pytester).assert_outcomes(passed=2)
    run(pytester, "--gpumem-observe=allocations").assert_outcomes(passed=2)
    bad = run(pytester, "--gpumem-observe=ops")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpumem-observe / ini gpumem_observe: observe='ops' is not a way of observing memory" in (
        bad.stderr.str() + bad.stdout.str()
    )


def test_a_bad_observe_marker_is_a_collection_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(observe="everything")
def test_bad():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*invalid gpumem marker on *::test_bad: observe='everything' is not a way*"])


# -- Inductor: what the compiled program allocates ------------------------------------------------

_HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None


def _raw_peak_and_end(step: Callable[[], None]) -> tuple[int, int]:
    """The running sum of the CPU allocation events PyTorch's profiler records for ``step``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    now = peak = 0
    for _, size in sorted(sizes):
        now += size
        peak = max(peak, now)
    return peak, now


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_COMPILER, reason="Inductor's CPU backend needs a C++ compiler")
def test_an_inductor_compiled_step_is_measured_as_compiled_and_stays_compiled_after_the_operator_tracker() -> None:
    """A chain of sin(x·w) + cos(x): eager autograd saves every intermediate for backward;
    Inductor's backward recomputes them from the inputs instead, so the compiled step's peak
    is a fraction of the eager one's (:func:`_inductor_step`).

    It runs in a process of its own: after a cold compile (an empty Inductor cache, as in a
    fresh virtualenv) Inductor keeps tensors it compiled with (290 MiB seen) alive in the
    process for good, past ``torch._dynamo.reset()``, and every later test that reads the
    process's footprint (a device limit, a start figure) would count them."""
    root = Path(__file__).resolve().parents[1]
    code = "import sys; sys.path[:0] = ['tests', '.']; import test_allocations; test_allocations._inductor_step()"
    child = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout + child.stderr


def _inductor_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(1024, requires_grad=True)
    x = torch.randn(8, 64, 1024)

    def chain(inputs: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            inputs = torch.sin(inputs * w) + torch.cos(inputs)
        return inputs.sum()

    compiled = torch.compile(chain)

    def run_step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            w.grad = None
            fn(x).backward()

        return step

    run_step(compiled)()  # compiles (outside any measurement)

    def measured(fn: Callable[[torch.Tensor], torch.Tensor], observe: str) -> Measurement:
        step = run_step(fn)
        step()  # w.grad exists after a step: each measured step frees it first, as before
        with measure(observe, device="cpu", observe=observe) as span:
            step()
        return span.measurement

    eager = measured(chain, "allocations")
    compiled_figures = measured(compiled, "allocations")
    # PyTorch's own allocation events for the same compiled step (w.grad freed outside it)
    w.grad = None
    raw_peak, raw_end = _raw_peak_and_end(lambda: compiled(x).backward())
    w.grad = None
    assert compiled_figures.cost("peak") == raw_peak
    assert compiled_figures.cost("allocated") == raw_end == w.numel() * 4  # w.grad
    assert compiled_figures.cost("peak") < eager.cost("peak") / 4
    assert eager.cost("peak") == measured(chain, "operators").cost("peak")  # eager: both observers agree

    # Under the operator tracker TorchDynamo runs the compiled function eagerly (the span says so)
    # and would skip its code from then on; the tracker resets that when it stops, so the code
    # runs compiled again afterwards, as if it had never been measured.
    with pytest.warns(CompiledCodeNotMeasured, match="compiles that code again after the measurement"):
        under_operators = measured(compiled, "operators")
    assert under_operators.cost("peak") == eager.cost("peak")
    assert measured(compiled, "allocations").cost("peak") == compiled_figures.cost("peak")
    w.grad = None
    assert _raw_peak_and_end(lambda: compiled(x).backward()) == (raw_peak, raw_end)  # unmeasured: compiled too


@pytest.mark.slow
def test_a_session_observing_allocations_confirms_leaks_and_passes_clean_steps(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch

CACHE = []

@pytest.mark.gpumem(retained="0B")
def test_leaks():
    CACHE.append(torch.zeros(1000))  # 4,000 B kept by a module-level list

@pytest.mark.gpumem(retained="0B")
def test_clean(gpumem):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    step = gpumem.train_step(model, opt, (torch.randn(32, 64), torch.randn(32, 64)), torch.nn.functional.mse_loss)
    assert list(step.phases) == ["forward", "backward", "optimizer"]
    assert step.breakdown["gradients"] == 4 * gpumem.psi
"""
    )
    artifacts = pytester.path / "pages"
    result = run(pytester, "--gpumem-observe=allocations", f"--gpumem-artifacts={artifacts}", "--gpumem-artifacts-all")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "memory leak confirmed on cpu: 3.91 KiB (4000 B) retained" in text
    assert "CACHE[0]" in text  # the leaked tensor is named by what holds it
    pages = sorted(p for p in artifacts.glob("*.html") if p.name != "index.html")
    assert len(pages) == 2
    assert all("<svg" in page.read_text() for page in pages)  # the timeline, from the replayed events


@pytest.mark.slow
def test_a_device_limit_takes_the_operator_tracker_and_contradictions_are_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_limits="""
import pytest
import torch

def _observed(gpumem):
    return type(gpumem.recorder.engine.tracker).__name__

@pytest.mark.gpumem(device_limit="64MiB")
def test_limited(gpumem):
    assert _observed(gpumem) == "StorageTracker"  # the run's observe=allocations yields to the limit
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**27)  # 512 MiB: over the emulated 64 MiB

@pytest.mark.gpumem(peak="1GiB")
def test_unlimited(gpumem):
    assert _observed(gpumem) == "AllocationTracker"
""",
        test_contradiction="""
import pytest

@pytest.mark.gpumem(observe="allocations", device_limit="64MiB")
def test_both():
    pass
""",
    )
    result = run(pytester, "--gpumem-observe=allocations", "test_limits.py")
    result.assert_outcomes(passed=2)
    collected = run(pytester, "test_contradiction.py")
    collected.assert_outcomes(errors=1)
    collected.stdout.fnmatch_lines(
        [
            "*invalid gpumem marker on test_contradiction.py::test_both: observe='allocations' cannot run under "
            "device_limit='64MiB'*"
        ]
    )
    pytester.makepyfile(
        test_option="""
import pytest

@pytest.mark.gpumem(observe="allocations")
def test_observed():
    pass
"""
    )
    refused = run(pytester, "--gpumem-device-limit=1GiB", "test_option.py")
    refused.assert_outcomes(errors=1)
    refused.stdout.fnmatch_lines(
        ["*test_option.py::test_observed: observe='allocations' cannot run under --gpumem-device-limit=1073741824*"]
    )
