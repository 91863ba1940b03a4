"""The training steps that distributed tests run on each rank (``run_ranks(fn, ...)``).

A rank process is spawned, or forked from a server that has imported only what every rank
imports (``pytest_gpumem.diagnose.warm_ranks``): either way it imports the module that defines
its function afresh. This module imports torch and nothing of the test suite, so a rank does not pay for
``tests/conftest.py``'s warm-up (hypothesis, every plugin module, a training step of each
kind: about 1.8 CPU-seconds a process).

Every step trains the same MLP 256 → 1024 → 256 (Ψ = 525,568 trainable parameters in four
tensors) with AdamW, twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pytest_gpumem import RankContext


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 256)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        optimizer.step()


def ddp_step(rank: int, ctx: RankContext) -> None:
    model = nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    train(model, optimizer)


def ddp_bucket_view_step(rank: int, ctx: RankContext) -> None:
    model = nn.parallel.DistributedDataParallel(mlp(), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    train(model, optimizer)


def zero_ddp_step(rank: int, ctx: RankContext) -> None:
    """ZeRO-1 under DDP (gradients as bucket views)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.parallel.DistributedDataParallel(mlp(), gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    ctx.track(model, optimizer)
    train(model, optimizer)


def zero_step(rank: int, ctx: RankContext) -> None:
    """ZeRO-1: every rank keeps the whole model and gradients, the optimizer state of its share."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = mlp()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    ctx.track(model, optimizer)
    train(model, optimizer)


def fsdp_step(rank: int, ctx: RankContext) -> None:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    train(model, optimizer)


def ddp_hook_step(rank: int, ctx: RankContext) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    model = nn.parallel.DistributedDataParallel(mlp())
    model.register_comm_hook(None, fp16_compress_hook)
    train(model, torch.optim.AdamW(model.parameters()))


def ddp_unused_step(rank: int, ctx: RankContext) -> None:
    model = nn.parallel.DistributedDataParallel(mlp(), find_unused_parameters=True)
    train(model, torch.optim.AdamW(model.parameters()))


def reads_a_value(rank: int, ctx: RankContext) -> None:
    model = mlp()
    if model(torch.randn(2, 256)).sum().item() > 0:  # a value: fake tensors have none
        pass


def rank_one_raises(rank: int, ctx: RankContext) -> None:
    if rank == 1:
        raise ValueError("no batch for rank 1")
    torch.distributed.barrier()  # rank 0 waits for rank 1 forever: it must be stopped


def rank_one_dies(rank: int, ctx: RankContext) -> None:
    if rank == 1:
        os._exit(3)  # killed mid-step: no report, no exception
    torch.distributed.barrier()


def sleeps(rank: int, ctx: RankContext) -> None:
    time.sleep(120)
    (Path(os.environ["GPUMEM_TEST_WOKE"]) / f"woke{rank}").touch()  # never, when it is stopped at the timeout


#: The environment variable naming the folder that :func:`describes_its_process` writes to.
PROCESS_REPORTS = "GPUMEM_TEST_RANK_REPORTS"


def describes_its_process(rank: int, ctx: RankContext) -> None:
    """Writes, as JSON, what this rank's process has imported, its pid and its parent's, the
    ``PYTEST_CURRENT_TEST``, ``HOME`` and ``CUDA_VISIBLE_DEVICES`` it sees, whether CUDA is available and
    the accelerator torch picks by itself, to ``rank<N>.json`` in the folder :data:`PROCESS_REPORTS` names."""
    report = {
        "modules": sorted(sys.modules),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "home": os.environ.get("HOME"),
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": torch.cuda.is_available(),
        "accelerator": str(torch._C._get_accelerator()),
    }
    (Path(os.environ[PROCESS_REPORTS]) / f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")


#: Llama-70B's shape (transformers' ``LlamaConfig``) but for its layer count.
LLAMA_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "use_cache": False,
}


def _llama_70b(ctx: RankContext, *, on_meta: bool, checkpointed: bool, cast_cache: bool, layers: int = 80) -> None:
    """A transformers Llama-70B-shaped model (80 layers, d=8192, GQA 64/8 heads, SwiGLU 28672),
    FSDP2 on every decoder layer and the root, bf16 autocast, fp32 AdamW, batch 1 × 2048.

    ``on_meta``: built on the meta device and given its shards' memory after ``fully_shard``
    (``to_empty``), instead of built whole; ``checkpointed``: each decoder layer recomputed in
    backward; ``cast_cache``: autocast keeps its bf16 copies of the weights until it ends;
    ``layers``: a slice of the model, its first ``layers`` decoder layers."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    config = transformers.LlamaConfig(num_hidden_layers=layers, **LLAMA_70B)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = transformers.LlamaForCausalLM(config)
    if checkpointed:
        model.gradient_checkpointing_enable()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if on_meta:
        model.to_empty(device=ctx.device)  # then the weights' initialisation, on real ranks
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (1, 2048))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cast_cache):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()


#: How each rank of :func:`llama_70b_what_breaks_first` builds and runs the model, by rank.
WHAT_BREAKS_FIRST = {
    "built-whole": {"on_meta": False, "checkpointed": False, "cast_cache": True},
    "on-meta": {"on_meta": True, "checkpointed": False, "cast_cache": True},
    "checkpointed-with-cast-cache": {"on_meta": True, "checkpointed": True, "cast_cache": True},
}


def llama_70b_what_breaks_first(rank: int, ctx: RankContext) -> None:
    """Rank ``r`` runs the ``r``-th way of :data:`WHAT_BREAKS_FIRST`: on fake ranks, which run
    one after another in one process, the three ways cost one process, each measured as a rank."""
    _llama_70b(ctx, **list(WHAT_BREAKS_FIRST.values())[rank])


def llama_70b_fits(layers: int, rank: int, ctx: RankContext) -> None:
    """The first ``layers`` layers of the model that fits: on meta, checkpointed, no cast cache
    (``functools.partial(llama_70b_fits, layers)`` is the rank function)."""
    _llama_70b(ctx, on_meta=True, checkpointed=True, cast_cache=False, layers=layers)
