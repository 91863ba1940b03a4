"""Work done on threads is measured like work done on the test's own thread.

The CPU engine's tracker watches operators through a dispatch mode, and torch's dispatch
modes (and saved-tensor hooks) are per thread: threads started while it watches, and work
submitted to thread pools, are watched too. What it cannot see is said, never shown as 0 B.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from pytest_gpumem import measure
from pytest_gpumem.data.figures import PartialFigures
from tests.conftest import run

STEP = """
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64)


def step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def on(where, fn, pool=None):
    if where == "main":
        fn()
    elif where == "thread":
        failed = []

        def target():
            try:
                fn()
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
    elif where == "pool":
        with ThreadPoolExecutor(2) as new_pool:
            new_pool.submit(fn).result()
    else:  # a pool whose thread was started before the test
        pool.submit(fn).result()


@pytest.fixture
def early_pool():
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its thread exists before the test starts
    yield pool
    pool.shutdown()
"""

WHERE = ("main", "thread", "pool", "early_pool")


def _report(pytester: pytest.Pytester, name: str = "report.json") -> dict[str, dict[str, Any]]:
    """The measurements of each test of the JSON report, by test name and span."""
    data = json.loads((pytester.path / name).read_text())
    return {
        test["nodeid"].split("::")[-1]: {m["name"]: m for m in test["measurements"]} | {"_errors": test["errors"]}
        for test in data["tests"]
    }


def _figures(measurement: dict[str, Any]) -> dict[str, Any]:
    """A span's figures as costs (the in-process sessions' start holds what earlier tests left)."""
    start = measurement["start"]
    return {
        "peak": measurement["peak"] - start,
        "allocated": measurement["allocated"] - start,
        "breakdown": {k: v for k, v in measurement["breakdown"].items() if k != "other"},
        "other": measurement["breakdown"]["other"] - start,
        "phases": {
            name: {key: phase[key] - start for key in ("start", "peak", "end")} | {"count": phase["count"]}
            for name, phase in measurement["phases"].items()
        },
        "saved_activations": measurement["saved_activations"],
    }


def test_a_step_on_a_thread_or_a_pool_has_the_figures_of_the_same_step_on_the_tests_thread(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.parametrize("where", ["main", "thread", "pool", "early_pool"])
@pytest.mark.gpumem(device="cpu")
def test_step(gpumem, where, early_pool):
    model, opt, x = build()
    gpumem.track(model, opt)
    step(model, opt, x)  # warm-up: AdamW's state
    with gpumem.measure("step"):
        on(where, lambda: step(model, opt, x), early_pool)
"""
    )
    run(pytester, "--gpumem-json=report.json").assert_outcomes(passed=4)
    report = _report(pytester)
    main = report["test_step[main]"]
    assert _figures(main["step"])["peak"] > 0
    assert main["step"]["breakdown"]["temporaries"] > 0
    for where in WHERE[1:]:
        test = report[f"test_step[{where}]"]
        assert _figures(test["step"]) == _figures(main["step"]), where
        assert _figures(test["call"])["peak"] == _figures(main["call"])["peak"], where
        assert test["call"]["notes"] == test["step"]["notes"] == [], where


def test_a_peak_limit_fails_on_a_thread_as_on_the_tests_thread(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.parametrize("where", ["main", "thread", "pool", "early_pool"])
@pytest.mark.gpumem(device="cpu", peak="1KiB")
def test_step(where, early_pool):
    on(where, lambda: torch.ones(1000).sum(), early_pool)  # 4000 + 4 bytes at its peak
"""
    )
    run(pytester, "--gpumem-json=report.json").assert_outcomes(failed=4)
    for where, test in _report(pytester).items():
        assert _figures(test["call"])["peak"] == 4004, where


@pytest.mark.slow  # four leak confirmations (full collections) in a session
def test_a_leak_made_on_a_thread_is_retained_with_its_bytes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        STEP
        + """
LEAKS = []


@pytest.fixture(autouse=True)
def _forget():
    yield
    LEAKS.clear()


@pytest.mark.parametrize("where", ["main", "thread", "pool", "early_pool"])
@pytest.mark.gpumem(device="cpu", retained="0B")
def test_leak(where, early_pool):
    on(where, lambda: LEAKS.append(torch.ones(1000)), early_pool)
"""
    )
    result = run(pytester, "--gpumem-json=report.json", "--gpumem-sites=off")  # no second run: its sites are not read
    result.assert_outcomes(failed=4)
    report = _report(pytester)
    for where in WHERE:
        assert report[f"test_leak[{where}]"]["call"]["retained"] == 4000, where
    assert result.stdout.str().count("LEAKS") >= 4


@pytest.mark.slow  # four out-of-memory reports, a census of live tensors each
def test_an_emulated_device_limit_is_enforced_on_a_thread(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.parametrize("where", ["main", "thread", "pool", "early_pool"])
@pytest.mark.gpumem(device="cpu", device_limit="1MiB")
def test_too_big(where, early_pool):
    on(where, lambda: torch.ones(1 << 20), early_pool)
"""
    )
    result = run(pytester, "--gpumem-json=report.json", "--gpumem-sites=off")  # no second run: its sites are not read
    result.assert_outcomes(failed=4)
    text = result.stdout.str()
    assert text.count("over the emulated device limit of 1048576 bytes") >= 4
    assert text.count("Tried to allocate 4194304 bytes") >= 4


