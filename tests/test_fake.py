"""Fake mode (``fake=True``): the H100 prediction of a step that runs on fake tensors, no data.

On the zoo steps that do not branch on fake tensors (``mlp`` and ``block``, fp32 and bf16) the
fake run's figures equal the real-tensor prediction's to the byte, span and phases included.
The ``transformers`` models take another path when they see fake tensors (docs/prediction.md).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from conftest import run, run_fresh
from pytest_gpumem import Measurement, max_microbatch, measure
from pytest_gpumem.measurement.engines.fake import REDUCED_IN_PLACE, FakeModeError, fake_mode
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.validate.zoo import zoo

_LOSSES = {
    torch.ops.aten.mse_loss.default: lambda a, b, reduction: F.mse_loss(a, b, reduction=reduction),
    torch.ops.aten.smooth_l1_loss.default: lambda a, b, reduction: F.smooth_l1_loss(a, b, reduction=reduction),
    torch.ops.aten.soft_margin_loss.default: lambda a, b, reduction: F.soft_margin_loss(a, b, reduction=reduction),
    torch.ops.aten.binary_cross_entropy.default: lambda a, b, reduction: F.binary_cross_entropy(
        a, b, reduction=reduction
    ),
}


def test_every_kernel_rule_has_a_check() -> None:
    assert set(_LOSSES) == set(REDUCED_IN_PLACE)


@pytest.mark.parametrize("op", list(_LOSSES), ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_fake_loss_holds_the_storage_the_cpu_kernel_holds(op: Any, reduction: str) -> None:
    """The CPU kernels leave a reduced loss in the storage of the unreduced one (never shrunk by
    the resize to 0-dim); so do the CUDA kernels, which share the code. Fake mode does the same."""
    loss = _LOSSES[op]
    a, b = torch.rand(32, 48), torch.rand(32, 48)
    real = loss(a, b, reduction).untyped_storage().nbytes()
    with fake_mode():
        fake_out = loss(torch.rand(32, 48), torch.rand(32, 48), reduction)
        assert isinstance(fake_out, FakeTensor)
        fake = fake_out.untyped_storage().nbytes()
    assert fake == real == 32 * 48 * 4  # not the 4 B of a 0-dim tensor: the rule is needed


def _figures(m: Measurement) -> dict[str, Any]:
    return {
        "start": m.start,
        "peak": m.peak,
        "allocated": m.allocated,
        "reserved": m.reserved,
        "breakdown": m.breakdown,
        "allocated_breakdown": m.allocated_breakdown,
        "saved_activations": m.saved_activations,
        "psi": m.psi,
        "phases": {name: (p.start, p.peak, p.end, p.count) for name, p in m.phases.items()},
    }


def _zoo_step(name: str, precision: str, *, fake: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The zoo step built and warmed up inside one prediction, then a measured step: the figures
    of the step and of the whole block."""
    (model,) = zoo("small", (name,))
    cpu = torch.device("cpu")
    with measure("whole", device="cpu", predict="h100", fake=fake) as whole:
        step = model.build(cpu, precision)
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
        with measure("step", track=(step.model, step.optimizer), fake=fake) as span:
            run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
        if fake:
            assert all(isinstance(p, FakeTensor) for p in step.model.parameters())
    return _figures(span.measurement), _figures(whole.measurement)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "block"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fake_prediction_equals_the_real_tensor_prediction_to_the_byte(name: str, precision: str) -> None:
    real = _zoo_step(name, precision, fake=False)
    fake = _zoo_step(name, precision, fake=True)
    assert fake == real
    assert real[0]["peak"] > real[0]["start"] > 0


_LARGE_STEP = """
import resource, torch
from pytest_gpumem import measure

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()  # torch's lazy imports, before the reading
before = peak()
with measure("build", device="cpu", predict="h100", fake=True):
    model = torch.nn.Sequential(torch.nn.Linear(32768, 32768), torch.nn.Linear(32768, 32768))
    optimizer = torch.optim.AdamW(model.parameters())
    with measure("step", track=(model, optimizer), fake=True) as span:
        model(torch.randn(8, 32768)).sum().backward()
        optimizer.step()
end = span.measurement.allocated_breakdown
print(peak() - before, span.measurement.psi, end["parameters"], end["gradients"], end["optimizer_state"])
"""


