"""An exact tensor-storage tracker at the dispatcher level: every operator's outputs, seen by its dispatch mode as they
are made, and each storage's death; it follows new threads and storages resized in place while it watches."""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

try:
    from torch._ops import OpOverload
except ImportError:  # pragma: no cover - torch moved it
    OpOverload = None  # type: ignore[assignment,misc]

try:  # TorchDynamo's frame hook, a C function of torch itself: importing it does not import TorchDynamo
    from torch._C._dynamo.eval_frame import set_eval_frame
except ImportError:  # pragma: no cover - torch moved it: the mode keeps torch's own wrapper
    set_eval_frame = None  # type: ignore[assignment]

from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.data.site_figures import Site, SiteConfig
from pytest_gpumem.measurement import frozen, gcfunctions
from pytest_gpumem.measurement.engines.compiled import forget_skips, skipped_frame
from pytest_gpumem.measurement.engines.saved import Held, Released, unpack
from pytest_gpumem.measurement.engines.savedhooks import SavedTensorHooks
from pytest_gpumem.measurement.engines.site_tracking import Found, SiteRecorder, SiteSnapshot, _State, found_sites
from pytest_gpumem.measurement.engines.sizing import output_storages
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
from pytest_gpumem.units import cuda_rounded

__all__ = ["FOLLOWERS", "OTHER", "TEMPORARIES", "TIMELINE_LIMIT", "StorageTracker", "TrackerSites"]

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, OTHER = range(len(CATEGORIES))

TIMELINE_LIMIT = 512  #: most samples a timeline keeps; longer timelines are halved (keeping maxima)
_WIDTH = 2 + len(CATEGORIES)  # a sample's ints: its event's index, its total, its bytes by category
_NEVER = sys.maxsize  # the next sampled event while no timeline is kept

#: How the tracker treats an operator's outputs, from its schema. SKIP: views and in-place writes, no storage can
#: appear or change size; FRESH: no output aliases an input; ALIAS: an output may alias and resize an input.
SKIP, FRESH, ALIAS = 0, 1, 2

_TENSOR = torch.Tensor


def output_kind(func: Any) -> int:
    """SKIP, FRESH or ALIAS for the operator ``func`` (see above), from its schema."""
    try:
        schema = func._schema
        infos = [r.alias_info for r in schema.returns]
        has_out = any(a.is_out for a in schema.arguments)
        name = schema.name
    except AttributeError:
        return FRESH
    # lift_fresh aliases a tensor that torch.tensor(data) built outside the dispatcher: a new storage here
    if all(info is None for info in infos) or name == "aten::lift_fresh":
        return FRESH
    if any(info is None for info in infos) or has_out or "resize" in name or "set_" in name:
        return ALIAS
    return SKIP


def operator_of(func: Any) -> tuple[Callable[..., Any], int]:
    """How the mode calls ``func`` (a plain ``OpOverload`` through its C++ handle), and its output kind."""
    call = func
    if OpOverload is not None and type(func).__call__ is OpOverload.__call__:
        call = getattr(func, "_op", func)
    return call, output_kind(func)


class TrackerMode(TorchDispatchMode):
    """Sees each operator's outputs and reports new storages to the tracker (once per operator)."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.operators = tracker._operators
        self.hooks = tracker.operator_hooks
        # bound once: this runs once per operator
        self.acquire, self.release = tracker._lock.acquire, tracker._lock.release
        self.output, self.outputs, self.fresh = tracker._output, tracker._outputs, tracker._fresh
        self.armed = False  #: on the stack: from then on only TorchDynamo asks :meth:`ignore_compile_internals`

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: :meth:`__torch_dispatch__` turns TorchDynamo's frame hook off itself, without importing it."""
        return set_eval_frame is None

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """False: TorchDynamo runs a compiled frame eagerly, which the tracker sees, and the frame is reported."""
        if self.armed:  # TorchDynamo asks: it is imported
            _never_traced()
            frame = skipped_frame()
            if frame is not None:
                code, library, text = frame
                self.tracker.compiled_frames.append((library, text))
                if code is not None:
                    self.tracker.skipped_codes.add(code)
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # TorchDynamo's frame hook must not compile the mode's own frames (see _should_skip_dynamo)
        prior = set_eval_frame(None) if set_eval_frame is not None else None
        try:
            # by identity (an operator's __hash__ is Python); the entry holds the operator, so its id is not reused
            operator = self.operators.get(id(func))
            if operator is None:
                hook = self.hooks.get(func._overloadpacket.__name__)
                operator = self.operators[id(func)] = (*operator_of(func), hook, func)
            call, kind, hook, _ = operator
            if kind == FRESH and self.tracker.limit is not None:
                self.tracker._refuse_early(func, args, kwargs)
            if hook is not None:
                self.acquire()
                try:
                    hook(args)
                finally:
                    self.release()
            out = call(*args, **kwargs) if kwargs else call(*args)
            if kind:
                self.acquire()
                try:
                    if type(out) is _TENSOR:
                        if kind == FRESH:
                            self.fresh(out)
                        else:
                            self.output(out, False)
                    elif isinstance(out, _TENSOR):
                        self.output(out, kind == FRESH)
                    else:
                        self.outputs(out, kind == FRESH)
                finally:
                    self.release()
            return out
        finally:
            if prior is not None:
                set_eval_frame(prior)


