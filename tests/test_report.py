"""Tests of pytest_gpumem.report.text: summary, failure and Markdown tables of real CPU steps."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import run
from pytest_gpumem import measure
from pytest_gpumem.baselines import BaselineEntry
from pytest_gpumem.data.figures import Measurement, Phase
from pytest_gpumem.data.findings import Finding, Limit, Tolerance
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.record import TestRecord as Record
from pytest_gpumem.judge.verdict import check_values, compare_baseline
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.report.details import breakdown_rows, environment_notes, measurement_table
from pytest_gpumem.report.formats import json_report
from pytest_gpumem.report.text import SUMMARY_HEADERS, markdown_report, summary_rows, summary_table
from pytest_gpumem.tables import elide_id, short_id
from pytest_gpumem.units import format_size

WIDTHS = (80, 100, 120, 1000)

LONG_ID = (
    "tests/integration/models/test_transformer_memory.py::TestLlamaBlock::"
    "test_train_step[bf16-seq2048-batch16-grad_accumulation4-activation_checkpointing]"
)
ADAMW_ID = "tests/test_steps.py::test_adamw_step"
BACKWARD_ID = "tests/test_steps.py::test_backward_frees_activations"
CUDA_KEY = "cuda | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch 2.13 | CUDA 12.8 | cuDNN 91002 | default allocator"
CPU_KEY = "cpu | torch 2.13 | cuda_rounding on"
BUDGET = "16Ψ + 2 * 4Ψ + 40MiB + activation_estimate(b=16, s=2048, d=4096, layers=32)"


@dataclass(frozen=True)
class Steps:
    """Real figures: a test call holding a warm-up and a measured AdamW step, the step, and a backward."""

    call: Measurement
    step: Measurement
    backward: Measurement


@pytest.fixture(scope="module")
def steps() -> Steps:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 32), torch.zeros(16, 32)
    with measure("call", device="cpu", track=(model, optimizer)) as call:
        run_step(model, optimizer, (x, y), F.mse_loss)  # warm-up
        with measure("step") as step:
            run_step(model, optimizer, (x, y), F.mse_loss)
        loss = F.mse_loss(model(x), y)
        with measure("backward") as backward:
            loss.backward()  # frees the activations saved for it
        del loss
    return Steps(call.measurement, step.measurement, backward.measurement)


def cost(measurement: Measurement, metric: str) -> int:
    value = measurement.cost(metric)
    assert value is not None
    return value


def costs(measurement: Measurement) -> dict[str, int | None]:
    return {metric: measurement.cost(metric) for metric in METRICS}


def limit_findings(test: str, measurement: Measurement, *limits: Limit) -> list[Finding]:
    """Limits checked as the plugin will check them: against costs (figure − start)."""
    return check_values(test, measurement.name, costs(measurement), limits, engine=measurement.engine)


def baseline_findings(
    test: str, measurement: Measurement, scale: float | None = 1.0, other_environments: tuple[str, ...] = ()
) -> list[Finding]:
    """Findings against a baseline of ``scale`` × this measurement's costs (``None``: no baseline here)."""
    entry = None
    if scale is not None:
        recorded = BaselineEntry.from_measurement(measurement).costs
        entry = BaselineEntry({metric: None if c is None else int(c * scale) for metric, c in recorded.items()})
    return compare_baseline(test, measurement, entry, Tolerance(0.01), other_environments=other_environments)


