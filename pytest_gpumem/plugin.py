"""The pytest layer: options, the ``gpumem`` marker and fixture, and the hooks that wire
engine → measurement → verdict → report together. Everything else is a plain library."""

from __future__ import annotations

import gc
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from pytest_gpumem.engines.base import Engine
from pytest_gpumem.engines.cuda import cuda_available
from pytest_gpumem.expressions import BudgetError
from pytest_gpumem.figures import Measurement
from pytest_gpumem.fixture import GpuMem
from pytest_gpumem.measure import Recorder, activate, make_engine, resolve_device
from pytest_gpumem.report import measurement_table, summary_table
from pytest_gpumem.returnwatch import code_of, watch_return
from pytest_gpumem.spec import GpumemSpec, SpecError, parse_device, parse_marker, parse_span_limits
from pytest_gpumem.verdict import Finding, Limit, check_limits, failure_message

MARKER_HELP = (
    "gpumem(peak=None, allocated=None, reserved=None, retained=None, device=None, breakdown=None, tolerance=None): "
    "measure the test's device memory and fail when a figure exceeds its limit. Limits are bytes (int), sizes "
    "('4GB' = 4 GiB, '512 MiB') or budget expressions ('16Ψ + 2GiB'). See pytest-gpumem's README."
)

SPEC_KEY = pytest.StashKey[GpumemSpec]()
RECORDER_KEY = pytest.StashKey[Recorder]()
RECORD_KEY = pytest.StashKey["TestRecord"]()


def _flag_value(config: pytest.Config, option: str, ini: str) -> bool:
    """A ``store_true`` option falls back to its ini value when not given."""
    value = config.getoption(option)
    if value is not None:
        return bool(value)
    return bool(config.getini(ini))


def _text_value(config: pytest.Config, option: str, ini: str) -> str:
    value = config.getoption(option)
    return str(value) if value is not None else str(config.getini(ini))


@dataclass(frozen=True)
class Settings:
    """The run's options, each from the command line or else its ini value."""

    device: str
    require_gpu: bool
    breakdown: bool
    cuda_rounding: bool

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        raw_device = _text_value(config, "gpumem_device", "gpumem_device").strip() or "auto"
        try:
            device = parse_device(raw_device)
        except SpecError as exc:
            raise pytest.UsageError(f"--gpumem-device / ini gpumem_device: {exc}") from None
        return cls(
            device=device,
            require_gpu=_flag_value(config, "gpumem_require_gpu", "gpumem_require_gpu"),
            breakdown=_flag_value(config, "gpumem_breakdown", "gpumem_breakdown"),
            cuda_rounding=_flag_value(config, "gpumem_cuda_rounding", "gpumem_cuda_rounding"),
        )


@dataclass
class TestRecord:
    """What the plugin learnt about one test call."""

    nodeid: str
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(finding.failed for finding in self.findings)

    def message(self) -> str:
        parts = [f"gpumem: {error}" for error in self.errors]
        broken = [finding for finding in self.findings if finding.failed]
        if broken:
            parts.append(failure_message(broken))
        if self.measurements:
            parts.append(measurement_table(self.measurements))
        return "\n\n".join(parts)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory guards (pytest-gpumem)")
    group.addoption(
        "--gpumem-device",
        dest="gpumem_device",
        default=None,
        metavar="DEVICE",
        help="device that measured tests run on: auto (CUDA when available, else CPU), cpu, cuda or cuda:N. "
        "Default: ini gpumem_device, else auto.",
    )
    group.addoption(
        "--gpumem-require-gpu",
        dest="gpumem_require_gpu",
        action="store_true",
        default=None,
        help="fail (instead of skip) measured tests when no CUDA device is available: for GPU CI jobs.",
    )
    group.addoption(
        "--gpumem-breakdown",
        dest="gpumem_breakdown",
        action="store_true",
        default=None,
        help="on CUDA, also run the storage tracker for the breakdown by category (always on for the CPU engine).",
    )
    group.addoption(
        "--gpumem-cuda-rounding",
        dest="gpumem_cuda_rounding",
        action="store_true",
        default=None,
        help="CPU engine: round every storage up to 512-byte blocks as the CUDA caching allocator does.",
    )
    parser.addini("gpumem_device", "default for --gpumem-device", default="auto")
    parser.addini("gpumem_require_gpu", "default for --gpumem-require-gpu", type="bool", default=False)
    parser.addini("gpumem_breakdown", "default for --gpumem-breakdown", type="bool", default=False)
    parser.addini("gpumem_cuda_rounding", "default for --gpumem-cuda-rounding", type="bool", default=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.pluginmanager.register(GpumemManager(config), "gpumem-manager")


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem:
    """Measure memory in a test: ``gpumem.device``, ``gpumem.measure(name)``, ``gpumem.track(...)``,
    ``gpumem.train_step(...)``. See pytest-gpumem's README."""
    recorder = request.node.stash.get(RECORDER_KEY, None)
    if recorder is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the gpumem fixture works only in test functions")
    return GpuMem(recorder, request.node.nodeid)


class GpumemManager:
    """Owns the run's state: settings, engines and the records of measured tests."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.settings = Settings.from_config(config)
        self.records: dict[str, TestRecord] = {}
        self._engines: dict[tuple[str, bool, bool], Engine] = {}

    # -- collection ------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        errors = []
        for item in items:
            markers = [(mark.args, mark.kwargs) for mark in item.iter_markers("gpumem")]
            uses_fixture = "gpumem" in getattr(item, "fixturenames", ())
            if not markers and not uses_fixture:
                continue
            try:
                item.stash[SPEC_KEY] = parse_marker(markers)
            except SpecError as exc:
                errors.append(f"{item.nodeid}: gpumem marker: {exc}")
        if errors:
            raise pytest.UsageError("invalid gpumem markers:\n  " + "\n  ".join(errors))

    # -- running ---------------------------------------------------------------

    def _engine(self, device: torch.device, breakdown: bool) -> Engine:
        key = (str(device), breakdown, self.settings.cuda_rounding)
        engine = self._engines.get(key)
        if engine is None:
            engine = make_engine(device, breakdown=breakdown, cuda_rounding=self.settings.cuda_rounding)
            self._engines[key] = engine
        return engine

    def _device_for(self, item: pytest.Item, spec: GpumemSpec) -> torch.device:
        wanted = spec.device or self.settings.device
        has_cuda = cuda_available()
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
                reason = (
                    f"gpumem: device {wanted!r} is not available "
                    f"({count} CUDA device{'s' if count != 1 else ''} visible)"
                )
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
        record = TestRecord(item.nodeid, [call] + [span.measurement for span in recorder.spans])
        if outcome.excinfo is None:
            self._judge(item, record, recorder)
        item.stash[RECORD_KEY] = record
        self.records[item.nodeid] = record

    def _judge(self, item: pytest.Item, record: TestRecord, recorder: Recorder) -> None:
        spec = item.stash[SPEC_KEY]
        call = record.measurements[0]
        record.findings.extend(self._check(record, call, spec.limits))
        for span in recorder.spans:
            specs, _ = parse_span_limits(span.name, span.limits)
            record.findings.extend(self._check(record, span.measurement, specs))

    def _check(
        self, record: TestRecord, measurement: Measurement, specs: Iterator[Any] | tuple[Any, ...]
    ) -> list[Finding]:
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

    # -- reporting -------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.records:
            return
        quiet = self.config.getoption("verbose") < 0
        records = list(self.records.values())
        if quiet and not any(record.failed for record in records):
            return
        terminalreporter.write_sep("=", "gpumem")
        terminalreporter.write_line(summary_table(records, only_problems=quiet))
