"""Leak confirmation on the CPU engine: real tensors kept by a module-level list, a cycle, a holder object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import run as run_session
from conftest import run_fresh
from pytest_gpumem.diagnose.leaks import LeakCheck, confirm_leak, referrer_names, snapshot_storages
from pytest_gpumem.measurement.engines.base import Engine

F32 = 4

#: What the leaking function keeps: a module-level cache, as real leaks often are.
CACHE: list[torch.Tensor] = []


class Holder:
    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None


HOLDER = Holder()
TABLE: dict[str, torch.Tensor] = {}


def leaky_step(n: int) -> None:
    for i in range(n):
        CACHE.append(torch.full((100 * (i + 1),), float(i)))
    scratch = torch.ones(10_000)  # freed on return: not a leak
    del scratch


def clean_step() -> None:
    x = torch.randn(256, 64)
    y = (x @ x.T).relu()
    del x, y


class Node:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.me: Any = self  # a reference cycle: only the garbage collector frees it


def cyclic_step() -> None:
    Node(torch.zeros(5_000))


@pytest.fixture
def engine(cpu_engine: Engine, census_gives_back_the_suites_freeze: None) -> Iterator[Engine]:
    """The CPU engine, tracking; its census gives back what the suite froze (the module-level
    holders among it), as a census gives back what a user's conftest froze."""
    assert cpu_engine.tracker is not None
    cpu_engine.tracker.start()
    yield cpu_engine
    cpu_engine.tracker.stop()
    CACHE.clear()
    HOLDER.kept = None
    TABLE.clear()


def run(engine: Engine, step: Any, *args: Any) -> LeakCheck:
    """The plugin's call order: clean start reading and snapshot, the test, then the check."""
    start = engine.allocated()
    snapshot = snapshot_storages(engine)
    step(*args)
    return confirm_leak(engine, start, snapshot=snapshot)


@pytest.mark.slow
def test_module_level_cache_is_a_confirmed_leak(engine: Engine) -> None:
    check = run(engine, leaky_step, 3)
    expected = (100 + 200 + 300) * F32
    assert check.confirmed and check.suspected
    assert check.retained == expected
    assert check.readings == (check.start + expected,) * 3
    assert check.driver_retained is None and check.driver_confirmed is None  # CPU: no driver
    assert check.leaked_count == 3
    assert check.leaked_bytes == expected
    assert [t.nbytes for t in check.leaked] == [1200, 800, 400]
    assert [t.shape for t in check.leaked] == [(300,), (200,), (100,)]
    assert all(t.dtype == "float32" and t.category == "temporaries" for t in check.leaked)
    names = [t.held_by for t in check.leaked]
    assert all(name is not None for name in names)
    assert [str(name).rsplit(".", 1)[-1] for name in names] == ["CACHE[2]", "CACHE[1]", "CACHE[0]"]
    assert str(names[0]).endswith("test_leaks.CACHE[2]")
    text = check.format()
    assert "memory leak confirmed on cpu: 2.34 KiB (2400 B) retained" in text
    assert "test_leaks.CACHE[0]" in text


def test_no_leak(engine: Engine) -> None:
    check = run(engine, clean_step)
    assert not check.confirmed and not check.suspected
    assert check.retained <= 0
    assert len(check.readings) == 1  # the first reading at or below the start ends the check
    assert check.leaked == ()
    assert "no leak" in check.format()


def test_reference_cycle_is_freed_not_reported(engine: Engine) -> None:
    start = engine.allocated()
    snapshot = snapshot_storages(engine)
    import gc

    gc.disable()  # keep the cycle alive until confirm_leak collects
    try:
        cyclic_step()
        assert engine.allocated() == start + 5_000 * F32  # the cycle still holds it
        check = confirm_leak(engine, start, snapshot=snapshot)
    finally:
        gc.enable()
    assert not check.confirmed
    assert check.retained == 0
    assert check.leaked == ()


@pytest.mark.slow
def test_attribute_and_dict_holders_are_named(engine: Engine) -> None:
    def step() -> None:
        HOLDER.kept = torch.zeros(3000)
        TABLE["weights"] = torch.zeros(2000)

    check = run(engine, step)
    assert check.confirmed
    assert check.retained == 5000 * F32
    names = [str(t.held_by) for t in check.leaked]
    assert names[0].endswith("test_leaks.HOLDER.kept")
    assert names[1].endswith("test_leaks.TABLE['weights']")


