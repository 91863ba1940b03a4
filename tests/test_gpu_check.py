"""``scripts/gpu-check``: its dry run on a machine without a GPU, its reading of pytest's results, its summary.

The GPU run itself happens on a GPU machine (docs/validation.md); here the script must not rot
between GPUs: every part's command exists and parses, and what it reads and writes is checked
against real pytest sessions.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    try:
        loader.exec_module(module)
    finally:
        del sys.modules["gpu_check"]
    return module


gpu_check = load_script()


def run_script(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False, cwd=cwd
    )


@pytest.mark.slow
def test_dry_run_checks_every_part_and_prints_the_plan() -> None:
    done = run_script("--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = gpu_check.plan(Path("/out"), sys.executable, 8)
    for part in plan:
        assert f"\n{part.name}  ({part.budget:.0f} s;" in done.stdout
    assert done.stdout.count("\n  ok   ") == sum(len(p.commands) for p in plan)
    assert "every command parses" in done.stdout
    assert sum(p.budget for p in plan) <= gpu_check.BUDGET


@pytest.mark.slow
def test_an_option_a_script_does_not_know_fails_the_dry_run() -> None:
    command = gpu_check.Command("bench", [sys.executable, "benchmarks/bench_overhead.py", "--no-such-flag"], "script")
    why = gpu_check.check_command(command, gpu_check.environment())
    assert why is not None and "does not know --no-such-flag" in why


@pytest.mark.slow
def test_a_selection_that_does_not_collect_fails_the_dry_run_and_the_others_still_pass() -> None:
    """The dry run collects every pytest command in one process, one session after another: each
    command is answered for by its own session, whatever the sessions before it did."""
    pytest_ = [sys.executable, "-m", "pytest"]
    commands = [
        gpu_check.Command("x", [*pytest_, "tests/test_no_such_file.py"], "pytest"),
        gpu_check.Command("x", [*pytest_, "tests/test_units.py", "-n", "2", "--junitxml=never.xml"], "pytest"),
        gpu_check.Command("x", [*pytest_, "tests/test_units.py", "--no-such-option"], "pytest"),
        gpu_check.Command("x", [*pytest_, "tests/test_units.py", "-k", "format"], "pytest"),
    ]
    missing, fine, unknown, selected = gpu_check.collection_problems(commands, gpu_check.environment())
    assert missing is not None and missing.startswith("collection failed (exit 4)")
    assert "file or directory not found: tests/test_no_such_file.py" in missing
    assert unknown is not None and "unrecognized arguments: --no-such-option" in unknown
    assert fine is None and selected is None
    assert not (ROOT / "never.xml").exists()


def test_unknown_parts_are_a_usage_error() -> None:
    done = run_script("--dry-run", "--parts", "cuda-tests,nope")
    assert done.returncode == 2
    assert "--parts: unknown part(s) nope; known: cuda-tests, demo, validate" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_run_refuses_and_says_to_dry_run(tmp_path: Path) -> None:
    done = run_script(str(tmp_path / "out"), "--parts", "demo")
    assert done.returncode == 2
    assert "gpu-check: no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "out" / "summary.md").exists()


def test_junit_counts_and_first_lines_of_a_real_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_x="""
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 + 1 == 3, "arithmetic moved"

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        """
    )
    xml = pytester.path / "x.xml"
    pytester.runpytest("-p", "no:gpumem", f"--junitxml={xml}")
    result = gpu_check.junit(xml)
    assert (result["tests"], result["failures"], result["errors"], result["skipped"]) == (3, 1, 0, 1)
    assert result["failed"] == ["test_x::test_bad: AssertionError: arithmetic moved"]
    assert gpu_check.junit(pytester.path / "missing.xml")["tests"] is None


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_stopped_sessions_outcomes_are_read_from_its_verbose_log(
    pytester: pytest.Pytester, tmp_path: Path, workers: list[str]
) -> None:
    """A part stopped at its budget writes no JUnit report: its failures are named from the log
    of ``pytest -v`` (what the session printed before it was stopped, here all of it)."""
    pytester.makepyfile(
        test_y="""
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert False

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:gpumem", "-p", "no:randomly", "-v", *workers)
    log = tmp_path / "part.log"
    log.write_text("test_y.py::test_earlier FAILED\n" + result.stdout.str(), encoding="utf-8")
    start = len("test_y.py::test_earlier FAILED\n")
    read = gpu_check.outcomes_in_log(log, start)
    assert (read["tests"], read["failures"], read["errors"], read["skipped"]) == (3, 1, 0, 1)
    assert read["failed"] == ["test_y.py::test_bad: FAILED (the part was stopped: from its log)"]