@functools.cache
def _never_traced() -> None:
    """Put the package among the folders TorchDynamo never traces into (its warning would fail a strict suite)."""
    from torch._dynamo import trace_rules

    trace_rules.add("pytest_gpumem")


class Patches:
    """Methods replaced while some tracker needs them (:meth:`add`), restored when the last one is removed."""

    def __init__(self, *patches: tuple[type, str, Callable[..., Any]]) -> None:
        self.patches = patches
        self.trackers: list[StorageTracker] = []
        self.originals: list[Any] = []  # the replaced methods, in the order of ``patches``, while replaced

    def add(self, tracker: StorageTracker) -> None:
        if tracker not in self.trackers:
            self.trackers.append(tracker)
        if not self.originals:
            self.originals = [getattr(owner, name) for owner, name, _ in self.patches]
            for owner, name, patched in self.patches:
                setattr(owner, name, patched)

    def remove(self, tracker: StorageTracker) -> None:
        if tracker in self.trackers:
            self.trackers.remove(tracker)
        if not self.trackers and self.originals:
            for (owner, name, _), original in zip(self.patches, self.originals, strict=True):
                setattr(owner, name, original)
            self.originals = []

    def original(self, index: int) -> Any:
        """The method ``patches[index]`` replaces (the one in place once restored)."""
        if self.originals:
            return self.originals[index]
        owner, name, _ = self.patches[index]
        return getattr(owner, name)


