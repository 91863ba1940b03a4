"""The pytest layer: options, the ``gpumem`` marker and fixture, and the hooks that wire
engine → measurement → verdict → report together. Everything else is a plain library.

Data flow, also under pytest-xdist: the process that runs a test measures it, checks its
limits and attaches a :class:`TestRecord` to the call report (``report.gpumem``). The
process that owns the run (the only one without xdist, the controller with it) reads
those records as reports arrive, compares them with the baseline file, fails regressed
tests (before junit-xml and the terminal see the report), and at the end writes the
baseline file once and the reports.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpumem import __version__
from pytest_gpumem.artifacts import artifact_path, render_html, write_html
from pytest_gpumem.baselines import (
    BASELINE_METRICS,
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    Environment,
    load,
    save,
)
from pytest_gpumem.engines.base import Engine
from pytest_gpumem.engines.cuda import cuda_available
from pytest_gpumem.expressions import BudgetError
from pytest_gpumem.expressions import parse_budget as parse_budget_expr
from pytest_gpumem.figures import CATEGORIES, Measurement, Timeline
from pytest_gpumem.fixture import GpuMem
from pytest_gpumem.leaks import confirm_leak, snapshot_storages
from pytest_gpumem.measure import Recorder, activate, make_engine, resolve_device
from pytest_gpumem.oom import OomWatch, device_limit, is_oom, release_oom
from pytest_gpumem.report import (
    finding_from_dict,
    finding_to_dict,
    json_report,
    markdown_report,
    measurement_table,
    summary_table,
)
from pytest_gpumem.returnwatch import code_of, watch_return
from pytest_gpumem.spec import GpumemSpec, LimitSpec, SpecError, parse_device, parse_marker, parse_span_limits
from pytest_gpumem.units import SizeError, parse_size
from pytest_gpumem.verdict import (
    Finding,
    Limit,
    Tolerance,
    check_limits,
    compare_baseline,
    failure_message,
    parse_tolerance,
    stale_findings,
)

MARKER_HELP = (
    "gpumem(peak=None, allocated=None, reserved=None, retained=None, device=None, breakdown=None, tolerance=None, "
    "device_limit=None, min_microbatch=None): "
    "measure the test's device memory and fail when a figure exceeds its limit or regresses from its baseline. "
    "Limits are bytes (int), sizes ('4GB' = 4 GiB, '512 MiB') or budget expressions ('16Ψ + 2GiB'). "
    "See pytest-gpumem's README."
)

DEFAULT_BASELINES = "gpumem-baselines.json"
DEFAULT_TOLERANCE = "2%,1MiB"
#: Most samples of a timeline kept in a test's record (for the HTML artifact).
TIMELINE_SAMPLES = 512
#: Entries of CUDA allocation history kept for a memory snapshot.
SNAPSHOT_ENTRIES = 100_000

SPEC_KEY = pytest.StashKey[GpumemSpec]()
RECORDER_KEY = pytest.StashKey[Recorder]()
RECORD_KEY = pytest.StashKey["TestRecord"]()


# -- settings -------------------------------------------------------------------------


def _flag(config: pytest.Config, name: str) -> bool:
    """A ``store_true`` option falls back to its ini value when not given."""
    value = config.getoption(name)
    return bool(value) if value is not None else bool(config.getini(name))


def _text(config: pytest.Config, name: str) -> str:
    value = config.getoption(name)
    return str(value if value is not None else config.getini(name)).strip()


def _path(config: pytest.Config, name: str) -> Path | None:
    text = _text(config, name)
    if not text:
        return None
    path = Path(text).expanduser()
    return path if path.is_absolute() else config.rootpath / path


@dataclass(frozen=True)
class Settings:
    """The run's options, each from the command line or else its ini value."""

    device: str
    require_gpu: bool
    breakdown: bool
    cuda_rounding: bool
    baselines: Path
    update: bool
    tolerance: Tolerance
    strict: bool
    prune: bool
    json_path: Path | None
    markdown_path: Path | None
    step_summary: bool
    device_limit: int | None
    leak_check: bool
    artifacts: Path
    artifacts_all: bool
    snapshot: bool

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        try:
            device = parse_device(_text(config, "gpumem_device") or "auto")
        except SpecError as exc:
            raise pytest.UsageError(f"--gpumem-device / ini gpumem_device: {exc}") from None
        tolerance_text = _text(config, "gpumem_tolerance") or DEFAULT_TOLERANCE
        try:
            tolerance = parse_tolerance(tolerance_text)
        except ValueError as exc:
            raise pytest.UsageError(f"--gpumem-tolerance / ini gpumem_tolerance: {exc}") from None
        limit_text = _text(config, "gpumem_device_limit")
        try:
            limit = parse_size(limit_text) if limit_text else None
        except SizeError as exc:
            raise pytest.UsageError(f"--gpumem-device-limit / ini gpumem_device_limit: {exc}") from None
        artifacts = _path(config, "gpumem_artifacts")
        if artifacts is None:
            cache = getattr(config, "cache", None)
            artifacts = cache.mkdir("gpumem-artifacts") if cache is not None else config.rootpath / ".gpumem-artifacts"
        return cls(
            device=device,
            require_gpu=_flag(config, "gpumem_require_gpu"),
            breakdown=_flag(config, "gpumem_breakdown"),
            cuda_rounding=_flag(config, "gpumem_cuda_rounding"),
            baselines=_path(config, "gpumem_baselines") or config.rootpath / DEFAULT_BASELINES,
            update=_flag(config, "gpumem_update_baselines"),
            tolerance=tolerance,
            strict=_flag(config, "gpumem_strict"),
            prune=_flag(config, "gpumem_prune"),
            json_path=_path(config, "gpumem_json"),
            markdown_path=_path(config, "gpumem_markdown"),
            step_summary=not _flag(config, "gpumem_no_step_summary"),
            device_limit=limit,
            leak_check=_flag(config, "gpumem_leak_check"),
            artifacts=artifacts,
            artifacts_all=_flag(config, "gpumem_artifacts_all"),
            snapshot=_flag(config, "gpumem_snapshot"),
        )


