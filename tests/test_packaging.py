"""The package as the index shows it: the sdist and wheel built from the checkout pass
``twine check --strict``, carry the licence text, the project's links and classifiers, a README
whose links all work off GitHub, no development pins, and the ``pytest-gpumem`` command; and
every ini setting's help says what it does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from pytest_gpumem.baselines.locate import tomllib
from pytest_gpumem.plugin.options import OPTIONS

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/pytest-gpumem/pytest-gpumem"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built from the checkout with ``python -m build`` (in its isolated environment)."""
    for module in ("build", "twine"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (the dev dependency group has it: pip install --group dev)")
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def wheel_metadata(dist: Path) -> tuple[zipfile.ZipFile, dict[str, list[str]], str]:
    wheel = zipfile.ZipFile(next(dist.glob("*.whl")))
    text = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    message = Parser().parsestr(text)
    fields: dict[str, list[str]] = {}
    for key, value in message.items():
        fields.setdefault(key, []).append(value)
    return wheel, fields, str(message.get_payload())


@pytest.mark.slow
def test_twine_check_strict_passes(dist: Path) -> None:
    files = sorted(str(path) for path in dist.iterdir())
    assert len(files) == 2
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2


@pytest.mark.slow
def test_the_wheel_carries_what_the_index_shows(dist: Path) -> None:
    wheel, fields, readme = wheel_metadata(dist)
    assert fields["License-Expression"] == ["MIT"]
    licence = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    assert "pytest_gpumem/schema/baselines.schema.json" in wheel.namelist()
    assert licence.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in licence
    urls = dict(value.split(", ", 1) for value in fields["Project-URL"])
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues", "Source"}
    assert all(url.startswith(REPOSITORY) for url in urls.values())
    classifiers = set(fields["Classifier"])
    assert {f"Programming Language :: Python :: 3.{minor}" for minor in (10, 11, 12, 13)} <= classifiers
    assert "Environment :: GPU :: NVIDIA CUDA" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    requires = fields["Requires-Dist"]
    assert not [r for r in requires if "==" in r], requires  # pins are the development group's
    assert "pluggy>=1.2" in requires  # pluggy 1.0 and 1.1 fail every run on loading the plugin (wrapper=True)
    assert "extra ==" not in " ".join(requires)  # the development tools are a dependency group, not published
    entry_points = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "pytest-gpumem = pytest_gpumem.cli:main" in entry_points
    assert "gpumem = pytest_gpumem.plugin" in entry_points
    # every link of the README works on the index: made absolute, to the repository's files
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 40
    assert [link for link in links if not link.startswith("https://")] == []
    assert f"]({REPOSITORY}/blob/main/docs/baselines.md#tolerance)" in readme
    assert f"]({REPOSITORY}/blob/main/README.md#what-the-figures-mean)" in readme
    # ...while the README in the repository keeps them relative (they work on GitHub and in a checkout)
    here = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/baselines.md#tolerance)" in here
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", here):
        assert link.startswith("https://") or (ROOT / link).exists(), link


@pytest.mark.slow
def test_the_sdist_carries_the_licence(dist: Path) -> None:
    with tarfile.open(next(dist.glob("*.tar.gz"))) as sdist:
        names = sdist.getnames()
    assert any(name.endswith("/LICENSE") for name in names)


def test_development_pins_are_a_dependency_group() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "optional-dependencies" not in project["project"]
    assert "transformers==5.17.0" in project["dependency-groups"]["dev"]
    assert project["build-system"]["requires"][0] == "hatchling>=1.27"
    # the README's second command installs the group with a pip that reads it; CI runs the same
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    command = 'python -m pip install -U "pip>=25.1" && python -m pip install "torch==2.13.0" -e . --group dev'
    assert readme[6].strip() == f"{command} && python -m pytest -n auto"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'python -m pip install -q -U "pip>=25.1"\npython -m pip install -q "torch==2.13.0" -e . --group dev' in ci


def test_every_ini_setting_has_its_option_s_help(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--help")
    text = " ".join(result.stdout.str().split())
    for option in OPTIONS:
        kind = "bool" if option.flag else "string"
        assert f"{option.dest} ({kind}): {' '.join(option.ini_help.split())}" in text
        assert option.ini_help.endswith(f"{option.flag_name} overrides it).")
    assert "default for --gpumem" not in text
    assert "gpumem_device (string): Device measured tests run on: auto" in text
