"""What makes memory figures comparable: :class:`Environment` and its key (torch imported only in ``detect``)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.units import format_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALLOCATOR_VARIABLES",
    "ENGINES",
    "KEYED_FIELDS",
    "Environment",
    "allocator_settings",
    "check_key_text",
    "check_label",
]

#: Engines an :class:`Environment` can describe (see :class:`~pytest_gpumem.data.figures.Measurement`).
ENGINES: tuple[str, ...] = ("cuda", "cpu", "predict")

#: Environment variables that change what the caching allocator holds, in key order; only set ones are recorded.
ALLOCATOR_VARIABLES: tuple[str, ...] = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "TORCH_CUBLAS_WORKSPACE_CACHE",
)

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)")


@dataclass(frozen=True)
class Environment(Coded):
    """What makes memory figures comparable between two runs: runs with the same :attr:`key` compare their figures.

    ``engine`` is one of :data:`ENGINES` (``"predict"``: the CPU engine predicting the GPU the device fields describe);
    ``None`` is a value that could not be found out; ``labels`` are user-chosen ``(name, value)`` pairs (or a mapping).
    The CPU engine's key holds only the engine, torch ``major.minor``, ``cuda_rounding`` and labels: its storage bytes
    do not depend on the CPU or the CUDA build.
    """

    engine: str = field(metadata=coded(missing="unknown"))
    device_name: str | None = None
    total_memory: int | None = field(default=None, metadata=coded(read=lambda v: v if type(v) is int else None))
    compute_capability: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    allocator: tuple[tuple[str, str], ...] | None = field(
        default=None,
        metadata=coded(
            write=lambda v: None if v is None else dict(v),
            read=lambda v: _allocator_pairs(v) if isinstance(v, Mapping) else None,
        ),
    )
    cuda_rounding: bool | None = field(default=None, metadata=coded(read=lambda v: v if type(v) is bool else None))
    labels: tuple[tuple[str, str], ...] = field(  # left out when there are none: older files keep their bytes
        default=(),
        metadata=coded(omit=True, write=dict, read=lambda v: _label_pairs(v) if isinstance(v, Mapping) else ()),
    )

    def __post_init__(self) -> None:
        for name in KEYED_FIELDS:
            check_key_text(name, getattr(self, name))
        for name, value in self.allocator or ():
            check_key_text(f"allocator {name}", f"{name}={value}")
        object.__setattr__(self, "labels", _label_pairs(self.labels))

    @classmethod
    def detect(
        cls,
        engine: str,
        device: torch.device | str | None = None,
        cuda_rounding: bool = False,
        *,
        predict: str | None = None,
    ) -> Environment:
        """The running process's environment for ``engine`` on ``device``, without labels; unreadable properties are
        ``None`` (a missing or broken device raises nothing)."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
        import torch

        torch_version = _major_minor(torch.__version__)
        if engine == "cpu":
            return cls(engine="cpu", torch_version=torch_version, cuda_rounding=bool(cuda_rounding))
        if engine == "predict":  # the target GPU's name, as the CPU run's torch predicts it
            from pytest_gpumem.targets import target

            if predict is None:
                raise ValueError("engine 'predict' needs predict=<the target GPU>")
            gpu = target(predict)
            return cls(
                engine="predict",
                device_name=gpu.device_name,
                total_memory=gpu.total_memory,
                compute_capability=gpu.compute_capability,
                torch_version=torch_version,
                allocator=(),
            )
        dev = torch.device(device if device is not None else "cuda")
        hip = getattr(torch.version, "hip", None)
        name, total, capability = _device_properties(dev, rocm=bool(hip))
        cuda_like = dev.type == "cuda"
        cudnn: int | None = None
        if cuda_like:
            cudnn_query: Callable[[], int | None] = torch.backends.cudnn.version
            with contextlib.suppress(Exception):  # a broken cuDNN install
                cudnn = cudnn_query()
        return cls(
            engine="cuda",
            device_name=name,
            total_memory=total,
            compute_capability=capability,
            torch_version=torch_version,
            cuda_version=_major_minor(torch.version.cuda) if cuda_like and not hip else None,
            hip_version=_major_minor(hip) if cuda_like and hip else None,
            cudnn_version=None if cudnn is None else str(cudnn),
            allocator=allocator_settings(os.environ),
        )

    @property
    def key(self) -> str:
        """The fields that make figures comparable joined by ``" | "``, labels last: ``"cpu | torch 2.13 | cuda_rounding
        off"``."""
        labels = [f"{name}={value}" for name, value in self.labels]
        if self.engine == "cpu":
            rounding = "unknown" if self.cuda_rounding is None else ("on" if self.cuda_rounding else "off")
            return " | ".join(("cpu", f"torch {_shown(self.torch_version)}", f"cuda_rounding {rounding}", *labels))
        parts = [
            self.engine,
            _shown(self.device_name),
            "memory unknown" if self.total_memory is None else format_size(self.total_memory, precision=0),
            f"cc {_shown(self.compute_capability)}",
            f"torch {_shown(self.torch_version)}",
        ]
        if self.hip_version is not None:
            parts += [f"HIP {self.hip_version}", f"MIOpen {_shown(self.cudnn_version)}"]
        elif self.cuda_version is not None:
            parts += [f"CUDA {self.cuda_version}", f"cuDNN {_shown(self.cudnn_version)}"]
        if self.allocator is None:
            parts.append("allocator unknown")
        else:
            parts += [f"{name}={value}" for name, value in self.allocator] or ["default allocator"]
        return " | ".join(parts + labels)


