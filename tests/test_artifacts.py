"""Tests of pytest_gpumem.report.artifacts: artifact file names and the HTML page."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpumem.data.figures import Measurement, Phase, Timeline
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.report.artifacts import MAX_NAME_LENGTH, artifact_path, artifact_stem, write_html
from pytest_gpumem.report.html import render_html
from pytest_gpumem.units import format_size

GiB = 1 << 30
MiB = 1 << 20

NASTY_IDS = [
    "",
    ".",
    "..",
    "/",
    "\\",
    "-",
    ".hidden::test",
    "../../../etc/passwd",
    "..\\..\\windows\\system32",
    "/absolute/path.py::test",
    "C:\\Users\\x.py::test",
    "test_x[ü-日本/../..]",
    "test_x[a b\tc\nd\re]",
    "test_x[\x00nul\x01\x1f\x7f]",
    "test_x[\ud800lone surrogate]",
    "test_x[😀]",
    "CON",
    "con.py::test",
    "NUL.txt",
    "COM1",
    "lpt9.py::t",
    "tests/test_a.py::test_b[" + "x/" * 500 + "]",
    "é" * 1000,
    "a" * 10_000,
    "trailing dot.",
    "trailing space ",
    "test[..]",
    "test[%2e%2e%2f]",
    "test[~user]",
    "test[$HOME]",
    "test[*?<>|\"':]",
]


# ---------------------------------------------------------------------------
# File names
# ---------------------------------------------------------------------------


def _check_name(directory: Path, nodeid: str, suffix: str = ".html") -> Path:
    path = artifact_path(directory, nodeid, suffix)
    base = directory.resolve()
    name = path.name
    assert path.parent == base
    assert path.resolve().parent == base
    assert os.path.commonpath([base, path.resolve()]) == str(base)
    assert name not in ("", ".", "..")
    assert "/" not in name and "\\" not in name and os.sep not in name
    assert Path(name).name == name
    assert name.isascii() and re.fullmatch(r"[A-Za-z0-9._-]+", name), name
    assert not name.startswith((".", "-"))
    assert len(name) <= MAX_NAME_LENGTH
    assert name.endswith(suffix)
    return path


def test_stem_of_a_typical_node_id_is_readable_and_stable() -> None:
    nodeid = "tests/test_train.py::test_step[cuda-bf16]"
    # Stable across runs and machines: pinned, since baselines and CI artifact names rely on it.
    assert artifact_stem(nodeid) == "tests_test_train.py_test_step_cuda-bf16-0bd031a728"
    assert artifact_stem(nodeid) == artifact_stem(str(nodeid))


def test_stem_keeps_safe_characters_and_replaces_the_rest() -> None:
    assert artifact_stem("test_x[ü-日本/../..]").startswith("test_x-")
    assert artifact_stem("a b/c").startswith("a_b_c-")
    assert artifact_stem("x..y").startswith("x.y-")
    assert artifact_stem("../../etc/passwd").startswith("etc_passwd-")


def test_empty_or_fully_unsafe_node_id_is_just_the_hash() -> None:
    assert re.fullmatch(r"[0-9a-f]{10}", artifact_stem(""))
    assert re.fullmatch(r"[0-9a-f]{10}", artifact_stem("日本"))
    assert artifact_stem("") != artifact_stem("日本")


@pytest.mark.parametrize("nodeid", ["CON", "con.py::test", "NUL.txt", "COM1", "lpt9.py::t", "Aux.x"])
def test_windows_device_names_are_avoided(nodeid: str) -> None:
    stem = artifact_stem(nodeid)
    assert stem.split(".", 1)[0].split("-", 1)[0].upper() not in {"CON", "NUL", "COM1", "LPT9", "AUX", "PRN"}
    assert stem.startswith("_")


def test_long_node_id_keeps_its_head_and_tail() -> None:
    nodeid = "tests/test_models.py::test_step[" + "-".join(f"p{i}" for i in range(300)) + "-final_id]"
    stem = artifact_stem(nodeid)
    assert len(stem) <= 121
    assert stem.startswith("tests_test_models.py_test_step_p0-p1")
    assert "final_id-" in stem


@pytest.mark.parametrize("nodeid", NASTY_IDS, ids=range(len(NASTY_IDS)))
def test_nasty_node_ids_stay_inside_the_directory(tmp_path: Path, nodeid: str) -> None:
    path = _check_name(tmp_path, nodeid)
    write_html(path, "<p>x</p>")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_nasty_node_ids_do_not_collide(tmp_path: Path) -> None:
    names = [artifact_path(tmp_path, nodeid, ".html").name for nodeid in NASTY_IDS]
    assert len(set(names)) == len(NASTY_IDS)
    assert len({name.casefold() for name in names}) == len(NASTY_IDS)
    for name in names:
        (tmp_path / name).write_text("x")
    assert len(list(tmp_path.iterdir())) == len(NASTY_IDS)


@given(nodeid=st.text(max_size=400), suffix=st.sampled_from(["", ".html", ".pickle", ".snapshot.pickle"]))
@settings(max_examples=300, deadline=None)
def test_any_node_id_gives_one_safe_component(
    tmp_path_factory: pytest.TempPathFactory, nodeid: str, suffix: str
) -> None:
    directory = tmp_path_factory.getbasetemp() / "artifacts"
    _check_name(directory, nodeid, suffix)
    assert artifact_stem(nodeid) == artifact_stem(nodeid)


@given(nodeids=st.lists(st.text(max_size=60), min_size=2, max_size=40, unique=True))
@settings(max_examples=200, deadline=None)
def test_distinct_node_ids_get_distinct_names(nodeids: list[str]) -> None:
    names = [artifact_path(Path("artifacts"), nodeid, ".html").name for nodeid in nodeids]
    assert len(set(names)) == len(nodeids)
    assert len({name.casefold() for name in names}) == len(nodeids)  # case-insensitive file systems


@given(nodeid=st.text(alphabet=st.sampled_from("./\\.:[]-_ aA\x00"), max_size=50))
@settings(max_examples=300, deadline=None)
def test_path_like_node_ids_stay_inside(tmp_path_factory: pytest.TempPathFactory, nodeid: str) -> None:
    _check_name(tmp_path_factory.getbasetemp() / "artifacts", nodeid)


def test_relative_directory_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = artifact_path(Path("out/../out"), "t.py::test", ".html")
    assert path.is_absolute()
    assert path.parent == tmp_path.resolve() / "out"


@pytest.mark.parametrize("suffix", ["html", "/html", ".ht/ml", ".ht ml", "./", "..", ".", ".html.", ".a" * 20, ".é"])
def test_unsafe_suffix_is_refused(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(ValueError, match="suffix"):
        artifact_path(tmp_path, "t.py::test", suffix)


def test_symlink_pointing_outside_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "artifacts"
    directory.mkdir()
    outside = tmp_path / "outside.html"
    path = artifact_path(directory, "t.py::test", ".html")
    try:
        path.symlink_to(outside)
    except OSError:  # pragma: no cover - platforms without symlinks
        pytest.skip("symlinks not available")
    with pytest.raises(ValueError, match="escapes"):
        artifact_path(directory, "t.py::test", ".html")


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def test_write_html_creates_parents_and_writes_utf8(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "page.html"
    write_html(path, "<p>日本 ü</p>")
    assert path.read_bytes() == "<p>日本 ü</p>".encode()
    write_html(path, "<p>second</p>")
    assert path.read_text(encoding="utf-8") == "<p>second</p>"
    assert [p.name for p in path.parent.iterdir()] == ["page.html"]


def test_write_html_leaves_the_old_file_and_no_temporary_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "page.html"
    write_html(path, "old")

    def fail(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_html(path, "new")
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]


# ---------------------------------------------------------------------------
# HTML page: a small DOM built with html.parser
# ---------------------------------------------------------------------------

VOID = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "source", "wbr", "embed", "track"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    parent: Element | None = None
    children: list[Element] = field(default_factory=list)
    data: list[str] = field(default_factory=list)

    def iter(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            yield from child.iter()

    def find_all(self, tag: str | None = None, **attrs: str) -> list[Element]:
        return [
            el
            for el in self.iter()
            if (tag is None or el.tag == tag) and all(el.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def having(self, attribute: str) -> list[Element]:
        return [el for el in self.iter() if attribute in el.attrs]

    def text(self) -> str:
        return "".join(self.data) + "".join(child.text() for child in self.children)

    def child(self, tag: str) -> Element:
        (found,) = [c for c in self.children if c.tag == tag]
        return found


class PageParser(HTMLParser):
    """Builds an Element tree and checks that every non-void tag is closed in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, parent=self.stack[-1])
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}, parent=self.stack[-1]))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].data.append(data)


