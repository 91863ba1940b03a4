"""The sites that changed: a span's site profile against its baseline's, as ``tracemalloc`` compares."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.data.site_figures import BEFORE, SiteFigures, SiteProfile

__all__ = ["SiteChange", "SiteDiff", "diff_sites", "merge_categories"]

Status = Literal["changed", "new", "gone", "unlisted"]


#: What a change's data carries after its baseline's bytes, for the reports' readers (not read back).
_AFTER: dict[str, Callable[[SiteChange], object]] = {
    "after": lambda c: {"peak": c.after_peak, "end": c.after_end},
    "delta": lambda c: {"peak": c.delta("peak"), "end": c.delta("end")},
}


@dataclass(frozen=True)
class SiteChange(Coded):
    """One site whose bytes changed, with the baseline's (None, or ``"unlisted"``, where it lists the largest only)."""

    _codec_order = ("site", "status")
    figures: SiteFigures = field(metadata=coded(key="site"))
    before_peak: int | None = field(metadata=coded(key="before.peak"))
    before_end: int | None = field(metadata=coded(key="before.end", then=_AFTER))
    status: Status = "changed"

    @property
    def after_peak(self) -> int:
        return 0 if self.status == "gone" else self.figures.peak

    @property
    def after_end(self) -> int:
        return 0 if self.status == "gone" else self.figures.end

    def delta(self, moment: str = "peak") -> int:
        """What the site's bytes at the ``"peak"`` (or ``"end"``) changed by."""
        if moment == "end":
            return self.after_end - (self.before_end or 0)
        return self.after_peak - (self.before_peak or 0)


@dataclass(frozen=True)
class SiteDiff(Coded):
    """The sites of one span that changed against its baseline's profile; ``compared``: how many either side lists."""

    span: str
    changes: tuple[SiteChange, ...]
    compared: int
    second_run: bool = False
    note: str = ""

    def at(self, moment: str = "peak") -> list[SiteChange]:
        """The changes at the ``"peak"`` (or ``"end"``): the grown, largest first, then the shrunk, largest first."""
        moved = [c for c in self.changes if c.delta(moment)]
        return sorted(moved, key=lambda c: (c.delta(moment) < 0, -abs(c.delta(moment)), c.figures.site.key))


def diff_sites(span: str, baseline: SiteProfile, current: SiteProfile) -> SiteDiff:
    """The rows of ``current`` changed against ``baseline``, paired so that code moved around a site gives no row."""
    if not baseline.by_category and current.by_category:
        current = merge_categories(current)
    before = [s for s in baseline.sites if s.site.key != BEFORE]  # the start: not what the span made
    after = [s for s in current.sites if s.site.key != BEFORE]
    pairs = _pair_by_code(before, after)
    shifts = _shifts(pairs)
    # a line whose text changed: by its place, once the shift of the function's other lines is undone
    pairs += _pair(before, after, lambda row: _place(row, shifts), lambda row: _place(row, {}))
    pairs += _pair(before, after, _moved_function)
    changes: list[SiteChange] = []
    for old, new in sorted(pairs, key=lambda pair: pair[1].key):
        if old.peak != new.peak or old.end != new.end:
            changes.append(SiteChange(new, old.peak, old.end))
    compared = len(pairs) + len(after) + len(before)
    hidden = [
        new for new in after if baseline.rest_sites and new.peak <= baseline.rest_peak and new.end <= baseline.rest_end
    ]
    if (
        hidden
        and sum(new.peak for new in hidden) + current.rest_peak == baseline.rest_peak
        and sum(new.end for new in hidden) + current.rest_end == baseline.rest_end
    ):  # the baseline's others, as they were: nothing changed among them
        after = [new for new in after if all(new is not row for row in hidden)]
        hidden = []
    for new in after:
        unlisted = any(new is row for row in hidden)
        changes.append(SiteChange(new, None, None, "unlisted" if unlisted else "new"))
    still = {(row.site.file, row.site.function, row.site.code): row.site for row in current.sites if row.site.code}
    for old in before:
        site = still.get((old.site.file, old.site.function, old.site.code)) if old.site.code else None
        if site is not None:  # the line is there, holding none of this category now: a change to nothing
            changes.append(SiteChange(replace(old, site=site, peak=0, end=0, count=0), old.peak, old.end))
            continue
        if current.rest_sites and old.peak <= current.rest_peak and old.end <= current.rest_end:
            continue  # this run lists only its largest sites: it may be among the others, unchanged
        changes.append(SiteChange(old, old.peak, old.end, "gone"))
    return SiteDiff(span, tuple(changes), compared, current.second_run, current.note)


