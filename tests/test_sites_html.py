"""The HTML page of a failing test, in a real browser: at 1024 and 1400 pixels wide no column of
any table is clipped or hidden behind a scrollbar, and the page is no wider than the window
(headless Chromium, Debian's ``chromium``; skipped where it is not installed). The chart's y-axis
is scaled to the data, a limit above it a marker at the top edge; the Phases keep their ×N."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from test_sites import MODEL, TEST
from test_sites_truth import TRAINER

from conftest import run
from pytest_gpumem.data.figures import Measurement, Phase, Timeline
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.report.artifacts import INDEX_NAME
from pytest_gpumem.report.html import render_html

pytest_plugins = ["pytester"]

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
MiB = 1 << 20

#: Measures the page as laid out: its width against the window's, and every table header that
#: lies outside the window or outside its card's visible box (a card scrolls sideways when a
#: table does not fit it). Written into the body's ``data-result`` for ``--dump-dom`` to show.
PROBE = """<script>
(function () {
  const width = window.innerWidth;
  const out = {window: width, page: document.documentElement.scrollWidth, clipped: [], scrolled: []};
  for (const card of document.querySelectorAll('.card')) {
    const title = card.querySelector('h2') ? card.querySelector('h2').textContent : '';
    if (card.scrollWidth > card.clientWidth + 1) out.scrolled.push(title);
    const box = card.getBoundingClientRect();
    for (const th of card.querySelectorAll('th')) {
      const r = th.getBoundingClientRect();
      if (r.right > Math.min(width, box.right) + 0.5 || r.left < Math.max(0, box.left) - 0.5) {
        out.clipped.push(title + ': ' + th.textContent);
      }
    }
  }
  document.body.setAttribute('data-result', JSON.stringify(out));
})();
</script>"""


#: Gathers the probes' results, once every frame has loaded, into the frames page's ``data-results``.
GATHER = """<script>
window.addEventListener('load', function () {
  const results = [];
  for (const frame of document.querySelectorAll('iframe')) {
    results.push(JSON.parse(frame.contentDocument.body.getAttribute('data-result')));
  }
  document.body.setAttribute('data-results', JSON.stringify(results));
});
</script>"""


def _probed(page: Path) -> Path:
    """A copy of ``page`` that runs :data:`PROBE`."""
    html = page.read_text(encoding="utf-8")
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)  # the probe is a script
    probed = page.with_name(page.stem + ".probed.html")
    probed.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    return probed


def _chromium(url: str, width: int, height: int, *flags: str) -> str:
    """The DOM of ``url`` as headless Chromium leaves it once loaded, in a window of ``width`` × ``height``."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                *flags,
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    return done.stdout + "\n" + done.stderr[-2000:]


def _attribute(dom: str, name: str) -> Any:
    found = re.search(rf'{name}="([^"]*)"', dom)
    assert found is not None, dom[-3000:]
    return json.loads(found[1].replace("&quot;", '"').replace("&amp;", "&"))


def _layout(page: Path, width: int, height: int) -> dict[str, object]:
    """``page`` laid out by headless Chromium in a window of ``width`` × ``height`` pixels."""
    return _attribute(_chromium(_probed(page).as_uri(), width, height), "data-result")  # type: ignore[no-any-return]


def _layouts(pages: list[Path], windows: list[tuple[int, int]]) -> dict[tuple[Path, tuple[int, int]], dict[str, Any]]:
    """Each of ``pages`` laid out in each of ``windows`` (width × height) by one headless Chromium: in
    a frame of that size each, which is the window of the page in it (its width, its scrollbar),
    beside the others on one page. Each Chromium costs about a CPU-second to start."""
    cases = [(page, window) for page in pages for window in windows]
    frames = "".join(
        f'<iframe src="{_probed(page).as_uri()}" style="border:0;display:block;width:{w}px;height:{h}px"></iframe>'
        for page, (w, h) in cases
    )
    outer = pages[0].parent.parent / "frames.html"
    outer.write_text(f'<html><body style="margin:0">{frames}{GATHER}</body></html>', encoding="utf-8")
    # the frames page reads its frames' documents: file pages are each an origin of their own without the flag
    dom = _chromium(outer.as_uri(), 1400, 900, "--allow-file-access-from-files")
    return dict(zip(cases, _attribute(dom, "data-results"), strict=True))


