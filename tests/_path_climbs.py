"""The path of one passing measured test, from the plugin's call hook to its verdict, as the steps it takes through the
package's layers (pyproject's import-linter contract, highest first).

A step is a function the path enters in a layer that acts (the pytest layer, reports, diagnosis, measurement, the
judge), the first of a run of such functions in one layer; value helpers (data, baselines, budgets, sizes, tables, the
codec) and comprehensions are not steps. A *climb* is a step into a higher layer than the step before: the pytest layer
taking control back from the measurement, or from the judge. ``python tests/_path_climbs.py`` prints the path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import pytest_gpumem
from conftest import run
from pytest_gpumem.baselines.locate import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(Path(pytest_gpumem.__file__).resolve().parent) + os.sep
ACTING = {"plugin", "integrations", "report", "diagnose", "measurement", "judge"}

TEST = """
import pytest
import torch


@pytest.mark.gpumem(peak="64MiB")
def test_step():
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
"""


def _ranks() -> dict[str, int]:
    """Each top-level module or folder of the package and its layer's height (higher: a higher layer)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (layers,) = [c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return {name.strip(): len(layers) - i for i, layer in enumerate(layers) for name in layer.split("|")}


@dataclass
class PathTracer:
    """A pytest plugin that records the steps of each test from the call hook to the judge's return."""

    ranks: dict[str, int] = field(default_factory=_ranks)
    steps: list[tuple[str, str]] = field(default_factory=list)  #: (layer, ``file:function``)
    _on: bool = False
    _done: bool = False

    def _layer(self, frame: FrameType) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return None
        top = path[len(PACKAGE) :].split(os.sep)[0].removesuffix(".py")
        return top if top in self.ranks else None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self._done or event not in ("call", "return"):
            return
        layer, name = self._layer(frame), frame.f_code.co_name
        if event == "return":
            if self._on and layer == "judge" and name == "judge":
                self._on, self._done = False, True
            return
        if not self._on:
            self._on = layer == "plugin" and name == "pytest_runtest_call"
        if not self._on or layer not in ACTING or name.startswith("<"):
            return
        if not self.steps or self.steps[-1][0] != layer:
            where = frame.f_code.co_filename[len(PACKAGE) :]
            self.steps.append((layer, f"{where}:{name}"))

    @property
    def climbs(self) -> list[int]:
        """The indexes of the steps into a higher layer than the step before."""
        ranks = [self.ranks[layer] for layer, _ in self.steps]
        return [i for i in range(1, len(ranks)) if ranks[i] > ranks[i - 1]]

    def pytest_runtest_logstart(self) -> None:
        sys.setprofile(self._profile)

    def pytest_runtest_logfinish(self) -> None:
        sys.setprofile(None)


def trace(pytester: pytest.Pytester) -> PathTracer:
    """The path of :data:`TEST`, run in a pytest session of this process."""
    pytester.makepyfile(test_path=TEST)
    tracer = PathTracer()
    result = run(pytester, plugins=[tracer])
    result.assert_outcomes(passed=1)
    assert tracer.steps and tracer._done, "the path was not traced from the call hook to the judge"
    return tracer


def describe(tracer: PathTracer) -> str:
    climbs = tracer.climbs
    lines = [f"{len(tracer.steps)} steps, {len(climbs)} climbs:"]
    lines += [f"  {'^' if i in climbs else ' '} {layer:<12} {where}" for i, (layer, where) in enumerate(tracer.steps)]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a developer's view of the path
    test = f"{ROOT / 'tests' / 'test_layout.py'}::test_one_passing_test_climbs_up_at_most_a_bound_of_times"
    sys.exit(pytest.main(["-q", "-s", "-p", "no:randomly", test]))
