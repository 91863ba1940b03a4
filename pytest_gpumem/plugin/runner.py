"""One measured test, from its clean start to its record: :class:`TestRun`, a plain object that runs without pytest."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import CodeType
from typing import Any

from pytest_gpumem.data.figures import Measurement, OutputNotWritten, PartialFigures, notify
from pytest_gpumem.diagnose.census import see_every_tensor
from pytest_gpumem.diagnose.kept import kept_by_site, state_key, state_options
from pytest_gpumem.diagnose.leaks import StorageSnapshot, confirm_leak, snapshot_storages
from pytest_gpumem.diagnose.oom import OomReport, OomWatch, is_oom, release_oom
from pytest_gpumem.judge.record import TIMELINE_SAMPLES, TestRecord
from pytest_gpumem.measurement import collector
from pytest_gpumem.measurement.active import activate
from pytest_gpumem.measurement.engines import unseen_note
from pytest_gpumem.measurement.engines.base import Engine, Workspaces
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.measurement.returnwatch import code_of, watch_return
from pytest_gpumem.plugin.plan import TestPlan
from pytest_gpumem.report.artifacts import artifact_path

__all__ = ["TestRun"]


def _forget_last_failure() -> None:
    """Drop pytest's ``sys.last_*``: its frames hold the failed test's tensors."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


