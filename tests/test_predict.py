"""Prediction mode: the CPU engine reporting what a target GPU's caching allocator would show.

The figures follow the allocator's rules byte for byte (the model's own tests are in
``test_predict_allocator.py``); ``test_predict_zoo.py`` compares whole training steps with
the figures recorded on an H100.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

from conftest import run
from pytest_gpumem import make_engine, measure
from pytest_gpumem.targets import target

MiB = 1 << 20
H100 = target("h100")
#: the workspaces warm before every start reading on the H100: cuBLAS's on the caller's thread
#: and on autograd's device thread, cuBLASLt's (Linear with a bias) on the caller's
WORKSPACES = 2 * 32 * MiB + MiB


def test_measure_predicts_blocks_segments_and_workspaces() -> None:
    with measure("odd", predict="h100") as span:
        big = torch.empty(11 * MiB + 1, dtype=torch.uint8)  # a 12 MiB segment, the block not split
        del big
    m = span.measurement
    assert m.start >= WORKSPACES
    assert (m.cost("peak"), m.cost("allocated")) == (12 * MiB, 0)
    assert m.cost("reserved") == 12 * MiB  # a freed block stays reserved


def test_the_cpu_engine_counts_the_same_storages_without_the_allocator() -> None:
    with measure("odd", device="cpu", cuda_rounding=True) as span:
        big = torch.empty(11 * MiB + 1, dtype=torch.uint8)
        del big
    assert span.measurement.cost("peak") == 11 * MiB + 512
    assert span.measurement.reserved is None


def test_workspaces_are_warm_before_the_start_reading_and_made_by_a_threads_first_matmul() -> None:
    engine = make_engine("cpu", predict="h100")
    engine.clean()
    assert engine.workspaces == WORKSPACES
    before = engine.allocated()
    engine.release_workspaces()
    assert engine.allocated() == before - WORKSPACES
    engine.start()
    try:
        weight = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(8, 64)
        after_randn = engine.allocated()
        out = x @ weight  # mm on this thread: cuBLAS's workspace, and the 2 KiB output
        assert engine.allocated() == after_randn + 32 * MiB + 2048
        out.sum().backward()  # mm in backward: the device thread's own workspace
        assert engine.allocated() >= after_randn + 2 * 32 * MiB
        layer = torch.nn.Linear(64, 64)
        with_lt = engine.allocated()
        y = layer(x)  # addmm with a bias vector: cuBLASLt's workspace, and the 2 KiB output
        assert engine.allocated() - with_lt == MiB + 2048
        del y
    finally:
        engine.stop()


def test_a_session_predicts_and_keys_its_baselines_by_the_target(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_odd="""
import pytest
import torch

@pytest.mark.gpumem(peak="1GiB")
def test_odd():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)
    del big
"""
    )
    result = run(pytester, "--gpumem-predict=H100", "--gpumem-update-baselines", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "environment: predict | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch *",
            "*library workspaces kept on the device: 65.00 MiB*",
            "*call  peak *12.00 MiB*",
            "*call  reserved *12.00 MiB*",
        ]
    )
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    (key,) = data["environments"]
    assert key.startswith("predict | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch ")
    call = data["environments"][key]["tests"]["test_odd.py::test_odd"]["spans"]["call"]
    assert (call["peak"], call["reserved"]) == (12 * MiB, 12 * MiB)
    # the CPU engine's figures go elsewhere and are never compared with the prediction
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    assert sorted(k.split(" | ")[0] for k in data["environments"]) == ["cpu", "predict"]


def test_the_marker_predicts_one_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marker="""
import pytest
import torch

@pytest.mark.gpumem(peak="11MiB", predict="h100")
def test_over():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)  # 12 MiB on the H100

@pytest.mark.gpumem(peak="11.5MiB")
def test_under():
    big = torch.empty(11 * 2**20 + 1, dtype=torch.uint8)  # 11 MiB + 512 B on the CPU engine
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "peak cost 12.00 MiB exceeds the limit 11.00 MiB (11MiB) by +1.00 MiB (+9.1%)",
            "figures on cpu (predict engine)",
            "call  reserved   66.00 MiB  78.00 MiB   12.00 MiB",
            "FAILED test_marker.py::test_over - peak cost 12.00 MiB exceeds*",
        ]
    )


def test_bad_predictions_are_errors_naming_the_test_or_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(predict="a100")
def test_unknown():
    pass

@pytest.mark.gpumem(predict="h100", observe="allocations")
def test_both():
    pass

