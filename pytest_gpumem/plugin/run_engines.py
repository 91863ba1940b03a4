"""The run's engines: one engine per kind for the run, and the run's collector."""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem.measurement import frozen
from pytest_gpumem.measurement.collector import Collector
from pytest_gpumem.measurement.engines import make_engine
from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["Engines", "Freezer"]


class Engines:
    """One engine per (device, breakdown, observe) for the run; a new one registers the frozen tensors."""

    def __init__(self, *, cuda_rounding: bool = False, freezer: Freezer | None = None) -> None:
        self.cuda_rounding = cuda_rounding
        self.freezer = freezer
        self._engines: dict[tuple[str, bool, str, str | None], Engine] = {}

    def get(
        self, device: torch.device, *, breakdown: bool = False, observe: str = "operators", predict: str | None = None
    ) -> Engine:
        """The engine for ``device``; on CUDA ``observe`` and ``predict`` are moot, on the CPU ``breakdown`` is."""
        breakdown = breakdown or device.type == "cpu"
        if device.type != "cpu":
            observe, predict = "operators", None
        key = (str(device), breakdown, observe, predict)
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = make_engine(
                device, breakdown=breakdown, cuda_rounding=self.cuda_rounding, observe=observe, predict=predict
            )
            if self.freezer is not None and engine.categories is not None:  # every tensor alive, frozen ones too
                engine.categories.scan(extra=frozen.tensors() if frozen.known() else ())
        return engine

    def cpu(self) -> Engine:
        return self.get(torch.device("cpu"))


class Freezer:
    """Wires the run's collector into pytest: started, compacted after each test, stopped."""

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

    def refreeze(self) -> None:
        """Between tests (their fixtures torn down), and before a failing test's second run: freeze what the session
        built since, if a lot."""
        if self.collector.active:
            self.collector.compact()
        elif frozen.theirs_given_back() or self.collector.reclaimable:
            self.collector.start()

    pytest_runtest_logfinish = refreeze

    def stop(self) -> None:
        if self._config is not None and self._config.pluginmanager.is_registered(self):
            self._config.pluginmanager.unregister(self)
        self.collector.stop()