class TestRun:
    """One measured test call: :meth:`start` just before the test function runs, :meth:`finish` after."""

    __test__ = False  # a name pytest would otherwise collect

    def __init__(
        self, plan: TestPlan, engine: Engine, *, environment: dict[str, Any], saved_tensors: bool = True
    ) -> None:
        self.plan = plan
        self.nodeid = plan.nodeid
        self.engine = engine
        self.environment = environment
        self.recorder = Recorder(
            engine,
            timeline=engine.categories is not None,
            saved_tensors=saved_tensors,
            fake=plan.fake,
            label=plan.nodeid,
            sites=plan.options.sites,
        )
        self.recorder.device_limit = plan.device_limit
        self.recorder.reserved = plan.reserved  # the cache emptied first
        self._stack = contextlib.ExitStack()  # the recorder's activation
        self._watches = contextlib.ExitStack()  # left just before the call span closes
        self._snapshot: StorageSnapshot | None = None
        self._watch: OomWatch | None = None
        self._oom = contextlib.ExitStack()  # the out-of-memory watch: entered before the recording, left first
        self._history: str | None = None
        self._started = False
        #: by site, what holds its live tensors at the return (a second run only)
        self._kept: dict[tuple[str, str | None], dict[str, int]] | None = None
        self._code: CodeType | None = None

    def start(self, function: Any = None) -> None:
        """Clean the device, read the start, and begin the ``call`` span; ``allocated`` is read as ``function``
        returns."""
        if self._started:
            raise RuntimeError(f"{self.nodeid}: the test run has started already")
        self._started = True
        _forget_last_failure()
        recorder, leak_check = self.recorder, self.plan.leak_check
        if recorder.device_limit is not None:
            collector.collect_everything()  # the emulated device holds all that is alive
        if leak_check:
            see_every_tensor()  # or someone else's frozen tensors would show as the test's
        if self.plan.options.reports:
            self._watch = self._oom.enter_context(OomWatch(self.engine, recorder))
        try:
            recorder.begin()
        except BaseException:
            self._oom.close()
            raise
        try:
            self._snapshot = snapshot_storages(self.engine) if leak_check else None
            self._stack.enter_context(activate(recorder))
            self._state = recorder.open("call")
            watches = self._watches
            if recorder.device_limit is not None:
                watches.enter_context(self.engine.limit_memory(recorder.device_limit))
            if self.plan.options.snapshots is not None:
                self._history = self._record_history(watches, self.plan.options.snapshots)
            self._code = code_of(function)
            kept = self.plan.options.sites is not None and not self.plan.options.reports  # a second run's holders
            watches.enter_context(watch_return(self._code, self._at_return if kept else recorder.read_return))
        except BaseException:
            self._oom.close()
            self._watches.close()
            self._stack.close()
            recorder.end()
            raise

    def _at_return(self) -> None:
        """A second run's test function returns: read ``allocated`` and what holds its sites' tensors, its locals
        alive."""
        self.recorder.read_return()
        self._kept = kept_by_site(self.engine, self.recorder.tracked, sys._getframe(1), self._code)

    def _with_holders(self, call: Measurement, tracked: list[Any]) -> Measurement:
        """``call`` whose site rows name what holds their storages (``max_exp_avg_sq (amsgrad=True)``)."""
        kept, self._kept = self._kept, None
        if not kept or call.sites is None:
            return call
        options = state_options(tracked)
        rows = []
        for row in call.sites.sites:
            held = kept.get((row.site.where(), row.category), {})
            named = []
            for name, nbytes in sorted(held.items(), key=lambda item: (-item[1], item[0])):
                key = state_key(name)
                named.append((f"{name} ({options[key]})" if key in options else name, nbytes))
            rows.append(replace(row, holders=tuple(named)) if named else row)
        return replace(call, sites=replace(call.sites, sites=tuple(rows)))

    def _record_history(self, watches: contextlib.ExitStack, folder: Path) -> str | None:
        """Record the allocation history for this test's memory snapshot; a bad path is a warning."""
        try:
            path = artifact_path(folder, self.nodeid, ".snapshot.pickle")
        except ValueError as exc:
            warnings.warn(
                OutputNotWritten(f"could not write the memory snapshot of {self.nodeid}: {exc}"), stacklevel=3
            )
            return None
        return watches.enter_context(self.engine.record_history(str(path)))

    def run(self, function: Callable[[], Any]) -> TestRecord:
        """:meth:`start`, call ``function``, :meth:`finish`: the whole run, outside pytest."""
        self.start(function)
        try:
            returned = function()
        except Exception as exc:
            return self.finish(exc)
        self._watches.close()  # allocated is read with what the function returned alive
        del returned
        return self.finish(None)

    def finish(self, exc: BaseException | None) -> TestRecord:
        """Close the ``call`` span, confirm leaks, gather what each span asked for; ``exc``: what the test raised."""
        recorder, engine = self.recorder, self.engine
        oom: OomReport | None = None
        try:
            try:
                if exc is not None and is_oom(exc) and self._watch is not None:
                    oom = self._watch.report_for(exc)
            finally:
                self._oom.close()
                self._watches.close()
            if self._history is not None and not os.path.exists(self._history):
                self._history = None  # a warning said why
            call = recorder.close(self._state, allocated=recorder.returned)
            timeline = recorder.timeline_since(self._state.start_event)
        finally:
            tracked = list(recorder.tracked) if self._kept else []
            self._stack.close()
            recorder.end()
        if self._kept:
            call = self._with_holders(call, tracked)  # the span is closed: probing counts nowhere
        del tracked
        if exc is not None and is_oom(exc):
            release_oom(exc, engine)
        engine.settle()  # library workspaces stay: they were there at the start reading
        notes = call.notes
        if engine.exact and engine.categories is not None:  # the tracker is the engine: what did it miss?
            unseen = engine.categories.scan()
            if unseen > 0:
                notes = (*notes, unseen_note(unseen))
                notify(PartialFigures(f"{self.nodeid}: {notes[-1]}"), stacklevel=2)
        call = replace(
            call, retained=engine.allocated() - call.start, max_microbatch=recorder.max_microbatch, notes=notes
        )
        leak_report = None
        spec = self.plan.spec
        if self._snapshot is not None and exc is None and call.retained and call.retained > 0:
            running = collector.running()
            if running is not None and running.frozen:
                # a cycle among frozen objects may hold what the test dropped: one collection sees every object, and
                # what survives it is frozen again, so the leak check's tries walk only what is not frozen
                running.collect_everything()
            leak = confirm_leak(engine, call.start, snapshot=self._snapshot)
            collector.give_back()  # the collection after the teardown sees every object, as without the check
            call = replace(call, retained=leak.retained)
            if leak.retained > 0:
                leak_report = leak.format()
        self._snapshot = None
        # what each span asked for: the call its marker's, each measure() block its own
        asking = [("call", spec.limits, spec.tolerance), *((s.name, s.limits, s.tolerance) for s in recorder.spans)]
        asked = {name: list(limits) for name, limits, _ in asking if limits}
        tolerances = {name: tolerance.to_dict() for name, _, tolerance in asking if tolerance is not None}
        return TestRecord(
            self.nodeid,
            measurements=[call] + [span.measurement for span in recorder.spans],
            environment=self.environment,
            tolerances=tolerances,
            passed=exc is None,
            reports=[] if oom is None else [oom.format()],
            timeline=None if timeline is None else timeline.to_dict(TIMELINE_SAMPLES),
            snapshot=self._history,
            device_limit=recorder.device_limit,
            workspaces=engine.workspaces if isinstance(engine, Workspaces) else None,
            asked=asked,
            leak_check=self.plan.options.leak_check,
            min_microbatch=spec.min_microbatch,
            ranks_measured=recorder.ranks_measured,
            leak_report=leak_report,
        )
