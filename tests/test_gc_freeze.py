"""The plugin never keeps what the suite let go (its collector's freezes included).

What the session imported or built is frozen (cheap collections per test): before the first
measured test, and between tests when a lot was left (the modules a first optimizer step
imports lazily, a cache a test filled). A full collection the plugin did not ask for (the
user's own ``gc.collect()``) is given every frozen object back first, so a reference cycle
a test drops is freed by it whenever the cycle was made; the plugin's own collections free
what a test made since the last freeze, and where a figure counts everything alive (an
emulated device limit, ``retained``) the plugin collects with everything given back. These
sessions run in a fresh process, where the plugin is the first to freeze (in this suite's
own process the suite's conftest has frozen everything already).
"""

from __future__ import annotations

import gc

import pytest

from conftest import run, run_fresh

CYCLES = """
import gc, sys, types, weakref
import pytest, torch

MiB = 2**20
HOLD, REF = {}, {}


# each maker returns the object to hold and a tensor that only the cycle keeps alive


class Node:
    def __init__(self):
        self.me = self                      # a reference cycle
        self.t = torch.ones(MiB // 4)


def node():
    n = Node()
    return n, n.t


def closure():
    t = torch.ones(MiB // 4)
    def f():
        return f, t                         # f's cell refers to f
    return f, t


def traceback():
    t = torch.ones(MiB // 4)
    try:
        raise ValueError("kept")
    except ValueError as exc:
        return exc, t                       # its traceback's frame holds t, and exc through it


def module_with_hook():
    model = torch.nn.Linear(512, 512)
    model.register_forward_hook(lambda m, i, o: model)   # the hook closes over the module
    return model, model.weight


def module_object():
    module = types.ModuleType("made_by_a_test")
    module.self = module
    module.t = torch.ones(MiB // 4)
    return module, module.t


MAKERS = {"object": node, "closure": closure, "traceback": traceback,
          "module hook": module_with_hook, "module": module_object}


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.gpumem(device="cpu")
def test_1_make(kind):
    HOLD[kind], tensor = MAKERS[kind]()
    REF[kind] = weakref.ref(tensor)


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.gpumem(device="cpu")
def test_2_drop_and_collect(kind):
    del HOLD[kind]
    gc.collect()
    assert REF[kind]() is None, f"the {kind} cycle is still alive after gc.collect()"


@pytest.mark.gpumem(device="cpu")
def test_3_make_64_mib_and_hold_it():
    node = Node()
    node.t = torch.ones(16 * MiB)
    HOLD["big"] = node


@pytest.mark.gpumem(device="cpu")
def test_4_drop_it_without_collecting():
    HOLD.clear()


@pytest.mark.gpumem(device="cpu", device_limit="32MiB")
def test_5_fits_in_32_mib():
    torch.ones(MiB)                         # fails if the dropped 64 MiB were still counted
"""


@pytest.mark.slow
def test_cycles_a_test_drops_are_freed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cycles=CYCLES)
    result = run_fresh(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=13)


