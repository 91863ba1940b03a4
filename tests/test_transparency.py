"""A suite behaves under the plugin as it does without it, except the memory verdicts it asks for:
objects stay the user's (copy, pickle, torch.save), torch's own machinery keeps working
(torch.func, disable_saved_tensors_hooks), the garbage collector shows the user everything and
frees what the suite drops, bad devices are clear errors, and folders named with "::" keep their
baselines. The whole corpus of user-style tests is compared in tests/test_differential.py."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run, run_fresh
from pytest_gpumem import measure
from pytest_gpumem.baselines import load
from pytest_gpumem.cli import main
from pytest_gpumem.data.figures import PartialFigures
from pytest_gpumem.measurement.engines.savedhooks import STEPPED_ASIDE_NOTE


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()


def test_a_tracked_model_and_optimizer_can_be_copied_pickled_and_saved() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with measure("step", track=(model, optimizer)) as span:
        _step(model, optimizer)
        twin = copy.deepcopy(model)  # an EMA copy, inside the measurement
        copy.deepcopy(optimizer)
        pickle.loads(pickle.dumps(model))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        averaged = torch.optim.swa_utils.AveragedModel(model)
        averaged.update_parameters(model)
        twin.load_state_dict(model.state_dict())
    assert span.phases  # the hooks still saw the step
    # nothing of the plugin's stays on the objects or in torch's global hooks
    assert not model._forward_hooks and not model._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_torch_func_and_disabled_saved_tensor_hooks_run_and_the_figures_say_what_was_not_counted() -> None:
    x = torch.randn(16, requires_grad=True)
    with warnings.catch_warnings(), measure("func") as span:
        # a note of torch's refusal is no warning (-W error stays green)
        warnings.simplefilter("error", PartialFigures)
        torch.func.grad(lambda x: (x.sin() * x).sum())(x)
        torch.func.jacrev(lambda x: x.sin() * x)(x)
        torch.func.hessian(lambda x: (x.sin() * x).sum())(x)
        torch.func.vmap(torch.func.grad_and_value(lambda x: (x.sin() * x).sum()))(torch.randn(2, 16))
        with torch.autograd.graph.disable_saved_tensors_hooks("the user's own message"):
            (x * x).sum().backward()
            refused = pytest.raises(RuntimeError, match="the user's own message")  # torch's refusal, as without
            with refused, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                pass
        (x.sin() * x).sum().backward()  # counted again
    assert STEPPED_ASIDE_NOTE in span.measurement.notes
    assert span.measurement.saved_activations is not None and span.measurement.saved_activations >= 16 * 4
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None  # nothing left pushed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--gpumem-device=cuda:00",), "--gpumem-device / ini gpumem_device: device='cuda:00' is not a device"),
        (
            ("--gpumem-device=cuda:99999999999999999999",),
            "--gpumem-device / ini gpumem_device: device='cuda:99999999999999999999' is not a device",
        ),
        (("--gpumem-device=cuda:128",), "(N from 0 to 127, without leading zeros)"),
    ],
)
def test_a_malformed_device_option_is_a_usage_error_that_names_it(
    pytester: pytest.Pytester, args: tuple[str, ...], message: str
) -> None:
    pytester.makepyfile(test_d="def test_x():\n    pass\n")
    result = run(pytester, *args, device=None)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


def test_a_malformed_device_on_a_marker_is_an_error_that_names_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_d='import pytest\n\n@pytest.mark.gpumem(device="cuda:99999999999999999999")\ndef test_x():\n    pass\n'
    )
    result = run(pytester, device=None)
    assert result.ret != pytest.ExitCode.OK
    text = result.stdout.str()
    assert "invalid gpumem marker on test_d.py::test_x: device='cuda:99999999999999999999' is not a device" in text
    assert "INTERNALERROR" not in text


def test_baselines_under_a_folder_named_with_colons_are_never_pruned_by_a_partial_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = pytester.path / "suite::gpu"
    folder.mkdir()
    (folder / "test_a.py").write_text(
        "import pytest, torch\n\n"
        "@pytest.mark.gpumem\ndef test_one():\n    torch.ones(100)\n\n"
        "@pytest.mark.gpumem\ndef test_two():\n    torch.ones(200)\n"
    )
    every = ["suite::gpu/test_a.py::test_one", "suite::gpu/test_a.py::test_two"]
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=2)  # pytest takes no such folder as an argument
    path = pytester.path / "gpumem-baselines.json"
    (environment,) = load(path).environment_keys()
    assert list(load(path).tests(environment)) == every
    narrowed = run(pytester, "-k", "test_one", "--gpumem-update-baselines", "--gpumem-prune")
    narrowed.assert_outcomes(passed=1)
    assert list(load(path).tests(environment)) == every
    monkeypatch.chdir(pytester.path)
    assert main(["baselines", "prune", "--missing"]) == 0
    assert list(load(path).tests(environment)) == every


#: Tests that drop a 32 MiB tensor held in a reference cycle at each fixture's teardown, and a
#: cache of 20,000 objects a test fills (so that the collector freezes between tests).
CYCLES = """
import gc, weakref
import pytest, torch

DROPPED = []
CACHE = []


class Cycle:
    def __init__(self):
        self.me = self
        self.tensor = torch.ones(8 * 2**20)  # 32 MiB


@pytest.fixture
def held():
    cycle = Cycle()
    DROPPED.append(weakref.ref(cycle.tensor))
    yield cycle