def suite(steps: Steps) -> list[Record]:
    """Four tests: a long id with a budget exceeded, an AdamW step that regressed, a backward, a new test."""
    call = replace(steps.call, retained=0)
    budget = Limit("peak", cost(steps.call, "peak") - 1024, BUDGET, kind="budget")
    long = Record(
        LONG_ID,
        [call, steps.step],
        limit_findings(LONG_ID, call, budget) + baseline_findings(LONG_ID, steps.step, None),
    )
    adamw_findings = [
        *limit_findings(ADAMW_ID, call, Limit("peak", 64 * 2**20, "64MiB"), Limit("retained", 0, "0B")),
        *baseline_findings(ADAMW_ID, call),
        *baseline_findings(ADAMW_ID, steps.step, scale=0.5),  # the step doubled: regressed
    ]
    adamw = Record(ADAMW_ID, [call, steps.step], adamw_findings)
    backward_findings = baseline_findings(BACKWARD_ID, steps.backward, scale=1.0)
    backward = Record(BACKWARD_ID, [replace(steps.backward, name="backward")], backward_findings)
    other_id = "tests/test_steps.py::test_on_another_machine"
    other = Record(other_id, [call], baseline_findings(other_id, call, None, (CUDA_KEY, CPU_KEY)))
    return [long, adamw, backward, other]


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def assert_fits(text: str, width: int) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, f"{len(too_wide)} line(s) wider than {width}: {too_wide[:3]}"


# --------------------------------------------------------------------------- width


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("verbosity", [-1, 0, 1])
def test_every_line_fits_the_width(steps: Steps, width: int, verbosity: int) -> None:
    records = suite(steps)
    text = summary_table(records, width=width, verbosity=verbosity)
    assert_fits(text, width)
    assert "\xa0" not in text  # what wrapping keeps together is shown with plain spaces
    # the test's function name and parametrize id stay whole, whatever is elided, where they fit
    name = "test_train_step[bf16-seq2048-batch16-grad_accumulation4-activation_checkpointing]"
    if width > len(name):
        assert name in text
    else:
        assert "test_train_step[bf16-seq2048-batch16-gra…accumulation4-activation_checkpointing]" in text
    assert "exceeded" in text and "regressed" in text
    for record in records:
        assert_fits(measurement_table(record.measurements, width=width), width)


def test_the_old_table_was_wider_than_a_terminal(steps: Steps) -> None:
    """Without a width the table is as wide as its cells: what every width above must shrink."""
    text = summary_table(suite(steps))
    assert max(map(len, lines_of(text))) > 200


@pytest.mark.parametrize("width", WIDTHS)
def test_a_wide_terminal_gets_one_row_per_figure_with_its_test_id(steps: Steps, width: int) -> None:
    text = summary_table(suite(steps), width=width)
    table = lines_of(text)[: lines_of(text).index("")]
    rows = [line for line in table if re.search(r"\b(peak|allocated|reserved|retained)\b", line)]
    exceeded = next(line for line in table if "exceeded" in line)
    name = "test_train_step[bf16-seq2048-batch16-grad_accumulation4-activation_checkpointing]"
    if width >= 200:  # everything in one row: the test id whole, on every row
        assert exceeded.startswith("test_transformer_memory.py::TestLlamaBlock::" + name)
        assert all(line.startswith("test_") for line in rows) and len(rows) == 13
    else:  # the test id on a line of its own, its rows under it
        title = [line for line in table[: table.index(exceeded)] if not line.startswith(" ")][-1]
        assert title == elide_id("test_transformer_memory.py::TestLlamaBlock::" + name, width)
        assert exceeded.startswith("  call")


