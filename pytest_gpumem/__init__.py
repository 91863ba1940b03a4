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
    "measure": "pytest_gpumem.measurement.active",
    "Span": "pytest_gpumem.measurement.recorder",
    "GpuMem": "pytest_gpumem.plugin.fixture",
    "make_engine": "pytest_gpumem.measurement.engines",
    "Measurement": "pytest_gpumem.data.figures",
    "Phase": "pytest_gpumem.data.figures",
    "Timeline": "pytest_gpumem.data.figures",
    "CATEGORIES": "pytest_gpumem.data.metrics",
    "METRICS": "pytest_gpumem.data.metrics",
    "PHASES": "pytest_gpumem.data.metrics",
    "LimitExceeded": "pytest_gpumem.judge.limits",
    "CompiledCodeNotMeasured": "pytest_gpumem.data.figures",
    # distributed steps
    "run_ranks": "pytest_gpumem.diagnose.distributed",
    "RankContext": "pytest_gpumem.diagnose.distributed",
    "DistributedError": "pytest_gpumem.diagnose.distributed",
    # out of memory, emulated devices, microbatches, leaks
    "device_limit": "pytest_gpumem.measurement.devicelimit",
    "is_oom": "pytest_gpumem.diagnose.oom",
    "oom_report": "pytest_gpumem.diagnose.oom",
    "OomReport": "pytest_gpumem.diagnose.oom",
    "OomWatch": "pytest_gpumem.diagnose.oom",
    "release_oom": "pytest_gpumem.diagnose.oom",
    "live_tensors": "pytest_gpumem.diagnose.census",
    "LiveTensor": "pytest_gpumem.diagnose.census",
    "max_microbatch": "pytest_gpumem.diagnose.microbatch",
    "plan_accumulation": "pytest_gpumem.diagnose.microbatch",
    "plan_for": "pytest_gpumem.diagnose.microbatch",
    "Plan": "pytest_gpumem.diagnose.microbatch",
    "MicrobatchError": "pytest_gpumem.diagnose.microbatch",
    "confirm_leak": "pytest_gpumem.diagnose.leaks",
    "snapshot_storages": "pytest_gpumem.diagnose.leaks",
    "LeakCheck": "pytest_gpumem.diagnose.leaks",
    # budgets
    "count_parameters": "pytest_gpumem.budgets.formulas",
    "model_states": "pytest_gpumem.budgets.formulas",
    "Budget": "pytest_gpumem.budgets.formulas",
    "mlp_activations": "pytest_gpumem.budgets.formulas",
    "transformer_layer_activations": "pytest_gpumem.budgets.formulas",
    "register_optimizer": "pytest_gpumem.budgets.optimizers",
    "OptimizerState": "pytest_gpumem.budgets.optimizers",
    "parse_budget": "pytest_gpumem.budgets.expressions",
    # sizes and tolerances
    "Tolerance": "pytest_gpumem.data.findings",
    "parse_tolerance": "pytest_gpumem.data.findings",
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
    from pytest_gpumem.budgets.expressions import parse_budget
    from pytest_gpumem.budgets.formulas import (
        Budget,
        count_parameters,
        mlp_activations,
        model_states,
        transformer_layer_activations,
    )
    from pytest_gpumem.budgets.optimizers import OptimizerState, register_optimizer
    from pytest_gpumem.data.figures import CompiledCodeNotMeasured, Measurement, Phase, Timeline
    from pytest_gpumem.data.findings import Tolerance, parse_tolerance
    from pytest_gpumem.data.metrics import CATEGORIES, METRICS, PHASES
    from pytest_gpumem.diagnose.census import LiveTensor, live_tensors
    from pytest_gpumem.diagnose.distributed import DistributedError, RankContext, run_ranks
    from pytest_gpumem.diagnose.leaks import LeakCheck, confirm_leak, snapshot_storages
    from pytest_gpumem.diagnose.microbatch import MicrobatchError, Plan, max_microbatch, plan_accumulation, plan_for
    from pytest_gpumem.diagnose.oom import OomReport, OomWatch, is_oom, oom_report, release_oom
    from pytest_gpumem.judge.limits import LimitExceeded
    from pytest_gpumem.measurement.active import measure
    from pytest_gpumem.measurement.devicelimit import device_limit
    from pytest_gpumem.measurement.engines import make_engine
    from pytest_gpumem.measurement.recorder import Span
    from pytest_gpumem.plugin.fixture import GpuMem
    from pytest_gpumem.units import format_size, parse_size
