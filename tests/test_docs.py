"""The checks of the documentation that no documentation-testing library does.

The README's and docs' code blocks themselves run under Sybil (the root ``conftest.py``):
every Python block runs, doctests compare their output, blocks marked
``<!-- test-file: NAME.py -->`` run as pytest sessions. Here:

* their imports work in a fresh interpreter outside the checkout, where only what the
  wheel ships resolves (optional third-party packages that are not installed are skipped);
* the README's quick start's pasted output is what it prints;
* every relative link points to an existing file, and every ``#anchor`` to a heading;
* every name in the table of ``docs/library.md`` is importable from ``pytest_gpumem``.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import pytest_gpumem
from conftest import once_for_the_workers
from tests._warm_sessions import runpytest_warm

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
#: The documents whose code blocks are checked.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: The documents whose links are checked.
LINKED = [*DOCUMENTS, ROOT / "CONTRIBUTING.md"]
#: The packages the wheel ships (pyproject.toml, [tool.hatch.build.targets.wheel]).
SHIPPED = ("pytest_gpumem",)
#: Third-party packages examples may use that pytest-gpumem does not depend on.
OPTIONAL = frozenset({"transformers"})

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*(?P<kind>quickstart|test-file):\s*(?P<name>test_\w+\.py)\s*-->$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, its text, where it starts, and the marker before it."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: tuple[str, str] | None = None  # ("test-file", "test_x.py")

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(text: str, path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown text, with the marker comment on the line before each."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        language = (opening["info"].strip().split() or [""])[0].lower()
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found = _MARKER.match(previous)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: the code block is never closed")
        marker = (found["kind"], found["name"]) if found else None
        blocks.append(Block(path, i + 1, language, "\n".join(body) + "\n", marker))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path.read_text(encoding="utf-8"), path) if b.language in ("python", "py")]


def _ids(paths: list[Path]) -> list[str]:
    return [str(path.relative_to(ROOT)) for path in paths]


# -- the extractor itself -------------------------------------------------------------------


def test_code_blocks_are_found_with_their_markers() -> None:
    text = textwrap.dedent(
        """\
        Intro.

        <!-- test-file: test_a.py -->
        ```python
        import torch
        ```

        ````markdown
        ```python
        not a block of its own
        ```
        ````

        ~~~py
        x = 1
        ~~~
        ```
        plain
        ```
        """
    )
    blocks = code_blocks(text, ROOT / "README.md")
    assert [(b.line, b.language, b.marker) for b in blocks] == [
        (4, "python", ("test-file", "test_a.py")),
        (8, "markdown", None),
        (14, "py", None),
        (17, "", None),
    ]
    assert blocks[0].text == "import torch\n"
    assert "not a block of its own" in blocks[1].text
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```python\nx = 1\n", ROOT / "README.md")


def test_the_readme_has_one_quick_start() -> None:
    quick = [b for b in python_blocks(ROOT / "README.md") if b.marker and b.marker[0] == "quickstart"]
    assert len(quick) == 1, "README.md: mark the quick start's test file with <!-- quickstart: test_NAME.py -->"


# -- their imports work where only the installed package resolves ---------------------------

_IMPORT_RUNNER = r"""
import importlib.util, json, os, sys

root, shim, statements, optional = json.loads(sys.argv[1])

def checkout(entry):
    entry = os.path.abspath(entry or os.getcwd())
    return os.path.isfile(os.path.join(entry, "pyproject.toml")) and os.path.isdir(os.path.join(entry, "pytest_gpumem"))

# Any checkout of this project on sys.path (an editable install, PYTHONPATH) would make
# `fixtures` and the other repository folders importable: drop them, and import the
# package under test from a folder that holds it alone, as an installed wheel would.
sys.path[:] = [shim] + [entry for entry in sys.path if not checkout(entry)]

