"""pytest-gpumem: guard the GPU memory of training steps in a test suite."""

from __future__ import annotations

from pytest_gpumem.figures import CATEGORIES, METRICS, PHASES, Measurement, Phase, Timeline
from pytest_gpumem.measure import Span, measure
from pytest_gpumem.units import format_size, parse_size

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "METRICS",
    "PHASES",
    "Measurement",
    "Phase",
    "Span",
    "Timeline",
    "__version__",
    "format_size",
    "measure",
    "parse_size",
]