# -- what travels from the process that ran a test to the one that judges it ---------


@dataclass
class TestRecord:
    """What the plugin learnt about one test call."""

    nodeid: str
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    environment: dict[str, Any] | None = None
    #: tolerance by span name ("call" for the marker's) as {"relative", "absolute"}; absent: the run's default
    tolerances: dict[str, dict[str, float]] = field(default_factory=dict)
    #: whether the test's own code passed (before any memory verdict)
    passed: bool = True
    #: text reports to add to the failure: the out-of-memory report, the leaked tensors
    reports: list[str] = field(default_factory=list)
    #: the call span's timeline (downsampled) for the HTML artifact
    timeline: dict[str, Any] | None = None
    #: a CUDA memory snapshot written for this test
    snapshot: str | None = None
    #: the emulated device size the test ran under (bytes)
    device_limit: int | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(finding.failed for finding in self.findings)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestRecord:
        return cls(
            nodeid=data["nodeid"],
            measurements=[Measurement.from_dict(m) for m in data["measurements"]],
            findings=[finding_from_dict(f) for f in data["findings"]],
            errors=list(data["errors"]),
            environment=data["environment"],
            tolerances=dict(data["tolerances"]),
            passed=bool(data["passed"]),
            reports=list(data.get("reports", ())),
            timeline=data.get("timeline"),
            snapshot=data.get("snapshot"),
            device_limit=data.get("device_limit"),
        )

    @property
    def environment_key(self) -> str | None:
        return None if self.environment is None else Environment.from_dict(self.environment).key

    def message(self) -> str:
        parts = [f"gpumem: {error}" for error in self.errors]
        broken = [finding for finding in self.findings if finding.failed]
        if broken:
            parts.append(failure_message(broken))
        parts.extend(self.reports)
        if self.measurements:
            parts.append(measurement_table(self.measurements))
        return "\n\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: what travels from an xdist worker to the controller."""
        return {
            "nodeid": self.nodeid,
            "measurements": [m.to_dict() for m in self.measurements],
            "findings": [finding_to_dict(f) for f in self.findings],
            "errors": list(self.errors),
            "environment": self.environment,
            "tolerances": dict(self.tolerances),
            "passed": self.passed,
            "reports": list(self.reports),
            "timeline": self.timeline,
            "snapshot": self.snapshot,
            "device_limit": self.device_limit,
        }


