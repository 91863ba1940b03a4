"""``benchmarks/bench_overhead.py`` as a command: it fails clearly where it cannot measure, and its
JSON holds what ran, within ``--max-seconds``. No figure is asserted here: speed is measured by
the benchmark itself, never by a test. The runs that check the JSON call the script's ``main`` in
this process (the pytest sessions it times are new interpreters, as a user's are); the option
errors run it as a new interpreter, as a user types it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "bench_overhead.py"
sys.path.insert(0, str(BENCHMARKS))

import bench_overhead  # noqa: E402


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _bench_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``bench_overhead.py *args`` through its ``main`` in this process: its exit status and output."""
    capsys.readouterr()
    try:
        bench_overhead.main(list(args))
        code = 0
    except SystemExit as stop:
        assert isinstance(stop.code, int), stop.code
        code = stop.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["bench_overhead.py", *args], code, out, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = _bench_here(capsys, "--cuda", "--tests", "4", "--json", str(tmp_path / "never.json"))
    assert done.returncode == 2
    assert "--cuda: no CUDA device is available" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "never.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variants", "off", "fast"], "unknown variant(s) fast"),
        (["--tests", "0"], "--tests and --repeat must be at least 1"),
        (["--max-seconds", "-3"], "--max-seconds must be positive (got -3.0)"),
        (["--suite", "encoder", "--cuda"], "--cuda writes its own suite"),
    ],
)
def test_bad_options_are_clear_errors(args: list[str], message: str) -> None:
    done = _bench(*args)
    assert done.returncode != 0 and message in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_json_holds_every_round_and_max_seconds_stops_starting_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = tmp_path / "full.json"  # no untimed sessions (the second run below has its one)
    done = _bench_here(
        capsys, "--tests", "2", "--repeat", "2", "--variants", "off", "on", "--no-untimed", "--json", str(full)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(full.read_text())
    assert result["suite"] == "tiny" and result["tests"] == 2 and result["rounds"] == 2
    assert not result["stopped_by_max_seconds"] and result["untimed"] == []
    assert [v["name"] for v in result["variants"]] == ["off", "on"]
    for variant in result["variants"]:
        assert len(variant["wall_s"]) == len(variant["cpu_s"]) == 2
        assert variant["median_cpu_s"] > 0
    assert set(result["ratios"]["on/off"]) == {"wall", "cpu"}
    assert {"python", "torch", "cpus"} <= set(result["machine"])

    # one variant of the suite that runs nothing (no torch): its untimed session alone takes over the 0.2 s
    short = tmp_path / "short.json"
    args = ["--suite", "noop", "--tests", "2", "--repeat", "5", "--variants", "off", "--max-seconds", "0.2"]
    done = _bench_here(capsys, *args, "--json", str(short))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(short.read_text())
    assert result["suite"] == "noop" and result["tests"] == 2
    assert result["rounds"] == 0 and result["stopped_by_max_seconds"] and result["ratios"] == {}
    assert result["untimed"] == ["off"]
    assert "no round fits in --max-seconds 0.2" in done.stdout