def _resize_(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` (no operator) while trackers watch: they are told of the storage's new size."""
    result = RESIZES.original(0)(storage, size)
    for tracker in list(RESIZES.trackers):
        tracker._storage_resized(storage)
    return result


def _start(thread: threading.Thread) -> None:
    """``Thread.start`` while trackers watch: the thread's ``run`` runs under them."""
    trackers = [tracker for tracker in FOLLOWERS.trackers if tracker.active]
    if trackers:
        run = thread.run

        def followed() -> None:
            try:
                call_followed(trackers, run)
            finally:
                thread.__dict__.pop("run", None)  # let go of the trackers with the thread's work

        thread.run = followed  # type: ignore[method-assign]
    FOLLOWERS.original(0)(thread)


def _submit(executor: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``ThreadPoolExecutor.submit`` while trackers watch: ``fn`` runs under them on the pool's thread."""
    trackers = [tracker for tracker in FOLLOWERS.trackers if tracker.active]
    if not trackers:
        return FOLLOWERS.original(1)(executor, fn, *args, **kwargs)
    return FOLLOWERS.original(1)(executor, call_followed, trackers, fn, *args, **kwargs)


def call_followed(trackers: list[StorageTracker], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on this thread, watched by those of ``trackers`` still active."""
    with contextlib.ExitStack() as stack:
        for tracker in trackers:
            if tracker.active:
                tracker._follow(stack)
        return fn(*args, **kwargs)


#: The trackers told of storages resized in place while they watch.
RESIZES = Patches((torch.UntypedStorage, "resize_", _resize_))
#: The trackers that new threads and thread pools' tasks run under while they watch (modes are per thread).
FOLLOWERS = Patches((threading.Thread, "start", _start), (ThreadPoolExecutor, "submit", _submit))


class StorageTracker:
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
        self.sites: SiteRecorder | None = None  # where storages are made, only when asked
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

    def _add(self, storage: torch.UntypedStorage, key: int, category: int, *, limited: bool = True) -> None:
        """Count a new storage (``limited``: refused over the emulated limit; existing bytes never are)."""
        nbytes = storage.nbytes()
        if self.cuda_rounding:
            nbytes = cuda_rounded(nbytes)
        if limited and self.limit is not None and self.current + nbytes > self.limit:
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
        """Count the storages of an operator's outputs, a tuple or a list (``fresh``: it creates them)."""
        tensor_type = torch.Tensor
        if isinstance(out, (tuple, list)):
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
        if entry is not None:
            self._resized(entry, storage)  # resize_ / out= that grew the storage
        elif fresh:
            self._add(storage, key, TEMPORARIES)
            if self.sites is not None:
                self.sites.made(self._entries[key], tensor)

    def _resized(self, entry: Entry, storage: torch.UntypedStorage) -> None:
        """Count ``entry``'s storage at its size now, if that changed."""
        nbytes = storage.nbytes()
        if self.cuda_rounding:
            nbytes = cuda_rounded(nbytes)
        delta = nbytes - entry.nbytes
        if not delta:
            return
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
        self.events += 1
        window = self._window
        if self.current > window.peak:
            window.peak = self.current
            window.event = self.events
            self._pending = True
        if self.events >= self._next_sample:
            self._sample()

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """A storage was resized in place, under no operator (FSDP2's unsharded parameters)."""
        with self._lock:
            entry = self._entries.get(storage._cdata)
            if entry is not None:
                self._resized(entry, storage)

    def _refuse_early(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        """Refuse ``func``'s outputs before its kernel runs when they would take the count over the limit."""
        sizes = output_storages(func, args, kwargs or {}, self.device)
        if not sizes:
            return
        nbytes = sum(cuda_rounded(size) for size in sizes) if self.cuda_rounding else sum(sizes)
        with self._lock:
            if self.limit is not None and self.current + nbytes > self.limit:
                self._refuse(nbytes)

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
                self._add(storage, key, OTHER if index is None else index, limited=False)
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
        at_peak = discovered and entry.moved <= window.event
        if at_peak:
            parts = list(window.breakdown)
            parts[entry.category] -= entry.nbytes
            parts[index] += entry.nbytes
            window.breakdown = tuple(parts)
        if self.sites is not None:
            self.sites.moved(entry, entry.category, index, window.sites if at_peak else None)
        self._by_category[entry.category] -= entry.nbytes
        self._by_category[index] += entry.nbytes
        entry.category = index
        entry.moved = self.events

    def scan(self, extra: Iterable[object] = ()) -> int:
        """Register every tensor on this device that the collector sees, and ``extra``'s; returns the new bytes."""
        with self._lock:
            before = self.current
            self._register_scanned(gcfunctions.get_objects(), itertools.chain(extra, frozen.tensors()))
            return self.current - before

    def forget_categories(self) -> None:
        """Count every storage as "other", before the scan that finds parameters and gradients again: a test's
        categories are its own (what an earlier test made, saved or tracked is "other" to the next)."""
        self.flush()
        with self._lock:
            for entry in self._entries.values():
                if entry.category != OTHER:
                    self._move(entry, OTHER, discovered=False)

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
        self._mode = TrackerMode(self)
        self._mode.__enter__()
        self._mode.armed = True
        RESIZES.add(self)
        FOLLOWERS.add(self)
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
        mode = TrackerMode(self)
        mode.armed = True
        # without __enter__: its process-wide flags are set already, and threads would undo them out of order
        _push_mode(mode)
        stack.callback(_pop_mode)
        if self._saved_hooks is not None:
            hooks = SavedTensorHooks(self._pack, unpack, notes=self.notes)
            hooks.push()
            stack.callback(hooks.pop)
        if self._contexts is not None:
            for make in self.thread_contexts:
                stack.enter_context(make())

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
        RESIZES.remove(self)
        FOLLOWERS.remove(self)
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

    # -- sites -----------------------------------------------------------------

    def site_snapshot(self) -> SiteSnapshot | None:
        """The bytes by site now (:meth:`SiteRecorder.snapshot`); None while sites are not recorded."""
        if self.sites is None:
            return None
        with self._lock:
            return self.sites.snapshot(self._by_category, len(self._entries))

    def _new_window(self) -> Window:
        """A window opened at the count now (its peak's sites: the sites now)."""
        return Window(self.current, tuple(self._by_category), self.events, self.saved, sites=self.site_snapshot())

    def record_sites(self, sites: SiteRecorder | None) -> None:
        """Record the site of every storage made from now on (None: stop); the open window's peak starts now."""
        with self._lock:
            if self._pending:
                self._settle()
            self.sites = sites
            self._freed = self._on_freed if sites is None else self._freed_at_site
            self._window.sites = self.site_snapshot()

    def _freed_at_site(self, entry: Any) -> None:
        """A storage made while sites were recorded is freed (its weak reference's callback)."""
        with self._lock:
            counted = self._entries.get(entry.key) is entry
            self._on_freed(entry)
            if counted and self.sites is not None:
                self.sites.freed(entry)


class TrackerSites:
    """:class:`~pytest_gpumem.measurement.engines.base.SiteRecording` by a storage tracker that watches operators
    (it sees the frame making each storage)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self._tracker = tracker

    def start(self, config: SiteConfig) -> None:
        self._tracker.record_sites(SiteRecorder(config))

    def set_phase(self, phase: str | None) -> None:
        if self._tracker.sites is not None:
            self._tracker.sites.phase = phase or ""

    def now(self) -> Any:
        return self._tracker.site_snapshot()

    def figures(self, peak: Any, end: Any) -> list[Found] | None:
        return None if end is None else found_sites(peak, end)

    def site_of(self, tensor: Any) -> Site | None:
        try:
            entry = self._tracker._entries.get(self._tracker._key(tensor.untyped_storage()) or 0)
        except (RuntimeError, NotImplementedError):
            return None
        state: _State | None = getattr(entry, "site", None)  # made while some recording was on
        return None if state is None else state.site()

    def here(self) -> Site | None:
        """The site of the code running now (the allocation an emulated limit refuses)."""
        sites = self._tracker.sites
        return None if sites is None else sites.here(sys._getframe()).site()
