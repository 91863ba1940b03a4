"""CUDA figures against PyTorch's own allocator counters. Skipped without a GPU.

These run on a GPU machine (``scripts/gpu-validate`` runs them and records the data
that CPU tests replay). Nothing here is mocked: without a device they do not run.
"""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem import measure

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
    lines = [line for line in result.outlines if "FIGURES" in line]
    assert len(lines) == 2
    assert lines[0].split("FIGURES")[1] == lines[1].split("FIGURES")[1]


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
