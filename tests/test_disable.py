"""The off switch: ``--gpumem-disable`` (ini ``gpumem_disable``, ``PYTEST_GPUMEM_DISABLE=1``)
runs every test, the ``gpumem`` fixture included, with nothing measured, judged or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run

pytest_plugins = ["pytester"]

SUITE = """
import pytest, torch

@pytest.mark.gpumem(peak="1KiB", allocated="1B", device_limit="1MiB")
def test_a_step_over_every_limit(gpumem):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    batch = (torch.ones(8, 64), torch.ones(8, 64))
    gpumem.train_step(model, opt, batch, torch.nn.functional.mse_loss)
    with gpumem.measure("big", peak="1B"):
        kept = torch.ones(1024, 1024)  # 4 MiB: over the emulated 1 MiB device too
    assert gpumem.device == torch.device("cpu")
    assert gpumem.psi == 64 * 64 + 64  # theory still works
    assert gpumem.budget("fp32", optimizer="adamw").items["parameters"] == 4 * gpumem.psi
    assert [span.name for span in gpumem.spans] == ["step", "big"]  # opened, unmeasured

def test_uses_the_fixture_unmarked(gpumem):
    gpumem.track(torch.nn.Linear(2, 2))
    assert gpumem.psi == 6
"""


@pytest.mark.slow
def test_every_test_runs_with_nothing_measured_judged_or_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_off=SUITE)
    baselines = pytester.path / "gpumem-baselines.json"
    baselines.write_text("{ not json")  # not even read
    result = run(pytester, "--gpumem-disable", f"--gpumem-json={pytester.path / 'report.json'}", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    text = result.stdout.str()
    assert "gpumem: disabled (--gpumem-disable): nothing is measured, judged or written" in text
    assert "= gpumem =" not in text  # no summary
    assert not (pytester.path / "report.json").exists()
    assert baselines.read_text() == "{ not json"
    # the same suite with the plugin on fails on every limit
    on = run(pytester, "-p", "no:randomly", f"--gpumem-baselines={pytester.path / 'other.json'}")
    on.assert_outcomes(failed=1, passed=1)


@pytest.mark.parametrize("how", ["env", "ini"])
def test_the_environment_variable_and_the_ini_setting_disable_it_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    pytester.makepyfile(test_off=SUITE)
    if how == "env":
        monkeypatch.setenv("PYTEST_GPUMEM_DISABLE", "1")
    else:
        pytester.makeini("[pytest]\ngpumem_disable = true\n")
    result = run(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert "gpumem: disabled" in result.stdout.str()


def test_a_figure_read_while_disabled_skips_the_test_and_says_why(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_reads="""
import pytest, torch

def test_reads_a_span(gpumem):
    with gpumem.measure("x") as span:
        torch.ones(10)
    assert span.peak < 1024

def test_reads_a_step(gpumem):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = gpumem.train_step(model, opt, torch.ones(2, 4), lambda out: out.sum())
    step.cost("peak")

def test_searches_a_microbatch(gpumem):
    gpumem.max_microbatch(lambda n: torch.ones(n), upper=8)
"""
    )
    result = run(pytester, "--gpumem-disable", "-p", "no:randomly", "-rs")
    result.assert_outcomes(skipped=3)  # the off switch never fails a test that passes with the plugin on
    result.stdout.fnmatch_lines(
        [
            "*gpumem.measure('x').peak: nothing is measured while pytest-gpumem is disabled*",
            "*gpumem.train_step(name='step').cost: nothing is measured*",
        ]
    )
    assert "SKIPPED [1] test_reads.py:6: gpumem.measure" in result.stdout.str()  # the line that read the figure
    skipped = run(pytester, "--gpumem-disable", "-p", "no:randomly", "-rs", "-k", "microbatch")
    skipped.stdout.fnmatch_lines(["*gpumem.max_microbatch() searches by measuring: skipped while*disabled*"])


def test_a_bad_marker_is_still_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad="import pytest\n@pytest.mark.gpumem(peak='4XB')\ndef test_x():\n    pass\n")
    result = run(pytester, "--gpumem-disable")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*invalid gpumem marker on test_bad.py::test_x: peak='4XB'*"])


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            None,
            ("--gpumem-disable", "--gpumem-update-baselines"),
            "--gpumem-update-baselines cannot run with --gpumem-disable (or PYTEST_GPUMEM_DISABLE): "
            "nothing is measured, so nothing could be recorded",
        ),
        ("maybe", (), "PYTEST_GPUMEM_DISABLE='maybe': expected 1, true, yes or on (or 0, false, no, off)"),
    ],
)
def test_contradictions_and_bad_values_are_usage_errors(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: str | None, args: tuple[str, ...], message: str
) -> None:
    if env is not None:
        monkeypatch.setenv("PYTEST_GPUMEM_DISABLE", env)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_a_report_path_is_not_checked_while_disabled(pytester: pytest.Pytester) -> None:
    pytester.mkdir("out")
    pytester.makepyfile(test_one="def test_one(gpumem):\n    pass\n")
    run(pytester, "--gpumem-disable", f"--gpumem-json={pytester.path / 'out'}").assert_outcomes(passed=1)
    assert list((pytester.path / "out").iterdir()) == []  # nothing written


def test_the_quick_start_passes_or_skips_while_disabled(pytester: pytest.Pytester) -> None:
    """The README's quick start under ``--gpumem-disable``: the step runs, reading its phases skips."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    quick_start = readme.split("<!-- quickstart: test_memory.py -->\n```python\n", 1)[1].split("```", 1)[0]
    pytester.makepyfile(test_memory=quick_start)
    result = run(pytester, "--gpumem-disable", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*gpumem.train_step(name='step').phases: nothing is measured*"])


@pytest.mark.slow
def test_distributed_runs_its_ranks_unmeasured_while_disabled(pytester: pytest.Pytester) -> None:
    """``gpumem.distributed`` runs the real ranks (``ranks=`` is not checked: real ranks all run)
    and returns a stand-in per rank; a prediction, which measures, skips the test."""
    pytester.makepyfile(
        test_ranks="""
import torch

def step(rank, ctx):
    torch.ones(4)

def test_runs_the_ranks(gpumem):
    figures = gpumem.distributed(step, world_size=2, ranks=[0])
    assert [repr(m) for m in figures] == [
        f"<gpumem.distributed(...)[{rank}]: not measured (pytest-gpumem is disabled)>" for rank in (0, 1)
    ]
    assert gpumem.spans == []
    figures[1].peak

def test_predicts(gpumem):
    gpumem.distributed(step, world_size=2, predict="h100")
"""
    )
    result = run(pytester, "--gpumem-disable", "-p", "no:randomly", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED ?1? test_ranks.py:12: gpumem.distributed(...)?1?.peak: nothing is measured*",
            "SKIPPED ?1? test_ranks.py:15: gpumem.distributed(predict=...) predicts by measuring: skipped*disabled",
        ]
    )
