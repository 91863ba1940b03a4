"""Baseline files: environment keys, load, merge, atomic save.

A baseline is the figures one test recorded in one :class:`Environment`,
committed to the repository and compared on later runs. All figures are bytes.
Baselines store *costs* (a figure minus its span's start, see
:meth:`pytest_gpumem.figures.Measurement.cost`), so test order, ``-k``, xdist and
session fixtures do not move them; the absolute ``start`` and the ``breakdown``
at the peak are kept for information.

The file is JSON (UTF-8, 2-space indent, newline at the end, canonical key
order) so that a pull request's diff shows which test's memory changed::

    {
      "schema": 1,
      "environments": {
        "cpu | torch 2.13 | cuda_rounding off": {
          "environment": {"engine": "cpu", ..., "cuda_rounding": false},
          "tests": {
            "tests/test_train.py::test_step": {
              "spans": {
                "call": {"peak": 1024, "allocated": 512, "reserved": null, "start": 0, "breakdown": {...}},
                "step": {...}
              }
            }
          }
        }
      }
    }

(the real file puts every value on its own line). Keys this release does not
know are kept verbatim when the file is rewritten, at every level, so an older
release never destroys what a newer one added within the same schema version.

This module never imports pytest; :func:`load` and :func:`save` are the only
functions that touch the file system. Nothing is ever pickled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import json.encoder
import operator
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpumem.figures import CATEGORIES, METRICS, Measurement
from pytest_gpumem.units import format_size

if TYPE_CHECKING:
    import torch

_encode_string: Callable[[str], str] = json.encoder.encode_basestring  # the C version where available

__all__ = [
    "ALLOCATOR_VARIABLES",
    "BASELINE_METRICS",
    "CALL_SPAN",
    "ENGINES",
    "ORPHAN_AGE_S",
    "SCHEMA_VERSION",
    "BaselineEntry",
    "BaselineFileError",
    "BaselineStore",
    "Environment",
    "StaleEntry",
    "allocator_settings",
    "load",
    "parse",
    "save",
]

#: Version of the file layout this release writes and the only one it reads.
#: Adding keys does not change it (older releases keep keys they do not know);
#: changing the meaning or type of an existing key does.
SCHEMA_VERSION = 1

#: The span that covers a whole test call; other spans are ``gpumem.measure(name)`` blocks.
CALL_SPAN = "call"

#: Figures whose cost :meth:`BaselineStore.record` stores for every span by default.
BASELINE_METRICS: tuple[str, ...] = ("peak", "allocated", "reserved")

#: Engines an :class:`Environment` can describe (see :class:`~pytest_gpumem.figures.Measurement`).
ENGINES: tuple[str, ...] = ("cuda", "cpu")

#: Environment variables that change what the caching allocator holds, in the
#: order they appear in an environment key. Only the ones that are set are recorded.
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

# Canonical key order inside the file. Keys not listed come after, sorted.
_TOP_ORDER = ("schema", "environments")
_ENV_ORDER = ("environment", "tests")
_TEST_ORDER = ("spans",)
_SPAN_ORDER = (*METRICS, "start", "breakdown")
# Span keys whose type this release checks (bytes or null) when loading.
_SPAN_INT_KEYS = frozenset((*METRICS, "start"))

_CONFLICT_MARKERS = ("<" * 7, "=" * 7, ">" * 7, "|" * 7)
_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)")
_HINT_RESTORE = (
    "Restore it from version control (e.g. `git checkout -- {path}`), or delete it and record the "
    "baselines again with `pytest --gpumem-update-baselines`."
)
_HINT_CONFLICT = (
    "Resolve the merge conflict first: keep one side of each conflicting block (for instance "
    "`git checkout --theirs -- {path}`), then run `pytest --gpumem-update-baselines` to record "
    "the tests your branch changed again."
)
_HINT_SAVE = "Nothing was written. Load the file again (a fresh pytest run does) before recording baselines into it."


class BaselineFileError(Exception):
    """A baseline file that cannot be read or must not be written.

    The message names the file, the line and column where the problem is known
    (``path:line:column: problem``) and what to do about it. The parts are also
    available as attributes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        problem: str,
        *,
        line: int | None = None,
        column: int | None = None,
        hint: str = "",
    ) -> None:
        self.path = Path(path)
        self.problem = problem
        self.line = line
        self.column = column
        self.hint = hint
        location = str(path)
        if line is not None:
            location += f":{line}"
            if column is not None:
                location += f":{column}"
        message = f"{location}: {problem}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)


