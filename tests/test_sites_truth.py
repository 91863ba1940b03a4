"""Sites that tell the truth: rows paired with the baseline's by their code (lines inserted
around a site give no row), one row per site and category (the rows add up to the breakdown,
category by category, on every engine), and the headline's categories agree with the rows."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from test_sites import MODEL, TEST

from conftest import run
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.data.site_figures import Site, SiteFigures, SiteProfile
from pytest_gpumem.judge.site_changes import diff_sites

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
            out += [extra if not extra or extra.startswith(" ") else indent + extra for extra in lines.splitlines()]
    return "\n".join(out) + "\n"


#: Where unrelated lines (comments, blank lines, logging) go, after which line and with what
#: indent: above every line of the step, between two of its lines, below them, in the model.
PLACES = {
    "above": ("def test_step(gpumem):", "    # a comment\n\n    logging.getLogger(__name__).debug('step')"),
    "between": ("logits = model(idx)", "# a comment\nlogging.getLogger(__name__).debug('step')"),
    "below": ("opt.zero_grad(set_to_none=True)", "\n# a comment"),
    "in the model": ("h = self.up(x)", "__import__('logging').getLogger(__name__).debug('up')"),
}


def _shifted(place: str) -> tuple[str, str]:
    after, lines = PLACES[place]
    if place == "in the model":
        return _insert(MODEL, after, lines), TEST
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


def _row(offset: int, code: str, peak: int, category: str = "activations") -> SiteFigures:
    return SiteFigures(Site("m.py", "Block.forward", offset, 10 + offset, code), peak, 0, 1, category, "forward")


@pytest.mark.parametrize(
    ("offsets", "moved"),
    [((2, 5), (2, 8)), ((2, 5), (5, 8)), ((2, 5), (4, 5))],
    ids=["between-the-repeats", "above-both", "between-above"],
)
def test_a_repeated_line_pairs_with_the_nearest_of_its_baseline_after_the_functions_shift(
    offsets: tuple[int, int], moved: tuple[int, int]
) -> None:
    """``h = layer(h)`` twice in a function, each holding its own bytes: with lines inserted above,
    between or around them, each pairs with the baseline's of the same order: nothing changed."""
    kept = [_row(1, "x = self.embed(idx)", 64), _row(9, "return self.head(h)", 32)]
    shift = moved[1] - offsets[1]
    baseline = SiteProfile((*kept, _row(offsets[0], "h = layer(h)", 100), _row(offsets[1], "h = layer(h)", 200)))
    now = [replace(row, site=replace(row.site, offset=row.site.offset + shift)) for row in kept[1:]]
    start = moved[0] - offsets[0]
    now.append(replace(kept[0], site=replace(kept[0].site, offset=1 + min(start, shift))))
    current = SiteProfile((*now, _row(moved[0], "h = layer(h)", 100), _row(moved[1], "h = layer(h)", 200)))
    assert diff_sites("call", baseline, current).changes == ()


def test_a_line_whose_text_changed_pairs_by_its_place_after_the_shift() -> None:
    """``h = up(x)`` edited into ``h = up(x).double()`` under a comment inserted above the function's
    lines: the row is the same line's, changed (not a "new" and a "gone")."""
    baseline = SiteProfile((_row(1, "x = embed(idx)", 64), _row(2, "h = up(x)", 100)))
    current = SiteProfile((_row(2, "x = embed(idx)", 64), _row(3, "h = up(x).double()", 200)))
    (change,) = diff_sites("call", baseline, current).changes
    assert (change.status, change.before_peak, change.delta()) == ("changed", 100, 100)


def test_a_baseline_stored_before_rows_were_split_by_category_compares_site_by_site() -> None:
    """A stored profile keyed by site alone (one row of all its bytes) is compared with this run's
    rows summed by site: no row for a site that merely has two categories now."""
    old = SiteProfile.from_stored({"m.py:Block.forward+2": "peak=300 end=0 n=2 activations forward | h = up(x)"})
    assert not old.by_category
    current = SiteProfile((_row(2, "h = up(x)", 200), _row(2, "h = up(x)", 100, "temporaries")))
    assert diff_sites("call", old, current).changes == ()
    stored = current.to_stored()
    assert sorted(stored) == ["m.py:Block.forward+2 activations", "m.py:Block.forward+2 temporaries"]
    again = SiteProfile.from_stored(stored)
    assert again.by_category and diff_sites("call", again, current).changes == ()
    assert {row.site.code for row in again.sites} == {"h = up(x)"}  # the smaller row's code from its sibling


TRAINER = """\
import os

import pytest
import torch

REGRESSION = os.environ.get("REGRESSION", "")


class Tiny(torch.nn.Module):
    def __init__(self, vocab=96, width=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.head = torch.nn.Linear(4 * width, vocab)

    def forward(self, idx):
        return self.head(torch.nn.functional.gelu(self.up(self.embed(idx))))


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.debug = model, optimizer, []

    def step(self, idx):
        logits = self.model(idx)
        if REGRESSION == "debug":
            self.debug.append(logits)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@pytest.mark.gpumem
def test_train(gpumem):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=REGRESSION == "amsgrad")
    gpumem.track(model, optimizer)
    trainer = Trainer(model, optimizer)
    idx = torch.randint(0, 96, (4, 16))
    for _ in range(3):
        trainer.step(idx)
"""

