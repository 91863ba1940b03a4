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

import re

import pytest

from conftest import run_fresh

#: Counts, per test, the objects each full collection walks as it starts, and says which
#: modules the first test imported.
COUNTING = """
import gc, sys
import pytest

WALKED = {}
CURRENT = []
MODULES = {}


def _count(phase, info):
    if phase == "start" and info["generation"] == 2 and CURRENT:
        WALKED.setdefault(CURRENT[-1], []).append(len(gc.get_objects()))


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

LAZY = """
import pytest, torch


def step():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()


@pytest.mark.gpumem(peak="1GiB")
def test_1_first_step_imports_lazily():
    step()


@pytest.mark.gpumem(peak="1GiB")
def test_2_step():
    step()


@pytest.mark.gpumem(peak="1GiB")
def test_3_step():
    step()
"""

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
