"""Reference workloads: what PyTorch's allocator must show for steps whose bytes can be counted by hand."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch
from torch import nn

from pytest_gpumem.budgets.formulas import mlp_activations
from pytest_gpumem.diagnose.leaks import confirm_leak, snapshot_storages
from pytest_gpumem.measurement.active import activate, measure
from pytest_gpumem.measurement.engines import Workspaces, make_engine
from pytest_gpumem.measurement.recorder import Recorder
from pytest_gpumem.measurement.steps import run_step
from pytest_gpumem.units import cuda_rounded, format_size
from pytest_gpumem.validate.compare import zoo_step
from pytest_gpumem.validate.results import MLP_REFERENCE, Check, Run, agreeing, probe, reserved_slack
from pytest_gpumem.validate.zoo import PRECISIONS, ZooModel


def reference_linear(run: Run) -> None:
    """fp32 ``nn.Linear(256, 250)``: its bytes after rounding; its first forward costs its output alone, no leak.

    The clean-state protocol makes the cuBLAS workspaces before the start; ``linear_raw_retained`` and
    ``linear_retained`` are the bytes left before and after the leak check.
    """
    device = run.device
    with run.guard("reference", "Linear(256, 250) weights and bias"):
        with probe("reference.linear-init", device) as made:
            layer = nn.Linear(256, 250, device=device)
        init = run.add(made.outcome).measurement
        weight, bias = cuda_rounded(256 * 250 * 4), cuda_rounded(250 * 4)
        run.check(
            "reference",
            "Linear(256, 250): weights + bias after 512-byte rounding",
            init.cost("allocated"),
            weight + bias,
            f"weights {weight:,} B (256·250·4) + bias {bias:,} B (1,000 rounded up)",
        )
        x = torch.randn(64, 256, device=device)
        engine = make_engine(device, cuda_rounding=True)
        recorder = Recorder(engine)
        recorder.begin()  # the clean-state protocol: on CUDA it creates the cuBLAS workspaces
        try:
            start = engine.allocated()
            snapshot = snapshot_storages(engine)
            with activate(recorder), probe("reference.linear-first-forward", device) as made:
                y = layer(x)
            forward = run.add(made.outcome).measurement
            output = cuda_rounded(y.untyped_storage().nbytes())
            del y
            gc.collect()
            raw = engine.allocated() - start
            leak = confirm_leak(engine, start, snapshot=snapshot)
        finally:
            recorder.end()
        workspaces = (engine.workspaces if isinstance(engine, Workspaces) else None) or 0
        run.figures.update(cublas_workspace=workspaces, linear_raw_retained=raw, linear_retained=leak.retained)
        run.check(
            "reference",
            "Linear first forward: its cost is its output (the workspaces were there before the start)",
            forward.cost("allocated"),
            output,
            f"output {output:,} B; the protocol keeps {format_size(workspaces)} of workspaces in every start",
        )
        run.check("reference", "Linear first forward: nothing stays allocated after the output is freed", raw, 0)
        run.checks.append(
            Check(
                "reference",
                "Linear first forward: the leak check sees no leak",
                not leak.suspected and leak.retained <= 0,
                leak.retained,
                0,
                f"retained {raw:,} B, {leak.retained:,} B with the workspaces freed (readings {list(leak.readings)})",
            )
        )


def reference_workspaces(run: Run, models: Sequence[ZooModel]) -> None:
    """After steps of the zoo's models the device holds no workspace beyond those the clean-state protocol made."""
    if not run.cuda:
        return
    device = run.device
    with run.guard("reference", "workspaces: training steps add none"):
        engine = make_engine(device)
        assert isinstance(engine, Workspaces)  # the CUDA engine's
        engine.clean()
        kept = engine.workspaces
        for model in models:
            for precision in PRECISIONS:
                step = model.build(device, precision)
                for _ in range(2):
                    run_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp)
                del step
        engine.settle()
        before = engine.allocated()
        engine.release_workspaces()
        held = before - engine.allocated()
        engine.warm_workspaces()
        run.figures["workspaces_after_steps"] = held
        names = ", ".join(m.name for m in models)
        run.check("reference", "workspaces held after training steps = what the protocol made", held, kept, names)


def reference_hand_counters(run: Run) -> None:
    """``measure()`` of a warmed-up step equals ``max_memory_allocated() − memory_allocated()`` read around it by
    hand."""
    if not run.cuda:
        return
    device = run.device
    with run.guard("counters", "measure() of a warmed-up step = PyTorch's counters by hand"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 1024, device=device)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), x).backward()
            optimizer.step()

        step()  # warm-up: AdamW's state, the workspaces of both threads
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        by_hand = torch.cuda.max_memory_allocated(device) - before
        with measure("hand", device=device) as span:
            step()
        run.check(
            "counters",
            "measure() of a warmed-up AdamW step: peak cost = max_memory_allocated() − memory_allocated()",
            span.cost("peak"),
            by_hand,
            "MLP 1024 → 4096 → 1024, batch 64, fp32",
        )


