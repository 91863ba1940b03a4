"""An exact tensor-storage tracker at the dispatcher level: every operator's outputs, each storage's death."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.measurement import frozen, gcfunctions
from pytest_gpumem.measurement.engines.compiled import forget_skips
from pytest_gpumem.measurement.engines.dispatch import TrackerMode
from pytest_gpumem.measurement.engines.followers import follow_threads, watch_resizes
from pytest_gpumem.measurement.engines.saved import Held, Released, unpack
from pytest_gpumem.measurement.engines.savedhooks import SavedTensorHooks
from pytest_gpumem.measurement.engines.site_tracking import TrackedSites
from pytest_gpumem.measurement.engines.storages import (
    _PLAIN,
    Block,
    Entry,
    OutOfMemory,
    StorageObserver,
    Window,
    fakes_counted,
    inner_tensors,
    sort_scanned,
    tensors_among,
)
from pytest_gpumem.units import CUDA_BLOCK, cuda_rounded

__all__ = ["CUDA_BLOCK", "StorageObserver", "StorageTracker", "Window", "cuda_rounded"]

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, OTHER = range(len(CATEGORIES))

TIMELINE_LIMIT = 512  #: most samples a timeline keeps; longer timelines are halved (keeping maxima)
_WIDTH = 2 + len(CATEGORIES)  # a sample's ints: its event's index, its total, its bytes by category
_NEVER = sys.maxsize  # the next sampled event while no timeline is kept


class StorageTracker(TrackedSites):
    """Counts the bytes of tensor storages on a device, by category: :meth:`scan`, then :meth:`start`, :meth:`stop`."""

    observes = "operators"  #: how it sees allocations: "operators" (its dispatch mode) or "allocations"

    def __init__(
        self,
        device: torch.device,
        *,
        cuda_rounding: bool = False,
        observer: StorageObserver | None = None,
        operator_hooks: Mapping[str, Callable[[tuple[Any, ...]], None]] | None = None,
        thread_contexts: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]] = (),
    ) -> None:
        self.device = torch.device(device)
        self.cuda_rounding = cuda_rounding
        self.observer = observer
        self.operator_hooks = dict(operator_hooks or {})
        self.thread_contexts = tuple(thread_contexts)
        self._contexts: contextlib.ExitStack | None = None
        self._entries: dict[int, Entry] = {}
        self._by_category = [0] * len(CATEGORIES)
        self.current = 0
        self._window = Window(0, tuple(self._by_category), 0)
        self._pending = False  # the peak's breakdown is not copied yet: a rising count costs no copy
        #: id(operator) → how the dispatch mode calls it, its output kind, its hook, the operator
        self._operators: dict[int, tuple[Callable[..., Any], int, Callable[[tuple[Any, ...]], None] | None, Any]] = {}
        self._lock = threading.RLock()  # reentrant: a collection inside a change frees storages on this thread
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self.notes: list[str] = []  #: what the figures miss since :meth:`start`
        self.counts_fakes = False  #: fake tensors are memory (fake=True)
        self._freed = self._on_freed  # one bound method for every weak reference
        self._mode: TrackerMode | None = None
        self._saved_hooks: Any = None
        self._param_keys: set[int] = set()
        self.saved = 0  #: bytes of the distinct storages autograd holds for backward (parameters excluded)
        self.events = 0
        self.compiled_frames: list[tuple[bool, str]] = []  #: frames TorchDynamo ran eagerly under the mode
        self.skipped_codes: set[Any] = set()  #: their code objects, whose skip mark :meth:`stop` clears
        self._samples: list[int] | None = None  # flat: an event's index, then its bytes by category
        self._timeline_stride = 1
        self._next_sample = _NEVER  # the event the timeline samples next
        self.sites = None  # where storages are made, only when asked (TrackedSites)
        self.limit: int | None = None  #: emulated device limit in bytes
        self.on_oom: Callable[[int], None] | None = None  #: called with the request size before the limit raises
        strided = self._strided = torch.strided
        self._cpu = self.device.type == "cpu"
        if self._cpu:
            self._on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cpu and t.layout == strided
        else:
            dev_type, index = self.device.type, self.device.index or 0
            self._on_device = lambda t: t.device.type == dev_type and t.get_device() == index

    # -- what is counted -------------------------------------------------------

    def breakdown(self) -> dict[str, int]:
        """Bytes alive now, by category."""
        with self._lock:
            return dict(zip(CATEGORIES, self._by_category, strict=True))

    def _add(self, storage: torch.UntypedStorage, key: int, category: int) -> None:
        nbytes = storage.nbytes()
        if self.cuda_rounding:
            nbytes = cuda_rounded(nbytes)
        if self.limit is not None and self.current + nbytes > self.limit:
            self._refuse(nbytes)
        self._insert(Entry(storage, self._freed), key, nbytes, category)

    def _insert(self, entry: Any, key: int, nbytes: int, category: int) -> None:
        self.events = events = self.events + 1
        entry.key = key
        entry.nbytes = nbytes
        entry.category = entry.prior = category
        entry.moved = events
        entry.saves = 0
        if self.observer is not None:
            self.observer.allocated(key, nbytes)
        self._entries[key] = entry
        self._by_category[category] += nbytes
        self.current = current = self.current + nbytes
        window = self._window
        if current > window.peak:
            window.peak = current
            window.event = events
            self._pending = True
        if events >= self._next_sample:
            self._sample()

    def add_block(self, key: int, nbytes: int, category: str = "other") -> Block:
        """Count ``nbytes`` that no storage holds (a library's workspace) under a negative ``key``."""
        block = Block()
        with self._lock:
            self._insert(block, key, nbytes, CATEGORIES.index(category))
        return block

    def remove_block(self, block: Block) -> None:
        self._on_freed(block)

    def _refuse(self, nbytes: int) -> None:
        if self.on_oom is not None:
            self.on_oom(nbytes)
        raise OutOfMemory(
            f"Tried to allocate {nbytes} bytes with {self.current} bytes allocated: "
            f"over the emulated device limit of {self.limit} bytes (pytest-gpumem CPU engine)"
        )

    def _on_freed(self, entry: Entry | Block) -> None:
        """Weak-reference callback: ``entry``'s storage is being freed (on any thread)."""
        key = entry.key
        self._acquire()
        try:
            if self._entries.get(key) is not entry:
                return
            if self.observer is not None:
                self.observer.freed(key)
            if self._pending:
                self._settle()
            del self._entries[key]
            self._by_category[entry.category] -= entry.nbytes
            self.current -= entry.nbytes
            self._param_keys.discard(key)
            self.events = events = self.events + 1
            if events >= self._next_sample:
                self._sample()
        finally:
            self._release()

    def _settle(self) -> None:
        """Copy the breakdown into the window before the count leaves its peak."""
        self._window.breakdown = tuple(self._by_category)
        self._pending = False
        if self.sites is not None:  # without sites, the window has none
            self._window.sites = self.site_snapshot()

    def _event(self) -> None:
        """Count an event that may raise the count (the categories are already updated)."""
        self.events += 1
        window = self._window
        if self.current > window.peak:
            window.peak = self.current
            window.event = self.events
            self._pending = True
        if self.events >= self._next_sample:
            self._sample()

    @property
    def timeline(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """The samples kept since :meth:`start` with ``timeline``: (event index, bytes by category)."""
        columns = self.timeline_columns(0)
        if columns is None:
            return None
        events, parts = columns
        return list(zip(events, zip(*parts, strict=True), strict=True))

    def timeline_columns(self, start_event: int) -> tuple[list[int], list[list[int]]] | None:
        """:attr:`timeline`'s samples from ``start_event`` on, as columns: event indexes, then bytes by category."""
        samples = self._samples
        if samples is None:
            return None
        width = _WIDTH
        events = samples[0::width]
        first = bisect.bisect_left(events, start_event)
        kept = samples[first * width :]
        return events[first:], [kept[i::width] for i in range(2, width)]

    def _sample(self) -> None:
        samples = self._samples
        assert samples is not None
        events = self.events
        samples.append(events)  # flat: no tuple per sample
        samples.append(self.current)
        samples.extend(self._by_category)
        if len(samples) >= TIMELINE_LIMIT * _WIDTH:
            self._halve_timeline()
        stride = self._timeline_stride
        self._next_sample = events - events % stride + stride

    def _halve_timeline(self) -> None:
        """Keep the higher of each pair of samples (the first of a tie), and sample half as often."""
        samples = self._samples
        assert samples is not None
        width, count = _WIDTH, len(samples)
        firsts = [  # of each pair, the sample with the higher total
            i + width if i + width < count and samples[i + width + 1] > samples[i + 1] else i
            for i in range(0, count, 2 * width)
        ]
        self._samples = [value for first in firsts for value in samples[first : first + width]]
        self._timeline_stride *= 2

    def _outputs(self, out: Any, fresh: bool) -> None:
        """Count the storages of an operator's outputs; ``fresh``: it creates them."""
        tensor_type = torch.Tensor
        if isinstance(out, tensor_type):
            self._output(out, fresh)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if fresh and type(item) is tensor_type:
                    self._fresh(item)
                elif isinstance(item, tensor_type):
                    self._output(item, fresh)
                elif isinstance(item, (tuple, list)):
                    for inner in item:
                        if isinstance(inner, tensor_type):
                            self._output(inner, fresh)

    def _fresh(self, tensor: torch.Tensor) -> None:
        """:meth:`_output` for a plain fresh CPU tensor, inlined (the common case)."""
        if (
            not self._cpu
            or self.limit is not None
            or self.sites is not None
            or self.observer is not None
            or self.cuda_rounding
        ):
            self._output(tensor, True)
            return
        if not tensor.is_cpu or tensor.layout != self._strided:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        entries = self._entries
        if key in entries:  # a known storage (lift_fresh of a tensor made outside the dispatcher)
            self._output(tensor, True)
            return
        nbytes = storage.nbytes()
        entry = Entry(storage, self._freed)
        self.events = events = self.events + 1
        entry.key = key
        entry.nbytes = nbytes
        entry.category = entry.prior = TEMPORARIES
        entry.moved = events
        entry.saves = 0
        entries[key] = entry
        self._by_category[TEMPORARIES] += nbytes
        self.current = current = self.current + nbytes
        window = self._window
        if current > window.peak:
            window.peak = current
            window.event = events
            self._pending = True
        if events >= self._next_sample:
            self._sample()

    def _output(self, tensor: torch.Tensor, fresh: bool) -> None:
        if type(tensor) not in _PLAIN:  # a wrapper subclass (DTensor): its local tensors hold the bytes
            inner = inner_tensors(tensor, self.counts_fakes)
            if inner is not None:
                for local in inner:
                    self._output(local, fresh)
                return
        if self._cpu:
            if not tensor.is_cpu or tensor.layout != self._strided:
                return
        elif not self._on_device(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            return
        key = storage._cdata
        entry = self._entries.get(key)
        if entry is None:
            if fresh:
                self._add(storage, key, TEMPORARIES)
                if self.sites is not None:
                    self.sites.made(self._entries[key], tensor)
            return
        nbytes = storage.nbytes()
        if self.cuda_rounding:
            nbytes = cuda_rounded(nbytes)
        if nbytes != entry.nbytes:  # resize_ / out= that grew the storage
            self._resize_entry(entry, nbytes)

    def _resize_entry(self, entry: Any, nbytes: int) -> None:
        delta = nbytes - entry.nbytes
        if delta > 0 and self.limit is not None and self.current + delta > self.limit:
            self._refuse(delta)
        if self.observer is not None:
            self.observer.resized(entry.key, nbytes)
        if self._pending and delta < 0:
            self._settle()
        entry.nbytes = nbytes
        self._by_category[entry.category] += delta
        self.current += delta
        if self.sites is not None:
            self.sites.resized(entry, delta)
        self._event()

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """A storage was resized in place, under no operator (FSDP2's unsharded parameters)."""
        with self._lock:
            entry = self._entries.get(storage._cdata)
            if entry is None:
                return
            nbytes = storage.nbytes()
            if self.cuda_rounding:
                nbytes = cuda_rounded(nbytes)
            if nbytes != entry.nbytes:
                self._resize_entry(entry, nbytes)

    # -- registering what exists ----------------------------------------------

    def register(self, tensors: Iterable[torch.Tensor], category: str | None = None) -> None:
        """Count the storages of ``tensors`` and set their category (None: keep it, or "other" when new)."""
        with self._lock:
            self._register(tensors, category)

    def _register(self, tensors: Iterable[torch.Tensor], category: str | None) -> None:
        index = None if category is None else CATEGORIES.index(category)
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            if type(tensor) not in _PLAIN:
                inner = inner_tensors(tensor, self.counts_fakes)
                if inner is not None:
                    self._register(inner, category)
                    continue
            if not self._on_device(tensor):
                continue
            try:
                storage = tensor.untyped_storage()
                key = self._key(storage)
            except (RuntimeError, NotImplementedError):  # no storage, or no data (fake tensors)
                continue
            if key is None:
                continue
            entry = self._entries.get(key)
            if entry is None:
                limit, self.limit = self.limit, None  # existing bytes never raise
                try:
                    self._add(storage, key, OTHER if index is None else index)
                finally:
                    self.limit = limit
            elif index is not None and entry.category != index:
                self._move(entry, index)
            if index == PARAMETERS:
                self._param_keys.add(key)

    def _key(self, storage: torch.UntypedStorage) -> int | None:
        return int(storage._cdata)

    def _move(self, entry: Entry, index: int, *, discovered: bool = True) -> None:
        """Give ``entry`` the category ``index``; ``discovered``: it always was one, the window's peak is corrected."""
        if self._pending:
            self._settle()
        window = self._window
        if discovered and entry.moved <= window.event:
            parts = list(window.breakdown)
            parts[entry.category] -= entry.nbytes
            parts[index] += entry.nbytes
            window.breakdown = tuple(parts)
        if self.sites is not None:
            self._site_moved(entry, index, discovered)
        self._by_category[entry.category] -= entry.nbytes
        self._by_category[index] += entry.nbytes
        entry.category = index
        entry.moved = self.events

    def scan(self, extra: Iterable[object] = ()) -> int:
        """Register every tensor on this device that the collector sees, and ``extra``'s; returns the new bytes."""
        with self._lock:
            before = self.current
            self._scan(extra)
            return self.current - before

    def _scan(self, extra: Iterable[object] = ()) -> None:
        self._register_scanned(gcfunctions.get_objects(), itertools.chain(extra, frozen.tensors()))

    def _register_scanned(self, objects: list[Any], extra: Iterable[object]) -> None:
        params, grads, others = sort_scanned(itertools.chain(tensors_among(objects), tensors_among(list(extra))))
        self.register(others)
        self.register(params, "parameters")
        self.register(grads, "gradients")

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """The category of ``tensor``'s storage, or None when it is not counted."""
        self.flush()
        try:
            key = self._key(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None
        entry = None if key is None else self._entries.get(key)
        return None if entry is None else CATEGORIES[entry.category]

    def flush(self) -> None:
        """Bring the counts up to now: they always are here (the allocation tracker replays)."""

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """A block of readings taken at one moment: the counts are brought up to now once."""
        return contextlib.nullcontext()

    def resolve(self, token: int) -> tuple[Window, int, int]:
        """A pending window's figures: windows are never pending here."""
        raise LookupError(f"no pending window {token}: the storage tracker reads windows when they close")

    # -- windows ---------------------------------------------------------------

    def take_window(self, *, defer: bool = False) -> Window:
        """The window since the last call; opens a new one (``defer`` is moot here)."""
        with self._lock:
            if self._pending:
                self._settle()
            window = self._window
            self._window = self._new_window()
            return window

    # -- activity --------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        """Begin watching operators (and saved tensors, unless ``saved_tensors`` is False)."""
        if self._mode is not None:
            raise RuntimeError("the storage tracker is already active")
        self.counts_fakes = fakes_counted()
        self._begin_count(timeline)
        self._mode = self._make_mode()
        self._mode.__enter__()
        self._mode.armed = True
        watch_resizes(self, watch=True)
        follow_threads(self, follow=True)
        if saved_tensors:
            self._saved_hooks = SavedTensorHooks(self._pack, unpack, notes=self.notes)
            self._saved_hooks.push()
        if self.thread_contexts:
            self._contexts = contextlib.ExitStack()
            for make in self.thread_contexts:
                self._contexts.enter_context(make())

    def _follow(self, stack: contextlib.ExitStack) -> None:
        """Watch the calling thread (not the one that started the tracker) until ``stack`` closes."""
        if any(getattr(mode, "tracker", None) is self for mode in _get_current_dispatch_mode_stack()):
            return  # watched already (a pool's thread started while watching, given work)
        mode = self._make_mode()
        mode.armed = True
        # without __enter__: its process-wide flags are set already, and threads would undo them out of order
        _push_mode(mode)
        stack.callback(_pop_mode)
        if self._saved_hooks is not None:
            stack.enter_context(SavedTensorHooks(self._pack, unpack, notes=self.notes))
        if self._contexts is not None:
            for make in self.thread_contexts:
                stack.enter_context(make())

    def _make_mode(self) -> TrackerMode:
        return TrackerMode(self)

    def _begin_count(self, timeline: bool) -> None:
        """Events count from here: a new window, the timeline restarted."""
        self._samples = [0, self.current, *self._by_category] if timeline else None
        self._timeline_stride = 1
        self._next_sample = 1 if timeline else _NEVER
        self.events = 0
        self.notes = []
        self._window = self._new_window()
        self._pending = False

    def stop(self) -> None:
        """Stop watching operators. Frees of counted storages are still seen."""
        if self._contexts is not None:
            contexts, self._contexts = self._contexts, None
            contexts.close()
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.pop()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        watch_resizes(self, watch=False)
        follow_threads(self, follow=False)
        codes, self.skipped_codes = self.skipped_codes, set()
        forget_skips(codes)

    def _pack(self, tensor: torch.Tensor) -> Held:
        if type(tensor) not in _PLAIN:
            inner = inner_tensors(tensor, self.counts_fakes)
            if inner is not None:  # a wrapper subclass: what it saves is its local tensor
                if len(inner) != 1 or not self._on_device(inner[0]):
                    return Held(tensor)
                return self._held_as(tensor, inner[0])
        if not self._on_device(tensor):
            return Held(tensor)
        base = tensor._base
        parameter_type = torch.nn.Parameter
        if isinstance(tensor, parameter_type) or isinstance(base, parameter_type):
            param = tensor if base is None else base
            try:
                known = self._entries.get(param.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                return Held(tensor)
            if known is None or known.category != PARAMETERS:  # else registering it changes nothing
                self.register((param,), "parameters")
            return Held(tensor)
        return self._held_as(tensor, tensor)

    def _held_as(self, tensor: torch.Tensor, local: torch.Tensor) -> Held:
        """Hold ``tensor`` for backward, saved as ``local``'s storage (a DTensor's shard)."""
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return Held(tensor)
        key = storage._cdata
        entry = self._entries.get(key)
        if entry is None or key in self._param_keys:
            return Held(tensor)
        self._save(entry)
        return Released(tensor, self._unsave, entry)

    def _save(self, entry: Entry) -> None:
        """Autograd holds ``entry`` for backward once more: counted once however often it is held."""
        with self._lock:
            if entry.saves == 0:
                self.saved += entry.nbytes
                if self.saved > self._window.saved_peak:
                    self._window.saved_peak = self.saved
                if entry.category in (TEMPORARIES, OTHER):
                    entry.prior = entry.category
                    self._move(entry, ACTIVATIONS, discovered=False)
            entry.saves += 1

    def _unsave(self, entry: Entry) -> None:
        with self._lock:
            entry.saves -= 1
            if entry.saves == 0:
                self.saved -= entry.nbytes
                if entry.category == ACTIVATIONS and entry() is not None:
                    self._move(entry, entry.prior, discovered=False)
