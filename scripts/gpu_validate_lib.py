"""The machinery behind ``scripts/gpu-validate``: workloads, checks, the record, its replay.

``scripts/gpu-validate`` validates pytest-gpumem on a real GPU and records what it saw, so
that CPU-only CI can replay the parts of the plugin that interpret GPU data. On a CUDA
machine it

1. runs the CUDA test suite (``pytest tests -m cuda`` with the plugin loaded from the checkout);
2. runs reference workloads and asserts what PyTorch's allocator must show: a fp32
   ``nn.Linear(256, 250)`` takes 256,000 + 1,024 bytes, its first forward costs its output
   alone (the clean-state protocol made the cuBLAS workspaces before the start: reported)
   and leaves nothing, Adam's first step adds twice the parameter bytes (plus step counters
   that live on the GPU), a bf16 MLP saves 18·b·s·d bytes with GELU and 10·b·s·d with ReLU
   (saved-tensor accounting and allocator bytes), ``measure()`` of a warmed-up step equals
   PyTorch's counters read by hand, the same step twice gives the same figures (``reserved``
   within one allocator segment), and training steps of the zoo add no workspace to those
   the protocol made;
3. checks, for every workload, that the plugin's peak / allocated / reserved equal
   ``max_memory_allocated`` / ``memory_allocated`` / ``max_memory_reserved`` read at the end
   of the same span (peaks reset at its start), to the byte;
4. trains each model of the zoo (:mod:`fixtures.zoo`) one step on the CPU engine with CUDA
   rounding and on the GPU, and splits each gap into bytes outside tensors (workspaces,
   unsplit blocks) and tensors that differ by category (kernel and algorithm choices);
5. writes the record: ``record.json``, ``summary.md``, ``memory_stats.json`` (raw
   ``memory_stats()`` dumps), ``snapshot.pickle`` (a capped PyTorch memory snapshot) and
   ``cuda-suite.log``, then replays it at once (:func:`replay`) as CI will.

``--cpu-only`` runs what needs no GPU (the CPU half of the zoo, the reference workloads on
the CPU engine) and writes the same record with every GPU figure ``None`` ("n/a"), so the
machinery is tested on any machine. It never writes into ``fixtures/recorded/``: only a real
GPU run may.

Every size is bytes. Nothing here is faked: a figure not measured is ``None``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

import pytest_gpumem
from fixtures.zoo import MODELS, PRECISIONS, SIZES, ZooModel, zoo
from pytest_gpumem.baselines import Environment
from pytest_gpumem.budgets.formulas import mlp_activations
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.diagnose.leaks import confirm_leak, snapshot_storages
from pytest_gpumem.judge.judgement import RESERVED_TOLERANCE_FLOOR
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement.engines import make_engine
from pytest_gpumem.measurement.engines.cpu import CpuEngine
from pytest_gpumem.measurement.engines.cuda import reading_from_stats
from pytest_gpumem.measurement.engines.tracker import StorageTracker, cuda_rounded
from pytest_gpumem.measurement.recorder import Recorder, Span, activate, measure
from pytest_gpumem.plugin.fixture import run_step
from pytest_gpumem.report.text import markdown_report, measurement_table, summary_rows
from pytest_gpumem.units import format_delta, format_size

__all__ = [
    "RECORD_FILE",
    "SCHEMA",
    "Check",
    "Loaded",
    "Outcome",
    "Run",
    "explain_gap",
    "load_record",
    "main",
    "record_name",
    "recorded_folders",
    "reference_adam",
    "reference_linear",
    "reference_mlp",
    "replay",
    "zoo_step",
]

ROOT = Path(__file__).resolve().parents[1]

#: Version of ``record.json``'s layout.
SCHEMA = 1

RECORD_FILE = "record.json"
SUMMARY_FILE = "summary.md"
STATS_FILE = "memory_stats.json"
SNAPSHOT_FILE = "snapshot.pickle"
SUITE_LOG = "cuda-suite.log"
#: Every file a record may hold (the device tool brings back at most 8 files of 16 MiB each).
RECORD_FILES: tuple[str, ...] = (RECORD_FILE, SUMMARY_FILE, STATS_FILE, SNAPSHOT_FILE, SUITE_LOG)

#: Allocation-history entries kept for the memory snapshot.
SNAPSHOT_ENTRIES = 2_000
#: Largest snapshot file written; longer histories are cut from the front until it fits.
SNAPSHOT_LIMIT = 12 * 2**20
#: Last bytes of the CUDA suite's output kept in ``cuda-suite.log``.
SUITE_LOG_LIMIT = 256 * 2**10

#: Shapes ``(b, s, d)`` of the bf16 MLP reference per zoo size: the issue's figure on a GPU, tiny for tests.
MLP_REFERENCE: Mapping[str, tuple[int, int, int]] = {"small": (2, 4096, 1024), "tiny": (2, 64, 64)}

GROUPS: tuple[str, ...] = ("suite", "reference", "determinism", "counters", "zoo", "replay")


# --------------------------------------------------------------------------- results


@dataclass
class Check:
    """One assertion, with the figures behind it.

    ``passed`` is None when the check does not apply here (a GPU figure on a CPU-only run).
    ``measured`` and ``expected`` are bytes where the check compares sizes.
    """

    group: str
    name: str
    passed: bool | None
    measured: int | None = None
    expected: int | None = None
    detail: str = ""

    @property
    def result(self) -> str:
        return "n/a" if self.passed is None else ("ok" if self.passed else "FAILED")

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "passed": self.passed,
            "measured": self.measured,
            "expected": self.expected,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Check:
        return cls(
            group=str(data["group"]),
            name=str(data["name"]),
            passed=data.get("passed"),
            measured=data.get("measured"),
            expected=data.get("expected"),
            detail=str(data.get("detail", "")),
        )


@dataclass
class Outcome:
    """A measured workload: the plugin's figures and, on CUDA, PyTorch's own read at the same moment.

    ``counters`` holds ``max_memory_allocated``, ``memory_allocated`` and
    ``max_memory_reserved`` read at the end of the span (peaks were reset at its start);
    ``stats`` the raw ``memory_stats()`` read right with them. Both are None off CUDA.
    """

    name: str
    measurement: Measurement
    counters: dict[str, int] | None = None
    stats: dict[str, Any] | None = None


@dataclass
class Run:
    """What a validation run collects: outcomes by name, checks, reported figures."""

    device: torch.device
    size: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, int | None] = field(default_factory=dict)
    zoo_rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def add(self, outcome: Outcome) -> Outcome:
        if outcome.name in self.outcomes:
            raise ValueError(f"outcome {outcome.name!r} recorded twice")
        self.outcomes[outcome.name] = outcome
        return outcome

    def check(
        self,
        group: str,
        name: str,
        measured: int | None,
        expected: int | None,
        detail: str = "",
    ) -> Check:
        """Record ``measured == expected`` (n/a when either is None)."""
        passed = None if measured is None or expected is None else measured == expected
        made = Check(group, name, passed, measured, expected, detail)
        self.checks.append(made)
        return made

    @contextlib.contextmanager
    def guard(self, group: str, name: str) -> Iterator[None]:
        """Run a workload; an exception becomes a failed check and the run goes on."""
        log(f"{group}: {name}")
        try:
            yield
        except Exception as exc:  # one broken workload must not lose the others' data
            where = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
            self.checks.append(Check(group, name, False, detail=f"{type(exc).__name__}: {exc} | {''.join(where)}"))
        finally:
            release(self.device)


def log(message: str) -> None:
    """Progress on stderr (stdout carries the tables)."""
    print(f"[gpu-validate] {message}", file=sys.stderr, flush=True)


def release(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return cached blocks, so the next workload starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- probes


class TensorEngine(CpuEngine):
    """The storage tracker alone on any device: bytes of tensor storages, rounded to 512-byte blocks.

    On CUDA it sees what the caching allocator holds for tensors, not what it holds
    outside them (cuBLAS, cuDNN and attention workspaces, unsplit blocks): the
    difference to the allocator's figures is those bytes.
    """

    name = "cuda-tensors"

    def __init__(self, device: torch.device) -> None:
        super().__init__(tracker=StorageTracker(device, cuda_rounding=True))
        self.device = device


class Probe:
    """Yielded by :func:`probe`: the span, and after the block the :class:`Outcome`."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.span: Span | None = None
        self.counters: dict[str, int] | None = None
        self.stats: dict[str, Any] | None = None
        self._outcome: Outcome | None = None

    def allocated_now(self) -> int:
        """Allocated bytes now: PyTorch's ``memory_allocated`` on CUDA, the engine's count elsewhere."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        assert self.span is not None
        return self.span.recorder.engine.allocated()

    @property
    def outcome(self) -> Outcome:
        if self._outcome is None:
            raise RuntimeError(f"probe {self.name!r} has no outcome until its block ends")
        return self._outcome


@contextlib.contextmanager
def probe(
    name: str,
    device: torch.device,
    *,
    breakdown: bool = False,
    track: Sequence[Any] = (),
    tensors_only: bool = False,
) -> Iterator[Probe]:
    """Measure the block with ``measure()`` and, on CUDA, read PyTorch's counters around it.

    On CUDA, peaks are reset at the start of the block and PyTorch's counters and the raw
    ``memory_stats()`` are read at its end, inside the same span: with nothing tracked (no
    phase windows) the plugin's peak, allocated and reserved must equal them to the byte.
    ``tensors_only`` measures with :class:`TensorEngine` instead (no counters). The CPU
    engine rounds storages to CUDA's 512-byte blocks.
    """
    made = Probe(name, device)
    cuda = device.type == "cuda" and not tensors_only
    span: Span
    with _span(name, device, breakdown=breakdown, track=track, tensors_only=tensors_only) as span:
        made.span = span
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        yield made
        if cuda:
            torch.cuda.synchronize(device)
            made.counters = {
                "max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
                "memory_allocated": int(torch.cuda.memory_allocated(device)),
                "max_memory_reserved": int(torch.cuda.max_memory_reserved(device)),
            }
            made.stats = dict(torch.cuda.memory_stats(device))
    comparable = not track  # tracked modules open phase windows, which reset the peaks mid-span
    made._outcome = Outcome(
        name, span.measurement, made.counters if comparable else None, made.stats if comparable else None
    )


@contextlib.contextmanager
def _span(
    name: str, device: torch.device, *, breakdown: bool, track: Sequence[Any], tensors_only: bool
) -> Iterator[Span]:
    if not tensors_only:
        with measure(name, device=device, breakdown=breakdown, cuda_rounding=True, track=tuple(track)) as span:
            yield span
        return
    recorder = Recorder(TensorEngine(device))
    recorder.track(*track)
    recorder.begin()
    try:
        with recorder.span(name) as span:
            yield span
    finally:
        recorder.end()


# --------------------------------------------------------------------------- reference workloads


def reference_linear(run: Run) -> None:
    """fp32 ``nn.Linear(256, 250)``: its bytes after rounding; its first forward costs its output alone, no leak.

    The clean-state protocol creates the library workspaces before the start reading
    (on CUDA: cuBLAS/cuBLASLt, per thread), so the forward's cost is its output and
    nothing stays behind. Figures: ``run.figures["cublas_workspace"]`` (the bytes the
    protocol keeps: 0 on the CPU engine), ``linear_raw_retained`` (allocated after the
    forward, outputs freed, minus the start) and ``linear_retained`` (after the leak check).
    """
    device = run.device
    with run.guard("reference", "Linear(256, 250) weights and bias"):
        with probe("reference.linear-init", device) as made:
            layer = nn.Linear(256, 250, device=device)
        init = run.add(made.outcome).measurement
        weight, bias = cuda_rounded(256 * 250 * 4), cuda_rounded(250 * 4)
        run.check(
            "reference",
            "Linear(256, 250): weights + bias after 512-byte rounding",
            init.cost("allocated"),
            weight + bias,
            f"weights {weight:,} B (256·250·4) + bias {bias:,} B (1,000 rounded up)",
        )
        x = torch.randn(64, 256, device=device)
        engine = make_engine(device, cuda_rounding=True)
        recorder = Recorder(engine)
        recorder.begin()  # the clean-state protocol: on CUDA it creates the cuBLAS workspaces
        try:
            start = engine.allocated()
            snapshot = snapshot_storages(engine)
            with activate(recorder), probe("reference.linear-first-forward", device) as made:
                y = layer(x)
            forward = run.add(made.outcome).measurement
            output = cuda_rounded(y.untyped_storage().nbytes())
            del y
            gc.collect()
            raw = engine.allocated() - start
            leak = confirm_leak(engine, start, snapshot=snapshot)
        finally:
            recorder.end()
        workspaces = engine.workspaces or 0
        run.figures.update(cublas_workspace=workspaces, linear_raw_retained=raw, linear_retained=leak.retained)
        run.check(
            "reference",
            "Linear first forward: its cost is its output (the workspaces were there before the start)",
            forward.cost("allocated"),
            output,
            f"output {output:,} B; the protocol keeps {format_size(workspaces)} of workspaces in every start",
        )
        run.check("reference", "Linear first forward: nothing stays allocated after the output is freed", raw, 0)
        run.checks.append(
            Check(
                "reference",
                "Linear first forward: the leak check sees no leak",
                not leak.suspected and leak.retained <= 0,
                leak.retained,
                0,
                f"retained {raw:,} B, {leak.retained:,} B with the workspaces freed (readings {list(leak.readings)})",
            )
        )


def reference_workspaces(run: Run, models: Sequence[ZooModel]) -> None:
    """The workspaces the clean-state protocol makes are all that training steps use: after
    steps of the zoo's models (fp32 and bf16, forward, backward, AdamW) the workspaces the
    device holds are the bytes the protocol measured, none more."""
    if not run.cuda:
        return
    device = run.device
    with run.guard("reference", "workspaces: training steps add none"):
        engine = make_engine(device)
        engine.clean()
        kept = engine.workspaces
        for model in models:
            for precision in PRECISIONS:
                step = model.build(device, precision)
                for _ in range(2):
                    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp)
                del step
        engine.settle()
        before = engine.allocated()
        engine.release_workspaces()
        held = before - engine.allocated()
        engine.warm_workspaces()
        run.figures["workspaces_after_steps"] = held
        names = ", ".join(m.name for m in models)
        run.check("reference", "workspaces held after training steps = what the protocol made", held, kept, names)


def reference_hand_counters(run: Run) -> None:
    """``measure()`` of a warmed-up step equals ``max_memory_allocated() − memory_allocated()`` read
    by hand around the same step: the clean-state protocol adds nothing a user would not see."""
    if not run.cuda:
        return
    device = run.device
    with run.guard("counters", "measure() of a warmed-up step = PyTorch's counters by hand"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 1024, device=device)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), x).backward()
            optimizer.step()

        step()  # warm-up: AdamW's state, the workspaces of both threads
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        by_hand = torch.cuda.max_memory_allocated(device) - before
        with measure("hand", device=device) as span:
            step()
        run.check(
            "counters",
            "measure() of a warmed-up AdamW step: peak cost = max_memory_allocated() − memory_allocated()",
            span.cost("peak"),
            by_hand,
            "MLP 1024 → 4096 → 1024, batch 64, fp32",
        )


def reference_adam(run: Run) -> None:
    """Adam's first step adds exp_avg and exp_avg_sq (2 × the parameter bytes) plus step counters on the device."""
    device = run.device
    for fused in (False, True):
        label = "fused" if fused else "default"
        with run.guard("reference", f"Adam ({label}) first step"):
            torch.manual_seed(0)
            model = nn.Linear(1024, 1024, device=device)
            optimizer = torch.optim.Adam(model.parameters(), fused=fused)
            model(torch.randn(8, 1024, device=device)).sum().backward()
            with probe(f"reference.adam-{label}-first-step", device) as made:
                optimizer.step()
            step = run.add(made.outcome).measurement
            params = sum(cuda_rounded(p.untyped_storage().nbytes()) for p in model.parameters())
            counters = [
                state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)
            ]
            here = [t for t in counters if t.device == device]
            counter_bytes = sum(cuda_rounded(t.untyped_storage().nbytes()) for t in here)
            place = counters[0].device.type if counters else "nowhere"
            run.check(
                "reference",
                f"Adam ({label}) first step: state = 2 × parameter bytes + step counters on the device",
                step.cost("allocated"),
                2 * params + counter_bytes,
                f"2 × {params:,} B + {len(here)} step counter(s) × 512 B (the counters live on {place})",
            )
            del model, optimizer


