"""The baseline file's declarative schema (pytest_gpumem.baselines.validation.FILE): its errors name the
line and column of the bad value, and the JSON Schema published from it describes the files the plugin writes."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from conftest import run
from pytest_gpumem.baselines import BaselineFileError, load
from pytest_gpumem.baselines.validation import json_schema, position

pytest_plugins = ["pytester"]

SCHEMA_FILE = Path(__file__).parents[1] / "pytest_gpumem" / "schema" / "baselines.schema.json"

SUITE = """
import dataclasses, pytest, torch

@pytest.mark.gpumem
def test_step(gpumem):
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    with gpumem.measure("step"):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
"""

CONFTEST = """
import dataclasses

def pytest_gpumem_environment(config, environment):
    return dataclasses.replace(environment, labels=(("runner", "pool-a"),))
"""


def problems(schema: dict[str, Any], value: Any, at: str = "") -> list[str]:
    """Where ``value`` breaks ``schema``: the JSON Schema keywords the published schema uses (type, const,
    minimum, maximum, if/then, properties, additionalProperties, required)."""
    kinds = {"object": dict, "integer": int, "string": str, "null": type(None), "array": list, "boolean": bool}

    def of(kind: str, item: Any) -> bool:
        return type(item) is kinds[kind]

    found: list[str] = []
    if "if" in schema and of(schema["if"]["type"], value):
        found += problems(schema["then"], value, at)
    kind = schema.get("type")
    if kind is not None and not any(of(k, value) for k in ([kind] if isinstance(kind, str) else kind)):
        return [*found, f"{at or '/'}: {value!r} is not {kind}"]
    if "const" in schema and value != schema["const"]:
        found.append(f"{at}: {value!r} is not {schema['const']!r}")
    if type(value) is int and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        found.append(f"{at}: {value} out of range")
    if isinstance(value, dict):
        found += [f"{at or '/'}: no {key!r}" for key in schema.get("required", ()) if key not in value]
        for key, item in value.items():
            found += problems(
                schema.get("properties", {}).get(key, schema.get("additionalProperties", {})), item, f"{at}/{key}"
            )
    return found


def test_the_published_schema_is_the_one_the_code_declares() -> None:
    expected = json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"
    assert SCHEMA_FILE.read_text(encoding="utf-8") == expected, (
        "regenerate it: python -c 'import json; from pytest_gpumem.baselines.validation import json_schema; "
        "print(json.dumps(json_schema(), indent=2, ensure_ascii=False))' > pytest_gpumem/schema/baselines.schema.json"
    )
    packaged = resources.files("pytest_gpumem").joinpath("schema", "baselines.schema.json").read_text("utf-8")
    assert packaged == expected


def test_a_baseline_file_the_plugin_writes_conforms_to_the_published_schema(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(CONFTEST)
    run(pytester, "--gpumem-update-baselines", "--gpumem-sites=always").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    (env,) = data["environments"].values()
    spans = env["tests"]["test_suite.py::test_step"]["spans"]
    assert env["environment"]["labels"] == {"runner": "pool-a"} and set(spans) == {"call", "step"}
    assert spans["call"]["sites"]  # every part the schema describes is there
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert problems(schema, data) == []
    spans["call"]["peak"] = -1
    spans["step"]["allocated"] = "1 MiB"
    data["schema"] = 2
    test = f"/environments/{next(iter(data['environments']))}/tests/test_suite.py::test_step"
    assert problems(schema, data) == [
        "/schema: 2 is not 1",
        f"{test}/spans/call/peak: -1 out of range",
        f"{test}/spans/step/allocated: '1 MiB' is not ['integer', 'null']",
    ]
    assert problems(schema, {}) == ["/: no 'schema'"]


def test_an_error_names_the_line_and_column_of_the_bad_value(tmp_path: Path) -> None:
    text = (
        '{\n  "schema": 1,\n  "environments": {\n    "k": {\n      "tests": {\n'
        '        "t.py::a": {"spans": {"call": {"peak": 1, "reserved": "1 MiB"}}}\n      }\n    }\n  }\n}\n'
    )
    path = tmp_path / "b.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(BaselineFileError) as info:
        load(path)
    column = text.splitlines()[5].index('"1 MiB"') + 1
    assert (info.value.line, info.value.column) == (6, column)
    assert str(info.value).startswith(
        f'{path}:6:{column}: ["environments"]["k"]["tests"]["t.py::a"]["spans"]["call"]["reserved"]: '
        "expected an integer number of bytes or null, found the string '1 MiB'"
    )
    assert path.read_text(encoding="utf-8") == text  # never rewritten


def test_a_key_of_the_same_name_nested_in_an_earlier_value_does_not_mislead_the_position(tmp_path: Path) -> None:
    # a later release's key holds the same names first: the error is where the file reader found the value
    text = (
        '{"schema": 1, "environments": {"k": {\n'
        '  "later": {"tests": {"t": {"spans": {"call": {"peak": "kept"}}}}},\n'
        '  "tests": {"t": {"spans": {"call": {"peak": 1.5}}}}}}}\n'
    )
    path = tmp_path / "b.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(BaselineFileError) as info:
        load(path)
    assert (info.value.line, info.value.column) == (3, text.splitlines()[2].index("1.5") + 1)
    assert "found the number 1.5" in str(info.value)


def test_a_repeated_key_is_located_where_the_reader_took_it() -> None:
    text = '{"a": {"b": 1},\n "a": {"b": 2}}'
    assert position(text, ("a", "b")) == (2, 13)
    assert position(text, ("a", "missing")) == (2, 7)  # the deepest found
    assert position("[1]", ("a",)) == (None, None)


GOOD = {
    "schema": 1,
    "environments": {
        "k": {
            "environment": {"engine": "cpu", "labels": {"a": "b"}},
            "tests": {"t": {"spans": {"call": {"peak": 1, "allocated": -1, "breakdown": {"other": 1}, "sites": {}}}}},
        }
    },
}
DEEP = json.loads("[" * 40 + "]" * 40)
SPAN = '["environments"]["k"]["tests"]["t"]["spans"]["call"]'


def env(d: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = d["environments"]["k"]
    return found


def span(d: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = env(d)["tests"]["t"]["spans"]["call"]
    return found


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: span(d).update(later=-5, retained=-1), None),  # a later release's figure may be negative
        (lambda d: env(d).update(environment=None), None),
        (lambda d: env(d).pop("tests"), None),
        (
            lambda d: span(d).update(peak=True),
            f'{SPAN}["peak"]: expected an integer number of bytes or null, found a boolean',
        ),
        (lambda d: span(d).update(start=-1), f'{SPAN}["start"]: -1 is negative: this figure is never below 0'),
        (lambda d: span(d).update(later=2**70), f'{SPAN}["later"]: 1180591620717411303424 is beyond 2**63 - 1'),
        (lambda d: span(d).update(later=DEEP), f'{SPAN}["later"]: a value nested too deeply (more than 32 levels)'),
        (lambda d: env(d)["tests"]["t"].update(x=DEEP), '["tests"]["t"]["x"]: a value nested too deeply'),
        (lambda d: d.update(x=DEEP), '["x"]: a value nested too deeply'),
        (lambda d: span(d).update(breakdown={"other": 1.5}), "integer byte counts or null; 'other' is the number 1.5"),
        (lambda d: span(d).update(breakdown=[1]), "integer byte counts or null, found an array"),
        (lambda d: span(d).update(sites={"t.py:f+1 activations": 5}), "expected a string such as 'peak=1024"),
        (lambda d: span(d).update(sites=[]), f'{SPAN}["sites"]: expected an object of site figures, found an array'),
        (lambda d: env(d)["environment"]["labels"].update(a=5), "invalid environment label 'a'=5"),
        (lambda d: env(d)["environment"].update(device_name="unknown"), "which the key shows for None"),
        (lambda d: env(d)["tests"].update(t=None), '["tests"]["t"]: expected an object, found null'),
        (lambda d: d.update(schema=True), '["schema"]: the schema version must be an integer, found a boolean'),
    ],
)
def test_each_kind_of_bad_value_is_refused_at_its_place(
    tmp_path: Path, change: Callable[[dict[str, Any]], object], message: str | None
) -> None:
    data = copy.deepcopy(GOOD)
    change(data)
    text = json.dumps(data, indent=2)
    path = tmp_path / "b.json"
    path.write_text(text, encoding="utf-8")
    if message is None:
        load(path)
        return
    with pytest.raises(BaselineFileError) as info:
        load(path)
    assert message in str(info.value)
    line, column = info.value.line, info.value.column
    assert line is not None and column is not None
    assert text.splitlines()[line - 1][column - 1] in '-0123456789[{"tfn'  # the start of the bad value
    assert path.read_text(encoding="utf-8") == text
