"""The ``gpumem`` fixture is one class, :class:`GpuMem`, over the test's :class:`Recorder` where
the plugin measures and over an :class:`Unrecorded` where it is disabled (``--gpumem-disable``).
A test written against one mode runs against the other: both offer the same members, and bad
arguments are the same errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pytest_gpumem import GpuMem
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.plugin.fixture import Unrecorded


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def _both(engine: Engine) -> tuple[GpuMem, GpuMem]:
    return GpuMem(Recorder(engine), "t.py::test_a"), GpuMem(Unrecorded(torch.device("cpu")), "t.py::test_a")


def test_the_fixture_lists_what_a_test_reaches(cpu_engine: Engine) -> None:
    measured, unmeasured = _both(cpu_engine)
    assert sorted(_public(measured)) == [
        "budget",
        "device",
        "distributed",
        "mark_phase",
        "max_microbatch",
        "measure",
        "nodeid",
        "plan_accumulation",
        "psi",
        "recorder",
        "spans",
        "track",
        "train_step",
    ]
    assert _public(unmeasured) == _public(measured)
    for fixture in (measured, unmeasured):
        assert (fixture.nodeid, fixture.device) == ("t.py::test_a", torch.device("cpu"))


BAD_CALLS: dict[str, Callable[[GpuMem], Any]] = {
    "track": lambda gpumem: gpumem.track(1),
    "budget": lambda gpumem: gpumem.budget(),
    "mark_phase": lambda gpumem: gpumem.mark_phase("sideways"),
    "measure": lambda gpumem: gpumem.measure("x", peak="4XB"),
    "measure name": lambda gpumem: gpumem.measure(""),
    "train_step": lambda gpumem: gpumem.train_step(torch.nn.Linear(2, 2), "sgd", torch.ones(1, 2)),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_both_modes_refuse_a_bad_call_alike(cpu_engine: Engine, call: Callable[[GpuMem], Any]) -> None:
    errors = []
    for fixture in _both(cpu_engine):
        with pytest.raises((ValueError, TypeError)) as caught:
            call(fixture)
        errors.append((caught.type, str(caught.value)))
    assert errors[0] == errors[1]


def test_both_modes_track_and_budget_alike(cpu_engine: Engine) -> None:
    model = torch.nn.Linear(8, 4)
    recorder = Recorder(cpu_engine)
    recorder.begin()  # as the plugin records a test's call
    try:
        figures = []
        for fixture in (GpuMem(recorder, "t.py::test_a"), GpuMem(Unrecorded(torch.device("cpu")), "t.py::test_a")):
            fixture.track(model, model)  # twice: harmless
            figures.append((fixture.psi, fixture.budget("fp32", optimizer="adamw").items))
    finally:
        recorder.end()  # its hooks removed
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the null recorder installs none
    four = 4 * 36  # bytes of 36 fp32 values
    items = {"parameters": four, "gradients": four, "exp_avg": four, "exp_avg_sq": four, "step counters": 8}
    assert figures == [(36, items)] * 2
