"""The training-step driver (``gpumem.train_step`` runs it; so do the validation's workloads):
an out-of-memory report names what its frames hold, as it names what the test's own frames hold."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pytest_gpumem.diagnose.oom import OomReport, OomWatch, release_oom
from pytest_gpumem.measurement.devicelimit import device_limit
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.measurement.steps import run_step


def test_an_oom_report_names_the_step_drivers_locals(cpu_engine: Engine) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batch = (torch.randn(128, 64), torch.randn(128, 8))
    recorder = Recorder(cpu_engine)
    recorder.begin()
    try:
        recorder.track(net, adam)
        run_step(net, adam, batch, nn.functional.mse_loss)  # warm-up: AdamW creates its state
        with recorder.span("probe") as span:
            run_step(net, adam, batch, nn.functional.mse_loss)
        with OomWatch(cpu_engine, recorder, top=50) as watch, device_limit(cpu_engine, span.peak - 1):
            try:
                run_step(net, adam, batch, nn.functional.mse_loss)
            except torch.OutOfMemoryError as exc:
                report = watch.report_for(exc)
                release_oom(exc, cpu_engine)
            else:  # pragma: no cover
                pytest.fail("no OOM")
        adam.zero_grad(set_to_none=True)
    finally:
        recorder.end()
    assert isinstance(report, OomReport)
    names = {tensor.held_by for tensor in report.largest}
    # the driver's locals label the tracked objects (innermost frame first), not this test's
    assert "model.0.weight" in names and "net.0.weight" not in names
    assert "optimizer.state[model.0.weight]['exp_avg']" in names
    assert any(re.fullmatch(r"local '\w+' in \w+ \(steps\.py:\d+\)", name or "") for name in names), names
