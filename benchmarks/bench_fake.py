"""What a prediction costs against model size: fake tensors against real ones.

Run: ``python benchmarks/bench_fake.py [--real-max 400e6] [--repeat 1]``

Each row predicts one training step on an H100 (``measure(predict="h100")``): a GPT-2 of
each preset (124 M, 355 M and 1.56 B parameters; fp32, AdamW, batch 1 × 1,024 tokens) and a
``transformers`` Llama-7B built from its config (6.7 B parameters; bf16 autocast, fp32 AdamW,
batch 1 × 2,048 tokens; skipped without ``transformers``). Every run is a fresh interpreter,
which reports the seconds of the measured block (model built, one step) and how much its
peak resident memory grew (``ru_maxrss``), with the predicted peak. Real tensors run only for
models up to ``--real-max`` parameters: the larger ones do not fit a 24 GiB runner.

A last table predicts one rank of a sharded step over the fake process group
(``run_ranks(..., predict="h100", fake=True, ranks=[r])``): a ``transformers``
Llama-70B-shaped model built on the meta device, FSDP2 on every decoder layer and the root,
each layer checkpointed, bf16 autocast without its cast cache, fp32 AdamW, batch 1 × 2,048,
on 8 and 64 ranks: the seconds of the call (the process that runs
the rank started, the rank predicted) and the peak resident memory of that process.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from tabulate import tabulate

SCRIPT = """
import resource, sys, time, torch
from pytest_gpumem import measure

name, fake = sys.argv[1], sys.argv[2] == "fake"
torch.manual_seed(0)
torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()  # torch's lazy imports, before the readings


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


before, started = peak(), time.perf_counter()
with measure("step", device="cpu", predict="h100", fake=fake) as span:
    if name == "llama-7b":
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
        )
        model = transformers.LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, config.vocab_size, (1, 2048))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
    else:
        from pytest_gpumem.validate.gpt2 import gpt2

        model = gpt2(name)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, model.config.vocab_size, (1, 1024))
        _, loss = model(tokens, tokens)
    loss.backward()
    optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
seconds = time.perf_counter() - started
print(psi, seconds, peak() - before, span.measurement.peak)
"""

MODELS = ("gpt2", "gpt2-medium", "gpt2-xl", "llama-7b")


def llama_70b_fsdp(rank: int, ctx: Any) -> None:
    """One rank of the sharded Llama-70B-shaped step (module level: the rank process imports it)."""
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard

    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=ctx.device)
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.track(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (1, 2048))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()


def one_rank(world_size: int, rank: int) -> None:
    """Predict ``rank`` of ``world_size`` and print Ψ, seconds, the rank process's peak RSS, peak and allocated."""
    from pytest_gpumem import run_ranks

    started = time.perf_counter()
    (measured,) = run_ranks(llama_70b_fsdp, world_size, predict="h100", fake=True, ranks=[rank], timeout=1800)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(measured.psi, seconds, rss, measured.peak, measured.allocated)


def ranks_table(repeat: int) -> None:
    rows = []
    for world_size in (8, 64):
        runs = []
        for _ in range(repeat):
            command = [sys.executable, __file__, "--one-rank", str(world_size), "0"]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"rank 0 of {world_size} failed:\n{done.stderr[-3000:]}")
            runs.append([float(v) for v in done.stdout.split()])
        psi, _, _, peak, allocated = runs[0]
        seconds = statistics.median(r[1] for r in runs)
        rss = statistics.median(r[2] for r in runs)
        rows.append(
            [
                f"{world_size}",
                f"{psi / 1e6:,.0f} M",
                f"{16 * psi / 2**30:.2f}",
                f"{allocated / 2**30:.2f}",
                f"{peak / 2**30:.2f}",
                f"{seconds:.1f}",
                f"{rss / 2**20:,.0f}",
            ]
        )
    headers = ["ranks", "Ψ of rank 0", "16Ψ GiB", "allocated GiB", "peak GiB", "s", "rank process RSS MiB"]
    print()
    print("Llama-70B-shaped FSDP2 step, rank 0 predicted on fake tensors over the fake process group")
    print(tabulate(rows, headers=headers, disable_numparse=True))


def run(name: str, mode: str) -> tuple[int, float, int, int]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, name, mode], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {mode} failed:\n{done.stderr[-3000:]}")
    psi, seconds, grown, predicted = done.stdout.split()
    return int(psi), float(seconds), int(grown), int(predicted)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--real-max", type=float, default=400e6, help="largest model run on real tensors (parameters)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row; figures are medians")
    parser.add_argument("--one-rank", nargs=2, type=int, metavar=("WORLD_SIZE", "RANK"), help=argparse.SUPPRESS)
    parser.add_argument("--no-ranks", action="store_true", help="leave out the sharded Llama-70B table")
    options = parser.parse_args()
    if options.one_rank:
        one_rank(*options.one_rank)
        return
    models = [m for m in MODELS if m != "llama-7b" or importlib.util.find_spec("transformers") is not None]
    rows = []
    for name in models:
        fake = [run(name, "fake") for _ in range(options.repeat)]
        psi = fake[0][0]
        real = [run(name, "real") for _ in range(options.repeat)] if psi <= options.real_max else []
        fake_s, fake_grown = statistics.median(r[1] for r in fake), statistics.median(r[2] for r in fake)
        row = [name, f"{psi / 1e6:,.0f} M", f"{fake[0][3] / 2**30:.2f}", f"{fake_s:.2f}", f"{fake_grown / 2**20:,.0f}"]
        if real:
            real_s, real_grown = statistics.median(r[1] for r in real), statistics.median(r[2] for r in real)
            same = "yes" if real[0][3] == fake[0][3] else f"{(fake[0][3] - real[0][3]):+,} B"
            row += [f"{real_s:.2f}", f"{real_grown / 2**20:,.0f}", f"{real_s / fake_s:.1f}×", same]
        else:
            row += ["—", "—", "—", "—"]
        rows.append(row)
    headers = [
        "model",
        "Ψ",
        "predicted peak GiB",
        "fake s",
        "fake RSS +MiB",
        "real s",
        "real RSS +MiB",
        "real / fake",
        "same peak",
    ]
    print("H100 prediction of one AdamW step, one fresh interpreter per run")
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if not options.no_ranks and importlib.util.find_spec("transformers") is not None:
        ranks_table(options.repeat)


if __name__ == "__main__":
    main()
