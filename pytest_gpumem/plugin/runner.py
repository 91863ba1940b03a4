"""One measured test, from its clean start to its record.

:class:`TestRun` is what the plugin does around a test call, as a plain object
that runs without pytest: the clean-state protocol, the ``call`` span, the
out-of-memory watch, the emulated device limit, CUDA allocation history, the
allocated figure read as the test function returns, then the leak check and
what each span asked for. :meth:`TestRun.finish` returns the test's
:class:`~pytest_gpumem.judge.record.TestRecord`, for the judge
(:func:`~pytest_gpumem.judge.judgement.judge`) to decide.

What the session imported or built is frozen (:class:`Freezer`, wiring the
:class:`~pytest_gpumem.measurement.collector.Collector`) so that each test's garbage
collections cover only what it made.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
import torch

from pytest_gpumem.data.figures import OutputNotWritten, PartialFigures
from pytest_gpumem.data.sites import SiteConfig
from pytest_gpumem.diagnose.leaks import StorageSnapshot, confirm_leak, snapshot_storages
from pytest_gpumem.diagnose.oom import OomReport, OomWatch, is_oom, release_oom
from pytest_gpumem.judge.record import TIMELINE_SAMPLES, TestRecord
from pytest_gpumem.measurement import collector, frozen
from pytest_gpumem.measurement.active import activate
from pytest_gpumem.measurement.collector import Collector
from pytest_gpumem.measurement.engines import cuda_available, make_engine, resolve_device, unseen_note
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.plugin.marker import GpumemSpec
from pytest_gpumem.plugin.returnwatch import watch_return
from pytest_gpumem.report.artifacts import artifact_path

__all__ = ["DeviceUnavailable", "Engines", "Freezer", "RunOptions", "TestRun", "choose_device"]


class DeviceUnavailable(Exception):
    """The device a test asks for is not there; ``required``: the run demands a GPU (fail, don't skip)."""

    def __init__(self, reason: str, *, required: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.required = required


def choose_device(wanted: str, *, require_gpu: bool = False, worker: int | None = None) -> torch.device:
    """The device a test measures on: ``wanted`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    ``"auto"`` is CUDA when available, else the CPU (with ``require_gpu``:
    :class:`DeviceUnavailable`). Under pytest-xdist, ``worker`` *i* measures on GPU
    *i mod N* for ``"auto"`` and ``"cuda"`` when several GPUs are visible. A CUDA
    device that is not there raises :class:`DeviceUnavailable`.
    """
    has_cuda = cuda_available()
    if wanted in ("auto", "cuda") and has_cuda:
        count = torch.cuda.device_count()
        if worker is not None and count > 1:
            return torch.device("cuda", worker % count)
    if wanted == "auto":
        if has_cuda:
            return resolve_device("auto")
        if require_gpu:
            raise DeviceUnavailable("--gpumem-require-gpu: no CUDA device is available", required=True)
        return torch.device("cpu")
    device = torch.device(wanted)
    if device.type == "cuda":
        count = torch.cuda.device_count() if has_cuda else 0
        index = device.index if device.index is not None else 0
        if index >= count:
            plural = "s" if count != 1 else ""
            reason = f"gpumem: device {wanted!r} is not available ({count} CUDA device{plural} visible)"
            raise DeviceUnavailable(reason, required=require_gpu)
        return resolve_device(wanted)
    return device


class Engines:
    """One engine per (device, breakdown, observe) for the whole run, so trackers and caches are reused.

    An engine with a storage tracker made while objects are frozen (see
    :class:`Freezer`) registers the tensors among the frozen objects first: its
    later scans cannot see them.
    """

    def __init__(self, *, cuda_rounding: bool = False, freezer: Freezer | None = None) -> None:
        self.cuda_rounding = cuda_rounding
        self.freezer = freezer
        self._engines: dict[tuple[str, bool, str, str | None], Engine] = {}

    def get(
        self, device: torch.device, *, breakdown: bool = False, observe: str = "operators", predict: str | None = None
    ) -> Engine:
        """The engine for ``device``; the CPU engine always has its tracker (``breakdown`` is moot)
        and ``observe`` chooses how it sees memory; on CUDA ``observe`` is moot (the caching
        allocator's figures are those of the code that runs, compiled or not), and so is
        ``predict`` (the GPU whose figures the CPU engine predicts: a real one is measured)."""
        breakdown = breakdown or device.type == "cpu"
        if device.type != "cpu":
            observe, predict = "operators", None
        key = (str(device), breakdown, observe, predict)
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = make_engine(
                device, breakdown=breakdown, cuda_rounding=self.cuda_rounding, observe=observe, predict=predict
            )
            if self.freezer is not None and engine.categorizes:
                self.freezer.scan(engine)
        return engine

    def cpu(self) -> Engine:
        """The CPU engine."""
        return self.get(torch.device("cpu"))


class Freezer:
    """Wires the run's :class:`~pytest_gpumem.measurement.collector.Collector` (what the plugin does to
    the garbage collector, and its rule) into pytest: started before the first measured test,
    compacted once each test's teardown is done (registered as a plugin for that, while it froze
    objects), stopped when the run ends."""

    def __init__(self, config: pytest.Config | None = None) -> None:
        self.collector = Collector()
        self._config = config

    @property
    def active(self) -> bool:
        """Whether the run's collector froze objects (someone else had not)."""
        return self.collector.active

    def start(self) -> None:
        """Collect garbage and freeze what exists now (see :meth:`Collector.start`)."""
        self.collector.start()
        if self._config is not None and self.collector.active:
            self._config.pluginmanager.register(self, "gpumem-collector")

    def pytest_runtest_logfinish(self) -> None:
        """A test is done, its fixtures torn down: freeze what the session built since, if a lot."""
        self.collector.compact()

    def scan(self, engine: Engine) -> None:
        """Let ``engine``'s tracker register every tensor alive, frozen ones included."""
        engine.scan(extra=frozen.tensors() if frozen.known() else ())

    def stop(self) -> None:
        if self._config is not None and self._config.pluginmanager.is_registered(self):
            self._config.pluginmanager.unregister(self)
        self.collector.stop()


@dataclass(frozen=True)
class RunOptions:
    """What the run asks of every measured test."""

    #: check every test for leaks (as ``retained="0B"`` does)
    leak_check: bool = False
    #: folder for CUDA memory snapshots (``--gpumem-snapshot``); None: none are written
    snapshots: Path | None = None
    #: the emulated device size (bytes) of tests whose marker names none
    device_limit: int | None = None
    #: record where storages are made, chosen so (None: not in this run; see plugin/sites.py)
    sites: SiteConfig | None = None


def _forget_last_failure() -> None:
    """Drop pytest's record of the last failure (``sys.last_*``): its frames hold the failed test's tensors."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


class TestRun:
    """One measured test call: :meth:`start` just before the test function runs, :meth:`finish` after.

    Args:
        nodeid: the test's node id (named in messages).
        spec: its validated marker.
        engine: where bytes are read.
        environment: ``Environment.to_dict()`` of the engine, for the record.
        options: what the run asks of every test.
    """

    __test__ = False  # a name pytest would otherwise collect

    def __init__(
        self,
        nodeid: str,
        spec: GpumemSpec,
        engine: Engine,
        *,
        environment: dict[str, Any],
        options: RunOptions | None = None,
        fake: bool = False,
    ) -> None:
        self.nodeid = nodeid
        self.spec = spec
        self.engine = engine
        self.environment = environment
        self.options = options or RunOptions()
        self.recorder = Recorder(engine, timeline=engine.categorizes, fake=fake, label=nodeid, sites=self.options.sites)
        #: the objects the test tracked, once it has finished (weakly: a second run tracks them again)
        self.tracked: list[weakref.ref[Any]] = []
        self.recorder.device_limit = spec.device_limit if spec.device_limit is not None else self.options.device_limit
        self._stack = contextlib.ExitStack()  # what lives as long as the call: the recorder's activation
        self._watches = contextlib.ExitStack()  # what is left just before the call span closes
        self._returned: list[tuple[int, dict[str, int] | None]] = []
        self._snapshot: StorageSnapshot | None = None
        self._watch: OomWatch | None = None
        self._history: str | None = None
        self._started = False

    @property
    def leak_check(self) -> bool:
        return self.options.leak_check or any(limit.metric == "retained" for limit in self.spec.limits)

    def start(self, code: CodeType | None = None) -> None:
        """Clean the device, read the start, and begin the ``call`` span.

        ``code`` is the test function's code object: ``allocated`` is read as it
        returns, while its locals are alive (None: read at :meth:`finish`).
        """
        if self._started:
            raise RuntimeError(f"{self.nodeid}: the test run has started already")
        self._started = True
        _forget_last_failure()
        recorder = self.recorder
        if recorder.device_limit is not None:  # the emulated device holds all that is alive: frozen cycles
            collector.give_back()  # a test dropped are collected first (the collector freezes again later)
        recorder.begin()  # collects garbage and registers what is alive
        try:
            self._snapshot = snapshot_storages(self.engine) if self.leak_check else None
            self._stack.enter_context(activate(recorder))
            self._state = recorder.open("call")
            watches = self._watches
            self._watch = watches.enter_context(OomWatch(self.engine, recorder))
            if recorder.device_limit is not None:
                watches.enter_context(self.engine.limit_memory(recorder.device_limit))
            if self.options.snapshots is not None:
                self._history = self._record_history(watches, self.options.snapshots)
            watches.enter_context(watch_return(code, lambda: self._returned.append(recorder.allocated_now())))
        except BaseException:
            self._watches.close()
            self._stack.close()
            recorder.end()
            raise

    def _record_history(self, watches: contextlib.ExitStack, folder: Path) -> str | None:
        """Record the allocation history for this test's memory snapshot; a path that cannot hold it
        (a symbolic link pointing elsewhere at its name) is a warning and no snapshot."""
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
        self.start(getattr(function, "__code__", None))
        try:
            returned = function()
        except Exception as exc:
            return self.finish(exc)
        self._watches.close()  # allocated is read with what the function returned alive, as at its return
        del returned
        return self.finish(None)

    def finish(self, exc: BaseException | None) -> TestRecord:
        """Close the ``call`` span, confirm leaks, and gather what each span asked for; ``exc`` is what
        the test raised (None: it passed)."""
        recorder, engine = self.recorder, self.engine
        oom: OomReport | None = None
        try:
            try:
                if exc is not None and is_oom(exc) and self._watch is not None:
                    oom = self._watch.report_for(exc)
            finally:
                self._watches.close()
            if self._history is not None and not os.path.exists(self._history):
                self._history = None  # it could not be written: an OutputNotWritten warning said why
            call = recorder.close(self._state, allocated=self._returned[-1] if self._returned else None)
            timeline = recorder.timeline_since(self._state.start_event)
        finally:
            self.tracked = [weakref.ref(obj) for obj in recorder.tracked]
            self._stack.close()
            recorder.end()
        if oom is not None and exc is not None:
            release_oom(exc, engine)  # what the failed test held goes; the traceback ends at the user's line
        engine.settle()  # library workspaces stay: they were there at the start reading too
        notes = call.notes
        if engine.exact:  # the tracker is the engine: what did it miss?
            unseen = engine.scan()
            if unseen > 0:
                notes = (*notes, unseen_note(unseen))
                warnings.warn(PartialFigures(f"{self.nodeid}: {notes[-1]}"), stacklevel=2)
        call = replace(
            call, retained=engine.allocated() - call.start, max_microbatch=recorder.max_microbatch, notes=notes
        )
        record = TestRecord(
            self.nodeid,
            environment=self.environment,
            passed=exc is None,
            timeline=None if timeline is None else timeline.to_dict(TIMELINE_SAMPLES),
            snapshot=self._history,
            device_limit=recorder.device_limit,
            workspaces=engine.workspaces,
        )
        if oom is not None:
            record.reports.append(oom.format())
        spec = self.spec
        if self._snapshot is not None and record.passed and call.retained and call.retained > 0:
            collector.give_back()  # a cycle among frozen objects may hold what the test dropped: collect all
            leak = confirm_leak(engine, call.start, snapshot=self._snapshot)
            call = replace(call, retained=leak.retained)
            if leak.retained > 0:  # the judge adds it to the failure when the retained check fails
                record.leak_report = leak.format()
        self._snapshot = None
        record.leak_check = self.options.leak_check
        record.min_microbatch = spec.min_microbatch
        record.ranks_measured = recorder.ranks_measured
        record.measurements = [call] + [span.measurement for span in recorder.spans]
        record.asked = {"call": list(spec.limits)} if spec.limits else {}
        if spec.tolerance is not None:
            record.set_tolerance("call", spec.tolerance)
        for span in recorder.spans:
            if span.tolerance is not None:
                record.set_tolerance(span.name, span.tolerance)
            if span.limits:
                record.asked[span.name] = list(span.limits)
        return record