def reference_mlp(run: Run) -> None:
    """bf16 MLP forward: bytes saved for backward are 18·b·s·d with GELU, 10·b·s·d with ReLU.

    Measured twice: by the saved-tensor accounting (``saved_activations``) and by the
    allocated bytes after the forward minus before it (after a warm-up forward inside the
    span, so workspaces are already there). The second equals the first: the input ``x``
    (2·b·s·d) was allocated before, the output (2·b·s·d) is new.
    """
    device = run.device
    b, s, d = MLP_REFERENCE[run.size]
    for activation, module in (("gelu", nn.GELU), ("relu", nn.ReLU)):
        with run.guard("reference", f"bf16 MLP ({activation}) saved activations"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(d, 4 * d), module(), nn.Linear(4 * d, d)).to(device, torch.bfloat16)
            x = torch.randn(b, s, d, device=device, dtype=torch.bfloat16)
            with probe(f"reference.mlp-{activation}-forward", device, breakdown=True) as made:
                with torch.no_grad():
                    model(x[:, :8])
                before = made.allocated_now()
                out = model(x)
                after = made.allocated_now()
            forward = run.add(made.outcome).measurement
            expected = mlp_activations(b, s, d, activation)
            factor = expected // (b * s * d)
            shape = f"b={b}, s={s}, d={d}"
            run.check(
                "reference",
                f"bf16 MLP ({activation}): saved for backward = {factor}·b·s·d (saved-tensor accounting)",
                forward.saved_activations,
                expected,
                shape,
            )
            run.check(
                "reference",
                f"bf16 MLP ({activation}): allocated after forward − before = {factor}·b·s·d",
                after - before,
                expected,
                f"{shape}; saved tensors minus the input x plus the output",
            )
            del model, x, out


