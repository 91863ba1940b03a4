"""Collection: the ``gpumem`` markers validated as their modules are collected, the plugin
switched off (``--gpumem-disable``), and the book of what the run collected (for stale baselines)."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.plugin.marker import GpumemSpec, closest_first, parse_marker
from pytest_gpumem.plugin.options import Settings

if TYPE_CHECKING:
    import torch


__all__ = [
    "DISABLED_KEY",
    "SPEC_ERROR_KEY",
    "SPEC_KEY",
    "CollectionBook",
    "DisabledManager",
    "MarkerCheck",
    "gpumem_marks",
    "marker_spec",
]

SPEC_KEY = pytest.StashKey[GpumemSpec]()
SPEC_ERROR_KEY = pytest.StashKey[str]()
#: the device of a test run while the plugin is disabled (``--gpumem-disable``)
DISABLED_KEY: pytest.StashKey[torch.device] = pytest.StashKey()


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def gpumem_marks(item: pytest.Item) -> list[pytest.Mark]:
    """The item's ``gpumem`` marks, closest first (:func:`~pytest_gpumem.plugin.marker.closest_first`)."""
    return closest_first(list(item.iter_markers("gpumem")), getattr(getattr(item, "callspec", None), "marks", ()))


def marker_spec(item: pytest.Item) -> GpumemSpec | None:
    """The item's validated marker (None when it is not measured); raises :class:`SpecError`."""
    markers = [(mark.args, mark.kwargs) for mark in gpumem_marks(item)]
    if not markers and "gpumem" not in getattr(item, "fixturenames", ()):
        return None
    return parse_marker(markers)


def _validate_markers(report: pytest.CollectReport) -> None:
    """Validate the markers of the items a collector made: a bad one is a collection error
    naming the test and the value, as pytest's own markers give (also under xdist)."""
    if not report.passed:
        return
    errors = []
    for item in report.result:
        if not isinstance(item, pytest.Item):
            continue
        try:
            spec = marker_spec(item)
        except SpecError as exc:
            errors.append(f"invalid gpumem marker on {item.nodeid}: {exc}")
            continue
        if spec is not None:
            item.stash[SPEC_KEY] = spec
    if errors:
        report.outcome = "failed"
        report.longrepr = "\n".join(errors)
        report.result = []


class MarkerCheck:
    """Validates the markers of every collected item, enabled or not: a bad one is an error."""

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        _validate_markers(report)
        return report


class DisabledManager(MarkerCheck):
    """The plugin switched off (``--gpumem-disable``): markers are still validated (a bad one
    is still an error) and the fixture still works, but nothing is measured, judged or written."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def pytest_report_header(self) -> str:
        return "gpumem: disabled (--gpumem-disable): nothing is measured, judged or written"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:  # markers a conftest added after collection
            try:
                marker_spec(item)
            except SpecError as exc:
                item.stash[SPEC_ERROR_KEY] = f"invalid gpumem marker on {item.nodeid}: {exc}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = marker_spec(item)
        if spec is None:
            return
        from pytest_gpumem.plugin.runner import DeviceUnavailable, choose_device

        unavailable: DeviceUnavailable | None = None
        try:  # the test still runs on the device it asks for, and is skipped where there is none
            item.stash[DISABLED_KEY] = choose_device(spec.device or self.settings.device, worker=worker_index())
        except DeviceUnavailable as exc:
            unavailable = exc
        if unavailable is not None:
            pytest.skip(unavailable.reason)


class CollectionBook:
    """What the run collected, for stale baselines: every node id, the collectors skipped or
    ignored (their tests still exist), whether the collection was whole (with xdist: the workers')."""

    config: pytest.Config

    def _start_book(self) -> None:
        self._collected: set[str] = set()
        self._collection_complete = True
        self._skipped: set[str] = set()  # collectors skipped as they were collected: their tests are never stale
        self._xdist = False  # a controller that heard from xdist workers

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self._collected.add(item.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_ignore_collect(self, collection_path: Path) -> Generator[None, bool | None, bool | None]:
        """A path left out of the collection (``--ignore``, a conftest's ``collect_ignore``, where a
        library is missing) still exists: its tests are never stale, as a skipped module's are."""
        ignored = yield
        if ignored:
            try:
                relative = collection_path.relative_to(self.config.rootpath)
            except ValueError:
                return ignored
            self._skipped.add(relative.as_posix())
        return ignored

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._collection_complete = False
        elif report.skipped:  # a module skipped at import (pytest.importorskip): its tests still exist
            self._skipped.add(report.nodeid)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None) or {}
        self._collected.update(output.get("gpumem_collected", ()))
        self._skipped.update(output.get("gpumem_skipped", ()))
        if not output.get("gpumem_complete", False):
            self._collection_complete = False
        self._xdist = True

    def _whole_suite(self) -> bool:
        """True when this run collected the whole suite (no paths or node ids on the command line)."""
        source = getattr(self.config, "args_source", None)
        return source is None or source != pytest.Config.ArgsSource.ARGS

    def _worker_output(self) -> None:
        """An xdist worker's collection, for the controller (``pytest_testnodedown``)."""
        output = self.config.workeroutput  # type: ignore[attr-defined]
        output["gpumem_collected"] = sorted(self._collected)
        output["gpumem_skipped"] = sorted(self._skipped)
        output["gpumem_complete"] = self._collection_complete and self._whole_suite()
