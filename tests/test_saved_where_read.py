"""A marked test counts what autograd saves for backward (the ``activations`` category, ``saved
for backward``) only where its plan reads it: the breakdown asked for, a baseline, the gpumem
fixture. Elsewhere the saved-tensor hooks are never pushed, activations are n/a and counted among
temporaries, and every total stays the same to the byte (docs/figures.md, "Activations: where
the plan reads them")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run

STEP = """
import pytest
import torch

HOOKS = {}


def step(name):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16, requires_grad=True)
    HOOKS[name] = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    net(x).pow(2).sum().backward()
    with open(name + ".hooks", "w") as out:
        out.write(str(HOOKS[name]))

"""


def _records(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    return {test["nodeid"].split("::")[-1]: test for test in data["tests"]}


def _call(record: dict) -> dict:
    return next(m for m in record["measurements"] if m["name"] == "call")


def test_a_limit_only_test_pushes_no_saved_tensor_hooks_and_its_totals_match(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_activations_plan=STEP
        + """
@pytest.mark.gpumem(peak="1GiB")
def test_limit_only():
    step("limit_only")


@pytest.mark.gpumem(peak="1GiB", breakdown=True)
def test_breakdown():
    step("breakdown")
"""
    )
    result = run(pytester, "--gpumem-json=report.json", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert (pytester.path / "limit_only.hooks").read_text() == "False"
    assert (pytester.path / "breakdown.hooks").read_text() == "True"
    records = _records(pytester.path / "report.json")
    plain, full = _call(records["test_limit_only"]), _call(records["test_breakdown"])
    assert plain["saved_activations"] is None
    assert "activations" not in plain["breakdown"]
    assert full["saved_activations"] > 0
    assert full["breakdown"]["activations"] >= 0
    for figure in ("peak", "allocated"):  # the same step: the totals do not depend on the accounting
        assert plain[figure] - plain["start"] == full[figure] - full["start"]
    assert sum(plain["breakdown"].values()) == plain["peak"]
    assert sum(full["breakdown"].values()) == full["peak"]


def test_a_failure_says_activations_are_among_temporaries(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_activations_plan=STEP
        + """
@pytest.mark.gpumem(peak="1KB")
def test_too_big():
    step("too_big")
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "peak at the peak beyond the model states: temporaries (activations among them) *",
            "*activations n/a*",
            "activations n/a: counted among temporaries in this test; breakdown=True (or a*",
        ]
    )


def test_a_baseline_or_the_fixture_turns_the_accounting_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_activations_plan=STEP
        + """
@pytest.mark.gpumem(peak="1GiB")
def test_baselined():
    step("baselined")


@pytest.mark.gpumem(peak="1GiB")
def test_fixture(gpumem):
    step("fixture")


@pytest.mark.gpumem(peak="1GiB")
def test_plain():
    step("plain")
"""
    )
    run(pytester, "--gpumem-update-baselines", "-k", "baselined").assert_outcomes(passed=1, deselected=2)
    assert (pytester.path / "baselined.hooks").read_text() == "True"  # a run that writes baselines
    (pytester.path / "baselined.hooks").unlink()
    result = run(pytester, "--gpumem-json=report.json", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    hooks = {name: (pytester.path / f"{name}.hooks").read_text() for name in ("baselined", "fixture", "plain")}
    assert hooks == {"baselined": "True", "fixture": "True", "plain": "False"}
    records = _records(pytester.path / "report.json")
    assert _call(records["test_baselined"])["saved_activations"] > 0
    assert "activations" in _call(records["test_baselined"])["breakdown"]
    assert _call(records["test_plain"])["saved_activations"] is None