def test_a_leak_on_a_thread_started_before_the_test_is_found_at_its_end_and_said(pytester: pytest.Pytester) -> None:
    """A thread that runs before the test starts cannot be watched: what it left alive is found
    at the test's end (retained is exact) and the call's figures say that they are partial."""
    pytester.makepyfile(
        STEP
        + """
LEAKS = []


@pytest.fixture
def worker():
    jobs, done = queue.Queue(), queue.Queue()

    def serve():
        while (job := jobs.get()) is not None:
            done.put(job())

    thread = threading.Thread(target=serve)
    thread.start()
    yield lambda fn: (jobs.put(fn), done.get())
    jobs.put(None)
    thread.join()
    LEAKS.clear()


@pytest.mark.gpumem(device="cpu")
def test_leak(worker):
    worker(lambda: LEAKS.append(torch.ones(1000)))
"""
    )
    result = run(pytester, "--gpumem-json=report.json", "-v")
    result.assert_outcomes(passed=1)
    call = _report(pytester)["test_leak"]["call"]
    assert call["retained"] == 4000
    assert call["peak"] - call["start"] == 0  # not seen while it ran...
    (note,) = call["notes"]  # ...and said
    assert "3.91 KiB" in note and "not seen" in note
    text = result.stdout.str()
    assert "PartialFigures" in text
    assert "partial: 3.91 KiB alive at the end" in text.replace("\n", " ") or "[1] partial: 3.91 KiB" in text


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _on_thread(fn: Callable[[], None]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def _in_pool(fn: Callable[[], None]) -> None:
    with ThreadPoolExecutor(1) as pool:
        pool.submit(fn).result()


@pytest.mark.parametrize("runner", [_on_thread, _in_pool], ids=["thread", "pool"])
def test_the_library_measure_sees_a_step_on_a_thread(runner: Callable[[Callable[[], None]], None]) -> None:
    model, opt, x = _build()
    _step(model, opt, x)
    spans = []
    for run_step in (lambda fn: fn(), runner):
        with measure("step", device="cpu", track=(model, opt)) as span:
            run_step(lambda: _step(model, opt, x))
        spans.append(span.measurement)
    main, threaded = spans
    assert threaded.cost("peak") == main.cost("peak") > 0
    assert threaded.cost("allocated") == main.cost("allocated")
    assert threaded.breakdown == main.breakdown
    assert threaded.phases == main.phases
    assert threaded.notes == main.notes == ()


def test_two_threads_at_once_peak_at_their_sum() -> None:
    """Two threads that each hold 4 MB at once: the peak is 8 MB (one count for all threads)."""
    barrier = threading.Barrier(2)

    def hold() -> None:
        tensor = torch.ones(1 << 20)
        barrier.wait()  # both hold theirs now
        barrier.wait()
        del tensor

    with measure("both", device="cpu") as span:
        threads = [threading.Thread(target=hold) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert span.cost("peak") == 2 * 4 * (1 << 20)
    assert span.cost("allocated") == 0


def test_threads_are_followed_only_while_a_tracker_watches() -> None:
    """The thread and pool hooks are taken out when the measurement ends."""
    start, submit = threading.Thread.start, ThreadPoolExecutor.submit
    with measure("span", device="cpu"):
        assert threading.Thread.start is not start
        assert ThreadPoolExecutor.submit is not submit
    assert threading.Thread.start is start
    assert ThreadPoolExecutor.submit is submit


def test_observing_allocations_says_it_does_not_see_threads() -> None:
    with (
        pytest.warns(PartialFigures, match="observe='allocations'"),
        measure("span", device="cpu", observe="allocations") as span,
    ):
        _on_thread(lambda: torch.ones(1000).sum().item() and None)
    (note,) = span.measurement.notes
    assert "observe='allocations'" in note and "thread" in note
