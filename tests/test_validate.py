"""``python -m pytest_gpumem validate`` on the CPU: its CPU half, its record, and the reference workloads' CPU figures.

The GPU half needs a CUDA device and runs on a GPU machine (see ``docs``: "Validating on a
GPU"); here the script runs with ``--cpu-only`` on the tiny zoo, and the reference workloads
run on the CPU engine with CUDA rounding, where their figures are known to the byte.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpumem import measure
from pytest_gpumem.baselines import Environment
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.units import format_size
from pytest_gpumem.validate.against import differences, load_record
from pytest_gpumem.validate.compare import explain_gap, gap_parts, zoo_figures
from pytest_gpumem.validate.main import main
from pytest_gpumem.validate.reference import reference_adam, reference_determinism, reference_linear, reference_mlp
from pytest_gpumem.validate.render import zoo_table_rows
from pytest_gpumem.validate.results import (
    MLP_REFERENCE,
    RECORD_FILE,
    SCHEMA,
    STATS_FILE,
    SUMMARY_FILE,
    Check,
    Run,
    suite_check,
)
from pytest_gpumem.validate.suite_record import plugin_installed, record_name, run_suite, suite_environment, suite_from
from pytest_gpumem.validate.zoo import PRECISIONS, zoo

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "fixtures" / "recorded" / "nvidia-h100-80gb-hbm3-torch2.11"
CPU = torch.device("cpu")
MiB = 2**20


def record_of(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    return data


@pytest.mark.slow
def test_cpu_only_run_passes_and_writes_a_small_record(cpu_only_run: tuple[Any, Path]) -> None:
    done, folder = cpu_only_run
    assert done.returncode == 0, done.stdout + done.stderr
    major, minor = torch.__version__.split(".")[:2]
    assert folder.name == f"cpu-only-torch{major}.{minor}"
    names = sorted(path.name for path in folder.iterdir())
    # what the device tool brings back: at most 8 files of 16 MiB; a CPU-only record has no GPU files
    assert names == sorted([RECORD_FILE, SUMMARY_FILE, STATS_FILE])
    assert all((folder / name).stat().st_size < MiB for name in names)
    assert "allocated CPU" in done.stdout and "gap GPU − CPU explained" in done.stdout
    assert "n/a (no GPU run)" in done.stdout
    assert "FAILED" not in done.stdout


@pytest.mark.slow
def test_cpu_only_record_structure(cpu_only_run: tuple[Any, Path]) -> None:
    _, folder = cpu_only_run
    record = record_of(folder)
    assert record["schema"] == SCHEMA
    assert record["mode"] == "cpu-only"
    assert record["environment"] is None and record["environment_key"] is None
    assert record["cpu_environment_key"] == Environment.detect("cpu", cuda_rounding=True).key
    assert record["suite"] is None and record["snapshot"] is None
    assert record["figures"]["cublas_workspace"] == 0  # the CPU engine counts tensors: no workspace
    assert json.loads((folder / STATS_FILE).read_text()) == {"workloads": {}, "snapshot": None}

    checks = [Check.from_dict(c) for c in record["checks"]]
    assert [c for c in checks if c.passed is False] == []
    groups = {c.group for c in checks}
    assert {"reference", "determinism", "replay"} <= groups
    assert "counters" not in groups  # PyTorch's CUDA counters exist only on a GPU

    rows = {(row["model"], row["precision"]): row for row in record["zoo"]}
    assert list(rows) == [(m.name, p) for m in zoo("tiny") for p in PRECISIONS]
    for model in zoo("tiny"):
        for precision in PRECISIONS:
            row = rows[model.name, precision]
            if not model.available:
                assert row["skipped"] == f"{model.needs} is not installed" and row["cpu"] is None
                continue
            assert row["cpu"] == f"zoo.{model.name}.{precision}.cpu"
            assert row["gpu"] is None and row["gpu_tensors"] is None
            assert row["figures"]["gpu"] is None and row["ratio"] == {"allocated": None, "peak": None}
            cpu = record["workloads"][row["cpu"]]["measurement"]
            assert row["figures"]["cpu"] == {"allocated": cpu["allocated"], "peak": cpu["peak"], "reserved": None}
            assert cpu["engine"] == "cpu" and cpu["cuda_rounding"] is True and cpu["psi"] == row["psi"]
    summary = (folder / SUMMARY_FILE).read_text(encoding="utf-8")
    assert re.search(r"^\| mlp +\| fp32 +\|", summary, re.M) and "n/a (no GPU run)" in summary


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["mlp", "block"])
def test_cpu_figures_equal_what_measure_reports(cpu_only_run: tuple[Any, Path], name: str, precision: str) -> None:
    """The record's CPU figures are ``measure(device="cpu", cuda_rounding=True)``'s for the same step."""
    _, folder = cpu_only_run
    recorded = record_of(folder)["workloads"][f"zoo.{name}.{precision}.cpu"]["measurement"]
    (model,) = zoo("tiny", (name,))
    step = model.build(CPU, precision)
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp)  # warm-up: AdamW's state
    with measure(recorded["name"], device="cpu", cuda_rounding=True, track=(step.model, step.optimizer)) as span:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp)
    assert span.measurement.to_dict() == recorded
    assert span.allocated % 512 == 0 and span.peak % 512 == 0


# --------------------------------------------------------------------------- reference workloads on CPU


@pytest.mark.slow
def test_linear_reference_on_cpu() -> None:
    run = Run(CPU, "tiny")
    reference_linear(run)
    assert [c for c in run.checks if not c.passed] == []
    init = run.outcomes["reference.linear-init"].measurement
    assert init.cost("allocated") == 256_000 + 1_024  # 256·250·4 bytes; 1,000 bias bytes take a 1,024-byte block
    forward = run.outcomes["reference.linear-first-forward"].measurement
    assert forward.cost("allocated") == 64 * 250 * 4  # the output alone: no workspace on the CPU engine
    assert run.figures == {"cublas_workspace": 0, "linear_raw_retained": 0, "linear_retained": 0}


@pytest.mark.slow
def test_adam_reference_on_cpu() -> None:
    """Adam's first step: exp_avg and exp_avg_sq, and the two step counters, which live on the CPU here."""
    run = Run(CPU, "tiny")
    reference_adam(run)
    params = 1024 * 1024 * 4 + 1024 * 4
    for label in ("default", "fused"):
        step = run.outcomes[f"reference.adam-{label}-first-step"].measurement
        assert step.cost("allocated") == 2 * params + 2 * 512, label
    assert [c for c in run.checks if not c.passed] == []