def merge_categories(profile: SiteProfile) -> SiteProfile:
    """``profile`` with one row a site (categories summed), as profiles were stored before the split by category."""
    merged: dict[str, list[SiteFigures]] = {}
    for row in profile.sites:
        merged.setdefault(row.site.key, []).append(row)
    rows = []
    for group in merged.values():
        main = max(group, key=lambda row: (row.peak, row.end))
        peak, end = sum(row.peak for row in group), sum(row.end for row in group)
        count = sum(row.count for row in group)
        rows.append(replace(main, peak=peak, end=end, count=count))
    rows.sort(key=lambda row: (-row.peak, -row.end, row.key))
    return replace(profile, sites=tuple(rows), by_category=False)


def _pair_by_code(before: list[SiteFigures], after: list[SiteFigures]) -> list[tuple[SiteFigures, SiteFigures]]:
    """Rows paired by file, function, category and code (repeated lines by nearest offset); removed from both lists."""

    def text(row: SiteFigures) -> Hashable:
        site = row.site
        return (site.file, site.function, site.code, row.category) if site.code else None

    groups: dict[Hashable, tuple[list[SiteFigures], list[SiteFigures]]] = {}
    for side, rows in enumerate((before, after)):
        for row in rows:
            key = text(row)
            if key is not None:
                groups.setdefault(key, ([], []))[side].append(row)
    found = [(olds[0], news[0]) for olds, news in groups.values() if len(olds) == 1 and len(news) == 1]
    shifts = _shifts(found)
    for olds, news in groups.values():
        if not olds or not news or (len(olds) == 1 and len(news) == 1):
            continue
        shift = shifts.get((news[0].site.file, news[0].site.function), 0)
        found += _align(sorted(olds, key=_offset), sorted(news, key=_offset), shift)
    _remove_paired(before, after, found)
    return found


def _shifts(pairs: list[tuple[SiteFigures, SiteFigures]]) -> dict[tuple[str, str], int]:
    """By (file, function): the median distance the paired rows' lines moved (lines inserted above them)."""
    moved: dict[tuple[str, str], list[int]] = {}
    for old, new in pairs:
        if (old.site.file, old.site.function) == (new.site.file, new.site.function):
            moved.setdefault((new.site.file, new.site.function), []).append(new.site.offset - old.site.offset)
    return {function: sorted(found)[len(found) // 2] for function, found in moved.items()}


def _place(row: SiteFigures, shifts: Mapping[tuple[str, str], int]) -> Hashable:
    site = row.site
    return (site.file, site.function, site.offset - shifts.get((site.file, site.function), 0), row.category)


def _moved_function(row: SiteFigures) -> Hashable:
    return (row.site.function, row.site.code, row.category) if row.site.code else None


def _offset(row: SiteFigures) -> int:
    return row.site.offset


def _align(olds: list[SiteFigures], news: list[SiteFigures], shift: int) -> list[tuple[SiteFigures, SiteFigures]]:
    """The most in-order pairs of ``olds`` and ``news`` (sorted by offset), nearest after ``shift``."""
    n, m = len(olds), len(news)
    # best[i][j]: (pairs, -distance) of olds[i:] with news[j:]
    best = [[(0, 0)] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            take = best[i + 1][j + 1]
            distance = abs(news[j].site.offset - olds[i].site.offset - shift)
            candidates = [(take[0] + 1, take[1] - distance), best[i + 1][j], best[i][j + 1]]
            best[i][j] = max(candidates)
    pairs = []
    i = j = 0
    while i < n and j < m:
        take = best[i + 1][j + 1]
        distance = abs(news[j].site.offset - olds[i].site.offset - shift)
        if best[i][j] == (take[0] + 1, take[1] - distance):
            pairs.append((olds[i], news[j]))
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return pairs


def _pair(
    before: list[SiteFigures],
    after: list[SiteFigures],
    match: Callable[[SiteFigures], Hashable],
    old_match: Callable[[SiteFigures], Hashable] | None = None,
) -> list[tuple[SiteFigures, SiteFigures]]:
    """Pairs that ``match`` (``old_match`` for ``before``) gives the same unique key; removed from both."""
    olds = _unique(before, old_match or match)
    news = _unique(after, match)
    found = [(olds[key], news[key]) for key in olds.keys() & news.keys()]
    _remove_paired(before, after, found)
    return found


def _remove_paired(
    before: list[SiteFigures], after: list[SiteFigures], pairs: list[tuple[SiteFigures, SiteFigures]]
) -> None:
    paired = {id(row) for pair in pairs for row in pair}
    before[:] = [row for row in before if id(row) not in paired]
    after[:] = [row for row in after if id(row) not in paired]


def _unique(figures: list[SiteFigures], match: Callable[[SiteFigures], Hashable]) -> dict[Hashable, SiteFigures]:
    seen: dict[Hashable, SiteFigures | None] = {}
    for item in figures:
        key = match(item)
        if key is None:
            continue
        seen[key] = None if key in seen else item
    return {key: item for key, item in seen.items() if item is not None}
