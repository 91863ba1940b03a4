"""The plugin's saved-tensor hooks, which step aside where torch turns such hooks off (``torch.func``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["STEPPED_ASIDE_NOTE", "SavedTensorHooks"]

_autograd: Any = torch._C._autograd

STEPPED_ASIDE_NOTE = (
    "saved tensors were not counted where torch turns saved-tensor hooks off "
    "(torch.func transforms, disable_saved_tensors_hooks): what autograd saved there counts as temporaries"
)

#: the pushed hooks of each thread, innermost last
_active: dict[int, list[SavedTensorHooks]] = {}
_lock = threading.Lock()
_real: dict[str, Callable[..., Any]] = {}


def _disable(*args: Any, **kwargs: Any) -> Any:
    for hooks in reversed(_active.get(threading.get_ident(), ())):
        hooks._step_aside()
    return _real["disable"](*args, **kwargs)


def _enable(*args: Any, **kwargs: Any) -> Any:
    result = _real["enable"](*args, **kwargs)
    for hooks in _active.get(threading.get_ident(), ()):
        hooks._step_back()
    return result


def _install() -> None:
    if not _real:
        _real["disable"] = _autograd._saved_tensors_hooks_disable
        _real["enable"] = _autograd._saved_tensors_hooks_enable
        _autograd._saved_tensors_hooks_disable = _disable
        _autograd._saved_tensors_hooks_enable = _enable


def _uninstall() -> None:
    if _real and not _active:
        if _autograd._saved_tensors_hooks_disable is _disable:
            _autograd._saved_tensors_hooks_disable = _real["disable"]
        if _autograd._saved_tensors_hooks_enable is _enable:
            _autograd._saved_tensors_hooks_enable = _real["enable"]
        _real.clear()


def _disabled() -> bool:
    return _autograd._saved_tensors_hooks_get_disabled_error_message() is not None


class SavedTensorHooks:
    """``pack`` and ``unpack`` as the calling thread's saved-tensor hooks, aside where torch turns hooks off."""

    def __init__(
        self,
        pack: Callable[[torch.Tensor], Any],
        unpack: Callable[[Any], torch.Tensor],
        *,
        notes: list[str] | None = None,
    ) -> None:
        self.pack = pack
        self.unpack = unpack
        #: where to note (once) that the hooks stepped aside
        self._notes = notes
        self._pushed = False
        self._thread: int | None = None

    def push(self) -> None:
        with _lock:
            _install()
            self._thread = threading.get_ident()
            _active.setdefault(self._thread, []).append(self)
        if _disabled():  # entered where hooks are off: pushed once they are on again
            self._aside()
        self._step_back()

    def pop(self) -> None:
        if self._pushed and self._on_top():
            _autograd._pop_saved_tensors_default_hooks()
        self._pushed = False
        with _lock:
            stack = _active.get(self._thread or 0, [])
            if self in stack:
                stack.remove(self)
            if not stack:
                _active.pop(self._thread or 0, None)
            _uninstall()

    def _on_top(self) -> bool:
        top = _autograd._top_saved_tensors_default_hooks(True)
        return top is not None and top[0] is self.pack and top[1] is self.unpack

    def _step_aside(self) -> None:
        if self._pushed and self._on_top():
            _autograd._pop_saved_tensors_default_hooks()
            self._pushed = False
            self._aside()

    def _aside(self) -> None:
        if self._notes is not None and STEPPED_ASIDE_NOTE not in self._notes:
            self._notes.append(STEPPED_ASIDE_NOTE)

    def _step_back(self) -> None:
        if not self._pushed and not _disabled():
            _autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
            self._pushed = True