@pytest.mark.slow
def test_mlp_reference_on_cpu() -> None:
    """bf16 MLP: 18·b·s·d bytes saved with GELU, 10·b·s·d with ReLU, by both accountings."""
    run = Run(CPU, "tiny")
    reference_mlp(run)
    b, s, d = MLP_REFERENCE["tiny"]
    assert run.outcomes["reference.mlp-gelu-forward"].measurement.saved_activations == 18 * b * s * d
    assert run.outcomes["reference.mlp-relu-forward"].measurement.saved_activations == 10 * b * s * d
    allocator = {c.name: c.measured for c in run.checks if "allocated after forward" in c.name}
    assert sorted(allocator.values()) == [10 * b * s * d, 18 * b * s * d]
    assert [c for c in run.checks if not c.passed] == []


@pytest.mark.slow
def test_determinism_on_cpu() -> None:
    run = Run(CPU, "tiny")
    reference_determinism(run, zoo("tiny", ("mlp",))[0])
    (check,) = run.checks
    assert check.passed, check.detail
    first, second = (run.outcomes[f"determinism.run-{i}"].measurement for i in (1, 2))
    assert first.to_dict() | {"name": ""} == second.to_dict() | {"name": ""}


def test_gap_parts_account_for_every_byte() -> None:
    """The gap split on real figures: the CPU engine without rounding stands for "CPU", with it for the other side.

    Rounding adds bytes to tensors only: nothing is outside tensors, and the categories'
    differences add up to the tensors' part.
    """
    (model,) = zoo("tiny", ("block",))
    plain = measured_step(model, cuda_rounding=False)
    rounded = measured_step(model, cuda_rounding=True)
    for metric in ("allocated", "peak"):
        parts = gap_parts(plain, rounded, rounded, metric)
        assert parts["total"] == getattr(rounded, metric) - getattr(plain, metric) > 0
        assert parts["outside_tensors"] == 0
        assert parts["tensors"] == parts["total"] == sum(parts["by_category"].values())
    text = explain_gap(plain, rounded, rounded)
    assert text.startswith("allocated +") and "outside tensors + " in text and "; peak +" in text
    assert explain_gap(plain, None, None) == "n/a (no GPU run)"

    # the zoo row and its table cells, as a GPU run fills them (here both sides are CPU figures)
    row = {"model": "block", "precision": "fp32", "psi": plain.psi, "cpu": "plain", "gpu": "rounded"}
    row |= {"gpu_tensors": "rounded", "skipped": None}
    row |= zoo_figures(row, {"plain": plain, "rounded": rounded})
    assert row["ratio"]["peak"] == round(rounded.peak / plain.peak, 4) > 1
    assert row["gap"]["allocated"] == gap_parts(plain, rounded, rounded, "allocated")
    (cells,) = zoo_table_rows([row])
    assert cells[:6] == [
        "block",
        "fp32",
        f"{plain.psi:,}",
        *map(format_size, (plain.allocated, rounded.allocated)),
        f"{row['ratio']['allocated']:.3f}",
    ]
    assert cells[-1] == text


