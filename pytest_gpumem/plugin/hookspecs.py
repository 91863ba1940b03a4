"""Hooks pytest-gpumem adds to pytest: implement them in a ``conftest.py`` or a plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gpumem.baselines import Environment


@pytest.hookspec(firstresult=True)
def pytest_gpumem_environment(config: pytest.Config, environment: Environment) -> Environment | None:
    """Adjust the environment that keys a test's baselines; return the one to use, or None to keep it.

    Called once per engine and device in each process that measures; it decides which runs compare with each other
    (see docs/baselines.md): add a label to keep baselines apart, or set a field to None to share them across its
    values. The first implementation that returns an environment wins.
    """
