"""What the plugin does to Python's garbage collector, in one place: :class:`Collector`.

Every measured test collects garbage before its start reading and after its end (the
clean-state protocol), so that a figure shows only what is alive. A full collection walks
every object the collector tracks: with torch, pytest and a suite loaded, several hundred
thousand, 100 ms and more. The collector keeps those walks to what the test made by
freezing (``gc.freeze()``) what the session imported or built, and gives the frozen objects
back whenever a full collection the plugin did not ask for starts, so that one sees
everything. Outside a run nothing is frozen, and :func:`collect` is ``gc.collect()``.
"""

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

#: Objects left to the collector (not frozen) between tests above which :meth:`Collector.compact`
#: freezes them. A few thousand objects cost a full collection well under a millisecond; the
#: ~120,000 that a first optimizer step imports (torch._dynamo, sympy, ...) 20 to 130 ms.
COMPACT_ABOVE = 5_000

_running: Collector | None = None


def running() -> Collector | None:
    """The collector that froze objects in this process for a run, or None."""
    return _running


@functools.cache
def interpreter_frozen() -> int:
    """Objects the interpreter itself holds frozen from its start: what ``gc.get_freeze_count()``
    is in a bare interpreter of this Python (``-I -S``). Python 3.12 keeps a few hundred
    immortal tuples of its deep-frozen standard-library code there (375 on 3.12.1 and 3.12.3);
    earlier and later versions none. Asked of a child process once (:func:`others_frozen` asks
    only while something is frozen); 0 when the child cannot run (then every frozen object
    counts as someone else's)."""
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
    """Whether someone (a conftest, a library, an enclosing session) froze objects beyond the
    interpreter's own (:func:`interpreter_frozen`)."""
    count = gcfunctions.get_freeze_count()  # walks the frozen objects before Python 3.13: once
    return count > 0 and count > interpreter_frozen()


def collect() -> None:
    """A full garbage collection on the plugin's account: through the running collector (it walks
    what is not frozen and gives nothing back), else ``gc.collect()``."""
    if _running is not None:
        _running.collect()
    else:
        gc.collect()


def collect_everything() -> None:
    """A full collection on the plugin's account that sees every object, the frozen ones too (see
    :meth:`Collector.collect_everything`), else ``gc.collect()``."""
    if _running is not None:
        _running.collect_everything()
    else:
        gc.collect()


def give_back() -> bool:
    """Give the running collector's frozen objects back before a collection whose figure needs
    everything (see :meth:`Collector.give_back`); returns whether any were frozen."""
    if _running is None or not _running.frozen:
        return False
    _running.give_back()
    return True


def thaw() -> bool:
    """Give the plugin's frozen objects back to the collector, so that ``gc.get_referrers``
    sees them (naming what holds a leaked tensor); only failures' reports need it. The
    running collector freezes again between tests (its :meth:`compact`); without one (objects
    remembered by hand), they are given back for good. Returns whether any were frozen."""
    if _running is not None:
        was_frozen = _running.frozen
        _running.give_back()
        return was_frozen
    was_frozen = frozen.known()
    if was_frozen:
        gcfunctions.unfreeze()
    frozen.forget()
    return was_frozen


