"""What autograd holds for backward, counted by ``saved_tensors_hooks`` alone (an engine without a tracker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pytest_gpumem.measurement.engines.savedhooks import SavedTensorHooks
from pytest_gpumem.measurement.engines.storages import _PLAIN
from pytest_gpumem.units import cuda_rounded

__all__ = ["Held", "Released", "SavedTensors", "unpack"]

_PARAMETER = torch.nn.Parameter
_NO_DISPATCH = torch._C._DisableTorchDispatch


class Held:
    """What autograd keeps instead of a saved tensor under the plugin's hooks: the tensor (a non-leaf detached, or a
    node saving its own output makes a cycle the collector cannot break) and its version, for :func:`unpack`'s check."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.is_leaf:
            self.tensor = tensor
        elif type(tensor) in _PLAIN:  # detached unseen by any dispatch mode: it is the plugin's own doing
            with _NO_DISPATCH():
                self.tensor = tensor.detach()
        else:
            self.tensor = tensor.detach()
        self.version = tensor._version


class Released(Held):
    """A saved tensor someone counts: ``release(token)`` is called when autograd lets go of it."""

    __slots__ = ("release", "token")

    def __init__(self, tensor: torch.Tensor, release: Callable[[Any], None], token: Any) -> None:
        super().__init__(tensor)
        self.release = release
        self.token = token

    def __del__(self) -> None:
        self.release(self.token)


def unpack(held: Held) -> torch.Tensor:
    """The saved tensor back, after autograd's own in-place check."""
    tensor = held.tensor
    if tensor._version != held.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version "
            f"{held.version} instead. (The same error autograd raises; pytest-gpumem's saved-tensor "
            "accounting keeps the check.)"
        )
    return tensor


class SavedTensors:
    """Bytes of the distinct storages autograd holds for backward on ``device``, and their peak per window."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._rounding = self.device.type != "cpu"
        index = self.device.index or 0
        dev_type = self.device.type
        self._on_device = lambda t: t.device.type == dev_type and (dev_type == "cpu" or t.get_device() == index)
        #: storage key → [tensors holding it, counted bytes]
        self._held: dict[int, list[int]] = {}
        self.current = 0
        self._peak = 0
        self._hooks: Any = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def start(self) -> None:
        if self._hooks is not None:
            raise RuntimeError("the saved-tensor counter is already active")
        self._peak = self.current
        self._hooks = SavedTensorHooks(self._pack, unpack)
        self._hooks.push()

    def stop(self) -> None:
        """Stop counting new saves; releases of counted ones are still seen."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.pop()

    def take_peak(self) -> int:
        """The highest bytes held for backward since the previous call; opens a new window."""
        peak, self._peak = self._peak, self.current
        return peak

    def _pack(self, tensor: torch.Tensor) -> Held:
        if (
            isinstance(tensor, _PARAMETER)
            or isinstance(tensor._base, _PARAMETER)
            or not self._on_device(tensor)
            or tensor.layout != torch.strided
        ):
            return Held(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return Held(tensor)
        key = storage._cdata
        held = self._held.get(key)
        if held is None:
            nbytes = int(storage.nbytes())
            held = self._held[key] = [0, cuda_rounded(nbytes) if self._rounding else nbytes]
            self.current += held[1]
            if self.current > self._peak:
                self._peak = self.current
        held[0] += 1
        return Released(tensor, self._release, key)

    def _release(self, key: int) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            del self._held[key]
            self.current -= held[1]
