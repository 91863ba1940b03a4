"""pytest-gpumem: guard the GPU memory of training steps in a test suite.

Everything a user needs is importable from here (``from pytest_gpumem import measure``).
Names are loaded on first use, so that pytest can load the plugin without importing
torch when no test is measured.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name → the module that defines it.
_EXPORTS: dict[str, str] = {
    # measuring
    "measure": "pytest_gpumem.recorder",
    "Span": "pytest_gpumem.recorder",
    "GpuMem": "pytest_gpumem.fixture",
    "make_engine": "pytest_gpumem.engines",
    "Measurement": "pytest_gpumem.figures",
    "Phase": "pytest_gpumem.figures",
    "Timeline": "pytest_gpumem.figures",
    "CATEGORIES": "pytest_gpumem.figures",
    "METRICS": "pytest_gpumem.figures",
    "PHASES": "pytest_gpumem.figures",
    "LimitExceeded": "pytest_gpumem.spec",
    "CompiledCodeNotMeasured": "pytest_gpumem.figures",
    # distributed steps
    "run_ranks": "pytest_gpumem.distributed",
    "RankContext": "pytest_gpumem.distributed",
    "DistributedError": "pytest_gpumem.distributed",
    # out of memory, emulated devices, microbatches, leaks
    "device_limit": "pytest_gpumem.devicelimit",
    "is_oom": "pytest_gpumem.oom",
    "oom_report": "pytest_gpumem.oom",
    "OomReport": "pytest_gpumem.oom",
    "OomWatch": "pytest_gpumem.oom",
    "release_oom": "pytest_gpumem.oom",
    "live_tensors": "pytest_gpumem.census",
    "LiveTensor": "pytest_gpumem.census",
    "max_microbatch": "pytest_gpumem.microbatch",
    "plan_accumulation": "pytest_gpumem.microbatch",
    "plan_for": "pytest_gpumem.microbatch",
    "Plan": "pytest_gpumem.microbatch",
    "MicrobatchError": "pytest_gpumem.microbatch",
    "confirm_leak": "pytest_gpumem.leaks",
    "snapshot_storages": "pytest_gpumem.leaks",
    "LeakCheck": "pytest_gpumem.leaks",
    # budgets
    "count_parameters": "pytest_gpumem.budgets",
    "model_states": "pytest_gpumem.budgets",
    "Budget": "pytest_gpumem.budgets",
    "mlp_activations": "pytest_gpumem.budgets",
    "transformer_layer_activations": "pytest_gpumem.budgets",
    "register_optimizer": "pytest_gpumem.budgets",
    "OptimizerState": "pytest_gpumem.budgets",
    "parse_budget": "pytest_gpumem.expressions",
    # sizes and tolerances
    "Tolerance": "pytest_gpumem.verdict",
    "parse_tolerance": "pytest_gpumem.verdict",
    "format_size": "pytest_gpumem.units",
    "parse_size": "pytest_gpumem.units",
}

__all__ = [
    "CATEGORIES",
    "METRICS",
    "PHASES",
    "Budget",
    "CompiledCodeNotMeasured",
    "DistributedError",
    "GpuMem",
    "LeakCheck",
    "LimitExceeded",
    "LiveTensor",
    "Measurement",
    "MicrobatchError",
    "OomReport",
    "OomWatch",
    "OptimizerState",
    "Phase",
    "Plan",
    "RankContext",
    "Span",
    "Timeline",
    "Tolerance",
    "__version__",
    "confirm_leak",
    "count_parameters",
    "device_limit",
    "format_size",
    "is_oom",
    "live_tensors",
    "make_engine",
    "max_microbatch",
    "measure",
    "mlp_activations",
    "model_states",
    "oom_report",
    "parse_budget",
    "parse_size",
    "parse_tolerance",
    "plan_accumulation",
    "plan_for",
    "register_optimizer",
    "release_oom",
    "run_ranks",
    "snapshot_storages",
    "transformer_layer_activations",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_gpumem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from pytest_gpumem.budgets import (
        Budget,
        OptimizerState,
        count_parameters,
        mlp_activations,
        model_states,
        register_optimizer,
        transformer_layer_activations,
    )
    from pytest_gpumem.census import LiveTensor, live_tensors
    from pytest_gpumem.devicelimit import device_limit
    from pytest_gpumem.distributed import DistributedError, RankContext, run_ranks
    from pytest_gpumem.engines import make_engine
    from pytest_gpumem.expressions import parse_budget
    from pytest_gpumem.figures import (
        CATEGORIES,
        METRICS,
        PHASES,
        CompiledCodeNotMeasured,
        Measurement,
        Phase,
        Timeline,
    )
    from pytest_gpumem.fixture import GpuMem
    from pytest_gpumem.leaks import LeakCheck, confirm_leak, snapshot_storages
    from pytest_gpumem.microbatch import MicrobatchError, Plan, max_microbatch, plan_accumulation, plan_for
    from pytest_gpumem.oom import OomReport, OomWatch, is_oom, oom_report, release_oom
    from pytest_gpumem.recorder import Span, measure
    from pytest_gpumem.spec import LimitExceeded
    from pytest_gpumem.units import format_size, parse_size
    from pytest_gpumem.verdict import Tolerance, parse_tolerance
