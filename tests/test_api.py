"""The public surface: what the documentation uses is importable from ``pytest_gpumem``,
takes device names as strings, and works outside pytest."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import pytest_gpumem
from pytest_gpumem import (
    LimitExceeded,
    device_limit,
    make_engine,
    max_microbatch,
    measure,
)
from pytest_gpumem.measurement.engines import Runtime, Workspaces


def test_every_public_name_resolves() -> None:
    for name in pytest_gpumem.__all__:
        assert getattr(pytest_gpumem, name) is not None, name
    assert set(pytest_gpumem.__all__) <= set(dir(pytest_gpumem))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pytest_gpumem.nope  # noqa: B018


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, pytest_gpumem.plugin, pytest_gpumem.baselines; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_make_engine_takes_device_names() -> None:
    engine = make_engine("cpu")
    assert engine.name == "cpu" and engine.device == torch.device("cpu") and engine.exact
    assert make_engine("auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "cuda:x", "", "cpu:0:1"):
        with pytest.raises(ValueError, match="is not a device"):
            make_engine(bad)


def test_each_engine_offers_the_capabilities_it_has() -> None:
    """What an engine does besides its readings is a capability it offers or not, not its device's name."""
    cpu, predict = make_engine("cpu"), make_engine("cpu", predict="h100")
    allocations = make_engine("cpu", observe="allocations")
    assert all(engine.categories is not None for engine in (cpu, predict, allocations))  # a storage tracker
    assert cpu.sites is not None and predict.sites is not None
    assert allocations.sites is None  # the allocator's reports carry no Python frames
    assert isinstance(predict, Workspaces) and not isinstance(cpu, Workspaces)
    assert not any(isinstance(engine, Runtime) for engine in (cpu, predict, allocations))


def test_measure_span_has_the_figures_and_limits_raise_limit_exceeded() -> None:
    model = torch.nn.Linear(64, 64)
    with measure("step", device="cpu", track=(model,)) as span:
        model(torch.randn(8, 64)).sum().backward()
    assert span.psi == 64 * 64 + 64
    assert span.allocated_breakdown is not None and span.allocated_breakdown["gradients"] == 4 * span.psi
    with pytest.raises(LimitExceeded, match="exceeds the limit"), measure("big", device="cpu", peak="1KiB"):
        torch.ones(1024)


def test_device_limit_and_max_microbatch_take_a_device_name_inside_measure() -> None:
    def step(size: int) -> None:
        torch.ones(size, 1024)  # 4 KiB per sample

    with measure("search", device="cpu"):
        with device_limit("cpu", "64KiB"), pytest.raises(torch.OutOfMemoryError):
            torch.ones(17 * 1024)
        assert max_microbatch(step, limit="64KiB", engine="cpu") == 16
    with measure("limited", device="cpu", device_limit="8KiB"), pytest.raises(torch.OutOfMemoryError):
        torch.ones(4 * 1024)


def test_device_limit_on_the_cpu_outside_a_measurement_is_an_error_not_a_silent_no_op() -> None:
    with pytest.raises(ValueError, match="sees allocations only while it measures"), device_limit("cpu", "1KiB"):
        pass


def test_a_span_holding_two_steps_reports_what_one_step_held_for_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    with measure("two", device="cpu", track=(model, opt)) as two:
        step()
        step()
    with measure("one", device="cpu", track=(model, opt)) as one:
        step()
    assert one.saved_activations is not None and one.saved_activations > 0
    assert two.saved_activations == one.saved_activations  # the most held at one time, not the sum of both
    assert two.saved_activations <= two.peak
    assert two.phases["forward"].count == 2 and one.phases["forward"].count == 1
