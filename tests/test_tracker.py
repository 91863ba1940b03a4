"""The CPU engine counts tensor storages exactly."""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem import measure
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.units import cuda_rounded


def mlp(d: int, activation: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), activation, torch.nn.Linear(4 * d, d)).to(dtype)


@pytest.mark.parametrize(("b", "s", "d"), [(2, 16, 32), (1, 64, 48), (3, 8, 64)])
@pytest.mark.parametrize(("activation", "factor"), [(torch.nn.GELU, 18), (torch.nn.ReLU, 10), (torch.nn.Tanh, 10)])
def test_bf16_mlp_saved_activations_match_formula(
    b: int, s: int, d: int, activation: type[torch.nn.Module], factor: int
) -> None:
    model = mlp(d, activation(), torch.bfloat16)
    x = torch.randn(b, s, d, dtype=torch.bfloat16)
    with measure("forward", device="cpu", track=(model,)) as span:
        out = model(x)
    assert span.saved_activations == factor * b * s * d
    # everything saved is still alive after forward: the activations at the end
    assert span.measurement.cost("allocated") == (factor - 2) * b * s * d + out.numel() * 2
    del out


def test_fp32_adamw_model_states_to_the_byte() -> None:
    torch.manual_seed(0)
    model = mlp(32, torch.nn.GELU())
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 32)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    step()  # Adam creates its state lazily at the first step
    with measure("step", device="cpu", track=(model, opt)) as span:
        step()
    from pytest_gpumem.measurement.engines.cpu import CpuEngine

    engine = CpuEngine()
    engine.clean()
    engine.tracker.register(params, "parameters")
    engine.tracker.register([p.grad for p in params], "gradients")
    engine.tracker.register([t for s in opt.state.values() for t in s.values()], "optimizer_state")
    breakdown = engine.tracker.breakdown()
    assert breakdown["parameters"] == 4 * n
    assert breakdown["gradients"] == 4 * n
    # exp_avg + exp_avg_sq, plus one float32 step counter per parameter tensor (on the CPU)
    assert breakdown["optimizer_state"] == 8 * n + 4 * len(params)
    # what stays allocated after the measured step: exactly the model states and the input
    assert span.allocated - span.start == 0  # grads of step 1 were freed and re-made by step 2
    assert span.allocated == 16 * n + 4 * len(params) + x.numel() * 4
    # at the peak, the categories sum to the peak
    assert span.breakdown is not None
    assert sum(span.breakdown.values()) == span.peak
    assert span.breakdown["parameters"] == 4 * n
    assert span.breakdown["optimizer_state"] == 8 * n + 4 * len(params)
    assert set(span.phases) == {"forward", "backward", "optimizer"}
    assert span.measurement.psi == n


def test_views_count_once_and_frees_subtract() -> None:
    tracker = StorageTracker(torch.device("cpu"))
    tracker.scan()
    before = tracker.current
    tracker.start()
    a = torch.empty(1000, dtype=torch.float32)
    views = [a[1:], a.view(10, 100), a.t() if a.dim() == 2 else a[::2]]
    assert tracker.current - before == 4000
    b = a.clone()
    assert tracker.current - before == 8000
    del a, views
    assert tracker.current - before == 4000
    del b
    assert tracker.current == before
    tracker.stop()
    window = tracker.take_window()
    assert window.peak - before == 8000


def test_preexisting_tensors_count_in_start_and_peak() -> None:
    kept = torch.ones(2048, dtype=torch.float64)
    with measure("span", device="cpu") as span:
        extra = torch.zeros(256)
    assert span.start >= kept.numel() * 8
    assert span.peak - span.start == 1024
    assert span.allocated - span.start == 1024
    del extra


def test_frees_of_preexisting_tensors_are_seen() -> None:
    old = torch.ones(10_000)
    with measure("span", device="cpu") as span:
        del old
    assert span.start - span.allocated == 40_000


def test_resize_grows_the_count() -> None:
    with measure("span", device="cpu") as span:
        t = torch.empty(10)
        t.resize_(1000)
    assert span.allocated - span.start == 4000
    del t


