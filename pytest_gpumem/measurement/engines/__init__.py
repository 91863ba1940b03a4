"""Where bytes are read: the engines (the ``Engine`` protocol, the capabilities one may offer), and their factory."""

from __future__ import annotations

import re

import torch

from pytest_gpumem.measurement.engines.base import Categories, Engine, Reading, Runtime, SiteRecording, Workspaces
from pytest_gpumem.measurement.engines.compiled import describe_compiled
from pytest_gpumem.measurement.engines.cpu import CpuEngine
from pytest_gpumem.measurement.engines.cuda import CudaEngine, cuda_available, cuda_device_count
from pytest_gpumem.measurement.engines.storages import unseen_note
from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.measurement.observe import observe_conflict, parse_observe

__all__ = [
    "DEVICE_HELP",
    "Categories",
    "Engine",
    "Reading",
    "Runtime",
    "SiteRecording",
    "StorageTracker",
    "Workspaces",
    "cuda_available",
    "cuda_device_count",
    "describe_compiled",
    "make_engine",
    "resolve_device",
    "unseen_note",
]

#: The device names pytest-gpumem accepts, as error messages spell them.
DEVICE_HELP = "use 'auto', 'cpu', 'cuda' or 'cuda:N'"

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a name stands for (``"auto"``: CUDA when available, else the CPU); ``ValueError`` otherwise."""
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    if isinstance(device, torch.device):
        resolved = device
    else:
        match = _DEVICE_RE.match(device) if isinstance(device, str) else None
        if match is None or match[1] == "auto":
            raise ValueError(f"device={device!r} is not a device: {DEVICE_HELP}")
        resolved = torch.device(device)
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(resolved)!r} is not supported: {DEVICE_HELP}")
    if resolved.type == "cuda" and resolved.index is None and cuda_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def make_engine(
    device: str | torch.device | None = "auto",
    *,
    breakdown: bool = False,
    cuda_rounding: bool = False,
    observe: str = "operators",
    predict: str | None = None,
) -> Engine:
    """An engine reading ``device`` (a name such as ``"cpu"``, ``"cuda:0"``, ``"auto"``, or a ``torch.device``).

    ``breakdown``: run the storage tracker beside a CUDA allocator (a Python call per operator); ``cuda_rounding``:
    count CPU storages as 512-byte blocks; ``observe``: ``"operators"`` or ``"allocations"`` (CPU only); ``predict``: a
    GPU (``"h100"``) whose allocator the CPU engine's figures predict.
    """
    parse_observe(observe)
    resolved = resolve_device(device)
    if predict is not None:
        from pytest_gpumem.measurement.engines.predict import PredictEngine
        from pytest_gpumem.targets import target

        if resolved.type != "cpu":
            raise ValueError(f"predict={predict!r} runs on the CPU engine, not on {str(resolved)!r}")
        conflict = observe_conflict(observe, predict=predict)
        if conflict is not None:
            raise ValueError(conflict)
        return PredictEngine(target(predict))
    if resolved.type == "cpu":
        if observe == "allocations":
            from pytest_gpumem.measurement.engines.allocations import AllocationTracker

            return CpuEngine(tracker=AllocationTracker(resolved, cuda_rounding=cuda_rounding))
        return CpuEngine(cuda_rounding=cuda_rounding)
    if observe == "allocations":
        raise ValueError(
            f"observe='allocations' is implemented for the CPU engine, not {str(resolved)!r}: on CUDA the "
            "caching allocator's figures are already those of the code that runs, compiled or not"
        )
    if not cuda_available() or (resolved.index or 0) >= cuda_device_count():
        raise ValueError(f"device {str(resolved)!r} is not available ({cuda_device_count()} CUDA devices visible)")
    tracker = StorageTracker(resolved, cuda_rounding=True) if breakdown else None
    return CudaEngine(resolved, tracker=tracker)
