"""Frames TorchDynamo runs eagerly under the storage tracker: which are the user's, and how a report names them."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

#: The plugin's own frames are never the user's compiled code (TorchDynamo is asked about the plugin's hooks too).
PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__ or "torch")) + os.sep


def skipped_frame() -> tuple[Any, bool, str] | None:
    """The frame TorchDynamo runs eagerly: (code, whether a library's, its name); None for the plugin's."""
    caller: Any = sys._getframe(2)
    for _ in range(4):
        if caller is None:
            break
        code = getattr(caller.f_locals.get("frame"), "f_code", None)
        if code is not None:
            if code.co_filename.startswith(PLUGIN_ROOT):
                return None
            name = getattr(code, "co_qualname", code.co_name)
            library = code.co_filename.startswith((TORCH_ROOT, "<"))  # torch's, or generated code
            return code, library, f"{name} ({code.co_filename}:{code.co_firstlineno})"
        caller = caller.f_back
    return None, False, "a torch.compile'd function"


def describe_compiled(frames: list[tuple[bool, str]]) -> str:
    """The frames worth naming to a user: their own code first, else torch modules' ``forward``."""
    own = [text for in_torch, text in frames if not in_torch]
    forwards = [text for in_torch, text in frames if in_torch and ".forward (" in text]
    names = list(dict.fromkeys(own or forwards or ["a torch.compile'd function"]))
    return "; ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def forget_skips(codes: set[Any]) -> None:
    """Undo what a dispatch mode made TorchDynamo remember (a code it ran eagerly is skipped ever after)."""
    reset_code = getattr(sys.modules.get("torch._dynamo"), "reset_code", None)
    if reset_code is None:
        return
    for code in codes:
        reset_code(code)