@pytest.mark.gpumem(peak="1GiB")
def test_fine():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)  # the module's collection error names both tests
    result.stdout.fnmatch_lines(
        [
            "invalid gpumem marker on *::test_unknown: predict='a100' is not a known GPU: use one of 'h100', 'h200'",
            "invalid gpumem marker on *::test_both: observe='allocations' cannot predict='h100': *",
        ]
    )
    bad = run(pytester, "--gpumem-predict=mi300")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpumem-predict / ini gpumem_predict: predict='mi300' is not a known GPU" in (
        bad.stderr.str() + bad.stdout.str()
    )


def test_the_runs_observe_option_yields_to_a_prediction(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(peak="1GiB", predict="h100")
def test_predicted(gpumem):
    assert type(gpumem.recorder.engine).__name__ == "PredictEngine"

@pytest.mark.gpumem(peak="1GiB", observe="allocations")
def test_observed(gpumem):
    assert type(gpumem.recorder.engine.tracker).__name__ == "AllocationTracker"
"""
    )
    run(pytester, "--gpumem-observe=allocations").assert_outcomes(passed=2)
    result = run(pytester, "--gpumem-predict=h100")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_observed*observe='allocations' cannot predict='h100'*"])


def test_make_engine_names_what_cannot_be_predicted() -> None:
    with pytest.raises(
        ValueError, match=r"observe='allocations' cannot predict='h100': a prediction follows the operators"
    ):
        make_engine("cpu", predict="h100", observe="allocations")
    with pytest.raises(ValueError, match=r"predict='a100' is not a known GPU"):
        make_engine("cpu", predict="a100")


@pytest.mark.parametrize(
    ("dtype", "head_dim", "masked", "kv_heads", "expected"),
    [
        (torch.bfloat16, 64, False, 8, "flash"),
        (torch.bfloat16, 64, False, 4, "flash"),  # flash takes grouped-query attention
        (torch.bfloat16, 64, True, 8, "efficient"),  # an explicit mask: not flash
        (torch.bfloat16, 512, False, 8, "efficient"),  # head size over 256: not flash
        (torch.float32, 64, False, 8, "efficient"),  # fp32: not flash
        (torch.float32, 64, False, 4, "math"),  # fp32 with grouped-query attention: neither
        (torch.bfloat16, 64, True, 4, "math"),  # a mask and grouped-query attention
        (torch.float32, 62, False, 8, "math"),  # a head size no fused kernel takes
    ],
)
def test_the_attention_backend_follows_the_targets_rules(
    dtype: torch.dtype, head_dim: int, masked: bool, kv_heads: int, expected: str
) -> None:
    from pytest_gpumem.measurement.engines.predict import choose_backend

    query = torch.empty(2, 8, 16, head_dim, dtype=dtype)
    key = torch.empty(2, kv_heads, 16, head_dim, dtype=dtype)
    mask = torch.zeros(16, 16, dtype=torch.bool) if masked else None
    assert choose_backend(H100, query, key, key, mask, enable_gqa=kv_heads != 8).name == expected


def _attention_step(predict: str | None, dtype: torch.dtype, dropout: float) -> tuple[int, list[torch.Tensor]]:
    """The bytes saved for backward by one attention call, and the gradients of q, k, v."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    with measure("attention", device="cpu", predict=predict, cuda_rounding=True) as span:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    saved = span.measurement.saved_activations
    assert saved is not None
    out.float().pow(2).sum().backward()
    return saved, [t.grad for t in (q, k, v) if t.grad is not None]


@pytest.mark.slow
def test_fused_attention_keeps_what_the_gpus_kernel_keeps_and_computes_the_cpus_gradients() -> None:
    # flash (bf16): q, k, v, the output (4 × 32 KiB), a float32 log-sum-exp [2, 4, 64] (2 KiB)
    # and two int64 random-state tensors, each storage in 512-byte blocks
    saved, grads = _attention_step("h100", torch.bfloat16, 0.0)
    assert saved == 4 * 2 * 4 * 64 * 32 * 2 + 2 * 4 * 64 * 4 + 2 * 512
    _, expected = _attention_step(None, torch.bfloat16, 0.0)
    assert len(grads) == 3
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    # memory-efficient (fp32): the log-sum-exp rows padded to 32 (64 already is); no random state
    saved, grads = _attention_step("h100", torch.float32, 0.0)
    assert saved == 4 * 2 * 4 * 64 * 32 * 4 + 2 * 4 * 64 * 4
    _, expected = _attention_step(None, torch.float32, 0.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, expected, strict=True))


