"""The threads a storage tracker follows, and the storages resized in place that it watches."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

try:
    from torch._ops import OpOverload
except ImportError:  # pragma: no cover - torch moved it
    OpOverload = None  # type: ignore[assignment,misc]

from typing import Protocol


class Follower(Protocol):
    """What a storage tracker offers the threads it follows and the storages it watches."""

    @property
    def active(self) -> bool: ...

    def _follow(self, stack: contextlib.ExitStack) -> None: ...

    def _storage_resized(self, storage: torch.UntypedStorage) -> None: ...


RESIZE_WATCHERS: list[Follower] = []
_original_resize: Any = None


def watch_resizes(tracker: Follower, *, watch: bool) -> None:
    """Tell ``tracker`` of storages resized in place while it watches (``UntypedStorage.resize_`` is no operator)."""
    global _original_resize
    if watch:
        if tracker not in RESIZE_WATCHERS:
            RESIZE_WATCHERS.append(tracker)
        if _original_resize is None:
            _original_resize = torch.UntypedStorage.resize_

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                result = _original_resize(storage, size)
                for watcher in list(RESIZE_WATCHERS):
                    watcher._storage_resized(storage)
                return result

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    else:
        if tracker in RESIZE_WATCHERS:
            RESIZE_WATCHERS.remove(tracker)
        if not RESIZE_WATCHERS and _original_resize is not None:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
            _original_resize = None


FOLLOWERS: list[Follower] = []
_original_start: Any = None
_original_submit: Any = None


def follow_threads(tracker: Follower, *, follow: bool) -> None:
    """While ``tracker`` watches, new threads and thread pools' tasks run under it too (modes are per thread)."""
    global _original_start, _original_submit
    if follow:
        if tracker not in FOLLOWERS:
            FOLLOWERS.append(tracker)
        if _original_start is None:
            _original_start, _original_submit = threading.Thread.start, ThreadPoolExecutor.submit
            threading.Thread.start = _start  # type: ignore[method-assign,assignment]
            ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign,assignment]
    else:
        if tracker in FOLLOWERS:
            FOLLOWERS.remove(tracker)
        if not FOLLOWERS and _original_start is not None:
            threading.Thread.start = _original_start  # type: ignore[method-assign]
            ThreadPoolExecutor.submit = _original_submit  # type: ignore[method-assign]
            _original_start = _original_submit = None


def _start(thread: threading.Thread) -> None:
    """``Thread.start`` while trackers watch: the thread's ``run`` runs under them."""
    trackers = [tracker for tracker in FOLLOWERS if tracker.active]
    if trackers:
        run = thread.run

        def followed() -> None:
            try:
                call_followed(trackers, run)
            finally:
                thread.__dict__.pop("run", None)  # let go of the trackers with the thread's work

        thread.run = followed  # type: ignore[method-assign]
    start: Any = _original_start or threading.Thread.start
    start(thread)


def _submit(executor: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``ThreadPoolExecutor.submit`` while trackers watch: ``fn`` runs under them on the pool's thread."""
    trackers = [tracker for tracker in FOLLOWERS if tracker.active]
    submit: Any = _original_submit or ThreadPoolExecutor.submit
    if not trackers:
        return submit(executor, fn, *args, **kwargs)
    return submit(executor, call_followed, trackers, fn, *args, **kwargs)


def call_followed(trackers: list[Follower], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on this thread, watched by those of ``trackers`` still active."""
    with contextlib.ExitStack() as stack:
        for tracker in trackers:
            if tracker.active:
                tracker._follow(stack)
        return fn(*args, **kwargs)
