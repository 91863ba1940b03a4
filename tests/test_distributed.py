"""Distributed steps: ``world_size`` rank processes (gloo on the CPU), each measured on its own.

Every rank trains the same MLP 256 → 1024 → 256 (Ψ = 525,568 trainable parameters in four
tensors) with AdamW; the figures are exact per rank and compared with the model-state budget
as exactly as each layout allows.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_steps import (
    ddp_bucket_view_step,
    ddp_step,
    fsdp_step,
    mlp,
    rank_one_dies,
    rank_one_raises,
    sleeps,
    zero_ddp_step,
)

from conftest import run
from pytest_gpumem import DistributedError, RankContext, model_states, run_ranks

PSI = 256 * 1024 + 1024 + 1024 * 256 + 256
#: AdamW's step counters: a float32 scalar per parameter tensor
COUNTERS = 4 * 4


@pytest.mark.slow
def test_ddp_keeps_model_states_and_a_gradient_bucket_on_every_rank() -> None:
    """DDP: every rank holds the whole model states, 16Ψ for fp32 AdamW (and the step counters),
    plus its gradient buckets: one flat copy of the gradients, 4Ψ."""
    budget = model_states([mlp()], "adamw", "fp32").total
    assert budget == 16 * PSI + COUNTERS
    for rank, m in enumerate(run_ranks(ddp_step, 2)):
        assert m.name == f"rank{rank}"
        assert m.psi == PSI
        assert m.allocated_breakdown == {
            "parameters": 4 * PSI,
            "gradients": 4 * PSI,
            "optimizer_state": 8 * PSI + COUNTERS,
            "activations": 0,
            "temporaries": 4 * PSI,  # the buckets
            "other": 0,
        }
        assert m.cost("allocated") == budget + 4 * PSI


@pytest.mark.slow
def test_gradients_as_bucket_views_cost_no_bucket_on_four_ranks() -> None:
    """``gradient_as_bucket_view=True``: the gradients *are* the bucket, so each of four ranks
    holds exactly the budget, 16Ψ (and the step counters)."""
    measurements = run_ranks(ddp_bucket_view_step, 4)
    assert len(measurements) == 4
    for m in measurements:
        assert m.cost("allocated") == 16 * PSI + COUNTERS
        assert m.allocated_breakdown is not None and m.allocated_breakdown["temporaries"] == 0


@pytest.mark.slow
def test_zero_shards_the_optimizer_state_by_parameter_tensors() -> None:
    """ZeroRedundancyOptimizer gives each rank whole parameter tensors: rank 0 the first
    Linear's (262,144 + 1,024 elements), rank 1 the second's (262,144 + 256). Each rank's
    optimizer state is 8 bytes per element of its share and the step counters of its two
    tensors; together they are the unsharded 8Ψ. The budget's ZeRO-1 rule splits every item
    evenly (⌈8Ψ/2⌉ per rank): the shards differ from it by the imbalance of the partition,
    ±3,072 B."""
    shares = [262_144 + 1_024, 262_144 + 256]
    items = model_states([mlp()], "adamw", "fp32", zero_stage=1, world_size=2).items
    even = items["exp_avg"] + items["exp_avg_sq"]  # 4Ψ: ⌈8Ψ/2⌉
    assert (even, items["step counters"]) == (4 * PSI, 8)
    states = []
    for rank, m in enumerate(run_ranks(zero_ddp_step, 2)):
        assert m.allocated_breakdown is not None
        state = m.allocated_breakdown["optimizer_state"]
        assert state == 8 * shares[rank] + 2 * 4
        assert abs(state - 8 - even) == 3_072 == 8 * abs(shares[rank] - PSI // 2)
        states.append(state)
    assert sum(states) == 8 * PSI + COUNTERS


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_keeps_a_shard_of_every_model_state(world_size: int) -> None:
    """FSDP2 (``fully_shard`` on each Linear and the root): each rank holds 1/N of every
    parameter, gradient and optimizer state, 16Ψ/N: exactly the ZeRO-3 budget. Ψ is the rank's
    own parameters (DTensor shards). Beyond it, the whole step counters (16 B; the budget splits
    them) and the two device meshes' rank tensors (int32 × N each). At the peak, the unsharded
    parameters of the layer being computed are allocated too: at least the larger Linear's,
    1 MiB + 4 KiB."""
    local = PSI // world_size
    zero3 = model_states([mlp()], "adamw", "fp32", zero_stage=3, world_size=world_size).total
    assert zero3 == 16 * local + COUNTERS // world_size
    for m in run_ranks(fsdp_step, world_size):
        assert m.psi == local
        assert m.allocated_breakdown == {
            "parameters": 4 * local,
            "gradients": 4 * local,
            "optimizer_state": 8 * local + COUNTERS,
            "activations": 0,
            "temporaries": 2 * world_size * 4,  # the meshes' rank tensors
            "other": 0,
        }
        assert m.cost("allocated") == zero3 - COUNTERS // world_size + COUNTERS + 2 * world_size * 4
        assert m.breakdown is not None and m.breakdown["temporaries"] >= 1024 * 256 * 4 + 1024 * 4


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_with_its_report_and_no_rank_is_left() -> None:
    """Rank 1 raises while rank 0 waits for it in a barrier: the run fails with rank 1's report
    as soon as it comes, not at the timeout, and rank 0 is stopped."""
    with pytest.raises(DistributedError) as caught:
        run_ranks(rank_one_raises, 2, timeout=600)
    assert 1 in caught.value.reports  # rank 0 may fail too, in its barrier, when rank 1 is gone
    text = str(caught.value)
    assert text.startswith(("1 of 2 ranks failed (rank 1)", "2 of 2 ranks failed (rank 0, 1)"))
    assert "rank 1 raised:" in text and "ValueError: no batch for rank 1" in text
    assert "did not finish" not in text
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_rank_killed_mid_step_fails_the_run_before_the_timeout() -> None:
    with pytest.raises(DistributedError, match="rank 1 exited with code 3 before reporting") as caught:
        run_ranks(rank_one_dies, 2, timeout=600)
    assert 1 in caught.value.reports
    assert "did not finish" not in str(caught.value)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_rank_past_the_timeout_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks sleep for two minutes; the run stops them at its timeout (or it would return
    their figures, not raise)."""
    monkeypatch.setenv("GPUMEM_TEST_WOKE", str(tmp_path))
    with pytest.raises(DistributedError, match="did not finish within 3 s") as caught:
        run_ranks(sleeps, 2, timeout=3)
    assert sorted(caught.value.reports) == [0, 1]
    assert multiprocessing.active_children() == []
    assert list(tmp_path.iterdir()) == []  # stopped in its sleep: no rank woke up to say so


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive int, got 0"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda', got 'tpu'"),
        ({"timeout": 0}, "timeout must be a positive, finite number of seconds"),
        ({"backend": "carrier-pigeon"}, "backend 'carrier-pigeon' is not a torch.distributed backend"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_ranks(ddp_step, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer than 64 GPUs")
def test_more_ranks_than_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"world_size=64 needs 64 CUDA devices, this machine has \d+"):
        run_ranks(ddp_step, 64, device="cuda")


def test_a_local_function_cannot_be_sent_to_the_ranks() -> None:
    def local(rank: int, ctx: RankContext) -> None:
        pass

    with pytest.raises(TypeError, match="define it at module level"):
        run_ranks(local, 2)


@pytest.mark.slow
def test_the_fixture_applies_the_marker_to_every_rank_and_keys_baselines_by_world_size(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_ranks="""
import pytest
import torch
from torch import nn


def step(rank, ctx):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    x = torch.randn(8, 256)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(x).sum().backward()
        optimizer.step()


@pytest.mark.gpumem(allocated="16Ψ + 8B")
def test_within(gpumem):
    ranks = gpumem.distributed(step, world_size=2)
    assert [m.name for m in ranks] == ["rank0-of-2", "rank1-of-2"]


@pytest.mark.gpumem(allocated="16Ψ")
def test_over(gpumem):
    gpumem.distributed(step, world_size=2)


def failing(rank, ctx):
    raise RuntimeError(f"rank {rank} has no data")


@pytest.mark.gpumem(peak="1GiB")
def test_failing(gpumem):
    gpumem.distributed(failing, world_size=2, timeout=300)
"""
    )
    result = run(pytester, "--gpumem-update-baselines")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*rank0-of-2*allocated cost*exceeds*16Ψ*",
            "*gpumem.distributed: * of 2 ranks failed (rank *)",
            "*RuntimeError: rank ? has no data*",
        ]
    )
    import json

    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    (environment,) = data["environments"].values()
    spans = environment["tests"]["test_ranks.py::test_within"]["spans"]
    assert sorted(spans) == ["call", "rank0-of-2", "rank1-of-2"]
    assert spans["rank0-of-2"]["allocated"] == 16 * (256 * 256 + 256) + 8
    assert multiprocessing.active_children() == []
