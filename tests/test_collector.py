"""What a measured test's garbage collections walk: what the test made, not what the session imported.

The first test of a suite as users write it imports parts of torch lazily (an optimizer's
first step imports ``torch._dynamo``, sympy and some 800 modules: over 100,000 objects).
The plugin's collector freezes what the session imported or built, so that the two full
collections of every later measured test walk only what that test made. These sessions
run in a fresh process (in this suite's own process torch's lazy imports are done and the
suite's conftest has frozen everything). The objects each collection walks are counted
inside the collector, by a ``gc.callbacks`` hook (``len(gc.get_objects())`` as a full
collection starts: every object it traverses), never timed.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from conftest import run, run_fresh
from pytest_gpumem.measurement import collector as collector_module
from pytest_gpumem.measurement import frozen, gcfunctions
from pytest_gpumem.measurement.collector import Collector, collect, give_back, others_frozen, running

#: Counts, per test, the objects each full collection walks as it starts, and says which
#: modules the first test imported.
COUNTING = """
import gc, sys
import pytest

WALKED = {}
CURRENT = []
MODULES = {}
# gc's own function, taken before the plugin's collector wraps it (its wrapper gives the frozen
# objects back to a user's call, which would count everything)
GET_OBJECTS = gc.get_objects


def _count(phase, info):
    if phase == "start" and info["generation"] == 2 and CURRENT:
        WALKED.setdefault(CURRENT[-1], []).append(len(GET_OBJECTS()))


gc.callbacks.append(_count)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    CURRENT.append(item.name)
    MODULES[item.name] = len(sys.modules), "torch._dynamo" in sys.modules
    try:
        return (yield)
    finally:
        CURRENT.pop()


def pytest_sessionfinish(session):
    print()
    for name, walked in WALKED.items():
        modules, dynamo = MODULES[name]
        print("WALKED", name, modules, int(dynamo), *walked)
"""

#: two optimizer steps of a small model
STEP = """
import pytest, torch


def step():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
"""

#: the two tests after the first, each a measured step
LATER = """

@pytest.mark.gpumem(peak="1GiB")
def test_2_step():
    step()


@pytest.mark.gpumem(peak="1GiB")
def test_3_step():
    step()
"""

LAZY = (
    STEP
    + """

@pytest.mark.gpumem(peak="1GiB")
def test_1_first_step_imports_lazily():
    step()

"""
    + LATER
)
#: Objects a later test's collections may walk: the test's own objects and pytest's for it are a
#: few thousand; the first step's lazy imports are over 100,000.
BOUND = 10_000


def _walked(output: str) -> dict[str, tuple[int, bool, list[int]]]:
    """``{test: (modules when it began, torch._dynamo imported then, objects each full collection walked)}``."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"WALKED (\w+) (\d+) ([01])((?: \d+)*)$", line)
        if match:
            name, modules, dynamo, walked = match.groups()
            found[name] = (int(modules), dynamo == "1", [int(n) for n in walked.split()])
    return found


