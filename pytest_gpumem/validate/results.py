"""The results of a validation run: checks, outcomes and the probes that measure them, the run that collects them,
and the record's files."""

from __future__ import annotations

import contextlib
import gc
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pytest_gpumem.codec import Coded
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import METRIC_INFO
from pytest_gpumem.measurement.active import measure
from pytest_gpumem.measurement.engines.cpu import CpuEngine
from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.measurement.recorder import Recorder, Span

#: The source checkout this package runs from (holding ``tests/``); None when installed.
_TOP = Path(__file__).resolve().parents[2]
CHECKOUT: Path | None = _TOP if (_TOP / "tests").is_dir() and (_TOP / "pyproject.toml").is_file() else None

#: Version of ``record.json``'s layout.
SCHEMA = 1

RECORD_FILE = "record.json"
SUMMARY_FILE = "summary.md"
STATS_FILE = "memory_stats.json"
SNAPSHOT_FILE = "snapshot.pickle"
SUITE_LOG = "cuda-suite.log"
#: Every file a record may hold (the device tool brings back at most 8 files of 16 MiB each).
RECORD_FILES: tuple[str, ...] = (RECORD_FILE, SUMMARY_FILE, STATS_FILE, SNAPSHOT_FILE, SUITE_LOG)

#: Largest snapshot file written; longer histories are cut from the front until it fits.
SNAPSHOT_LIMIT = 12 * 2**20
#: Last bytes of the CUDA suite's output kept in ``cuda-suite.log``.
SUITE_LOG_LIMIT = 256 * 2**10

#: Shapes ``(b, s, d)`` of the bf16 MLP reference per zoo size: the issue's figure on a GPU, tiny for tests.
MLP_REFERENCE: Mapping[str, tuple[int, int, int]] = {"small": (2, 4096, 1024), "tiny": (2, 64, 64)}

#: The clean-state protocol a record was made with: 1 freed the library workspaces before every start reading, 2 makes
#: and keeps them and compares ``reserved``'s cost within a segment. No key: protocol 1.
PROTOCOL = 2

#: The workload traced by ``--trace mlp``: the zoo MLP's fp32 AdamW step on the GPU (after its warm-up).
TRACED_STEP = "trace.zoo.mlp.fp32"


@dataclass
class Check(Coded):
    """One assertion and its figures; ``passed`` is None where it does not apply (a GPU figure on a CPU-only run)."""

    group: str
    name: str
    passed: bool | None
    measured: int | None = None
    expected: int | None = None
    detail: str = ""

    @property
    def result(self) -> str:
        return "n/a" if self.passed is None else ("ok" if self.passed else "FAILED")


@dataclass
class Outcome:
    """A measured workload: the plugin's figures and, on CUDA, PyTorch's counters and ``memory_stats()`` read at the end
    of the same span (None off CUDA)."""

    name: str
    measurement: Measurement
    counters: dict[str, int] | None = None
    stats: dict[str, Any] | None = None


class TensorEngine(CpuEngine):
    """The storage tracker alone on any device: tensor storage bytes, rounded to 512-byte blocks (on CUDA, the
    allocator's figures minus its bytes outside tensors)."""

    name = "cuda-tensors"

    def __init__(self, device: torch.device) -> None:
        super().__init__(tracker=StorageTracker(device, cuda_rounding=True))
        self.device = device


@dataclass
class Probe:
    """Yielded by :func:`probe`: the span, and after the block the :class:`Outcome`."""

    name: str
    device: torch.device
    span: Span
    outcome: Outcome = field(init=False)

    def allocated_now(self) -> int:
        """Allocated bytes now: PyTorch's ``memory_allocated`` on CUDA, the engine's count elsewhere."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.span.recorder.engine.allocated()


@contextlib.contextmanager
def probe(
    name: str,
    device: torch.device,
    *,
    breakdown: bool = False,
    track: Sequence[Any] = (),
    tensors_only: bool = False,
) -> Iterator[Probe]:
    """Measure the block with ``measure()`` and, on CUDA, read PyTorch's counters at its end in the same span.

    With nothing tracked the plugin's figures must equal them to the byte; ``tensors_only`` measures with
    :class:`TensorEngine` instead.
    """
    cuda = device.type == "cuda" and not tensors_only
    counters: dict[str, int] | None = None
    stats: dict[str, Any] | None = None
    with contextlib.ExitStack() as stack:
        if tensors_only:
            recorder = Recorder(TensorEngine(device))
            recorder.track(*track)
            recorder.begin()
            stack.callback(recorder.end)
            span = stack.enter_context(recorder.span(name))
        else:
            measured = measure(name, device=device, breakdown=breakdown, cuda_rounding=True, track=tuple(track))
            span = stack.enter_context(measured)
        made = Probe(name, device, span)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        yield made
        if cuda:
            torch.cuda.synchronize(device)
            counters = {
                "max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
                "memory_allocated": int(torch.cuda.memory_allocated(device)),
                "max_memory_reserved": int(torch.cuda.max_memory_reserved(device)),
            }
            stats = dict(torch.cuda.memory_stats(device))
    if track:  # tracked modules open phase windows, which reset the peaks mid-span
        counters = stats = None
    made.outcome = Outcome(name, span.measurement, counters, stats)


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

    def check(self, group: str, name: str, measured: int | None, expected: int | None, detail: str = "") -> None:
        """Record ``measured == expected`` (n/a when either is None)."""
        passed = None if measured is None or expected is None else measured == expected
        self.checks.append(Check(group, name, passed, measured, expected, detail))

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


def reserved_slack(*runs: Measurement) -> int:
    """How far ``reserved``'s cost may move between runs of one step in one process: a segment, or the bytes the caching
    allocator held free at a run's start."""
    free = [m.start_reserved - m.start for m in runs if m.start_reserved is not None and m.start is not None]
    return max([METRIC_INFO["reserved"].tolerance_floor, *free])


def agreeing(
    group: str, name: str, pairs: Sequence[tuple[str, Any, Any]], source: str, spec: str = "", same: str = ""
) -> Check:
    """A check that each pair of figures is equal (measured and expected: the first pair's); the detail names those
    that differ (formatted with ``spec``, the second of each from ``source``), else it is ``same``."""
    differing = [f"{key} {ours:{spec}} vs {source} {theirs:{spec}}" for key, ours, theirs in pairs if ours != theirs]
    return Check(group, name, not differing, pairs[0][1], pairs[0][2], "; ".join(differing) or same)


def suite_check(summary: Mapping[str, Any]) -> Check:
    """The suite passed: exit 0, tests ran, none failed, none skipped (with a GPU nothing may skip)."""
    tests, skipped = summary.get("tests"), summary.get("skipped")
    passed = summary.get("exit_code") == 0 and bool(tests) and not summary.get("failures") and not skipped
    detail = (
        f"{tests} test(s), {summary.get('failures')} failed, {summary.get('errors')} error(s), "
        f"{skipped} skipped, exit {summary.get('exit_code')}, {summary.get('seconds')} s: {summary.get('command')}"
    )
    return Check("suite", "CUDA test suite (pytest tests -m cuda)", passed, detail=detail)