#: The same cycles, frozen by the collector between tests before they are dropped: the first test
#: makes them all, then an optimizer step imports parts of torch lazily (over 100,000 objects), so
#: the collector freezes what is alive once the test is done. Later tests make a cache of 20,000
#: objects (what a suite builds as it runs) for the same effect.
FROZEN_CYCLES = (
    CYCLES.split("@pytest.mark.parametrize", 1)[0]
    + """
def build():                                # a cache a test fills: the collector freezes it
    HOLD.setdefault("bulk", []).append([[] for _ in range(20_000)])


def is_frozen(obj):
    from pytest_gpumem.measurement import gcfunctions  # gc's own functions: its wrappers give frozen objects back

    return gcfunctions.get_freeze_count() > 0 and not any(o is obj for o in gcfunctions.get_objects())


@pytest.mark.gpumem(device="cpu")
def test_1_make_them_all_then_import_lazily():
    for kind, maker in MAKERS.items():
        HOLD[kind], tensor = maker()
        REF[kind] = weakref.ref(tensor)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()                              # imports torch._dynamo, sympy, ...


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.gpumem(device="cpu")
def test_2_drop_a_frozen_cycle_and_collect(kind):
    assert is_frozen(HOLD[kind]), f"the {kind} cycle is not frozen: nothing is tested"
    del HOLD[kind]
    gc.collect()
    assert REF[kind]() is None, f"the frozen {kind} cycle is still alive after gc.collect()"


@pytest.mark.gpumem(device="cpu")
def test_3_make_64_mib_in_a_cycle_and_hold_it():
    node = Node()
    node.t = torch.ones(16 * MiB)
    HOLD["big"] = node
    build()


@pytest.mark.gpumem(device="cpu")
def test_4_drop_it_frozen_without_collecting():
    assert is_frozen(HOLD["big"])
    del HOLD["big"]


@pytest.mark.gpumem(device="cpu", device_limit="32MiB")
def test_5_fits_in_32_mib():
    torch.ones(MiB)                         # fails if the dropped 64 MiB were still counted
    # the collection before the test was given everything; what survived is frozen again, so
    # this test's own collections walk what it makes, not the whole process
    assert is_frozen(HOLD), "what the session built is not frozen again during the test"


@pytest.mark.gpumem(device="cpu", retained="0B")
def test_6_collect_then_drop_a_cycle_made_before():
    node = Node()
    gc.collect()                            # what survives it is frozen: the test's own objects too
    assert is_frozen(node)
    del node                                # garbage among frozen objects: retained must not count it


class Holder:
    def __init__(self):
        self.me = self


@pytest.mark.gpumem(device="cpu")
def test_7_hold_a_cycle_without_tensors():
    HOLD["holder"] = Holder()
    build()


@pytest.mark.gpumem(device="cpu", retained="0B")
def test_8_give_the_frozen_cycle_a_tensor_and_drop_it():
    assert is_frozen(HOLD["holder"])
    HOLD.pop("holder").t = torch.ones(MiB)  # garbage now: retained must not count it
"""
)


@pytest.mark.slow
def test_frozen_cycles_a_test_drops_are_freed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_frozen_cycles=FROZEN_CYCLES)
    result = run_fresh(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=12)


@pytest.mark.slow
def test_objects_someone_else_froze_stay_frozen_and_the_plugin_adds_none(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import gc
gc.collect()
gc.freeze()
FROZEN = gc.get_freeze_count()
"""
    )
    pytester.makepyfile(
        test_frozen="""
import gc, weakref
import pytest, torch
import conftest

HOLD, REF = {}, {}

@pytest.mark.gpumem(device="cpu")
def test_make():
    class Node:
        pass
    node = Node()
    node.me, node.t = node, torch.ones(1000)
    HOLD["n"], REF["n"] = node, weakref.ref(node)

@pytest.mark.gpumem(device="cpu")
def test_frozen_count_is_the_conftests_and_the_cycle_is_freed():
    assert 0 < gc.get_freeze_count() <= conftest.FROZEN  # frozen objects may die, none were added
    HOLD.clear()
    gc.collect()
    assert REF["n"]() is None
"""
    )
    run_fresh(pytester, "-p", "no:randomly").assert_outcomes(passed=2)


def test_a_session_inside_a_frozen_process_freezes_nothing_more(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_one="""
import pytest, torch

@pytest.mark.gpumem(device="cpu")
def test_one():
    torch.ones(10)
"""
    )
    before = gc.get_freeze_count()  # this suite's conftest freezes once collection is done
    run(pytester).assert_outcomes(passed=1)
    assert gc.get_freeze_count() <= before  # frozen objects may die; the session froze none


@pytest.mark.slow
def test_once_the_users_own_freeze_is_given_back_the_next_tests_are_frozen_again(pytester: pytest.Pytester) -> None:
    """A test that freezes and then unfreezes objects itself does not leave the rest of the run
    walking the whole process at every collection: the plugin freezes again after it."""
    pytester.makepyfile(
        test_own_freeze="""
import gc
import pytest, torch
from pytest_gpumem.measurement import collector

pytestmark = pytest.mark.gpumem(device="cpu")

def test_1_the_plugin_froze():
    assert collector.running() is not None

def test_2_freeze_and_give_back():
    gc.freeze()
    assert collector.running() is None  # the user's now
    gc.unfreeze()

def test_3_frozen_again():
    assert collector.running() is not None and collector.running().frozen
"""
    )
    run_fresh(pytester, "-p", "no:randomly").assert_outcomes(passed=3)
