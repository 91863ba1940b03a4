"""Sites that tell the truth: rows paired with the baseline's by their code (lines inserted
around a site give no row), one row per site and category (the rows add up to the breakdown,
category by category, on every engine), and the headline's categories agree with the rows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import run
from pytest_gpumem.data.metrics import CATEGORIES
from test_sites import MODEL, TEST

pytest_plugins = ["pytester"]


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(tinymodel=MODEL, test_train=TEST)
    pytester.syspathinsert()
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)
    return pytester


def _report(pytester: pytest.Pytester, *args: str, failed: int = 0) -> dict[str, Any]:
    report = pytester.path / "report.json"
    result = run(pytester, f"--gpumem-json={report}", *args)
    result.assert_outcomes(passed=1 - failed, failed=failed)
    return json.loads(report.read_text())["tests"][0]


def _insert(source: str, after: str, lines: str) -> str:
    """``source`` with ``lines`` inserted after the line that holds ``after`` (once), indented as it."""
    out = []
    for line in source.splitlines():
        out.append(line)
        if after in line:
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + extra if extra else "" for extra in lines.splitlines()]
    return "\n".join(out) + "\n"


#: Unrelated lines: a comment, a blank line, logging.
UNRELATED = "# a comment\n\nlogging.getLogger(__name__).debug('step')"

#: Where the unrelated lines go: above every line of the step, between its lines, below them.
PLACES = {
    "above": ("def test_step(gpumem):", "    "),
    "between": ("logits = model(idx)", ""),
    "below": ("opt.zero_grad(set_to_none=True)", ""),
    "in the model": ("h = self.up(x)", ""),
}


def _shifted(place: str) -> tuple[str, str]:
    after, indent = PLACES[place]
    lines = "\n".join(indent + line if line else "" for line in UNRELATED.splitlines())
    if place == "in the model":
        return _insert(MODEL, after, lines.replace("logging.", "__import__('logging').")), TEST
    return MODEL, _insert(TEST.replace("import os\n", "import logging\nimport os\n"), after, lines)


@pytest.mark.parametrize("place", list(PLACES))
def test_lines_inserted_around_the_sites_give_no_row(suite: pytest.Pytester, place: str) -> None:
    """A comment, a blank line and a logging call inserted above the step's lines, between two of
    them, below them, or inside the model's forward: every site pairs with its baseline's by its
    code, nothing changed. (Paired by offset first, a line that took another's offset was
    compared with it: rows of false growth, a "new" and a "gone".)"""
    model, test = _shifted(place)
    suite.makepyfile(tinymodel=model, test_train=test)
    found = _report(suite, "--gpumem-sites=always")
    assert found["site_changes"]["call"]["changes"] == []


@pytest.mark.parametrize("place", ["above", "between"])
def test_a_regression_below_inserted_lines_is_its_only_row(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, place: str
) -> None:
    """The fp32 copy of the logits kept, with unrelated lines inserted above it: one row, the
    copy's line, new since the baseline, 24 KiB (4 × 16 × 96 float32s)."""
    model, test = _shifted(place)
    suite.makepyfile(tinymodel=model, test_train=test)
    monkeypatch.setenv("SITES_REGRESSION", "copy")
    found = _report(suite, failed=1)
    changes = found["site_changes"]["call"]["changes"]
    assert [(c["status"], c["site"]["code"], c["delta"]["peak"]) for c in changes if c["delta"]["peak"]] == [
        ("new", "kept = logits.detach().float().clone()", 4 * 16 * 96 * 4)
    ]


def _by_category(rows: list[dict[str, Any]], moment: str) -> dict[str, int]:
    found = dict.fromkeys(CATEGORIES, 0)
    for row in rows:
        found[row["category"]] += row[moment]
    return found


ENGINES = {
    "cpu": "@pytest.mark.gpumem",
    "prediction": '@pytest.mark.gpumem(predict="h100")',
    "fake": '@pytest.mark.gpumem(fake=True, predict="h100")',
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_rows_add_up_to_the_breakdown_category_by_category(pytester: pytest.Pytester, engine: str) -> None:
    """Every row is one site's bytes of one category: summed by category, the rows (with the bytes
    alive before the span) are the breakdown at the peak and at the end, to the byte, on the CPU
    engine and in a prediction for an H100 on real and on fake tensors (whose whole blocks the
    allocator did not split are a row of their own). A line whose tensors are of two categories has two rows."""
    pytester.makepyfile(tinymodel=MODEL, test_train=TEST.replace("@pytest.mark.gpumem", ENGINES[engine]))
    pytester.syspathinsert()
    found = _report(pytester, "--gpumem-sites=always")
    (call,) = [m for m in found["measurements"] if m["name"] == "call"]
    rows = call["sites"]["sites"]
    assert call["sites"]["rest"] == {"peak": 0, "end": 0, "sites": 0}
    assert _by_category(rows, "peak") == call["breakdown"]
    assert _by_category(rows, "end") == call["allocated_breakdown"]
    keys = [(row["key"], row["category"]) for row in rows]
    assert len(set(keys)) == len(keys)  # one row a site and category
    loss = sorted(row["category"] for row in rows if row["code"].startswith("loss = "))
    assert loss == ["activations", "temporaries"]  # saved for backward, and the loss itself: two rows


@pytest.mark.parametrize("regression", ["copy", "batch", "eval"])
def test_the_headline_categories_are_the_rows_summed(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, regression: str
) -> None:
    """The failure's "by category at the peak" and its rows never disagree: the rows' changes,
    summed by category, are the headline's, to the byte, for each regression of docs/sites.md."""
    monkeypatch.setenv("SITES_REGRESSION", regression)
    found = _report(suite, failed=1)
    (finding,) = [f for f in found["findings"] if f["metric"] == "peak" and f["span"] == "call"]
    summed: dict[str, int] = {}
    for change in found["site_changes"]["call"]["changes"]:
        category = change["site"]["category"]
        summed[category] = summed.get(category, 0) + change["delta"]["peak"]
    assert {c: d for c, d in summed.items() if d} == finding["changed"]