# -- pytest hooks: options, marker, fixture -----------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory guards (pytest-gpumem)")

    def option(name: str, help: str, *, flag: bool = False, default: str = "", metavar: str | None = None) -> None:
        dest = "gpumem_" + name.replace("-", "_")
        if flag:
            group.addoption(f"--gpumem-{name}", dest=dest, action="store_true", default=None, help=help)
            parser.addini(dest, f"default for --gpumem-{name}", type="bool", default=False)
        else:
            group.addoption(f"--gpumem-{name}", dest=dest, default=None, metavar=metavar, help=help)
            parser.addini(dest, f"default for --gpumem-{name}", default=default)

    option(
        "device",
        "device measured tests run on: auto (CUDA when available, else CPU), cpu, cuda or cuda:N. Default: auto.",
        default="auto",
        metavar="DEVICE",
    )
    option("require-gpu", "fail (instead of skip) measured tests when no CUDA device is available.", flag=True)
    option("breakdown", "on CUDA, also run the storage tracker for the breakdown by category.", flag=True)
    option("cuda-rounding", "CPU engine: round storages up to 512-byte blocks as CUDA does.", flag=True)
    option(
        "baselines",
        f"baseline file (default: {DEFAULT_BASELINES} at the rootdir).",
        metavar="PATH",
    )
    option("update-baselines", "record the figures of tests that ran and passed into the baseline file.", flag=True)
    option(
        "tolerance",
        f"default tolerance of baseline comparisons: '2%', '1MiB' or '2%,1MiB' (default {DEFAULT_TOLERANCE}).",
        default=DEFAULT_TOLERANCE,
        metavar="TOL",
    )
    option("strict", "fail on new, improved, other-environment and stale baselines too (ratcheting CI).", flag=True)
    option("prune", "with --gpumem-update-baselines: remove baselines of tests that no longer exist.", flag=True)
    option("json", "write the JSON report (environment, measurements, verdicts) to PATH.", metavar="PATH")
    option("markdown", "write the Markdown report to PATH.", metavar="PATH")
    option("no-step-summary", "do not append the Markdown report to $GITHUB_STEP_SUMMARY.", flag=True)
    option(
        "device-limit",
        "run every measured test as if the device had SIZE bytes (e.g. 24GiB); the marker's device_limit wins.",
        metavar="SIZE",
    )
    option("leak-check", "check every measured test for leaks (as retained='0B' does).", flag=True)
    option(
        "artifacts",
        "folder for the HTML memory timelines of failed tests (default: gpumem-artifacts in the pytest cache).",
        metavar="DIR",
    )
    option("artifacts-all", "write artifacts for passing tests too.", flag=True)
    option("snapshot", "CUDA: record allocation history and write a PyTorch memory snapshot per test.", flag=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.pluginmanager.register(GpumemManager(config), "gpumem-manager")


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem:
    """Measure memory in a test: ``gpumem.device``, ``gpumem.measure(name)``, ``gpumem.track(...)``,
    ``gpumem.train_step(...)``, ``gpumem.budget()``. See pytest-gpumem's README."""
    recorder = request.node.stash.get(RECORDER_KEY, None)
    if recorder is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the gpumem fixture works only in test functions")
    return GpuMem(recorder, request.node.nodeid)


def _timeline_dict(timeline: Timeline, samples: int = TIMELINE_SAMPLES) -> dict[str, Any]:
    """A timeline as JSON-ready data, thinned to at most ``samples`` samples (keeping each stretch's highest)."""
    events = list(timeline.events)
    totals = timeline.totals()
    keep = list(range(len(events)))
    if len(keep) > samples:
        size = -(-len(keep) // samples)
        keep = [max(range(i, min(i + size, len(events))), key=totals.__getitem__) for i in range(0, len(events), size)]
    return {
        "events": [events[i] for i in keep],
        "series": {c: [timeline.series[c][i] for i in keep] for c in CATEGORIES},
        "marks": [list(mark) for mark in timeline.marks],
    }


def _timeline_from(data: dict[str, Any]) -> Timeline:
    return Timeline(
        events=tuple(data["events"]),
        series={c: tuple(data["series"][c]) for c in CATEGORIES},
        marks=tuple((int(event), str(label)) for event, label in data["marks"]),
    )


def _append(report: pytest.TestReport, title: str, text: str) -> None:
    """Add ``text`` to a failed report's message, keeping pytest's own rendering of its error."""
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    else:
        report.longrepr = f"{report.longrepr}\n\n{text}"


def _baseline_metrics(measurement: Measurement) -> tuple[str, ...]:
    """The figures a baseline keeps: the byte costs, and the largest microbatch when the test searched it."""
    return BASELINE_METRICS + (("max_microbatch",) if measurement.max_microbatch is not None else ())


def _tolerance_dict(tolerance: Tolerance) -> dict[str, float]:
    return {"relative": tolerance.relative, "absolute": tolerance.absolute}


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


class GpumemManager:
    """Owns the run's state: settings, engines, the baseline store and the records."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.settings = Settings.from_config(config)
        self.records: dict[str, TestRecord] = {}
        self._engines: dict[tuple[str, bool, bool], Engine] = {}
        self._environments: dict[str, dict[str, Any]] = {}
        self._collected: set[str] = set()
        self._collection_complete = True
        self._stale: list[Finding] = []
        self._freezing = False
        self._xdist = False  # a controller that heard from xdist workers
        self._save_error: str | None = None
        self.store: BaselineStore | None = None
        if not _is_worker(config):
            try:
                self.store = load(self.settings.baselines)
            except BaselineFileError as exc:
                raise pytest.UsageError(f"gpumem baselines: {exc}") from None

    # -- collection ---------------------------------------------------------------------

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self._collected.add(item.nodeid)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._collection_complete = False

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        errors = []
        for item in items:
            markers = [(mark.args, mark.kwargs) for mark in item.iter_markers("gpumem")]
            if not markers and "gpumem" not in getattr(item, "fixturenames", ()):
                continue
            try:
                item.stash[SPEC_KEY] = parse_marker(markers)
            except SpecError as exc:
                errors.append(f"{item.nodeid}: gpumem marker: {exc}")
        if errors:
            raise pytest.UsageError("invalid gpumem markers:\n  " + "\n  ".join(errors))

    # -- running (in the process that runs the test) ------------------------------------

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, None]:
        """Freeze what exists before the first test, so each test's garbage collection is cheap.

        Every measured test collects garbage before its start reading and after
        it; with a few hundred thousand objects alive (torch, pytest, the
        collected items) each collection costs 100+ ms. Objects alive before the
        loop are collected once, their tensors registered with the CPU engine
        (frozen objects are invisible to later scans), then frozen; each measured
        test freezes again after its start reading (torch imports modules lazily
        during the first tests). Frozen objects that later become cyclic garbage
        are collected when the loop ends.
        """
        measured = any(SPEC_KEY in item.stash for item in session.items)
        if measured and gc.isenabled() and gc.get_freeze_count() == 0:
            gc.collect()
            cpu = self._engine(torch.device("cpu"), True)
            if cpu.tracker is not None:
                cpu.tracker.scan()
            gc.freeze()
            self._freezing = True
        try:
            yield
        finally:
            if self._freezing:
                self._freezing = False
                gc.unfreeze()

    def _engine(self, device: torch.device, breakdown: bool) -> Engine:
        key = (str(device), breakdown, self.settings.cuda_rounding)
        engine = self._engines.get(key)
        if engine is None:
            engine = make_engine(device, breakdown=breakdown, cuda_rounding=self.settings.cuda_rounding)
            self._engines[key] = engine
        return engine

    def _environment(self, engine: Engine) -> dict[str, Any]:
        key = f"{engine.name}:{engine.device}"
        if key not in self._environments:
            cuda_rounding = bool(getattr(engine, "cuda_rounding", False))
            self._environments[key] = Environment.detect(engine.name, engine.device, cuda_rounding).to_dict()
        return self._environments[key]

    def _device_for(self, item: pytest.Item, spec: GpumemSpec) -> torch.device:
        wanted = spec.device or self.settings.device
        has_cuda = cuda_available()
        if wanted in ("auto", "cuda") and has_cuda:
            # pytest-xdist: worker i measures on GPU i mod N when several are visible
            index = _worker_index()
            count = torch.cuda.device_count()
            if index is not None and count > 1:
                return torch.device("cuda", index % count)
        if wanted == "auto":
            if has_cuda:
                return resolve_device("auto")
            if self.settings.require_gpu:
                pytest.fail(f"{item.nodeid}: --gpumem-require-gpu: no CUDA device is available", pytrace=False)
            return torch.device("cpu")
        device = torch.device(wanted)
        if device.type == "cuda":
            count = torch.cuda.device_count() if has_cuda else 0
            index = device.index if device.index is not None else 0
            if index >= count:
                plural = "s" if count != 1 else ""
                reason = f"gpumem: device {wanted!r} is not available ({count} CUDA device{plural} visible)"
                if self.settings.require_gpu:
                    pytest.fail(f"{item.nodeid}: --gpumem-require-gpu: {reason}", pytrace=False)
                pytest.skip(reason)
            return resolve_device(wanted)
        return device

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        spec = item.stash.get(SPEC_KEY, None)
        if spec is None:
            return
        device = self._device_for(item, spec)
        breakdown = spec.breakdown if spec.breakdown is not None else self.settings.breakdown
        engine = self._engine(device, breakdown=device.type == "cpu" or breakdown)
        recorder = Recorder(engine, timeline=engine.tracker is not None)
        recorder.device_limit = spec.device_limit if spec.device_limit is not None else self.settings.device_limit
        item.stash[RECORDER_KEY] = recorder

    def _leak_check(self, spec: GpumemSpec) -> bool:
        return self.settings.leak_check or any(limit.metric == "retained" for limit in spec.limits)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, None]:
        recorder = item.stash.get(RECORDER_KEY, None)
        if recorder is None:
            yield
            return
        spec = item.stash[SPEC_KEY]
        engine = recorder.engine
        # pytest keeps the last failure (and the frames holding its tensors) in sys.last_*,
        # and drops it only later in this hook: drop it now so this test starts clean.
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        returned: list[tuple[int, dict[str, int] | None]] = []
        recorder.begin()  # collects garbage and registers what is alive
        if self._freezing:
            gc.freeze()  # keep what is alive now out of this test's collections
        snapshot = snapshot_storages(engine) if self._leak_check(spec) else None
        oom = None
        try:
            with activate(recorder):
                state = recorder.open("call")
                code = code_of(getattr(item, "obj", None))
                with contextlib.ExitStack() as stack:
                    watch = stack.enter_context(OomWatch(engine, recorder))
                    if recorder.device_limit is not None:
                        stack.enter_context(device_limit(engine, recorder.device_limit))
                    history = stack.enter_context(self._cuda_history(engine, item))
                    stack.enter_context(watch_return(code, lambda: returned.append(recorder.allocated_now())))
                    outcome = yield
                    exc = outcome.excinfo[1] if outcome.excinfo else None
                    if exc is not None and is_oom(exc):
                        oom = watch.report_for(exc)
                call = recorder.close(state, allocated=returned[-1] if returned else None)
                timeline = recorder.timeline_since(state.start_event)
        finally:
            recorder.end()
        if oom is not None and exc is not None:
            release_oom(exc, engine)  # what the failed test held goes, traceback frames included
        engine.settle()  # garbage and library caches (cuBLAS workspaces) are not the test's
        call = replace(call, retained=engine.allocated() - call.start, max_microbatch=recorder.max_microbatch)
        record = TestRecord(
            item.nodeid,
            environment=self._environment(engine),
            passed=outcome.excinfo is None,
            timeline=None if timeline is None else _timeline_dict(timeline),
            snapshot=history[0] if history else None,
            device_limit=recorder.device_limit,
        )
        if oom is not None:
            record.reports.append(oom.format())
        allowed = next((limit for limit in spec.limits if limit.metric == "retained"), None)
        if snapshot is not None and record.passed and call.retained and call.retained > 0:
            check = confirm_leak(engine, call.start, snapshot=snapshot)
            call = replace(call, retained=check.retained)
            bound = 0 if allowed is None else allowed.resolve(call.psi).value
            if check.retained > bound:
                record.reports.append(check.format())
        limits = list(spec.limits)
        if self.settings.leak_check and allowed is None:
            limits.append(LimitSpec("retained", "0B (gpumem_leak_check)", parse_budget_expr("0")))
        record.measurements = [call] + [span.measurement for span in recorder.spans]
        if spec.tolerance is not None:
            record.tolerances["call"] = _tolerance_dict(spec.tolerance)
        for span in recorder.spans:
            specs, tolerance = parse_span_limits(span.name, span.limits)
            if tolerance is not None:
                record.tolerances[span.name] = _tolerance_dict(tolerance)
            if record.passed:
                record.findings.extend(self._check(record, span.measurement, specs))
        if record.passed:
            floors = []
            if spec.min_microbatch is not None:
                floors.append(Limit("max_microbatch", spec.min_microbatch, f"min_microbatch={spec.min_microbatch}"))
            record.findings[:0] = self._check(record, call, limits, floors)
        item.stash[RECORD_KEY] = record

    @contextlib.contextmanager
    def _cuda_history(self, engine: Engine, item: pytest.Item) -> Iterator[list[str]]:
        """With ``--gpumem-snapshot`` on CUDA: record allocation history, then dump a snapshot."""
        written: list[str] = []
        if not self.settings.snapshot or engine.name != "cuda":
            yield written
            return
        memory = torch.cuda.memory
        memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
        try:
            yield written
        finally:
            path = artifact_path(self.settings.artifacts, item.nodeid, ".snapshot.pickle")
            path.parent.mkdir(parents=True, exist_ok=True)
            memory._dump_snapshot(str(path))
            memory._record_memory_history(enabled=None)
            written.append(str(path))

    def _check(
        self,
        record: TestRecord,
        measurement: Measurement,
        specs: Iterable[LimitSpec],
        resolved: Iterable[Limit] = (),
    ) -> list[Finding]:
        """Resolve ``specs`` (Ψ from the measurement) and check them, with already ``resolved`` limits."""
        limits: list[Limit] = []
        for spec in specs:
            try:
                limits.append(spec.resolve(measurement.psi))
            except BudgetError as exc:
                where = "marker" if measurement.name == "call" else f"span {measurement.name!r}"
                hint = " (track the model with gpumem.track(model, optimizer))" if spec.uses_psi else ""
                record.errors.append(f"{where}: {spec.metric}={spec.text!r}: {exc}{hint}")
        return check_limits(record.nodeid, measurement, [*limits, *resolved])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        record = item.stash.get(RECORD_KEY, None)
        if report.when != "call" or record is None:
            return
        for measurement in record.measurements:
            prefix = "gpumem" if measurement.name == "call" else f"gpumem[{measurement.name}]"
            for metric in ("peak", "allocated", "reserved", "retained"):
                value = measurement.figure(metric)
                if value is not None:
                    item.user_properties.append((f"{prefix}.{metric}", value))
        if report.passed and record.failed:
            report.outcome = "failed"
            report.longrepr = record.message()
        elif report.failed and record.reports:
            _append(report, "gpumem", "\n\n".join(record.reports))
        report.gpumem = record.to_dict()  # type: ignore[attr-defined]  # travels to the xdist controller

    # -- judging (in the process that owns the run) -------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = getattr(report, "gpumem", None)
        if data is None or report.when != "call" or _is_worker(self.config) or self.store is None:
            return
        record = TestRecord.from_dict(data)
        self.records[record.nodeid] = record
        limits_failed = record.failed
        try:
            self._judge_baselines(report, record, limits_failed)
        finally:
            self._artifacts(report, record)

    def _judge_baselines(self, report: pytest.TestReport, record: TestRecord, limits_failed: bool) -> None:
        assert self.store is not None
        if not record.passed or record.environment is None or self.settings.update:
            return
        env = Environment.from_dict(record.environment)
        findings: list[Finding] = []
        for measurement in record.measurements:
            given = record.tolerances.get(measurement.name) or record.tolerances.get("call")
            tolerance = (
                self.settings.tolerance if given is None else Tolerance(given["relative"], int(given["absolute"]))
            )
            metrics = _baseline_metrics(measurement)
            # a tolerance's absolute floor is bytes: a count (max_microbatch) gets only its relative part
            per_metric = {m: tolerance if m in BASELINE_METRICS else Tolerance(tolerance.relative, 0) for m in metrics}
            findings.extend(
                compare_baseline(
                    record.nodeid,
                    measurement,
                    self.store.entry(env.key, record.nodeid, measurement.name),
                    per_metric,
                    other_environments=self.store.environments_with(record.nodeid, exclude=env.key),
                    strict=self.settings.strict,
                    metrics=metrics,
                )
            )
        record.findings.extend(findings)
        broken = [finding for finding in findings if finding.failed]
        if broken and report.passed:
            report.outcome = "failed"
            report.longrepr = failure_message(broken) + "\n\n" + measurement_table(record.measurements)
        elif broken and limits_failed:
            _append(report, "gpumem baselines", failure_message(broken))

    def _artifacts(self, report: pytest.TestReport, record: TestRecord) -> None:
        """The HTML timeline of a failed test (of every test with --gpumem-artifacts-all)."""
        keep = report.failed or self.settings.artifacts_all
        if not keep:
            if record.snapshot:
                Path(record.snapshot).unlink(missing_ok=True)
            return
        call = record.measurements[0]
        lines: dict[str, int] = {} if record.device_limit is None else {"device limit": record.device_limit}
        for finding in record.findings:
            if finding.span != "call" or finding.reference is None or finding.metric not in ("peak", "allocated"):
                continue
            if finding.kind in ("limit", "budget"):
                lines[f"{finding.kind} {finding.metric}"] = finding.reference
            elif finding.kind == "baseline":
                lines[f"baseline {finding.metric}"] = finding.reference + call.start
        timeline = _timeline_from(record.timeline) if record.timeline else Timeline((), {c: () for c in CATEGORIES})
        details = [failure_message([f for f in record.findings if f.failed])] if record.failed else []
        details += record.reports
        path = artifact_path(self.settings.artifacts, record.nodeid, ".html")
        write_html(
            path,
            render_html(title=record.nodeid, measurement=call, timeline=timeline, lines=lines, details=details),
        )
        written = [str(path)] + ([record.snapshot] if record.snapshot else [])
        if report.failed:
            _append(report, "gpumem artifacts", "gpumem artifacts: " + ", ".join(written))

    # -- xdist: collected ids travel from the workers to the controller -----------------

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if _is_worker(self.config):
            output = self.config.workeroutput  # type: ignore[attr-defined]
            output["gpumem_collected"] = sorted(self._collected)
            output["gpumem_complete"] = self._collection_complete and self._whole_suite()
            return
        self._finish(session)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None) or {}
        self._collected.update(output.get("gpumem_collected", ()))
        if not output.get("gpumem_complete", False):
            self._collection_complete = False
        self._xdist = True

    def _whole_suite(self) -> bool:
        """True when this run collected the whole suite (no paths or node ids on the command line)."""
        source = getattr(self.config, "args_source", None)
        return source is None or source != pytest.Config.ArgsSource.ARGS

    def _finish(self, session: pytest.Session) -> None:
        assert self.store is not None
        store = self.store
        complete = self._collection_complete and (self._xdist or self._whole_suite())
        env_keys = sorted({key for record in self.records.values() if (key := record.environment_key)})
        if complete and self._collected:
            stale = [entry for key in env_keys for entry in store.stale(self._collected, key)]
            self._stale = stale_findings(stale, strict=self.settings.strict)
            if self.settings.update and self.settings.prune and stale:
                store.prune(stale)
        if self.settings.update:
            for record in self.records.values():
                if record.passed and not record.failed and record.environment is not None:
                    entries = {
                        m.name: BaselineEntry.from_measurement(m, _baseline_metrics(m)) for m in record.measurements
                    }
                    store.record(Environment.from_dict(record.environment), record.nodeid, entries)
            try:
                save(store, self.settings.baselines)
            except (BaselineFileError, OSError) as exc:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
                self._save_error = f"gpumem: could not write the baseline file: {exc}"
        elif self.settings.strict and any(f.failed for f in self._stale):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self._write_reports(env_keys)

    def _write_reports(self, env_keys: list[str]) -> None:
        records = list(self.records.values())
        if not records and not self._stale:
            return
        environments: list[dict[str, Any]] = []
        for record in records:
            if record.environment is not None and record.environment_key not in [e["key"] for e in environments]:
                environments.append({"key": record.environment_key, **record.environment})
        if self.settings.json_path is not None:
            data = json_report(
                records, environments=environments, extra_findings=self._stale, generator=f"pytest-gpumem {__version__}"
            )
            self.settings.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.settings.json_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        markdown = markdown_report(records, header=", ".join(env_keys), extra_findings=self._stale)
        if self.settings.markdown_path is not None:
            self.settings.markdown_path.parent.mkdir(parents=True, exist_ok=True)
            self.settings.markdown_path.write_text(markdown, encoding="utf-8")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and self.settings.step_summary:
            with open(summary, "a", encoding="utf-8") as handle:
                handle.write(markdown)

    # -- reporting ------------------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if _is_worker(self.config):
            return
        error = self._save_error
        records = list(self.records.values())
        if not records and not self._stale and not error:
            return
        quiet = self.config.getoption("verbose") < 0
        problems = any(record.failed for record in records) or any(f.failed for f in self._stale)
        if quiet and not problems and not error:
            return
        terminalreporter.write_sep("=", "gpumem")
        keys = sorted({key for record in records if (key := record.environment_key)})
        if keys:
            terminalreporter.write_line(f"environment: {' ; '.join(keys)}")
        if records:
            terminalreporter.write_line(summary_table(records, only_problems=quiet))
        stale = [f for f in self._stale if f.failed or not quiet]
        if stale:
            prune = "" if self.settings.prune else " (remove them with --gpumem-update-baselines --gpumem-prune)"
            terminalreporter.write_line(f"stale baselines, their tests no longer exist{prune}:")
            for finding in stale:
                terminalreporter.write_line(f"  {finding.test}  [{finding.detail}]")
        if self.settings.update:
            terminalreporter.write_line(f"baselines written to {self.settings.baselines}")
        if error:
            terminalreporter.write_line(error, red=True)
