"""The recording ``measure()`` blocks join: :func:`measure`, :func:`activate` (the plugin's) and :func:`engine_for`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pytest_gpumem.data.findings import failure_message
from pytest_gpumem.data.site_figures import SiteConfig
from pytest_gpumem.judge.judgement import judge
from pytest_gpumem.judge.limits import LimitExceeded, check_span_name
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement.engines import make_engine, resolve_device
from pytest_gpumem.measurement.engines.base import Engine
from pytest_gpumem.measurement.recorder import Recorder, Span
from pytest_gpumem.units import parse_size

__all__ = ["activate", "engine_for", "measure"]

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("pytest_gpumem_recorder", default=None)


def engine_for(target: Engine | str | torch.device | None) -> Engine:
    """The engine for ``target``: itself, the engine measuring that device now, else a new one."""
    if target is not None and not isinstance(target, (str, torch.device)):
        return target
    device = resolve_device(target)
    active = _ACTIVE.get()
    if active is not None and active.active and active.engine.device == device:
        return active.engine
    return make_engine(device)


@contextmanager
def measure(
    name: str = "span",
    *,
    device: str | torch.device | None = None,
    track: tuple[Any, ...] | list[Any] = (),
    breakdown: bool = False,
    cuda_rounding: bool = False,
    timeline: bool = False,
    device_limit: int | str | None = None,
    observe: str = "operators",
    predict: str | None = None,
    fake: bool = False,
    sites: SiteConfig | None = None,
    **limits: Any,
) -> Iterator[Span]:
    """Measure the memory a block of code costs, inside or outside pytest (see docs/library.md).

    Inside a measured test or another ``measure`` block on the same device, the span joins that recording; otherwise it
    starts its own on ``device`` (default: CUDA when available, else CPU). ``device_limit``: run as if the device had
    that much memory; ``observe="allocations"``: compiled code runs as compiled (CPU); ``predict="h100"``: report what
    that GPU would show; ``fake=True``: run on fake tensors (build the model inside the block); ``sites``: record where
    bytes are made. Limits (``peak="4GiB"``) are checked at the end; outside pytest a broken one raises
    :class:`pytest_gpumem.LimitExceeded`.
    """
    active = _ACTIVE.get()
    joined = active if active is not None and active.active else None
    if fake and joined is not None and not joined.fake:
        raise ValueError(
            "fake=True applies to a whole measurement: this block joins one on real tensors "
            "(put fake=True on the test's marker, or measure the block on its own)"
        )
    if fake and predict is None and not (joined is not None and joined.fake):
        raise ValueError("fake=True needs predict= (the GPU whose figures the fake run predicts, e.g. 'h100')")
    target = None if device is None else resolve_device(device)
    if predict is not None and target is None:
        target = torch.device("cpu")
    nbytes = None if device_limit is None else parse_size(device_limit)
    recorder = joined if joined is not None and (target is None or target == joined.engine.device) else None
    joining = recorder is not None
    if recorder is not None:
        name = check_span_name(name)
    else:
        engine = make_engine(target, breakdown=breakdown, cuda_rounding=cuda_rounding, observe=observe, predict=predict)
        recorder = Recorder(engine, timeline=timeline, fake=fake, label=name, sites=sites)
        recorder.reserved = nbytes is not None or "reserved" in limits  # from an empty cache only then
        recorder.driver = True  # the span's figures are the caller's to read, the driver's among them
    recorder.track(*track)
    with contextlib.ExitStack() as stack:
        if not joining:
            recorder.begin()
            stack.callback(recorder.end)
            stack.callback(_ACTIVE.reset, _ACTIVE.set(recorder))
        if nbytes is not None:
            stack.enter_context(recorder.engine.limit_memory(nbytes))
        span = stack.enter_context(recorder.span(name, **limits))
        yield span
    if not joining and span.limits:
        record = judge(TestRecord(span.name, measurements=[span.measurement], asked={span.name: list(span.limits)}))
        if record.failed:
            broken = [finding for finding in record.findings if finding.failed]
            raise LimitExceeded("\n\n".join([*record.errors, *([failure_message(broken)] if broken else [])]))


@contextmanager
def activate(recorder: Recorder) -> Iterator[Recorder]:
    """Make ``recorder`` the one that :func:`measure` blocks join (the plugin uses this)."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)
