"""The public names of pytest-gpumem, listed once: this stub is what type checkers read, and
``__init__.py`` loads each name from the module named here on first use, so that pytest can
load the plugin without importing torch when no test is measured."""

from .budgets.expressions import (
    parse_budget as parse_budget,
)
from .budgets.formulas import (
    Budget as Budget,
)
from .budgets.formulas import (
    count_parameters as count_parameters,
)
from .budgets.formulas import (
    mlp_activations as mlp_activations,
)
from .budgets.formulas import (
    model_states as model_states,
)
from .budgets.formulas import (
    transformer_layer_activations as transformer_layer_activations,
)
from .budgets.optimizers import (
    OptimizerState as OptimizerState,
)
from .budgets.optimizers import (
    register_optimizer as register_optimizer,
)
from .data.figures import (
    CompiledCodeNotMeasured as CompiledCodeNotMeasured,
)
from .data.figures import (
    Measurement as Measurement,
)
from .data.figures import (
    OutputNotWritten as OutputNotWritten,
)
from .data.figures import (
    Phase as Phase,
)
from .data.figures import (
    Timeline as Timeline,
)
from .data.findings import (
    Tolerance as Tolerance,
)
from .data.findings import (
    parse_tolerance as parse_tolerance,
)
from .data.metrics import (
    CATEGORIES as CATEGORIES,
)
from .data.metrics import (
    METRICS as METRICS,
)
from .data.metrics import (
    PHASES as PHASES,
)
from .diagnose.census import (
    LiveTensor as LiveTensor,
)
from .diagnose.census import (
    live_tensors as live_tensors,
)
from .diagnose.distributed import (
    DistributedError as DistributedError,
)
from .diagnose.distributed import (
    RankContext as RankContext,
)
from .diagnose.distributed import (
    run_ranks as run_ranks,
)
from .diagnose.leaks import (
    LeakCheck as LeakCheck,
)
from .diagnose.leaks import (
    confirm_leak as confirm_leak,
)
from .diagnose.leaks import (
    snapshot_storages as snapshot_storages,
)
from .diagnose.microbatch import (
    MicrobatchError as MicrobatchError,
)
from .diagnose.microbatch import (
    Plan as Plan,
)
from .diagnose.microbatch import (
    max_microbatch as max_microbatch,
)
from .diagnose.microbatch import (
    plan_accumulation as plan_accumulation,
)
from .diagnose.microbatch import (
    plan_for as plan_for,
)
from .diagnose.oom import (
    OomReport as OomReport,
)
from .diagnose.oom import (
    OomWatch as OomWatch,
)
from .diagnose.oom import (
    is_oom as is_oom,
)
from .diagnose.oom import (
    oom_report as oom_report,
)
from .diagnose.oom import (
    release_oom as release_oom,
)
from .judge.limits import (
    LimitExceeded as LimitExceeded,
)
from .measurement.active import (
    measure as measure,
)
from .measurement.devicelimit import (
    device_limit as device_limit,
)
from .measurement.engines import (
    make_engine as make_engine,
)
from .measurement.engines.fake import (
    FakeModeError as FakeModeError,
)
from .measurement.engines.fake import (
    FakeTensorsDiffer as FakeTensorsDiffer,
)
from .measurement.recorder import (
    Span as Span,
)
from .plugin.fixture import (
    GpuMem as GpuMem,
)
from .units import (
    format_size as format_size,
)
from .units import (
    parse_size as parse_size,
)

__version__: str