def allocator_settings(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The :data:`ALLOCATOR_VARIABLES` set (non-blank) in ``environ``, as ``(name, stripped value)`` pairs."""
    return tuple((name, environ[name].strip()) for name in ALLOCATOR_VARIABLES if environ.get(name, "").strip())


#: The text fields an environment key shows (:attr:`Environment.key`), checked with :func:`check_key_text`.
KEYED_FIELDS: tuple[str, ...] = (
    "engine",
    "device_name",
    "compute_capability",
    "torch_version",
    "cuda_version",
    "hip_version",
    "cudnn_version",
)
#: The keyed fields the key shows as 'unknown' when None (every one but the engine, which is never None).
_SHOWS_NONE = frozenset(KEYED_FIELDS) - {"engine"}

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _problem(text: str, *, empty: str, spaces: str) -> str | None:
    """What makes ``text`` unfit for a part of an environment key (``empty`` or ``spaces`` where it is blank or padded),
    or None."""
    if "|" in text:
        return "contains '|' (the key's separator)"
    if "\n" in text or "\r" in text:
        return "contains a line break"
    control = _CONTROL.search(text)
    if control is not None:
        return f"contains the control character {control.group()!r}"
    if not text:
        return empty
    return spaces if text != text.strip() else None


def check_key_text(what: str, text: object) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``text``, if a string, can be a part of an environment key."""
    if not isinstance(text, str):
        return
    blank = "is empty or has leading or trailing spaces"
    problem = _problem(text, empty=blank, spaces=blank)
    if problem is None and what in _SHOWS_NONE and text == "unknown":
        problem = "is 'unknown', which the key shows for None: use None"
    if problem is not None:
        raise ValueError(f"invalid environment {what} {text!r}: it {problem}")


def check_label(name: object, value: object) -> None:
    """Raise ``ValueError`` naming the label unless ``name=value`` can be part of an environment key."""
    shown = repr(f"{name}={value}") if isinstance(name, str) and isinstance(value, str) else f"{name!r}={value!r}"
    for what, text in (("name", name), ("value", value)):
        if not isinstance(text, str):
            raise ValueError(f"invalid environment label {shown}: the {what} must be a string")
        problem = _problem(text, empty="is empty", spaces="has leading or trailing spaces")
        if problem is not None:
            raise ValueError(f"invalid environment label {shown}: the {what} {problem}")
    assert isinstance(name, str)
    if "=" in name:
        raise ValueError(f"invalid environment label {shown}: the name contains '='")
    if name in ALLOCATOR_VARIABLES:
        raise ValueError(f"invalid environment label {shown}: {name} is an allocator variable, keyed already")


def _label_pairs(labels: Mapping[str, Any] | Iterable[Any]) -> tuple[tuple[str, str], ...]:
    """``labels`` (pairs or a mapping) checked with :func:`check_label`, as pairs sorted by name."""
    if not isinstance(labels, (Mapping, tuple, list)):
        raise ValueError(f"invalid environment labels {labels!r}: expected (name, value) pairs or a mapping")
    pairs: dict[str, str] = {}
    for item in labels.items() if isinstance(labels, Mapping) else labels:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"invalid environment label {item!r}: expected a (name, value) pair")
        name, value = item
        check_label(name, value)
        if name in pairs:
            raise ValueError(f"invalid environment labels: the name {name!r} appears twice")
        pairs[name] = value
    return tuple(sorted(pairs.items()))


def _allocator_pairs(settings: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """``settings`` as ``(name, value)`` pairs in :data:`ALLOCATOR_VARIABLES` order, other names after, sorted."""
    return tuple((str(name), str(settings[name])) for name in sorted(settings, key=allocator_rank))


def allocator_rank(name: str) -> tuple[int, str]:
    """Sort key of an allocator variable: :data:`ALLOCATOR_VARIABLES` order, other names after, by name."""
    return (ALLOCATOR_VARIABLES.index(name), "") if name in ALLOCATOR_VARIABLES else (len(ALLOCATOR_VARIABLES), name)


def _device_properties(device: torch.device, *, rocm: bool) -> tuple[str | None, int | None, str | None]:
    """Name, total memory (bytes) and compute capability of ``device``; ``None`` for what cannot be read."""
    import torch

    try:
        props = getattr(torch, device.type).get_device_properties(device)
    except Exception:
        return None, None, None
    name, total, arch = (getattr(props, key, None) for key in ("name", "total_memory", "gcnArchName"))
    capability: str | None = None
    if rocm and arch:
        capability = str(arch).split(":")[0]  # drop feature flags such as ":sramecc+:xnack-"
    elif isinstance(getattr(props, "major", None), int) and isinstance(getattr(props, "minor", None), int):
        capability = f"{props.major}.{props.minor}"
    return None if name is None else str(name), total if isinstance(total, int) else None, capability


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    match = _VERSION_RE.match(str(version))
    return f"{match[1]}.{match[2]}" if match else str(version)


def _shown(value: str | None) -> str:
    return "unknown" if value is None else value
