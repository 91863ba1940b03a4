"""Where a project's baseline file is, found from any folder under its rootdir as pytest would (without pytest)."""

from __future__ import annotations

import configparser
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines import DEFAULT_FILENAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib

__all__ = ["Located", "locate"]

#: pytest's configuration files in its search order, with the section each must hold (None: any content).
_CONFIG_FILES: tuple[tuple[str, str | None], ...] = (
    ("pytest.toml", None),
    (".pytest.toml", None),
    ("pytest.ini", None),
    (".pytest.ini", None),
    ("pyproject.toml", "tool.pytest"),
    ("tox.ini", "pytest"),
    ("setup.cfg", "tool:pytest"),
)


@dataclass
class Located:
    """The baseline file found (``path``), how (``how``), and the folders looked in (``looked``)."""

    path: Path | None
    how: str = ""
    #: the rootdir: the folder of the configuration file found (None without one)
    rootdir: Path | None = None
    looked: list[Path] = field(default_factory=list)

    def where_looked(self) -> str:
        """The folders looked in, for a message: the first and the last, with the count."""
        if not self.looked:
            return "nowhere"
        if len(self.looked) == 1:
            return str(self.looked[0])
        return f"{self.looked[0]} and its {len(self.looked) - 1} parent folders up to {self.looked[-1]}"


def locate(start: Path) -> Located:
    """The baseline file for a command run in ``start``: the first folder up with a pytest configuration file (or a
    ``gpumem-baselines.json``) decides; ``path`` is None when none has either."""
    found = Located(None)
    for folder in (start, *start.parents):
        found.looked.append(folder)
        config = _config_in(folder)
        if config is not None:
            name, setting = config
            found.rootdir = folder
            if setting is not None:
                value, source = setting
                found.path = folder / Path(value).expanduser()  # an absolute path stays as it is
                found.how = f"{source} {value!r} in {folder / name}"
            else:
                found.path = folder / DEFAULT_FILENAME
                found.how = f"the default file at the rootdir, {folder} (the folder of {name})"
            return found
        if (folder / DEFAULT_FILENAME).is_file():
            found.path = folder / DEFAULT_FILENAME
            found.how = f"the first {DEFAULT_FILENAME} up from {start}"
            return found
    return found


def _config_in(folder: Path) -> tuple[str, tuple[str, str] | None] | None:
    """The pytest configuration file in ``folder`` (its name) and its baseline setting, or None."""
    for name, section in _CONFIG_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            values = _toml(path, section) if name.endswith(".toml") else _ini(path, section)
        except (OSError, ValueError, configparser.Error, UnicodeDecodeError):
            continue  # pytest would stop on it; here the next candidate is as good a guess
        if values is not None:
            return name, _setting(values)
    return None


def _toml(path: Path, section: str | None) -> dict[str, Any] | None:
    data: Any = tomllib.loads(path.read_text(encoding="utf-8"))
    if section is None:  # pytest.toml: [pytest]
        table = data.get("pytest", {})
        return table if isinstance(table, dict) else {}
    tool = data.get("tool", {}).get("pytest")
    if not isinstance(tool, dict):
        return None
    legacy = tool.get("ini_options")
    return legacy if isinstance(legacy, dict) else tool


def _ini(path: Path, section: str | None) -> dict[str, Any] | None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(path.read_text(encoding="utf-8"), str(path))
    wanted = section or "pytest"
    if not parser.has_section(wanted):
        return None if section is not None else {}
    return dict(parser.items(wanted))


def _setting(values: dict[str, Any]) -> tuple[str, str] | None:
    """``--gpumem-baselines`` in ``addopts``, else ``gpumem_baselines`` (the value, and where set), or None."""
    found = _in_addopts(values.get("addopts", ""))
    if found:
        return found, "--gpumem-baselines in addopts:"
    value = values.get("gpumem_baselines")
    if isinstance(value, str) and value.strip():
        return value.strip(), "gpumem_baselines ="
    return None


def _in_addopts(addopts: Any) -> str | None:
    """The value of the last ``--gpumem-baselines`` in ``addopts``, or None."""
    try:
        words = [str(w) for w in addopts] if isinstance(addopts, list) else shlex.split(str(addopts))
    except ValueError:  # an unclosed quote: pytest would stop on it
        return None
    value = None
    for index, word in enumerate(words):
        if word.startswith("--gpumem-baselines="):
            value = word.partition("=")[2] or None
        elif word == "--gpumem-baselines" and index + 1 < len(words):
            value = words[index + 1]
    return value
