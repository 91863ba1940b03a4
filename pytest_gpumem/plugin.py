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

import gc
import json
import os
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpumem import __version__
from pytest_gpumem.baselines import BaselineFileError, BaselineStore, Environment, load, save
from pytest_gpumem.engines.base import Engine
from pytest_gpumem.engines.cuda import cuda_available
from pytest_gpumem.expressions import BudgetError
from pytest_gpumem.figures import Measurement
from pytest_gpumem.fixture import GpuMem
from pytest_gpumem.measure import Recorder, activate, make_engine, resolve_device
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
    "gpumem(peak=None, allocated=None, reserved=None, retained=None, device=None, breakdown=None, tolerance=None): "
    "measure the test's device memory and fail when a figure exceeds its limit or regresses from its baseline. "
    "Limits are bytes (int), sizes ('4GB' = 4 GiB, '512 MiB') or budget expressions ('16Ψ + 2GiB'). "
    "See pytest-gpumem's README."
)

DEFAULT_BASELINES = "gpumem-baselines.json"
DEFAULT_TOLERANCE = "2%,1MiB"

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
        )

    @property
    def environment_key(self) -> str | None:
        return None if self.environment is None else Environment.from_dict(self.environment).key

    def message(self) -> str:
        parts = [f"gpumem: {error}" for error in self.errors]
        broken = [finding for finding in self.findings if finding.failed]
        if broken:
            parts.append(failure_message(broken))
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
        item.stash[RECORDER_KEY] = Recorder(engine)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, None]:
        recorder = item.stash.get(RECORDER_KEY, None)
        if recorder is None:
            yield
            return
        returned: list[tuple[int, dict[str, int] | None]] = []
        recorder.begin()
        try:
            with activate(recorder):
                state = recorder.open("call")
                code = code_of(getattr(item, "obj", None))
                with watch_return(code, lambda: returned.append(recorder.allocated_now())):
                    outcome = yield
                call = recorder.close(state, allocated=returned[-1] if returned else None)
        finally:
            recorder.end()
        gc.collect()
        if call.engine == "cuda":
            torch.cuda.synchronize(recorder.engine.device)
        call = replace(call, retained=recorder.engine.allocated() - call.start)
        spec = item.stash[SPEC_KEY]
        record = TestRecord(
            item.nodeid,
            [call] + [span.measurement for span in recorder.spans],
            environment=self._environment(recorder.engine),
            passed=outcome.excinfo is None,
        )
        if spec.tolerance is not None:
            record.tolerances["call"] = _tolerance_dict(spec.tolerance)
        for span in recorder.spans:
            specs, tolerance = parse_span_limits(span.name, span.limits)
            if tolerance is not None:
                record.tolerances[span.name] = _tolerance_dict(tolerance)
            if record.passed:
                record.findings.extend(self._check(record, span.measurement, specs))
        if record.passed:
            record.findings[:0] = self._check(record, call, spec.limits)
        item.stash[RECORD_KEY] = record

    def _check(self, record: TestRecord, measurement: Measurement, specs: Iterable[LimitSpec]) -> list[Finding]:
        limits: list[Limit] = []
        for spec in specs:
            try:
                limits.append(spec.resolve(measurement.psi))
            except BudgetError as exc:
                where = "marker" if measurement.name == "call" else f"span {measurement.name!r}"
                hint = " (track the model with gpumem.track(model, optimizer))" if spec.uses_psi else ""
                record.errors.append(f"{where}: {spec.metric}={spec.text!r}: {exc}{hint}")
        return check_limits(record.nodeid, measurement, limits)

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
        if not record.passed or record.environment is None:
            return
        if self.settings.update:
            return
        env = Environment.from_dict(record.environment)
        findings: list[Finding] = []
        for measurement in record.measurements:
            given = record.tolerances.get(measurement.name) or record.tolerances.get("call")
            tolerance = (
                self.settings.tolerance if given is None else Tolerance(given["relative"], int(given["absolute"]))
            )
            findings.extend(
                compare_baseline(
                    record.nodeid,
                    measurement,
                    self.store.entry(env.key, record.nodeid, measurement.name),
                    tolerance,
                    other_environments=self.store.environments_with(record.nodeid, exclude=env.key),
                    strict=self.settings.strict,
                )
            )
        record.findings.extend(findings)
        broken = [finding for finding in findings if finding.failed]
        if broken and report.passed:
            report.outcome = "failed"
            report.longrepr = failure_message(broken) + "\n\n" + measurement_table(record.measurements)
        elif broken and limits_failed:
            report.longrepr = f"{report.longrepr}\n\n{failure_message(broken)}"

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
        complete = self._collection_complete and (getattr(self, "_xdist", False) or self._whole_suite())
        env_keys = sorted({key for record in self.records.values() if (key := record.environment_key)})
        if complete and self._collected:
            stale = [entry for key in env_keys for entry in store.stale(self._collected, key)]
            self._stale = stale_findings(stale, strict=self.settings.strict)
            if self.settings.update and self.settings.prune and stale:
                store.prune(stale)
        if self.settings.update:
            for record in self.records.values():
                if record.passed and not record.failed and record.environment is not None:
                    store.record(Environment.from_dict(record.environment), record.nodeid, record.measurements)
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
        error = getattr(self, "_save_error", None)
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
