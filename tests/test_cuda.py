"""CUDA figures against PyTorch's own allocator counters. Skipped without a GPU.

These run on a GPU machine (``python -m pytest_gpumem validate`` runs them and records the data
that CPU tests replay). Nothing here is mocked: without a device they do not run.
"""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem import measure
from pytest_gpumem.data.metrics import METRIC_INFO
from pytest_gpumem.diagnose.leaks import confirm_leak, snapshot_storages
from pytest_gpumem.measurement.engines import make_engine

_RESERVED_FLOOR = METRIC_INFO["reserved"].tolerance_floor

pytestmark = pytest.mark.cuda

pytest_plugins = ["pytester"]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_span_figures_equal_torch_counters() -> None:
    dev = device()
    keep = torch.empty(3 * 2**20, dtype=torch.uint8, device=dev)
    with measure("span", device=dev) as span:
        torch.cuda.reset_peak_memory_stats(dev)  # our windows fold peaks taken before this too
        a = torch.empty(5 * 2**20, dtype=torch.uint8, device=dev)
        del a
        b = torch.empty(2**20, dtype=torch.uint8, device=dev)
        torch_peak = torch.cuda.max_memory_allocated(dev)
        torch_allocated = torch.cuda.memory_allocated(dev)
        torch_reserved = torch.cuda.max_memory_reserved(dev)
    assert span.peak == torch_peak
    assert span.allocated == torch_allocated
    assert span.reserved is not None and span.reserved >= torch_reserved
    assert span.start >= keep.numel()
    assert span.measurement.engine == "cuda"
    del b, keep


def test_linear_weights_and_bias_after_rounding() -> None:
    dev = device()
    with measure("init", device=dev) as span:
        layer = torch.nn.Linear(256, 250).to(dev)
    # 256*250*4 = 256,000 bytes (a multiple of 512); the 1,000-byte bias takes 1,024
    assert span.cost("allocated") == 256_000 + 1_024
    del layer


def test_adam_state_is_twice_the_parameters() -> None:
    dev = device()
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 1024, device=dev)).sum().backward()
    with measure("first step", device=dev) as span:
        opt.step()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # exp_avg + exp_avg_sq on the GPU; step counters stay on the CPU (not fused/capturable)
    assert span.cost("allocated") == 2 * param_bytes


@pytest.mark.parametrize(("activation", "factor"), [(torch.nn.GELU, 18), (torch.nn.ReLU, 10)])
def test_bf16_mlp_saved_activations(activation: type[torch.nn.Module], factor: int) -> None:
    b, s, d = 2, 4096, 1024
    dev = device()
    model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), activation(), torch.nn.Linear(4 * d, d))
    model = model.to(dev, torch.bfloat16)
    x = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16)
    with measure("forward", device=dev, breakdown=True, track=(model,)) as span:
        out = model(x)
    assert span.saved_activations == factor * b * s * d
    # what stays allocated after forward: the saved activations minus the input x (held
    # before the span) plus the output
    assert span.cost("allocated") == (factor - 2) * b * s * d + out.numel() * 2
    del out


def test_same_test_twice_gives_identical_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(device="cuda")
@pytest.mark.parametrize("run", [1, 2])
def test_step(gpumem, run):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 512, device="cuda")
    m = gpumem.train_step(model, opt, (x, torch.zeros_like(x)), torch.nn.functional.mse_loss)
    print("FIGURES", m.cost("peak"), m.cost("allocated"), m.cost("reserved"))
