"""The pytest layer: options, the ``gpumem`` marker and fixture (the other hooks live on the run's
``GpumemManager``); it imports no torch, and a run without a measured test reads no baseline file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.plugin import hookspecs
from pytest_gpumem.plugin.collection import DISABLED_KEY, DisabledManager
from pytest_gpumem.plugin.manager import RUN_KEY, GpumemManager
from pytest_gpumem.plugin.marker import marker_help
from pytest_gpumem.plugin.options import OPTIONS, OptionError, Settings

if TYPE_CHECKING:
    from pytest_gpumem.plugin.fixture import GpuMem


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory guards (pytest-gpumem)")
    for option in OPTIONS:
        help = option.help.replace("%", "%%")  # argparse %-formats help texts
        if option.flag:
            group.addoption(option.flag_name, dest=option.dest, action="store_true", default=None, help=help)
            parser.addini(option.dest, option.ini_help, type="bool", default=False)
        else:
            group.addoption(option.flag_name, dest=option.dest, default=None, metavar=option.metavar, help=help)
            parser.addini(option.dest, option.ini_help, default=option.default)


def _settings(config: pytest.Config) -> Settings:
    """The run's settings: each option from the command line, else its ini value (flags too)."""

    def value(name: str) -> Any:
        given = config.getoption(name)
        return given if given is not None else config.getini(name)

    cache = getattr(config, "cache", None)
    try:
        return Settings.read(value, config.rootpath, None if cache is None else lambda: cache.mkdir("gpumem-artifacts"))
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", marker_help())
    settings = _settings(config)
    manager = DisabledManager(settings) if settings.disable else GpumemManager(config, settings)
    manager.register(config.pluginmanager)


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem:
    """Measure memory in a test: ``gpumem.device``, ``gpumem.measure(name)``, ``gpumem.track(...)``,
    ``gpumem.train_step(...)``, ``gpumem.budget()``. See pytest-gpumem's README."""
    from pytest_gpumem.plugin.fixture import GpuMem, Unrecorded

    disabled = request.node.stash.get(DISABLED_KEY, None)
    if disabled is not None:
        return GpuMem(Unrecorded(disabled), request.node.nodeid)
    run = request.node.stash.get(RUN_KEY, None)
    if run is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the gpumem fixture works only in test functions")
    return GpuMem(run.recorder, request.node.nodeid, run.plan.spec.limits)