class Collector:
    """Owns what the plugin does to ``gc``: the freeze, its own collections, giving frozen objects back.

    Its rule, in three parts:

    * **The suite's garbage is never kept alive by the plugin.** The collector freezes only
      right after a collection of what it freezes: what it freezes is alive. Whenever a full
      collection that the plugin did not ask for starts (the user's ``gc.collect()``, a
      library's, the interpreter's own), a ``gc.callbacks`` hook gives every frozen object back
      first: that collection sees everything, as it would without the plugin, and frees a
      cycle the suite dropped, whenever it was made; what survives it (alive) is frozen again.
      Where a figure counts everything alive (an emulated device limit, a test that seems to
      retain memory), the plugin collects with everything given back too.
    * **Nothing is hidden from the user's code.** While objects are frozen,
      ``gc.get_objects``, ``gc.get_referrers`` and ``gc.get_freeze_count`` give them back
      before they answer (:mod:`~pytest_gpumem.measurement.gcfunctions`); a user's
      ``gc.freeze()`` gives them back first and ends the collector's freezing for the run, so
      that the user's freeze is the user's alone. A ``gc.disable()`` stops its freezing while
      it lasts; thresholds are never touched.
    * **A test's collections do not walk what the session imported or built.** :meth:`start`
      freezes what exists before the first measured test; :meth:`compact`, between tests,
      collects and freezes what is left when it is a lot (over :attr:`compact_above` objects
      not frozen). Later tests' collections walk what they made.

    Objects frozen by someone else before :meth:`start` stay frozen, and the collector freezes
    nothing and gives nothing back: it cannot tell theirs from its own. The interpreter's own
    frozen objects (:func:`interpreter_frozen`) are nobody's. The tensors among the frozen
    objects are remembered (:mod:`pytest_gpumem.measurement.frozen`) so that a tracker and a
    census still find them.

    Attributes:
        froze: freezes so far (:meth:`start`'s and each :meth:`compact` that froze).
        given_back: times the frozen objects were given back while the run went on.
    """

    def __init__(self, *, compact_above: int = COMPACT_ABOVE) -> None:
        self.compact_above = compact_above
        self.active = False  # this collector owns the run's freezing (its objects may be given back now)
        self.frozen = False  # its objects are frozen now
        self.froze = 0
        self.given_back = 0
        self._collecting = False
        self._refreeze = False  # a full collection not the plugin's was given everything: freeze as it ends
        self._young: list[weakref.ref[Any]] = []  # the modules and tensors not frozen as it started

    # -- the run ----------------------------------------------------------------------

    def start(self) -> None:
        """Collect garbage and freeze what exists now (unless the collector is off, someone froze
        objects before, or another collector runs in this process)."""
        global _running
        if self.active or _running is not None or not gc.isenabled() or others_frozen():
            return
        self.collect()
        frozen.remember()
        gcfunctions.freeze()
        self.active = self.frozen = True
        self.froze += 1
        _running = self
        gc.callbacks.append(self._on_collection)
        gcfunctions.install(self._on_user_call, self._yield_to_user)

    def stop(self) -> None:
        """Give every frozen object back and forget them: the run is over."""
        if not self.active:
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
        """A full collection of what is not frozen, on the plugin's account: nothing is given back."""
        self._collecting = True
        try:
            gc.collect()
        finally:
            self._collecting = False

    def compact(self) -> bool:
        """Between tests: when over :attr:`compact_above` objects are left to the collector, collect
        them and freeze what survives (its tensors remembered). Returns whether it froze. Counting
        lists what is not frozen (~25 ns an object). Nothing while ``gc`` is disabled."""
        if not self.active or not gc.isenabled():
            return False
        if len(gcfunctions.get_objects()) <= self.compact_above:
            return False
        self.collect()  # what the last test and its teardown dropped is freed, never frozen
        objects = gcfunctions.get_objects()
        if len(objects) <= self.compact_above:
            return False
        frozen.add(objects)
        del objects
        gcfunctions.freeze()
        self.frozen = True
        self.froze += 1
        return True

    def collect_everything(self) -> None:
        """A full collection on the plugin's account that sees every object: the frozen ones are given
        back to it, and what survives it (all of it alive) is frozen again. The test that follows
        (one with an emulated device limit) starts from a state where a cycle among the frozen
        objects that an earlier test dropped is freed."""
        if self.frozen:
            self.given_back += 1
            self.give_back()
        if not self.compact():
            self.collect()

    def give_back(self) -> None:
        """Give the frozen objects back now (``gc.unfreeze()``): the next collection walks them, and
        ``gc.get_referrers`` sees them. The next :meth:`compact` freezes again."""
        if self.frozen:
            self.frozen = False
            gcfunctions.unfreeze()

    def _on_user_call(self) -> None:
        """Before a user's call of a wrapped ``gc`` function (see
        :mod:`~pytest_gpumem.measurement.gcfunctions`): the frozen objects go back."""
        if self.frozen:
            self.given_back += 1
            self.give_back()

    def _yield_to_user(self) -> None:
        """After the user's own ``gc.freeze()``: the frozen objects are theirs now, never given back or
        frozen again by the plugin."""
        self._detach()
        self.frozen = False
        frozen.forget()

    def _detach(self) -> None:
        """No longer the run's collector: its wrappers and its ``gc.callbacks`` hook go."""
        global _running
        self.active = False
        gcfunctions.uninstall()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if _running is self:
            _running = None

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` hook: a full collection the plugin did not ask for is given everything
        as it starts, and what survives it (all of it alive) is frozen again as it ends. The tensors
        made since the last freeze are noted (weakly: the collection may free them) as it starts,
        among the few objects not frozen then, and remembered as it ends."""
        if info["generation"] != 2 or self._collecting:
            return
        if phase == "start":
            if self.frozen:
                self._young = frozen.references(gcfunctions.get_objects())
                self.given_back += 1
                self.give_back()
                self._refreeze = True
        elif self._refreeze:
            self._refreeze = False
            young, self._young = self._young, []
            if not self.active or not gc.isenabled():
                return
            frozen.add(obj for obj in (ref() for ref in young) if obj is not None)
            gcfunctions.freeze()
            self.frozen = True
            self.froze += 1