"""
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    lines = [line.split("FIGURES")[1].split() for line in result.outlines if "FIGURES" in line]
    assert len(lines) == 2
    assert lines[0][:2] == lines[1][:2]  # peak and allocated: to the byte
    # reserved moves with the process's allocation history, by whole segments at most
    assert abs(int(lines[0][2]) - int(lines[1][2])) <= _RESERVED_FLOOR


def test_require_gpu_passes_with_a_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1GiB")
def test_on_gpu(gpumem):
    assert gpumem.device.type == "cuda"
    x = torch.ones(1024, device=gpumem.device)
"""
    )
    pytester.runpytest_subprocess("--gpumem-require-gpu", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def _workspaces_held(engine) -> int:  # type: ignore[no-untyped-def]
    """Bytes the library workspaces hold now (they are freed to see it, then made again)."""
    engine.settle()
    before = engine.allocated()
    engine.release_workspaces()
    held = before - engine.allocated()
    engine.warm_workspaces()
    return held


def test_the_first_matmul_of_a_span_costs_no_workspace() -> None:
    """The clean-state protocol makes the workspaces before the start: a span's first Linear
    (cuBLASLt with a bias, a cuBLAS matmul in backward on autograd's thread) costs its tensors."""
    dev = device()
    torch._C._cuda_clearCublasWorkspaces()
    layer = torch.nn.Linear(256, 250).to(dev)
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    with measure("forward", device=dev) as span:
        y = layer(x)
    assert span.cost("allocated") == 64 * 250 * 4  # the output alone (a multiple of 512)
    with measure("backward", device=dev) as span:
        y.sum().backward()
    grads = 64 * 256 * 4 + 256 * 250 * 4 + 1024  # x.grad, weight.grad, bias.grad (1,000 B in a 1,024 B block)
    # Linear saved x and the weight (both alive before the span) and the test still holds y:
    # what stays is the gradients alone
    assert span.cost("allocated") == grads
    del y


def test_training_steps_use_no_workspace_the_protocol_did_not_make() -> None:
    dev = device()
    engine = make_engine(dev)
    engine.clean()
    assert engine.workspaces is not None and engine.workspaces > 0
    for dtype in (None, torch.bfloat16):
        layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dev)
        del layer
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, 128, 256, device=dev)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
        del model, opt, x, loss
    assert _workspaces_held(engine) == engine.workspaces


def test_saved_activations_are_counted_without_the_tracker() -> None:
    b, s, d = 2, 4096, 1024
    dev = device()
    model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
    model = model.to(dev, torch.bfloat16)
    x = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16)
    with measure("forward", device=dev) as span:
        out = model(x)
    assert span.measurement.breakdown is None  # no tracker: the caching allocator alone
    assert span.saved_activations == 18 * b * s * d
    with measure("backward", device=dev) as backward:
        out.float().pow(2).mean().backward()
    # a span counts what is saved for backward inside it: pow saves its input, the fp32 copy of
    # the output (what autograd held before the span is the forward span's figure); the CPU
    # engine counts the same
    assert backward.saved_activations == b * s * d * 4
    del out


def test_measure_of_a_warmed_up_step_equals_the_counters_read_by_hand() -> None:
    dev = device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()

    step()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    step()
    torch.cuda.synchronize(dev)
    by_hand = torch.cuda.max_memory_allocated(dev) - before
    with measure("step", device=dev) as span:
        step()
    assert span.cost("peak") == by_hand


def test_the_leak_check_frees_the_workspaces_and_finds_the_leak_alone() -> None:
    dev = device()
    engine = make_engine(dev)
    engine.clean()
    start = engine.allocated()
    snapshot = snapshot_storages(engine)
    leaked = [torch.empty(2**20, dtype=torch.uint8, device=dev)]
    check = confirm_leak(engine, start, snapshot=snapshot)
    assert check.start == start - (engine.workspaces or 0)
    assert check.retained == 2**20 and check.suspected
    assert check.leaked and check.leaked[0].nbytes == 2**20
    assert _workspaces_held(engine) == engine.workspaces  # made again after the check
    leaked.clear()


