"""The same bytes in any order: a baseline file holds only figures that do not depend on which
tests ran before (a module-level cache that one test fills is in the next tests' start and
breakdown, in one order and not another)."""

from __future__ import annotations

import pytest
import torch

from conftest import run, run_fresh
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder
from tests._sessions_xdist import warm_workers

CACHED_SUITE = """
import pytest, torch

CACHE = []

@pytest.mark.gpumem
def test_fills_the_cache():
    CACHE.append(torch.ones(16 * 1024))   # 64 KiB alive to the end of the session

@pytest.mark.gpumem
@pytest.mark.parametrize("n", [16, 32, 64])
def test_step(gpumem, n):
    torch.manual_seed(n)
    model = torch.nn.Sequential(torch.nn.Linear(32, n), torch.nn.ReLU(), torch.nn.Linear(n, 32))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 32)
    gpumem.train_step(model, opt, (x, torch.zeros(4, 32)), torch.nn.functional.mse_loss)

@pytest.mark.gpumem
def test_tensors(gpumem):
    with gpumem.measure("block"):
        y = torch.ones(1000) * 2
"""

REVERSING_CONFTEST = """
import os

def pytest_collection_modifyitems(items):
    if os.environ.get("GPUMEM_TEST_REVERSE"):
        items.reverse()
"""


@pytest.mark.slow
def test_serial_parallel_and_reversed_runs_write_the_same_bytes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_cached=CACHED_SUITE)
    pytester.makeconftest(REVERSING_CONFTEST)
    path = pytester.path / "gpumem-baselines.json"
    files = {}
    for name in ("serial", "xdist", "reversed"):
        if name == "reversed":
            monkeypatch.setenv("GPUMEM_TEST_REVERSE", "1")
        path.unlink(missing_ok=True)
        if name == "xdist":  # the workers measure, each a process of its own (tests/_sessions_xdist.py)
            with warm_workers(monkeypatch):
                run(pytester, "--gpumem-update-baselines", "-n", "2").assert_outcomes(passed=5)
        else:
            run_fresh(pytester, "--gpumem-update-baselines").assert_outcomes(passed=5)
        files[name] = path.read_text()
    assert files["xdist"] == files["serial"]
    assert files["reversed"] == files["serial"]


def test_what_an_earlier_test_left_alive_is_other_in_the_next(cpu_engine: Engine) -> None:
    """Categories are a test's own: a tensor one recording made (a temporary) and another tracked
    (a parameter) count as "other" when the next recording starts, until it tracks them itself."""
    model = torch.nn.Linear(64, 64)
    categories = cpu_engine.categories
    assert categories is not None
    first = Recorder(cpu_engine)
    first.begin()
    try:
        first.track(model)
        cache = torch.ones(1024)
        assert categories.category_of(cache) == "temporaries"
        assert categories.category_of(model.weight) == "parameters"
    finally:
        first.end()
    second = Recorder(cpu_engine)
    second.begin()
    try:
        assert categories.category_of(cache) == "other"
        assert categories.category_of(model.weight) == "parameters"  # the scan finds parameters as such
        second.track(model)
        assert categories.category_of(model.weight) == "parameters"
    finally:
        second.end()


def test_a_breakdown_an_earlier_release_recorded_is_compared_without_other() -> None:
    """A file of an earlier release holds ``start`` and the breakdown's ``other``: the comparison
    leaves ``other`` out, as a baseline recorded now does, so a cache another test filled is
    not named as a change."""
    from pytest_gpumem.baselines import BaselineEntry, BaselineStore, Environment
    from pytest_gpumem.data.figures import Measurement
    from pytest_gpumem.judge.judgement import judge
    from pytest_gpumem.judge.record import TestRecord

    environment = Environment(engine="cpu", torch_version="2.13", cuda_rounding=False)
    store = BaselineStore()
    old = {"temporaries": 1000, "other": 0, "activations": 0}
    store.record(environment, "t.py::a", {"call": BaselineEntry({"peak": 1000}, start=0, breakdown=old)})
    now = {"temporaries": 3000, "other": 65536, "activations": 0}  # 64 KiB cached by an earlier test
    measured = Measurement("call", "cpu", "cpu", start=65536, peak=65536 + 3000, allocated=65536, breakdown=now)
    record = TestRecord("t.py::a", environment=environment.to_dict(), measurements=[measured])
    (peak,) = [f for f in judge(record, store).findings if f.metric == "peak"]
    assert peak.status == "regressed" and dict(peak.changed) == {"temporaries": 2000}
