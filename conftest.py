"""The documentation's examples run as tests, under Sybil (https://sybil.readthedocs.io).

Every Python code block of the README and of ``docs/*.md`` runs in its document's namespace,
in the order written; a block written as a doctest (``>>>``) has its shown output compared.
A block marked ``<!-- test-file: test_NAME.py -->`` (``<!-- quickstart: ... -->`` for the
README's) is a test module: it runs as a pytest session of its own, on the CPU engine, which
must pass. ``<!-- skip: next "why" -->`` leaves a block out;
``<!-- clear-namespace -->`` starts an example afresh. Each document is one test (its blocks
share a namespace, so pytest-xdist and pytest-randomly must not split or reorder them) and
runs in an empty temporary folder, so that what an example writes lands there. The set-up is
``tests/docs_examples.py``.

Sybil was chosen over pytest-examples and pytest-codeblocks: it runs Markdown code blocks
and doctests in one namespace per document (the docs build one example over several
blocks), compares doctest output, has skip and namespace directives in HTML comments that
GitHub does not render, and takes a custom parser for the blocks that are test modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import sybil  # noqa: F401
except ImportError:  # the demo suite runs without the development tools; the docs' examples need Sybil
    _INSTALL = 'python -m pip install -U "pip>=25.1" && python -m pip install -e . --group dev'

    class _NotRun(pytest.Item):
        def runtest(self) -> None:
            pytest.skip("the documentation's examples run under Sybil, which is not installed: " + _INSTALL)

    class _Document(pytest.File):
        def collect(self) -> list[pytest.Item]:
            return [_NotRun.from_parent(self, name="examples")]

    def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> _Document | None:
        root = Path(__file__).resolve().parent
        if file_path.suffix == ".md" and (file_path.parent == root / "docs" or file_path == root / "README.md"):
            return _Document.from_parent(parent, path=file_path)
        return None

else:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
    from docs_examples import collect_document

    pytest_collect_file = collect_document