def reference_determinism(run: Run, model: ZooModel) -> None:
    """The same training step twice in one process: identical figures; ``reserved``'s cost within
    one allocator segment (what the cache holds depends on the process's allocation history)."""
    engine = "cuda" if run.cuda else "cpu"
    with run.guard("determinism", f"{model.name} fp32 step twice"):
        first = run.add(zoo_step(model, "fp32", run.device, engine, name="determinism.run-1")).measurement
        second = run.add(zoo_step(model, "fp32", run.device, engine, name="determinism.run-2")).measurement
        keys = ("start", "peak", "allocated", "requested_peak", "saved_activations")
        one, two = first.to_dict(), second.to_dict()
        differing = [key for key in keys if one[key] != two[key]]
        reserved = [first.cost("reserved"), second.cost("reserved")]
        if None not in reserved and abs(reserved[0] - reserved[1]) > RESERVED_TOLERANCE_FLOOR:  # type: ignore[operator]
            differing.append("reserved")
            one["reserved"], two["reserved"] = reserved
        run.checks.append(
            Check(
                "determinism",
                f"{model.name} fp32 training step run twice in one process: identical figures "
                f"(reserved cost within {format_size(RESERVED_TOLERANCE_FLOOR)})",
                not differing,
                second.peak,
                first.peak,
                "differ: " + ", ".join(f"{k} {one[k]} vs {two[k]}" for k in differing)
                if differing
                else ", ".join(f"{k} {one[k]:,}" for k in keys if one[k] is not None)
                + f"; reserved cost {reserved[0]} vs {reserved[1]}",
            )
        )


def counter_checks(run: Run) -> None:
    """For every CUDA outcome: the plugin's figures equal PyTorch's counters read around the same span."""
    for outcome in run.outcomes.values():
        if outcome.counters is None:
            continue
        m, c = outcome.measurement, outcome.counters
        pairs = (
            ("peak", m.peak, c["max_memory_allocated"]),
            ("allocated", m.allocated, c["memory_allocated"]),
            ("reserved", m.reserved, c["max_memory_reserved"]),
        )
        differing = [f"{name} {ours:,} vs torch {theirs:,}" for name, ours, theirs in pairs if ours != theirs]
        run.checks.append(
            Check(
                "counters",
                f"{outcome.name}: peak / allocated / reserved = torch's counters",
                not differing,
                m.peak,
                c["max_memory_allocated"],
                "; ".join(differing)
                if differing
                else f"peak {m.peak:,}, allocated {m.allocated:,}, reserved {m.reserved or 0:,}",
            )
        )


