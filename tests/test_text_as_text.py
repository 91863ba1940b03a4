"""Reports carry text as text: a test id, a span name or an environment label reaches the Markdown
report (and ``$GITHUB_STEP_SUMMARY``) escaped for Markdown, the terminal without its control
characters, and the baseline key without a character that would make it ambiguous."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import run
from pytest_gpumem.baselines import Environment
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.judge.limits import SpecError, check_span_name
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.text import SUMMARY_HEADERS, markdown_report, terminal_summary

#: What a test id or span name may hold that Markdown would render as something else.
HOSTILE = "a![img](http://example.invalid/x.png)<img src=x onerror=alert(1)>|`code`*em*_u_[l](h)~~s~~\\&amp;b"


def _record(test: str, span: str) -> TestRecord:
    call = Measurement("call", "cpu", "cpu", start=0, peak=400, allocated=400)
    named = Measurement(span, "cpu", "cpu", start=0, peak=100, allocated=0)
    finding = Finding(test, span, "peak", "baseline", "new", 100, None, detail="no baseline")
    return TestRecord(test, measurements=[call, named], findings=[finding])


def _github(text: str) -> list:
    """The tokens of ``text`` as GitHub renders Markdown (CommonMark, GFM tables and
    strikethrough, raw HTML allowed)."""
    return MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"]).parse(text)


def test_test_ids_and_span_names_are_text_in_the_markdown_report() -> None:
    test = f"test_x.py::test_step[{HOSTILE}]"
    span = f"span {HOSTILE}"
    markdown = markdown_report([_record(test, span)], header="cpu | torch 2.13 | `labelled`")
    tokens = _github(markdown)
    kinds = {token.type for token in tokens} | {child.type for token in tokens for child in token.children or ()}
    assert not kinds & {"image", "html_inline", "html_block", "link_open", "em_open", "strong_open", "s_open"}
    texts = ["".join(child.content for child in token.children or ()) for token in tokens if token.type == "inline"]
    assert test in texts and span in texts  # each shown as it is, as text
    environment = next(token for token in tokens if token.type == "inline" and "Environment" in token.content)
    assert [child.content for child in environment.children if child.type == "code_inline"] == [
        "cpu | torch 2.13 | `labelled`"
    ]


def test_every_row_of_the_markdown_table_has_its_cells() -> None:
    markdown = markdown_report([_record(f"t.py::test[{HOSTILE}]", f"s{HOSTILE}")])
    tokens = _github(markdown)
    rows = [i for i, token in enumerate(tokens) if token.type == "tr_open"]
    ends = [i for i, token in enumerate(tokens) if token.type == "tr_close"]
    spans = zip(rows, ends, strict=True)
    cells = [sum(tokens[j].type in ("td_open", "th_open") for j in range(a, b)) for a, b in spans]
    assert cells == [len(SUMMARY_HEADERS)] * len(rows) and len(rows) >= 3


@pytest.mark.parametrize("name", ["\x1b[31mred", "two\nlines", "bell\x07", "del\x7f", "csi\x9b"])
def test_a_span_name_with_a_control_character_is_refused(name: str) -> None:
    with pytest.raises(SpecError, match="control character"):
        check_span_name(name)


def test_control_characters_from_a_baseline_file_never_reach_the_terminal_raw() -> None:
    """A span or test name read back from an edited baseline file (a stale row) is shown escaped."""
    test = "t.py::test_\x1b]8;;http://x\x07link"
    record = _record("t.py::ok", "step")
    record.findings.append(Finding(test, "\x1b[2Jspan", "*", "baseline", "stale", detail="recorded span"))
    text = terminal_summary([record], stale=[Finding(test, "*", "*", "baseline", "stale", detail="k")])
    assert text is not None
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2Jspan" in text and "t.py::test_\\x1b]8;;http://x\\x07link" in text


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"labels": (("runner", "a | b"),)}, "'|'"),
        ({"device_name": "A100 | torch 2.13"}, "'|'"),
        ({"device_name": "A100\nH100"}, "line break"),
        ({"compute_capability": "9.0\x1b[31m"}, "control character"),
        ({"allocator": (("PYTORCH_CUDA_ALLOC_CONF", "a|b"),)}, "'|'"),
        ({"device_name": "unknown"}, "use None"),
        ({"torch_version": ""}, "empty"),
        ({"cudnn_version": " 91002"}, "leading or trailing spaces"),
    ],
)
def test_an_environment_that_would_make_an_ambiguous_key_is_refused(change: dict, problem: str) -> None:
    base = Environment(engine="cuda", device_name="NVIDIA H100", torch_version="2.13", allocator=())
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(base, **change)


def test_the_environment_hook_cannot_make_an_ambiguous_key(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import dataclasses

def pytest_gpumem_environment(config, environment):
    return dataclasses.replace(environment, torch_version="2.13 | cuda_rounding on")
"""
    )
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gpumem(peak="1MiB")
def test_step():
    pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pytest_gpumem_environment hook: invalid environment torch_version *'|'*"])


def test_a_baseline_file_whose_environment_makes_an_ambiguous_key_is_refused(tmp_path: Path) -> None:
    from pytest_gpumem.baselines import BaselineFileError, load

    path = tmp_path / "gpumem-baselines.json"
    described = {"engine": "cuda", "device_name": "A100 | torch 2.13", "torch_version": "2.13"}
    tree = {"schema": 1, "environments": {"k": {"environment": described, "tests": {}}}}
    path.write_text(json.dumps(tree))
    with pytest.raises(BaselineFileError, match=r"device_name.*contains '\|'"):
        load(path)