@pytest.mark.slow
def test_views_of_one_leaked_storage_count_once(engine: Engine) -> None:
    def step() -> None:
        base = torch.zeros(4096)
        CACHE.extend([base[:10], base.view(64, 64), base[100:]])

    check = run(engine, step)
    assert check.retained == 4096 * F32
    assert check.leaked_count == 1
    (leaked,) = check.leaked
    assert leaked.nbytes == 4096 * F32
    assert leaked.views >= 3  # the three views, and their base if torch keeps its Python object
    # the base has no Python holder any more: the largest view that one has names the storage
    assert leaked.shape == (64, 64)
    assert str(leaked.held_by).endswith("test_leaks.CACHE[1]")


@pytest.mark.slow
def test_a_storage_alive_at_start_is_not_listed(engine: Engine) -> None:
    before = torch.zeros(1000)
    engine.clean()  # the tracker counts it from here on
    start = engine.allocated()
    snapshot = snapshot_storages(engine)
    assert snapshot.alive_at_start(before.untyped_storage())
    leaky_step(1)
    check = confirm_leak(engine, start, snapshot=snapshot)
    assert [t.nbytes for t in check.leaked] == [400]
    del before


def test_without_snapshot_the_leak_is_confirmed_but_not_listed(engine: Engine) -> None:
    start = engine.allocated()
    leaky_step(2)
    check = confirm_leak(engine, start, tries=2)
    assert check.confirmed
    assert check.retained == 300 * F32
    assert len(check.readings) == 2
    assert check.leaked == () and not check.listed
    assert "snapshot_storages" in check.format()
    assert check.to_dict()["retained"] == 1200


def test_tries_must_be_positive(engine: Engine) -> None:
    with pytest.raises(ValueError):
        confirm_leak(engine, 0, tries=0)


def test_referrer_names_skip_the_argument_list() -> None:
    local_tensor = torch.zeros(3)
    in_list = torch.zeros(2)
    box = [in_list]
    names = referrer_names([local_tensor, in_list])
    # locals of running frames are invisible to the garbage collector; the argument list is no holder
    assert id(local_tensor) not in names
    assert names[id(in_list)] == "list[0]"  # held by a list that nothing nameable holds
    assert referrer_names([]) == {}
    del box


class _Holder:
    kept: torch.Tensor | None = None


def test_a_module_level_name_wins_over_an_anonymous_dict_that_also_holds_the_holder() -> None:
    """The plugin freezes module globals out of the collector's generations between tests, so
    ``gc.get_referrers`` finds an anonymous dict that refers to a holder (a frame's materialised
    locals, a cache) and not the module's globals: the module-level name must still win."""
    import gc

    gc.freeze()  # this module's globals among them
    try:
        globals()["LATE_HOLDER"] = holder = _Holder()  # made after the freeze, as a test's objects are
        holder.kept = tensor = torch.zeros(5)
        anonymous = {"obj": holder}
        names = referrer_names([tensor])
        assert names[id(tensor)].endswith("test_leaks.LATE_HOLDER.kept")
        del anonymous
    finally:
        gc.unfreeze()
        del globals()["LATE_HOLDER"]


@pytest.mark.slow
def test_attribute_of_an_object_with_a_materialised_dict(engine: Engine) -> None:
    class Box:
        pass

    box = Box()
    vars(box)  # the instance dict now exists as a dict object: it, not the object, holds the tensor
    BOXES = [box]

    def step() -> None:
        box.kept = torch.zeros(1000)  # type: ignore[attr-defined]

    check = run(engine, step)
    assert check.confirmed
    assert check.leaked[0].held_by == "Box.kept"
    del BOXES


@pytest.mark.slow
def test_a_holder_is_named_by_its_module_for_every_leak_of_a_session(pytester: pytest.Pytester) -> None:
    """The first report reads the holder's attributes (which gives it a ``__dict__``) and the
    plugin freezes the module's globals between tests: the second leak through the same holder
    is still named by the module-level name, not by the holder's type."""
    pytester.makepyfile(
        test_holder="""
import pytest
import torch

class Holder:
    kept = None

HOLDER = Holder()

@pytest.mark.gpumem(retained="0B")
def test_one():
    HOLDER.kept = torch.zeros(3000)

@pytest.mark.gpumem(retained="0B")
def test_two():
    HOLDER.kept = torch.zeros(4000)
"""
    )
    result = run_session(pytester)
    result.assert_outcomes(failed=2)
    # the leak report's rows (the sites' notes name the holder too: "note held by ...")
    held_by = [
        line.split()[-1]
        for line in result.stdout.lines
        if line.rstrip().endswith("HOLDER.kept") and "held by" not in line and "code " not in line
    ]
    assert held_by == ["test_holder.HOLDER.kept", "test_holder.HOLDER.kept"]


