"""Emulated device limits, OOM reports and releasing a failed step: real torch training steps on the CPU engine."""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import run_fresh
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.diagnose.census import live_tensors
from pytest_gpumem.diagnose.oom import (
    OomReport,
    OomWatch,
    is_oom,
    oom_report,
    release_oom,
    requested_bytes,
)
from pytest_gpumem.measurement.devicelimit import device_limit
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.measurement.recorder import Recorder

D_IN, HIDDEN, D_OUT = 64, 256, 8
F32 = 4


def build() -> tuple[nn.Sequential, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int) -> None:
    """One step; gradients are set to None at the end so that every step costs the same."""
    x = torch.randn(batch, D_IN)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture
def engine(cpu_engine: Engine) -> Engine:
    return cpu_engine


@pytest.fixture
def recorder(engine: Engine) -> Iterator[Recorder]:
    recorder = Recorder(engine)
    recorder.begin()
    yield recorder
    recorder.end()


def tracker_of(engine: Engine) -> StorageTracker:
    assert engine.tracker is not None
    return engine.tracker


def step_peak(recorder: Recorder, model: nn.Module, opt: torch.optim.Optimizer, batch: int) -> tuple[int, str]:
    """Peak of one measured step and the first phase that reached it."""
    with recorder.span(f"probe{batch}") as span:
        train_step(model, opt, batch)
    phase = next(name for name, p in span.phases.items() if p.peak == span.peak)
    return span.peak, phase


# --------------------------------------------------------------------------- device_limit


def test_limit_at_the_peak_passes_one_byte_less_raises(recorder: Recorder, engine: Engine) -> None:
    model, opt = build()
    recorder.track(model, opt)
    train_step(model, opt, 4)  # warm-up: AdamW creates its state
    peak, _ = step_peak(recorder, model, opt, 128)
    tracker = tracker_of(engine)
    with device_limit(engine, peak) as limit:
        assert limit == peak
        assert tracker.limit == peak
        train_step(model, opt, 128)
    assert tracker.limit is None
    with pytest.raises(torch.OutOfMemoryError), device_limit(engine, peak - 1):
        train_step(model, opt, 128)
    assert tracker.limit is None  # restored after the error too


def test_device_limit_nests_restores_and_parses_sizes() -> None:
    tracker = StorageTracker(torch.device("cpu"))
    tracker.limit = 7
    with device_limit(tracker, "1KiB"):
        assert tracker.limit == 1024
        with device_limit(tracker, 10):
            assert tracker.limit == 10
        assert tracker.limit == 1024
    assert tracker.limit == 7
    with pytest.raises(ValueError), device_limit(tracker, "-1GB"):
        pass  # pragma: no cover
    assert tracker.limit == 7


def test_limit_raises_only_while_tracking(engine: Engine) -> None:
    engine.clean()
    tracker = tracker_of(engine)
    with device_limit(engine, 0):
        torch.zeros(1000)  # the tracker is stopped: it sees nothing
        tracker.start()
        try:
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(1000)
        finally:
            tracker.stop()


class Kernels(TorchDispatchMode):
    """A dispatch mode below the tracker's: the operators that reached their kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ran.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_an_allocation_over_the_limit_is_refused_before_its_kernel_runs(engine: Engine) -> None:
    """The host pays nothing for an allocation the emulated device refuses: a factory, and an
    operator whose output a meta kernel sizes (a product, a copy of an expanded view), are refused
    before their kernels run; ``torch.empty(2**40)`` is the emulated device's out-of-memory error,
    not the host allocator's."""
    tracker = tracker_of(engine)
    kernels = Kernels()
    column, row, small = torch.ones(2**13, 1), torch.ones(1, 2**13), torch.ones(2**13)
    refused = {
        "zeros": lambda: torch.zeros(2**26),  # 256 MiB
        "empty": lambda: torch.empty(2**40),  # 4 TiB: more than the host has
        "mm": lambda: column @ row,  # 256 MiB out of 64 KiB
        "clone": lambda: small.expand(2**13, 2**13).contiguous(),
    }
    with kernels:
        tracker.start(saved_tensors=False)
        try:
            with device_limit(engine, tracker.current + 2**20):
                for name, allocate in refused.items():
                    with pytest.raises(torch.OutOfMemoryError, match="over the emulated device limit"):
                        allocate()
                    assert name not in kernels.ran
                fits = torch.zeros(1024)  # what fits still runs
        finally:
            tracker.stop()
    assert "zeros" in kernels.ran and fits.numel() == 1024