def _pages(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The artifact pages of the worked examples: docs/sites.md's three regressions (an fp32 copy
    kept, the batch doubled, an eval pass without no_grad), a tensor kept in a list and
    ``amsgrad=True``, each failing against its baseline with its sites."""
    pytester.makepyfile(tinymodel=MODEL, test_train=TEST, test_trainer=TRAINER)
    pytester.syspathinsert()
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=2)
    pages = []
    for variable, regression in [("SITES_REGRESSION", r) for r in ("copy", "batch", "eval")] + [
        ("REGRESSION", r) for r in ("debug", "amsgrad")
    ]:
        monkeypatch.setenv(variable, regression)
        folder = pytester.path / "pages" / regression
        result = run(
            pytester, f"--gpumem-artifacts={folder}", "test_train.py" if variable[0] == "S" else "test_trainer.py"
        )
        result.assert_outcomes(failed=1)
        monkeypatch.delenv(variable)
        (page,) = [path for path in folder.glob("*.html") if path.name != INDEX_NAME]  # the run's index beside it
        assert "Sites at the peak" in page.read_text(encoding="utf-8")
        pages.append(page)
    return pages


@pytest.mark.slow  # five failing sessions and fifteen browser windows
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium (Debian's chromium package) is not installed")
def test_no_column_is_clipped_at_1024_and_1400_pixels(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worked example's page, in windows 1024 and 1400 pixels wide (with a vertical scrollbar
    and without one): the page is no wider than the window, no card scrolls sideways, and every
    column header lies inside the window and inside its card. The pages are laid out in frames of
    those sizes, by one Chromium (:func:`_layouts`): the frames' layouts are the windows' (the
    next test)."""
    windows = [(1024, 900), (1024, 6000), (1400, 900)]
    for (page, (width, height)), layout in _layouts(_pages(pytester, monkeypatch), windows).items():
        assert layout["window"] == width
        assert layout["page"] <= width, (page.name, width, layout)
        assert layout["scrolled"] == [] and layout["clipped"] == [], (page.parent.name, width, height, layout)


#: A card whose table's header is 1,390 pixels wide, on a page 3,000 pixels tall.
WIDE = """<html><head><style>body { margin: 0 } .card { display: block }</style></head><body>
<div class="card"><h2>wide</h2><table style="border-collapse: collapse"><tr>
<th style="box-sizing: border-box; width: 1390px; min-width: 1390px; padding: 0">a header</th></tr></table></div>
<div style="height: 3000px"></div></body></html>"""


@pytest.mark.slow  # four browser windows
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium (Debian's chromium package) is not installed")
def test_a_page_in_a_frame_is_laid_out_as_in_a_window_of_the_frames_size(tmp_path: Path) -> None:
    """What :func:`_layouts` finds in a frame is what a window of its size finds: a table 1,390
    pixels wide is clipped at 1024 pixels, and at 1400 with the vertical scrollbar (a page taller
    than the window), not without it."""
    folder = tmp_path / "pages"
    folder.mkdir()
    page = folder / "wide.html"
    page.write_text(WIDE, encoding="utf-8")
    windows = [(1024, 900), (1400, 900), (1400, 6000)]
    framed = _layouts([page], windows)
    for width, height in windows:
        assert framed[(page, (width, height))] == _layout(page, width, height), (width, height)
    assert [bool(framed[(page, window)]["clipped"]) for window in windows] == [True, True, False]


def _page(lines: dict[str, int], *, count: int = 1) -> str:
    series = {c: tuple((i + 1) * MiB if c == "activations" else MiB for i in range(6)) for c in CATEGORIES}
    timeline = Timeline(events=tuple(range(6)), series=series, marks=((0, "forward"),))
    peak = max(timeline.totals())
    measurement = Measurement(
        name="call",
        engine="cpu",
        device="cpu",
        start=0,
        peak=peak,
        allocated=peak,
        phases={"forward": Phase("forward", 0, peak, peak, count)},
    )
    return render_html(title="t.py::test", measurement=measurement, timeline=timeline, lines=lines)


def test_the_y_axis_is_scaled_to_the_data_and_a_limit_above_it_is_a_marker_at_the_top_edge() -> None:
    """An 11 MiB step under a 64 MiB limit: the axis ends near the data (not at 64 MiB), the
    limit is a short marker at the chart's top edge that says its value; a baseline within the
    data is a line at its height."""
    page = _page({"limit peak": 64 * MiB, "baseline peak": 8 * MiB})
    ticks = [float(t.split()[0]) for t in re.findall(r'<text class="tick"[^>]*>([^<]*) MiB</text>', page)]
    assert 11 <= max(ticks) <= 16  # the data's 11 MiB, rounded up to a tick
    (limit,) = re.findall(r'<line data-line="limit peak"[^>]*>', page)
    assert 'data-above="true"' in limit and 'y1="62"' in limit
    assert "↑ limit peak 64.00 MiB" in page
    (baseline,) = re.findall(r'<line data-line="baseline peak"[^>]*>', page)
    assert "data-above" not in baseline


def test_the_phases_table_keeps_the_times_a_phase_ran() -> None:
    """The terminal's "forward ×3" is the page's too."""
    assert re.search(r'<tr data-phase="forward"><td>forward ×3</td>', _page({}, count=3))
    assert re.search(r'<tr data-phase="forward"><td>forward</td>', _page({}, count=1))
