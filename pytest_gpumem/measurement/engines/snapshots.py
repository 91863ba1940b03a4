"""Memory snapshots from the storage tracker: the pickle PyTorch's memory_viz opens, without a GPU (only builtins, so
it unpickles without this package)."""

from __future__ import annotations

import collections
import pickle
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

from pytest_gpumem.data.figures import OutputNotWritten
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.files import write_file
from pytest_gpumem.measurement.engines.compiled import PLUGIN_ROOT
from pytest_gpumem.measurement.engines.storages import StorageObserver

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.tracker import StorageTracker
    from pytest_gpumem.targets.allocator import CachingAllocatorModel

__all__ = ["SNAPSHOT_ENTRIES", "SnapshotRecorder", "write_snapshot"]

#: Most trace entries a snapshot keeps (the latest), as the CUDA engine asks of the allocator.
SNAPSHOT_ENTRIES = 100_000

#: Most Python frames kept per allocation (innermost first).
MAX_FRAMES = 64

#: Where the CPU engine's first storage address starts (any value: nothing dereferences it).
_FIRST_ADDRESS = 0x7F00_0000_0000
_ALIGN = 512

Frames = list[dict[str, Any]]

_UNSEEN: Any = object()


def python_frames(cache: dict[tuple[Any, int], Any]) -> Frames:
    """The caller's Python stack as memory_viz's frames, without this package's, one dict per location."""
    frames: Frames = []
    append = frames.append
    frame: Any = sys._getframe(1)
    for _ in range(MAX_FRAMES * 2):  # this package's frames are skipped; a stack is kept to MAX_FRAMES
        if frame is None:
            break
        key = (frame.f_code, frame.f_lasti)  # the instruction: cheaper to read than the line
        found = cache.get(key, _UNSEEN)
        if found is _UNSEEN:
            code = frame.f_code
            found = cache[key] = (
                None
                if code.co_filename.startswith(PLUGIN_ROOT)
                else {"filename": code.co_filename, "line": frame.f_lineno or 0, "name": code.co_name}
            )
        if found is not None:
            append(found)
        frame = frame.f_back
    return frames[:MAX_FRAMES]


class SnapshotRecorder:
    """Records a ``tracker``'s allocations and frees as a snapshot's trace (``model``: the predicted allocator)."""

    def __init__(self, tracker: StorageTracker, model: CachingAllocatorModel | None = None) -> None:
        self.tracker = tracker
        self.model = model
        self.inner: StorageObserver | None = None
        self.trace: collections.deque[dict[str, Any]] = collections.deque(maxlen=SNAPSHOT_ENTRIES)
        #: key → (address, size, frames) of what is allocated now (CPU engine: every block counted)
        self._blocks: dict[int, tuple[int, int, Frames]] = {}
        self._next_address = _FIRST_ADDRESS
        self._segments_seen: set[int] = set()
        self._frames: dict[tuple[Any, int], Any] = {}
        #: frames are read as an operator runs; allocations read from the profiler's reports come later
        self._stacks = tracker.observes == "operators"

    # -- following the tracker ------------------------------------------------------

    def start(self) -> None:
        """Follow the tracker from now on; what it counts already is allocated before the trace."""
        with self.tracker._lock:
            self.inner, self.tracker.observer = self.tracker.observer, self
            if self.model is None:
                for key, entry in list(self.tracker._entries.items()):
                    self._blocks[key] = (self._address(entry.nbytes), entry.nbytes, [])
            else:
                self._segments_seen.update(segment for segment, *_ in self.model.layout())

    def stop(self) -> None:
        """Stop following: the tracker's observer is the one it had before :meth:`start`."""
        with self.tracker._lock:
            if self.tracker.observer is self:
                self.tracker.observer = self.inner

    def _address(self, nbytes: int) -> int:
        address = self._next_address
        self._next_address += max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        return address

    def _entry(self, action: str, address: int, size: int, frames: Frames) -> None:
        self.trace.append(
            {
                "action": action,
                "addr": address,
                "size": size,
                "stream": 0,
                "frames": frames,
                "time_us": time.time_ns() // 1000,
            }
        )

    def allocated(self, key: int, nbytes: int) -> None:
        if self.inner is not None:
            self.inner.allocated(key, nbytes)
        frames = python_frames(self._frames) if self._stacks else []
        if self.model is None:
            address, size = self._address(nbytes), nbytes
        else:
            found = self.model.block_of(key)
            if found is None:
                return
            segment, base, offset, size = found
            if segment not in self._segments_seen:
                self._segments_seen.add(segment)
                self._entry("segment_alloc", base, self.model.segment_bytes(segment), frames)
            address = base + offset
        self._blocks[key] = (address, size, frames)
        self._entry("alloc", address, size, frames)

    def freed(self, key: int) -> None:
        if self.inner is not None:
            self.inner.freed(key)
        block = self._blocks.pop(key, None)
        if block is None:
            return
        address, size, frames = block
        self._entry("free_requested", address, size, frames)
        self._entry("free_completed", address, size, frames)

    def resized(self, key: int, nbytes: int) -> None:
        """A storage resized in place is a free and a new block, as the caching allocator sees it."""
        if self.inner is not None:
            self.inner.resized(key, nbytes)
        inner, self.inner = self.inner, None  # the inner observer has been told already
        try:
            self.freed(key)
            if nbytes:
                self.allocated(key, nbytes)
        finally:
            self.inner = inner

    # -- the snapshot ---------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The memory snapshot now: ``segments`` and ``device_traces`` (``torch.cuda.memory._snapshot()``'s form)."""
        with self.tracker._lock:
            categories = {key: CATEGORIES[entry.category] for key, entry in list(self.tracker._entries.items())}
            if self.model is None:
                segments = [
                    _segment(address, size, [_block(address, size, size, frames, categories.get(key))])
                    for key, (address, size, frames) in sorted(self._blocks.items(), key=lambda item: item[1][0])
                ]
            else:
                segments = []
                for _segment_id, base, total, small, blocks in self.model.layout():
                    drawn = []
                    for offset, size, key in blocks:
                        if key is None:  # a free block
                            drawn.append(_block(base + offset, size, 0, [], None, "inactive"))
                            continue
                        known = self._blocks.get(key)
                        frames = known[2] if known is not None else []
                        requested = self.model.size_of(key) or size
                        drawn.append(_block(base + offset, size, requested, frames, categories.get(key)))
                    segments.append(_segment(base, total, drawn, "small" if small else "large"))
            return {"segments": segments, "device_traces": [list(self.trace)]}


def _block(
    address: int, size: int, requested: int, frames: Frames, category: str | None, state: str = "active_allocated"
) -> dict[str, Any]:
    block = {"address": address, "size": size, "requested_size": requested, "state": state, "frames": frames}
    if category is not None:
        block["category"] = category
    return block


def _segment(address: int, total: int, blocks: list[dict[str, Any]], kind: str = "large") -> dict[str, Any]:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated"),
        "stream": 0,
        "segment_type": kind,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def write_snapshot(path: str, snapshot: dict[str, Any]) -> str | None:
    """Pickle ``snapshot`` to ``path``, whole or not at all (else an :class:`OutputNotWritten` warning)."""
    try:
        write_file(path, pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError as exc:
        warnings.warn(
            OutputNotWritten(f"could not write the memory snapshot {path}: {exc.strerror or exc}"), stacklevel=3
        )
        return None
    return path