# --------------------------------------------------------------------------- is_oom / requested_bytes


def test_is_oom() -> None:
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # not a RuntimeError
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator refuses a PiB
    except RuntimeError as exc:
        assert is_oom(exc)
    wrapped = ValueError("step failed")
    wrapped.__cause__ = torch.OutOfMemoryError("inner")
    assert is_oom(wrapped)
    handled = ValueError("while handling")
    handled.__context__ = torch.OutOfMemoryError("inner")
    assert not is_oom(handled)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity", (20 * 2**20, False)),
        ("Tried to allocate 1.50 GiB", (3 * 2**29, False)),
        ("Tried to allocate 512 bytes with 0 bytes allocated", (512, True)),
        ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 100 bytes.", (100, True)),
        ("Tried to allocate 2.50 KiB", (2560, False)),
        ("something else", None),
    ],
)
def test_requested_bytes(message: str, expected: tuple[int, bool] | None) -> None:
    assert requested_bytes(message) == expected


# --------------------------------------------------------------------------- the report


def adamw_state_bytes(model: nn.Module) -> int:
    params = list(model.parameters())
    return sum(2 * p.numel() * p.element_size() for p in params) + len(params) * F32  # exp_avg, exp_avg_sq, step


def test_report_at_the_failed_allocation(recorder: Recorder, engine: Engine) -> None:
    model, opt = build()
    recorder.track(model, opt)
    train_step(model, opt, 4)
    peak, peak_phase = step_peak(recorder, model, opt, 128)
    tracker = tracker_of(engine)
    seen: list[int] = []
    tracker.on_oom = seen.append  # a previous callback is kept and still called
    with OomWatch(engine, recorder, top=50) as watch, device_limit(engine, peak - 1):
        try:
            train_step(model, opt, 128)
        except torch.OutOfMemoryError as exc:
            report = watch.report_for(exc)
            release_oom(exc, engine)
        else:  # pragma: no cover
            pytest.fail("no OOM")
    assert tracker.on_oom == seen.append
    tracker.on_oom = None
    opt.zero_grad(set_to_none=True)

    assert isinstance(report, OomReport)
    assert report.when == "at the failed allocation"
    assert report.requested == seen[0]
    assert report.requested_exact
    assert report.limit == peak - 1
    assert report.allocated <= peak - 1 < report.allocated + report.requested
    assert report.allocated + report.requested == peak  # the first allocation over the limit reaches the peak
    assert report.phase == peak_phase
    assert report.reserved is None
    assert report.message.startswith("OutOfMemory: Tried to allocate")
    # the breakdown at that moment, to the byte
    assert report.breakdown is not None
    assert sum(report.breakdown.values()) == report.allocated
    param_bytes = sum(p.numel() * F32 for p in model.parameters())
    assert report.breakdown["parameters"] == param_bytes
    assert report.breakdown["optimizer_state"] == adamw_state_bytes(model)
    # every counted storage was found from Python, each counted once
    assert report.live_bytes == report.allocated
    assert report.unreachable == 0
    sizes = [t.nbytes for t in report.largest]
    assert sizes == sorted(sizes, reverse=True)
    by_name = {t.held_by: t for t in report.largest}
    weight = by_name["model.0.weight"]  # labelled by the local variable that holds the tracked module
    assert (weight.nbytes, weight.shape, weight.dtype, weight.category) == (
        HIDDEN * D_IN * F32,
        (HIDDEN, D_IN),
        "float32",
        "parameters",
    )
    exp_avg = by_name["opt.state[model.0.weight]['exp_avg']"]  # as the code reads it
    assert (exp_avg.nbytes, exp_avg.category) == (HIDDEN * D_IN * F32, "optimizer_state")
    # the formatted message names what matters
    text = report.format()
    for fragment in (f"during {peak_phase}", f"({report.requested} B)", "model.0.weight", "allocated by category"):
        assert fragment in text


