"""Cost and agreement of CPU memory trackers on one training step.

Run: ``python benchmarks/bench_tracker.py [--repeat 15] [--threads 1]``

The step: a pre-LayerNorm transformer block (d=256, 4 heads, causal SDPA, GELU MLP
256 → 1024 → 256), batch 4, sequence 128, fp32, AdamW; ``zero_grad(set_to_none=True)``,
forward, MSE loss, backward, ``step()``. One warm-up step creates AdamW's state.
The same model and batch are measured by:

* ``untracked``: the step alone, the reference;
* ``pytest-gpumem``: ``with pytest_gpumem.measure("step", device="cpu", track=(model, opt))``;
* ``pytest-gpumem observe=allocations``: the same with ``observe="allocations"`` (the CPU
  allocator's reports to the profiler instead of the dispatch mode);
* ``MemTracker``: ``torch.distributed._tools.mem_tracker.MemTracker`` with
  ``track_external(model, opt, x, y)``;
* ``profiler``: ``torch.profiler.profile(activities=[CPU], profile_memory=True)``.

Two times per tracker, both as ratios to the untracked step of the same round:

* ``step inside``: the step alone while the tracker is active (what each step of a
  longer measured block costs: the per-operator hooks);
* ``whole``: the tracker set up, entered, the step, left, and the peak read out — what
  measuring one step costs. For pytest-gpumem that includes the clean-state protocol
  (``gc.collect()`` and the scan of the garbage collector's objects for tensors that
  exist before the span); for the profiler, building its results and summing its
  allocation events; for MemTracker, ``track_external`` and the snapshot.

Each round runs the five variants in turn (the order rotates each round); every
figure is the median over ``--repeat`` rounds. Targets: pytest-gpumem cheaper than
both alternatives and ``step inside`` ≤ 1.2 × untracked.

Peaks: each tracker's peak *cost* (highest bytes during the step minus the bytes at
its start) and each one's absolute peak where it has one. See benchmarks/README.md
for why they differ.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the profiler warns about frees of older blocks

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_gpumem import measure

D, HEADS, SEQ, BATCH = 256, 4, 128, 4


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


@dataclass
class Setup:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    zero_grad: bool = True  # False: the step leaves .grad as it finds it (None, for the agreement check)

    def step(self) -> None:
        if self.zero_grad:
            self.opt.zero_grad(set_to_none=True)
        F.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()


@dataclass
class Result:
    """Times of one variant (seconds) and the peaks it reported."""

    inside: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    peak_cost: int | None = None
    peak: int | None = None


def untracked(setup: Setup, result: Result) -> None:
    started = time.perf_counter()
    setup.step()
    result.inside.append(time.perf_counter() - started)
    result.whole.append(result.inside[-1])


def ours(setup: Setup, result: Result, observe: str = "operators") -> None:
    started = time.perf_counter()
    with measure("step", device="cpu", observe=observe, track=(setup.model, setup.opt)) as span:
        inner = time.perf_counter()
        setup.step()
        result.inside.append(time.perf_counter() - inner)
    result.peak_cost, result.peak = span.cost("peak"), span.peak
    result.whole.append(time.perf_counter() - started)


def mem_tracker(setup: Setup, result: Result) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    started = time.perf_counter()
    tracker = MemTracker()
    tracker.track_external(setup.model, setup.opt, setup.x, setup.y)
    device = torch.device("cpu")
    start = tracker.get_tracker_snapshot("current")[device]["Total"]
    with tracker:
        inner = time.perf_counter()
        setup.step()
        result.inside.append(time.perf_counter() - inner)
    peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    result.whole.append(time.perf_counter() - started)
    result.peak_cost, result.peak = peak - start, peak


def profiler_peak(prof: torch.profiler.profile) -> int:
    """Highest running sum of the CPU allocation events (bytes): the peak cost the profiler saw."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def profiler(setup: Setup, result: Result) -> None:
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        inner = time.perf_counter()
        setup.step()
        result.inside.append(time.perf_counter() - inner)
    result.peak_cost = profiler_peak(prof)
    result.whole.append(time.perf_counter() - started)


def peaks_without_zero_grad(setup: Setup) -> dict[str, int]:
    """Peak cost of forward, backward and step with ``.grad`` already None, as each tracker reports it.

    The profiler reports the free of a block only when it knows the block's size, from
    an allocation it recorded; the gradients that ``zero_grad(set_to_none=True)`` frees
    inside the step were allocated by an earlier step. Freeing them first takes that
    blind spot out of the comparison.
    """
    peaks: dict[str, int] = {}
    for name in ("pytest-gpumem", "pytest-gpumem observe=allocations", "MemTracker", "profiler(profile_memory)"):
        setup.opt.zero_grad(set_to_none=True)
        result = Result()
        setup.zero_grad = False
        try:
            VARIANTS[name](setup, result)
        finally:
            setup.zero_grad = True
        assert result.peak_cost is not None
        peaks[name] = result.peak_cost
    return peaks