def test_attention_with_dropout_keeps_no_attention_matrix_and_replays_its_random_numbers() -> None:
    saved, _ = _attention_step(None, torch.float32, 0.1)
    assert saved > 2 * 4 * 64 * 64 * 4  # the CPU's math composite keeps the attention weights
    # predicted: the memory-efficient kernel's q, k, v, output, log-sum-exp and random state, and
    # the gradients a plain CPU run computes (the same random numbers, replayed in backward)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    with measure("attention", predict="h100") as span:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert span.measurement.saved_activations == 4 * 2 * 4 * 64 * 32 * 4 + 2 * 4 * 64 * 4 + 2 * 512
    out.sum().backward()  # backward recomputes the CPU's attention with the forward's random numbers
    torch.manual_seed(0)
    q2, k2, v2 = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, dropout_p=0.1).sum().backward()
    assert q.grad is not None and q2.grad is not None and torch.allclose(q.grad, q2.grad, atol=1e-6)


def test_dropout_keeps_a_bool_mask_as_the_fused_kernel_does() -> None:
    x = torch.randn(1024, 256, requires_grad=True)
    with measure("dropout", device="cpu") as plain:
        y = torch.nn.functional.dropout(x, 0.1, training=True)
    with measure("dropout", predict="h100") as predicted:
        z = torch.nn.functional.dropout(x, 0.1, training=True)
    assert plain.measurement.saved_activations == 1024 * 256 * 4  # the CPU keeps a float mask
    assert predicted.measurement.saved_activations == 1024 * 256  # CUDA's kernel a bool one
    del y, z


def test_autocast_casts_by_the_targets_lists() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with measure("autocast", predict="h100"), torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ x  # bf16 on both devices
        cube = h.pow(3)  # CUDA's autocast runs pow in float32; the CPU's leaves it in bf16
        product = torch.mv(x, x[0])  # CUDA's in bf16; the CPU's in float32
    assert (h.dtype, cube.dtype, product.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x).pow(3).dtype == torch.bfloat16
        assert torch.mv(x, x[0]).dtype == torch.float32


def _checkpointed_gpt2_step(fake: bool, checkpointed: bool) -> tuple[Any, ...]:
    """A small GPT-2 step whose blocks are checkpointed (recomputed in backward), predicted."""
    from torch.utils.checkpoint import checkpoint

    from pytest_gpumem.validate.gpt2 import gpt2

    with measure("step", device="cpu", predict="h100", fake=fake) as span:
        torch.manual_seed(0)
        model = gpt2("gpt2", n_layer=2, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
        if checkpointed:
            blocks = list(model.h)
            for block in blocks:
                block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        tokens = torch.randint(0, 1024, (4, 256))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(tokens, tokens)
        loss.backward()
    m = span.measurement
    return m.peak, m.allocated, m.reserved, m.saved_activations, dict(m.breakdown or {})


def test_activation_checkpointing_recomputes_with_the_targets_kernels() -> None:
    """Checkpointed blocks run again in backward: the recomputation runs the target's attention
    kernel as the forward did, so it saves the same tensors (PyTorch checks), on real and fake
    tensors alike; it keeps less for backward than the same step without checkpointing."""
    real = _checkpointed_gpt2_step(fake=False, checkpointed=True)
    assert _checkpointed_gpt2_step(fake=True, checkpointed=True) == real
    plain = _checkpointed_gpt2_step(fake=False, checkpointed=False)
    assert real[3] < plain[3]  # saved activations
    assert real[0] < plain[0]  # peak


def _adamw_state(**options: Any) -> tuple[int, int]:
    """The predicted optimizer state after an AdamW step of a 4-tensor MLP, and the bytes of
    its exp_avg and exp_avg_sq (each tensor in 512-byte blocks)."""
    torch.manual_seed(0)
    with measure("step", device="cpu", predict="h100") as span:
        model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 10))
        optimizer = torch.optim.AdamW(model.parameters(), **options)
        span.recorder.track(model, optimizer)
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    moments = 2 * sum(-(-4 * p.numel() // 512) * 512 for p in model.parameters())
    end = span.measurement.allocated_breakdown
    assert end is not None
    return end["optimizer_state"], moments


def test_optimizer_scalars_kept_on_the_gpus_host_are_not_counted() -> None:
    """AdamW's step counters are host tensors on a GPU unless the optimizer is fused (then they
    live with the parameters, a 512-byte block each)."""
    state, moments = _adamw_state()
    assert state == moments
    state, moments = _adamw_state(fused=True)
    assert state == moments + 4 * 512


def test_step_counters_made_before_the_prediction_are_not_counted() -> None:
    """A warm-up step outside the prediction makes the step counters; the prediction's start
    (which counts every tensor alive) leaves them out: the parameters, gradients and moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    with measure("step", device="cpu", predict="h100", track=(model, optimizer)) as span:
        pass
    blocks = sum(-(-4 * p.numel() // 512) * 512 for p in model.parameters())
    breakdown = span.measurement.allocated_breakdown
    assert breakdown is not None
    assert breakdown["optimizer_state"] == 2 * blocks
    assert (breakdown["parameters"], breakdown["gradients"]) == (blocks, blocks)