# --------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class Environment:
    """What makes memory figures comparable between two runs.

    Two runs whose environments have the same :attr:`key` compare their figures
    with each other; figures recorded under another key are kept side by side
    and never compared. A value that could not be found out is ``None`` and
    shows as ``unknown`` in the key.

    Attributes:
        engine: ``"cuda"`` (a device's caching allocator: CUDA, ROCm, XPU) or
            ``"cpu"`` (the exact tensor-storage tracker).
        device_name: the device model, e.g. ``"NVIDIA H100 80GB HBM3"``;
            ``None`` on the CPU engine.
        total_memory: device memory in bytes as the runtime reports it;
            ``None`` on the CPU engine.
        compute_capability: ``"9.0"`` on CUDA, the ``gfx`` architecture on ROCm
            (``"gfx90a"``); ``None`` elsewhere.
        torch_version: PyTorch ``major.minor`` (``"2.13"``).
        cuda_version: the CUDA version PyTorch was built with (``"12.8"``);
            ``None`` on ROCm, XPU and the CPU engine.
        hip_version: the HIP version of a ROCm build (``"6.2"``); else ``None``.
        cudnn_version: cuDNN's (MIOpen's on ROCm) integer version as PyTorch
            reports it (``"91002"``); ``None`` when unavailable or on the CPU engine.
        allocator: ``(name, value)`` of each :data:`ALLOCATOR_VARIABLES` that is
            set, in that order; ``()`` means all defaults; ``None`` on the CPU
            engine, where the caching allocator plays no part.
        cuda_rounding: CPU engine only: whether each storage was rounded up to
            the CUDA caching allocator's 512-byte blocks. ``None`` on ``"cuda"``.

    The CPU engine counts tensor-storage bytes: they depend on PyTorch (which
    tensors autograd saves, how optimizers lay out their state) and on the
    rounding option, but not on the CPU model, its memory or the CUDA build of
    torch. Its key therefore holds only the engine, torch ``major.minor`` and
    ``cuda_rounding``, so that baselines recorded on a laptop hold on any CI
    runner.
    """

    engine: str
    device_name: str | None = None
    total_memory: int | None = None
    compute_capability: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    allocator: tuple[tuple[str, str], ...] | None = None
    cuda_rounding: bool | None = None

    @classmethod
    def detect(cls, engine: str, device: torch.device | str | None = None, cuda_rounding: bool = False) -> Environment:
        """Describe the environment of the running process for ``engine`` on ``device``.

        ``cuda_rounding`` is the CPU engine's rounding option and is ignored
        for ``"cuda"``. Properties that cannot be read are ``None``; this never
        raises for a missing or broken device. Raises ``ValueError`` for an
        unknown engine.
        """
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
        import torch

        torch_version = _major_minor(torch.__version__)
        if engine == "cpu":
            return cls(engine="cpu", torch_version=torch_version, cuda_rounding=bool(cuda_rounding))
        dev = torch.device(device if device is not None else "cuda")
        hip = getattr(torch.version, "hip", None)
        name, total, capability = _device_properties(dev, rocm=bool(hip))
        cuda_like = dev.type == "cuda"
        cuda_version = _major_minor(torch.version.cuda) if cuda_like and not hip else None
        hip_version = _major_minor(hip) if cuda_like and hip else None
        cudnn_version: str | None = None
        if cuda_like:
            cudnn_query: Callable[[], int | None] = torch.backends.cudnn.version
            try:
                number = cudnn_query()
            except Exception:  # pragma: no cover - defensive: a broken cuDNN install
                number = None
            cudnn_version = None if number is None else str(number)
        return cls(
            engine="cuda",
            device_name=name,
            total_memory=total,
            compute_capability=capability,
            torch_version=torch_version,
            cuda_version=cuda_version,
            hip_version=hip_version,
            cudnn_version=cudnn_version,
            allocator=allocator_settings(os.environ),
            cuda_rounding=None,
        )

    @property
    def key(self) -> str:
        """A stable, human-readable key: the parts that make figures comparable, joined by ``" | "``.

        Examples: ``"cpu | torch 2.13 | cuda_rounding off"`` and
        ``"cuda | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch 2.13 | CUDA 12.8 | cuDNN 91002 |
        default allocator"``. The key is a function of the fields above, so it
        can be recomputed from the ``environment`` object stored in the file.
        """
        if self.engine == "cpu":
            rounding = "unknown" if self.cuda_rounding is None else ("on" if self.cuda_rounding else "off")
            return " | ".join(("cpu", f"torch {_shown(self.torch_version)}", f"cuda_rounding {rounding}"))
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
        elif not self.allocator:
            parts.append("default allocator")
        else:
            parts += [f"{name}={value}" for name, value in self.allocator]
        return " | ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict in field order; ``allocator`` becomes an object ``{name: value}``."""
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "allocator" and value is not None:
                value = dict(value)
            data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Environment:
        """Rebuild an environment written by :meth:`to_dict`; missing keys are ``None``, unknown ones ignored."""
        allocator = data.get("allocator")
        total = data.get("total_memory")
        rounding = data.get("cuda_rounding")
        if not isinstance(allocator, Mapping):
            allocator = None
        return cls(
            engine=str(data.get("engine", "unknown")),
            device_name=_opt_str(data.get("device_name")),
            total_memory=total if type(total) is int else None,
            compute_capability=_opt_str(data.get("compute_capability")),
            torch_version=_opt_str(data.get("torch_version")),
            cuda_version=_opt_str(data.get("cuda_version")),
            hip_version=_opt_str(data.get("hip_version")),
            cudnn_version=_opt_str(data.get("cudnn_version")),
            allocator=None if allocator is None else _allocator_pairs(allocator),
            cuda_rounding=rounding if isinstance(rounding, bool) else None,
        )