def clean_state_costs(repeat: int = 5) -> tuple[float, float, int]:
    """Median milliseconds of ``gc.collect()`` and of a fresh tracker's scan, and the object count."""
    from pytest_gpumem.measurement.engines.tracker import StorageTracker

    collects, scans = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        gc.collect()
        collects.append(time.perf_counter() - started)
        started = time.perf_counter()
        StorageTracker(torch.device("cpu")).scan()
        scans.append(time.perf_counter() - started)
    return statistics.median(collects) * 1000, statistics.median(scans) * 1000, len(gc.get_objects())


VARIANTS: dict[str, Callable[[Setup, Result], None]] = {
    "untracked": untracked,
    "pytest-gpumem": ours,
    "pytest-gpumem observe=allocations": lambda setup, result: ours(setup, result, "allocations"),
    "MemTracker": mem_tracker,
    "profiler(profile_memory)": profiler,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="rounds; figures are medians (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    torch.manual_seed(0)
    model = Block()
    setup = Setup(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)
    )
    results = {name: Result() for name in VARIANTS}
    for run in VARIANTS.values():  # warm-up: AdamW state, lazy imports, first use of each tool
        run(setup, Result())
    names = list(VARIANTS)
    for round_index in range(options.repeat):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            VARIANTS[name](setup, results[name])

    base_inside = statistics.median(results["untracked"].inside)
    base_whole = statistics.median(results["untracked"].whole)
    ours_cost = results["pytest-gpumem"].peak_cost
    rows = []
    for name, result in results.items():
        inside, whole = statistics.median(result.inside), statistics.median(result.whole)
        diff = "" if result.peak_cost is None or ours_cost is None else f"{result.peak_cost - ours_cost:+,}"
        rows.append(
            [
                name,
                f"{inside * 1000:.1f}",
                f"{inside / base_inside:.3f}",
                f"{whole * 1000:.1f}",
                f"{whole / base_whole:.3f}",
                "" if result.peak_cost is None else f"{result.peak_cost:,}",
                diff,
                "" if result.peak is None else f"{result.peak:,}",
            ]
        )
    psi = sum(p.numel() for p in model.parameters())
    print(
        f"transformer block d={D}, heads={HEADS}, seq={SEQ}, batch={BATCH}, fp32 AdamW, Ψ={psi:,}; "
        f"torch {torch.__version__}, {options.threads} thread(s), median of {options.repeat} rounds"
    )
    print(
        tabulate(
            rows,
            headers=[
                "tracker",
                "step inside ms",
                "× untracked",
                "whole ms",
                "× untracked",
                "peak cost B",
                "vs ours B",
                "absolute peak B",
            ],
            disable_numparse=True,
            colalign=("left",) + ("right",) * 7,
        )
    )
    agreement = peaks_without_zero_grad(setup)
    print(
        "\npeak cost of the same step with the gradients already freed (zero_grad before each tracker starts):\n"
        + tabulate(
            [[name, f"{value:,}", f"{value - agreement['pytest-gpumem']:+,}"] for name, value in agreement.items()],
            headers=["tracker", "peak cost B", "vs ours B"],
            disable_numparse=True,
            colalign=("left", "right", "right"),
        )
    )
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"gradient bytes that zero_grad(set_to_none=True) frees at the start of the step: {grads:,}")

    collect_ms, scan_ms, objects = clean_state_costs()
    print(
        f"clean-state protocol at the start of each pytest-gpumem span, in this process ({objects:,} objects "
        f"tracked by the garbage collector): gc.collect() {collect_ms:.1f} ms, scan for existing tensors "
        f"{scan_ms:.1f} ms (medians of 5)"
    )

    alternatives = ("MemTracker", "profiler(profile_memory)")
    ours_inside = statistics.median(results["pytest-gpumem"].inside)
    ours_whole = statistics.median(results["pytest-gpumem"].whole)
    cheaper_inside = all(ours_inside < statistics.median(results[n].inside) for n in alternatives)
    cheaper_whole = all(ours_whole < statistics.median(results[n].whole) for n in alternatives)
    ratio = ours_inside / base_inside
    print(
        f"\nstep inside pytest-gpumem: {ratio:.3f} × untracked (target ≤ 1.2: {'met' if ratio <= 1.2 else 'MISSED'}); "
        f"cheaper than both alternatives: step inside {'yes' if cheaper_inside else 'NO'}, "
        f"whole {'yes' if cheaper_whole else 'NO'}"
    )


if __name__ == "__main__":
    main()
