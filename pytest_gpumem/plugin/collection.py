"""Collection: markers validated as collected, the plugin switched off, and the book of what the run collected."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines.staleness import FAILED, IGNORED, IN_PART, LAST_FAILED, SKIPPED, Collection, file_of
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.plugin.marker import GpumemSpec, closest_first, parse_marker
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.plan import PlanError, choose_device

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
    "settle_spec",
]

SPEC_KEY = pytest.StashKey[GpumemSpec]()
SPEC_ERROR_KEY = pytest.StashKey[str]()
DISABLED_KEY: pytest.StashKey[torch.device] = pytest.StashKey()  #: a test's device while the plugin is disabled


def worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def gpumem_marks(item: pytest.Item) -> list[pytest.Mark]:
    """The item's ``gpumem`` marks, closest first."""
    return closest_first(list(item.iter_markers("gpumem")), getattr(getattr(item, "callspec", None), "marks", ()))


def marker_spec(item: pytest.Item, marks: list[pytest.Mark] | None = None) -> GpumemSpec | None:
    """The item's validated marker (None when it is not measured); raises :class:`SpecError`."""
    markers = [(mark.args, mark.kwargs) for mark in (gpumem_marks(item) if marks is None else marks)]
    if not markers and "gpumem" not in getattr(item, "fixturenames", ()):
        return None
    return parse_marker(markers)


def settle_spec(item: pytest.Item, marks: list[pytest.Mark] | None = None) -> None:
    """The item's marker as the collection leaves it, in ``item.stash[SPEC_KEY]`` (or its error)."""
    try:
        spec = marker_spec(item, marks)
    except SpecError as exc:
        item.stash[SPEC_ERROR_KEY] = f"invalid gpumem marker on {item.nodeid}: {exc}"
        return
    if spec is not None:
        item.stash[SPEC_KEY] = spec
    elif SPEC_KEY in item.stash:
        del item.stash[SPEC_KEY]


class MarkerCheck:
    """Validates the markers of every collected item, enabled or not: a bad one is a collection error."""

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        if report.passed:
            items = [item for item in report.result if isinstance(item, pytest.Item)]
            for item in items:
                settle_spec(item)
            errors = [item.stash[SPEC_ERROR_KEY] for item in items if SPEC_ERROR_KEY in item.stash]
            if errors:
                report.outcome = "failed"
                report.longrepr = "\n".join(errors)
                report.result = []
        return report


class DisabledManager:
    """The plugin switched off (``--gpumem-disable``): markers are validated, nothing is measured, judged or written."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.markers = MarkerCheck()

    def register(self, pluginmanager: pytest.PytestPluginManager) -> None:
        pluginmanager.register(self, "gpumem-manager")
        pluginmanager.register(self.markers, "gpumem-markers")

    def pytest_report_header(self) -> str:
        return "gpumem: disabled (--gpumem-disable): nothing is measured, judged or written"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:  # markers a conftest added or removed after collection
            settle_spec(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = item.stash.get(SPEC_KEY, None)
        if spec is None:
            return
        try:  # the test still runs on its device, and is skipped where there is none
            item.stash[DISABLED_KEY] = choose_device(spec.device or self.settings.device, worker=worker_index())
        except PlanError as exc:
            raise pytest.skip.Exception(exc.reason) from None


class CollectionBook:
    """What the run collected, for stale baselines: every node id, the files collected whole, why others were not."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._collected: set[str] = set()
        self._whole: set[str] = set()  # files whose every test is collected
        self._partial: dict[str, str] = {}  # files and folders seen in part or not at all: why
        self._workers_whole: list[set[str]] = []  # with xdist: each worker's whole files
        self._xdist = False  # a controller that heard from xdist workers
        self._last_failed = False  # --lf with failures on record: files are collected in part

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self._collected.add(item.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_ignore_collect(self, collection_path: Path) -> Generator[None, bool | None, bool | None]:
        """A path left out of the collection (``--ignore``) still exists: its tests are never stale."""
        ignored = yield
        if ignored and collection_path.is_relative_to(self.config.rootpath):
            self._partial.setdefault(collection_path.relative_to(self.config.rootpath).as_posix(), IGNORED)
        return ignored

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        path = file_of(report.nodeid)
        if report.failed:
            self._partial[path] = FAILED
            self._whole.discard(path)
        elif report.skipped:  # a module skipped at import (pytest.importorskip): its tests still exist
            self._partial.setdefault(report.nodeid if report.nodeid == path else path, SKIPPED)
            self._whole.discard(path)
        else:
            self._collected.update(node.nodeid for node in report.result if isinstance(node, pytest.Item))
            if report.nodeid == path and path not in self._partial and (self.config.rootpath / path).is_file():
                self._whole.add(path)  # a file collector: its report lists every test it holds

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None) or {}
        self._collected.update(output.get("gpumem_collected", ()))
        self._partial.update(output.get("gpumem_partial", {}))
        if "gpumem_whole" in output:
            self._workers_whole.append(set(output["gpumem_whole"]))
        self._xdist = True

    def collection(self) -> Collection:
        """What this run collected (with xdist: what every worker collected whole)."""
        whole = self._whole
        if self._xdist:
            whole = set.intersection(*self._workers_whole) if self._workers_whole else set()
        partial = dict(self._partial)
        everything = None
        for path in _narrowed_files(self.config):
            if path is None:
                everything = IN_PART  # a node id whose file cannot be told (--pyargs)
            else:
                partial[path] = IN_PART
        if self._last_failed:
            everything = LAST_FAILED
        return Collection(
            items=frozenset(self._collected),
            whole=frozenset() if everything else frozenset(path for path in whole if path not in partial),
            rootdir=self.config.rootpath,
            partial=partial,
            everything=everything,
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> None:
        """``--lf`` with failures on record collects only what failed."""
        cache = getattr(self.config, "cache", None)
        self._last_failed = bool(
            self.config.getoption("lf", False) and cache is not None and cache.get("cache/lastfailed", {})
        )

    def worker_output(self) -> None:
        """An xdist worker's collection, for the controller (``pytest_testnodedown``)."""
        output = self.config.workeroutput  # type: ignore[attr-defined]
        collection = self.collection()
        output["gpumem_collected"] = sorted(collection.items)
        output["gpumem_whole"] = sorted(collection.whole)
        output["gpumem_partial"] = dict(collection.partial)


def _narrowed_files(config: pytest.Config) -> list[str | None]:
    """The files that node ids on the command line collect in part; None where the file cannot be told (--pyargs)."""
    found: list[str | None] = []
    for arg in config.args:
        path = file_of(str(arg))
        if path == str(arg) or Path(config.invocation_params.dir, arg).exists():
            continue  # a whole file or folder (whose name may hold "::")
        where = Path(os.path.abspath(Path(config.invocation_params.dir, path)))
        try:
            found.append(where.relative_to(config.rootpath).as_posix() if where.is_file() else None)
        except (OSError, ValueError):
            found.append(None)
    return found
