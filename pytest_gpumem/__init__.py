"""pytest-gpumem: guard the GPU memory of training steps in a test suite.

The public names are listed once, in ``__init__.pyi``; each loads on first use, so pytest can load the plugin without
importing torch.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def _public_names() -> dict[str, str]:
    """Public name → the module that defines it, read from the stub's ``from .module import name``."""
    stub = ast.parse(Path(__file__).with_suffix(".pyi").read_text(encoding="utf-8"))
    return {
        alias.name: f"{__name__}.{node.module}"
        for node in stub.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }


_PUBLIC = _public_names()
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
