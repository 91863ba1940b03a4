"""Where a test runs: its measured run set up before its fixtures, started at the call, finished as it returns."""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError, Environment
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin.collection import SPEC_ERROR_KEY, SPEC_KEY, gpumem_marks, marker_spec, worker_index
from pytest_gpumem.plugin.marker import GpumemSpec, late_marker_problems, parse_marker
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.plan import PlanError, plan_test, sites_mode
from pytest_gpumem.plugin.site_runs import (
    SECOND_RUN_KEY,
    SecondRun,
    no_second_run,
    no_sites_note,
    run_test,
    wants_sites,
)
from pytest_gpumem.plugin.torchrun import Launch

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines import Engine
    from pytest_gpumem.plugin.run_engines import Engines, Freezer
    from pytest_gpumem.plugin.runner import TestRun
    from pytest_gpumem.plugin.session import BaselineSession

__all__ = ["MARKS_KEY", "RECORD_KEY", "RUN_KEY", "Measuring"]

RUN_KEY: pytest.StashKey[TestRun] = pytest.StashKey()
RECORD_KEY = pytest.StashKey[tuple[TestRecord, str]]()  #: the call's record, and as JSON text for its report
MARKS_KEY = pytest.StashKey[list[pytest.Mark]]()  #: the test's ``gpumem`` marks when its collection ended