def allocator_settings(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The :data:`ALLOCATOR_VARIABLES` set (non-blank) in ``environ``, as ``(name, stripped value)`` pairs."""
    return tuple((name, environ[name].strip()) for name in ALLOCATOR_VARIABLES if environ.get(name, "").strip())


def _allocator_pairs(settings: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """``settings`` as ``(name, value)`` pairs in :data:`ALLOCATOR_VARIABLES` order, other names after, sorted."""
    return tuple((str(name), str(settings[name])) for name in sorted(settings, key=_allocator_rank))


def _allocator_rank(name: str) -> tuple[int, str]:
    return (ALLOCATOR_VARIABLES.index(name), "") if name in ALLOCATOR_VARIABLES else (len(ALLOCATOR_VARIABLES), name)


def _device_properties(device: torch.device, *, rocm: bool) -> tuple[str | None, int | None, str | None]:
    """Name, total memory (bytes) and compute capability of ``device``; ``None`` for what cannot be read."""
    import torch

    try:
        module = getattr(torch, device.type)
        props = module.get_device_properties(device)
    except Exception:
        return None, None, None
    name = getattr(props, "name", None)
    total = getattr(props, "total_memory", None)
    capability: str | None = None
    arch = getattr(props, "gcnArchName", None)
    if rocm and arch:
        capability = str(arch).split(":")[0]  # drop feature flags such as ":sramecc+:xnack-"
    elif isinstance(getattr(props, "major", None), int) and isinstance(getattr(props, "minor", None), int):
        capability = f"{props.major}.{props.minor}"
    return (
        None if name is None else str(name),
        total if isinstance(total, int) else None,
        capability,
    )


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    match = _VERSION_RE.match(str(version))
    return f"{match[1]}.{match[2]}" if match else str(version)


def _shown(value: str | None) -> str:
    return "unknown" if value is None else value


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class BaselineEntry:
    """The baseline of one span of one test in one environment.

    Attributes:
        costs: metric name → recorded cost (bytes for the figures of
            :data:`~pytest_gpumem.figures.METRICS`; another unit for metrics a
            later feature adds), ``None`` where the engine could not know it.
        start: allocated bytes when the span began (absolute; for information,
            never compared).
        breakdown: bytes by category at the peak (absolute, sums to the
            absolute peak); ``None`` when not measured.
        extra: keys of the span this release does not know, kept verbatim.
    """

    costs: Mapping[str, int | None]
    start: int | None = None
    breakdown: Mapping[str, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_measurement(
        cls,
        measurement: Measurement,
        metrics: Iterable[str] = BASELINE_METRICS,
        *,
        extra_costs: Mapping[str, int | None] | None = None,
    ) -> BaselineEntry:
        """The entry that records ``measurement``: ``measurement.cost(m)`` for each of ``metrics``.

        ``extra_costs`` adds figures that a :class:`Measurement` does not carry
        (for a later metric such as ``max_microbatch``).
        """
        costs: dict[str, int | None] = {metric: measurement.cost(metric) for metric in metrics}
        if extra_costs:
            costs.update(extra_costs)
        breakdown: dict[str, int] | None = None
        if measurement.breakdown is not None:  # every category, 0 where absent, as Measurement.to_dict writes it
            breakdown = {c: int(measurement.breakdown.get(c, 0)) for c in CATEGORIES}
            breakdown.update((c, int(v)) for c, v in measurement.breakdown.items() if c not in breakdown)
        return cls(costs=costs, start=measurement.start, breakdown=breakdown)

    def cost(self, metric: str) -> int | None:
        """The recorded cost of ``metric``; ``None`` when unknown or not recorded."""
        return self.costs.get(metric)

    def to_dict(self) -> dict[str, Any]:
        """The span object as the file stores it (canonical key order, ``breakdown`` absent when ``None``)."""
        return _canonical_span(self._raw())

    def _raw(self) -> dict[str, Any]:
        """:meth:`to_dict` without the canonical ordering (the store orders when it writes)."""
        data: dict[str, Any] = dict(self.extra) if self.extra else {}
        data.update(self.costs)
        data["start"] = self.start
        if self.breakdown is not None:
            data["breakdown"] = dict(self.breakdown)
        else:
            data.pop("breakdown", None)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaselineEntry:
        """Read a span object: integer or null values are costs, ``start`` and ``breakdown`` are
        themselves, anything else goes to :attr:`extra`."""
        costs: dict[str, int | None] = {}
        extra: dict[str, Any] = {}
        start: int | None = None
        breakdown: Mapping[str, int] | None = None
        for key, value in data.items():
            if key == "start":
                start = value if type(value) is int else None
            elif key == "breakdown":
                breakdown = None if value is None else dict(value)
            elif value is None or type(value) is int:
                costs[key] = value
            else:
                extra[key] = value
        return cls(costs, start, breakdown, extra)


@dataclass(frozen=True)
class StaleEntry:
    """A test that has baselines in ``environment`` but no longer exists; ``spans`` are its recorded spans."""

    environment: str
    test: str
    spans: tuple[str, ...]


# --------------------------------------------------------------------------- the store


class BaselineStore:
    """All baselines of one file, in memory.

    The store keeps the JSON tree it was loaded from, so keys this release does
    not know survive a rewrite; lookups build :class:`BaselineEntry` objects on
    demand. Get one with :func:`load` (a missing file gives an empty store)
    or ``BaselineStore()`` for a file that does not exist yet; write it with
    :func:`save`.
    """

    def __init__(self) -> None:
        self._top: dict[str, Any] = {"schema": SCHEMA_VERSION, "environments": {}}
        self._envs: dict[str, Any] = self._top["environments"]
        #: The file this store was loaded from or last saved to, if any.
        self.path: Path | None = None
        self._fingerprint: tuple[int, int, int, int] | None = None
        self._digest: bytes | None = None
        self._described: set[str] = set()  # environments whose description record() completed

    # -- reading -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of (environment, test) pairs with baselines."""
        return sum(len(env.get("tests", {})) for env in self._envs.values())

    def environment_keys(self) -> tuple[str, ...]:
        """Keys of every environment in the store, sorted."""
        return tuple(sorted(self._envs))

    def environment(self, key: str) -> Environment | None:
        """The environment stored under ``key``; ``None`` when there is none."""
        env = self._envs.get(key)
        return None if env is None else Environment.from_dict(env.get("environment") or {})

    def tests(self, environment: str) -> tuple[str, ...]:
        """Node ids with baselines in the environment keyed ``environment``, sorted."""
        env = self._envs.get(environment)
        return () if env is None else tuple(sorted(env.get("tests", {})))

    def spans(self, environment: str, test: str) -> dict[str, BaselineEntry]:
        """Every span baseline of ``test`` in ``environment``: span name → entry (empty when none)."""
        raw = self._raw_test(environment, test)
        if raw is None:
            return {}
        return {name: BaselineEntry.from_dict(span) for name, span in _span_items(raw.get("spans", {}))}

    def entry(self, environment: str, test: str, span: str = CALL_SPAN) -> BaselineEntry | None:
        """The baseline of ``span`` of ``test`` in ``environment``; ``None`` when there is none."""
        raw = self._raw_test(environment, test)
        if raw is None:
            return None
        data = raw.get("spans", {}).get(span)
        return None if data is None else BaselineEntry.from_dict(data)

    def environments_with(self, test: str, *, exclude: str | None = None) -> tuple[str, ...]:
        """Keys of the environments that have baselines for ``test`` (sorted), leaving out ``exclude``.

        With ``exclude`` set to the current key this answers "baselines only for: ...".
        """
        return tuple(sorted(k for k, env in self._envs.items() if k != exclude and test in env.get("tests", {})))

    def _raw_test(self, environment: str, test: str) -> dict[str, Any] | None:
        env = self._envs.get(environment)
        if env is None:
            return None
        raw: dict[str, Any] | None = env.get("tests", {}).get(test)
        return raw

    # -- updating ----------------------------------------------------------------------

    def record(
        self,
        environment: Environment,
        test: str,
        spans: Iterable[Measurement] | Mapping[str, BaselineEntry],
    ) -> None:
        """Record the baselines of a test that ran: ``spans`` are its measurements (or entries by span name).

        The test's span set is replaced: a span the test no longer measures (a
        renamed ``measure()`` block) disappears. Everything else is left as it
        was: other tests, other environments, and the keys this release does
        not know at every level (including inside the spans recorded again).
        Raises ``ValueError`` when two measurements share a span name.
        """
        entries: dict[str, BaselineEntry] = {}
        if isinstance(spans, Mapping):
            entries = dict(spans)
        else:
            for measurement in spans:
                if measurement.name in entries:
                    raise ValueError(f"{test}: two measurements of the span {measurement.name!r}")
                entries[measurement.name] = BaselineEntry.from_measurement(measurement)
        key = environment.key
        env = self._envs.get(key)
        if env is None:
            env = self._envs[key] = {"environment": environment.to_dict(), "tests": {}}
        elif key not in self._described:
            # values already there win: machines that share a key may differ in what the key
            # rounds (total memory in whole GiB), and rewriting it on every update would churn
            env["environment"] = {**environment.to_dict(), **(env.get("environment") or {})}
            env.setdefault("tests", {})
        self._described.add(key)
        tests: dict[str, Any] = env["tests"]
        old_test: dict[str, Any] = tests.get(test) or {}
        old_spans: dict[str, Any] = old_test.get("spans") or {}
        new_spans: dict[str, Any] = {}
        for name, entry in entries.items():
            _check_entry(test, name, entry)
            written = entry._raw()
            old = old_spans.get(name)
            if old:
                # keep what this entry does not write; drop a breakdown it no longer has
                kept = {k: v for k, v in old.items() if k not in written and k != "breakdown"}
                if kept:
                    written = {**kept, **written}
            new_spans[name] = written
        tests[test] = {**old_test, "spans": new_spans}

    def remove(self, environment: str, test: str) -> bool:
        """Remove every baseline of ``test`` in ``environment``; True when there was one.

        An environment left without tests is removed too, unless it holds keys
        this release does not know.
        """
        env = self._envs.get(environment)
        if env is None or test not in env.get("tests", {}):
            return False
        del env["tests"][test]
        if not env["tests"] and set(env) <= set(_ENV_ORDER):
            del self._envs[environment]
        return True

    def stale(
        self, collected: Iterable[str], environment: str | None, *, roots: Iterable[str] | None = None
    ) -> list[StaleEntry]:
        """Baselines whose test no longer exists, sorted by environment then node id.

        ``collected`` are the node ids of every test pytest collected, deselected
        ones included. ``environment`` limits the search to one environment key;
        ``None`` searches all of them. ``roots`` are node-id prefixes (paths
        such as ``"tests/unit"`` or ``"tests/test_a.py"``) naming what this run
        collected; a baseline outside them is never stale. ``None`` means the
        whole suite was collected.

        The plugin passes the current environment: a test may exist only where
        it can be collected (parametrized over the available devices, or in a
        module skipped at import on machines without a library), so a run in
        one environment cannot tell that another environment's test is gone.
        """
        ids = collected if isinstance(collected, (set, frozenset)) else set(collected)
        prefixes = None if roots is None else [_normalize_root(root) for root in roots]
        keys = sorted(self._envs) if environment is None else [environment]
        found: list[StaleEntry] = []
        for key in keys:
            env = self._envs.get(key)
            if env is None:
                continue
            for test, raw in sorted(env.get("tests", {}).items()):
                if test in ids or (prefixes is not None and not any(_under(test, p) for p in prefixes)):
                    continue
                found.append(StaleEntry(key, test, tuple(name for name, _ in _span_items(raw.get("spans", {})))))
        return found

    def prune(self, stale: Iterable[StaleEntry]) -> int:
        """Remove the baselines :meth:`stale` reported; returns how many tests were removed."""
        return sum(self.remove(entry.environment, entry.test) for entry in stale)

    # -- serialising -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The whole file as a JSON-ready dict in canonical order (see the module docstring)."""
        envs = {key: _canonical_env(self._envs[key]) for key in sorted(self._envs)}
        top = {"schema": SCHEMA_VERSION, "environments": envs}
        return _ordered(self._top, _TOP_ORDER, top)

    def dumps(self) -> bytes:
        """The file's bytes: canonical JSON, UTF-8, 2-space indent, newline at the end.

        The same baselines give the same bytes whatever order they were
        recorded in, which is how parallel workers reproduce a serial run.
        """
        # The same text as ``json.dumps(self.to_dict(), indent=2, ensure_ascii=False)``, written
        # straight from the tree: five times faster than building the canonical copy and
        # letting the json module's pure-Python indenting encoder render it.
        with _gc_paused():
            return self._dumps()

    def _dumps(self) -> bytes:
        out: list[str] = [f'{{\n  "schema": {SCHEMA_VERSION},\n  "environments": ']
        if not self._envs:
            out.append("{}")
        else:
            out.append("{")
            separator = "\n"
            for key in sorted(self._envs):
                out.append(f"{separator}    {_encode_string(key)}: ")
                separator = ",\n"
                _render_env(self._envs[key], "    ", out)
            out.append("\n  }")
        _render_extra(self._top, _TOP_ORDER, "  ", out)
        out.append("\n}\n")
        return "".join(out).encode()

    @classmethod
    def _from_tree(cls, tree: dict[str, Any]) -> BaselineStore:
        store = cls()
        tree.setdefault("environments", {})
        store._top = tree
        store._envs = tree["environments"]
        return store


def _check_entry(test: str, span: str, entry: BaselineEntry) -> None:
    """Refuse values the file could not hold as integer bytes (floats, bools, strings)."""
    for metric, value in entry.costs.items():
        if metric in ("start", "breakdown"):
            raise ValueError(f"{test} [{span}]: {metric!r} is not a metric name")
        if value is not None and type(value) is not int:
            raise TypeError(f"{test} [{span}] {metric}: expected an int or None, got {value!r}")
    if entry.start is not None and type(entry.start) is not int:
        raise TypeError(f"{test} [{span}] start: expected an int or None, got {entry.start!r}")
    if entry.breakdown is not None and not all(type(v) is int for v in entry.breakdown.values()):
        raise TypeError(f"{test} [{span}] breakdown: expected int bytes per category, got {dict(entry.breakdown)!r}")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (if enabled) while building many acyclic objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _span_items(spans: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Spans in file order: ``call`` first, then the others by name."""
    return sorted(spans.items(), key=lambda item: (item[0] != CALL_SPAN, item[0]))


def _normalize_root(root: str) -> str:
    root = root.replace(os.sep, "/").strip()
    while root.startswith("./"):
        root = root[2:]
    return "" if root in ("", ".") else root.rstrip("/")


def _under(test: str, root: str) -> bool:
    if not root or test == root:
        return True
    return test.startswith(root) and test[len(root)] in "/:["


# --------------------------------------------------------------------------- canonical form


def _sorted_json(value: Any) -> Any:
    """A JSON value with every object's keys sorted (for keys this release does not know)."""
    if isinstance(value, dict):
        return {key: _sorted_json(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_json(item) for item in value]
    return value


def _ordered(raw: Mapping[str, Any], order: tuple[str, ...], known: Mapping[str, Any]) -> dict[str, Any]:
    """``known`` keys in ``order``, then the other keys of ``raw`` sorted, their values in canonical form."""
    result: dict[str, Any] = {key: known[key] for key in order if key in known}
    for key in sorted(raw):
        if key not in result:
            result[key] = _sorted_json(raw[key])
    return result


def _canonical_env(env: Mapping[str, Any]) -> dict[str, Any]:
    described = env.get("environment") or {}
    names = tuple(f.name for f in fields(Environment))
    known = {k: _sorted_json(described[k]) for k in names if k in described}
    allocator = described.get("allocator")
    if isinstance(allocator, dict):
        known["allocator"] = {name: allocator[name] for name in sorted(allocator, key=_allocator_rank)}
    environment = _ordered(described, names, known)
    raw_tests: Mapping[str, Any] = env.get("tests", {})
    tests = {test: _canonical_test(raw_tests[test]) for test in sorted(raw_tests)}
    return _ordered(env, _ENV_ORDER, {"environment": environment, "tests": tests})


def _canonical_test(test: Mapping[str, Any]) -> dict[str, Any]:
    spans = {name: _canonical_span(span) for name, span in _span_items(test.get("spans", {}))}
    if len(test) == 1:  # fast path: nothing but "spans"
        return {"spans": spans}
    return _ordered(test, _TEST_ORDER, {"spans": spans})


def _canonical_span(span: Mapping[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {key: span[key] for key in _SPAN_ORDER if key in span}
    breakdown = result.get("breakdown")
    if breakdown is not None:
        ordered = {c: breakdown[c] for c in CATEGORIES if c in breakdown}
        if len(ordered) != len(breakdown):
            ordered.update((c, breakdown[c]) for c in sorted(breakdown) if c not in ordered)
        result["breakdown"] = ordered
    if len(result) != len(span):
        for key in sorted(span):
            if key not in result:
                result[key] = _sorted_json(span[key])
    return result


def _render_extra(raw: Mapping[str, Any], known: Iterable[str], prefix: str, out: list[str]) -> None:
    """Append the keys of ``raw`` that are not ``known`` (sorted, canonical), each after a comma."""
    for key in sorted(set(raw).difference(known)):
        out.append(f",\n{prefix}{_encode_string(key)}: ")
        _render_value(_sorted_json(raw[key]), prefix, out)


def _render_env(env: Mapping[str, Any], prefix: str, out: list[str]) -> None:
    inner = prefix + "  "
    described = _canonical_env({"environment": env.get("environment") or {}})["environment"]
    out.append(f'{{\n{inner}"environment": ')
    _render(described, inner, out)
    out.append(f',\n{inner}"tests": ')
    tests: Mapping[str, Any] = env.get("tests", {})
    if not tests:
        out.append("{}")
    else:
        out.append("{")
        test_prefix = inner + "  "
        span_prefix = test_prefix + "    "
        plain, full = _span_template(span_prefix, False), _span_template(span_prefix, True)
        separator = "\n"
        for test in sorted(tests):
            raw = tests[test]
            out.append(f'{separator}{test_prefix}{_encode_string(test)}: {{\n{test_prefix}  "spans": ')
            separator = ",\n"
            spans = raw.get("spans", {})
            if not spans:
                out.append("{}")
            else:
                out.append("{")
                span_separator = "\n"
                for name, span in _span_items(spans) if len(spans) > 1 else spans.items():
                    head = f"{span_separator}{span_prefix}{_encode_string(name)}: "
                    span_separator = ",\n"
                    # fast path for the spans record() writes (the whole file, usually)
                    keys = tuple(span)
                    if keys == _FULL_SPAN:
                        breakdown = span["breakdown"]
                        if type(breakdown) is dict and tuple(breakdown) == CATEGORIES:
                            values = (*_plain_values(span), *breakdown.values())
                            if set(map(type, values)) <= _INT_OR_NONE:
                                out.append(head + full.format(*_numbers(values)))
                                continue
                    elif keys == _PLAIN_SPAN:
                        values = _plain_values(span)
                        if set(map(type, values)) <= _INT_OR_NONE:
                            out.append(head + plain.format(*_numbers(values)))
                            continue
                    out.append(head)
                    _render_span(span, span_prefix, out)
                out.append(f"\n{test_prefix}  }}")
            if len(raw) > 1:
                _render_extra(raw, _TEST_ORDER, test_prefix + "  ", out)
            out.append(f"\n{test_prefix}}}")
        out.append(f"\n{inner}}}")
    _render_extra(env, _ENV_ORDER, inner, out)
    out.append(f"\n{prefix}}}")


_SPAN_ORDER_SET = frozenset(_SPAN_ORDER)
_SPAN_KEY_TEXT = {key: f'"{key}": ' for key in (*_SPAN_ORDER, *CATEGORIES)}


# The spans record() writes: their canonical rendering comes from a cached template.
_PLAIN_SPAN = tuple(key for key in _SPAN_ORDER if key in (*BASELINE_METRICS, "start"))
_FULL_SPAN = (*_PLAIN_SPAN, "breakdown")


@functools.lru_cache(maxsize=64)
def _span_template(prefix: str, with_breakdown: bool) -> str:
    inner = prefix + "  "
    lines = [f'{inner}"{key}": {{}}' for key in _PLAIN_SPAN]
    if with_breakdown:
        deeper = inner + "  "
        rows = ",\n".join(f'{deeper}"{c}": {{}}' for c in CATEGORIES)
        lines.append(f'{inner}"breakdown": {{{{\n{rows}\n{inner}}}}}')
    return "{{\n" + ",\n".join(lines) + f"\n{prefix}}}}}"


_INT_OR_NONE = frozenset((int, type(None)))
_plain_values: Callable[[Mapping[str, Any]], tuple[Any, ...]] = operator.itemgetter(*_PLAIN_SPAN)


def _numbers(values: tuple[int | None, ...]) -> list[str]:
    """JSON of ints and ``None``s (at least two): their tuple's repr, but for null."""
    return repr(values)[1:-1].replace("None", "null").split(", ")


def _render_span(span: Mapping[str, Any], prefix: str, out: list[str]) -> None:
    """Append the canonical rendering of one span object (see :func:`_canonical_span`)."""
    if not span:
        out.append("{}")
        return
    inner = prefix + "  "
    lines: list[str] = []
    for key in _SPAN_ORDER:
        if key not in span:
            continue
        value = span[key]
        if type(value) is int:
            lines.append(f"{inner}{_SPAN_KEY_TEXT[key]}{value}")
        elif value is None:
            lines.append(f"{inner}{_SPAN_KEY_TEXT[key]}null")
        elif key == "breakdown" and type(value) is dict and value:
            deeper = inner + "  "
            ordered = _canonical_span({"breakdown": value})["breakdown"]
            rows = ",\n".join(
                f"{deeper}{_SPAN_KEY_TEXT.get(c) or _encode_string(c) + ': '}{_scalar(v)}" for c, v in ordered.items()
            )
            lines.append(f"{inner}{_SPAN_KEY_TEXT[key]}{{\n{rows}\n{inner}}}")
        else:
            part: list[str] = [f"{inner}{_SPAN_KEY_TEXT[key]}"]
            _render_value(value, inner, part)
            lines.append("".join(part))
    if len(lines) != len(span):
        for key in sorted(span):
            if key not in _SPAN_ORDER_SET:
                part = [f"{inner}{_encode_string(key)}: "]
                _render_value(_sorted_json(span[key]), inner, part)
                lines.append("".join(part))
    out.append("{\n" + ",\n".join(lines) + f"\n{prefix}}}")


def _scalar(value: Any) -> str:
    if type(value) is int:
        return int.__repr__(value)
    parts: list[str] = []
    _render_value(value, "", parts)
    return "".join(parts)


def _render_value(value: Any, prefix: str, out: list[str]) -> None:
    if isinstance(value, (dict, list)):
        _render(value, prefix, out)
    elif type(value) is int:
        out.append(int.__repr__(value))
    elif type(value) is str:
        out.append(_encode_string(value))
    elif value is None:
        out.append("null")
    else:
        out.append(_encode_scalar(value))


def _render(value: Mapping[str, Any] | list[Any], prefix: str, out: list[str]) -> None:
    """Append ``json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False)`` to ``out``, indented by ``prefix``.

    The same text as the json module's, about three times faster: with an
    indent, the json module falls back to its pure-Python encoder.
    """
    if not value:
        out.append("{}" if isinstance(value, Mapping) else "[]")
        return
    inner = prefix + "  "
    items: Iterable[tuple[str | None, Any]] = (
        value.items() if isinstance(value, Mapping) else ((None, item) for item in value)
    )
    out.append("{\n" if isinstance(value, Mapping) else "[\n")
    separator = ""
    for key, item in items:
        out.append(separator)
        separator = ",\n"
        out.append(inner if key is None else f"{inner}{_encode_string(key)}: ")
        kind = type(item)
        if kind is int:
            out.append(int.__repr__(item))
        elif kind is str:
            out.append(_encode_string(item))
        elif item is None:
            out.append("null")
        elif kind is dict or kind is list:
            _render(item, inner, out)
        else:
            out.append(_encode_scalar(item))
    out.append(f"\n{prefix}{'}' if isinstance(value, Mapping) else ']'}")


def _encode_scalar(item: Any) -> str:
    if isinstance(item, (dict, list, tuple)):
        return json.dumps(item, indent=2, ensure_ascii=False, allow_nan=False)  # pragma: no cover - not in our trees
    return json.dumps(item, ensure_ascii=False, allow_nan=False)


# --------------------------------------------------------------------------- load


def load(path: str | os.PathLike[str]) -> BaselineStore:
    """Read the baseline file at ``path``.

    A missing file is an empty store (it will be created by :func:`save`).
    Raises :class:`BaselineFileError`, naming the file, the line and column
    where known, and what to do, for a file that cannot be read, is not UTF-8,
    holds git conflict markers, is not valid JSON (a truncated file), repeats a
    key, has a schema version this release cannot read, or has values of the
    wrong type.
    """
    target = Path(path)
    try:
        with open(target, "rb") as handle:
            info = os.fstat(handle.fileno())
            data = handle.read()
    except FileNotFoundError:
        store = BaselineStore()
        store.path = target
        return store
    except OSError as exc:
        raise BaselineFileError(
            target,
            f"cannot read the baseline file: {exc.strerror or exc}",
            hint="Check that the path names a readable file.",
        ) from None
    store = parse(data, target)
    store.path = target
    store._fingerprint = _fingerprint(info)
    store._digest = _digest(data)
    return store


def parse(data: bytes, path: str | os.PathLike[str] = "<baselines>") -> BaselineStore:
    """Build a store from the bytes of a baseline file; ``path`` only names it in errors.

    Raises :class:`BaselineFileError` as :func:`load` does.
    """
    restore = _HINT_RESTORE.format(path=path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        raise BaselineFileError(path, "not UTF-8 text", line=line, column=column, hint=restore) from None
    try:
        with _gc_paused():  # hundreds of thousands of acyclic dicts: no point in collecting meanwhile
            tree = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (json.JSONDecodeError, _DuplicateKeyError, _ConstantError) as exc:
        # A conflict marker line is never valid JSON, so the happy path needs no scan for one.
        _raise_for_conflict(text, path)
        if isinstance(exc, _DuplicateKeyError):
            raise BaselineFileError(
                path,
                f"the key {exc.key!r} appears twice in one object (a bad merge?)",
                line=_line_of_second(text, exc.key),
                hint=f"Keep one of the two, or {_lower_first(restore)}",
            ) from None
        if isinstance(exc, _ConstantError):
            raise BaselineFileError(path, f"{exc.constant} is not a valid number of bytes", hint=restore) from None
        problem = "empty file" if not text.strip() else f"not valid JSON ({exc.msg}); the file may be truncated"
        raise BaselineFileError(path, problem, line=exc.lineno, column=exc.colno, hint=restore) from None
    _validate(tree, text, path)
    return BaselineStore._from_tree(tree)


def _raise_for_conflict(text: str, path: str | os.PathLike[str]) -> None:
    marker = _find_conflict_marker(text)
    if marker is not None:
        end = text.find("\n", marker)
        shown = text[marker : end if end >= 0 else len(text)].strip()
        raise BaselineFileError(
            path,
            f"git conflict marker {shown[:40]!r}: the file has an unresolved merge conflict",
            line=text.count("\n", 0, marker) + 1,
            column=1,
            hint=_HINT_CONFLICT.format(path=path),
        )


def _find_conflict_marker(text: str) -> int | None:
    """Offset of the first line that is a git conflict marker (``<<<<<<<``, ``=======``, ``>>>>>>>``,
    ``|||||||`` alone or followed by a space and a label); ``None`` when there is none.

    ``str.find`` instead of a multiline regex: ten times faster on a large file.
    """
    found: int | None = None
    for marker in _CONFLICT_MARKERS:
        start = 0
        while True:
            index = text.find(marker, start)
            if index < 0 or (found is not None and index > found):
                break
            after = text[index + 7 : index + 8]
            if (index == 0 or text[index - 1] == "\n") and after in ("", "\n", "\r", " ", "\t"):
                found = index
                break
            start = index + 1
    return found


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _ConstantError(Exception):
    def __init__(self, constant: str) -> None:
        super().__init__(constant)
        self.constant = constant


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return result


def _reject_constant(constant: str) -> Any:
    raise _ConstantError(constant)


def _line_column(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def _line_of_second(text: str, key: str) -> int | None:
    pattern = re.compile(re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:")
    matches = list(pattern.finditer(text))
    if len(matches) < 2:
        return None
    return text.count("\n", 0, matches[1].start()) + 1


def _locate(text: str, keys: Iterable[str]) -> int | None:
    """The line of the last of ``keys`` (a path of object keys), searching for each after the previous one."""
    position = 0
    found: int | None = None
    for key in keys:
        match = re.compile(re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:").search(text, position)
        if match is None:
            break
        position = match.end()
        found = match.start()
    return None if found is None else text.count("\n", 0, found) + 1


def _validate(tree: Any, text: str, path: str | os.PathLike[str]) -> None:
    """Check the types of everything this release reads; raise :class:`BaselineFileError` on the first problem."""

    def fail(keys: tuple[str, ...], problem: str, hint: str = "") -> BaselineFileError:
        where = "".join(f"[{json.dumps(k, ensure_ascii=False)}]" for k in keys)
        return BaselineFileError(
            path,
            f"{where or 'top level'}: {problem}",
            line=_locate(text, keys) if keys else None,
            hint=hint or f"Correct it by hand, or {_lower_first(_HINT_RESTORE.format(path=path))}",
        )

    if not isinstance(tree, dict):
        raise fail((), f"expected a JSON object, found {_json_type(tree)}; this is not a pytest-gpumem baseline file")
    schema = tree.get("schema")
    if "schema" not in tree:
        raise fail((), 'no "schema" version; this is not a pytest-gpumem baseline file')
    if type(schema) is not int:
        raise fail(("schema",), f"the schema version must be an integer, found {_json_type(schema)}")
    if schema != SCHEMA_VERSION:
        newer = schema > SCHEMA_VERSION
        raise fail(
            ("schema",),
            f"schema version {schema} cannot be read by this release of pytest-gpumem (it reads version "
            f"{SCHEMA_VERSION}); the file was written by {'a newer' if newer else 'an older'} release",
            hint=(
                "Upgrade pytest-gpumem to the release that wrote it"
                if newer
                else "Record the baselines again with `pytest --gpumem-update-baselines`"
            )
            + "; the file was left untouched.",
        )
    envs = tree.get("environments", {})
    if not isinstance(envs, dict):
        raise fail(("environments",), f"expected an object, found {_json_type(envs)}")
    for key, env in envs.items():
        if not isinstance(env, dict):
            raise fail(("environments", key), f"expected an object, found {_json_type(env)}")
        described = env.get("environment", {})
        if described is not None and not isinstance(described, dict):
            raise fail(("environments", key, "environment"), f"expected an object, found {_json_type(described)}")
        tests = env.setdefault("tests", {})
        if not isinstance(tests, dict):
            raise fail(("environments", key, "tests"), f"expected an object, found {_json_type(tests)}")
        for test, raw in tests.items():
            if not isinstance(raw, dict):
                raise fail(("environments", key, "tests", test), f"expected an object, found {_json_type(raw)}")
            spans = raw.setdefault("spans", {})
            if not isinstance(spans, dict):
                raise fail(
                    ("environments", key, "tests", test, "spans"), f"expected an object, found {_json_type(spans)}"
                )
            for name, span in spans.items():
                if not isinstance(span, dict):
                    raise fail(
                        ("environments", key, "tests", test, "spans", name),
                        f"expected an object, found {_json_type(span)}",
                    )
                for field_name in _SPAN_INT_KEYS.intersection(span):
                    value = span[field_name]
                    if value is not None and type(value) is not int:
                        raise fail(
                            ("environments", key, "tests", test, "spans", name, field_name),
                            f"expected an integer number of bytes or null, found {_json_type(value)}",
                        )
                breakdown = span.get("breakdown")
                if breakdown is not None and not (
                    isinstance(breakdown, dict) and all(type(v) is int for v in breakdown.values())
                ):
                    raise fail(
                        ("environments", key, "tests", test, "spans", name, "breakdown"),
                        "expected an object of integer byte counts or null",
                    )


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, list):
        return "an array"
    return "an object"


# --------------------------------------------------------------------------- save

#: Temp files older than this (seconds) are removed by the next save even if their writer may live.
ORPHAN_AGE_S = 24 * 3600


def save(store: BaselineStore, path: str | os.PathLike[str] | None = None, *, force: bool = False) -> bool:
    """Write ``store`` to ``path`` (default: the file it was loaded from) atomically; True when written.

    The bytes go to a temporary file in the same folder, are flushed and
    fsynced, then ``os.replace`` puts them in place, so a reader, a crash or a
    kill at any moment sees either the old file or the new one, never a mix.
    On any error the temporary file is removed and the old file is intact. A
    kill (SIGKILL, power loss) between creating and renaming the temporary file
    can leave it behind as ``.<name>.<pid>.<random>.tmp``; the next save
    removes such orphans once their process is gone (or after a day).

    Nothing is written when the bytes would not change. Unless ``force`` is
    true, raises :class:`BaselineFileError` instead of overwriting a file that
    this store was not loaded from, or that changed on disk since it was loaded
    (another run saved it, or it was edited): the store would otherwise
    silently drop the entries it never saw. Creates missing parent folders.
    """
    if path is None and store.path is None:
        raise ValueError("save() needs a path for a store that was not loaded from a file")
    target = Path(path) if path is not None else store.path
    assert target is not None
    data = store.dumps()
    ours = store.path is not None and _same_path(store.path, target)
    try:
        current: tuple[int, int, int, int] | None = _fingerprint(os.stat(target))
    except FileNotFoundError:
        current = None
    if not force and current is not None:
        if not ours:
            raise BaselineFileError(
                target,
                "refusing to overwrite a baseline file this store was not loaded from",
                hint=_HINT_SAVE,
            )
        if current != store._fingerprint:
            raise BaselineFileError(target, "the file changed on disk since it was loaded", hint=_HINT_SAVE)
    digest = _digest(data)
    if ours and current is not None and current == store._fingerprint and digest == store._digest:
        return False
    _atomic_write(target, data)
    store.path = target
    store._fingerprint = _fingerprint(os.stat(target))
    store._digest = digest
    return True


def _atomic_write(target: Path, data: bytes) -> None:
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    _remove_orphans(target)
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None  # a new file: 0o666 less the umask, as open() would give it
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        temp = folder / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(temp, flags, 0o666)
            break
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None and hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    if sys.platform == "win32":  # pragma: no cover
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _remove_orphans(target: Path) -> None:
    """Remove temp files a killed save of ``target`` left behind: their process is gone, or they are old."""
    prefix = f".{target.name}."
    try:
        names = os.listdir(target.parent)
    except OSError:  # pragma: no cover
        return
    now = time.time()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].split(".")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        orphan = target.parent / name
        try:
            old = now - orphan.stat().st_mtime > ORPHAN_AGE_S
        except OSError:
            continue
        if old or (int(parts[0]) != os.getpid() and not _alive(int(parts[0]))):
            with contextlib.suppress(OSError):
                orphan.unlink()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (always True on Windows, where we cannot ask safely)."""
    if sys.platform == "win32":  # pragma: no cover - os.kill(pid, 0) would terminate the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists but belongs to someone else
    return True


def _fingerprint(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _same_path(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)
