"""The plugin never keeps what the suite let go (its collector freeze included).

The objects alive before the first measured test are frozen (cheap collections per
test); nothing a test makes is ever frozen, so a reference cycle a test drops is freed
by the next collection: the user's own ``gc.collect()``, or the plugin's own at the next
test's start. These sessions run in a fresh process, where the plugin is the first to
freeze (in this suite's own process an earlier measured test may have frozen already).
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
