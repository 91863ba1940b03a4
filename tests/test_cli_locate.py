"""The command line finds the baseline file from any folder under the rootdir, as pytest would:
the first folder up with a pytest configuration file decides (its ``gpumem_baselines``, or
``--gpumem-baselines`` in its ``addopts``, else the default file there); without one, the first
``gpumem-baselines.json`` up. When it finds none it says where it looked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import TRAIN, baseline_file, run

from pytest_gpumem.baselines.locate import locate
from pytest_gpumem.baselines.locate import tomllib as toml
from pytest_gpumem.cli import DOCS_URL, main


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project whose tests live two folders down."""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    return tmp_path


CONFIGS = {
    "pyproject.toml": '[tool.pytest.ini_options]\ngpumem_baselines = "ci/base.json"\n',
    "pytest.ini": "[pytest]\ngpumem_baselines = ci/base.json\n",
    "tox.ini": "[tox]\n\n[pytest]\ngpumem_baselines = ci/base.json\n",
    "setup.cfg": "[metadata]\nname = x\n\n[tool:pytest]\ngpumem_baselines = ci/base.json\n",
    "pytest.toml": '[pytest]\ngpumem_baselines = "ci/base.json"\n',
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_show_finds_the_configured_file_from_a_folder_below(
    project: Path, name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / name).write_text(CONFIGS[name], encoding="utf-8")
    (project / "ci").mkdir()
    baseline_file(project / "ci" / "base.json")
    monkeypatch.chdir(project / "tests" / "unit")
    code, out, err = run(capsys, "show", "tiny")
    assert (code, err) == (0, "")
    assert TRAIN in out


def test_addopts_wins_over_the_ini_setting(project: Path) -> None:
    (project / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "-q --gpumem-baselines=ci/other.json"\n'
        'gpumem_baselines = "ci/base.json"\n',
        encoding="utf-8",
    )
    found = locate(project / "tests" / "unit")
    assert (found.path, found.rootdir) == (project / "ci" / "other.json", project)
    assert found.how == f"--gpumem-baselines in addopts: 'ci/other.json' in {project / 'pyproject.toml'}"


def test_a_pyproject_without_pytest_settings_is_no_rootdir(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pytest skips a pyproject.toml without [tool.pytest...]; a gpumem-baselines.json higher up is found."""
    (project / "tests" / "pyproject.toml").write_text("[tool.black]\n", encoding="utf-8")
    baseline_file(project / "gpumem-baselines.json")
    found = locate(project / "tests" / "unit")
    assert found.path == project / "gpumem-baselines.json"
    assert found.rootdir is None


def test_the_default_file_at_the_rootdir(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    baseline_file(project / "gpumem-baselines.json")
    monkeypatch.chdir(project / "tests" / "unit")
    code, out, _ = run(capsys, "prune", "--dry-run", "tests/test_old.py")
    assert code == 0
    assert f"from {project / 'gpumem-baselines.json'} (dry run: nothing written)" in out


def test_a_configured_file_that_is_missing_is_named(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "pytest.ini").write_text("[pytest]\ngpumem_baselines = ci/base.json\n", encoding="utf-8")
    monkeypatch.chdir(project / "tests")
    code, out, err = run(capsys, "show")
    assert (code, out) == (2, "")
    assert err == (
        f"python -m pytest_gpumem baselines show: error: {project / 'ci' / 'base.json'}: no such file "
        f"(gpumem_baselines = 'ci/base.json' in {project / 'pytest.ini'}); give --file PATH for another file\n"
    )


def test_nothing_found_says_where_it_looked(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    start = project / "tests" / "unit"
    names = (*CONFIGS, "gpumem-baselines.json")
    if any((folder / name).exists() for folder in (start, *start.parents) for name in names):
        pytest.skip("a folder above the temporary folder holds a pytest configuration file")
    monkeypatch.chdir(start)
    code, _, err = run(capsys, "show")
    assert code == 2
    depth = len(start.parents)
    assert err == (
        f"python -m pytest_gpumem baselines show: error: no baseline file given and none found: no folder from "
        f"{start} and its {depth} parent folders up to / holds a pytest configuration file (pytest.ini, "
        "pyproject.toml, tox.ini, setup.cfg) or a gpumem-baselines.json; give --file PATH\n"
    )


def test_prune_missing_is_relative_to_the_rootdir(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the file in ci/, node ids are still relative to the rootdir (the configuration file's folder)."""
    (project / "pytest.ini").write_text("[pytest]\ngpumem_baselines = ci/base.json\n", encoding="utf-8")
    (project / "ci").mkdir()
    baseline_file(project / "ci" / "base.json")
    (project / "tests" / "test_train.py").write_text("", encoding="utf-8")
    monkeypatch.chdir(project / "tests" / "unit")
    code, out, _ = run(capsys, "prune", "--missing", "--dry-run")
    assert code == 0
    assert "would remove tests/test_old.py::test_legacy" in out
    assert "test_train.py" not in out


def test_help_points_at_the_documentation_online(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"Documentation: {DOCS_URL}\n")
    assert "validation.md in the documentation" in " ".join(out.split())
    assert "docs/validation.md" not in out
    assert DOCS_URL.startswith("https://")


def test_the_console_script_is_the_command_line() -> None:
    """``pytest-gpumem`` (pyproject's [project.scripts]) is :func:`pytest_gpumem.cli.main`, named in its messages."""
    root = Path(__file__).resolve().parent.parent
    scripts = toml.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts == {"pytest-gpumem": "pytest_gpumem.cli:main"}
    code = "import sys; from pytest_gpumem.cli import main; sys.argv[0] = '/venv/bin/pytest-gpumem'; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", code, "baselines", "show", "--file", "nowhere.json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == "pytest-gpumem baselines show: error: nowhere.json: no such file\n"