def test_report_names_locals_in_forward(recorder: Recorder, engine: Engine) -> None:
    model, opt = build()
    recorder.track(model, opt)
    start = engine.allocated()
    batch = 512
    with OomWatch(engine, recorder) as watch, device_limit(engine, start + batch * D_IN * F32 + 100):
        try:
            x = torch.randn(batch, D_IN)  # fits
            model(x)  # the first Linear's output does not
        except torch.OutOfMemoryError as exc:
            report = watch.report_for(exc)
            release_oom(exc, engine)
        else:  # pragma: no cover
            pytest.fail("no OOM")
    assert report.phase == "forward"
    assert report.requested == batch * HIDDEN * F32
    biggest = report.largest[0]
    assert biggest.shape == (batch, D_IN)
    assert biggest.nbytes == batch * D_IN * F32
    assert biggest.held_by is not None
    assert biggest.held_by.startswith("local 'x' in test_report_names_locals_in_forward (test_oom.py:")
    assert biggest.category == "activations"  # Linear saved its input for backward before its output failed
    # reading the frame's locals for the report left no reference behind: deleting the local frees it
    ref = weakref.ref(x)
    del x
    assert ref() is None


def test_an_oom_after_backward_is_not_reported_as_during_backward(recorder: Recorder, engine: Engine) -> None:
    model, _ = build()
    recorder.track(model)
    model(torch.randn(16, D_IN)).sum().backward()  # no optimizer: nothing else ends the backward phase
    assert recorder.phase is None
    start = engine.allocated()
    with OomWatch(engine, recorder) as watch, device_limit(engine, start + 1024):
        try:
            torch.ones(1024)  # 4 KiB in the test body, after backward
        except torch.OutOfMemoryError as exc:
            report = watch.report_for(exc)
            release_oom(exc, engine)
        else:  # pragma: no cover
            pytest.fail("no OOM")
    assert report.phase is None
    assert "during" not in report.format().splitlines()[0]


def test_report_built_when_caught_parses_the_message(engine: Engine) -> None:
    engine.clean()
    kept = torch.zeros(1000)
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity")
    report = oom_report(engine, exc=exc, top=3)
    assert report.when == "when the error was caught"
    assert (report.requested, report.requested_exact) == (2 * 2**20, False)
    assert report.phase is None
    assert report.allocated == engine.allocated()
    assert "requested: ~2.00 MiB" in report.format()
    assert report.to_dict()["requested"] == 2 * 2**20
    del kept


def test_report_for_an_error_the_tracker_did_not_raise(recorder: Recorder, engine: Engine) -> None:
    with OomWatch(engine, recorder) as watch:
        report = watch.report_for(RuntimeError("CUDA out of memory. Tried to allocate 1.00 KiB"))
    assert watch.report is None
    assert (report.requested, report.requested_exact) == (1024, False)


def test_live_tensors_counts_views_once() -> None:
    base = torch.zeros(4096)
    views = [base[:10], base[100:], base.view(64, 64)]
    tensors, count, nbytes = live_tensors("cpu", top=None)
    mine = [t for t in tensors if t.nbytes == 4096 * F32 and t.views >= 4]
    assert len(mine) == 1
    assert mine[0].shape == (64, 64) or mine[0].shape == (4096,)
    assert count == len(tensors)
    assert nbytes == sum(t.nbytes for t in tensors)
    del base, views


# --------------------------------------------------------------------------- releasing


def failing_forward(model: nn.Module, batch: int) -> torch.Tensor:
    hidden = torch.randn(batch, D_IN)
    out: torch.Tensor = model(hidden).sum()
    return out


def test_release_frees_what_the_frames_held(recorder: Recorder, engine: Engine) -> None:
    model, opt = build()
    recorder.track(model, opt)
    tracker = tracker_of(engine)
    before = tracker.current
    batch = 256
    with device_limit(engine, before + batch * D_IN * F32 + batch * HIDDEN * F32 + 64):
        try:
            failing_forward(model, batch)
        except torch.OutOfMemoryError as caught:
            exc = caught
    # the exception is held: its traceback's frames keep the step's tensors alive
    assert tracker.current > before
    assert exc.__traceback__ is not None
    release_oom(exc, engine)
    assert tracker.current == before
    # the traceback stays down to the user's last frame, where pytest shows the line that allocated;
    # the frames of torch and of the CPU engine below it go, the user's frames lose their locals
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_name, tb.tb_lineno))
        tb = tb.tb_next
    assert frames[-1] == ("failing_forward", failing_forward.__code__.co_firstlineno + 2)
    assert [name for name, _ in frames] == ["test_release_frees_what_the_frames_held", "failing_forward"]
    assert "Tried to allocate" in str(exc)  # the exception itself stays usable


