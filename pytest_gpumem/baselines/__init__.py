"""Baseline files: environment keys, load, merge, atomic save (the layout is in docs/baselines.md).

Baselines store *costs*, which test order, ``-k``, xdist and session fixtures do not move. Keys this release does not
know are kept verbatim, so an older release never destroys what a newer one added.
"""

from __future__ import annotations

from pytest_gpumem.baselines.canonical import CALL_SPAN, SCHEMA_VERSION
from pytest_gpumem.baselines.environment import ALLOCATOR_VARIABLES, ENGINES, Environment, allocator_settings
from pytest_gpumem.baselines.loading import load, parse
from pytest_gpumem.baselines.saving import ORPHAN_AGE_S, save
from pytest_gpumem.baselines.store import BaselineEntry, BaselineStore, StaleEntry
from pytest_gpumem.baselines.validation import BaselineFileError

__all__ = [
    "ALLOCATOR_VARIABLES",
    "CALL_SPAN",
    "DEFAULT_FILENAME",
    "ENGINES",
    "ORPHAN_AGE_S",
    "SCHEMA_VERSION",
    "BaselineEntry",
    "BaselineFileError",
    "BaselineStore",
    "Environment",
    "StaleEntry",
    "allocator_settings",
    "load",
    "parse",
    "save",
]

#: The baseline file's name when none is given, in the rootdir (``pytest``) or the current folder (the CLI).
DEFAULT_FILENAME = "gpumem-baselines.json"
