"""``torch.compile``'d code under the tensor tracker: never measured as the eager program in silence.

TorchDynamo runs a compiled frame eagerly while a dispatch mode that does not ignore compile
internals is on the stack, and the tracker is one. The tracker reports each such frame, and
the span warns (``CompiledCodeNotMeasured``). These tests compile with ``backend="eager"``:
TorchDynamo's decision does not depend on the backend, and it needs no C++ compiler.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import run_fresh
from pytest_gpumem import CompiledCodeNotMeasured, measure

pytestmark = [
    pytest.mark.usefixtures("forget_compiled_code"),
    pytest.mark.skipif(
        not hasattr(TorchDispatchMode, "ignore_compile_internals"),
        reason="this torch's TorchDynamo does not ask dispatch modes about compiled frames",
    ),
]


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.sin(x * w) + torch.cos(x)
    return x.sum()


def _measured(fn, *args: torch.Tensor) -> tuple[int, list[str]]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with measure("step", device="cpu") as span:
            fn(*args).backward()
    return span.peak - span.start, [str(w.message) for w in caught if w.category is CompiledCodeNotMeasured]


def test_a_compiled_function_under_the_tracker_warns_and_names_it() -> None:
    w = torch.randn(256, requires_grad=True)
    x = torch.randn(16, 256)
    compiled = torch.compile(_chain, backend="eager")
    compiled(x, w).backward()  # compiled before the measurement: the cached code is not run either
    w.grad = None
    eager_cost, eager_warnings = _measured(_chain, x, w)
    w.grad = None
    compiled_cost, compiled_warnings = _measured(compiled, x, w)
    assert eager_warnings == []
    (message,) = compiled_warnings
    assert message.startswith("span 'step' measured the eager program, not the torch.compile'd one")
    assert f"_chain ({__file__}:" in message
    assert "pytest_gpumem" not in message.split("eagerly because")[0]  # the plugin's hooks are not named
    assert compiled_cost == eager_cost  # what the warning is about: the same program was measured


def test_a_compiled_module_is_named_by_its_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 32)
    _, messages = _measured(lambda inputs: compiled(inputs).sum(), x)
    (message,) = messages
    assert "Sequential.forward (" in message


def test_each_span_reports_only_its_own_compiled_frames() -> None:
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(4, 64)
    compiled = torch.compile(_chain, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with measure("outer", device="cpu") as outer:
            with outer.recorder.span("eager part"):
                _chain(x, w).backward()
            with outer.recorder.span("compiled part"):
                compiled(x, w).backward()
    spans = [str(w.message).split("'")[1] for w in caught if w.category is CompiledCodeNotMeasured]
    assert spans == ["compiled part", "outer"]


@pytest.mark.slow
def test_a_measured_test_with_a_compiled_model_warns_in_the_session_and_can_be_made_an_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
import pytest
import torch

@pytest.mark.gpumem(peak="1GiB")
def test_compiled_step():
    model = torch.compile(torch.nn.Linear(16, 16), backend="eager")
    model(torch.randn(4, 16)).sum().backward()
"""
    )
    result = run_fresh(pytester)
    result.assert_outcomes(passed=1)
    text = result.stdout.str()
    assert "CompiledCodeNotMeasured: span 'call' measured the eager program" in text
    assert "test_a_measured_test_with_a_compiled_model" in text  # the warning names the test
    strict = run_fresh(pytester, "-W", "error::pytest_gpumem.CompiledCodeNotMeasured")
    strict.assert_outcomes(failed=1)
    assert "measured the eager program" in strict.stdout.str()