results = []
for where, source, top in statements:
    if top in optional and importlib.util.find_spec(top) is None:
        results.append([where, source, "skipped", top + " is not installed"])
        continue
    try:
        exec(compile(source, where, "exec"), {"__name__": "__doc_example__"})
    except BaseException as exc:
        results.append([where, source, "error", type(exc).__name__ + ": " + str(exc)])
    else:
        results.append([where, source, "ok", ""])
print(json.dumps(results))
"""


def _imports(block: Block) -> list[tuple[str, str, str]]:
    """``(where, statement, top-level module)`` for each import statement of ``block``.

    A block that does not parse has none here: :func:`test_python_blocks_parse` reports it.
    """
    try:
        tree = ast.parse(block.text)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            tops = [(node.module or "").split(".")[0] if node.level == 0 else "."]
        else:
            continue
        source = ast.get_source_segment(block.text, node) or ast.unparse(node)
        where = f"{block.where} (block line {node.lineno})"
        found.extend((where, source, top) for top in dict.fromkeys(tops))
    return found


def run_imports(statements: list[tuple[str, str, str]], folder: Path) -> dict[str, list[list[str]]]:
    """Run each import statement in a fresh interpreter in ``folder``; results by statement's place."""
    shim = folder / "site"
    shim.mkdir(exist_ok=True)
    for package in SHIPPED:
        link = shim / package
        if not link.exists():
            link.symlink_to(ROOT / package, target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    argument = json.dumps([str(ROOT), str(shim), statements, sorted(OPTIONAL)])
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_RUNNER, argument],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results: dict[str, list[list[str]]] = {}
    for where, source, status, detail in json.loads(done.stdout.splitlines()[-1]):
        results.setdefault(where.split(":")[0], []).append([where, source, status, detail])
    return results


@pytest.fixture(scope="module")
def import_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[list[str]]]:
    """Every document's import statements, run once for all the workers of a run."""
    statements = [item for path in DOCUMENTS for block in python_blocks(path) for item in _imports(block)]
    made: dict[str, list[list[str]]] = once_for_the_workers(
        request, "doc-imports", lambda: run_imports(statements, tmp_path_factory.mktemp("imports"))
    )
    return made


def test_the_import_check_sees_only_what_the_wheel_ships(tmp_path: Path) -> None:
    """The repository's own folders (fixtures/, scripts/) must not resolve there; the package must."""
    statements = [
        ("README.md:1", "import pytest_gpumem", "pytest_gpumem"),
        ("README.md:2", "import fixtures", "fixtures"),
        ("README.md:3", "import transformers", "transformers"),
    ]
    results = {where: (status, detail) for where, _, status, detail in run_imports(statements, tmp_path)["README.md"]}
    assert results["README.md:1"] == ("ok", "")
    assert results["README.md:2"][0] == "error" and "fixtures" in results["README.md:2"][1]
    assert results["README.md:3"][0] == ("ok" if importlib.util.find_spec("transformers") else "skipped")


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_imports_work_outside_the_checkout(path: Path, import_results: dict[str, list[list[str]]]) -> None:
    errors = [
        f"{where}: {source}\n    {detail}"
        for where, source, status, detail in import_results.get(str(path.relative_to(ROOT)), [])
        if status == "error"
    ]
    assert not errors, "imports that fail where only the installed package resolves:\n" + "\n".join(errors)


# -- test files in the documents run and pass --------------------------------------------------

_TEST_FILES = [block for path in DOCUMENTS for block in python_blocks(path) if block.marker]


def _run(pytester: pytest.Pytester, block: Block, *args: str) -> pytest.RunResult:
    assert block.marker is not None
    pytester.path.joinpath(block.marker[1]).write_text(block.text, encoding="utf-8")
    return runpytest_warm(pytester, "-p", "no:cacheprovider", *args)  # a process of its own, forked warm


def _output_after(block: Block) -> list[str]:
    """The lines of the first plain code block after ``block`` (the output a document shows for it)."""
    after = [b for b in code_blocks(block.path.read_text(encoding="utf-8"), block.path) if b.line > block.line]
    output = next((b for b in after if b.language == ""), None)
    assert output is not None, f"{block.where}: no output block after the quick start"
    return output.text.splitlines()