# --------------------------------------------------------------------------- the zoo


def zoo_step(model: ZooModel, precision: str, device: torch.device, engine: str, *, name: str | None = None) -> Outcome:
    """One measured AdamW training step of ``model`` after one warm-up step (AdamW creates its state there).

    ``engine``: ``"cpu"`` (the CPU engine with CUDA rounding, model and optimizer tracked),
    ``"cuda"`` (the caching allocator, nothing tracked so PyTorch's counters compare) or
    ``"cuda-tensors"`` (the storage tracker alone on the GPU, tracked).
    """
    if engine not in ("cpu", "cuda", "cuda-tensors"):
        raise ValueError(f"unknown engine {engine!r}")
    step = model.build(device, precision)
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=device)
    track = () if engine == "cuda" else (step.model, step.optimizer)
    key = name or f"zoo.{model.name}.{precision}.{engine}"
    with probe(key, device, track=track, tensors_only=engine == "cuda-tensors") as made:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=device)
    del step
    release(device)
    return made.outcome


def _ratio(gpu: int | None, cpu: int | None) -> float | None:
    if gpu is None or cpu is None or cpu == 0:
        return None
    return round(gpu / cpu, 4)


def _breakdown(m: Measurement, metric: str) -> Mapping[str, int] | None:
    return m.allocated_breakdown if metric == "allocated" else m.breakdown


def gap_parts(cpu: Measurement, gpu: Measurement, tensors: Measurement | None, metric: str) -> dict[str, Any]:
    """The GPU-minus-CPU gap of ``metric`` ("allocated" or "peak"), split where the tensor run allows.

    ``outside_tensors`` is what the allocator holds beyond tensor storages (workspaces,
    blocks it did not split); ``tensors`` is how the GPU's tensors differ from the CPU
    engine's, and ``by_category`` splits that by breakdown category. All bytes.
    """
    cpu_value, gpu_value = cpu.figure(metric), gpu.figure(metric)
    assert cpu_value is not None and gpu_value is not None
    parts: dict[str, Any] = {
        "total": gpu_value - cpu_value,
        "outside_tensors": None,
        "tensors": None,
        "by_category": {},
    }
    if tensors is None:
        return parts
    tensor_value = tensors.figure(metric)
    assert tensor_value is not None
    parts["outside_tensors"] = gpu_value - tensor_value
    parts["tensors"] = tensor_value - cpu_value
    ours, theirs = _breakdown(tensors, metric), _breakdown(cpu, metric)
    if ours is not None and theirs is not None:
        deltas = {c: ours.get(c, 0) - theirs.get(c, 0) for c in CATEGORIES}
        parts["by_category"] = {c: v for c, v in deltas.items() if v}
    return parts


def explain_gap(cpu: Measurement, gpu: Measurement | None, tensors: Measurement | None) -> str:
    """One line that accounts for the GPU-minus-CPU gaps of allocated and peak, byte for byte."""
    if gpu is None:
        return "n/a (no GPU run)"
    texts = []
    for metric in ("allocated", "peak"):
        parts = gap_parts(cpu, gpu, tensors, metric)
        text = f"{metric} {format_delta(parts['total'])}"
        if parts["outside_tensors"] is not None:
            inside = parts["tensors"]
            outside, sign = format_delta(parts["outside_tensors"]), "+" if inside >= 0 else "−"
            text += f" = {outside} outside tensors {sign} {format_size(abs(inside))} tensors"
            categories = sorted(parts["by_category"].items(), key=lambda item: -abs(item[1]))
            if categories:
                text += " (" + ", ".join(f"{c} {format_delta(v)}" for c, v in categories) + ")"
        texts.append(text)
    return "; ".join(texts)


def zoo_comparison(run: Run, models: Sequence[ZooModel], gpu: torch.device | None) -> None:
    """Each zoo model × precision: the CPU engine, and with a GPU the allocator and the tensor run."""
    cpu = torch.device("cpu")
    for model in models:
        for precision in PRECISIONS:
            row: dict[str, Any] = {
                "model": model.name,
                "precision": precision,
                "size": model.size,
                "shape": dict(model.shape),
                "description": model.description,
                "psi": None,
                "cpu": None,
                "gpu": None,
                "gpu_tensors": None,
                "skipped": None,
            }
            run.zoo_rows.append(row)
            if not model.available:
                row["skipped"] = f"{model.needs} is not installed"
                continue
            label = f"{model.name} {precision}"
            with run.guard("zoo", f"{label} on the CPU engine"):
                outcome = run.add(zoo_step(model, precision, cpu, "cpu"))
                row["cpu"] = outcome.name
                row["psi"] = outcome.measurement.psi
            if gpu is None:
                continue
            with run.guard("zoo", f"{label} on the GPU"):
                row["gpu"] = run.add(zoo_step(model, precision, gpu, "cuda")).name
            with run.guard("zoo", f"{label} on the GPU, tensors only"):
                row["gpu_tensors"] = run.add(zoo_step(model, precision, gpu, "cuda-tensors")).name
    for row in run.zoo_rows:
        row.update(zoo_figures(row, {name: o.measurement for name, o in run.outcomes.items()}))


def zoo_figures(row: Mapping[str, Any], measurements: Mapping[str, Measurement]) -> dict[str, Any]:
    """The figures, ratios, gaps and explanation of a zoo row, from the measurements it names."""
    cpu = measurements.get(row["cpu"]) if row["cpu"] else None
    gpu = measurements.get(row["gpu"]) if row["gpu"] else None
    tensors = measurements.get(row["gpu_tensors"]) if row["gpu_tensors"] else None
    figures: dict[str, Any] = {}
    for key, m in (("cpu", cpu), ("gpu", gpu), ("gpu_tensors", tensors)):
        figures[key] = None if m is None else {"allocated": m.allocated, "peak": m.peak, "reserved": m.reserved}
    ratio = {
        metric: _ratio(gpu.figure(metric) if gpu else None, cpu.figure(metric) if cpu else None)
        for metric in ("allocated", "peak")
    }
    gap = None
    explanation = "n/a (no CPU figures)" if cpu is None else explain_gap(cpu, gpu, tensors)
    if cpu is not None and gpu is not None:
        gap = {metric: gap_parts(cpu, gpu, tensors, metric) for metric in ("allocated", "peak")}
    return {"figures": figures, "ratio": ratio, "gap": gap, "explanation": explanation}


# --------------------------------------------------------------------------- the CUDA suite


def plugin_installed() -> bool:
    """True when pytest finds the plugin through the ``pytest11`` entry point (pytest-gpumem is installed)."""
    try:
        points = importlib.metadata.entry_points(group="pytest11")
    except Exception:
        return False
    return any(point.value.split(":")[0].strip() == "pytest_gpumem.plugin" for point in points)


