"""The prediction engine: a CPU run, counted as a target GPU's caching allocator would count it.

The storage tracker watches the run's operators as on the CPU engine; every storage it
sees allocated or freed is also requested from, or returned to, a model of the CUDA
caching allocator (:class:`~pytest_gpumem.predict.allocator.CachingAllocatorModel`) with
the target's constants, and the library workspaces the target's threads allocate at their
first matrix product (cuBLAS, cuBLASLt) are allocated there too. The figures are the model's:
``allocated`` counts whole blocks (512-byte rounding, blocks it did not split), ``reserved``
its segments. Like the CUDA engine, the engine creates the workspaces before a test's start
reading, so a test's cost never includes a workspace an earlier test did or did not create.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from pytest_gpumem.engines.base import Reading
from pytest_gpumem.engines.cpu import CpuEngine
from pytest_gpumem.engines.tracker import OTHER, StorageTracker, _Mode
from pytest_gpumem.predict import Target, Workspace

__all__ = ["PredictEngine", "PredictTracker"]

#: The thread a workspace belongs to: the caller's, or the autograd engine's device thread,
#: which runs a CUDA backward (on the CPU, backward runs on the caller's thread).
_MAIN, _BACKWARD = "main", "backward"


class _Synthetic:
    """A tracker entry for memory that is no tensor (a workspace): alive until released."""

    __slots__ = ("category", "key", "moved", "nbytes", "prior", "saves", "serial")
    key: int
    nbytes: int
    category: int
    serial: int
    moved: int
    saves: int
    prior: int

    def __call__(self) -> _Synthetic:
        return self


class _PredictMode(_Mode):
    """The tracker's dispatch mode, which also sees the operators that make a thread's workspaces."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        tracker = self.tracker
        assert isinstance(tracker, PredictTracker)
        name = func._overloadpacket.__name__
        if name in tracker.workspace_operators:
            tracker.matrix_product(name, args)
        return super().__torch_dispatch__(func, types, args, kwargs)


class PredictTracker(StorageTracker):
    """The storage tracker, its allocations mirrored in a model of the target's caching allocator."""

    def __init__(self, target: Target) -> None:
        super().__init__(torch.device("cpu"), cuda_rounding=True)
        from pytest_gpumem.predict import CachingAllocatorModel

        self.target = target
        self.model = CachingAllocatorModel(target.allocator)
        self.workspace_operators = frozenset().union(*(w.operators for w in target.workspaces))
        self._workspaces: dict[tuple[str, str], _Synthetic] = {}
        self._synthetic_keys = itertools.count(1)

    # -- the model follows the tracker's entries -----------------------------------------

    def _insert(self, entry: Any, key: int, nbytes: int, category: int) -> None:
        self.model.malloc(key, nbytes)
        super()._insert(entry, key, nbytes, category)

    def _on_freed(self, entry: Any) -> None:
        key = entry.key
        if self._entries.get(key) is entry:
            self.model.free(key)
        super()._on_freed(entry)

    def _output(self, tensor: torch.Tensor, fresh: bool) -> None:
        super()._output(tensor, fresh)
        if not tensor.is_cpu or tensor.layout != torch.strided:
            return
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        entry = self._entries.get(key)
        if entry is not None and self.model.size_of(key) != entry.nbytes:  # resized in place
            self.model.free(key)
            self.model.malloc(key, entry.nbytes)

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        super().start(saved_tensors=saved_tensors, timeline=timeline)
        # the same mode with the workspace check (the base class entered a plain one)
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._mode = _PredictMode(self)
        self._mode.__enter__()
        self._mode.armed = True

    # -- workspaces ----------------------------------------------------------------

    def matrix_product(self, name: str, args: tuple[Any, ...]) -> None:
        """The thread running operator ``name`` gets the workspaces it uses, if it has none yet."""
        thread = _BACKWARD if torch._C._current_graph_task_id() != -1 else _MAIN
        for workspace in self.target.workspaces:
            if name in workspace.operators and (workspace.library, thread) not in self._workspaces:
                if workspace.when == "bias" and not _has_vector_bias(args):
                    continue
                self._create(workspace, thread)

    def _create(self, workspace: Workspace, thread: str) -> None:
        entry = _Synthetic()
        key = -next(self._synthetic_keys)  # storages' keys are addresses: never negative
        self._workspaces[(workspace.library, thread)] = entry
        self._insert(entry, key, workspace.nbytes, OTHER)

    def warm_workspaces(self) -> None:
        """Create every workspace a training step's threads get: the caller's thread all of
        them, the backward thread those of a plain matrix product."""
        for workspace in self.target.workspaces:
            if (workspace.library, _MAIN) not in self._workspaces:
                self._create(workspace, _MAIN)
            plain = "mm" in workspace.operators and workspace.when is None
            if plain and (workspace.library, _BACKWARD) not in self._workspaces:
                self._create(workspace, _BACKWARD)

    def release_workspaces(self) -> None:
        """Free every workspace (what ``torch._C._cuda_clearCublasWorkspaces()`` does)."""
        for entry in self._workspaces.values():
            self._on_freed(entry)
        self._workspaces.clear()

    @property
    def workspace_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._workspaces.values())


def _has_vector_bias(args: tuple[Any, ...]) -> bool:
    """``addmm(bias, a, b)`` with a one-dimensional bias: ``Linear`` with a bias (cuBLASLt's path)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dim() == 1


class PredictEngine(CpuEngine):
    """A CPU run whose figures are those the target GPU's caching allocator would show.

    Args:
        target: the GPU and PyTorch version to predict (:func:`pytest_gpumem.predict.target`).
    """

    name = "predict"
    exact = True

    def __init__(self, target: Target) -> None:
        self.target = target
        self.predictor = PredictTracker(target)
        super().__init__(tracker=self.predictor)
        self._workspace_total: int | None = None

    @property
    def workspaces(self) -> int | None:
        return self._workspace_total

    def allocated(self) -> int:
        return self.predictor.model.allocated

    def reserved(self) -> int | None:
        return self.predictor.model.reserved

    def take_window(self, *, defer: bool = False) -> Reading:
        window = self.tracker.take_window()
        model = self.predictor.model
        peak, reserved_peak = model.peak_allocated, model.peak_reserved
        model.reset_peaks()
        breakdown = window.breakdown
        if breakdown is not None and peak > window.peak:  # whole blocks the allocator did not split
            parts = list(breakdown)
            parts[OTHER] += peak - window.peak
            breakdown = tuple(parts)
        return Reading(peak=peak, breakdown=breakdown, reserved_peak=reserved_peak, saved_peak=window.saved_peak)

    def clean(self) -> None:
        """As the CUDA engine: collect garbage, register what is alive, create the workspaces,
        return cached blocks (``empty_cache``), and start a new window."""
        self.settle()
        self.tracker.scan()
        self.warm_workspaces()
        if self._workspace_total is None:
            self._workspace_total = self.predictor.workspace_bytes
        self.empty_cache()
        self.take_window()

    def warm_workspaces(self) -> None:
        self.predictor.warm_workspaces()

    def release_workspaces(self) -> None:
        self.predictor.release_workspaces()

    def empty_cache(self) -> None:
        self.predictor.model.empty_cache()
