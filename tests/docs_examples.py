"""The Sybil set-up behind the root conftest: see its docstring."""

from __future__ import annotations

import os
import re
import tempfile
import unittest
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.example import SybilFailure
from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser

from pytest_gpumem.budgets import optimizers
from tests._warm_sessions import run_session

ROOT = Path(__file__).resolve().parent.parent
#: ``<!-- test-file: test_x.py -->`` (or ``quickstart``) on the line before a block.
_TEST_FILE = re.compile(r"<!--\s*(?:quickstart|test-file):\s*(test_\w+\.py)\s*-->\s*$")


def _test_file_name(document: Document, region: Region) -> str | None:
    """The test module's file name when the line before ``region`` marks it as one."""
    before = document.text[: region.start].rstrip().rsplit("\n", 1)[-1]
    found = _TEST_FILE.search(before)
    return found.group(1) if found else None


class _CodeBlocks(PythonCodeBlockParser):
    """Python blocks and doctests, without the blocks that are test modules."""

    def __call__(self, document: Document) -> Any:
        for region in super().__call__(document):
            if _test_file_name(document, region) is None:
                yield region


class _TestFiles(PythonCodeBlockParser):
    """The blocks that are test modules: each runs as a pytest session in a process of its own
    (forked from one that has imported torch: ``tests/_warm_sessions.py``)."""

    def __call__(self, document: Document) -> Any:
        for region in super().__call__(document):
            name = _test_file_name(document, region)
            if name is not None:
                region.parsed = (name, str(region.parsed))
                region.evaluator = _run_test_file
                yield region


def _run_test_file(example: Example) -> str | None:
    name, source = example.parsed
    folder = Path(_RUNNING["folder"]) / Path(example.path).stem
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(source, encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    # on the CPU engine, as the documents' outputs are, whatever the machine has
    command = [
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--gpumem-device=cpu",
        name,
    ]
    with tempfile.TemporaryDirectory(prefix="gpumem-docs-output-") as output:  # not in the example's folder
        stdout, stderr = Path(output) / "stdout", Path(output) / "stderr"
        code = run_session(command, cwd=folder, env=env, stdout=stdout, stderr=stderr)
        out, err = stdout.read_text(encoding="utf8"), stderr.read_text(encoding="utf8")
    if code != 0:
        return f"{name} (line {example.line}) failed as a pytest session:\n{out[-6000:]}{err[-2000:]}"
    return None


#: The working directory to return to, and the temporary folder, of the document running now.
_RUNNING: dict[str, str] = {}
#: The optimizer registry as it was before the document ran.
_REGISTRY: dict[str, Any] = {}


def _setup(namespace: dict[str, Any]) -> None:
    """Each document runs in a fresh temporary folder (what an example writes lands there)."""
    import tempfile

    _REGISTRY.update(rules=dict(optimizers._RULES), names=dict(optimizers._NAMES))
    _RUNNING["folder"] = tempfile.mkdtemp(prefix="gpumem-docs-")
    _RUNNING["cwd"] = os.getcwd()
    os.chdir(_RUNNING["folder"])


def _teardown(namespace: dict[str, Any]) -> None:
    """Back to the working directory; the document's objects (and their tensors) go."""
    import gc
    import shutil

    os.chdir(_RUNNING.pop("cwd"))
    shutil.rmtree(_RUNNING.pop("folder"), ignore_errors=True)
    namespace.clear()
    # An example's registered optimizer leaves with it: its rule's globals were the namespace.
    optimizers._RULES.clear()
    optimizers._RULES.update(_REGISTRY.pop("rules"))
    optimizers._NAMES.clear()
    optimizers._NAMES.update(_REGISTRY.pop("names"))
    gc.collect()


DOCS = Sybil(
    parsers=[_CodeBlocks(), _TestFiles(), SkipParser(), ClearNamespaceParser()],
    patterns=["README.md", "docs/*.md"],
    path=str(ROOT),
)


class DocumentItem(pytest.Item):
    """All the examples of one document, in order, as one test: they share a namespace, so they
    must run in one process and in the order written, whatever pytest-xdist or pytest-randomly
    do with the other tests."""

    def runtest(self) -> None:
        document = DOCS.parse(self.path)
        _setup(document.namespace)
        try:
            for example in document.examples():
                try:
                    example.evaluate()
                except (unittest.SkipTest, pytest.skip.Exception):  # a block left out with a reason
                    continue
        finally:
            _teardown(document.namespace)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, SybilFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"the examples of {self.path.name}"


class DocumentFile(pytest.File):
    """A Markdown document whose code blocks are tests."""

    def collect(self) -> Any:
        item = DocumentItem.from_parent(self, name="examples")
        if any(_TEST_FILE.search(line) for line in self.path.read_text(encoding="utf-8").splitlines()):
            item.add_marker(pytest.mark.slow)  # its test modules run as pytest sessions in processes of their own
        yield item


def collect_document(file_path: Path, parent: pytest.Collector) -> DocumentFile | None:
    """The ``pytest_collect_file`` hook of the root conftest: the README and ``docs/*.md``."""
    if DOCS.should_parse(file_path):
        return DocumentFile.from_parent(parent, path=file_path)
    return None
