"""``--check-leftovers``: every test leaves the process as it found it.

A plugin of this suite (loaded by ``conftest.py``). After each test's teardown it
compares the process with what it was before the test: the tensors alive (by
storage, after a garbage collection), the environment, the working directory,
the threads, the collector's frozen objects and torch's global settings. A test that leaves any of them changed
gets an error at teardown that names what it left and, for tensors, what holds
them. A diagnostic, run by hand::

    python -m pytest --check-leftovers -p randomly -n 2

The tensor scan costs about 0.1 s per test (one ``gc.get_objects()`` pass, and a
full collection only when a test left new storages), so it is off by default.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Generator
from typing import Any

import pytest
import torch

from conftest import forget_last_failure, refreeze
from pytest_gpumem.diagnose.leaks import referrer_names
from pytest_gpumem.units import format_size


def _storages() -> dict[int, torch.Tensor]:
    """One live tensor per storage (any device), by the storage's C pointer."""
    found: dict[int, torch.Tensor] = {}
    tensor_type = torch.Tensor
    for obj in gc.get_objects():
        cls = type(obj)
        if not (cls is tensor_type or issubclass(cls, tensor_type)):
            continue
        try:
            if obj.is_meta:  # shapes without memory
                continue
            storage = obj.untyped_storage()
            if storage.nbytes() == 0:
                continue
            found.setdefault(int(storage._cdata), obj)
        except (RuntimeError, NotImplementedError, TypeError):  # meta, sparse, wrapper subclasses
            continue
    return found


def _torch_settings() -> dict[str, object]:
    """torch's process-wide settings a test could change and forget to restore."""
    return {
        "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(),
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "autocast (cpu)": torch.is_autocast_enabled("cpu"),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
    }


def _threads() -> set[str]:
    return {f"{thread.name} ({type(thread).__name__})" for thread in threading.enumerate() if thread.is_alive()}


class Leftovers:
    """The state before the current test, and the check after it."""

    def __init__(self) -> None:
        self._storages: set[int] | None = None

    def _state(self) -> dict[str, Any]:
        return {
            "environment": dict(os.environ),
            "working directory": os.getcwd(),
            "threads": _threads(),
            "torch settings": _torch_settings(),
            "objects frozen (gc.freeze)": gc.get_freeze_count(),
        }

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        refreeze()  # as the suite does before every test: what earlier tests left is out of sight
        if self._storages is None:
            self._storages = set(_storages())
        state = self._state()
        result = yield
        # the test's fixtures and arguments are gone now (pytest drops them after teardown)
        problems = self._compare(state, self._state())
        forget_last_failure()  # pytest's record of the last failure (post-mortem) is no leftover
        left = {key: tensor for key, tensor in _storages().items() if key not in self._storages}
        if left:
            left.clear()  # or the collection below could not free them: this dict would hold them
            gc.collect()
            left = {key: tensor for key, tensor in _storages().items() if key not in self._storages}
        if left:
            problems.append(_describe(left))
        self._storages |= set(left)  # reported once: the next test is judged by what it adds
        del left
        if problems:
            report = pytest.TestReport(
                item.nodeid,
                item.location,
                keywords={},
                outcome="failed",
                longrepr="the test left the process changed (--check-leftovers):\n" + "\n".join(problems),
                when="teardown",
            )
            item.ihook.pytest_runtest_logreport(report=report)
        return result

    @staticmethod
    def _compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        problems = []
        env_before, env_after = before.pop("environment"), after.pop("environment")
        changed = sorted(k for k in env_before.keys() | env_after.keys() if env_before.get(k) != env_after.get(k))
        if changed:
            problems.append(f"environment variables changed: {', '.join(changed)}")
        threads = after.pop("threads") - before.pop("threads")
        if threads:
            problems.append(f"threads still running: {', '.join(sorted(threads))}")
        if before["working directory"] != after["working directory"]:
            problems.append(f"working directory: {before['working directory']!r} -> {after['working directory']!r}")
        key = "objects frozen (gc.freeze)"
        if after[key] > before[key]:  # frozen objects may die (a decrease); none may be added
            problems.append(f"{key} grew: {before[key]} -> {after[key]}")
        settings_before, settings_after = before["torch settings"], after["torch settings"]
        for key, value in settings_before.items():
            if settings_after[key] != value:
                problems.append(f"torch setting {key}: {value!r} -> {settings_after[key]!r}")
        return problems


def _describe(left: dict[int, torch.Tensor]) -> str:
    tensors = sorted(left.values(), key=lambda t: -t.untyped_storage().nbytes())
    names = referrer_names(tensors[:20], ignore=[left, tensors])
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    lines = [f"{len(tensors)} tensor storage(s) still alive, {format_size(total)} in all:"]
    for tensor in tensors[:20]:
        shape = "×".join(str(n) for n in tensor.shape) or "scalar"
        where = names.get(id(tensor), "held by nothing nameable")
        lines.append(f"  {format_size(tensor.untyped_storage().nbytes())}  {shape}  {tensor.dtype}  {where}")
    return "\n".join(lines)
