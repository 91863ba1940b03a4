"""Microbatch search on a real CPU training step (MLP + AdamW) under an emulated device limit."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import forget_last_failure
from pytest_gpumem.diagnose.microbatch import MicrobatchError, Plan, max_microbatch, plan_accumulation, plan_for
from pytest_gpumem.diagnose.oom import OomWatch, release_oom
from pytest_gpumem.measurement.devicelimit import device_limit
from pytest_gpumem.measurement.engines import make_engine
from pytest_gpumem.measurement.engines.base import Engine

D_IN, HIDDEN, D_OUT = 32, 128, 4
N = 64  # the brute-force scan covers sizes 1..N


class Trainer:
    """A model, its optimizer and a step that builds its own batch of ``size`` samples."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.head = nn.Linear(HIDDEN, D_OUT)
        self.opt = torch.optim.AdamW([*self.model.parameters(), *self.head.parameters()], lr=1e-3)
        self.sizes: list[int] = []

    def step(self, size: int) -> None:
        self.sizes.append(size)
        x, y = torch.randn(size, D_IN), torch.randn(size, D_OUT)
        loss = F.mse_loss(self.head(self.model(x)), y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()

    def cleanup(self) -> None:
        self.opt.zero_grad(set_to_none=True)


@pytest.fixture
def engine(cpu_engine: Engine) -> Iterator[Engine]:
    assert cpu_engine.tracker is not None
    cpu_engine.tracker.start(saved_tensors=False)
    yield cpu_engine
    cpu_engine.tracker.stop()


@pytest.fixture
def trainer(engine: Engine) -> Trainer:
    trainer = Trainer()
    trainer.step(1)  # warm-up: AdamW creates its state, which then stays for every size
    trainer.cleanup()
    trainer.sizes.clear()
    return trainer


def peak_of(engine: Engine, trainer: Trainer, size: int) -> int:
    engine.take_window()
    trainer.step(size)
    trainer.cleanup()
    return engine.take_window().peak


def brute_force(engine: Engine, trainer: Trainer, limit: int) -> int:
    """Each size 1..N tried on its own under a fresh limit; the largest size below the first that fails."""
    assert engine.tracker is not None
    baseline = engine.tracker.current
    results = []
    for size in range(1, N + 1):
        try:
            with device_limit(engine, limit):
                trainer.step(size)
            results.append(True)
        except torch.OutOfMemoryError as exc:
            release_oom(exc, engine, collect=False)
            results.append(False)
        trainer.cleanup()
        assert engine.tracker.current == baseline  # every try starts from the same state
    fitting = results.index(False) if False in results else N
    assert not any(results[fitting:]), "memory is monotonic in the microbatch size"
    return fitting


class Peaks(dict[int, int]):
    """Peaks of single steps by size, measured on first use."""

    def __init__(self, engine: Engine, trainer: Trainer) -> None:
        super().__init__()
        self.engine, self.trainer = engine, trainer

    def __missing__(self, size: int) -> int:
        self[size] = peak = peak_of(self.engine, self.trainer, size)
        return peak


@pytest.fixture
def peaks(engine: Engine, trainer: Trainer) -> Peaks:
    return Peaks(engine, trainer)


@pytest.mark.parametrize("answer", [1, 2, 5, 37, 48, 63])
def test_search_matches_brute_force(engine: Engine, trainer: Trainer, peaks: Peaks, answer: int) -> None:
    limit = peaks[answer]  # exactly the peak of `answer` fits, the next size does not
    assert peaks[answer + 1] > limit
    expected = brute_force(engine, trainer, limit)
    assert expected == answer
    trainer.sizes.clear()
    found = max_microbatch(trainer.step, limit=limit, engine=engine, cleanup=trainer.cleanup, upper=N)
    assert found == expected
    assert engine.tracker is not None and engine.tracker.limit is None
    # doubling then bisection: far fewer tries than the scan
    assert len(trainer.sizes) <= 2 * (N.bit_length() + 1)


def test_nothing_fits_returns_zero(engine: Engine, trainer: Trainer, peaks: Peaks) -> None:
    limit = peaks[1] - 1
    trainer.sizes.clear()
    found = max_microbatch(trainer.step, limit=limit, engine=engine, cleanup=trainer.cleanup)
    assert found == 0
    assert trainer.sizes == [1]


def test_the_tries_that_run_out_of_memory_build_no_report_and_the_watch_is_kept(
    engine: Engine, trainer: Trainer, peaks: Peaks
) -> None:
    """A measured test watches for out-of-memory errors (:class:`OomWatch`), whose report is a
    census of every live tensor, each named by what holds it. The search catches each try's
    error, so no report is built for it; an error after the search is reported as before."""
    limit = peaks[37]
    with OomWatch(engine) as watch:
        assert max_microbatch(trainer.step, limit=limit, engine=engine, cleanup=trainer.cleanup) == 37
        assert watch.report is None, "a report was built for a try the search caught"
        with device_limit(engine, limit), pytest.raises(Exception) as raised:
            trainer.step(64)
        assert watch.report is not None and watch.report.requested is not None
        assert f"Tried to allocate {watch.report.requested} bytes" in str(raised.value)
        release_oom(raised.value, engine)
        trainer.cleanup()
    assert engine.tracker is not None and engine.tracker.on_oom is None


def test_plan_accumulation_on_the_found_size(engine: Engine, trainer: Trainer, peaks: Peaks) -> None:
    limit = peaks[37]
    plan = plan_accumulation(96, trainer.step, limit=limit, engine=engine, cleanup=trainer.cleanup)
    assert plan == Plan(microbatch=32, accumulation_steps=3, global_batch=96, max_microbatch=37)
    assert max(trainer.sizes) <= 96  # the search never goes past the global batch
    with pytest.raises(MicrobatchError):
        plan_accumulation(96, trainer.step, limit=peaks[1] - 1, engine=engine, cleanup=trainer.cleanup)


def test_the_tracker_is_started_for_the_search() -> None:
    forget_last_failure()
    trainer = Trainer()
    trainer.step(1)
    trainer.cleanup()
    engine = make_engine(torch.device("cpu"))
    assert engine.tracker is not None
    engine.clean()
    engine.tracker.start(saved_tensors=False)
    try:
        limit = peak_of(engine, trainer, 20)
    finally:
        engine.tracker.stop()
    # not started: the search starts the tracker (after the clean-state protocol) and stops it
    found = max_microbatch(trainer.step, limit=limit, engine=engine, cleanup=trainer.cleanup)
    assert found == 20
    assert not engine.tracker.active


def test_a_step_that_never_runs_out_stops_at_upper() -> None:
    engine = make_engine(torch.device("cpu"))  # its count does not move: no garbage collection between tries
    sizes: list[int] = []
    assert max_microbatch(sizes.append, upper=100, engine=engine) == 100
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 100]
    sizes.clear()
    assert max_microbatch(sizes.append, start=3, upper=3) == 3  # without an engine: collects after each try
    assert sizes == [3]