@pytest.mark.slow
def test_a_model_larger_than_the_machine_allocates_nothing() -> None:
    """2.1 B fp32 parameters with AdamW (34 GiB on the device), predicted in a fresh process
    whose peak memory grows by less than 512 MiB."""
    done = subprocess.run([sys.executable, "-c", _LARGE_STEP], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    grown, psi, parameters, gradients, optimizer_state = map(int, done.stdout.split())
    assert psi == 2 * (32768 * 32768 + 32768)
    assert (parameters, gradients) == (4 * psi, 4 * psi)
    # exp_avg and exp_avg_sq; AdamW's step counters live on the host on a GPU
    assert optimizer_state == 8 * psi
    assert grown < 512 * 1024 * 1024


def _blocks(nbytes: int) -> int:
    """``nbytes`` in the caching allocator's 512-byte blocks."""
    return -(-nbytes // 512) * 512


@pytest.mark.slow
def test_a_gpt2_xl_step_holds_its_budget_term_by_term() -> None:
    """GPT-2 XL (1.56 B parameters in 580 tensors; fp32, AdamW, batch 1 × 1,024) on fake tensors:
    after the step, each model state is the budget's term plus the allocator's rounding of each
    tensor to 512-byte blocks (86,784 B over the 580 parameters), the step counters are on the
    host (the budget of the CPU run counts their 4 bytes each), and what the step keeps beside
    them is named: the logits and the loss it returned, the token ids, the cuBLAS workspaces
    (and the allocator's blocks that it did not split)."""
    from pytest_gpumem import model_states
    from pytest_gpumem.validate.gpt2 import gpt2

    with measure("step", device="cpu", predict="h100", fake=True) as span:
        model = gpt2("gpt2-xl")
        optimizer = torch.optim.AdamW(model.parameters())
        span.recorder.track(model, optimizer)
        tokens = torch.randint(0, model.config.vocab_size, (1, 1024))
        logits, loss = model(tokens, tokens)
        loss.backward()
        optimizer.step()
        budget = model_states(model, optimizer, "fp32")
        sizes = [4 * p.numel() for p in model.parameters()]
        workspaces = span.recorder.engine.workspaces
    psi = span.measurement.psi
    assert psi == 1_557_611_200 and len(sizes) == 580
    rounding = sum(map(_blocks, sizes)) - 4 * psi
    assert rounding == 86_784
    assert budget.items == {
        "parameters": 4 * psi,
        "gradients": 4 * psi,
        "exp_avg": 4 * psi,
        "exp_avg_sq": 4 * psi,
        "step counters": 4 * 580,
    }
    end = span.measurement.allocated_breakdown
    assert end is not None
    assert end["parameters"] == budget.items["parameters"] + rounding
    assert end["gradients"] == budget.items["gradients"] + rounding
    assert end["optimizer_state"] == budget.items["exp_avg"] + budget.items["exp_avg_sq"] + 2 * rounding
    assert end["parameters"] + end["gradients"] + end["optimizer_state"] == budget.total + 4 * rounding - 580 * 4
    kept = _blocks(logits.numel() * 4) + _blocks(loss.numel() * 4) + _blocks(tokens.numel() * 8)
    assert end["temporaries"] == kept == 205_861_376
    assert end["activations"] == 0
    assert workspaces == 68_157_440 and end["other"] >= workspaces
    assert span.measurement.allocated == sum(end.values())


def _line_of(marker: str) -> int:
    """The number of the line of this file that ends with ``marker``."""
    with open(__file__, encoding="utf-8") as source:
        return next(number for number, text in enumerate(source, 1) if text.rstrip().endswith(marker))


def test_a_value_the_step_needs_is_an_error_naming_the_line() -> None:
    with pytest.raises(FakeModeError) as caught, measure("step", device="cpu", predict="h100", fake=True):
        x = torch.randn(4, 4)
        if x.sum().item() > 0:  # the line named: .item()
            pass
    line = _line_of("# the line named: .item()")
    assert f"{__file__}:{line}" in str(caught.value)
    assert "needs the values of a tensor" in str(caught.value)


def test_the_line_named_is_the_users_not_generated_codes() -> None:
    """Code made by ``exec`` (``<string>``, as a dataclass's ``__init__``) is nobody's line: its caller's is named."""
    namespace: dict[str, Any] = {}
    exec("def total(x):\n    return x.sum().item()\n", namespace)
    with pytest.raises(FakeModeError) as caught, measure("step", device="cpu", predict="h100", fake=True):
        namespace["total"](torch.randn(4, 4))  # the line named: generated code's caller
    line = _line_of("# the line named: generated code's caller")
    assert f"{__file__}:{line}" in str(caught.value)


def test_a_real_tensor_in_a_fake_step_is_an_error_naming_the_line() -> None:
    weight = torch.randn(4, 4)  # made before the block: real
    with pytest.raises(FakeModeError) as caught, measure("step", device="cpu", predict="h100", fake=True):
        torch.randn(2, 4) @ weight  # the line named: a real tensor
    line = _line_of("# the line named: a real tensor")
    assert f"{__file__}:{line}" in str(caught.value)
    assert "got a real tensor" in str(caught.value)


def test_fake_needs_a_prediction_and_a_fake_recording() -> None:
    with pytest.raises(ValueError, match=r"fake=True needs predict="), measure("step", device="cpu", fake=True):
        pass
    with (
        measure("outer", device="cpu", predict="h100"),
        pytest.raises(ValueError, match=r"joins one on real tensors"),
        measure("inner", fake=True),
    ):
        pass


def test_after_a_fake_block_tensors_are_real_again() -> None:
    with measure("step", device="cpu", predict="h100", fake=True):
        assert isinstance(torch.ones(2), FakeTensor)
    assert type(torch.ones(2)) is torch.Tensor


SUITE = """
import pytest, torch
from torch._subclasses.fake_tensor import FakeTensor

def step(n=32768):
    model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, n))  # 2.1 B parameters
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, n)).sum().backward()
    optimizer.step()
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    return model, optimizer

@pytest.mark.gpumem(predict="h100", fake=True, allocated="35GiB")
def test_fits():
    model, optimizer = step()

@pytest.mark.gpumem(predict="h100", fake=True, device_limit="24GiB")
def test_does_not_fit():
    step()

@pytest.mark.gpumem(predict="h100", fake=True)
def test_needs_a_value():
    x = torch.randn(3)
    print(x.max().item())  # the value
"""


@pytest.mark.slow
def test_the_marker_runs_a_test_on_fake_tensors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fake_suite=SUITE)
    result = run(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    assert "test_does_not_fit" in text and "over the emulated device limit" in text
    assert "parameters" in text and "optimizer_state" in text  # the categories at the failing allocation
    assert "fake mode cannot run" in text and "test_fake_suite.py:23" in text


def test_the_option_runs_predicted_tests_on_fake_tensors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch
from torch._subclasses.fake_tensor import FakeTensor

@pytest.mark.gpumem(predict="h100", peak="40GiB")
def test_predicted():
    model = torch.nn.Linear(32768, 32768)
    model(torch.randn(4, 32768)).sum().backward()
    assert isinstance(model.weight.grad, FakeTensor)

@pytest.mark.gpumem(peak="1GiB")
def test_not_predicted_stays_real():
    assert type(torch.ones(2)) is torch.Tensor
"""
    )
    run(pytester, "--gpumem-fake").assert_outcomes(passed=2)


def test_fake_without_a_prediction_is_an_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(fake=True)
def test_unpredicted():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)  # at set-up, before the test runs
    result.stdout.fnmatch_lines(["*test_unpredicted: fake=True needs a prediction*"])


def test_a_bad_fake_value_is_a_collection_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(predict="h100", fake="yes")
def test_bad_value():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_bad_value: fake='yes' must be True or False*"])


def _gpt2_step(**config: Any) -> Any:
    from pytest_gpumem.validate.gpt2 import gpt2

    def step(size: int) -> None:
        torch.manual_seed(0)
        model = gpt2("gpt2", **config)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, model.config.vocab_size, (size, model.config.n_positions))
        _, loss = model(tokens, tokens)
        loss.backward()
        optimizer.step()

    return step


@pytest.mark.slow
def test_max_microbatch_on_fake_tensors_finds_what_real_tensors_find() -> None:
    tiny = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 256}
    real = max_microbatch(_gpt2_step(**tiny), limit="200MiB", predict="h100", upper=512)
    fake = max_microbatch(_gpt2_step(**tiny), limit="200MiB", predict="h100", fake=True, upper=512)
    assert fake == real > 1


def test_max_microbatch_names_what_it_cannot_search() -> None:
    with pytest.raises(ValueError, match=r"fake=True needs predict="):
        max_microbatch(lambda size: None, fake=True, upper=4)
    with pytest.raises(ValueError, match=r"engine= or predict=, not both"):
        max_microbatch(lambda size: None, predict="h100", engine="cpu", upper=4)


@pytest.mark.slow
def test_a_llama_7b_fine_tune_does_not_fit_an_80gb_h100(pytester: pytest.Pytester) -> None:
    """A transformers Llama-7B built from its config (bf16 autocast, fp32 AdamW: 16 bytes of each
    of 6.7 B parameters), predicted on fake tensors: out of memory in the optimizer step, with the
    categories at the refused allocation."""
    pytest.importorskip("transformers")
    pytester.makepyfile(
        """
import pytest, torch, transformers

@pytest.mark.gpumem(predict="h100", fake=True, device_limit="80GB")
def test_llama_7b(gpumem):
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    gpumem.track(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (1, 2048))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
"""
    )
    # in a process of its own: transformers' modules imported inside an in-process session are
    # dropped when it ends (pytester restores sys.modules), while the package object stays with
    # the classes it cached (LlamaConfig), so a later test of this process would mix two copies.
    # Sites off: the report at the refused allocation is what this test checks; the lines of a
    # Llama-7B failure are checked by test_sites_frameworks.py (and docs/sites.md)
    result = run_fresh(pytester, "-p", "no:randomly", "--gpumem-sites=off")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*out of memory on cpu during optimizer (at the failed allocation)*",
            "*limit:     80.00 GiB*",
            "parameters       25.10 GiB",
            "gradients        25.10 GiB",
            "optimizer_state  29.69 GiB",
        ]
    )
    result.stdout.fnmatch_lines(["*FakeTensorsDiffer: *test_llama_7b: LlamaForCausalLM ran on fake tensors*"])


def test_the_fixtures_train_step_runs_on_fake_tensors(pytester: pytest.Pytester) -> None:
    """``gpumem.train_step`` (warm-up, then a measured step in phases) and span limits with Ψ
    work on fake tensors: 2.1 GiB of parameters, exactly 16Ψ after the step."""
    pytester.makepyfile(
        """
import pytest, torch
from torch import nn

@pytest.mark.gpumem(predict="h100", fake=True)
def test_step(gpumem):
    model = nn.Sequential(nn.Linear(8192, 32768), nn.GELU(), nn.Linear(32768, 8192))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 8192)
    gpumem.train_step(model, optimizer, (x, x), nn.functional.mse_loss)
    (step,) = gpumem.spans
    assert set(step.phases) == {"forward", "backward", "optimizer"}
    end = step.allocated_breakdown
    assert (end["parameters"], end["gradients"]) == (4 * gpumem.psi, 4 * gpumem.psi)
    assert end["optimizer_state"] == 8 * gpumem.psi  # the step counters are on the GPU's host
"""
    )
    run(pytester).assert_outcomes(passed=1)


def test_fake_tensors_are_no_memory_where_the_run_is_not_on_fake_tensors() -> None:
    """Outside a run on fake tensors a fake tensor is a shape, not memory: TorchDynamo keeps many
    (it traces a compiled function with them), and a test may make some itself. On the CPU engine
    they count for nothing, whether alive before a span or made inside it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept = []
    with measure("before", device="cpu") as before:
        pass
    with FakeTensorMode():
        kept.append(torch.ones(1024, 1024))  # 4 MiB, were it memory
    with measure("fakes", device="cpu") as span:
        with FakeTensorMode():
            kept.append(torch.ones(1024, 1024))
        real = torch.ones(256)
    figures = span.measurement
    assert all(isinstance(tensor, FakeTensor) for tensor in kept)
    assert figures.start == before.measurement.start
    assert (figures.peak - figures.start, figures.allocated - figures.start) == (256 * 4, 256 * 4)
    del real