def parse(page: str) -> Element:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.stack == [parser.root], "unclosed elements"
    return parser.root


def path_points(d: str) -> list[tuple[float, float]]:
    """Absolute points of SVG path data made of M, L, H, V and Z."""
    points: list[tuple[float, float]] = []
    x = y = 0.0
    for command, args in re.findall(r"([MLHVZ])([^MLHVZ]*)", d):
        numbers = [float(n) for n in re.findall(r"-?[0-9.]+", args)]
        if command in "ML":
            x, y = numbers
        elif command == "H":
            (x,) = numbers
        elif command == "V":
            (y,) = numbers
        else:
            continue
        points.append((x, y))
    return points


def make_timeline(
    n: int, marks: tuple[tuple[int, str], ...] = (), value: Callable[[str, int], int] | None = None
) -> Timeline:
    def default(category: str, i: int) -> int:
        return (CATEGORIES.index(category) + 1) * MiB + (i % 7) * 64 * 1024

    value = value or default
    return Timeline(
        events=tuple(range(n)),
        series={category: tuple(value(category, i) for i in range(n)) for category in CATEGORIES},
        marks=marks,
    )


def make_measurement(timeline: Timeline, **changes: object) -> Measurement:
    totals = timeline.totals()
    peak = max(totals) if totals else 3 * MiB
    top = totals.index(peak) if totals else 0
    fields: dict[str, object] = {
        "name": "step",
        "engine": "cuda",
        "device": "cuda:0",
        "start": totals[0] if totals else MiB,
        "peak": peak,
        "allocated": totals[-1] if totals else MiB,
        "reserved": peak + 2 * MiB,
        "start_reserved": 2 * MiB,
        "retained": 0,
        "breakdown": {c: timeline.series[c][top] for c in CATEGORIES} if totals else None,
        "phases": {
            "forward": Phase("forward", MiB, 5 * MiB, 4 * MiB),
            "backward": Phase("backward", 4 * MiB, 6 * MiB, 3 * MiB),
            "optimizer": Phase("optimizer", 3 * MiB, 3 * MiB + 512, 3 * MiB),
        },
        "psi": 1234,
    }
    fields.update(changes)
    return Measurement(**fields)  # type: ignore[arg-type]


