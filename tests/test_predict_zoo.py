"""The H100 and H200 predictions against the figures recorded on those GPUs (torch 2.11, ``record.json``).

Each zoo training step (``pytest_gpumem.validate.zoo``, size ``small``: the size the records hold) is
run on the CPU under the prediction engine with the records' clean-state protocol (2): one warm-up
step, the library workspaces made before the start and kept, then the measured step. The
prediction is compared with the GPU's own counters for that step.

What the prediction models, and how far each figure is from the GPU, in bytes:

* ``allocated`` and ``start`` of the MLP and the transformer block: exact, to the byte. AdamW's
  step counters, one 0-dimensional float32 tensor per parameter tensor, live on the host on
  the GPU (AdamW neither fused nor capturable), and the prediction does not count them either.
* ``peak`` of the MLP and the block: the whole gap is a transient the GPU's peak holds in
  backward (the peak of these models is in backward) beyond every tensor: 32 MiB (fp32), 64 MiB
  (MLP bf16), 72 MiB (block bf16), gone by the end of the step. The H200 record's trace of the
  MLP's fp32 step (``snapshot.pickle``) shows it: a 32 MiB block autograd's device thread
  allocates (no Python frame) in the last Linear's backward, after the weight's gradient, freed
  a few events later; a C++ allocation no tensor holds, which the prediction does not model.
  The test takes its size from the record (the GPU's peak cost minus the cost of its tensors'
  peak, both measured on that GPU) and checks that the rest of the prediction is within 2%,
  and that without it the prediction is *not* within 2%, so that this file changes when the
  transient is modelled.
* ``reserved`` of the MLP and the block: 19 to 31% below the GPU's. What the GPU reserved
  before the step depends on every allocation the process made before (the record's process
  ran other workloads first), the backward transient takes its own segments, and ``foreach``
  AdamW (CUDA's default) makes other temporaries. The test bounds it from above.
* GPT-2 and Llama (``transformers``): see their test.

Every step runs on fake tensors (``fake=True``'s mode): its figures are the real-tensor run's to the
byte, ``reserved`` included, which one test per model checks on real tensors (bf16);
``tests/test_fake.py`` checks it for the MLP and the block in both precisions through
``measure(..., fake=True)``. ``transformers`` takes its tracing path when its mask functions see a
fake tensor (``masking_utils.is_tracing``); the fake runs here are given the eager path's answer
(:func:`_eager_masks`), so that they run the real run's operators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import recorded_folder
from pytest_gpumem.measurement.engines.fake import fake_mode
from pytest_gpumem.measurement.engines.predict import PredictEngine
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.targets import Target, target
from pytest_gpumem.validate.zoo import zoo

#: zoo steps of the recorded size: on real tensors in the checks of fake tensors
pytestmark = pytest.mark.slow

MiB = 1 << 20
GPUS = ("h100", "h200")
ROWS = [(name, precision) for name in ("mlp", "block") for precision in ("fp32", "bf16")]
TRANSFORMERS_ROWS = [(name, precision) for name in ("gpt2", "llama") for precision in ("fp32", "bf16")]


def _record(gpu: str) -> dict[str, Any]:
    """The record ``gpu``'s prediction target is checked against (``targets.json``)."""
    data: dict[str, Any] = json.loads((recorded_folder(gpu) / "record.json").read_text(encoding="utf-8"))
    return data


def _percent(predicted: int, recorded: int) -> float:
    return 100 * (predicted - recorded) / recorded


def _predicted_step(name: str, precision: str, gpu: str, *, fake: bool) -> dict[str, int]:
    """The zoo step's figures predicted for ``gpu``: computed once for targets that differ only
    in what names and bounds the device (the H100 and the H200 share their allocator, workspaces
    and kernels), since a step that fits does not depend on those."""
    modelled = dataclasses.replace(target(gpu), name="", aliases=(), device_name="", total_memory=0, record=None)
    return dict(_predicted(name, precision, modelled, fake))


@functools.cache
def _predicted(name: str, precision: str, modelled: Target, fake: bool) -> tuple[tuple[str, int], ...]:
    """The zoo step's figures predicted for the target ``modelled`` with the records' clean-state
    protocol (the library workspaces made before the start and kept), as ``validate`` measured
    the GPU; on fake tensors (built, warmed up and measured in one fake mode) when ``fake``."""
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(_eager_masks(name))
            stack.enter_context(fake_mode())
        return _predicted_now(name, precision, modelled)


@contextlib.contextmanager
def _eager_masks(name: str) -> Iterator[None]:
    """For a ``transformers`` model, its mask functions take the path they take on real tensors:
    ``masking_utils.is_tracing(tensor)`` is true of any fake tensor, and on it they build the
    ``batch × 1 × seq × seq`` causal mask (which makes Llama's attention ``repeat_kv`` its keys and
    values) where the eager step passes no mask; answered as for a real tensor (no compiler, jit or
    CUDA graph capture runs here), the fake step runs the real step's operators, one for one."""
    if zoo("small", (name,))[0].needs != "transformers":
        yield
        return
    masking_utils = importlib.import_module("transformers.masking_utils")
    import_utils = importlib.import_module("transformers.utils.import_utils")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking_utils, "is_tracing", lambda tensor=None: import_utils.is_tracing())
        yield


