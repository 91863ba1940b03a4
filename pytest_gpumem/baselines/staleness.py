"""Which baselines a run may call stale: those of tests whose file is gone, or was collected whole without them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pytest_gpumem.baselines.store import BaselineStore, StaleEntry
from pytest_gpumem.tables import file_of

__all__ = [
    "FAILED",
    "IGNORED",
    "IN_PART",
    "LAST_FAILED",
    "NOT_COLLECTED",
    "NO_FILE_EXISTS",
    "SKIPPED",
    "Collection",
    "Staleness",
    "file_of",
    "find_stale",
]

# Why a test's baselines are kept though it was not collected (the summary prints "N <reason>").
NOT_COLLECTED = "in files this run did not collect"
LAST_FAILED = "in files --lf collected only in part"
IN_PART = "in files collected in part (node ids on the command line)"
SKIPPED = "in modules skipped as they were collected"
IGNORED = "in files left out of the collection (--ignore, collect_ignore)"
FAILED = "in files whose collection failed"
NO_FILE_EXISTS = "whose files are all missing under the rootdir (is it the one they were recorded under?)"


@dataclass(frozen=True)
class Collection:
    """What a run collected, in node-id paths: every node id (deselected too), the files collected ``whole``, those
    seen ``partial``ly or not at all with why, and a reason that keeps ``everything`` whose file exists (``--lf``)."""

    items: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()
    rootdir: Path | None = None
    partial: Mapping[str, str] = field(default_factory=dict)
    everything: str | None = None

    def kept_because(self, path: str) -> str:
        """Why the baselines of tests in file ``path`` (not collected whole) are kept."""
        if self.everything is not None:
            return self.everything
        if path in self.partial:
            return self.partial[path]
        folders = (why for folder, why in self.partial.items() if path.startswith(folder.rstrip("/") + "/"))
        return next(folders, NOT_COLLECTED)


@dataclass(frozen=True)
class Staleness:
    """What :func:`find_stale` found: the stale baselines, and how many tests' baselines were kept, by why."""

    stale: list[StaleEntry]
    kept: dict[str, int]


def find_stale(store: BaselineStore, collection: Collection, environment: str) -> Staleness:
    """The stale baselines of ``environment`` (a test may exist only where it can be collected), and the tests kept
    because the run could not judge them."""
    tests = store.tests(environment)
    files = {file_of(test) for test in tests}
    missing = {path for path in files if path not in collection.whole and _missing(collection.rootdir, path)}
    # no file of the environment exists at all: node ids are most likely relative to another folder
    none_exists = bool(files) and missing == files
    stale: list[StaleEntry] = []
    kept: dict[str, int] = {}
    for test in tests:
        if test in collection.items:
            continue
        path = file_of(test)
        if path in collection.whole or (path in missing and not none_exists):
            stale.append(StaleEntry(environment, test, store.span_names(environment, test)))
            continue
        reason = NO_FILE_EXISTS if path in missing else collection.kept_because(path)
        kept[reason] = kept.get(reason, 0) + 1
    return Staleness(stale, kept)


def _missing(rootdir: Path | None, path: str) -> bool:
    """Whether the file ``path`` (a node-id path) is known to be gone: False when it cannot be told."""
    if rootdir is None or not path:
        return False
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute() or ".." in parts or (os.sep != "/" and "\\" in path):
        return False
    try:
        os.stat(rootdir.joinpath(*parts))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return False
