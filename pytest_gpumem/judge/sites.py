"""The sites that changed: a span's site profile against the one stored with its baseline.

Modelled on ``tracemalloc.Snapshot.compare_to``: each site of either side is matched with
the other side's, and what changed is listed by growth (the grown first, largest first, then
the shrunk), a site only in this run "new since the baseline", one only in the baseline
"gone". Sites are matched by key (``file:function+offset``); a site whose key found no
partner is matched by its file, function and source line (a line that moved inside its
function), then by its function and source line (a function that moved to another file), so
that code moved without changing memory does not show as a pair of "new" and "gone".

Pure: no I/O, no torch. Sizes are bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pytest_gpumem.data.sites import BEFORE, Site, SiteFigures, SiteProfile

__all__ = ["SiteChange", "SiteDiff", "diff_sites"]

Status = Literal["changed", "new", "gone", "unlisted"]


@dataclass(frozen=True)
class SiteChange:
    """One site whose bytes changed: ``figures`` (this run's; the baseline's for a site that is
    gone), the baseline's bytes at the peak and at the end (None for a site the baseline does not
    list), and ``status``: ``"changed"``, ``"new"`` (since the baseline), ``"gone"``, or
    ``"unlisted"`` (the baseline lists only its largest sites: this one may be among the others)."""

    figures: SiteFigures
    before_peak: int | None
    before_end: int | None
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.figures.to_dict(),
            "status": self.status,
            "before": {"peak": self.before_peak, "end": self.before_end},
            "after": {"peak": self.after_peak, "end": self.after_end},
            "delta": {"peak": self.delta("peak"), "end": self.delta("end")},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SiteChange:
        before = data.get("before") or {}
        return cls(SiteFigures.from_dict(data["site"]), before.get("peak"), before.get("end"), data["status"])


@dataclass(frozen=True)
class SiteDiff:
    """The sites of one span that changed against its baseline's profile; ``compared``: how many
    sites either side lists; ``second_run`` and ``note`` as the span's profile has them."""

    span: str
    changes: tuple[SiteChange, ...]
    compared: int
    second_run: bool = False
    note: str = ""

    def at(self, moment: str = "peak") -> list[SiteChange]:
        """The changes of bytes at the ``"peak"`` (or ``"end"``): the grown first, largest first, then
        the shrunk, largest shrink first (ties by site)."""
        grown = [c for c in self.changes if c.delta(moment) > 0]
        shrunk = [c for c in self.changes if c.delta(moment) < 0]
        grown.sort(key=lambda c: (-c.delta(moment), c.figures.site.key))
        shrunk.sort(key=lambda c: (c.delta(moment), c.figures.site.key))
        return grown + shrunk

    def to_dict(self) -> dict[str, Any]:
        return {
            "span": self.span,
            "changes": [c.to_dict() for c in self.changes],
            "compared": self.compared,
            "second_run": self.second_run,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SiteDiff:
        return cls(
            str(data["span"]),
            tuple(SiteChange.from_dict(c) for c in data.get("changes") or ()),
            int(data.get("compared", 0)),
            bool(data.get("second_run", False)),
            str(data.get("note", "")),
        )


def diff_sites(span: str, baseline: SiteProfile, current: SiteProfile) -> SiteDiff:
    """The sites of ``current`` (this run) that changed against ``baseline`` (the stored profile)."""
    before = [s for s in baseline.sites if s.site.key != BEFORE]  # the start: not what the span made
    after = [s for s in current.sites if s.site.key != BEFORE]
    pairs: list[tuple[SiteFigures, SiteFigures]] = []
    matchers: list[Callable[[Site], Hashable]] = [
        lambda site: site.key,
        lambda site: (site.file, site.function, site.code) if site.code else None,
        lambda site: (site.function, site.code) if site.code else None,
    ]
    for match in matchers:
        pairs += _pair(before, after, match)
    changes: list[SiteChange] = []
    for old, new in pairs:
        if old.peak != new.peak or old.end != new.end:
            changes.append(SiteChange(new, old.peak, old.end))
    for new in after:
        hidden = baseline.rest_sites and new.peak <= baseline.rest_peak and new.end <= baseline.rest_end
        changes.append(SiteChange(new, None, None, "unlisted" if hidden else "new"))
    for old in before:
        hidden = current.rest_sites and old.peak <= current.rest_peak and old.end <= current.rest_end
        if hidden:  # this run lists only its largest sites: it may be among the others, unchanged
            continue
        changes.append(SiteChange(old, old.peak, old.end, "gone"))
    compared = len(pairs) + len(after) + len(before)
    return SiteDiff(span, tuple(changes), compared, current.second_run, current.note)


def _pair(
    before: list[SiteFigures], after: list[SiteFigures], match: Callable[[Site], Hashable]
) -> list[tuple[SiteFigures, SiteFigures]]:
    """Pairs of ``before`` and ``after`` that ``match`` gives the same, unique, key; removes them from both."""
    olds = _unique(before, match)
    news = _unique(after, match)
    found = [(olds[key], news[key]) for key in olds.keys() & news.keys()]
    paired_old = {id(old) for old, _ in found}
    paired_new = {id(new) for _, new in found}
    before[:] = [f for f in before if id(f) not in paired_old]
    after[:] = [f for f in after if id(f) not in paired_new]
    return sorted(found, key=lambda pair: pair[1].site.key)


def _unique(figures: list[SiteFigures], match: Callable[[Site], Hashable]) -> dict[Hashable, SiteFigures]:
    seen: dict[Hashable, SiteFigures | None] = {}
    for item in figures:
        key = match(item.site)
        if key is None:
            continue
        seen[key] = None if key in seen else item
    return {key: item for key, item in seen.items() if item is not None}
