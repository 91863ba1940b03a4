"""Sites in a run: which test runs record where their bytes were made, and the second run of a
test that failed on memory.

Recording a site costs a walk up the stack at every allocation, so a passing test on real
tensors never pays it: sites are recorded on a baseline update (they are stored with the
figures), in every run with ``--gpumem-sites=always``, in every run of a test on fake tensors
(there the walk costs a few percent of a step, and a second run would cost the whole step
again), and otherwise (``rerun``, the default) by running the call of a test that failed on
memory once more, right after the first, with sites on. The second run reuses the test's
fixture values: function-scoped fixtures are not set up again (pytest sets a test's fixtures up
once; tearing them down and up again in the middle of its call phase would run other fixtures'
finalizers out of order). A test whose call changes state its fixtures hold (a model trained in
place, an optimizer's state, a counter) gives other figures the second time: the record says
so, and its figures stay the first run's. ``sites="off"`` on the marker (or
``--gpumem-sites=off``) leaves such a test alone. No torch at import.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.judge.judgement import JudgeOptions, judge
from pytest_gpumem.judge.record import TestRecord

if TYPE_CHECKING:
    from pytest_gpumem.plugin.engines import Freezer
    from pytest_gpumem.plugin.marker import GpumemSpec
    from pytest_gpumem.plugin.options import Settings
    from pytest_gpumem.plugin.runner import RunOptions, TestRun
    from pytest_gpumem.plugin.session import BaselineSession

__all__ = ["run_options", "second_run"]


def _mode(settings: Settings, spec: GpumemSpec) -> str:
    return spec.sites or settings.sites


def run_options(settings: Settings, spec: GpumemSpec, *, fake: bool) -> RunOptions:
    """What the run asks of this test's first run: sites on a baseline update, with ``always``,
    and on fake tensors (``fake``), where recording them costs a few percent of a step that a
    second run would run again whole."""
    from pytest_gpumem.plugin.runner import RunOptions

    mode = _mode(settings, spec)
    sites = mode == "always" or (mode != "off" and (settings.baselines.update or fake))
    return RunOptions(
        leak_check=settings.leak_check,
        snapshots=settings.artifacts if settings.snapshot else None,
        device_limit=settings.device_limit,
        sites=settings.site_config if sites else None,
    )


def _fails(session: BaselineSession, record: TestRecord) -> bool:
    """Whether the judge fails ``record`` (judged on a copy: the process that owns the run judges it again)."""
    copy = TestRecord.from_json(record.to_json(timeline=False))
    options = session.options
    store = None
    if copy.environment is not None and not options.update:
        with contextlib.suppress(BaselineFileError):  # the owner of the run reports the file
            store = session.store
    judge(copy, store, JudgeOptions(options.tolerance, strict=options.strict, update=options.update))
    return copy.failed


def _expected(item: pytest.Item, exc: BaseException) -> bool:
    """Whether pytest reports ``exc`` as an expected failure: the test is marked ``xfail`` (its
    ``raises`` matching, its condition true) and ``--runxfail`` is not given. Its report shows no
    sites, so the second run that would name them is not run. Read as pytest's own skipping plugin
    reads it (``_pytest.skipping``); where that cannot be read, the second run runs as before."""
    if getattr(item.config.option, "runxfail", False):
        return False
    try:
        from _pytest.skipping import evaluate_xfail_marks, xfailed_key
    except ImportError:  # pragma: no cover - pytest moved it
        return False
    xfailed = item.stash.get(xfailed_key, None)
    if xfailed is None:
        xfailed = evaluate_xfail_marks(item)
    if xfailed is None:
        return False
    raises = xfailed.raises
    if raises is None:
        return True
    if isinstance(raises, (type, tuple)):
        return isinstance(exc, raises)
    matches = getattr(raises, "matches", None)  # pytest.RaisesExc (pytest 8.4 and later)
    return bool(matches(exc)) if callable(matches) else False


def second_run(
    item: pytest.Item,
    run: TestRun,
    record: TestRecord,
    exc: BaseException | None,
    settings: Settings,
    session: BaselineSession,
    freezer: Freezer | None,
) -> TestRecord:
    """``record`` with sites: when the test failed on memory (or ran out of memory, unless that is
    the failure its ``xfail`` mark expects) and its first run recorded none, its call runs once
    more with sites on, and each span of ``record`` gets the sites of the same span of that run;
    the leak and out-of-memory reports stay the first run's. ``record`` as it is otherwise.
    ``freezer``: the run's collector (None where the run has none), which freezes again before
    the second run what the first run's reports gave back."""
    from pytest_gpumem.diagnose.oom import is_oom
    from pytest_gpumem.plugin.returnwatch import code_of
    from pytest_gpumem.plugin.runner import TestRun

    if _mode(settings, run.spec) != "rerun" or run.options.sites is not None or settings.site_config is None:
        return record
    if not run.engine.records_sites:  # the CPU engine observing allocations: no second run for nothing
        return record
    if exc is not None:
        if not is_oom(exc) or _expected(item, exc):
            return record
    elif not _fails(session, record):
        return record
    if freezer is not None:
        # what the first run's leak check or report gave back to the collector is frozen again, as
        # between tests: the second run's collections walk what it makes, as the first run's did
        freezer.refreeze()
    # the leak and out-of-memory reports stay the first run's (see with_sites): the second builds none
    options = replace(run.options, sites=settings.site_config, snapshots=None, reports=False)
    again = TestRun(
        run.nodeid, run.spec, run.engine, environment=run.environment, options=options, fake=run.recorder.fake
    )
    fixture = getattr(item, "funcargs", {}).get("gpumem")
    if fixture is not None and getattr(fixture, "recorder", None) is run.recorder:
        fixture.recorder = again.recorder  # the test's gpumem measures the second run
    again.start(code_of(getattr(item, "obj", None)))
    for ref in run.tracked:  # tracked by a fixture, before the call: tracked again
        obj = ref()
        if obj is not None:
            again.recorder.track(obj)
    raised: BaseException | None = None
    try:
        item.runtest()
    except Exception as error:  # the second run's outcome is reported, not raised
        raised = error
    except BaseException:  # KeyboardInterrupt, pytest.exit: stop as the first run would
        again.finish(None)
        raise
    second = again.finish(raised)
    if fixture is not None and getattr(fixture, "recorder", None) is again.recorder:
        fixture.recorder = run.recorder
    return with_sites(record, second, raised)


