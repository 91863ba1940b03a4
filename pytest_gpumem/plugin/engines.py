"""The run's engines: the device a test measures on (:func:`choose_device`), one engine per kind for
the whole run (:class:`Engines`), and the run's collector wired into pytest (:class:`Freezer`):
what the session imported or built is frozen, so that each test's garbage collections cover only
what it made (:class:`~pytest_gpumem.measurement.collector.Collector`)."""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem.measurement import frozen
from pytest_gpumem.measurement.collector import Collector
from pytest_gpumem.measurement.engines import cuda_available, make_engine, resolve_device
from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["DeviceUnavailable", "Engines", "Freezer", "choose_device"]


class DeviceUnavailable(Exception):
    """The device a test asks for is not there; ``required``: the run demands a GPU (fail, don't skip)."""

    def __init__(self, reason: str, *, required: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.required = required


def choose_device(wanted: str, *, require_gpu: bool = False, worker: int | None = None) -> torch.device:
    """The device a test measures on: ``wanted`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    ``"auto"`` is CUDA when available, else the CPU (with ``require_gpu``:
    :class:`DeviceUnavailable`). Under pytest-xdist, ``worker`` *i* measures on GPU
    *i mod N* for ``"auto"`` and ``"cuda"`` when several GPUs are visible. A CUDA
    device that is not there raises :class:`DeviceUnavailable`.
    """
    has_cuda = cuda_available()
    if wanted in ("auto", "cuda") and has_cuda:
        count = torch.cuda.device_count()
        if worker is not None and count > 1:
            return torch.device("cuda", worker % count)
    if wanted == "auto":
        if has_cuda:
            return resolve_device("auto")
        if require_gpu:
            raise DeviceUnavailable("--gpumem-require-gpu: no CUDA device is available", required=True)
        return torch.device("cpu")
    device = torch.device(wanted)
    if device.type == "cuda":
        count = torch.cuda.device_count() if has_cuda else 0
        index = device.index if device.index is not None else 0
        if index >= count:
            plural = "s" if count != 1 else ""
            reason = f"gpumem: device {wanted!r} is not available ({count} CUDA device{plural} visible)"
            raise DeviceUnavailable(reason, required=require_gpu)
        return resolve_device(wanted)
    return device


class Engines:
    """One engine per (device, breakdown, observe) for the whole run, so trackers and caches are reused.

    An engine with a storage tracker made while objects are frozen (see
    :class:`Freezer`) registers the tensors among the frozen objects first: its
    later scans cannot see them.
    """

    def __init__(self, *, cuda_rounding: bool = False, freezer: Freezer | None = None) -> None:
        self.cuda_rounding = cuda_rounding
        self.freezer = freezer
        self._engines: dict[tuple[str, bool, str, str | None], Engine] = {}

    def get(
        self, device: torch.device, *, breakdown: bool = False, observe: str = "operators", predict: str | None = None
    ) -> Engine:
        """The engine for ``device``; the CPU engine always has its tracker (``breakdown`` is moot)
        and ``observe`` chooses how it sees memory; on CUDA ``observe`` is moot (the caching
        allocator's figures are those of the code that runs, compiled or not), and so is
        ``predict`` (the GPU whose figures the CPU engine predicts: a real one is measured)."""
        breakdown = breakdown or device.type == "cpu"
        if device.type != "cpu":
            observe, predict = "operators", None
        key = (str(device), breakdown, observe, predict)
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = make_engine(
                device, breakdown=breakdown, cuda_rounding=self.cuda_rounding, observe=observe, predict=predict
            )
            if self.freezer is not None and engine.categorizes:
                self.freezer.scan(engine)
        return engine

    def cpu(self) -> Engine:
        """The CPU engine."""
        return self.get(torch.device("cpu"))


class Freezer:
    """Wires the run's :class:`~pytest_gpumem.measurement.collector.Collector` (what the plugin does to
    the garbage collector, and its rule) into pytest: started before the first measured test,
    compacted once each test's teardown is done (registered as a plugin for that), stopped when
    the run ends.

    Where someone else had frozen objects as the run started, the collector froze nothing; once a
    census of live tensors (an out-of-memory or leak report) has given their objects back for
    good, nothing is frozen any more, and the collector starts after that test as it would have
    at the run's start: the later tests' collections walk what they made, not the whole process."""

    def __init__(self, config: pytest.Config | None = None) -> None:
        self.collector = Collector()
        self._config = config

    @property
    def active(self) -> bool:
        """Whether the run's collector froze objects (someone else had not)."""
        return self.collector.active

    def start(self) -> None:
        """Collect garbage and freeze what exists now (see :meth:`Collector.start`)."""
        self.collector.start()
        if self._config is not None:
            self._config.pluginmanager.register(self, "gpumem-collector")

    def pytest_runtest_logfinish(self) -> None:
        """A test is done, its fixtures torn down: :meth:`refreeze`."""
        self.refreeze()

    def refreeze(self) -> None:
        """Between tests, and before a failing test's second run: freeze what the session built
        since, if a lot (or start, where a census gave back what someone else froze)."""
        if self.collector.active:
            self.collector.compact()
        elif frozen.theirs_given_back():
            self.collector.start()

    def scan(self, engine: Engine) -> None:
        """Let ``engine``'s tracker register every tensor alive, frozen ones included."""
        engine.scan(extra=frozen.tensors() if frozen.known() else ())

    def stop(self) -> None:
        if self._config is not None and self._config.pluginmanager.is_registered(self):
            self._config.pluginmanager.unregister(self)
        self.collector.stop()
