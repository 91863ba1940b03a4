"""What the plugin does to Python's garbage collector, in one place: :class:`Collector` (docs/figures.md)."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import weakref
from typing import Any

from pytest_gpumem.measurement import frozen, gcfunctions

__all__ = [
    "COMPACT_ABOVE",
    "Collector",
    "collect",
    "collect_everything",
    "give_back",
    "interpreter_frozen",
    "others_frozen",
    "running",
    "thaw",
]

COMPACT_ABOVE = 5_000  #: objects not frozen between tests above which :meth:`Collector.compact` freezes them

_running: Collector | None = None


def running() -> Collector | None:
    """The collector that froze objects in this process for a run, or None."""
    return _running


@functools.cache
def interpreter_frozen() -> int:
    """Objects a bare interpreter holds frozen from its start (Python 3.12's deep-frozen code); 0 when unknown."""
    if not sys.executable:
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(done.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def others_frozen() -> bool:
    """Whether someone (a conftest, a library, an enclosing session) froze objects beyond the interpreter's own."""
    count = gcfunctions.get_freeze_count()
    return count > 0 and count > interpreter_frozen()


def collect() -> None:
    """A full garbage collection on the plugin's account (through the running collector, if any)."""
    if _running is not None:
        _running.collect()
    else:
        gc.collect()


def collect_everything() -> None:
    """A full collection on the plugin's account that sees every object, the frozen ones too."""
    if _running is not None:
        _running.collect_everything()
    else:
        gc.collect()


def give_back() -> bool:
    """Give the running collector's frozen objects back; returns whether any were frozen."""
    if _running is None or not _running.frozen:
        return False
    _running.give_back()
    return True


def thaw() -> bool:
    """Give the plugin's frozen objects back, for ``gc.get_referrers``; returns whether any were frozen."""
    if _running is not None:
        return give_back()
    was_frozen = frozen.known()
    if was_frozen:  # someone else's freeze, its tensors lent to the plugin: given back for good, as a census does
        frozen.give_back_theirs()
    frozen.forget()
    return was_frozen


class Collector:
    """Owns what the plugin does to ``gc``: freezing what a collection found alive, giving it back when others ask."""

    def __init__(self, *, compact_above: int = COMPACT_ABOVE) -> None:
        self.compact_above = compact_above
        self.active = False  # this collector owns the run's freezing
        self.frozen = False  # its objects are frozen now
        self.froze = 0  # freezes so far
        self.given_back = 0  # times the frozen objects were given back during the run
        self.reclaimable = False  # a user's freeze made it yield, and the user has given their objects back since
        self._collecting = False
        self._asked = False  # a ``gc.collect()`` not the plugin's is running
        self._heap = 0  # objects alive after the last collection that saw every object
        self._frozen_count = 0  # objects frozen since (some may have been freed)
        self._refreeze = False  # a collection not the plugin's was given everything: freeze as it ends
        self._young: list[weakref.ref[Any]] = []  # the modules and tensors not frozen as it started

    # -- the run ----------------------------------------------------------------------

    def start(self) -> None:
        """Collect garbage and freeze what exists now (unless ``gc`` is off, or someone froze objects before)."""
        global _running
        self.reclaimable = False
        if self.active or _running is not None or not gc.isenabled() or others_frozen():
            return
        gcfunctions.uninstall()  # the watch on the user's gc.unfreeze(), if any
        self.collect()
        objects = gcfunctions.get_objects()
        frozen.remember(objects)
        self._heap = self._frozen_count = len(objects)
        del objects
        gcfunctions.freeze()
        self.active = self.frozen = True
        self.froze += 1
        _running = self
        gc.callbacks.append(self._on_collection)
        gcfunctions.install(self._hand_back, self._yield_to_user, self._on_users_collect)

    def stop(self) -> None:
        """The run is over: give every frozen object back."""
        self.reclaimable = False
        if not self.active:
            if _running is None:
                gcfunctions.uninstall()  # the watch on the user's gc.unfreeze()
            return
        self._detach()
        self.give_back()
        frozen.forget()

    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- collections ------------------------------------------------------------------

    def collect(self) -> None:
        """A full collection of what is not frozen, on the plugin's account."""
        self._collecting = True
        try:
            gcfunctions.collect()
        finally:
            self._collecting = False

    def compact(self) -> bool:
        """Between tests: when over :attr:`compact_above` objects are not frozen, collect and freeze what survives."""
        if not self.active or not gc.isenabled() or len(gcfunctions.get_objects()) <= self.compact_above:
            return False
        walks_everything = not self.frozen
        self.collect()  # what the last test dropped is freed, never frozen
        objects = gcfunctions.get_objects()
        if len(objects) <= self.compact_above:
            return False
        frozen.add(objects)
        if walks_everything:  # nothing was frozen: that collection saw every object
            self._heap = self._frozen_count = len(objects)
        else:
            self._frozen_count += len(objects)
        del objects
        gcfunctions.freeze()
        self.frozen = True
        self.froze += 1
        return True

    def collect_everything(self) -> None:
        """A full collection on the plugin's account that sees every object; what survives is frozen again."""
        self._hand_back()
        if not self.compact():
            self.collect()

    def give_back(self) -> None:
        """Give the frozen objects back now (``gc.unfreeze()``); the next :meth:`compact` freezes again."""
        if self.frozen:
            self.frozen = False
            gcfunctions.unfreeze()

    def _hand_back(self) -> None:
        """Give the frozen objects back, counted in :attr:`given_back` (a user's call of a wrapped ``gc`` function)."""
        if self.frozen:
            self.given_back += 1
            self.give_back()

    def _on_users_collect(self, running: bool) -> None:
        """Around a user's ``gc.collect()``: a full collection asked for, which sees every object."""
        self._asked = running

    def _yield_to_user(self) -> None:
        """After the user's own ``gc.freeze()``: the frozen objects are theirs now, until they give them back."""
        self._detach()
        self.frozen = False
        frozen.forget()
        gcfunctions.watch_unfreeze(self._on_users_unfreeze)

    def _on_users_unfreeze(self) -> None:
        """After the user's ``gc.unfreeze()``: nothing is theirs now, so :meth:`start` may freeze again."""
        gcfunctions.uninstall()
        self.reclaimable = True

    def _detach(self) -> None:
        """No longer the run's collector: its ``gc`` wrappers and hook go."""
        global _running
        self.active = False
        gcfunctions.uninstall()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if _running is self:
            _running = None

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` hook: a full collection not the plugin's is given everything when the interpreter
        alone would have run it over every object; what survives is refrozen."""
        if info["generation"] != 2 or self._collecting:
            return
        if phase == "start":
            if self.frozen:
                young = gcfunctions.get_objects()
                if not self._asked and not self._interpreter_collects_all(len(young)):
                    return
                self._young = frozen.references(young)
                self._frozen_count += len(young)
                del young
                self._hand_back()
                self._refreeze = True
        elif self._refreeze:
            self._refreeze = False
            young, self._young = self._young, []
            self._heap = self._frozen_count = max(0, self._frozen_count - info["collected"])
            if not self.active or not gc.isenabled():
                return
            frozen.add(obj for obj in (ref() for ref in young) if obj is not None)
            gcfunctions.freeze()
            self.frozen = True
            self.froze += 1

    def _interpreter_collects_all(self, young: int) -> bool:
        """Whether the interpreter, without the freeze, would collect its oldest generation now: it does once the
        objects that lived on since its last full collection are a quarter of those alive then (CPython's rule)."""
        return self._frozen_count + young - self._heap >= self._heap // 4