#: The model's parameters' bytes (float32): the embedding, the two linears' weights and biases.
PARAMETERS = 4 * (96 * 32 + 32 * 128 + 128 + 128 * 96 + 96)


@pytest.fixture
def trainer(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_trainer=TRAINER)
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)
    return pytester


def _row_at_end(test: dict[str, Any], code: str) -> dict[str, Any]:
    (change,) = [c for c in test["site_changes"]["call"]["changes"] if c["delta"]["end"]]
    assert change["site"]["code"].startswith(code)
    return change


def test_a_tensor_kept_in_a_list_names_the_list_that_holds_it(
    trainer: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``self.debug.append(logits)``: the row is the line that made the logits, and it names what
    keeps them: the trainer's ``debug`` list, holding the three steps' logits (4 × 16 × 96 float32s
    each) at the end, to the byte."""
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("REGRESSION", "debug")
    report = trainer.path / "report.json"
    result = run(trainer, f"--gpumem-json={report}")
    result.assert_outcomes(failed=1)
    test = json.loads(report.read_text())["tests"][0]
    change = _row_at_end(test, "return self.head(")
    assert change["delta"]["end"] == 3 * 4 * 16 * 96 * 4
    assert change["site"]["holders"] == [["Trainer.debug[…]", 3 * 4 * 16 * 96 * 4]]
    end_table = result.stdout.str().split("at the end, against the baseline")[1]
    assert "held by Trainer.debug[…]" in end_table.split("sites from a second run")[0]


def test_an_optimizer_option_names_the_state_key_it_adds(
    trainer: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``amsgrad=True``: the optimizer's step line grew by one more state the size of the
    parameters, and the row says which: ``optimizer.state[…]['max_exp_avg_sq']``, and the option
    that adds it (its ``exp_avg`` and ``exp_avg_sq``, of the same size, were there before)."""
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("REGRESSION", "amsgrad")
    report = trainer.path / "report.json"
    result = run(trainer, f"--gpumem-json={report}")
    result.assert_outcomes(failed=1)
    test = json.loads(report.read_text())["tests"][0]
    change = _row_at_end(test, "self.optimizer.step()")
    assert change["delta"]["end"] == PARAMETERS
    holders = dict(map(tuple, change["site"]["holders"]))
    assert holders["optimizer.state[…]['max_exp_avg_sq'] (amsgrad=True)"] == PARAMETERS
    assert holders["optimizer.state[…]['exp_avg']"] == PARAMETERS
    assert "held by optimizer.state[…]['max_exp_avg_sq'] (amsgrad=True)" in result.stdout.str()


def test_passing_runs_search_no_holders(trainer: pytest.Pytester) -> None:
    """The holders are searched in a failing test's second run only: a baseline update and a
    passing run with sites on (``always``) name none."""
    report = trainer.path / "report.json"
    for args in (["--gpumem-update-baselines"], ["--gpumem-sites=always"]):
        run(trainer, f"--gpumem-json={report}", *args).assert_outcomes(passed=1)
        (call,) = [m for m in json.loads(report.read_text())["tests"][0]["measurements"] if m["name"] == "call"]
        assert call["sites"]["sites"] and all(row["holders"] == [] for row in call["sites"]["sites"])


def test_a_line_that_holds_none_of_a_category_now_is_a_change_to_nothing_not_gone() -> None:
    """``logits = model(idx)`` held float32 temporaries at the peak; with ``.double()`` on the next
    line it holds none of them then, but still makes its activations: its temporaries row is a
    change to 0 B at its line, not a "gone" row for a line that is there."""
    baseline = SiteProfile((_row(1, "logits = model(idx)", 300), _row(1, "logits = model(idx)", 512, "temporaries")))
    current = SiteProfile((_row(1, "logits = model(idx)", 300), _row(2, "logits = logits.double()", 1024)))
    changes = diff_sites("call", baseline, current).at("peak")
    assert [(c.status, c.figures.site.code, c.figures.category, c.delta()) for c in changes] == [
        ("new", "logits = logits.double()", "activations", 1024),
        ("changed", "logits = model(idx)", "temporaries", -512),
    ]
    assert changes[1].figures.site.line == 11  # this run's line, not a stored site's


@pytest.mark.parametrize("regression", ["debug", "amsgrad"])
def test_the_headline_categories_are_the_rows_summed_for_a_kept_tensor_and_an_option(
    trainer: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, regression: str
) -> None:
    """As for docs/sites.md's first three regressions: the rows' changes at the peak, summed by
    category, are the failure's "by category at the peak", to the byte."""
    monkeypatch.setenv("REGRESSION", regression)
    report = trainer.path / "report.json"
    run(trainer, f"--gpumem-json={report}").assert_outcomes(failed=1)
    found = json.loads(report.read_text())["tests"][0]
    (finding,) = [f for f in found["findings"] if f["metric"] == "peak" and f["span"] == "call"]
    summed: dict[str, int] = {}
    for change in found["site_changes"]["call"]["changes"]:
        category = change["site"]["category"]
        summed[category] = summed.get(category, 0) + change["delta"]["peak"]
    assert {c: d for c, d in summed.items() if d} == finding["changed"]