def test_the_same_marker_holds_on_the_gpu(pytester: pytest.Pytester) -> None:
    """16Ψ + a little for a fp32 AdamW step: what the CPU engine passes, the GPU passes too."""
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(allocated="16Ψ + 2MiB", peak="16Ψ + 64MiB", retained="0B")
def test_step(gpumem):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)  # copied twice, then dropped
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(gpumem.device)
    del layer
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 128, 256, device=gpumem.device)
    gpumem.train_step(model, opt, (x, torch.zeros_like(x)), torch.nn.functional.mse_loss)
"""
    )
    for device_name in ("cuda", "cpu"):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--gpumem-device={device_name}")
        result.assert_outcomes(passed=1)


SNAPSHOT_SUITE = """
import pytest, torch


@pytest.mark.gpumem(device="cuda")
def test_step():
    x = torch.ones(2**20, device="cuda")
    (x * 2).sum()
"""


def test_a_memory_snapshot_that_cannot_be_written_is_a_warning(tmp_path) -> None:
    """A full disk (RLIMIT_FSIZE) while the snapshot pickle is written: a warning naming it, the test
    passes, no half-written pickle, and allocation history is switched off after it."""
    import os
    import resource
    import subprocess
    import sys

    (tmp_path / "test_snap.py").write_text(SNAPSHOT_SUITE)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "--gpumem-snapshot"]
    command += ["--gpumem-artifacts=art", "--gpumem-artifacts-all"]
    written = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert written.returncode == 0, written.stdout
    (pickle,) = (tmp_path / "art").glob("*.snapshot.pickle")
    pickle.unlink()  # the page stays: the failed run cannot replace it

    def full_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a .pyc written under the limit is cut short
    failed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, preexec_fn=full_disk)
    text = " ".join(failed.stdout.split())
    assert failed.returncode == 0, text
    assert "1 passed" in text and "INTERNALERROR" not in text and "Traceback" not in text
    assert f"could not write the memory snapshot {pickle}: File too large" in text
    assert [name for name in os.listdir(tmp_path / "art") if "snapshot" in name] == []


def test_sites_on_cuda_name_the_line_that_grew_with_its_blocks_to_the_byte() -> None:
    """The allocator's history, replayed: a tensor kept alive in the second of two otherwise equal
    runs is the one new site, in this file at its line, and its bytes are the peak's growth."""
    import inspect
    from pathlib import Path

    from pytest_gpumem.data.site_figures import SiteConfig
    from pytest_gpumem.judge.site_changes import diff_sites
    from pytest_gpumem.measurement.recorder import Recorder

    dev = device()
    engine = make_engine(dev)
    config = SiteConfig(str(Path(__file__).resolve().parent))
    frame = inspect.currentframe()
    assert frame is not None
    lines: list[int] = []

    def step(keep: bool) -> tuple[object, torch.Tensor | None]:
        recorder = Recorder(engine, sites=config)
        recorder.begin()
        try:
            state = recorder.open("call")
            x = torch.ones(256, 1024, device=dev)
            y = x * 2
            lines.append(inspect.currentframe().f_lineno + 1)  # type: ignore[union-attr]
            kept = (y + 1) if keep else None
            z = (x + y).sum()
            del x, y, z
            return recorder.close(state), kept
        finally:
            recorder.end()

    base, _ = step(False)
    grown, kept = step(True)
    growth = grown.cost("peak") - base.cost("peak")  # type: ignore[attr-defined]
    assert growth == 2**20
    diff = diff_sites("call", base.sites, grown.sites)  # type: ignore[attr-defined]
    new = [change for change in diff.changes if change.status == "new"]
    assert len(new) == 1, diff.changes
    site = new[0].figures.site
    assert (site.file, site.line, site.function) == (
        Path(__file__).name,
        lines[-1],
        "test_sites_on_cuda_name_the_line_that_grew_with_its_blocks_to_the_byte.<locals>.step",
    )
    assert new[0].delta("peak") == growth
    assert sum(change.delta("peak") for change in diff.changes) == growth
    assert sum(s.peak for s in grown.sites.sites) + grown.sites.rest_peak == grown.peak  # type: ignore[attr-defined]
    del kept