def test_summary_names_the_device_the_parts_and_the_failures() -> None:
    """The summary's table, the failures, the validation against the committed record (a change
    of clean-state protocol said as such, the differences past the first 60 counted, none lost)
    and the overhead ratios."""
    differences = [f"zoo.w{i}.cuda peak cost: {i:,} → 0 B (-{i:,} B)" for i in range(65)]
    validation = {
        "record": "validate/nvidia-h200-torch2.11",
        "checks": 61,
        "failed_checks": [],
        "against": "nvidia-h100-80gb-hbm3-torch2.11",
        "differences": differences,
        "same": 85,
        "protocols": [1, 2],
    }
    summary = {
        "device": {
            "device": "NVIDIA H200",
            "total_memory": 150_000_000_000,
            "compute_capability": "9.0",
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "cudnn": 91900,
            "python": "3.12.3",
        },
        "budget": 540.0,
        "seconds": 301.4,
        "parts": [
            gpu_check.Outcome(
                "cuda-tests",
                "failed",
                40.2,
                commands=[
                    {"label": "x", "command": "python -m pytest tests -m cuda", "exit_code": 1, "seconds": 40.2}
                    | {"tests": 17, "failures": 1, "errors": 0, "skipped": 0, "failed": ["t::a: boom"]}
                ],
            ).__dict__,
            gpu_check.Outcome("validate", "passed", 56.0, figures=validation).__dict__,
            gpu_check.Outcome(
                "overhead", "passed", 100.0, figures={"ratios": {"on/off": {"wall": 1.2135074, "cpu": 1.2133950}}}
            ).__dict__,
            gpu_check.Outcome("fast-slice", "skipped", why="the budget was gone (3 s left)").__dict__,
        ],
    }
    text = gpu_check.render(summary)
    assert "NVIDIA H200 (140 GiB, cc 9.0), torch 2.11.0+cu130, CUDA 13.0" in text
    assert "| cuda-tests | failed | 40 | 17 | 1 | 0 |" in text
    assert "| fast-slice | skipped (the budget was gone (3 s left)) | 0 |  |  |  |" in text
    assert "- FAILED t::a: boom" in text
    assert "- against `nvidia-h100-80gb-hbm3-torch2.11`: 85 figures equal, 65 differ" in text
    assert "  - the committed record was made with clean-state protocol 1, this one with 2: costs" in text
    assert f"  - {differences[59]}" in text and differences[60] not in text
    assert "  - … and 5 more (`validate/nvidia-h200-torch2.11/record.json`)" in text
    assert "- on/off: wall ×1.214, cpu ×1.213" in text


