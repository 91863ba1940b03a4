"""The framework adapters with the real frameworks, on the CPU engine: a Hugging Face
``Trainer``, a Lightning ``Trainer.fit`` and an ``accelerate`` loop are measured as a test's
own step would be: Ψ of the model, one span per training step with its forward, backward
and optimizer phases, the breakdown's parameters and optimizer state to the byte, and a
limit that is too small fails with the plugin's message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import needs, run_fresh

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
F32 = 4


def measured(pytester: pytest.Pytester, example: str, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    """Run ``examples/<example>`` in a fresh process; its result and the JSON report's only test."""
    pytester.makepyfile(**{Path(example).stem: (ROOT / "examples" / example).read_text()})
    report = pytester.path / "report.json"
    result = run_fresh(pytester, f"--gpumem-json={report}", *args)
    (test,) = json.loads(report.read_text())["tests"]
    return result, test


def check_steps(test: dict[str, Any], psi: int, tensors: int, *, gradients_kept: bool) -> None:
    spans = {m["name"]: m for m in test["measurements"]}
    assert list(spans) == ["call", "step1", "step2", "step3"]
    for name in ("step1", "step2", "step3"):
        assert spans[name]["psi"] == psi
        assert list(spans[name]["phases"]) == ["forward", "backward", "optimizer"]
    # the last step's peak: the parameters (4Ψ) and AdamW's state (8Ψ and a float32 step counter
    # per parameter tensor), both counted to the byte under their categories
    peak = spans["step3"]["breakdown"]
    assert peak["parameters"] == F32 * psi
    assert peak["optimizer_state"] == 2 * F32 * psi + F32 * tensors
    # what stays allocated at the end of the call
    end = spans["call"]["allocated_breakdown"]
    assert end["parameters"] == F32 * psi and end["optimizer_state"] == 2 * F32 * psi + F32 * tensors
    assert end["gradients"] == (F32 * psi if gradients_kept else 0)


@pytest.mark.slow
def test_a_hugging_face_trainer_is_measured_step_by_step(pytester: pytest.Pytester) -> None:
    needs("transformers")
    result, test = measured(pytester, "test_hf_trainer.py")
    result.assert_outcomes(passed=1)
    # GPT-2, 2 layers, d=64, vocab 128, 32 positions (the head is tied to the token embedding)
    psi = 128 * 64 + 32 * 64 + 2 * (4 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64))
    psi += 2 * 64
    check_steps(test, psi, tensors=2 + 2 * 12 + 2, gradients_kept=False)


@pytest.mark.slow
def test_a_lightning_fit_is_measured_step_by_step(pytester: pytest.Pytester) -> None:
    needs("lightning")
    result, test = measured(pytester, "test_lightning.py")
    result.assert_outcomes(passed=1)
    check_steps(test, 64 * 256 + 256 + 256 * 64 + 64, tensors=4, gradients_kept=True)


@pytest.mark.slow
def test_an_accelerate_loop_is_measured_step_by_step(pytester: pytest.Pytester) -> None:
    needs("accelerate")
    result, test = measured(pytester, "test_accelerate.py")
    result.assert_outcomes(passed=1)
    check_steps(test, 64 * 256 + 256 + 256 * 64 + 64, tensors=4, gradients_kept=False)


@pytest.mark.slow
def test_a_limit_too_small_for_a_trainer_step_fails_with_the_plugins_message(pytester: pytest.Pytester) -> None:
    needs("transformers")
    source = (ROOT / "examples" / "test_hf_trainer.py").read_text().replace('peak="16MiB"', 'peak="1MiB"')
    pytester.makepyfile(test_hf_trainer=source)
    result = run_fresh(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*peak cost * exceeds the limit 1.00 MiB (1MiB) by *"])


@pytest.mark.slow
def test_the_adapters_run_with_the_plugin_disabled(pytester: pytest.Pytester) -> None:
    """Under ``--gpumem-disable`` the callbacks still open their spans (unmeasured): the examples pass."""
    needs("transformers", "lightning", "accelerate")
    for example in ("test_hf_trainer.py", "test_lightning.py", "test_accelerate.py"):
        pytester.makepyfile(**{Path(example).stem: (ROOT / "examples" / example).read_text()})
    run_fresh(pytester, "--gpumem-disable").assert_outcomes(passed=3)


def test_unwrap_finds_the_torch_objects_inside_the_wrappers() -> None:
    import torch

    from pytest_gpumem.integrations import unwrap

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert unwrap(model) is model and unwrap(optimizer) is optimizer
    compiled = torch.compile(model, backend="eager")
    assert unwrap(compiled) is model  # compiled, not run: nothing is cached
    wrapped = torch.nn.DataParallel(model)
    assert unwrap(wrapped) is model
    # accelerate's AcceleratedOptimizer: the accelerate example's optimizer state of 8Ψ above
    # is counted on the torch optimizer inside it
