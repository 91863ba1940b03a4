"""Allocations observed where they happen: the CPU allocator's own reports to PyTorch's profiler (see docs/figures.md).

Each reading replays the session's events; a Python-side event is queued with a 1-byte mark allocation that places it.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.measurement import collector, frozen, gcfunctions
from pytest_gpumem.measurement.engines.saved import Held, Released, unpack
from pytest_gpumem.measurement.engines.savedhooks import SavedTensorHooks
from pytest_gpumem.measurement.engines.storages import Block, Entry, Window, is_fake, tensors_among
from pytest_gpumem.measurement.engines.tracker import FOLLOWERS, TEMPORARIES, StorageTracker
from pytest_gpumem.units import cuda_rounded

__all__ = ["MARK_BYTES", "AllocationTracker", "ProfilerInUse"]

#: The size of the allocations that place Python-side events in the stream (their marks).
MARK_BYTES = 1

_SAVE, _UNSAVE, _REGISTER, _FREED, _WINDOW = range(5)

#: The note on a span that ran work on other threads while the profiler was read.
THREADS_NOT_SEEN = (
    "work ran on other threads, whose allocations observe='allocations' does not see (PyTorch's profiler "
    "reports only the allocations of the thread that started it): peak and allocated miss them; measure "
    "threaded code with observe='operators'"
)


class ProfilerInUse(RuntimeError):
    """PyTorch's profiler is already running: allocations cannot be observed through it."""


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto writes a line to the process's stderr each time a session starts or stops."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocationTracker(StorageTracker):
    """The storage tracker's accounting over the CPU allocator's events (see the module's docstring)."""

    observes = "allocations"
    #: Profile user scopes only: memory events and no operator events (False: every scope, slower, same figures).
    user_scopes_only = True

    def __init__(self, device: torch.device, *, cuda_rounding: bool = False) -> None:
        super().__init__(device, cuda_rounding=cuda_rounding)
        if self.device.type != "cpu":
            raise ValueError(f"observe='allocations' reads the CPU allocator's reports, not {self.device}")
        from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled
        from torch._C._profiler import RecordScope, _EventType
        from torch.autograd.profiler import profile

        self._prepare, self._enable, self._disable = _prepare_profiler, _enable_profiler, _disable_profiler
        self._profiler_enabled = _profiler_enabled
        # the configuration torch.profiler itself would use (its fields change across versions)
        template = profile(use_cpu=True, profile_memory=True, use_kineto=True)
        self._config = template.config
        self._activities = template.kineto_activities
        self._allocation_tag = _EventType.Allocation
        self._scopes = {RecordScope.USER_SCOPE} if self.user_scopes_only else set()
        self._queue: list[tuple[Any, ...]] = []
        self._marks: list[torch.UntypedStorage] = []  # one a queued event, alive until the replay
        self._tokens = itertools.count()
        self._saved_entries: dict[int, Any] = {}
        self._windows: dict[int, tuple[Window, int, int]] = {}
        self._graph_task = torch._C._current_graph_task_id
        self._profiling = False
        self._holding = False  # inside reading(): one flush serves every reading
        # TorchDynamo must never trace the hook: the mark it makes is not traceable
        self._pack_hook = torch.compiler.disable(self._pack)

    # -- the profiler session ---------------------------------------------------------

    def _begin_session(self) -> None:
        config = self._config()
        with _quiet_stderr():
            self._prepare(config, self._activities)
            self._enable(config, self._activities, self._scopes)  # type: ignore[call-arg]  # torch's stub lacks scopes

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        if self._profiling:
            raise RuntimeError("the allocation tracker is already active")
        if self._profiler_enabled():
            raise ProfilerInUse(
                "observe='allocations' reads allocations through PyTorch's profiler, which is already "
                "running; measure this code with observe='operators', or profile it outside the measurement"
            )
        self._windows.clear()
        self._begin_count(timeline)
        self._begin_session()
        self._profiling = True
        FOLLOWERS.add(self)
        if saved_tensors:
            self._saved_hooks = SavedTensorHooks(self._pack_hook, unpack, notes=self.notes)
            self._saved_hooks.push()

    def stop(self) -> None:
        FOLLOWERS.remove(self)
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.pop()
        if self._profiling:
            collector.collect()  # garbage made in the span is freed while its frees are still reported
            self._flush(restart=False)
            self._adopt_survivors()

    def _adopt_survivors(self) -> None:
        """Give the blocks still alive weak references: once the profiler stops, their frees are not reported."""
        for obj in itertools.chain(tensors_among(gcfunctions.get_objects()), frozen.tensors()):  # frozen ones too
            if type(obj) is not torch.Tensor and is_fake(obj):
                continue  # torch.compile's tracing tensors: no memory, a data pointer torch warns about
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            block: Any = self._entries.get(ptr)
            if type(block) is not Block:
                continue
            entry = Entry(storage, self._freed)
            for field in Entry.__slots__:
                if hasattr(block, field):  # ``site`` only where sites were recorded
                    setattr(entry, field, getattr(block, field))
            self._entries[ptr] = entry
            for token, saved in self._saved_entries.items():
                if saved is block:
                    self._saved_entries[token] = entry

    @property
    def active(self) -> bool:
        return self._profiling

    def _follow(self, stack: contextlib.ExitStack) -> None:
        """A thread runs work while the span is measured: the profiler cannot see it, so the figures say so."""
        with self._lock:
            if THREADS_NOT_SEEN not in self.notes:
                self.notes.append(THREADS_NOT_SEEN)

    def flush(self) -> None:
        """Bring the ledger up to now; not inside backward, whose nodes run under the session captured as it began."""
        if self._profiling and not self._holding and self._graph_task() == -1:
            self._flush(restart=True)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Readings taken together (a span's start or end figures): one flush for all of them."""
        if self._holding:
            yield
            return
        self.flush()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def _flush(self, *, restart: bool) -> None:
        if not self._profiler_enabled():
            self._profiling = False
            raise ProfilerInUse(
                "observe='allocations' lost its profiler session: the measured code stopped PyTorch's "
                "profiler (torch.profiler used inside the measurement); measure this code with observe='operators'"
            )
        enabled = gc.isenabled()
        gc.disable()  # nothing may be freed between the two sessions: that free would go unseen
        try:
            with _quiet_stderr():
                result = self._disable()
            queued, self._queue = self._queue, []
            marks, self._marks = self._marks, []
            if restart:
                self._begin_session()
            else:
                self._profiling = False
        finally:
            if enabled:
                gc.enable()
        self._replay(result, queued, marks)

    def _record(self, event: tuple[Any, ...]) -> None:
        """A Python-side event: queued with a mark in the stream while profiling, else applied now."""
        if self._profiling:
            self._queue.append(event)
            self._marks.append(torch.UntypedStorage(MARK_BYTES, device=self.device))
        else:
            self._apply(event)

    # -- replay ---------------------------------------------------------------------

    def _replay(self, result: Any, queued: list[tuple[Any, ...]], marks: list[torch.UntypedStorage]) -> None:
        allocation = self._allocation_tag
        stream: list[tuple[int, int, int]] = []  # (time, ptr, signed bytes)
        stack = list(result.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == allocation:
                fields = event.extra_fields
                if fields.device.type == "cpu" and fields.alloc_size:
                    stream.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            stack.extend(event.children)
        stream.sort(key=lambda item: item[0])
        # a mark's address names its event: its storage is alive, no other block has that address
        placed = {mark.data_ptr(): index for index, mark in enumerate(marks)}
        applied = 0
        for _, ptr, size in stream:
            entry: Any = self._entries.get(ptr)
            if size < 0:
                if type(entry) is Block:  # a block alive before the span is freed by its weak reference
                    StorageTracker._on_freed(self, entry)
                continue
            if entry is not None:  # its free went unseen: the block is gone, its address reused
                StorageTracker._on_freed(self, entry)
            index = placed.get(ptr) if size == MARK_BYTES else None
            if index is not None and index >= applied:
                for event in queued[applied : index + 1]:  # an earlier mark unseen (another thread): here
                    self._apply(event)
                applied = index + 1
            else:
                self._insert(Block(), ptr, cuda_rounded(size) if self.cuda_rounding else size, TEMPORARIES)
        for event in queued[applied:]:  # marks not seen (made on another thread): after everything seen
            self._apply(event)
        del marks  # their frees are reported in the next session, at addresses no block has

    def _apply(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == _FREED:
            StorageTracker._on_freed(self, event[1])
        elif kind == _REGISTER:
            _, ptrs, index, is_param = event
            for ptr in ptrs:
                entry = self._entries.get(ptr)
                if entry is None:
                    continue
                if entry.category != index:
                    self._move(entry, index)
                if is_param:
                    self._param_keys.add(ptr)
        elif kind == _SAVE:
            _, token, ptr = event
            entry = self._entries.get(ptr)
            if entry is None or ptr in self._param_keys:
                return
            self._saved_entries[token] = entry
            self._save(entry)
        elif kind == _WINDOW:
            window = StorageTracker.take_window(self)
            self._windows[event[1]] = (window, self.current, self.events)
        elif kind == _UNSAVE:
            saved: Any = self._saved_entries.pop(event[1], None)
            if saved is not None and self._entries.get(saved.key) is saved:
                self._unsave(saved)  # type: ignore[arg-type]  # an entry by its fields

    # -- what Python learns -----------------------------------------------------------

    def _on_freed(self, entry: Any) -> None:
        """Weak-reference callback of a storage alive before the span: queued like the rest."""
        if self._profiling:
            self._record((_FREED, entry))
        else:
            StorageTracker._on_freed(self, entry)

    def register(self, tensors: Iterable[torch.Tensor], category: str | None = None) -> None:
        if not self._profiling:  # the scan before the span: storages alive now, found by weak reference
            super().register(tensors, category)
            return
        if category is None:
            return  # storages seen in the stream are already counted; nothing else to learn
        ptrs = []
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and self._on_device(tensor):
                try:
                    ptr = self._key(tensor.untyped_storage())
                except (RuntimeError, NotImplementedError):
                    continue
                if ptr is not None:
                    ptrs.append(ptr)
        if ptrs:
            self._record((_REGISTER, ptrs, CATEGORIES.index(category), category == "parameters"))

    def _key(self, storage: torch.UntypedStorage) -> int | None:
        """Allocations are known by address: a storage by its data pointer (None for no data)."""
        return storage.data_ptr() or None

    def _pack(self, tensor: torch.Tensor) -> Held:
        if not self._on_device(tensor):
            return Held(tensor)
        base = tensor._base
        parameter_type = torch.nn.Parameter
        if isinstance(tensor, parameter_type) or isinstance(base, parameter_type):
            self.register((tensor if base is None else base,), "parameters")
            return Held(tensor)
        try:
            ptr = self._key(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return Held(tensor)
        if ptr is None:
            return Held(tensor)
        token = next(self._tokens)
        self._record((_SAVE, token, ptr))
        return Released(tensor, self._record, (_UNSAVE, token))  # autograd lets go: queued like the save

    # -- readings flush first ---------------------------------------------------------

    def take_window(self, *, defer: bool = False) -> Window:
        """The window since the last one; with ``defer``, or in backward, a pending one to :meth:`resolve`."""
        if self._profiling and (defer or self._graph_task() != -1):
            token = next(self._tokens)
            self._record((_WINDOW, token))
            return Window(0, (), pending=token)
        self.flush()
        return super().take_window()

    def resolve(self, token: int) -> tuple[Window, int, int]:
        try:
            return self._windows[token]
        except KeyError:
            raise LookupError(f"pending window {token} is not read yet: read a window outside backward first") from None

    def breakdown(self) -> dict[str, int]:
        self.flush()
        return super().breakdown()
