"""The training-step driver: one step of a model and its optimizer on a batch (``gpumem.train_step``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["AMP_MODES", "StepHost", "describe", "run_step", "train_step_span"]

#: Values of ``train_step(amp=...)``.
AMP_MODES: tuple[str | None, ...] = (None, "bf16", "fp16")


class StepHost(Protocol):
    """What :func:`train_step_span` needs of the ``gpumem`` fixture: its test, its device, tracking, a span."""

    @property
    def nodeid(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def track(self, *objects: Any) -> None: ...

    def measure(self, name: str, **limits: Any) -> AbstractContextManager[Any]: ...


def train_step_span(
    gpumem: StepHost,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    *,
    amp: str | None,
    warmup: int,
    name: str,
) -> Any:
    """``gpumem.train_step``: ``warmup`` steps, then one step in the span ``name``, which it returns."""
    __tracebackhide__ = True
    nodeid = gpumem.nodeid
    if amp not in AMP_MODES:
        raise ValueError(f"{nodeid}: train_step(amp={amp!r}): expected None, 'bf16' or 'fp16'")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"{nodeid}: train_step(warmup={warmup!r}): expected an int >= 0")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{nodeid}: train_step(model=...): expected a torch.nn.Module, got {describe(model)}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{nodeid}: train_step(optimizer=...): expected a torch.optim.Optimizer, got {describe(optimizer)}"
        )
    gpumem.track(model, optimizer)
    scaler = torch.amp.GradScaler(gpumem.device.type) if amp == "fp16" else None
    for _ in range(warmup):
        run_step(model, optimizer, batch, loss_fn, amp=amp, scaler=scaler, device=gpumem.device)
    with gpumem.measure(name) as span:
        run_step(model, optimizer, batch, loss_fn, amp=amp, scaler=scaler, device=gpumem.device)
    return span


def run_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    *,
    amp: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
    device: torch.device | None = None,
) -> None:
    """One training step (zero_grad, forward, loss, backward, step), under autocast with ``amp``, through ``scaler``."""
    __tracebackhide__ = True
    optimizer.zero_grad(set_to_none=True)
    device_type = (device or next(model.parameters()).device).type
    if amp is None:
        loss = _loss(model, batch, loss_fn)
    else:
        dtype = torch.bfloat16 if amp == "bf16" else torch.float16
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss = _loss(model, batch, loss_fn)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    del loss


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    __tracebackhide__ = True
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _loss(model: torch.nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    __tracebackhide__ = True
    if loss_fn is not None:
        if isinstance(batch, (torch.Tensor, Mapping)):
            return loss_fn(_call(model, batch))
        if not isinstance(batch, Sequence) or isinstance(batch, str) or len(batch) != 2:
            raise ValueError(
                "train_step: with loss_fn, batch must be an (inputs, target) pair, a tensor or a mapping; "
                f"got {describe(batch)}"
            )
        inputs, target = batch
        return loss_fn(_call(model, inputs), target)
    output = _call(model, batch)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"train_step: the model's output is not a scalar loss (got {describe(loss)}); pass loss_fn=... "
            "(e.g. torch.nn.functional.cross_entropy) and batch=(inputs, target)"
        )
    return loss


def describe(value: Any) -> str:
    """``value`` for an error message, without dumping tensors: ``"a float32 tensor of shape (4, 32)"``."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"a {dtype} tensor of shape {tuple(value.shape)}{where}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(describe(item) if isinstance(item, torch.Tensor) else _short(item) for item in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} of {len(value)}: ({items}{more})"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(repr, list(value)[:6]))}"
    return _short(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"