@pytest.mark.slow
def test_later_tests_do_not_walk_what_the_first_test_imported(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(COUNTING)
    pytester.makepyfile(test_lazy=LAZY)
    result = run_fresh(pytester, "-s", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    walked = _walked(result.stdout.str())
    assert list(walked) == ["test_1_first_step_imports_lazily", "test_2_step", "test_3_step"], result.stdout.str()
    first_modules, dynamo_before, _ = walked["test_1_first_step_imports_lazily"]
    second_modules, dynamo_after, _ = walked["test_2_step"]
    # the scenario is real: the first test's step imported torch._dynamo and hundreds of modules
    assert not dynamo_before and dynamo_after
    assert second_modules - first_modules > 300
    for name in ("test_2_step", "test_3_step"):
        collections = walked[name][2]
        assert len(collections) == 2, (name, collections)  # the clean state's and the settle's
        assert max(collections) < BOUND, (name, collections)


#: The inner session measures "on cuda:0" through the CUDA engine, its device calls taken by the
#: recording stand-in of tests/test_cuda_contract.py (so is ``gc.collect``, to count the plugin's
#: collections); the collector is the real one. The bodies run on the CPU.
CUDA_CONFTEST = """
import sys
sys.path.insert(0, {tests!r})

import pytest
from test_cuda_contract import Phases, install_stand_in

STAND_IN = install_stand_in(pytest.MonkeyPatch())


def pytest_configure(config):
    config.pluginmanager.register(Phases(STAND_IN), "phases")


def pytest_terminal_summary(terminalreporter):
    test = None
    counts = {{}}
    for call in STAND_IN.calls:
        if call.startswith("test "):
            test = call[len("test "):]
            counts[test] = 0
        elif call == "gc.collect(2)" and test is not None:
            counts[test] += 1
    for name, count in counts.items():
        print("COLLECTIONS", name, count)
"""


@pytest.mark.slow
def test_a_cuda_test_makes_two_full_collections_of_what_it_made(pytester: pytest.Pytester) -> None:
    """The contract on a GPU, checked on the CPU: a measured CUDA test asks for two full collections
    (the clean state's and the settle's), and after a first test that imported torch._dynamo each
    walks what the test made."""
    tests = str(Path(__file__).resolve().parent)
    pytester.makeconftest(CUDA_CONFTEST.format(tests=tests) + COUNTING)
    pytester.makepyfile(test_lazy=LAZY)
    result = run_fresh(pytester, "-s", "-p", "no:randomly", device="cuda")
    result.assert_outcomes(passed=3)
    output = result.stdout.str()
    walked = _walked(output)
    asked = {name: int(count) for name, count in re.findall(r"COLLECTIONS (\w+) (\d+)", output)}
    assert not walked["test_1_first_step_imports_lazily"][1] and walked["test_2_step"][1]  # dynamo came with test 1
    for name in ("test_2_step", "test_3_step"):
        assert asked[name] == 2, (name, asked)
        collections = walked[name][2]
        assert len(collections) == 2 and max(collections) < BOUND, (name, collections)


class Cycle:
    def __init__(self) -> None:
        self.me = self
        self.tensor = torch.ones(10)


def _is_frozen(obj: object) -> bool:
    return all(other is not obj for other in gcfunctions.get_objects())


@pytest.mark.usefixtures("nothing_frozen")
def test_a_full_collection_the_plugin_did_not_ask_for_is_given_everything() -> None:
    before = Cycle()
    with Collector() as collector:
        assert collector.active and collector.frozen and _is_frozen(before)
        assert any(tensor is before.tensor for tensor in frozen.tensors())  # remembered for the trackers
        collect()  # on the plugin's account: walks what is not frozen, gives nothing back
        assert collector.frozen and _is_frozen(before) and collector.given_back == 0
        later = Cycle()  # made since the freeze: the plugin's collections walk it
        assert not _is_frozen(later)
        ref = weakref.ref(before)
        del before
        gc.collect()  # the user's: everything is given back first, so the dropped cycle is freed
        assert ref() is None and collector.given_back == 1
        # what survived it is frozen again as it ended, the tensors made since remembered
        assert collector.frozen and collector.froze == 2 and _is_frozen(later)
        assert any(tensor is later.tensor for tensor in frozen.tensors())
        ref = weakref.ref(later)
        del later
        collect()  # the plugin's own does not walk the frozen cycle...
        assert ref() is not None
        gc.collect()  # ...the user's does
        assert ref() is None and collector.given_back == 2
    assert gcfunctions.get_freeze_count() == 0  # the run's end gives everything back
    assert collector._on_collection not in gc.callbacks and not frozen.known()


@pytest.mark.slow  # full collections of the whole process
@pytest.mark.usefixtures("nothing_frozen")
def test_the_interpreters_own_full_collections_see_everything_as_often_as_without_the_freeze() -> None:
    """CPython collects its oldest generation once the objects that lived on since its last full
    collection are a quarter of those alive then. Frozen objects leave that generation, so its own
    rule would walk the whole heap far more often than without the plugin: the collector gives
    everything back only when the rule, counting the frozen objects, says so."""
    gc.collect()
    heap = len(gc.get_objects())
    with Collector() as collector:
        dropped = Cycle()
        ref = weakref.ref(dropped)
        collect()
        assert _is_frozen(dropped) is False
        gc.collect()  # the user's: given everything, and what survives is frozen again
        assert _is_frozen(dropped) and collector.given_back == 1
        del dropped
        collect()  # after it, what the oldest generation holds is small (all else is frozen)
        gc.set_threshold(10, 2, 2)  # the interpreter collects often, its oldest generation too
        few = [[] for _ in range(heap // 50)]
        assert collector.given_back == 1 and ref() is not None  # it would have collected the younger ones only
        many = [[] for _ in range(heap // 3)]
        assert collector.given_back >= 2 and ref() is None
        del few, many
        collector.collect_everything()  # as before a device-limit test: the count starts again from what is alive
        collect()  # the plugin's own: the oldest generation holds little again
        given = collector.given_back
        few = [[] for _ in range(heap // 50)]
        assert collector.given_back == given
        del few


@pytest.mark.usefixtures("nothing_frozen")
def test_compaction_waits_for_many_objects_and_thaw_gives_them_back() -> None:
    with Collector(compact_above=20_000) as collector:
        small = [[] for _ in range(1_000)]
        assert not collector.compact() and not _is_frozen(small)
        large = [[] for _ in range(30_000)]
        assert collector.compact() and _is_frozen(small) and _is_frozen(large)
        collector_module.thaw()  # a report naming what holds a tensor needs the referrers: given back
        assert not collector.frozen and not _is_frozen(large)
        assert give_back() is False  # nothing frozen now
        assert collector.compact() and collector.frozen  # frozen again between tests
        assert give_back() is True and not collector.frozen


@pytest.mark.usefixtures("nothing_frozen")
def test_after_the_users_own_freeze_is_given_back_the_collector_freezes_again() -> None:
    with Collector() as collector:
        gc.freeze()  # the user's: the frozen objects are theirs, the collector yields
        assert not collector.active and running() is None and not collector.reclaimable
        collector.start()  # theirs are still frozen: it cannot tell them from its own
        assert not collector.active
        gc.unfreeze()  # given back: nothing is anyone's now
        assert collector.reclaimable and gc.unfreeze is gcfunctions.unfreeze
        collector.start()  # as the run does between tests
        assert collector.active and running() is collector and collector.frozen and not collector.reclaimable
    assert gcfunctions.get_freeze_count() == 0 and running() is None


@pytest.mark.usefixtures("nothing_frozen")
def test_objects_someone_else_froze_are_left_alone() -> None:
    gc.freeze()  # as a conftest, a library or an enclosing session would
    collector_module.interpreter_frozen()  # asked of a child once: its objects die before the count
    count = gcfunctions.get_freeze_count()

    def kept() -> bool:
        """Nothing given back (which leaves none frozen); a thread of the process (xdist's) may meanwhile free a
        few of the frozen objects by reference counting."""
        return count - 100 < gcfunctions.get_freeze_count() <= count

    with Collector() as collector:
        assert not collector.active and running() is None
        assert not collector.compact()
        gc.collect()
        assert kept()  # nothing given back: it cannot tell theirs from its own
    assert kept()


@pytest.mark.usefixtures("nothing_frozen")
def test_the_interpreters_own_frozen_objects_do_not_stop_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12 starts with objects of its own frozen (immortal tuples of its deep-frozen
    standard library, :func:`interpreter_frozen`): they are nobody's, so the collector freezes
    and gives back as usual. Objects frozen here stand in for them; one more frozen is someone's."""
    gc.freeze()
    count = gcfunctions.get_freeze_count()
    monkeypatch.setattr(collector_module, "interpreter_frozen", lambda: count)
    assert count > 0 and not others_frozen()
    with Collector() as collector:
        assert collector.active and running() is collector
    assert gcfunctions.get_freeze_count() == 0  # given back with the collector's own
    gc.freeze()
    kept = [[] for _ in range(10)]
    gc.freeze()  # beyond the interpreter's: someone's
    assert others_frozen()
    with Collector() as collector:
        assert not collector.active
    del kept


@pytest.mark.slow
def test_a_fresh_process_has_no_one_elses_frozen_objects() -> None:
    """``interpreter_frozen()`` is what a bare interpreter of this Python holds frozen (375 tuples
    on Python 3.12, none on 3.11 and 3.13), so a process that imported torch and the plugin has
    nothing frozen that is someone else's, and the run's collector starts there."""
    bare = subprocess.run(
        [sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
        capture_output=True,
        text=True,
        check=True,
    )
    code = (
        "from pytest_gpumem.measurement.collector import Collector, interpreter_frozen, others_frozen\n"
        "print(interpreter_frozen(), others_frozen())\n"
        "collector = Collector()\n"
        "collector.start()\n"
        "print(collector.active)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [bare.stdout.strip(), "False", "True"]
    if sys.version_info[:2] == (3, 12):
        assert int(bare.stdout) > 0


@pytest.mark.usefixtures("nothing_frozen")
def test_one_collector_runs_at_a_time() -> None:
    with Collector() as outer, Collector() as inner:
        assert outer.active and not inner.active and running() is outer
    assert running() is None


@pytest.mark.usefixtures("nothing_frozen")
def test_no_tensor_a_module_holds_gets_a_weak_reference_and_the_trackers_still_find_them() -> None:
    """``torch.utils.swap_tensors`` refuses a tensor with a weak reference (FSDP2's ``to_empty``,
    ``.to()`` of fake parameters, ``swap_module_params_on_conversion``): the collector remembers a
    module's parameters, their gradients and its buffers through the module, at the run's start,
    at a compaction and after a collection of the user's, and only other tensors directly."""
    before = torch.nn.BatchNorm1d(3)
    before.weight.grad = torch.ones(3)
    loose = torch.ones(2)
    with Collector(compact_above=0) as collector:
        gc.collect()  # the user's: what was made since is remembered as it ends
        during = torch.nn.Linear(2, 2)
        gc.collect()
        later = torch.nn.Linear(2, 2)
        assert collector.compact()
        held = [
            *before.parameters(),
            before.weight.grad,
            *before.buffers(),
            *during.parameters(),
            *later.parameters(),
        ]
        assert [weakref.getweakrefs(tensor) for tensor in held] == [[]] * len(held)
        remembered = {id(tensor) for tensor in frozen.tensors()}
        assert {id(tensor) for tensor in [*held, loose]} <= remembered
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            for module in (before, during, later):
                module.to(torch.float64)  # swaps each parameter (and a gradient) in place
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        assert before.weight.grad.dtype == during.weight.dtype == later.weight.dtype == torch.float64


@pytest.mark.usefixtures("nothing_frozen")  # as a user's session starts: the plugin's collector freezes
def test_a_test_that_swaps_its_parameters_runs_as_it_does_without_the_plugin(pytester: pytest.Pytester) -> None:
    """A module built at import (frozen as the run starts) and one built in the test, after a
    collection of the user's, convert with ``swap_module_params_on_conversion`` as without the plugin."""
    pytester.makepyfile(
        """
import gc
import pytest
import torch
from torch import nn

MODEL = nn.Linear(4, 4)


@pytest.mark.parametrize("which", ["built-at-import", "built-in-the-test"])
@pytest.mark.gpumem(device="cpu")
def test_swap(which):
    model = MODEL if which == "built-at-import" else nn.Linear(4, 4)
    gc.collect()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.weight.dtype == torch.float64
"""
    )
    run(pytester).assert_outcomes(passed=2)


THEIR_FREEZE = (
    STEP
    + """
LEAKS = []


@pytest.mark.gpumem(retained="0B")
def test_1_leaks():
    step()
    LEAKS.append(torch.ones(1000))

"""
    + LATER
)


@pytest.mark.slow
def test_after_a_census_gave_back_what_a_conftest_froze_later_tests_walk_what_they_made(
    pytester: pytest.Pytester,
) -> None:
    """A conftest froze objects itself (``gc.freeze()``), so the plugin's collector froze nothing;
    the leak report's census gave them back for good. The collector starts after that test, and
    the later tests' collections walk what they made, not the whole process."""
    pytester.makeconftest(COUNTING + "\nimport torch\n\ngc.freeze()  # the conftest's own\n")
    pytester.makepyfile(test_theirs=THEIR_FREEZE)
    result = run_fresh(pytester, "-s", "-p", "no:randomly", "--gpumem-leak-check")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*LEAKS*"])  # the census named the holder
    walked = _walked(result.stdout.str())
    for name in ("test_2_step", "test_3_step"):
        collections = walked[name][2]
        assert collections and max(collections) < BOUND, (name, collections)