FROZEN_BY_A_CONFTEST = {
    "conftest.py": """
import gc

import torch

KEPT = [torch.ones(1000)]  # a session's tensor, alive for good
gc.collect()
gc.freeze()  # a conftest's speed-up: everything alive now is frozen
""",
    "test_frozen.py": """
import pytest
import torch

from conftest import KEPT


@pytest.mark.gpumem(retained="0B")
def test_keeps_nothing():
    torch.ones(10)


@pytest.mark.gpumem(retained="0B")
def test_keeps_a_tensor():
    KEPT.append(torch.ones(256))
""",
}


def test_tensors_a_conftest_froze_are_never_counted_as_retained(pytester: pytest.Pytester) -> None:
    """A conftest that freezes what is alive (``gc.freeze()``, a known speed-up of large suites)
    hides its tensors from ``gc.get_objects()``: they are given back before the start that the
    leak check compares the end with, not brought into sight by its census afterwards, when they
    would count as retained by a test that kept nothing. A test that keeps a tensor still fails,
    by that tensor's bytes alone."""
    pytester.makepyfile(**FROZEN_BY_A_CONFTEST)
    result = run_fresh(pytester, "-p", "no:randomly", "-rf")
    result.assert_outcomes(passed=1, failed=1)
    failed = [line for line in result.outlines if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_keeps_a_tensor" in failed[0], result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "test_frozen.py::test_keeps_a_tensor",
            f"  call  retained * +{256 * F32 / 1024:.2f} KiB    0 B  exceeded",
            "test_frozen.py::test_keeps_nothing",
            "*",
            "*",
            "  call  retained * 0 B    0 B  ok",
        ]
    )


#: Counts, per test, the full collections that walk every object (nothing frozen as they start), from the test's
#: setup to the freeze after its teardown; the interpreter's own collections are kept out of the way.
COUNT_WHOLE_HEAP_COLLECTIONS = """
import gc

import pytest

from pytest_gpumem.measurement import collector, gcfunctions

WHOLE = {}
gc.set_threshold(1_000_000, 1_000, 1_000)  # the interpreter collects nothing during these short tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    counted = WHOLE.setdefault(item.name, [0])
    nothing = collector.interpreter_frozen()

    def count(phase, info):  # after the collector's hook: what the collection was given is frozen no more
        if phase == "start" and info["generation"] == 2 and gcfunctions.get_freeze_count() <= nothing:
            counted[0] += 1

    gc.callbacks.append(count)
    try:
        return (yield)
    finally:
        gc.callbacks.remove(count)


def pytest_terminal_summary(terminalreporter):
    for name, (count,) in WHOLE.items():
        terminalreporter.write_line(f"whole-heap collections {name}: {count}")
"""


@pytest.mark.slow  # a session in a process of its own
def test_a_leaking_test_walks_the_whole_process_twice_per_run(pytester: pytest.Pytester) -> None:
    """A leak check gives the frozen objects back so that a cycle among them that the test dropped is freed: one
    collection sees every object and what survives is frozen again, so its later tries walk only what the test
    made; the collection after the teardown sees everything once more. A second run for sites walks it twice (its
    census gives the frozen objects back to name the holder of a tensor the test made), and never for a tensor made
    before the test (it has no site to name a holder for). A test that leaks nothing walks it never."""
    pytester.makeconftest(COUNT_WHOLE_HEAP_COLLECTIONS)
    pytester.makepyfile(
        test_leak="""
import pytest, torch

LEAKS = []
KEPT = [torch.ones(10)]  # alive before the tests, held by a plain list: a census names it only with help


@pytest.fixture(autouse=True)
def _forget():
    yield
    LEAKS.clear()


@pytest.mark.gpumem(device="cpu", retained="0B")
def test_1_keeps_nothing():
    torch.ones(1000)


@pytest.mark.gpumem(device="cpu", retained="0B")
def test_2_leaks():
    LEAKS.append(torch.ones(1000))


@pytest.mark.gpumem(device="cpu", retained="0B")
def test_3_leaks_again():
    LEAKS.append(torch.ones(1000))


@pytest.mark.gpumem(device="cpu", peak="1KiB")
def test_4_peaks_over_its_limit():
    torch.ones(1000).sum()
"""
    )
    result = run_fresh(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=3)
    assert result.stdout.str().count("test_leak.LEAKS[0]") == 2  # each leak report names the holder
    counts = [line for line in result.outlines if line.startswith("whole-heap collections")]
    assert counts == [
        "whole-heap collections test_1_keeps_nothing: 0",
        "whole-heap collections test_2_leaks: 4",
        "whole-heap collections test_3_leaks_again: 4",
        "whole-heap collections test_4_peaks_over_its_limit: 0",
    ], result.stdout.str()
