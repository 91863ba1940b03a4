"""The H100 prediction against the figures recorded on an H100 (torch 2.11, ``record.json``).

Each zoo training step (``pytest_gpumem.validate.zoo``, size ``small``: the size the record holds) is run
on the CPU under the prediction engine with the record's protocol: one warm-up step, the
clean-state protocol of the version that made the record (library workspaces freed, cache
emptied), then the measured step, whose threads create their workspaces again. The
prediction is compared with the H100's own counters for that step.

What the prediction models, and how far each figure is from the H100, in bytes:

* ``allocated`` (and ``start``): exact, to the byte. AdamW's step counters, one 0-dimensional
  float32 tensor per parameter tensor, live on the host on the H100 (AdamW neither fused nor
  capturable), and the prediction does not count them either.
* ``peak``: the whole gap is a transient the H100's peak holds in backward (the peak of
  these four models is in backward) beyond every tensor *and* the two 32 MiB cuBLAS
  workspaces and cuBLASLt's 1 MiB: 32 MiB (fp32), 64 MiB (MLP bf16), 72 MiB (block bf16),
  gone by the end of the step. It is no tensor (the record's tensor run on the GPU does not
  see it) and no third workspace; the record holds no allocation trace of these steps, so
  it is not modelled. The test takes its size from the record (GPU peak minus the GPU's
  tensor peak minus the workspaces) and checks that the rest of the prediction is within
  2%; and that without it the prediction is *not* within 2%, so this file changes when the
  transient is modelled.
* ``reserved``: below the H100's by 19–31%: what the H100 reserved before the step
  depends on every allocation the process made before (the record's process ran other
  workloads first), the backward transient takes its own segments, and ``foreach`` AdamW
  (CUDA's default) makes other temporaries. The test bounds it from above.

The ``gpt2`` and ``llama`` rows (``transformers``, the record's version) are within 2%; see
their test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpumem.measurement.engines.predict import PredictEngine
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.targets import target
from pytest_gpumem.validate.zoo import zoo

#: each test runs a whole zoo step of the recorded size (up to 64 MiB activations, about 40 s in all)
pytestmark = pytest.mark.slow

MiB = 1 << 20
#: the H100's workspaces at the end of each step: cuBLAS on two threads, cuBLASLt on one
WORKSPACES = 2 * 32 * MiB + MiB
ROWS = [(name, precision) for name in ("mlp", "block") for precision in ("fp32", "bf16")]
TRANSFORMERS_ROWS = [(name, precision) for name in ("gpt2", "llama") for precision in ("fp32", "bf16")]


@pytest.fixture
def record(recorded_h100: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((recorded_h100 / "record.json").read_text(encoding="utf-8"))
    return data


def _percent(predicted: int, recorded: int) -> float:
    return 100 * (predicted - recorded) / recorded


def _predicted_step(name: str, precision: str) -> dict[str, int]:
    """The zoo step's figures, predicted with the record's protocol (see the module's docstring)."""
    (model,) = zoo("small", (name,))
    torch.manual_seed(0)
    step = model.build("cpu", precision)
    cpu = torch.device("cpu")
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    engine = PredictEngine(target("h100"))
    engine.clean()
    engine.release_workspaces()
    engine.empty_cache()
    engine.take_window()
    start, start_reserved = engine.allocated(), engine.reserved()
    engine.start()
    try:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    finally:
        engine.stop()
    window = engine.take_window()
    assert start_reserved is not None and window.reserved_peak is not None
    return {
        "start": start,
        "peak": window.peak,
        "allocated": engine.allocated(),
        "reserved": window.reserved_peak,
        "start_reserved": start_reserved,
    }


@pytest.mark.parametrize(("name", "precision"), ROWS, ids=[f"{n}-{p}" for n, p in ROWS])
def test_a_zoo_step_is_predicted_as_the_h100_ran_it(record: dict[str, Any], name: str, precision: str) -> None:
    workloads = record["workloads"]
    gpu = workloads[f"zoo.{name}.{precision}.cuda"]["measurement"]
    tensors = workloads[f"zoo.{name}.{precision}.cuda-tensors"]["measurement"]
    predicted = _predicted_step(name, precision)
    assert predicted["start"] == gpu["start"]
    assert predicted["allocated"] == gpu["allocated"]

    transient = gpu["peak"] - tensors["peak"] - WORKSPACES
    assert 32 * MiB <= transient <= 72 * MiB + 64 * 1024
    residual = predicted["peak"] + transient - gpu["peak"]
    assert abs(residual) <= 0.02 * gpu["peak"], f"{name} {precision}: peak residual {residual:+,} B"
    assert abs(predicted["peak"] - gpu["peak"]) > 0.02 * gpu["peak"], "the transient is modelled now: update this"

    assert predicted["reserved"] <= gpu["reserved"]
    assert predicted["reserved"] - predicted["start_reserved"] <= gpu["reserved"] - gpu["start_reserved"]


@pytest.mark.parametrize(("name", "precision"), TRANSFORMERS_ROWS, ids=[f"{n}-{p}" for n, p in TRANSFORMERS_ROWS])
def test_a_transformer_step_is_predicted_within_two_percent(record: dict[str, Any], name: str, precision: str) -> None:
    """GPT-2 (attention dropout: the H100 runs memory-efficient attention in fp32, flash attention
    in bf16, where the CPU runs the math composite) and Llama (grouped-query attention: the H100
    runs the math composite in fp32, where the CPU runs its flash kernel). The peak of both is
    in the loss, before backward: no backward transient. What remains is within 2%:
    the allocator's unsplit blocks after the step (9 and 11 MiB for GPT-2 on the H100, part of
    which the model reproduces) and small buffers made on the device (15,872 B)."""
    pytest.importorskip("transformers")
    gpu = record["workloads"][f"zoo.{name}.{precision}.cuda"]["measurement"]
    predicted = _predicted_step(name, precision)
    for metric, bound in (("peak", 2.0), ("allocated", 2.0), ("reserved", 5.0)):
        off = _percent(predicted[metric], gpu[metric])
        assert abs(off) <= bound, f"{name} {precision}: {metric} {predicted[metric]:,} B is {off:+.2f}% from the H100's"


def _predicted_now(name: str, precision: str, gpu: str) -> dict[str, int]:
    """The zoo step's figures predicted for ``gpu`` with this release's clean-state protocol (the
    library workspaces made before the start and kept), as ``validate`` measured the H200."""
    (model,) = zoo("small", (name,))
    torch.manual_seed(0)
    step = model.build("cpu", precision)
    cpu = torch.device("cpu")
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    engine = PredictEngine(target(gpu))
    engine.clean()
    engine.take_window()
    start = engine.allocated()
    engine.start()
    try:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    finally:
        engine.stop()
    return {"start": start, "peak": engine.take_window().peak, "allocated": engine.allocated()}


@pytest.mark.parametrize(("name", "precision"), ROWS, ids=[f"{n}-{p}" for n, p in ROWS])
def test_a_zoo_step_is_predicted_as_the_h200_ran_it(name: str, precision: str) -> None:
    """The H200 (torch 2.11, clean-state protocol 2): ``start`` and ``allocated`` to the byte; the
    peak short by the same backward transient as the H100's. The H200 record's trace of the MLP's
    fp32 step (``snapshot.pickle``) shows it: a 32 MiB block the autograd thread allocates (no
    Python frame) in the last Linear's backward, after the weight's gradient, freed a few events
    later; a C++ allocation no tensor holds, which the prediction does not model."""
    record = json.loads((Path(__file__).resolve().parents[1] / str(target("h200").record) / "record.json").read_text())
    gpu = record["workloads"][f"zoo.{name}.{precision}.cuda"]["measurement"]
    tensors = record["workloads"][f"zoo.{name}.{precision}.cuda-tensors"]["measurement"]
    predicted = _predicted_now(name, precision, "h200")
    assert predicted["start"] == gpu["start"]
    assert predicted["allocated"] == gpu["allocated"]
    transient = (gpu["peak"] - gpu["start"]) - (tensors["peak"] - tensors["start"])  # beyond every tensor
    assert 32 * MiB <= transient <= 72 * MiB + 64 * 1024
    residual = predicted["peak"] + transient - gpu["peak"]
    assert abs(residual) <= 0.02 * gpu["peak"], f"{name} {precision}: peak residual {residual:+,} B"