def test_bisection_with_an_old_style_oom() -> None:
    engine = make_engine(torch.device("cpu"))
    tried: list[int] = []

    def step(size: int) -> None:
        tried.append(size)
        if size > 300:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {size} bytes")

    assert max_microbatch(step, start=5, upper=10_000, engine=engine) == 300
    assert tried == [5, 10, 20, 40, 80, 160, 320, 240, 280, 300, 310, 305, 302, 301]
    assert max_microbatch(step, start=301, upper=10_000, engine=engine) == 0


def test_other_errors_propagate(engine: Engine) -> None:
    cleaned: list[int] = []

    def step(size: int) -> None:
        if size == 8:
            raise ValueError("shape mismatch at 8")

    with pytest.raises(ValueError, match="shape mismatch at 8"):
        max_microbatch(step, upper=64, engine=engine, cleanup=lambda: cleaned.append(1))
    assert len(cleaned) == 4  # sizes 1, 2, 4 and the failing 8 were all cleaned up after


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 0}, "start must be an int >= 1"),
        ({"upper": 0}, "upper must be an int >= 1"),
        ({"start": 4, "upper": 2}, "below start"),
        ({"limit": 100}, "needs the engine"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        max_microbatch(lambda size: None, **kwargs)  # type: ignore[arg-type]


def test_cpu_engine_without_limit_or_upper_is_refused() -> None:
    engine = make_engine(torch.device("cpu"))
    with pytest.raises(ValueError, match="give upper"):
        max_microbatch(lambda size: None, engine=engine)


@pytest.mark.parametrize(
    ("global_batch", "max_size", "microbatch"),
    [(96, 40, 32), (96, 37, 32), (97, 50, 1), (8, 100, 8), (12, 5, 4), (36, 6, 6), (1, 1, 1), (64, 63, 32)],
)
def test_plan_for(global_batch: int, max_size: int, microbatch: int) -> None:
    plan = plan_for(global_batch, max_size)
    assert plan.microbatch == microbatch
    assert plan.microbatch * plan.accumulation_steps == global_batch
    assert plan.max_microbatch == max_size


def test_plan_for_errors() -> None:
    with pytest.raises(MicrobatchError):
        plan_for(8, 0)
    with pytest.raises(ValueError):
        plan_for(0, 4)


def brute_plan(global_batch: int, max_size: int) -> int:
    return max(d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= max_size)


def test_plan_for_matches_brute_force() -> None:
    check: Callable[[int, int], int] = brute_plan
    for global_batch in range(1, 130):
        for max_size in (1, 2, 3, 7, 16, 50, 129):
            assert plan_for(global_batch, max_size).microbatch == check(global_batch, max_size)


def test_a_step_whose_memory_does_not_grow_with_the_size_stops_the_search_saying_why(engine: Engine) -> None:
    """Under a limit, without ``upper``: a step that allocates the same bytes at every size never
    runs out of memory; the doubling stops after 30 doublings instead of running forever."""
    sizes: list[int] = []

    def step(size: int) -> None:
        sizes.append(size)
        torch.ones(10)

    with pytest.raises(MicrobatchError) as raised:
        max_microbatch(step, limit="1MiB", engine=engine)
    assert sizes == [2**i for i in range(31)]
    assert str(raised.value) == (
        "max_microbatch: every size from 1 to 1,073,741,824 fit under the limit 1.00 MiB (30 doublings): the "
        "step's memory does not grow with its size (or too little to ever run out); the search stopped there. "
        "Build the batch from size in step(size), or give upper="
    )
