"""``benchmarks/bench_opheavy.py`` and ``benchmarks/probe_cuda.py`` as commands: the suites they write
are the ones they describe, bad options are clear errors. No figure is asserted here: speed is
measured by the benchmarks themselves, never by a test. The probe's refusal without a GPU calls its
``main`` in this process, which has imported torch already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._warm_sessions import run_session

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_opheavy  # noqa: E402
import probe_cuda  # noqa: E402


def _run(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.parametrize("suite", ["optim", "small"])
def test_each_suite_has_sixty_marked_tests(tmp_path: Path, suite: str) -> None:
    """The written suite collects its 60 tests, each marked (the zoo: 10 optimizers, 2 dtypes, 3 settings)."""
    assert bench_opheavy.write_suite(tmp_path, suite) == 60
    # python -m pytest, in a process forked from one that has imported torch (tests/_warm_sessions.py)
    args = ["--collect-only", "-q", "-p", "no:gpumem", "-p", "no:randomly", "-m", "gpumem"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    code = run_session(args, cwd=tmp_path, env=dict(os.environ), stdout=out, stderr=err)
    stdout = out.read_text(encoding="utf-8")
    assert code == 0, stdout + err.read_text(encoding="utf-8")
    assert "60 tests collected" in stdout
    if suite == "optim":
        names = {line.split("[")[1].split("-")[0] for line in stdout.splitlines() if "::test_optimizer[" in line}
        assert names == set(bench_opheavy.NAMES)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeat", "0"], "--repeat must be at least 1 (got 0)"),
        (["--variants", "off", "fast"], "unknown variant(s) fast"),
        (["--other", "/nonexistent/checkout"], "--other /nonexistent/checkout: no pytest_gpumem package there"),
    ],
)
def test_bad_options_of_the_benchmark_are_clear_errors(args: list[str], message: str) -> None:
    done = _run("bench_opheavy.py", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "nothing to probe: give --alone, --ablate or both"),
        (["--ablate", "--tests", "0"], "must be at least 1 (got 50, 1, 0)"),
        (["--ablate", "--suite", "/nonexistent"], "--suite /nonexistent: no suite there"),
    ],
)
def test_bad_options_of_the_probe_are_clear_errors(args: list[str], message: str) -> None:
    done = _run("probe_cuda.py", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")
def test_the_probe_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "probes: alone ablations over 20 tests" in _run("probe_cuda.py", "--alone", "--ablate", "--dry-run").stdout
    with pytest.raises(SystemExit) as stop:
        probe_cuda.main(["--alone"])
    assert stop.value.code == 2 and "no CUDA device is available" in capsys.readouterr().err