@pytest.mark.slow
def test_parts_run_in_order_within_their_budgets_and_the_summary_says_what_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestration on a machine without a GPU: the device facts are the one thing stood in
    for (they come from torch.cuda); the commands are real processes with real deadlines. The
    second part may take longer than the whole run: it is stopped at the run's deadline, and the
    third is skipped."""
    python = sys.executable
    parts = [
        gpu_check.Part("passes", 60, "a quick command", [gpu_check.Command("ok", [python, "-c", "pass"], "script")]),
        gpu_check.Part(
            "sleeps",
            600,
            "past the run's budget",
            [gpu_check.Command("sleep", [python, "-c", "import time; time.sleep(600)"], "script")],
        ),
        gpu_check.Part("late", 60, "after the budget", [gpu_check.Command("never", [python, "-c", "pass"], "script")]),
    ]
    facts = {"cuda_available": True, "device": "stand-in", "total_memory": 2**30, "compute_capability": "0.0"}
    facts |= {"torch": torch.__version__, "cuda": None, "cudnn": None, "python": "3"}
    monkeypatch.setattr(gpu_check, "device_facts", lambda env: dict(facts))
    monkeypatch.setattr(gpu_check, "MIN_PART", 1.0)
    code = gpu_check.run(parts, tmp_path, budget=7)
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    statuses = [(p["name"], p["status"]) for p in summary["parts"]]
    assert code == 1
    assert statuses == [("passes", "passed"), ("sleeps", "timed out"), ("late", "skipped")]
    assert summary["parts"][2]["why"].startswith("the budget was gone (")
    assert "[gpu-check] stopped after" in (tmp_path / "sleeps.log").read_text(encoding="utf-8")
    text = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| passes | passed |" in text and "| sleeps | timed out |" in text and "| late | skipped (the budget" in text


def test_validation_records_the_suite_as_skipped_when_the_cuda_tests_did_not_run(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "--suite-from", str(tmp_path / "none.xml")]
    argv += ["--suite-log", str(tmp_path / "none.log"), "--trace", "mlp"]
    result = gpu_check.run_command(
        gpu_check.Command("v", argv, "script"), gpu_check.environment(), 60, tmp_path / "v.log"
    )
    assert result["exit_code"] == 0
    assert "['--skip-suite', '--trace', 'mlp']" in (tmp_path / "v.log").read_text(encoding="utf-8")


def test_a_script_that_refuses_its_options_together_fails_the_dry_run() -> None:
    """Each option exists, but the script refuses them together: its own --dry-run says so."""
    argv = [sys.executable, "benchmarks/bench_overhead.py", "--cuda", "--suite", "encoder"]
    why = gpu_check.check_command(gpu_check.Command("bench", argv, "script"), gpu_check.environment())
    assert why is not None and "--dry-run refused" in why and "leave --suite out" in why


def test_profile_session_prints_where_a_session_spends_its_time(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_p="def test_p():\n    assert sum(range(10)) == 45\n")
    out = pytester.path / "p.prof"
    argv = [str(ROOT / "benchmarks" / "profile_session.py"), str(pytester.path), "--top", "5", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, *argv, "--", "-p", "no:gpumem"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "=== by tottime ===" in done.stdout and "=== by cumulative ===" in done.stdout
    assert out.stat().st_size > 0


def test_the_overhead_is_split_into_one_time_and_per_test_cost(tmp_path: Path) -> None:
    """The 1-test and the 40-test sessions' added CPU (on − off medians) give a test's part (their
    difference over 39) and the session's one-time part; the summary prints both."""

    def bench(tests: int, off: float, on: float) -> dict[str, object]:
        variants = [{"name": "off", "median_cpu_s": off}, {"name": "on", "median_cpu_s": on}]
        ratios = {"on/off": {"wall": on / off, "cpu": on / off}}
        return {"tests": tests, "rounds": 3, "ratios": ratios, "variants": variants}

    (tmp_path / "overhead.json").write_text(json.dumps(bench(40, 7.0, 8.2)))
    (tmp_path / "overhead-1.json").write_text(json.dumps(bench(1, 3.0, 3.42)))
    figures = gpu_check.read_overhead(tmp_path)
    split = figures["split"]
    assert split["tests"] == 40
    assert split["per_test_cpu_ms"] == pytest.approx((1.2 - 0.42) / 39 * 1000)
    assert split["one_time_cpu_s"] == pytest.approx(0.42 - (1.2 - 0.42) / 39)
    device = {"device": "GPU", "total_memory": 0, "compute_capability": "9.0", "torch": "2", "cuda": "13"}
    part = {"name": "overhead", "status": "passed", "why": "", "seconds": 90.0, "commands": [], "figures": figures}
    summary = {"device": {**device, "cudnn": 1, "python": "3.12"}, "seconds": 90.0, "budget": 540.0, "parts": [part]}
    assert "+20.0 ms a test, +0.40 s once a session" in gpu_check.render(summary)
    (tmp_path / "overhead-1.json").unlink()
    assert "split" not in gpu_check.read_overhead(tmp_path)
