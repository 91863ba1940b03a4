"""The package's layout holds its bounds: a pytest layer of wiring (hooks that register, objects
that declare only what they set), a tracker private to the engines, public names listed once, and
a plugin that pytest loads without torch. Files are split where their concept splits, not at a
line count. The layers themselves are checked by import-linter's contracts (``lint-imports``,
pyproject's ``[tool.importlinter]``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_gpumem

PACKAGE = Path(pytest_gpumem.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_pytest_layers_entry_holds_only_hooks_and_the_fixture() -> None:
    plugin = PACKAGE / "plugin"
    hooks = [
        node.name for node in ast.parse((plugin / "__init__.py").read_text()).body if isinstance(node, ast.FunctionDef)
    ]
    assert hooks and all(name.startswith("pytest_") or name == "gpumem" or name.startswith("_") for name in hooks)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at its top or inside a function."""
    name, known = _module(path), {_module(p) for p in MODULES}
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_circles() -> None:
    """No two modules import each other, through any chain, even by an import inside a function."""
    graph = {_module(path): _imports(path) for path in MODULES}
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph[module]
        if start in seen:
            circles.append(start)
    assert not circles, circles


def test_the_pytest_layers_objects_declare_only_what_they_set() -> None:
    """A class of the pytest layer sets every attribute it declares: none is a bare annotation that
    another class (a mixin's partner) is expected to set. The run's manager owns its parts instead.
    Dataclasses and protocols declare their fields so, by design."""
    found = []
    for path in sorted((PACKAGE / "plugin").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            bases = {ast.unparse(b) for b in node.bases}
            if decorators & {"dataclass", "dataclasses.dataclass"} or bases & {"Protocol", "NamedTuple"}:
                continue
            found += [
                f"{path.name}:{item.lineno} {node.name}.{ast.unparse(item.target)}"
                for item in node.body
                if isinstance(item, ast.AnnAssign) and item.value is None
            ]
    assert not found, found


def test_only_the_engines_reach_a_storage_tracker() -> None:
    """Outside ``measurement/engines`` nothing reads ``.tracker`` of an engine: what the rest of
    the package needs of a tracker is a capability an engine offers (``Categories``, ``SiteRecording``)."""
    engines = PACKAGE / "measurement" / "engines"
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in MODULES
        if engines not in path.parents
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and node.attr == "tracker"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert not found, found


def test_the_engine_protocol_is_narrow() -> None:
    """What every engine offers is a short list; what only some can do is a capability (``engines/base.py``)."""
    from pytest_gpumem.measurement.engines.base import Engine

    members = {name for name in vars(Engine) if not name.startswith("_")} | set(Engine.__annotations__)
    assert len(members) <= 22, sorted(members)


def test_public_names_are_listed_once_and_each_loads() -> None:
    stub = ast.parse((PACKAGE / "__init__.pyi").read_text(encoding="utf-8"))
    listed = [alias.name for node in stub.body if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert len(listed) == len(set(listed)) and sorted(listed) == pytest_gpumem.__all__
    init = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    literals = {
        item.value
        for node in ast.walk(init)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict))
        for item in ast.walk(node)
        if isinstance(item, ast.Constant)
    }
    imported = {alias.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not (set(listed) & (literals | imported))  # no second list of them in __init__.py
    assert all(getattr(pytest_gpumem, name) is not None for name in listed)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        pytest_gpumem.nothing_here  # noqa: B018


def test_pytest_loads_the_plugin_without_torch() -> None:
    """Loading the plugin (as pytest does, through its entry point) imports no torch: a suite
    without a measured test pays nothing for it (benchmarks/bench_import.py times it)."""
    code = (
        "import sys, pytest, pytest_gpumem.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout


def test_no_two_modules_share_a_name() -> None:
    """A module's or a package's last name says which one it is: none is used twice."""
    names = [path.stem for path in MODULES if path.name != "__init__.py"]
    names += [path.parent.name for path in MODULES if path.name == "__init__.py" and path.parent != PACKAGE]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []


#: Climbs of a passing test's path (tests/_path_climbs.py): no change may add one; issue 47 asks for at most 3.
CLIMBS = 6


def test_one_passing_test_climbs_up_at_most_a_bound_of_times(pytester: pytest.Pytester) -> None:
    """From the plugin's call hook to the verdict, a passing test's path goes back up a layer at most :data:`CLIMBS`
    times (pytest layer, reports, diagnosis, measurement, judge: a step into a higher one is a climb)."""
    from _path_climbs import describe, trace

    tracer = trace(pytester)
    print(describe(tracer))
    assert len(tracer.climbs) <= CLIMBS, describe(tracer)