def render(
    timeline: Timeline | None = None,
    *,
    lines: Mapping[str, int] | None = None,
    details: tuple[str, ...] = (),
    title: str = "tests/test_x.py::test_step",
    **changes: object,
) -> str:
    timeline = timeline if timeline is not None else make_timeline(50, ((0, "forward"), (20, "backward")))
    measurement = make_measurement(timeline, **changes)
    return render_html(title=title, measurement=measurement, timeline=timeline, lines=lines or {}, details=details)


# ---------------------------------------------------------------------------
# HTML page: chart
# ---------------------------------------------------------------------------


def test_one_area_per_category_in_order_with_hover_title() -> None:
    svg = parse(render()).find_all("svg")[0]
    areas = svg.having("data-category")
    assert [a.attrs["data-category"] for a in areas] == list(CATEGORIES)
    for area in areas:
        assert area.tag == "path"
        assert area.attrs["fill"].startswith("#")
        assert path_points(area.attrs["d"])
        assert area.attrs["data-category"].replace("_", " ") in area.child("title").text()
    assert len({a.attrs["fill"] for a in areas}) == len(CATEGORIES)


def test_legend_names_every_category() -> None:
    svg = parse(render()).find_all("svg")[0]
    legend = [el.child("text").text() for el in svg.having("data-legend")]
    assert legend == [c.replace("_", " ") for c in CATEGORIES]


