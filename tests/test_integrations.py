"""The framework adapters with the real frameworks, on the CPU engine: a Hugging Face
``Trainer``, a Lightning ``Trainer.fit`` and an ``accelerate`` loop are measured as a test's
own step would be: Ψ of the model, one span per training step with its forward, backward
and optimizer phases, the breakdown's parameters and optimizer state to the byte, and a
limit that is too small fails with the plugin's message.

The examples run in processes of their own (importing a framework in the suite's process would
change what later tests measure), in two sessions shared by the tests (:func:`runs`): the three
examples and the Trainer's with a limit too small, then the three under ``--gpumem-disable``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from conftest import needs
from tests._sessions_batch import Ran, Session, run_batch

ROOT = Path(__file__).resolve().parent.parent
F32 = 4

#: The examples, by the module each runs as in the shared sessions, and the package each needs.
EXAMPLES = {"test_hf_trainer.py": "transformers", "test_lightning.py": "lightning", "test_accelerate.py": "accelerate"}
#: The Trainer's example with a limit too small for its step.
SMALL_LIMIT = "test_hf_trainer_1mib.py"


def _example(name: str) -> str:
    return (ROOT / "examples" / name).read_text()


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, Ran]:
    """The module's two sessions, by name, with the frameworks installed: ``measured`` (each
    example, then the Trainer's with ``peak="1MiB"``; a JSON report) and ``disabled`` (the three
    examples under ``--gpumem-disable``, when all three frameworks are installed)."""
    has = {name: importlib.util.find_spec(name) is not None for name in set(EXAMPLES.values())}
    measured = {name: _example(name) for name, package in EXAMPLES.items() if has[package]}
    if has["transformers"]:
        measured[SMALL_LIMIT] = _example("test_hf_trainer.py").replace('peak="16MiB"', 'peak="1MiB"')
    sessions = {"measured": Session((), measured)}
    if all(has.values()):
        sessions["disabled"] = Session(("--gpumem-disable",), {name: _example(name) for name in EXAMPLES})
    sessions = {name: session for name, session in sessions.items() if session.modules}
    return dict(zip(sessions, run_batch(request, "integrations", list(sessions.values())), strict=True))


def measured(runs: dict[str, Ran], example: str) -> dict[str, Any]:
    """The JSON report's entry of ``examples/<example>``'s only test, which passed."""
    ran = runs["measured"]
    (test,) = [test for test in ran.report["tests"] if test["nodeid"].startswith(f"{example}::")]
    assert ran.outcome(test["nodeid"]) == "passed", ran.result.stdout.str()[-6000:]
    return test


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
def test_a_hugging_face_trainer_is_measured_step_by_step(runs: dict[str, Ran]) -> None:
    needs("transformers")
    test = measured(runs, "test_hf_trainer.py")
    # GPT-2, 2 layers, d=64, vocab 128, 32 positions (the head is tied to the token embedding)
    psi = 128 * 64 + 32 * 64 + 2 * (4 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64))
    psi += 2 * 64
    check_steps(test, psi, tensors=2 + 2 * 12 + 2, gradients_kept=False)


@pytest.mark.slow
def test_a_lightning_fit_is_measured_step_by_step(runs: dict[str, Ran]) -> None:
    needs("lightning")
    test = measured(runs, "test_lightning.py")
    check_steps(test, 64 * 256 + 256 + 256 * 64 + 64, tensors=4, gradients_kept=True)


@pytest.mark.slow
def test_an_accelerate_loop_is_measured_step_by_step(runs: dict[str, Ran]) -> None:
    needs("accelerate")
    test = measured(runs, "test_accelerate.py")
    check_steps(test, 64 * 256 + 256 + 256 * 64 + 64, tensors=4, gradients_kept=False)


@pytest.mark.slow
def test_a_limit_too_small_for_a_trainer_step_fails_with_the_plugins_message(runs: dict[str, Ran]) -> None:
    needs("transformers")
    ran = runs["measured"]
    (test,) = [test for test in ran.report["tests"] if test["nodeid"].startswith(f"{SMALL_LIMIT}::")]
    assert ran.outcome(test["nodeid"]) == "failed", ran.result.stdout.str()[-6000:]
    failure = ran.section(test["nodeid"].split("::")[-1])
    pytest.LineMatcher(failure.splitlines()).fnmatch_lines(["*peak cost * exceeds the limit 1.00 MiB (1MiB) by *"])


@pytest.mark.slow
def test_the_adapters_run_with_the_plugin_disabled(runs: dict[str, Ran]) -> None:
    """Under ``--gpumem-disable`` the callbacks still open their spans (unmeasured): the examples pass."""
    needs("transformers", "lightning", "accelerate")
    runs["disabled"].result.assert_outcomes(passed=3)


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
