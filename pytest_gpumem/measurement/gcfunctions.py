"""``gc``'s functions as the plugin calls them, and wrappers that give frozen objects back before a user's call."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

__all__ = [
    "collect",
    "freeze",
    "get_freeze_count",
    "get_objects",
    "get_referrers",
    "install",
    "unfreeze",
    "uninstall",
    "watch_unfreeze",
]

get_objects = gc.get_objects
get_referrers = gc.get_referrers
get_freeze_count = gc.get_freeze_count
freeze = gc.freeze
unfreeze = gc.unfreeze

_WRAPPED = {real.__name__: real for real in (get_objects, get_referrers, get_freeze_count, freeze, unfreeze)}


def _wrapper(
    real: Callable[..., Any], before: Callable[[], None], after: Callable[[], None] | None
) -> Callable[..., Any]:
    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        before()
        result = real(*args, **kwargs)
        if after is not None:
            after()
        return result

    return call


_collect_under: Callable[..., int] | None = None  #: ``gc.collect`` as it was when :func:`install` wrapped it


def collect() -> int:
    """A full collection through ``gc.collect`` as it is without the plugin's wrapper."""
    return (_collect_under or gc.collect)()


def _asked(real: Callable[..., Any], asking: Callable[[bool], None]) -> Callable[..., Any]:
    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        asking(True)
        try:
            return real(*args, **kwargs)
        finally:
            asking(False)

    return call


def install(give_back: Callable[[], None], froze: Callable[[], None], asking: Callable[[bool], None]) -> None:
    """Put wrappers in ``gc``'s place that call ``give_back()`` first, and ``froze()`` after a ``gc.freeze()``;
    ``gc.collect()`` is told apart from the interpreter's own collections by ``asking(True)`` while it runs."""
    for name, real in _WRAPPED.items():
        if getattr(gc, name) is real:
            setattr(gc, name, _wrapper(real, give_back, froze if name == "freeze" else None))
    global _collect_under
    if _collect_under is None:
        _collect_under = gc.collect
        gc.collect = _asked(gc.collect, asking)


def watch_unfreeze(after: Callable[[], None]) -> None:
    """Put a wrapper in ``gc.unfreeze``'s place that calls ``after()`` once it returns (until :func:`uninstall`)."""
    if gc.unfreeze is unfreeze:
        gc.unfreeze = _wrapper(unfreeze, lambda: None, after)


def uninstall() -> None:
    """Put ``gc``'s own functions back."""
    global _collect_under
    for name, real in _WRAPPED.items():
        current = getattr(gc, name)
        if current is not real and getattr(current, "__wrapped__", None) is real:
            setattr(gc, name, real)
    under, _collect_under = _collect_under, None
    if under is not None and getattr(gc.collect, "__wrapped__", None) is under:
        setattr(gc, "collect", under)  # noqa: B010  # gc's own, or what stood in its place before the run