def test_areas_stack_and_peak_is_the_top() -> None:
    timeline = make_timeline(40)
    root = parse(render(timeline))
    areas = {
        a.attrs["data-category"]: path_points(a.attrs["d"]) for a in root.having("data-category") if a.tag == "path"
    }
    parameters_bottom = max(y for _, y in areas["parameters"])
    other_top = min(y for _, y in areas["other"])
    (peak,) = root.having("data-peak")
    assert int(peak.attrs["data-peak"]) == max(timeline.totals())
    assert float(peak.attrs["cy"]) == pytest.approx(other_top, abs=0.11)
    assert other_top < parameters_bottom


def test_phase_marks_are_labelled_vertical_lines_in_event_order() -> None:
    marks = ((0, "forward"), (20, "backward"), (35, "optimizer"))
    root = parse(render(make_timeline(50, marks)))
    lines = root.having("data-phase")
    chart_lines = [el for el in lines if el.tag == "line"]
    assert [el.attrs["data-phase"] for el in chart_lines] == ["forward", "backward", "optimizer"]
    xs = [float(el.attrs["x1"]) for el in chart_lines]
    assert xs == sorted(xs) and len(set(xs)) == 3
    for el in chart_lines:
        assert el.attrs["x1"] == el.attrs["x2"]
        assert el.parent is not None and el.attrs["data-phase"] in el.parent.text()


def test_close_phase_labels_go_to_separate_rows() -> None:
    marks = ((10, "forward"), (11, "backward"), (12, "optimizer"))
    root = parse(render(make_timeline(1000, marks)))
    texts = [el.parent.child("text") for el in root.having("data-phase") if el.tag == "line" and el.parent]
    assert len({t.attrs["y"] for t in texts}) == 3


def test_reference_lines_are_drawn_at_their_height() -> None:
    lines = {"limit peak": 20 * MiB, "baseline peak": 15 * MiB, "budget allocated": 12 * MiB, "small": 1 * MiB}
    root = parse(render(lines=lines))
    drawn = {el.attrs["data-line"]: el for el in root.having("data-line")}
    assert set(drawn) == set(lines)
    for name, el in drawn.items():
        assert int(el.attrs["data-bytes"]) == lines[name]
        assert el.attrs["y1"] == el.attrs["y2"]
        assert name in el.parent.text()  # type: ignore[union-attr]
    by_height = sorted(lines, key=lines.__getitem__)
    ys = [float(drawn[name].attrs["y1"]) for name in by_height]
    assert ys == sorted(ys, reverse=True) and len(set(ys)) == len(ys)  # higher limit, higher on the page


def test_a_limit_far_above_the_samples_is_a_marker_at_the_top_edge_and_the_axis_fits_the_data() -> None:
    root = parse(render(lines={"limit peak": 4 * GiB}))
    (line,) = root.having("data-line")
    (peak,) = root.having("data-peak")
    svg = root.find_all("svg")[0]
    height = float(svg.attrs["viewbox"].split()[3])
    assert 0 < float(line.attrs["y1"]) < float(peak.attrs["cy"]) < height
    assert line.attrs["data-above"] == "true" and "4.00 GiB" in line.parent.text()  # type: ignore[union-attr]
    tick_labels = [el.text() for el in svg.find_all("text", **{"class": "tick"})]
    assert not any("GiB" in label for label in tick_labels)  # the axis is the data's