def _predicted_now(name: str, precision: str, modelled: Target) -> tuple[tuple[str, int], ...]:
    (model,) = zoo("small", (name,))
    torch.manual_seed(0)
    step = model.build("cpu", precision)
    cpu = torch.device("cpu")
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    engine = PredictEngine(modelled)
    engine.clean()
    engine.take_window()
    start, start_reserved = engine.allocated(), engine.reserved()
    engine.start()
    try:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=cpu)
    finally:
        engine.stop()
    window = engine.take_window()
    assert start_reserved is not None and "reserved" in window.highest
    figures = {
        "start": start,
        "peak": window.peak,
        "allocated": engine.allocated(),
        "reserved": window.highest["reserved"],
        "start_reserved": start_reserved,
    }
    return tuple(figures.items())


@pytest.mark.parametrize("name", ["mlp", "block", "gpt2", "llama"])
def test_the_zoo_step_on_fake_tensors_is_predicted_as_on_real_tensors(name: str) -> None:
    """Every figure the GPU comparisons read, to the byte: ``start``, ``peak``, ``allocated``,
    ``reserved`` and the reserved ``start`` (the tensors alive at the start are counted in the same
    order, so the allocator model packs them into the same segments)."""
    if zoo("small", (name,))[0].needs:
        pytest.importorskip("transformers")
    real = _predicted_step(name, "bf16", "h100", fake=False)
    fake = _predicted_step(name, "bf16", "h100", fake=True)
    assert fake == real
    assert real["peak"] > real["start"] > 0


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize(("name", "precision"), ROWS, ids=[f"{n}-{p}" for n, p in ROWS])
def test_a_zoo_step_is_predicted_as_the_gpu_ran_it(gpu: str, name: str, precision: str) -> None:
    """``start`` and ``allocated`` to the byte; the peak short by the backward transient alone;
    ``reserved`` bounded from above (see the module's docstring). On fake tensors: the figures are
    the real-tensor run's (``test_the_zoo_step_on_fake_tensors_is_predicted_as_on_real_tensors``)."""
    workloads = _record(gpu)["workloads"]
    measured = workloads[f"zoo.{name}.{precision}.cuda"]["measurement"]
    tensors = workloads[f"zoo.{name}.{precision}.cuda-tensors"]["measurement"]
    predicted = _predicted_step(name, precision, gpu, fake=True)
    assert predicted["start"] == measured["start"]
    assert predicted["allocated"] == measured["allocated"]

    transient = (measured["peak"] - measured["start"]) - (tensors["peak"] - tensors["start"])  # beyond every tensor
    assert 32 * MiB <= transient <= 72 * MiB + 64 * 1024
    residual = predicted["peak"] + transient - measured["peak"]
    assert abs(residual) <= 0.02 * measured["peak"], f"{gpu} {name} {precision}: peak residual {residual:+,} B"
    assert abs(predicted["peak"] - measured["peak"]) > 0.02 * measured["peak"], "the transient is modelled: update this"

    assert predicted["reserved"] <= measured["reserved"]
    assert predicted["reserved"] - predicted["start_reserved"] <= measured["reserved"] - measured["start_reserved"]


@pytest.mark.parametrize(("name", "precision"), TRANSFORMERS_ROWS, ids=[f"{n}-{p}" for n, p in TRANSFORMERS_ROWS])
def test_a_transformer_step_is_predicted_within_two_percent(name: str, precision: str) -> None:
    """GPT-2 (attention dropout: the H100 runs memory-efficient attention in fp32, flash attention
    in bf16, where the CPU runs the math composite) and Llama (grouped-query attention: the H100
    runs the math composite in fp32, where the CPU runs its flash kernel), against the H100's
    record. The peak of both is in the loss, before backward: no backward transient. Peak and
    allocated are within 2%, reserved within 5%; the largest residuals (docs/prediction.md's
    table) are GPT-2 fp32's peak, +24,107,008 B (+1.57%), and its reserved, +37,748,736 B
    (+2.42%); ``allocated`` is at most 1,753,088 B (0.28%, Llama bf16) from the H100's. On fake
    tensors: the figures are the real-tensor run's
    (``test_the_zoo_step_on_fake_tensors_is_predicted_as_on_real_tensors``)."""
    pytest.importorskip("transformers")
    measured = _record("h100")["workloads"][f"zoo.{name}.{precision}.cuda"]["measurement"]
    predicted = _predicted_step(name, precision, "h100", fake=True)
    for metric, bound in (("peak", 2.0), ("allocated", 2.0), ("reserved", 5.0)):
        off = _percent(predicted[metric], measured[metric])
        assert abs(off) <= bound, f"{name} {precision}: {metric} {predicted[metric]:,} B is {off:+.2f}% from the H100's"