class Measuring:
    """The measuring hooks, in the process that runs the tests (a part of the manager, registered on its own)."""

    def __init__(
        self, config: pytest.Config, settings: Settings, baselines: BaselineSession, launch: Launch | None
    ) -> None:
        self.config = config
        self.settings = settings
        self.baselines = baselines
        self.launch = launch
        self.engines: Engines | None = None  #: made when the run loop starts with a measured test
        self.freezer: Freezer | None = None  #: the run's collector, started with the engines
        self._environments: dict[str, tuple[dict[str, Any], str]] = {}  # by engine, as the environment hook made them

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        if any(SPEC_KEY in item.stash for item in session.items):
            from pytest_gpumem.plugin.run_engines import Engines, Freezer

            self.freezer = Freezer(self.config)
            self.freezer.start()
            self.engines = Engines(cuda_rounding=self.settings.cuda_rounding, freezer=self.freezer)
        try:
            return (yield)
        finally:
            if self.freezer is not None:
                self.freezer.stop()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """A measured test that may want its sites runs through :func:`run_test`."""
        spec = item.stash.get(SPEC_KEY, None)
        if spec is None or sites_mode(spec, self.settings) != "rerun":
            return None
        return run_test(item, nextitem, self.freezer)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = item.stash.get(SPEC_KEY, None)
        if spec is not None:
            self._prepare(item, spec)

    def _prepare(self, item: pytest.Item, spec: GpumemSpec) -> None:
        """The test's run (``item.stash[RUN_KEY]``) from its plan; skips or fails the test that cannot run."""
        from pytest_gpumem.plugin.run_engines import Engines
        from pytest_gpumem.plugin.runner import TestRun

        problem: PlanError | None = None
        try:
            plan = plan_test(item.nodeid, spec, self.settings, worker=self._gpu_index())
        except PlanError as exc:
            problem = exc  # raised outside the handler: pytest would print it twice
        if problem is not None:
            if problem.skip:
                pytest.skip(problem.reason)
            pytest.fail(problem.reason, pytrace=False)
        second = item.stash.get(SECOND_RUN_KEY, None)
        if second is not None and second.running:  # the reports stay the first run's
            plan = plan.second_run(self.settings.site_config)
        if self.engines is None:  # outside the run loop (pytester's inline runs)
            self.engines = Engines(cuda_rounding=self.settings.cuda_rounding)
        assert plan.device is not None
        engine = self.engines.get(plan.device, breakdown=plan.breakdown, observe=plan.observe, predict=plan.predict)
        environment, environment_key = self._environment(engine)
        # activations told apart where they are read: the breakdown, the fixture, a baseline
        uses_fixture = "gpumem" in getattr(item, "fixturenames", ())
        reads_saved = plan.breakdown or uses_fixture or self._baselined(item, environment_key)
        item.stash[RUN_KEY] = TestRun(plan, engine, environment=environment, saved_tensors=reads_saved)

    def _baselined(self, item: pytest.Item, environment_key: str) -> bool:
        """Whether the test's figures meet a baseline (then its activations are told apart, docs/figures.md)."""
        if self.baselines.options.update:
            return True
        try:
            store = self.baselines.store
        except BaselineFileError:
            return True  # the judge reports the file
        return bool(store.span_names(environment_key, item.nodeid))

    def _gpu_index(self) -> int | None:
        """Which GPU this process measures on: the xdist worker's, else torchrun's local rank."""
        worker = worker_index()
        if worker is None and self.launch is not None:
            return self.launch.local_rank
        return worker

    def _environment(self, engine: Engine) -> tuple[dict[str, Any], str]:
        key = f"{engine.name}:{engine.device}:{engine.cuda_rounding}:{engine.predicts}"
        if key not in self._environments:
            detected = Environment.detect(engine.name, engine.device, engine.cuda_rounding, predict=engine.predicts)
            problem = None
            try:
                adjusted = self.config.hook.pytest_gpumem_environment(config=self.config, environment=detected)
                if adjusted is not None and not isinstance(adjusted, Environment):
                    raise TypeError(f"expected an Environment or None, got {type(adjusted).__name__}")
                environment = adjusted or detected
                self._environments[key] = (environment.to_dict(), environment.key)
            except (TypeError, ValueError) as exc:
                problem = f"pytest_gpumem_environment hook: {exc}"
            if problem is not None:
                pytest.fail(problem, pytrace=False)
        return self._environments[key]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        run = item.stash.get(RUN_KEY, None)
        if run is None:
            spec = _spec_now(item)  # a fixture may have marked the test
            if spec is None:
                result = yield
                if _spec_now(item) is not None:
                    pytest.fail(
                        f"{item.nodeid}: a gpumem marker added while the test ran is too late to measure it: "
                        "mark the test itself, or add the marker in a fixture or pytest_collection_modifyitems",
                        pytrace=False,
                    )
                return result
            self._prepare(item, spec)
            run = item.stash[RUN_KEY]
        from pytest_gpumem.measurement.returnwatch import ReturnWatchError

        problem = None
        try:
            run.start(getattr(item, "obj", None))
        except ReturnWatchError as exc:
            problem = f"{item.nodeid}: {exc}"
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        began = time.perf_counter()
        try:
            result = yield
        except BaseException as exc:
            self._keep(item, run, _finish(item, run, exc), exc, time.perf_counter() - began)
            raise
        self._keep(item, run, _finish(item, run, None), None, time.perf_counter() - began)
        return result

    def _keep(
        self, item: pytest.Item, run: TestRun, record: TestRecord, exc: BaseException | None, seconds: float
    ) -> None:
        """Keep the call's record for its report; a first run that failed on memory may ask for a second run."""
        second = item.stash.get(SECOND_RUN_KEY, None)
        if second is not None and second.running:
            second.record = record
            return
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        if not interrupted and wants_sites(item, run, record, exc, self.baselines):
            reason = no_second_run(item, record, seconds, self.settings)
            if reason is None and self.launch is not None:
                reason = "pytest runs under torchrun, whose ranks would not run it again together"
            if reason is not None:
                record = replace(record, reports=[*record.reports, no_sites_note(reason)])
            else:
                item.stash[SECOND_RUN_KEY] = SecondRun(record)
        item.stash[RECORD_KEY] = (record, record.to_json())


def _spec_now(item: pytest.Item) -> GpumemSpec | None:
    """The item's marker as it is now; a bad one fails the test."""
    problem = None
    try:
        return marker_spec(item)
    except SpecError as exc:
        problem = f"invalid gpumem marker on {item.nodeid}: {exc}"
    pytest.fail(problem, pytrace=False)


def _finish(item: pytest.Item, run: TestRun, exc: BaseException | None) -> TestRecord:
    """``run.finish(exc)`` with the markers as they are now: what a late marker can no longer change is an error."""
    collected = item.stash.get(MARKS_KEY, None)
    marks = gpumem_marks(item)
    late = [collected is not None and not any(mark is other for other in collected) for mark in marks]
    problems: list[str] = []
    if any(late):
        markers = [(mark.args, mark.kwargs) for mark in marks]
        try:
            now = parse_marker(markers)
        except SpecError as error:
            problems.append(f"invalid gpumem marker added after collection: {error}")
        else:
            problems = late_marker_problems(markers, late, run.plan.spec, now)
            run.plan = run.plan.with_marker(now)
    record = run.finish(exc)
    if not problems:
        return record
    return replace(record, errors=[*record.errors, *(f"{item.nodeid}: {problem}" for problem in problems)])