def test_axis_ticks_are_readable_sizes() -> None:
    svg = parse(render(make_timeline(10, value=lambda c, i: GiB if c == "parameters" else 0))).find_all("svg")[0]
    labels = [el.text() for el in svg.find_all("text", **{"class": "tick"})]
    assert "0 B" in labels
    size_labels = [label for label in labels if label.endswith("B")]
    assert all(re.fullmatch(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)", label) for label in size_labels), size_labels
    assert "1.00 GiB" in size_labels or "1 GiB" in size_labels


def test_empty_timeline_renders_axes_and_measured_peak() -> None:
    timeline = Timeline(events=(), series={c: () for c in CATEGORIES})
    page = render(timeline, lines={"limit peak": 8 * MiB}, peak=5 * MiB)
    root = parse(page)
    assert [a.attrs["data-category"] for a in root.having("data-category") if a.tag == "path"] == list(CATEGORIES)
    (peak,) = root.having("data-peak")
    assert int(peak.attrs["data-peak"]) == 5 * MiB
    assert float(root.having("data-line")[0].attrs["y1"]) < float(peak.attrs["y1"])
    assert "no timeline samples" in root.text()


def test_single_event_fills_the_width() -> None:
    timeline = make_timeline(1, ((0, "forward"),))
    root = parse(render(timeline))
    points = path_points(root.find_all("path", data_category="parameters")[0].attrs["d"])
    xs = [x for x, _ in points]
    assert max(xs) - min(xs) > 500


def test_missing_and_short_series_read_zero() -> None:
    timeline = Timeline(events=(0, 1, 2), series={"parameters": (MiB, MiB, MiB), "gradients": (MiB,)})
    measurement = Measurement(name="call", engine="cpu", device="cpu", start=0, peak=2 * MiB, allocated=MiB)
    root = parse(render_html(title="t", measurement=measurement, timeline=timeline))
    assert len(root.having("data-category")) >= len(CATEGORIES)
    assert int(root.having("data-peak")[0].attrs["data-peak"]) == 2 * MiB


def test_large_timeline_is_downsampled_but_keeps_its_peak() -> None:
    n = 20_000
    spike = 12_345

    def value(category: str, i: int) -> int:
        if category == "activations":
            return 512 * MiB if i == spike else (i % 97) * MiB
        return (i % 13) * MiB

    timeline = make_timeline(n, ((0, "forward"), (9_000, "backward"), (18_000, "optimizer")), value)
    page = render(timeline)
    assert len(page) < 200_000
    root = parse(page)
    paths = [el for el in root.having("data-category") if el.tag == "path"]
    coordinates = sum(len(path_points(el.attrs["d"])) for el in paths)
    assert coordinates < 5_000
    (peak,) = root.having("data-peak")
    assert int(peak.attrs["data-peak"]) == max(timeline.totals())
    other_top = min(y for _, y in path_points(root.find_all("path", data_category="other")[0].attrs["d"]))
    assert float(peak.attrs["cy"]) == pytest.approx(other_top, abs=0.11)
    assert "20,000 samples" in root.text()


# ---------------------------------------------------------------------------
# HTML page: tables, details, escaping, offline
# ---------------------------------------------------------------------------


def _row(root: Element, first_cell: str) -> list[str]:
    for tr in root.find_all("tr"):
        cells = [c.text().strip() for c in tr.children if c.tag in ("td", "th")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r}")


def test_figures_table_shows_values_costs_and_na() -> None:
    timeline = make_timeline(10)
    root = parse(render(timeline, start=MiB, reserved=None, start_reserved=None, retained=None))
    peak = max(timeline.totals())
    assert _row(root, "start")[1] == "1.00 MiB"
    assert _row(root, "peak")[1:3] == [format_size(peak), "+" + format_size(peak - MiB)]
    assert _row(root, "reserved")[1:3] == ["n/a", "n/a"]
    assert _row(root, "retained")[1] == "n/a"
    assert "engine" in root.find_all("p", **{"class": "meta"})[0].text()


def test_breakdown_and_phases_tables() -> None:
    breakdown = {"parameters": 3 * MiB, "gradients": MiB}
    root = parse(render(breakdown=breakdown))
    assert _row(root, "parameters")[1:] == ["3.00 MiB", "75.0%"]
    assert _row(root, "optimizer state")[1:] == ["0 B", "0.0%"]
    assert _row(root, "total")[1] == "4.00 MiB"
    assert [tr.attrs["data-phase"] for tr in root.find_all("tr") if "data-phase" in tr.attrs] == [
        "forward",
        "backward",
        "optimizer",
    ]
    assert _row(root, "backward")[1:] == ["4.00 MiB", "6.00 MiB", "3.00 MiB", "+2.00 MiB"]


def test_unmeasured_breakdown_and_no_phases_say_so() -> None:
    timeline = Timeline(events=(), series={})
    root = parse(render(timeline, breakdown=None, phases={}))
    text = root.text()
    assert "not measured (n/a)" in text
    assert "no phases recorded" in text


def test_details_are_shown_escaped_in_pre() -> None:
    details = ("peak 6.56 GiB exceeds the limit 6.00 GiB", "  <b>bold</b> & 'quotes' \"too\"")
    root = parse(render(details=details))
    (pre,) = root.find_all("pre")
    assert pre.text() == "\n" + "\n".join(details)  # the browser drops the newline after <pre>
    assert not pre.children


def test_no_details_section_without_details() -> None:
    assert not parse(render()).find_all("pre")


EVIL = "<script>alert('x')</script>\"><img src=x onerror=alert(1)>&amp;"


def test_user_strings_are_escaped() -> None:
    page = render(
        make_timeline(10, ((3, EVIL),)),
        title=EVIL,
        details=(EVIL,),
        lines={EVIL: 40 * MiB},
        name=EVIL,
        device=EVIL,
        phases={EVIL: Phase(EVIL, 0, 1, 0)},
    )
    assert "<script" not in page.lower()
    assert "<img" not in page.lower()
    root = parse(page)
    tags = {el.tag for el in root.iter()}
    assert not tags & {"script", "img", "iframe", "object"}
    assert not any(k.startswith("on") for el in root.iter() for k in el.attrs)
    assert root.find_all("h1")[0].text() == EVIL
    assert root.find_all("title")[0].text().startswith(EVIL)
    assert root.find_all("pre")[0].text() == "\n" + EVIL
    assert root.having("data-line")[0].attrs["data-line"] == EVIL
    assert [el.attrs["data-phase"] for el in root.having("data-phase") if el.tag == "line"] == [EVIL]


def test_control_characters_and_surrogates_are_replaced() -> None:
    title = "test[\x00\x1b[31m\ud800]"
    page = render(title=title, details=("line\x07one\nline two\ttab",))
    page.encode("utf-8")  # no lone surrogate left
    root = parse(page)
    assert root.find_all("h1")[0].text() == "test[\ufffd\ufffd[31m\ufffd]"
    assert root.find_all("pre")[0].text() == "\nline\ufffdone\nline two\ttab"


def test_page_is_self_contained_and_offline() -> None:
    page = render(lines={"limit peak": 40 * MiB}, details=("x",))
    lowered = page.lower()
    # The only "http" is the Content-Security-Policy meta tag (http-equiv), which forbids fetching anything.
    assert "http" not in lowered.replace("http-equiv", "")
    assert "default-src 'none'" in page
    for needle in ("<script", "<link", "<img", "<iframe", "src=", "href=", "url(", "@import", "xlink", "//"):
        assert needle not in lowered, needle
    root = parse(page)
    assert root.find_all("html")[0].attrs["lang"] == "en"
    assert root.find_all("meta")[0].attrs == {"charset": "utf-8"}
    assert len(root.find_all("svg")) == 1 and len(root.find_all("style")) == 1


def test_render_and_write_round_trip(tmp_path: Path) -> None:
    nodeid = "tests/test_x.py::test_step[ü/../..]"
    page = render(title=nodeid)
    path = artifact_path(tmp_path, nodeid, ".html")
    write_html(path, page)
    assert path.read_text(encoding="utf-8") == page
    assert path.parent == tmp_path.resolve()