def suite_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for the suite: the checkout first on ``PYTHONPATH`` (absolute, so pytester's
    subprocesses in other folders import it too) and, when the plugin is not installed, the plugin
    named in ``PYTEST_PLUGINS`` (which pytest reads in every process; ``-p`` would reach only the
    first, and either would clash with an installed entry point)."""
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    if not plugin_installed():
        plugins = [p for p in environ.get("PYTEST_PLUGINS", "").split(",") if p.strip()]
        if "pytest_gpumem.plugin" not in plugins:
            env["PYTEST_PLUGINS"] = ",".join([*plugins, "pytest_gpumem.plugin"])
    return env


def run_suite(extra: Sequence[str], timeout: float) -> tuple[dict[str, Any], str]:
    """Run ``pytest tests -m cuda`` from the checkout; its counts (from junit XML) and its output."""
    with tempfile.TemporaryDirectory(prefix="gpu-validate-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "tests",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "-rfEs",
            f"--junitxml={junit}",
            *extra,
        ]
        began = time.monotonic()
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=suite_environment(os.environ),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            output = _text(exc.stdout) + _text(exc.stderr) + f"\n[gpu-validate] timed out after {timeout:.0f} s\n"
        counts = _junit_counts(junit)
    shown = ["python", *(c if not c.startswith("--junitxml") else "--junitxml=<tmp>" for c in command[1:])]
    summary: dict[str, Any] = {
        "command": " ".join(shown),
        "exit_code": code,
        "seconds": round(time.monotonic() - began, 1),
        **counts,
        "log": SUITE_LOG,
    }
    return summary, output


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _junit_counts(path: Path) -> dict[str, int | None]:
    keys = ("tests", "failures", "errors", "skipped")
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):  # no report: pytest did not start, or was killed writing it
        return dict.fromkeys(keys)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}


def suite_check(summary: Mapping[str, Any]) -> Check:
    """The suite passed: exit 0, tests ran, none failed, none skipped (with a GPU nothing may skip)."""
    tests, skipped = summary.get("tests"), summary.get("skipped")
    passed = summary.get("exit_code") == 0 and bool(tests) and not summary.get("failures") and not skipped
    detail = (
        f"{tests} test(s), {summary.get('failures')} failed, {summary.get('errors')} error(s), "
        f"{skipped} skipped, exit {summary.get('exit_code')}, {summary.get('seconds')} s: {summary.get('command')}"
    )
    return Check("suite", "CUDA test suite (pytest tests -m cuda)", passed, detail=detail)


# --------------------------------------------------------------------------- the snapshot


def take_snapshot(device: torch.device, entries: int) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """The memory snapshot of the history recorded so far (pickled, cut to :data:`SNAPSHOT_LIMIT`),
    the ``memory_stats()`` read right after it, and a description for the record."""
    snapshot = torch.cuda.memory._snapshot()
    stats = dict(torch.cuda.memory_stats(device))
    traces = snapshot.get("device_traces") or []
    kept = [len(trace) for trace in traces]
    data = pickle.dumps(snapshot)
    while len(data) > SNAPSHOT_LIMIT and any(kept):
        kept = [n // 2 for n in kept]
        snapshot["device_traces"] = [trace[len(trace) - n :] for trace, n in zip(traces, kept, strict=True)]
        data = pickle.dumps(snapshot)
    info = {
        "file": SNAPSHOT_FILE,
        "device_index": device.index,
        "max_entries": entries,
        "trace_entries": sum(kept),
        "segments": len(snapshot.get("segments", [])),
        "bytes": len(data),
    }
    return data, stats, info


class _PlainData(pickle.Unpickler):
    """Reads a pickle of plain data only (dicts, lists, strings, numbers): any class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a memory snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """A memory snapshot written by this script, read without executing anything it could name."""
    with path.open("rb") as handle:
        data = _PlainData(handle).load()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a memory snapshot (a {type(data).__name__})")
    return data


# --------------------------------------------------------------------------- the record


def record_name(device_name: str | None, torch_version: str) -> str:
    """The record's folder name: ``"nvidia-h100-80gb-hbm3-torch2.13"``; ``"cpu-only-torch2.13"`` without a GPU."""
    model = re.sub(r"[^a-z0-9]+", "-", (device_name or "cpu-only").lower()).strip("-") or "unknown-gpu"
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    version = f"{match[1]}.{match[2]}" if match else re.sub(r"[^0-9a-z.]+", "-", torch_version.lower())
    return f"{model}-torch{version}"


def recorded_folders(directory: Path) -> list[Path]:
    """The record folders under ``directory`` (each holds a ``record.json``), sorted by name."""
    if not directory.is_dir():
        return []
    return sorted(path.parent for path in directory.glob(f"*/{RECORD_FILE}"))


def build_record(
    run: Run,
    *,
    mode: str,
    environment: Environment | None,
    suite: Mapping[str, Any] | None,
    snapshot: Mapping[str, Any] | None,
    models: Sequence[ZooModel],
) -> dict[str, Any]:
    """The JSON-ready record of a run (``record.json``); the stats dumps go to their own file."""
    cpu_environment = Environment.detect("cpu", cuda_rounding=True)
    try:
        transformers: str | None = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return {
        "schema": SCHEMA,
        "protocol": PROTOCOL,
        "generator": f"scripts/gpu-validate (pytest-gpumem {pytest_gpumem.__version__})",
        "mode": mode,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers,
        "device": str(run.device),
        "environment": None if environment is None else environment.to_dict(),
        "environment_key": None if environment is None else environment.key,
        "cpu_environment": cpu_environment.to_dict(),
        "cpu_environment_key": cpu_environment.key,
        "size": run.size,
        "models": [m.name for m in models],
        "suite": None if suite is None else dict(suite),
        "figures": dict(run.figures),
        "checks": [c.to_dict() for c in run.checks],
        "workloads": {
            name: {
                "measurement": o.measurement.to_dict(),
                "counters": o.counters,
                "stats": o.stats is not None,
            }
            for name, o in run.outcomes.items()
        },
        "zoo": run.zoo_rows,
        "snapshot": None if snapshot is None else dict(snapshot),
        "files": {},
    }


