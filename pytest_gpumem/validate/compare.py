"""The model zoo on the CPU engine and on the GPU: each gap split into bytes outside tensors and tensors by category."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.units import format_delta, format_size
from pytest_gpumem.validate.results import Outcome, Run, probe, release
from pytest_gpumem.validate.zoo import PRECISIONS, ZooModel


def zoo_step(model: ZooModel, precision: str, device: torch.device, engine: str, *, name: str | None = None) -> Outcome:
    """One measured AdamW step of ``model`` after a warm-up step, on ``engine`` "cpu", "cuda" or "cuda-tensors"."""
    step = model.build(device, precision)
    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=device)
    track = () if engine == "cuda" else (step.model, step.optimizer)
    key = name or f"zoo.{model.name}.{precision}.{engine}"
    with probe(key, device, track=track, tensors_only=engine == "cuda-tensors") as made:
        run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp, device=device)
    del step
    release(device)
    return made.outcome


def _ratio(gpu: Measurement | None, cpu: Measurement | None, metric: str) -> float | None:
    over, under = (None if m is None else m.figure(metric) for m in (gpu, cpu))
    return None if over is None or not under else round(over / under, 4)


def _breakdown(m: Measurement, metric: str) -> Mapping[str, int] | None:
    return m.allocated_breakdown if metric == "allocated" else m.breakdown


def gap_parts(cpu: Measurement, gpu: Measurement, tensors: Measurement | None, metric: str) -> dict[str, Any]:
    """The GPU-minus-CPU gap of ``metric``, split into bytes ``outside_tensors`` and ``tensors`` (``by_category``)."""
    cpu_value, gpu_value = cpu.figure(metric), gpu.figure(metric)
    assert cpu_value is not None and gpu_value is not None
    parts: dict[str, Any] = {
        "total": gpu_value - cpu_value,
        "outside_tensors": None,
        "tensors": None,
        "by_category": {},
    }
    if tensors is None:
        return parts
    tensor_value = tensors.figure(metric)
    assert tensor_value is not None
    parts["outside_tensors"] = gpu_value - tensor_value
    parts["tensors"] = tensor_value - cpu_value
    ours, theirs = _breakdown(tensors, metric), _breakdown(cpu, metric)
    if ours is not None and theirs is not None:
        deltas = {c: ours.get(c, 0) - theirs.get(c, 0) for c in CATEGORIES}
        parts["by_category"] = {c: v for c, v in deltas.items() if v}
    return parts


def explain_gap(cpu: Measurement, gpu: Measurement | None, tensors: Measurement | None) -> str:
    """One line that accounts for the GPU-minus-CPU gaps of allocated and peak, byte for byte."""
    if gpu is None:
        return "n/a (no GPU run)"
    texts = []
    for metric in ("allocated", "peak"):
        parts = gap_parts(cpu, gpu, tensors, metric)
        text = f"{metric} {format_delta(parts['total'])}"
        if parts["outside_tensors"] is not None:
            inside = parts["tensors"]
            outside, sign = format_delta(parts["outside_tensors"]), "+" if inside >= 0 else "−"
            text += f" = {outside} outside tensors {sign} {format_size(abs(inside))} tensors"
            categories = sorted(parts["by_category"].items(), key=lambda item: -abs(item[1]))
            if categories:
                text += " (" + ", ".join(f"{c} {format_delta(v)}" for c, v in categories) + ")"
        texts.append(text)
    return "; ".join(texts)


def zoo_comparison(run: Run, models: Sequence[ZooModel], gpu: torch.device | None) -> None:
    """Each zoo model × precision: the CPU engine, and with a GPU the allocator and the tensor run."""
    cpu = torch.device("cpu")
    for model in models:
        for precision in PRECISIONS:
            row: dict[str, Any] = {
                "model": model.name,
                "precision": precision,
                "size": model.size,
                "shape": dict(model.shape),
                "description": model.description,
                **dict.fromkeys(("psi", "cpu", "gpu", "gpu_tensors", "skipped")),
            }
            run.zoo_rows.append(row)
            if not model.available:
                row["skipped"] = f"{model.needs} is not installed"
                continue
            label = f"{model.name} {precision}"
            with run.guard("zoo", f"{label} on the CPU engine"):
                outcome = run.add(zoo_step(model, precision, cpu, "cpu"))
                row["cpu"] = outcome.name
                row["psi"] = outcome.measurement.psi
            if gpu is None:
                continue
            for key, engine, where in (("gpu", "cuda", ""), ("gpu_tensors", "cuda-tensors", ", tensors only")):
                with run.guard("zoo", f"{label} on the GPU{where}"):
                    row[key] = run.add(zoo_step(model, precision, gpu, engine)).name
    measurements = {name: o.measurement for name, o in run.outcomes.items()}
    for row in run.zoo_rows:
        row.update(zoo_figures(row, measurements))


def zoo_figures(row: Mapping[str, Any], measurements: Mapping[str, Measurement]) -> dict[str, Any]:
    """The figures, ratios, gaps and explanation of a zoo row, from the measurements it names."""
    cpu, gpu, tensors = (measurements.get(row[key]) if row[key] else None for key in ("cpu", "gpu", "gpu_tensors"))
    figures = {
        key: None if m is None else {"allocated": m.allocated, "peak": m.peak, "reserved": m.reserved}
        for key, m in (("cpu", cpu), ("gpu", gpu), ("gpu_tensors", tensors))
    }
    metrics = ("allocated", "peak")
    return {
        "figures": figures,
        "ratio": {metric: _ratio(gpu, cpu, metric) for metric in metrics},
        "gap": None
        if cpu is None or gpu is None
        else {metric: gap_parts(cpu, gpu, tensors, metric) for metric in metrics},
        "explanation": "n/a (no CPU figures)" if cpu is None else explain_gap(cpu, gpu, tensors),
    }
