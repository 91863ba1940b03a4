"""What keeps a site's tensors alive: the holders a failing test's sites name (found in the second run only)."""

from __future__ import annotations

import gc
import inspect
import re
from collections.abc import Iterable, Mapping
from types import CodeType, FrameType
from typing import Any

import torch

from pytest_gpumem.diagnose.census import live_tensors, stack_frames
from pytest_gpumem.measurement import gcfunctions

__all__ = ["holder_pattern", "kept_by_site", "state_key", "state_options"]

_STATE = re.compile(r"\.state\[[^\]]*\]")
_INDEX = re.compile(r"\[\d+\]")
_LOCAL = re.compile(r"^(?P<name>local '[^']*') in .*$")
_STATE_KEY = re.compile(r"\.state\[…\]\['(?P<key>[^']+)'\]$")


def holder_pattern(name: str) -> str:
    """``name`` without indices and parameters (``Trainer.debug[3]``: ``Trainer.debug[…]``), a local without its
    place."""
    name = _LOCAL.sub(r"\g<name>", name)
    return _INDEX.sub("[…]", _STATE.sub(".state[…]", name))


def kept_by_site(
    engine: Any, tracked: Iterable[Any], frame: FrameType | None, code: CodeType | None = None
) -> dict[tuple[str, str | None], dict[str, int]]:
    """By site and category, the bytes of its live storages by :func:`holder_pattern` of what holds them.

    ``frame`` is the stack whose locals name tensors; ``code`` the test function's, looked for among referrers once it
    has returned.
    """
    frames = list(stack_frames(frame))
    if code is not None and all(f.f_code is not code for f in frames):
        frames[:0] = _frames_of(code)
    tensors, _, _ = live_tensors(
        engine.device,
        engine=engine,
        objects=list(tracked),
        frames=frames,
        top=None,
        counted_only=engine.exact,
        # only a storage made at a site is worth giving the frozen objects back to name its holder
        thaw_for=lambda group: engine.sites is not None and engine.sites.site_of(group.tensors[0]) is not None,
    )
    del frames
    found: dict[tuple[str, str | None], dict[str, int]] = {}
    for tensor in tensors:
        if tensor.site is None or tensor.held_by is None:
            continue
        holders = found.setdefault((tensor.site, tensor.category), {})
        name = holder_pattern(tensor.held_by)
        holders[name] = holders.get(name, 0) + tensor.nbytes
    return found


def _frames_of(code: CodeType) -> list[FrameType]:
    """The frames of ``code`` kept alive: among what the collector walks, else among everything, the frozen objects
    given back (costly for the next freeze, so only where needed)."""
    for referrers in (gcfunctions.get_referrers, gc.get_referrers):
        found = [f for f in referrers(code) if isinstance(f, FrameType) and f.f_code is code]
        if found:
            return found
    return []


def state_options(optimizers: Iterable[Any]) -> dict[str, str]:
    """By state key, the non-default options of ``optimizers`` that add it (``{"max_exp_avg_sq": "amsgrad=True"}``),
    found by stepping each class once on a one-element parameter."""
    found: dict[str, str] = {}
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        try:
            found.update(_option_keys(type(optimizer), optimizer.defaults))
        except Exception:  # an optimizer this probe cannot build or step: nothing to say
            continue
    return found


def _option_keys(cls: type[torch.optim.Optimizer], options: Mapping[str, Any]) -> dict[str, str]:
    parameters = inspect.signature(cls.__init__).parameters
    changed = {
        name: value
        for name, value in options.items()
        if name in parameters
        and parameters[name].default is not inspect.Parameter.empty
        and isinstance(value, (bool, int, float, str))
        and value != parameters[name].default
    }
    if not changed:
        return {}
    base = _keys(cls, {})
    found: dict[str, str] = {}
    for name, value in changed.items():
        for key in _keys(cls, {name: value}) - base:
            found.setdefault(key, f"{name}={value!r}")
    return found


def _keys(cls: type[torch.optim.Optimizer], options: Mapping[str, Any]) -> set[str]:
    """The tensor state keys ``cls`` makes in one step on a one-element parameter."""
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.ones(1)
    probe = cls([param], **options)
    probe.step()
    return {key for key, value in probe.state[param].items() if isinstance(value, torch.Tensor)}


def state_key(pattern: str) -> str | None:
    """The optimizer state key a :func:`holder_pattern` names (``opt.state[…]['exp_avg']``: ``exp_avg``)."""
    match = _STATE_KEY.search(pattern)
    return None if match is None else match["key"]