def write_record(
    folder: Path,
    record: dict[str, Any],
    stats: Mapping[str, Any],
    *,
    snapshot: bytes | None = None,
    suite_log: str | None = None,
) -> list[Path]:
    """Write the record's files into ``folder`` (replacing an earlier record there); returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in RECORD_FILES:
        (folder / name).unlink(missing_ok=True)
    files: dict[str, str] = {"record": RECORD_FILE, "summary": SUMMARY_FILE, "memory_stats": STATS_FILE}
    if snapshot is not None:
        (folder / SNAPSHOT_FILE).write_bytes(snapshot)
        files["snapshot"] = SNAPSHOT_FILE
    if suite_log is not None:
        tail = suite_log.encode()[-SUITE_LOG_LIMIT:].decode(errors="replace")
        (folder / SUITE_LOG).write_text(tail, encoding="utf-8")
        files["suite_log"] = SUITE_LOG
    record["files"] = files
    _write_json(folder / STATS_FILE, stats)
    _write_json(folder / RECORD_FILE, record)
    (folder / SUMMARY_FILE).write_text(render_markdown(record), encoding="utf-8")
    return [folder / name for name in RECORD_FILES if (folder / name).exists()]


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- tables


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def check_rows(checks: Sequence[Check]) -> list[list[str]]:
    return [[c.group, c.name, _bytes(c.measured), _bytes(c.expected), c.result, c.detail] for c in checks]


CHECK_HEADERS = ("group", "check", "measured B", "expected B", "result", "detail")
ZOO_HEADERS = (
    "model",
    "precision",
    "Ψ",
    "allocated CPU",
    "allocated GPU",
    "×",
    "peak CPU",
    "peak GPU",
    "×",
    "reserved GPU",
    "gap GPU − CPU explained",
)


def zoo_table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        if row.get("skipped"):
            out.append([row["model"], row["precision"], "", *["n/a"] * 7, f"skipped: {row['skipped']}"])
            continue
        figures = row.get("figures") or {}
        cpu, gpu = figures.get("cpu") or {}, figures.get("gpu") or {}
        ratio = row.get("ratio") or {}
        out.append(
            [
                row["model"],
                row["precision"],
                "n/a" if row.get("psi") is None else f"{row['psi']:,}",
                format_size(cpu.get("allocated")),
                format_size(gpu.get("allocated")),
                "n/a" if ratio.get("allocated") is None else f"{ratio['allocated']:.3f}",
                format_size(cpu.get("peak")),
                format_size(gpu.get("peak")),
                "n/a" if ratio.get("peak") is None else f"{ratio['peak']:.3f}",
                format_size(gpu.get("reserved")),
                str(row.get("explanation", "")),
            ]
        )
    return out


GAP_LEGEND = (
    "Gaps: *outside tensors* is what the caching allocator holds beyond tensor storages "
    "(cuBLAS/cuBLASLt, cuDNN and attention workspaces, and large blocks it did not split: up to "
    "1 MiB each); *tensors* is how the GPU's tensor storages (the storage tracker run on the GPU, "
    "512-byte rounding) differ from the CPU engine's, by category: step counters that AdamW keeps "
    "on the CPU when training on a GPU (optimizer_state −512 B per parameter tensor), kernels that "
    "save other tensors (SDPA's flash/efficient backends keep log-sum-exp rows instead of "
    "attention weights), autocast's different CPU and CUDA op lists, dropout masks (bool on CUDA, "
    "the activation's dtype on CPU)."
)


def _suite_line(suite: Mapping[str, Any] | None) -> str:
    if suite is None:
        return "CUDA suite: not run"
    return suite_check(suite).detail


def _wrapped(rows: Sequence[Sequence[str]], widths: Mapping[int, int]) -> list[list[str]]:
    """``rows`` with the cells of the columns in ``widths`` wrapped to that many characters."""
    return [[textwrap.fill(cell, widths[i]) if i in widths else cell for i, cell in enumerate(row)] for row in rows]


def render_terminal(record: Mapping[str, Any]) -> str:
    """The tables printed at the end of a run."""
    checks = [Check.from_dict(c) for c in record["checks"]]
    lines = [
        f"gpu-validate: {record['mode']} run on {record['device']}, torch {record['torch']}",
        f"environment: {record['environment_key'] or 'n/a (no GPU)'}",
        f"CPU engine:  {record['cpu_environment_key']}",
        _suite_line(record.get("suite")),
        "",
        tabulate(_wrapped(check_rows(checks), {1: 60, 5: 50}), headers=CHECK_HEADERS, disable_numparse=True),
        "",
        tabulate(_wrapped(zoo_table_rows(record["zoo"]), {10: 60}), headers=ZOO_HEADERS, disable_numparse=True),
    ]
    failed = [c for c in checks if c.passed is False]
    if failed:
        lines += ["", "FAILED checks:", *(f"- [{c.group}] {c.name}: {c.detail}" for c in failed)]
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in rows]
    return lines


def render_markdown(record: Mapping[str, Any]) -> str:
    """``summary.md``: the environment, the suite, every check, the zoo table and its legend."""
    checks = [Check.from_dict(c) for c in record["checks"]]
    failed = sum(1 for c in checks if c.passed is False)
    lines = [
        f"# gpu-validate: {record['device']} ({record['mode']})",
        "",
        f"- environment: `{record['environment_key'] or 'n/a (no GPU)'}`",
        f"- CPU engine: `{record['cpu_environment_key']}`",
        f"- torch {record['torch']}, transformers {record.get('transformers') or 'not installed'}",
        f"- {_suite_line(record.get('suite'))}",
        f"- {len(checks)} checks, {failed} failed; zoo size `{record['size']}`",
        "",
        "## Checks",
        "",
        *_md_table(CHECK_HEADERS, check_rows(checks)),
        "",
        "## CPU engine (CUDA rounding) vs GPU: one AdamW training step",
        "",
        *_md_table(ZOO_HEADERS, zoo_table_rows(record["zoo"])),
        "",
        GAP_LEGEND,
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- replay


@dataclass
class Loaded:
    """A record folder read back: ``record.json``, the ``memory_stats()`` dumps, the snapshot (if any)."""

    folder: Path
    record: dict[str, Any]
    stats: dict[str, Any]
    snapshot: dict[str, Any] | None

    @property
    def gpu(self) -> bool:
        return bool(self.record.get("mode") == "gpu")

    def measurements(self) -> dict[str, Measurement]:
        return {name: Measurement.from_dict(w["measurement"]) for name, w in self.record["workloads"].items()}


def load_record(folder: Path) -> Loaded:
    """Read a record folder written by :func:`write_record`."""
    record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{folder / RECORD_FILE}: schema {record.get('schema')!r}, this script reads {SCHEMA}")
    stats_path = folder / STATS_FILE
    stats = json.loads(stats_path.read_text(encoding="utf-8")) if stats_path.exists() else {}
    snapshot_path = folder / SNAPSHOT_FILE
    snapshot = load_snapshot(snapshot_path) if snapshot_path.exists() else None
    return Loaded(folder, record, stats, snapshot)


def replay_stats(loaded: Loaded) -> list[Check]:
    """Each raw ``memory_stats()`` dump, read by ``reading_from_stats``, gives the recorded figures."""
    checks = []
    dumps: Mapping[str, Any] = loaded.stats.get("workloads") or {}
    measurements = loaded.measurements()
    if loaded.gpu and not dumps:
        checks.append(Check("replay", "a GPU record holds memory_stats() dumps", False, detail="none found"))
    for name, stats in dumps.items():
        m = measurements.get(name)
        if m is None:
            checks.append(Check("replay", f"{name}: dump of a recorded workload", False, detail="no such workload"))
            continue
        reading = reading_from_stats(stats)
        pairs = (
            ("peak", reading.peak, m.peak),
            ("reserved", reading.reserved_peak, m.reserved),
            ("requested", reading.requested_peak, m.requested_peak),
            ("allocated", int(stats.get("allocated_bytes.all.current", -1)), m.allocated),
        )
        differing = [f"{key} {ours} vs recorded {theirs}" for key, ours, theirs in pairs if ours != theirs]
        checks.append(
            Check(
                "replay",
                f"{name}: reading_from_stats(dump) = recorded peak / reserved / requested / allocated",
                not differing,
                reading.peak,
                m.peak,
                "; ".join(differing),
            )
        )
    return checks


def replay_environment(loaded: Loaded) -> list[Check]:
    """``Environment.from_dict`` of each recorded environment gives back the recorded key."""
    checks = []
    for field_name, key_name in (("environment", "environment_key"), ("cpu_environment", "cpu_environment_key")):
        data, key = loaded.record.get(field_name), loaded.record.get(key_name)
        if data is None:
            if loaded.gpu and field_name == "environment":
                checks.append(Check("replay", "a GPU record holds its environment", False))
            continue
        rebuilt = Environment.from_dict(data)
        same = rebuilt.key == key and rebuilt.to_dict() == data
        checks.append(
            Check("replay", f"{field_name}: Environment.from_dict(...).key = recorded key", same, detail=rebuilt.key)
        )
    if loaded.gpu:
        engine = (loaded.record.get("environment") or {}).get("engine")
        checks.append(
            Check("replay", "the GPU record's environment is a cuda one", engine == "cuda", detail=str(engine))
        )
    return checks


def replay_report(loaded: Loaded) -> list[Check]:
    """The report renders the recorded measurements: every figure formatted, n/a where unknown."""
    measurements = loaded.measurements()
    records = [TestRecord(f"gpu-validate::{name}", [m]) for name, m in measurements.items()]
    rows = summary_rows(records)
    problems = []
    for record in records:
        m = record.measurements[0]
        shown = {row[2]: row[3] for row in rows if row[0] == record.nodeid and row[1] == m.name}
        for metric in ("peak", "allocated", "reserved"):
            value = m.figure(metric)
            if value is None and metric in shown:
                problems.append(f"{m.name}: {metric} unknown but shown as {shown[metric]!r}")
            elif value is not None and shown.get(metric) != format_size(value):
                problems.append(f"{m.name}: {metric} {value} shown as {shown.get(metric)!r}")
    table = measurement_table(list(measurements.values()))
    problems += [f"{name}: missing from the measurement table" for name in measurements if name not in table]
    markdown = markdown_report(records, header=str(loaded.record.get("environment_key") or ""))
    body = [line for line in markdown.splitlines() if line.startswith("| gpu-validate::")]
    if len(body) != len(rows):
        problems.append(f"Markdown report: {len(body)} rows for {len(rows)} figures")
    again = {name: Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) for name, m in measurements.items()}
    problems += [f"{name}: JSON round trip changed it" for name in measurements if again[name] != measurements[name]]
    return [
        Check(
            "replay",
            f"report renders {len(measurements)} recorded measurement(s) ({len(rows)} figures)",
            not problems and bool(measurements),
            detail="; ".join(problems[:5]) or ("" if measurements else "no measurements"),
        )
    ]


def replay_zoo(loaded: Loaded) -> list[Check]:
    """Each zoo row's figures, ratios and explanation follow from its measurements (a GPU record has GPU ones)."""
    measurements = loaded.measurements()
    checks = []
    for row in loaded.record.get("zoo", []):
        if row.get("skipped"):
            continue
        again = zoo_figures(row, measurements)
        differing = [key for key in again if again[key] != row.get(key)]
        if loaded.gpu and not (row.get("gpu") and row.get("gpu_tensors")):
            differing.append("no GPU measurement")
        checks.append(
            Check(
                "replay",
                f"zoo {row['model']} {row['precision']}: figures, ratios and gap explanation recomputed",
                not differing,
                detail=", ".join(differing),
            )
        )
    return checks