def test_a_narrow_terminal_leaves_out_baseline_and_percent_before_the_table_goes(steps: Steps) -> None:
    records = suite(steps)[1:3]  # limits and baselines, short statuses
    wide = summary_table(records, width=120)
    assert re.match(r"  span +metric +measured +cost +limit +baseline +Δ +Δ% +status$", wide.splitlines()[0])
    assert "left out" not in wide
    narrow = summary_table(records, width=80)
    assert_fits(narrow, 80)
    assert re.match(r"  span +metric +measured +cost +limit +Δ +status$", narrow.splitlines()[0])
    assert "(left out to fit 80 columns: baseline, Δ%)" in narrow
    assert re.search(r"^  step +peak +[0-9.]+ KiB +[0-9.]+ KiB +\+[0-9.]+ KiB +regressed$", narrow, re.MULTILINE)
    assert "Δ = cost − baseline" in narrow
    assert "baseline 9.12 KiB" not in narrow and "9.12 KiB" in markdown_report(records)
    # narrower still: one space between columns, then one record per block
    rule = narrow.splitlines()[1]
    assert re.fullmatch(r"  -+(  -+)+", rule)
    tight = summary_table(records, width=len(rule) - 1)
    assert_fits(tight, len(rule) - 1)
    assert re.fullmatch(r"  -+( -+)+", tight.splitlines()[1]) and len(tight.splitlines()[1]) == len(rule) - 6
    tightest = len(tight.splitlines()[1])
    assert "---" in summary_table(records, width=tightest)
    assert "---" not in summary_table(records, width=tightest - 1)


def test_a_test_id_wider_than_the_terminal_is_elided_in_the_middle_keeping_the_name(steps: Steps) -> None:
    nested = ADAMW_ID.replace("tests/", "tests/" + "deeply/nested/" * 4)
    records = [Record(nested, r.measurements, r.findings) for r in suite(steps)[1:2]]
    assert len(nested) > 80
    for verbosity, shown in ((0, short_id(nested)), (1, nested)):
        text = summary_table(records, width=80, verbosity=verbosity)
        assert_fits(text, 80)
        titles = [line for line in lines_of(text) if "::" in line]
        assert titles == [elide_id(shown, 80)] * (1 if verbosity == 0 else 3)  # -v: breakdown and phases too
    title = elide_id(nested, 80)
    assert title.startswith("tests/deeply/") and "…" in title and title.endswith("::test_adamw_step")


LLAMA = "tests/models/test_llama.py::TestLlama::test_step[fp32]"


@pytest.mark.parametrize(
    ("nodeid", "width", "expected"),
    [
        (LLAMA, 60, LLAMA),
        (LLAMA, 40, "tests/model…::TestLlama::test_step[fp32]"),
        (LLAMA, 30, "tests/…tLlama::test_step[fp32]"),
        (LLAMA, 18, "…::test_step[fp32]"),
        (LLAMA, 17, "…test_step[fp32]"),
        (LLAMA, 15, "test_step[fp32]"),
        (LLAMA, 12, "test_s…fp32]"),
        (LLAMA, 1, "…"),
        ("a.py::test[x::y/z]", 14, "…test[x::y/z]"),  # "::" in a parametrize id is not the name's
        ("no_colons", 5, "no…ns"),
    ],
)
def test_elide_id_keeps_the_name_and_parametrize_id(nodeid: str, width: int, expected: str) -> None:
    assert elide_id(nodeid, width) == expected


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(min_value=1, max_value=160),
    name=st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")), min_size=1, max_size=90),
    verbosity=st.integers(min_value=-1, max_value=2),
)
def test_any_width_degrades_gracefully(steps: Steps, width: int, name: str, verbosity: int) -> None:
    """Down to one column: no crash, every line fits, every test named (elided as needed)."""
    records = suite(steps)
    records[0] = replace(records[0], nodeid=f"tests/test_x.py::test_{name}", errors=[f"boom: {name} " * 3])
    text = summary_table(records, width=width, verbosity=verbosity)
    assert_fits(text, width)
    assert text.count("exceeded") >= 1 or width < len("exceeded")
    assert_fits(measurement_table(records[0].measurements, width=width), width)


def test_a_tiny_width_shows_one_record_per_block(steps: Steps) -> None:
    text = summary_table(suite(steps), width=40)
    assert_fits(text, 40)
    assert "---" not in text  # no table at all
    block = lines_of(text)[lines_of(text).index("test_steps.py::test_adamw_step") + 1 :]
    step = steps.step  # measured is absolute: what else the process holds moves it, so it is read, not pinned
    assert block[:4] == [
        "  step peak: regressed;",
        f"      measured {format_size(step.peak)},",
        "      cost 18.25 KiB, baseline 9.12 KiB,",
        "      Δ +9.12 KiB (+100.0%)",
    ]