def measured_step(model: Any, *, cuda_rounding: bool) -> Any:
    step = model.build(CPU, "fp32")
    run_step(step.model, step.optimizer, step.batch, step.loss_fn)
    with measure("step", device="cpu", cuda_rounding=cuda_rounding, track=(step.model, step.optimizer)) as span:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn)
    return span.measurement


# --------------------------------------------------------------------------- the script's plumbing


@pytest.mark.parametrize(
    ("device", "torch_version", "name"),
    [
        ("NVIDIA H100 80GB HBM3", "2.13.0+cu128", "nvidia-h100-80gb-hbm3-torch2.13"),
        ("NVIDIA H200", "2.11.0+cu130", "nvidia-h200-torch2.11"),
        ("AMD Instinct MI300X (gfx942)", "2.6.0+rocm6.2", "amd-instinct-mi300x-gfx942-torch2.6"),
        (None, "2.13.0+cpu", "cpu-only-torch2.13"),
    ],
)
def test_record_name_is_filesystem_safe(device: str | None, torch_version: str, name: str) -> None:
    assert record_name(device, torch_version) == name


def test_cpu_only_refuses_to_write_recorded_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cpu-only"]) == 2
    assert main(["--cpu-only", "--out", str(ROOT / "fixtures" / "recorded")]) == 2
    assert "only a GPU run" in capsys.readouterr().err
    assert main(["--cpu-only", "--out", str(tmp_path), "--models", "mlp,resnet"]) == 2
    assert "unknown zoo model(s) 'resnet'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_mode_without_a_gpu_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_suite_environment_loads_the_plugin_from_the_checkout() -> None:
    """The checkout first on an absolute PYTHONPATH; the plugin through PYTEST_PLUGINS unless installed."""
    env = suite_environment({"PYTHONPATH": "elsewhere", "PYTEST_PLUGINS": "other"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "elsewhere"]
    plugins = "other" if plugin_installed() else "other,pytest_gpumem.plugin"
    assert env["PYTEST_PLUGINS"] == plugins


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script's own run is the test")
def test_suite_without_a_gpu_skips_everything_and_fails_the_check() -> None:
    """The CUDA suite as the script runs it: here every test skips, which a GPU run must not accept."""
    summary, output = run_suite([], timeout=240)
    assert summary["exit_code"] == 0, output
    assert summary["tests"] == summary["skipped"] > 0, output
    assert summary["failures"] == summary["errors"] == 0
    assert summary["command"].startswith("python -m pytest tests -m cuda")
    check = suite_check(summary)
    assert check.passed is False and f"{summary['skipped']} skipped" in check.detail


@pytest.mark.slow
def test_cpu_only_record_is_compared_with_the_committed_one(cpu_only_run: tuple[Any, Path]) -> None:
    _, folder = cpu_only_run
    against = record_of(folder)["against"]
    committed = load_record(H100)
    assert against["record"] == H100.name
    assert against["environment"] == committed["environment_key"]
    # the CPU-only run holds the zoo's CPU workloads at the tiny size; the H100 record holds them at small
    assert "zoo.mlp.fp32.cpu" not in against["only_here"]
    assert any(line.startswith("zoo.mlp.fp32.cpu peak cost: ") for line in against["differences"])
    assert f"## Against `{H100.name}`" in (folder / SUMMARY_FILE).read_text(encoding="utf-8")


def test_a_record_against_itself_has_no_differences() -> None:
    record = load_record(H100)
    against = differences(record, record, H100.name)
    assert against["differences"] == [] and against["only_here"] == [] and against["only_there"] == []
    assert against["same"] >= 3 * len(record["workloads"])  # peak, allocated and requested costs at least


def test_differences_are_costs_and_name_both_values() -> None:
    """A workload that started higher (workspaces kept before the start) differs in no cost; a
    figure that grew is named with both costs and the difference."""
    record = load_record(H100)
    changed = copy.deepcopy(record)
    linear = changed["workloads"]["reference.linear-init"]
    for key in ("start", "peak", "allocated", "requested_peak"):
        linear["measurement"][key] += 68_157_440
    for key in ("max_memory_allocated", "memory_allocated"):
        linear["counters"][key] += 68_157_440
    mlp = changed["workloads"]["zoo.mlp.fp32.cuda"]["measurement"]
    mlp["peak"] += 512
    cost = mlp["peak"] - mlp["start"]
    del changed["workloads"]["reference.adam-default-first-step"]
    against = differences(changed, record, H100.name)
    assert against["differences"] == [f"zoo.mlp.fp32.cuda peak cost: {cost - 512:,} → {cost:,} B (+512 B)"]
    assert against["only_there"] == ["reference.adam-default-first-step"]


def test_against_a_folder_without_a_record_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--cpu-only", "--out", str(tmp_path / "out"), "--size", "tiny", "--against", str(tmp_path)])
    assert code == 2
    assert f"--against {tmp_path}" in capsys.readouterr().err


def test_trace_of_the_mlp_needs_the_mlp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--cpu-only", "--out", str(tmp_path), "--size", "tiny", "--models", "block", "--trace", "mlp"])
    assert code == 2
    assert "--trace mlp needs the mlp model" in capsys.readouterr().err


def test_a_suite_that_already_ran_is_recorded_from_its_junit_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_s="def test_a():\n    pass\n\ndef test_b():\n    assert False, 'no'\n")
    xml = pytester.path / "suite.xml"
    pytester.runpytest("-p", "no:gpumem", f"--junitxml={xml}")
    (pytester.path / "suite.log").write_text("the suite's output\n", encoding="utf-8")
    summary, log = suite_from(xml, pytester.path / "suite.log")
    assert (summary["tests"], summary["failures"], summary["errors"], summary["skipped"]) == (2, 1, 0, 0)
    assert summary["exit_code"] == 1 and summary["log"] == "cuda-suite.log"
    assert log == "the suite's output\n"
    check = suite_check(summary)
    assert check.passed is False and "2 test(s), 1 failed" in (check.detail or "")
    (pytester.path / "junk.xml").write_text("<html/>", encoding="utf-8")
    with pytest.raises(ValueError, match="not a JUnit XML report"):
        suite_from(pytester.path / "junk.xml", None)