def replay_snapshot(loaded: Loaded) -> list[Check]:
    """The snapshot's segments add up to the reserved and allocated bytes of the stats read with it."""
    info = loaded.record.get("snapshot")
    if info is None:
        return [Check("replay", "a GPU record holds a memory snapshot", False)] if loaded.gpu else []
    if loaded.snapshot is None:
        return [Check("replay", f"snapshot file {info.get('file')} is there", False)]
    stats = loaded.stats.get("snapshot") or {}
    index = info.get("device_index")
    segments = [s for s in loaded.snapshot.get("segments", []) if s.get("device", index) == index]
    pairs = (
        ("reserved", sum(int(s["total_size"]) for s in segments), stats.get("reserved_bytes.all.current")),
        ("allocated", sum(int(s["allocated_size"]) for s in segments), stats.get("allocated_bytes.all.current")),
        ("segments", len(segments), stats.get("segment.all.current")),
    )
    differing = [f"{key} {ours} vs stats {theirs}" for key, ours, theirs in pairs if ours != theirs]
    return [
        Check(
            "replay",
            "snapshot segments = reserved / allocated / segment count of the stats read with it",
            not differing,
            pairs[0][1],
            pairs[0][2],
            "; ".join(differing),
        )
    ]


#: The clean-state protocol a record was made with. 1 freed the library workspaces before
#: every start reading, so a span's first matmul counted its cuBLAS workspace as a cost, and
#: determinism compared ``reserved`` to the byte. 2 makes the workspaces before the start and
#: keeps them (part of every start, never a cost), and compares ``reserved``'s cost within one
#: allocator segment. Records without the key are protocol 1.
PROTOCOL = 2

_SUITE_ASSERT = re.compile(r"^E\s+AssertionError: assert (\d+) == (.+)$")


def _arithmetic(text: str) -> int:
    """The value of an integer expression of numbers, + - * // and parentheses (from a pytest log)."""
    import ast

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.FloorDiv):
                return left // right
        raise ValueError(f"not an integer expression: {text!r}")

    return value(ast.parse(text, mode="eval"))