def test_cuda_rounding() -> None:
    assert [cuda_rounded(n) for n in (0, 1, 511, 512, 513, 1_000_000)] == [0, 512, 512, 512, 1024, 1_000_448]
    with measure("span", device="cpu", cuda_rounding=True) as span:
        small = [torch.empty(1, dtype=torch.uint8) for _ in range(3)]
        big = torch.empty(1025, dtype=torch.uint8)
    assert span.allocated - span.start == 3 * 512 + 1536
    assert span.measurement.cuda_rounding
    del small, big


def test_activations_return_to_their_category_after_backward() -> None:
    model = mlp(16, torch.nn.ReLU())
    x = torch.randn(4, 16)
    with measure("step", device="cpu", track=(model,)) as span:
        loss = model(x).sum()
        loss.backward()
    assert span.breakdown is not None
    assert span.breakdown["activations"] > 0
    tracker = StorageTracker(torch.device("cpu"))
    tracker.scan()
    assert tracker.breakdown()["activations"] == 0
    del loss


def test_breakdown_categories_are_the_documented_ones() -> None:
    with measure("span", device="cpu") as span:
        t = torch.ones(3)
    assert span.breakdown is not None
    assert tuple(span.breakdown) == CATEGORIES
    del t


def test_timeline_marks_phases() -> None:
    model = mlp(16, torch.nn.GELU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 16)
    with measure("step", device="cpu", track=(model, opt), timeline=True) as span:
        model(x).sum().backward()
        opt.step()
    timeline = span.timeline
    assert timeline is not None
    assert [label for _, label in timeline.marks] == ["forward", "backward", "optimizer"]
    assert max(timeline.totals()) == span.peak
    assert timeline.totals()[0] == span.start


@pytest.mark.parametrize("activation", [torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU])
def test_measuring_does_not_keep_graphs_alive(activation: type[torch.nn.Module]) -> None:
    """Nodes that save their own output (ReLU, Tanh) must not form uncollectable cycles."""
    import gc
    import weakref

    model = mlp(8, activation())
    ref = weakref.ref(model[0].weight)
    with measure("forward", device="cpu") as span:
        out = model(torch.randn(4, 8))
    del out, model
    gc.collect()
    assert ref() is None
    assert span.saved_activations is not None and span.saved_activations > 0


def test_inplace_modification_of_a_saved_tensor_still_raises() -> None:
    """Saved-tensor accounting must not hide autograd's in-place check from a buggy step."""
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = x.exp()
        y.add_(1)
        y.sum().backward()
    with measure("buggy", device="cpu"), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = x.exp()
        y.add_(1)
        y.sum().backward()
    with measure("fine", device="cpu"):
        y = x.exp()
        y.sum().backward()


def test_tensors_built_from_data_are_counted() -> None:
    """torch.tensor(data) reaches the dispatcher only as aten::lift_fresh (Adam's step counters)."""
    with measure("literal", device="cpu") as span:
        scalar = torch.tensor(0.0)
        vector = torch.tensor([1, 2, 3], dtype=torch.int64)
    assert span.cost("allocated") == 4 + 24
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    with measure("first step", device="cpu") as first:
        opt.step()
    params = list(model.parameters())
    # exp_avg + exp_avg_sq, and one float32 step counter per parameter tensor made by torch.tensor()
    assert first.cost("allocated") == 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)
    del scalar, vector


def test_a_storage_resized_in_place_is_counted() -> None:
    """FSDP2 frees and re-allocates its unsharded parameters with ``untyped_storage().resize_()``,
    under no operator: the tracker follows the storage's size."""
    resize = torch.UntypedStorage.resize_
    with measure("resize", device="cpu") as freed:
        t = torch.zeros(1000)
        t.untyped_storage().resize_(0)
    assert (freed.measurement.cost("peak"), freed.measurement.cost("allocated")) == (4000, 0)
    with measure("resize", device="cpu") as grown:
        t.untyped_storage().resize_(8000)
    assert (grown.measurement.cost("peak"), grown.measurement.cost("allocated")) == (8000, 8000)
    with measure("resize", predict="h100") as predicted:
        t.untyped_storage().resize_(11 * 2**20 + 1)  # the H100 allocates a 12 MiB block, unsplit
    assert predicted.measurement.cost("allocated") == 12 * 2**20 - 8192
    assert torch.UntypedStorage.resize_ is resize  # watched only while a tracker runs
