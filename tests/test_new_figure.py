"""A new figure is a row of the metric table, a field of ``Measurement`` and its reading:
nothing else of the package changes for it to be limited by the marker and a span, kept in
the baseline file, judged, and shown in every report.

A pytest session in its own process adds a figure, ``held``, before the plugin is imported
(``-p newfigure``): a row appended to ``METRIC_TABLE`` in ``data/metrics.py``'s own code, a
``Measurement`` with two more fields, and the recorder reading it. The rest of the package is
as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import run_fresh

pytest_plugins = ["pytester"]

NEW_FIGURE = '''
"""Adds the figure "held" as a contributor would: a table row, a Measurement field, its reading."""

import ast
import dataclasses
import importlib.util
import sys

import pytest_gpumem.data

assert "pytest_gpumem.data.metrics" not in sys.modules, "the plugin was imported before this module"

ROW = """MetricInfo(
    "held",
    meaning="limit on the bytes held (a figure a test added)",
    about="bytes held, read by the test's recorder",
    cost="start_held",
    span_limit=True,
    baseline="always",
    tolerance=(0.01, 0),
)"""

# data/metrics.py's own code with one row more in METRIC_TABLE: every view of the table follows
spec = importlib.util.find_spec("pytest_gpumem.data.metrics")
tree = ast.parse(open(spec.origin, encoding="utf-8").read())
(table,) = [node for node in tree.body if isinstance(node, ast.AnnAssign) and node.target.id == "METRIC_TABLE"]
table.value.elts.append(ast.parse(ROW, mode="eval").body)
metrics = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = metrics
exec(compile(ast.fix_missing_locations(tree), spec.origin, "exec"), metrics.__dict__)
pytest_gpumem.data.metrics = metrics

from pytest_gpumem.data import figures  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Measurement(figures.Measurement):
    held: int | None = None
    start_held: int | None = None


Measurement.__module__ = figures.__name__
figures.Measurement = Measurement

from pytest_gpumem.measurement import recorder  # noqa: E402

_close = recorder.Recorder.close


def close(self, *args, **kwargs):
    """The reading: 1,000 bytes over what is allocated, at the start and at the peak."""
    measured = _close(self, *args, **kwargs)
    return dataclasses.replace(measured, held=measured.peak + 1000, start_held=measured.start + 1000)


recorder.Recorder.close = close
'''

SUITE = """
import pytest, torch

@pytest.mark.gpumem(held="64KiB")
def test_step(gpumem):
    x = torch.ones({n})
    with gpumem.measure("step", held="1MiB"):
        y = torch.ones({n})
"""


def spans(baselines: Any) -> list[dict[str, Any]]:
    """Every span entry of a baseline file's JSON (a mapping with a ``peak``)."""
    if isinstance(baselines, dict):
        found = [baselines] if "peak" in baselines else []
        return found + [entry for value in baselines.values() for entry in spans(value)]
    if isinstance(baselines, list):
        return [entry for value in baselines for entry in spans(value)]
    return []


@pytest.mark.slow
def test_a_new_figure_is_a_table_row_a_measurement_field_and_its_reading(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(newfigure=NEW_FIGURE)
    help_text = " ".join(run_fresh(pytester, "-p", "newfigure", "--help").stdout.str().split())
    assert "2% or 1.00 MiB for reserved; 1% for held;" in help_text  # --gpumem-tolerance's help

    pytester.makepyfile(test_held=SUITE.format(n=1024))  # 4 KiB in the call, 4 KiB more in the span
    run_fresh(pytester, "-p", "newfigure", "--gpumem-update-baselines").assert_outcomes(passed=1)
    kept = spans(json.loads((pytester.path / "gpumem-baselines.json").read_text()))
    assert sorted((entry["held"], entry["peak"]) for entry in kept) == [(4096, 4096), (8192, 8192)]

    pytester.makepyfile(test_held=SUITE.format(n=32 * 1024))  # 128 KiB each
    reports = ["--gpumem-json=report.json", "--gpumem-markdown=report.md", "--gpumem-artifacts=artifacts"]
    result = run_fresh(pytester, "-p", "newfigure", *reports)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*held cost 256.00 KiB exceeds the limit 64.00 KiB (64KiB) by +192.00 KiB*",
            "*held cost 256.00 KiB regressed from baseline 8.00 KiB by +248.00 KiB (×32.0), tolerance 1%*",
            "*step] held cost 128.00 KiB regressed from baseline 4.00 KiB*",
        ]
    )
    rows = [line.split() for line in result.stdout.lines]
    assert ["call", "held", "1000", "B", "256.98", "KiB", "256.00", "KiB"] in rows  # the failure's figures
    # the terminal summary: span, metric, measured, cost, limit, Δ, status
    assert ["step", "held", "256.98", "KiB", "128.00", "KiB", "1.00", "MiB", "+124.00", "KiB", "regressed"] in rows

    report = json.loads((pytester.path / "report.json").read_text())
    (test,) = report["tests"]
    assert [m["held"] - m["start_held"] for m in test["measurements"]] == [256 * 1024, 128 * 1024]
    assert [(f["span"], f["kind"], f["status"]) for f in test["findings"] if f["metric"] == "held"] == [
        ("call", "limit", "exceeded"),
        ("step", "limit", "ok"),
        ("call", "baseline", "regressed"),
        ("step", "baseline", "regressed"),
    ]
    markdown = (pytester.path / "report.md").read_text()
    assert "| held " in markdown and "256.00 KiB" in markdown
    (page,) = [p for p in Path(pytester.path / "artifacts").rglob("*.html") if p.name != "index.html"]
    html = page.read_text()
    assert "<td>held</td>" in html and "bytes held, read by the test&#x27;s recorder" in html