def test_release_after_a_backward_oom_with_zero_grad(recorder: Recorder, engine: Engine) -> None:
    model, opt = build()
    recorder.track(model, opt)
    train_step(model, opt, 4)
    tracker = tracker_of(engine)
    peak, _ = step_peak(recorder, model, opt, 128)
    before = tracker.current
    # fail in backward: enough for the forward, not for all the gradients
    with recorder.span("forward-only") as span:
        loss = model(torch.randn(128, D_IN)).pow(2).mean()
        del loss
    limit = span.peak + 1
    assert limit < peak
    with device_limit(engine, limit):
        try:
            train_step(model, opt, 128)
        except torch.OutOfMemoryError as caught:
            exc = caught
    assert recorder.phase in ("backward", "optimizer")
    release_oom(exc, engine)
    opt.zero_grad(set_to_none=True)  # gradients of a partial backward are the caller's business
    assert tracker.current == before


def test_release_clears_chained_exceptions(engine: Engine) -> None:
    engine.clean()
    tracker = tracker_of(engine)
    tracker.start()
    try:
        before = tracker.current

        def inner() -> None:
            big = torch.ones(10_000)
            raise torch.OutOfMemoryError(f"Tried to allocate 4 bytes ({big.numel()})")

        def outer() -> None:
            other = torch.ones(5_000)
            try:
                inner()
            except torch.OutOfMemoryError as oom:
                raise RuntimeError(f"step failed with {other.numel()}") from oom

        try:
            outer()
        except RuntimeError as caught:
            exc = caught
        assert is_oom(exc)
        assert tracker.current == before + 15_000 * F32
        release_oom(exc, engine)
        assert tracker.current == before
        assert exc.__cause__ is not None and exc.__cause__.__traceback__ is not None
        last = exc.__cause__.__traceback__
        while last.tb_next is not None:
            last = last.tb_next
        assert last.tb_frame.f_code.co_name == "inner"  # where it was raised
    finally:
        tracker.stop()


def test_release_spares_generator_frames(engine: Engine) -> None:
    def wrapper() -> Generator[None, None, None]:
        try:
            yield
        except torch.OutOfMemoryError as exc:
            caught.append(exc)
            yield

    caught: list[BaseException] = []
    gen = wrapper()
    next(gen)
    gen.throw(torch.OutOfMemoryError("boom"))
    release_oom(caught[0], engine)
    with pytest.raises(StopIteration):
        next(gen)  # the generator that caught the error was neither closed nor broken


def test_breakdown_categories_are_the_tracker_ones() -> None:
    assert set(CATEGORIES) >= {"parameters", "gradients", "optimizer_state"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.fc(x)
        out: torch.Tensor = wide.relu()  # the second activation does not fit
        return out


def test_modules_are_named_by_the_callers_variable_not_self(recorder: Recorder, engine: Engine) -> None:
    model = Net()
    recorder.track(model)
    batch = 64
    start = engine.allocated()
    with (
        OomWatch(engine, recorder, top=20) as watch,
        device_limit(engine, start + batch * (D_IN + HIDDEN) * F32),
    ):
        try:
            model(torch.randn(batch, D_IN))
        except torch.OutOfMemoryError as exc:
            report = watch.report_for(exc)
            release_oom(exc, engine)
        else:  # pragma: no cover
            pytest.fail("no OOM")
    held = {t.held_by for t in report.largest}
    assert {"model.fc.weight", "model.fc.bias"} <= held
    assert any(str(name).startswith("local 'wide' in forward (test_oom.py:") for name in held)
    assert report.requested == batch * HIDDEN * F32


@pytest.mark.slow
def test_the_report_knows_optimizer_state_made_in_the_step_that_failed(pytester: pytest.Pytester) -> None:
    """Adam's state is made inside its first step(); an allocation refused there is reported
    with that state as optimizer state (the optimizer's ``state`` says so), not as temporaries."""
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(device="cpu", device_limit="14MiB")
def test_first_step(gpumem):
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    gpumem.track(model, optimizer)
    model(torch.randn(8, 1024)).sum().backward()
    optimizer.step()
"""
    )
    result = run_fresh(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*during optimizer*", "optimizer_state  4.0*MiB"])