@pytest.mark.gpumem
@pytest.mark.parametrize("n", range(12))
def test_holds_a_cycle(held, n):
    CACHE.append([[] for _ in range(20_000)])


def test_zz_what_is_still_alive():
    alive = sum(ref() is not None for ref in DROPPED)
    print("\\nALIVE", alive)
"""


@pytest.mark.slow
def test_cycles_dropped_at_teardown_are_freed_as_without_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cycles=CYCLES)
    alive = {}
    for plugin in ("gpumem", "no:gpumem"):
        off = ["-p", plugin] if plugin.startswith("no:") else []
        result = run_fresh(pytester, "-s", "-p", "no:randomly", *off, device=None)
        result.assert_outcomes(passed=13)
        (line,) = [line for line in result.stdout.lines if line.startswith("ALIVE")]
        alive[plugin] = int(line.split()[1])
    # without the plugin the interpreter's own collections free them (a few may wait for the next);
    # the plugin keeps none alive longer: it never freezes what a collection would free
    assert alive["gpumem"] <= alive["no:gpumem"] + 1, alive


#: What a user's leak check sees: objects made before the first measured test (the collector
#: froze them) and after, in gc.get_objects() and gc.get_referrers(), with and without the plugin.
GC_VIEW = """
import gc
import pytest, torch

MADE_AT_IMPORT = torch.ones(3)
HOLDER = {"kept": MADE_AT_IMPORT}


@pytest.mark.gpumem
def test_1_measured():
    torch.ones(10)


def test_2_counts_tensors_after_collecting():
    gc.collect()
    assert any(obj is MADE_AT_IMPORT for obj in gc.get_objects())
    assert any(obj is HOLDER for obj in gc.get_referrers(MADE_AT_IMPORT))


def test_3_counts_without_collecting():
    assert any(obj is MADE_AT_IMPORT for obj in gc.get_objects())
    assert gc.get_freeze_count() == 0


def test_4_freezes_itself():
    gc.freeze()
    assert gc.get_freeze_count() > 0
    assert not any(obj is MADE_AT_IMPORT for obj in gc.get_objects())
    gc.unfreeze()
    assert any(obj is MADE_AT_IMPORT for obj in gc.get_objects())


@pytest.mark.gpumem
def test_5_measured_after_the_users_freeze():
    torch.ones(10)
    assert gc.isenabled()
"""


@pytest.mark.slow
def test_the_garbage_collectors_view_is_the_users(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_view=GC_VIEW)
    for args in ((), ("-p", "no:gpumem")):
        run_fresh(pytester, "-p", "no:randomly", *args, device=None).assert_outcomes(passed=5)


def test_the_collector_leaves_a_users_gc_disable_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_off="""
import gc
import pytest, torch


def test_1_switches_it_off():
    gc.disable()


@pytest.mark.gpumem
def test_2_measured():
    torch.ones(10)
    assert not gc.isenabled()


def test_3_still_off():
    assert not gc.isenabled()
    gc.enable()
"""
    )
    enabled = gc.isenabled()
    try:
        run(pytester, "-p", "no:randomly").assert_outcomes(passed=3)
    finally:
        if enabled:
            gc.enable()


def test_nothing_is_left_in_gcs_place_after_a_run(pytester: pytest.Pytester) -> None:
    before = {name: getattr(gc, name) for name in ("get_objects", "get_referrers", "freeze", "unfreeze")}
    pytester.makepyfile(test_one="import pytest, torch\n\n@pytest.mark.gpumem\ndef test_x():\n    torch.ones(10)\n")
    run(pytester).assert_outcomes(passed=1)
    assert {name: getattr(gc, name) for name in before} == before
    assert os.environ.get("PYTEST_GPUMEM_DISABLE") is None
    assert Path(__file__).exists()


#: Ten tests whose fixtures drop a 64 MiB tensor in a reference cycle at teardown, then an
#: emulated device and a microbatch search: what they find must not depend on the ten before.
ORDER = """
import pytest, torch

CACHE = []


class Cycle:
    def __init__(self):
        self.me = self
        self.tensor = torch.ones(16 * 2**20)  # 64 MiB


@pytest.fixture
def held():
    yield Cycle()


@pytest.mark.parametrize("n", range(10))
def test_a_drops_a_cycle(held, n):
    CACHE.append([[] for _ in range(20_000)])  # the collector freezes between these tests


def test_b_finds_the_largest_microbatch(gpumem):
    found = gpumem.max_microbatch(lambda n: torch.ones(n, 2**18), limit="256MiB", upper=1024)  # 1 MiB a row
    print("\\nFOUND", found)


@pytest.mark.gpumem(device="cpu", device_limit="256MiB")
def test_c_fits_under_the_emulated_device():
    torch.ones(48 * 2**20)  # 192 MiB
"""


@pytest.mark.slow
def test_emulated_limits_and_microbatch_searches_do_not_depend_on_test_order(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_order=ORDER)
    found = {}
    for selection in ("test_b or test_c", "test_a or test_b or test_c"):
        result = run_fresh(pytester, "-s", "-p", "no:randomly", "-k", selection)
        result.assert_outcomes(passed=2 if selection.startswith("test_b") else 12)
        found[selection] = [line for line in result.stdout.lines if line.startswith("FOUND")]
    assert found["test_b or test_c"] == found["test_a or test_b or test_c"] != []