def rejudge(loaded: Loaded) -> list[Check]:
    """The record's own checks, judged by this release's protocol where the recorded data allows.

    For a protocol 1 record, two kinds of failure are judged again from what was recorded:
    the determinism check (``reserved``'s cost within :data:`RESERVED_TOLERANCE_FLOOR`,
    ``start_reserved`` not compared), and CUDA suite failures whose only excess over the
    expected bytes is the recorded cuBLAS workspace (a span's first matmul made it; protocol 2
    makes it before the start). Every other check stands as recorded.
    """
    record = loaded.record
    checks = [Check.from_dict(c) for c in record["checks"]]
    if record.get("protocol", 1) >= PROTOCOL:
        return checks
    measurements = loaded.measurements()
    workspace = record["figures"].get("cublas_workspace")
    judged: list[Check] = []
    for check in checks:
        if check.passed is not False:
            judged.append(check)
        elif check.group == "determinism":
            first, second = measurements["determinism.run-1"], measurements["determinism.run-2"]
            keys = ("start", "peak", "allocated", "requested_peak", "saved_activations")
            same = all(getattr(first, k) == getattr(second, k) for k in keys)
            costs = (first.cost("reserved"), second.cost("reserved"))
            within = None not in costs and abs(costs[0] - costs[1]) <= RESERVED_TOLERANCE_FLOOR  # type: ignore[operator]
            detail = f"protocol 1 record judged again: reserved cost {costs[0]} vs {costs[1]}"
            judged.append(Check(check.group, check.name, same and within, check.measured, check.expected, detail))
        elif check.group == "suite":
            log = (
                (loaded.folder / SUITE_LOG).read_text(encoding="utf-8") if (loaded.folder / SUITE_LOG).exists() else ""
            )
            excesses = []
            for line in log.splitlines():
                match = _SUITE_ASSERT.match(line)
                if match:
                    excesses.append(int(match[1]) - _arithmetic(match[2]))
            failed = (record.get("suite") or {}).get("failures")
            explained = bool(excesses) and len(excesses) == failed and all(e == workspace for e in excesses)
            detail = (
                f"protocol 1 record judged again: {len(excesses)} failure(s), each over by {excesses}; "
                f"the cuBLAS workspace a span's first matmul made is {workspace} B"
            )
            judged.append(Check(check.group, check.name, explained, check.measured, check.expected, detail))
        else:
            judged.append(check)
    return judged


def replay(folder: Path) -> list[Check]:
    """Every replay check of a record folder (what ``tests/test_replay.py`` asserts)."""
    loaded = load_record(folder)
    return [
        *replay_stats(loaded),
        *replay_environment(loaded),
        *replay_report(loaded),
        *replay_zoo(loaded),
        *replay_snapshot(loaded),
    ]


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-validate",
        description="Validate pytest-gpumem on a CUDA GPU and record what it saw under fixtures/recorded/.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder in which the record folder <gpu-model>-torch<version>/ is written "
        "(default: fixtures/recorded; required with --cpu-only)",
    )
    parser.add_argument(
        "--cpu-only",
        "--dry-run",
        dest="cpu_only",
        action="store_true",
        help="run only what needs no GPU (CPU half of the zoo, references on the CPU engine); GPU figures are n/a",
    )
    parser.add_argument("--device", default="cuda", help="the CUDA device (default: cuda, the current one)")
    parser.add_argument("--size", choices=SIZES, default="small", help="zoo and reference sizes (default: small)")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated zoo models (default: {','.join(MODELS)}; those whose package is missing are skipped)",
    )
    parser.add_argument("--skip-suite", action="store_true", help="do not run the CUDA test suite")
    parser.add_argument("--suite-timeout", type=float, default=300.0, help="seconds for the CUDA suite (default 300)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="an extra argument for the CUDA suite")
    parser.add_argument(
        "--snapshot-entries", type=int, default=SNAPSHOT_ENTRIES, help="allocation history kept in the snapshot"
    )
    return parser


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the validation; 0 when every check passed, 1 when one failed, 2 when it could not run."""
    options = _parser().parse_args(argv)
    recorded = ROOT / "fixtures" / "recorded"
    if options.cpu_only:
        if options.out is None:
            print("gpu-validate: --cpu-only needs --out DIR (only a GPU run writes under fixtures/)", file=sys.stderr)
            return 2
        if _inside(options.out, recorded):
            print(f"gpu-validate: --cpu-only must not write under {recorded}: only a GPU run may", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print(
            "gpu-validate: no CUDA device is available; run on a GPU machine, "
            "or use --cpu-only --out DIR to exercise the CPU half",
            file=sys.stderr,
        )
        return 2
    try:
        models = zoo(options.size, tuple(m.strip() for m in options.models.split(",") if m.strip()))
    except ValueError as exc:
        print(f"gpu-validate: {exc}", file=sys.stderr)
        return 2

    gpu = None if options.cpu_only else _cuda_device(options.device)
    device = gpu or torch.device("cpu")
    run = Run(device=device, size=options.size)
    environment = None if gpu is None else Environment.detect("cuda", gpu)
    folder = (options.out or recorded) / record_name(
        None if environment is None else environment.device_name, torch.__version__
    )

    suite: dict[str, Any] | None = None
    suite_log: str | None = None
    if gpu is not None and not options.skip_suite:
        log("running the CUDA test suite")
        suite, suite_log = run_suite(options.pytest_arg, options.suite_timeout)
        run.checks.append(suite_check(suite))

    snapshot_bytes: bytes | None = None
    snapshot_info: dict[str, Any] | None = None
    snapshot_stats: dict[str, Any] | None = None
    if gpu is not None:
        torch.cuda.set_device(gpu)
        torch.empty(1, device=gpu)
        torch.cuda.memory._record_memory_history(max_entries=options.snapshot_entries, stacks="python")
    try:
        reference_linear(run)
        reference_adam(run)
        reference_mlp(run)
    finally:
        if gpu is not None:
            with run.guard("reference", "memory snapshot of the reference workloads"):
                snapshot_bytes, snapshot_stats, snapshot_info = take_snapshot(gpu, options.snapshot_entries)
            torch.cuda.memory._record_memory_history(enabled=None)
    reference_hand_counters(run)
    first = next((m for m in models if m.available), None)
    if first is not None:
        reference_determinism(run, first)
    reference_workspaces(run, [m for m in models if m.available])
    zoo_comparison(run, models, gpu)
    counter_checks(run)

    stats = {
        "workloads": {name: o.stats for name, o in run.outcomes.items() if o.stats is not None},
        "snapshot": snapshot_stats,
    }
    record = build_record(
        run,
        mode="cpu-only" if gpu is None else "gpu",
        environment=environment,
        suite=suite,
        snapshot=snapshot_info,
        models=models,
    )
    write_record(folder, record, stats, snapshot=snapshot_bytes, suite_log=suite_log)
    log(f"replaying {folder}")
    try:
        replayed = replay(folder)
    except Exception as exc:  # a record CI could not read: say so, keep the record for inspection
        replayed = [Check("replay", "the record reads back", False, detail=f"{type(exc).__name__}: {exc}")]
    record["checks"] += [c.to_dict() for c in replayed]
    files = write_record(folder, record, stats, snapshot=snapshot_bytes, suite_log=suite_log)

    print(render_terminal(record))
    print()
    print(f"record: {folder}")
    for path in files:
        print(f"  {path.name}  {path.stat().st_size:,} B")
    checks = [Check.from_dict(c) for c in record["checks"]]
    return 1 if any(c.passed is False for c in checks) else 0


def _cuda_device(spec: str) -> torch.device:
    device = torch.device(spec)
    if device.type != "cuda":
        raise SystemExit(f"gpu-validate: --device must be a CUDA device, got {spec!r}")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
