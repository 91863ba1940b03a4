"""Baseline files: environment keys, load, merge, atomic save.

A baseline is the figures one test recorded in one :class:`Environment`,
committed to the repository and compared on later runs. All figures are bytes.
Baselines store *costs* (a figure minus its span's start, see
:meth:`pytest_gpumem.data.figures.Measurement.cost`), so test order, ``-k``, xdist and
session fixtures do not move them; the absolute ``start`` and the ``breakdown``
at the peak are kept for information.

The file is JSON (UTF-8, 2-space indent, newline at the end, canonical key
order) so that a pull request's diff shows which test's memory changed::

    {
      "schema": 1,
      "environments": {
        "cpu | torch 2.13 | cuda_rounding off": {
          "environment": {"engine": "cpu", ..., "cuda_rounding": false},
          "tests": {
            "tests/test_train.py::test_step": {
              "spans": {
                "call": {"peak": 1024, "allocated": 512, "reserved": null, "start": 0, "breakdown": {...}},
                "step": {...}
              }
            }
          }
        }
      }
    }

(the real file puts every value on its own line). An environment with labels
(:attr:`Environment.labels`) has them in its ``environment`` object as
``"labels": {"name": "value"}``; the key is left out when there are none. Keys
this release does not know are kept verbatim when the file is rewritten, at
every level, so an older release never destroys what a newer one added within
the same schema version.

The modules: :mod:`~pytest_gpumem.baselines.environment` (what makes figures
comparable), :mod:`~pytest_gpumem.baselines.store` (the baselines in memory),
:mod:`~pytest_gpumem.baselines.canonical` (key order and the JSON text),
:mod:`~pytest_gpumem.baselines.validation` and
:mod:`~pytest_gpumem.baselines.loading` (reading, errors located by line and
column), :mod:`~pytest_gpumem.baselines.saving` (the atomic write).

This package never imports pytest, nor torch outside :meth:`Environment.detect`;
:func:`load` and :func:`save` are the only functions that touch the file
system. Nothing is ever pickled.
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
