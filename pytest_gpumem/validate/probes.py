"""Probes: a workload measured by the plugin and read from PyTorch's own counters in the same span."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pytest_gpumem.measurement.active import measure
from pytest_gpumem.measurement.engines.cpu import CpuEngine
from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.measurement.recorder import Recorder, Span
from pytest_gpumem.validate.results import Outcome


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
    _outcome: Outcome | None = None

    def allocated_now(self) -> int:
        """Allocated bytes now: PyTorch's ``memory_allocated`` on CUDA, the engine's count elsewhere."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
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
    made._outcome = Outcome(name, span.measurement, counters, stats)
