"""The ``gpumem`` fixture is one protocol (:class:`GpumemFixture`) with two implementations: the
measured :class:`GpuMem` and :class:`UnmeasuredGpuMem` (``--gpumem-disable``). A test written
against one runs against the other, so every public member agrees: its kind (method, property,
attribute) and each parameter's name, kind, default and annotation."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from pytest_gpumem import GpuMem
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.plugin.fixture import GpumemFixture
from pytest_gpumem.plugin.unmeasured import UnmeasuredGpuMem

#: Members of the measured fixture only: the recording a measured test reads spans from.
MEASURED_ONLY = {"recorder"}


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def _members() -> list[str]:
    return sorted(_public(GpumemFixture) | set(GpumemFixture.__annotations__))


def _parameters(function: Any) -> list[tuple[str, Any, Any, Any]]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_lists_what_a_test_reaches() -> None:
    assert _members() == [
        "budget",
        "device",
        "distributed",
        "mark_phase",
        "max_microbatch",
        "measure",
        "nodeid",
        "plan_accumulation",
        "psi",
        "spans",
        "track",
        "train_step",
    ]


@pytest.mark.parametrize("name", _members())
def test_both_fixtures_implement_each_member_alike(name: str) -> None:
    expected = inspect.getattr_static(GpumemFixture, name, None)
    for implementation in (GpuMem, UnmeasuredGpuMem):
        assert GpumemFixture in implementation.__mro__  # it says it implements the protocol
        found = inspect.getattr_static(implementation, name, None)
        if expected is None:  # an attribute each instance sets
            assert found is None or not callable(found), (implementation, name)
            continue
        assert found is not expected, f"{implementation.__name__}.{name} is the protocol's own stub"
        assert type(found) is type(expected), (implementation, name)
        if isinstance(expected, property):
            expected_function, found_function = expected.fget, found.fget
        else:
            expected_function, found_function = expected, found
        assert _parameters(found_function) == _parameters(expected_function), f"{implementation.__name__}.{name}"


def test_each_instance_has_every_member_and_no_other(cpu_engine: Engine) -> None:
    measured = GpuMem(Recorder(cpu_engine), "t.py::test_a")
    unmeasured = UnmeasuredGpuMem(torch.device("cpu"), "t.py::test_a")
    assert _public(measured) - MEASURED_ONLY == set(_members())
    assert _public(unmeasured) == set(_members())
    for fixture in (measured, unmeasured):
        assert (fixture.nodeid, fixture.device) == ("t.py::test_a", torch.device("cpu"))