def _gpumem_section(lines: list[str]) -> list[str]:
    """From the ``= gpumem =`` line up to the last line before pytest's final ``passed`` line."""
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"=+ gpumem =+", line.strip()))
    end = next(i for i in range(len(lines) - 1, start, -1) if re.search(r"\d+ passed", lines[i]))
    return [line.rstrip() for line in lines[start:end]]


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.__version__.startswith("2.13."), reason="the quick start's output was recorded with torch 2.13"
)
def test_readme_quick_start_output_is_what_it_prints(pytester: pytest.Pytester) -> None:
    (block,) = [b for b in _TEST_FILES if b.path.name == "README.md" and b.marker and b.marker[0] == "quickstart"]
    result = _run(pytester, block, "--gpumem-device=cpu")
    result.assert_outcomes(passed=1)  # the quick start is one test
    assert _gpumem_section(_output_after(block)) == _gpumem_section(result.outlines)


# -- links and anchors --------------------------------------------------------------------------

_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")


def _outside_fences(text: str) -> str:
    """The text with the lines of fenced code blocks blanked (line numbers stay)."""
    lines, inside = [], None
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if inside is None and opening is not None:
            inside = opening["fence"]
            lines.append("")
        elif inside is not None:
            if re.match(rf"^ {{0,3}}{inside[0]}{{{len(inside)},}}\s*$", line):
                inside = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*{1,3})(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # *emphasis*
    text = re.sub(r"(?<!\w)(_{1,3})(?=\S)(.+?)(?<=\S)\1(?!\w)", r"\2", text)  # _emphasis_
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of a Markdown file, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for line in _outside_fences(path.read_text(encoding="utf-8")).splitlines():
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, leaving out code blocks and inline code."""
    text = _outside_fences(path.read_text(encoding="utf-8"))
    text = re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)
    return [*_LINK.findall(text), *_REFERENCE.findall(text)]


def test_slugs_follow_github() -> None:
    assert slug("Figures: what every metric means") == "figures-what-every-metric-means"
    assert slug("Counting parameters: Ψ") == "counting-parameters-ψ"
    assert slug("Out of memory, leaks and microbatches in a test") == "out-of-memory-leaks-and-microbatches-in-a-test"
    assert slug("The `gpumem` fixture") == "the-gpumem-fixture"
    assert slug("Reference model: `fixtures/gpt2.py`") == "reference-model-fixturesgpt2py"
    assert slug("Session overhead — `bench_overhead.py`") == "session-overhead--bench_overheadpy"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_links_are_found_outside_code() -> None:
    page = ROOT / "docs" / "figures.md"
    assert "baselines.md" in links(page)
    assert all("`" not in link for link in links(page))
    assert "figures-what-every-metric-means" in anchors(page)


@pytest.mark.parametrize("path", LINKED, ids=_ids(LINKED))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


# -- the library page's names --------------------------------------------------------------------


def library_names() -> list[str]:
    """The names in the first column of the table under "## Public names" in docs/library.md."""
    text = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    section = text.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|", section, re.MULTILINE)


LIBRARY_NAMES = library_names()


def test_the_library_table_lists_the_public_names() -> None:
    assert len(LIBRARY_NAMES) >= 30, LIBRARY_NAMES
    assert len(set(LIBRARY_NAMES)) == len(LIBRARY_NAMES), "a name is listed twice"
    exported: list[Any] = list(getattr(pytest_gpumem, "__all__", []))
    missing = sorted(set(exported) - set(LIBRARY_NAMES))
    assert not missing, f"pytest_gpumem.__all__ names missing from docs/library.md: {missing}"


@pytest.mark.parametrize("name", LIBRARY_NAMES)
def test_library_names_are_importable(name: str) -> None:
    module = importlib.import_module("pytest_gpumem")
    assert hasattr(module, name), (
        f"docs/library.md lists {name!r}, which `from pytest_gpumem import {name}` cannot import"
    )