# --------------------------------------------------------------------------- columns


def test_columns_mean_one_thing_cost_is_figure_minus_start(steps: Steps) -> None:
    rows = summary_rows(suite(steps))
    assert all(len(row) == len(SUMMARY_HEADERS) for row in rows)
    header = {name: i for i, name in enumerate(SUMMARY_HEADERS)}
    step = steps.step
    by_key = {(row[0], row[1], row[2]): row for row in rows}
    peak = by_key[("test_steps.py::test_adamw_step", "step", "peak")]
    assert peak[header["measured"]] == format_size(step.peak)
    assert peak[header["cost"]] == format_size(step.peak - step.start)
    assert peak[header["baseline"]] == format_size(cost(step, "peak") // 2)
    assert peak[header["status"]] == "regressed"
    # allocated is a net change: signed
    allocated = by_key[("test_steps.py::test_adamw_step", "call", "allocated")]
    assert allocated[header["cost"]] == "+" + format_size(steps.call.cost("allocated"))


def test_a_negative_cost_reads_as_freed_everywhere(steps: Steps) -> None:
    backward = steps.backward
    freed = backward.cost("allocated")
    assert freed is not None and freed < 0  # the backward freed the activations saved for it
    records = suite(steps)
    expected = format_size(freed)  # "-10.00 KiB"
    legend = "a negative allocated or retained cost: the span freed more than it allocated"
    for text in (
        summary_table(records, width=100),
        measurement_table(records[2].measurements, width=80),
        markdown_report(records),
    ):
        assert expected in text and expected.startswith("-")
        assert legend in text
    # and only where a negative cost is shown
    assert legend not in summary_table(records[:2], width=100)


def test_a_cost_that_frees_less_than_its_baseline_grew(steps: Steps) -> None:
    """Δ% is relative to the baseline's size: -10 KiB against a baseline of -20 KiB is +50%, not -50%."""
    backward = steps.backward
    record = Record(BACKWARD_ID, [backward], baseline_findings(BACKWARD_ID, backward, 2.0))
    (row,) = [row for row in summary_rows([record]) if row[2] == "allocated"]
    freed = cost(backward, "allocated")
    assert row[4] == format_size(freed) and row[6:9] == [format_size(2 * freed), "+" + format_size(-freed), "+50.0%"]


def test_limits_are_compared_with_the_cost_next_to_it(steps: Steps) -> None:
    call = steps.call
    assert call.start > 0  # the model was alive before: figure and cost differ
    limit = Limit("peak", cost(call, "peak") - 1, "1KiB")
    record = Record("t.py::test_x", [call], limit_findings("t.py::test_x", call, limit))
    text = summary_table([record], width=120)
    row = next(line for line in lines_of(text) if "exceeded" in line)
    assert re.search(rf"{re.escape(format_size(call.cost('peak')))}\s+{re.escape(format_size(limit.value))}", row)
    assert "cost = measured − the span's start: what limits and baselines compare" in text


def test_budget_expressions_become_numbered_notes(steps: Steps) -> None:
    records = suite(steps)
    text = summary_table(records, width=120)
    row = next(line for line in lines_of(text) if "exceeded" in line)
    assert re.search(r"\[1\]\s+exceeded", row)
    note = text[text.index("\n[1] ") + 1 :]
    finding = records[0].findings[0]
    assert note.startswith(f"[1] peak budget {BUDGET[:40]}")
    assert f"×{finding.ratio:.3f} used" in " ".join(note.split())
    assert BUDGET not in row


# --------------------------------------------------------------------------- statuses


def test_other_environments_named_once_each(steps: Steps) -> None:
    records = suite(steps)
    (other,) = [r for r in records if r.nodeid.endswith("test_on_another_machine")]
    assert other.findings[0].detail.startswith("baselines only for: ")  # the detail carries the prefix
    text = summary_table(records, width=80)
    assert text.count("baselines only for:") == 1 and "for: baselines only for" not in text
    # each environment key whole on its lines: parts of a key break only at " | "
    assert CPU_KEY in text
    assert "cuda | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch 2.13 |" in text
    (note,) = environment_notes(records)
    assert note == (
        "test_steps.py::test_on_another_machine: no baseline in this environment; "
        f"baselines only for: {CUDA_KEY}; {CPU_KEY}"
    )
    assert "for: baselines only for" not in markdown_report(records)


@pytest.mark.parametrize("width", WIDTHS)
def test_environment_keys_head_the_summary_within_the_width(steps: Steps, width: int) -> None:
    one = summary_table(suite(steps), width=width, environments=[CUDA_KEY])
    assert_fits(one, width)
    table = summary_table(suite(steps), width=width)
    assert one.endswith("\n" + table)
    head = one[: -len(table) - 1]
    assert " ".join(head.split()) == f"environment: {CUDA_KEY}"
    assert all(line.endswith((" |", "allocator")) for line in head.splitlines())  # broken between parts only
    two = summary_table(suite(steps), width=width, environments=[CUDA_KEY, CPU_KEY])
    assert_fits(two, width)
    assert two.startswith("environments:\n  cuda | NVIDIA H100 80GB HBM3 |") and f"\n  {CPU_KEY}\n" in two
    assert summary_table([], width=width, environments=[CPU_KEY]) == f"environment: {CPU_KEY}"


def test_a_figure_nothing_checked_says_so_and_a_zero_retained_waits_for_v(steps: Steps) -> None:
    leaky = Record("t.py::test_leaky", [replace(steps.call, retained=4096)])
    clean = Record("t.py::test_clean", [replace(steps.call, retained=0)])
    default = summary_table([leaky, clean], width=100)
    retained = [line for line in lines_of(default) if "retained" in line and "unchecked" in line]
    assert len(retained) == 1 and "+4.00 KiB" in retained[0]  # the leak shows, the clean zero does not
    assert "unchecked: no limit or baseline compared this figure" in default
    assert all(row[-1] for row in summary_rows([leaky, clean]))  # no row without a status
    verbose = summary_table([leaky, clean], width=100, verbosity=1)
    assert len([line for line in lines_of(verbose) if "retained" in line and "unchecked" in line]) == 2


def test_a_limit_that_cannot_be_checked_says_why(steps: Steps) -> None:
    limits = (Limit("reserved", 2**30, "1GiB"), Limit("retained", 0, "0B (gpumem_leak_check)"))
    call = replace(steps.call, retained=0)
    record = Record("t.py::test_cpu", [call], limit_findings("t.py::test_cpu", call, *limits))
    assert [f.status for f in record.findings] == ["n/a", "ok"]
    text = summary_table([record], width=80)
    assert_fits(text, 80)
    assert re.search(r"^t\.py::test_cpu +call +reserved +n/a +n/a +1\.00 GiB \[1\] +n/a$", text, re.MULTILINE)
    words = " ".join(text.split())  # the notes wrapped at 80
    assert "[1] reserved limit 1.00 GiB cannot be checked: the cpu engine has no caching allocator" in words
    assert "[2] retained limit 0B (gpumem_leak_check)" in words  # where a limit nobody wrote came from


def test_a_count_metric_has_its_own_row(steps: Steps) -> None:
    call = replace(steps.call, max_microbatch=8)
    floor = Limit("max_microbatch", 16, "min_microbatch=16")
    record = Record("t.py::test_fits", [call], check_values("t.py::test_fits", "call", {"max_microbatch": 8}, [floor]))
    (row,) = [row for row in summary_rows([record]) if row[2] == "max_microbatch"]
    assert row[1:] == [
        "call",
        "max_microbatch",
        "8",
        "8",
        "16 (max_microbatch limit min_microbatch=16)",
        "",
        "",
        "",
        "exceeded",
    ]
    assert re.search(r"^call +max_microbatch +8 +8$", measurement_table([call]), re.MULTILINE)


def test_without_a_width_nothing_is_elided(steps: Steps) -> None:
    text = summary_table(suite(steps))
    assert text.splitlines()[0].startswith("test  ")
    assert LONG_ID.replace("tests/integration/models/", "") + "  call" in text
    assert "…" not in text and "left out" not in text


def test_quiet_shows_only_problems_and_errors(steps: Steps) -> None:
    records = suite(steps)
    records.append(Record("t.py::test_broken", errors=["marker: allocated='16Ψ': Ψ is unknown (track the model)"]))
    text = summary_table(records, width=80, verbosity=-1)
    assert "test_on_another_machine" not in text and "new" not in text
    assert "exceeded" in text and "regressed" in text and "error" in text
    assert "Ψ is unknown (track the model)" in text
    assert summary_table(records[3:4], width=80, verbosity=-1) == ""


def test_problems_first(steps: Steps) -> None:
    """Tests with a failing row first; in each test its failing rows first, the rest in span order."""
    rows = summary_rows(list(reversed(suite(steps))))
    assert [row[0] for row in rows[:2]] == ["test_steps.py::test_adamw_step"] * 2
    assert (rows[0][1], rows[0][2], rows[0][-1]) == ("step", "peak", "regressed")
    tests = list(dict.fromkeys(row[0] for row in rows))
    assert tests[:2] == ["test_steps.py::test_adamw_step", LONG_ID.replace("tests/integration/models/", "")]
    failing = [i for i, row in enumerate(rows) if row[-1].startswith(("exceeded", "regressed"))]
    assert failing and all(rows[i][0] in tests[:2] for i in failing)
    adamw = [row for row in rows if row[0] == tests[0]]
    first_passing = next(i for i, row in enumerate(adamw) if row[-1] in ("ok", "new"))
    assert all(row[-1] == "regressed" for row in adamw[:first_passing])
    assert not any(row[-1] == "regressed" for row in adamw[first_passing:])


def test_improved_and_new_say_what_to_do(steps: Steps) -> None:
    improved = Record("t.py::test_better", [steps.step], baseline_findings("t.py::test_better", steps.step, 2.0))
    new = Record("t.py::test_new", [steps.step], baseline_findings("t.py::test_new", steps.step, None))
    text = summary_table([improved, new], width=80)
    assert "improved: update baselines (--gpumem-update-baselines)" in text
    assert "new: no baseline yet (--gpumem-update-baselines records one)" in text


# --------------------------------------------------------------------------- phases, -v


def twice(measurement: Measurement) -> Measurement:
    return replace(measurement, phases={n: replace(p, count=2) for n, p in measurement.phases.items()})


def test_phases_that_ran_twice_are_counted(steps: Steps) -> None:
    call = twice(steps.call)
    record = Record("t.py::test_two_steps", [call, steps.step])
    verbose = summary_table([record], width=100, verbosity=1)
    assert_fits(verbose, 100)
    assert re.search(r"call\s+forward ×2", verbose) and re.search(r"step\s+forward\s", verbose)
    assert "×N: the phase ran N times in the span (e.g. a warm-up step and the measured step)" in verbose
    table = measurement_table([call, steps.step], width=80)
    assert "backward ×2" in table and "optimizer ×2" in table and "×N: the phase ran N times" in table
    assert "×N" not in measurement_table([steps.step], width=80)
    (row,) = breakdown_rows([("t.py::test_two_steps", call)])
    assert f"{format_size(call.phases['forward'].peak)} ×2" in row


def test_verbose_adds_full_ids_breakdown_and_phases(steps: Steps) -> None:
    records = suite(steps)
    default = summary_table(records, width=120)
    verbose = summary_table(records, width=120, verbosity=1)
    assert "tests/test_steps.py::" not in default and "tests/test_steps.py::test_adamw_step" in verbose
    assert "breakdown at peak" not in default and "breakdown at peak" in verbose and "phases" in verbose
    assert re.search(r"parameters\s+gradients\s+optimizer_state", verbose)


def test_phase_count_round_trips_and_defaults_to_one(steps: Steps) -> None:
    call = twice(steps.call)
    data = call.to_dict()
    assert data["phases"]["forward"]["count"] == 2
    assert Measurement.from_dict(json.loads(json.dumps(data))) == call
    del data["phases"]["forward"]["count"]  # written before the field existed
    assert Measurement.from_dict(data).phases["forward"] == replace(call.phases["forward"], count=1)
    assert Phase("forward", 1, 2, 1).count == 1
    report = json_report([Record("t.py::test_x", [call])], environments=[])
    assert report["schema"] == 1
    assert report["tests"][0]["measurements"][0]["phases"]["backward"]["count"] == 2  # type: ignore[index]


# --------------------------------------------------------------------------- failure message, Markdown


def test_measurement_table_shows_start_measured_and_cost(steps: Steps) -> None:
    table = measurement_table([steps.call, steps.step])
    assert table.startswith("figures on cpu (cpu engine)")
    step = steps.step
    row = next(line for line in lines_of(table) if line.startswith("step") and " peak " in line)
    assert row.split() == [
        "step",
        "peak",
        *format_size(step.start).split(),
        *format_size(step.peak).split(),
        *format_size(step.peak - step.start).split(),
    ]
    assert "not known on this engine: reserved" in table
    assert re.search(r"parameters\s+gradients\s+optimizer_state", table)


def test_markdown_is_the_same_table_unlimited(steps: Steps) -> None:
    records = suite(steps)
    markdown = markdown_report(records, header=CPU_KEY)
    assert "| " + " | ".join(SUMMARY_HEADERS) + " |" in markdown
    body = [line for line in lines_of(markdown) if line.startswith("| tests/")]
    assert len(body) == len(summary_rows(records))
    assert any(line.startswith(f"| {LONG_ID} | call | peak |") for line in body)  # full ids, never elided
    assert "- [1] peak budget " + BUDGET in markdown
    assert f"- [2] no baseline in this environment; baselines only for: {CUDA_KEY}; {CPU_KEY}" in markdown
    assert "\xa0" not in markdown
    assert "\\|" not in markdown  # nothing to escape: the keys' "|" are in a note, not in the table


def test_widths_of_sizes_align_right(steps: Steps) -> None:
    text = summary_table(suite(steps)[1:2], width=120)
    header, _, *rows = lines_of(text)[: lines_of(text).index("")]
    end = header.index("cost") + len("cost")
    assert all(row[end - 1] != " " for row in rows if row[end - 5 : end].strip())


def test_a_measured_figure_above_a_limit_that_passes_says_the_limit_bounds_the_cost(
    pytester: pytest.Pytester,
) -> None:
    """A prediction's figures include the library workspaces kept on the device (65 MiB on an
    H100): a user read ``peak 89.77 MiB … limit 64.00 MiB`` as a breach. The row says which
    figure the limit compared."""
    pytester.makepyfile(
        test_predicted="""
import pytest, torch

@pytest.mark.gpumem(peak="64MiB", predict="h100")
def test_step(gpumem):
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters())
    gpumem.train_step(model, opt, (torch.ones(64, 1024), torch.ones(64, 1024)), torch.nn.functional.mse_loss)
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1)
    text = " ".join(result.stdout.str().split())
    assert "peak 89.77 MiB 24.77 MiB 64.00 MiB [1]" in text
    assert (
        "[1] the peak limit 64.00 MiB bounds the cost, 24.77 MiB; the measured 89.77 MiB includes "
        "the 65.00 MiB there at the span's start"
    ) in text
