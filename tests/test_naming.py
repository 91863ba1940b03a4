"""A failure speaks the user's code: an out-of-memory error under an emulated device limit
shows the test's line and its helper's, as a GPU's would, and leaked or live tensors of
modules and optimizers that user code holds at module level are named as the code reads
them (``model.weight.grad``, ``MODELS['big'].weight``, ``opt.state[model.weight]['exp_avg']``)."""

from __future__ import annotations

import re

import pytest

from conftest import run, run_fresh

pytest_plugins = ["pytester"]

OOM = """
import pytest, torch

def make_activations():
    return torch.ones(64, 1024, 1024)  # 256 MiB: the line that allocates

@pytest.mark.gpumem(device_limit="64MiB")
def test_step():
    x = make_activations()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tb", ["auto", "long", "short"])
def test_an_emulated_out_of_memory_error_shows_the_users_lines(pytester: pytest.Pytester, tb: str) -> None:
    pytester.makepyfile(test_oom_lines=OOM)
    result = run(pytester, f"--tb={tb}")
    result.assert_outcomes(failed=1)
    failure = result.stdout.str().split("= FAILURES =")[1].split("- gpumem -")[0]
    assert "x = make_activations()" in failure  # the test's line
    assert "return torch.ones(64, 1024, 1024)" in failure  # the helper's line, the last one shown
    for internal in ("tracker.py", "logging.py", "eval_frame.py", "_compile.py", "pluggy"):
        assert internal not in failure, failure
    assert "test_oom_lines.py:4" in failure  # the helper's line (the file's 4th) is where it is reported
    assert failure.index("x = make_activations()") < failure.index("return torch.ones(64, 1024, 1024)")


LEAKS = """
import pytest, torch

model = torch.nn.Linear(256, 256)
MODELS = {}

class Holder:
    pass

HOLDER = Holder()

@pytest.mark.gpumem(retained="0B")
def test_global_model_keeps_its_gradients():
    model(torch.ones(8, 256)).sum().backward()

@pytest.mark.gpumem(retained="0B")
def test_a_model_kept_in_a_global_dict():
    MODELS["big"] = torch.nn.Linear(128, 512)

@pytest.mark.gpumem(retained="0B")
def test_a_model_kept_as_an_attribute_of_a_global():
    HOLDER.net = torch.nn.Linear(64, 1024)
"""


@pytest.mark.slow
def test_leaks_through_module_level_objects_are_named_as_the_code_reads_them(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_held=LEAKS)
    result = run_fresh(pytester, "-p", "no:randomly")
    result.assert_outcomes(failed=3)
    text = result.stdout.str()
    sections = text.split("= FAILURES =")[1]
    gradients, in_dict, attribute = sections.split("______ test_")[1:4]
    assert "256.00 KiB  256×256  float32  gradients  model.weight.grad" in gradients
    assert "1.00 KiB    256      float32  gradients  model.bias.grad" in gradients
    assert "MODELS['big'].weight" in in_dict and "MODELS['big'].bias" in in_dict
    assert "HOLDER.net.weight" in attribute and "HOLDER.net.bias" in attribute
    assert "unknown" not in sections.split("figures on")[0]
    assert "_parameters" not in text


OOM_REPORT = """
import pytest, torch

model = torch.nn.Linear(512, 512)
opt = torch.optim.AdamW(model.parameters())

@pytest.mark.gpumem(device_limit="8MiB")
def test_step():
    model(torch.ones(4, 512)).sum().backward()
    opt.step()  # AdamW's state: two more copies of the weights
    torch.ones(4, 1024, 1024)  # 16 MiB: does not fit
"""


@pytest.mark.slow
def test_an_out_of_memory_report_names_module_level_models_and_optimizers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_oom_report=OOM_REPORT)
    result = run_fresh(pytester)
    result.assert_outcomes(failed=1)
    table = result.stdout.str().split("largest live tensors")[1].split("- gpumem artifacts -")[0]
    for name in (
        "model.weight",
        "model.weight.grad",
        "opt.state[model.weight]['exp_avg']",
        "opt.state[model.weight]['exp_avg_sq']",
    ):
        assert f"  {name}\n" in table, table
    assert "unknown" not in table.split("\n")[3]  # the largest tensors all have names


LEFT_BEHIND = """
import pytest, torch

class Compiled:  # what a compiler's cache looks like to a report: an object holding tensors
    def __init__(self):
        self.constants = {"w": torch.ones(1024, 1024)}

CACHE = []

def test_a_compile_leaves_tensors_behind():
    CACHE.append(Compiled())

@pytest.mark.gpumem(device_limit="8MiB")
def test_the_next_test_runs_out_of_memory():
    torch.ones(2, 1024, 1024)
"""


@pytest.mark.slow
def test_an_out_of_memory_report_names_what_an_earlier_test_left_behind(pytester: pytest.Pytester) -> None:
    """The new-user trial's out-of-memory report listed 290 MiB of tensors that an earlier
    test left alive as "held by unknown": the report names their holder when Python holds it."""
    pytester.makepyfile(test_left_behind=LEFT_BEHIND)
    result = run_fresh(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    table = result.stdout.str().split("largest live tensors")[1].split("- gpumem artifacts -")[0]
    # two levels up the referrers: the dict, and the object whose attribute it is
    assert re.search(r"4\.00 MiB  1024×1024  float32  other +Compiled\.constants\['w'\]", table), table