def reference_adam(run: Run) -> None:
    """Adam's first step adds exp_avg and exp_avg_sq (2 × the parameter bytes) plus step counters on the device."""
    device = run.device
    for fused in (False, True):
        label = "fused" if fused else "default"
        with run.guard("reference", f"Adam ({label}) first step"):
            torch.manual_seed(0)
            model = nn.Linear(1024, 1024, device=device)
            optimizer = torch.optim.Adam(model.parameters(), fused=fused)
            model(torch.randn(8, 1024, device=device)).sum().backward()
            with probe(f"reference.adam-{label}-first-step", device) as made:
                optimizer.step()
            step = run.add(made.outcome).measurement
            params = sum(cuda_rounded(p.untyped_storage().nbytes()) for p in model.parameters())
            counters = [
                state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)
            ]
            here = [t for t in counters if t.device == device]
            counter_bytes = sum(cuda_rounded(t.untyped_storage().nbytes()) for t in here)
            place = counters[0].device.type if counters else "nowhere"
            run.check(
                "reference",
                f"Adam ({label}) first step: state = 2 × parameter bytes + step counters on the device",
                step.cost("allocated"),
                2 * params + counter_bytes,
                f"2 × {params:,} B + {len(here)} step counter(s) × 512 B (the counters live on {place})",
            )
            del model, optimizer


def reference_mlp(run: Run) -> None:
    """bf16 MLP forward: bytes saved for backward are 18·b·s·d with GELU, 10·b·s·d with ReLU.

    Measured by the saved-tensor accounting and by allocated bytes after minus before a warmed-up forward; they agree.
    """
    device = run.device
    b, s, d = MLP_REFERENCE[run.size]
    for activation, module in (("gelu", nn.GELU), ("relu", nn.ReLU)):
        with run.guard("reference", f"bf16 MLP ({activation}) saved activations"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(d, 4 * d), module(), nn.Linear(4 * d, d)).to(device, torch.bfloat16)
            x = torch.randn(b, s, d, device=device, dtype=torch.bfloat16)
            with probe(f"reference.mlp-{activation}-forward", device, breakdown=True) as made:
                with torch.no_grad():
                    model(x[:, :8])
                before = made.allocated_now()
                out = model(x)
                after = made.allocated_now()
            forward = run.add(made.outcome).measurement
            expected = mlp_activations(b, s, d, activation)
            factor = expected // (b * s * d)
            shape = f"b={b}, s={s}, d={d}"
            run.check(
                "reference",
                f"bf16 MLP ({activation}): saved for backward = {factor}·b·s·d (saved-tensor accounting)",
                forward.saved_activations,
                expected,
                shape,
            )
            run.check(
                "reference",
                f"bf16 MLP ({activation}): allocated after forward − before = {factor}·b·s·d",
                after - before,
                expected,
                f"{shape}; saved tensors minus the input x plus the output",
            )
            del model, x, out


def reference_determinism(run: Run, model: ZooModel) -> None:
    """The same training step twice in one process: identical figures, ``reserved``'s cost within one segment."""
    engine = "cuda" if run.cuda else "cpu"
    with run.guard("determinism", f"{model.name} fp32 step twice"):
        first = run.add(zoo_step(model, "fp32", run.device, engine, name="determinism.run-1")).measurement
        second = run.add(zoo_step(model, "fp32", run.device, engine, name="determinism.run-2")).measurement
        keys = ("start", "peak", "allocated", "requested_peak", "saved_activations")
        one, two = first.to_dict(), second.to_dict()
        differing = [key for key in keys if one[key] != two[key]]
        reserved = [first.cost("reserved"), second.cost("reserved")]
        slack = reserved_slack(first, second)
        if None not in reserved and abs(reserved[0] - reserved[1]) > slack:  # type: ignore[operator]
            differing.append("reserved")
            one["reserved"], two["reserved"] = reserved
        run.checks.append(
            Check(
                "determinism",
                f"{model.name} fp32 training step run twice in one process: identical figures "
                f"(reserved cost within {format_size(slack)}: one segment, or the bytes cached free at a start)",
                not differing,
                second.peak,
                first.peak,
                "differ: " + ", ".join(f"{k} {one[k]} vs {two[k]}" for k in differing)
                if differing
                else ", ".join(f"{k} {one[k]:,}" for k in keys if one[k] is not None)
                + f"; reserved cost {reserved[0]} vs {reserved[1]}",
            )
        )


def counter_checks(run: Run) -> None:
    """For every CUDA outcome: the plugin's figures equal PyTorch's counters read around the same span."""
    for outcome in run.outcomes.values():
        if outcome.counters is None:
            continue
        m, c = outcome.measurement, outcome.counters
        pairs = (
            ("peak", m.peak, c["max_memory_allocated"]),
            ("allocated", m.allocated, c["memory_allocated"]),
            ("reserved", m.reserved, c["max_memory_reserved"]),
        )
        same = f"peak {m.peak:,}, allocated {m.allocated:,}, reserved {m.reserved or 0:,}"
        title = f"{outcome.name}: peak / allocated / reserved = torch's counters"
        run.checks.append(agreeing("counters", title, pairs, "torch", spec=",", same=same))