def with_sites(first: TestRecord, second: TestRecord, raised: BaseException | None) -> TestRecord:
    """``first`` with the sites of ``second`` (the same test run again with sites on), span by span,
    each marked as from a second run and saying where that run's figures differ."""
    seconds = {m.name: m for m in second.measurements}
    measurements = []
    for measurement in first.measurements:
        other = seconds.get(measurement.name)
        if other is None or other.sites is None:
            measurements.append(measurement)
            continue
        note = _differs(measurement, other)
        if raised is not None and first.passed:
            note = f"the second run raised {type(raised).__name__}: {raised}".strip()
        measurements.append(replace(measurement, sites=replace(other.sites, second_run=True, note=note)))
    first.measurements = measurements
    # The leak and out-of-memory reports stay the first run's: they name what held the memory
    # when the test failed. A second run does not start where the first did (a test that leaks
    # into a module-level list leaks again: its report would name CACHE[2] for CACHE[0]; objects
    # the collector froze between the runs hide their holders' names). The sites above name the
    # lines; --gpumem-sites=always puts them into the reports too.
    return first


def _differs(first: Measurement, second: Measurement) -> str:
    """How the second run's figures differ from the first's ("" when its costs are the same)."""
    differ = [
        f"{metric} cost {second.cost(metric)} B, the first run's {first.cost(metric)} B"
        for metric in ("peak", "allocated")
        if second.cost(metric) != first.cost(metric)
    ]
    if not differ:
        return ""
    return "the second run's figures differ (" + "; ".join(differ) + "): the figures shown are the first run's"
