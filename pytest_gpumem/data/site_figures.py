"""Where the bytes of a span were made: :class:`Site`, :class:`SiteFigures` and :class:`SiteProfile` (no torch).

A site is the innermost user-code frame of an allocating stack, named by the line's offset from its ``def`` so stored
profiles survive unrelated edits."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.data.metrics import CATEGORIES, PHASES

__all__ = [
    "BEFORE",
    "CARRIED_SITES",
    "ELSEWHERE",
    "OTHER_SITES",
    "SITES_BUDGET",
    "SITES_MODES",
    "Site",
    "SiteConfig",
    "SiteCounts",
    "SiteFigures",
    "SiteProfile",
    "build_profile",
    "parse_sites_mode",
    "parse_stored_site",
    "split_row_key",
]

#: The key of the bytes alive before sites were recorded (a fixture, an earlier test, import).
BEFORE = "(before)"
#: The key of bytes made where no frame of the stack was the user's code.
ELSEWHERE = "(elsewhere)"
#: The stored key of the sites a stored profile leaves out (its ``n`` counts sites, not storages).
OTHER_SITES = "(other sites)"
#: Most characters of a site's source line kept.
CODE_CHARS = 48
#: Most characters of one example shape kept.
EXAMPLE_CHARS = 40
#: Most sites a measurement carries (the rest are summed in :attr:`SiteProfile.rest_peak`...).
CARRIED_SITES = 64
#: Most bytes of text a test's stored profiles take in the baseline file, all spans together.
SITES_BUDGET = 3072

#: When sites are recorded: "rerun" (on a baseline update and a memory failure's second run; the default), "always",
#: "off".
SITES_MODES = ("rerun", "always", "off")

_PSEUDO = {BEFORE: "alive before sites were recorded", ELSEWHERE: "made outside the user's code"}


@dataclass(frozen=True)
class SiteConfig:
    """How sites are chosen: frames under ``root`` (pytest's rootdir) or in the packages named in ``include``."""

    root: str
    include: tuple[str, ...] = ()


@dataclass(frozen=True)
class Site:
    """A place in the code: ``file``, ``function``, ``offset`` from the function's first line, the absolute ``line`` (0
    when unknown) and its ``code``; a pseudo-site (:data:`BEFORE`, :data:`ELSEWHERE`) has only a ``function``."""

    file: str
    function: str
    offset: int = 0
    line: int = 0
    code: str = ""

    @property
    def key(self) -> str:
        """``file:function+offset``, what a site is matched by across runs; a pseudo-site's own key."""
        return f"{self.file}:{self.function}+{self.offset}" if self.file else self.function

    @property
    def pseudo(self) -> bool:
        return not self.file

    def where(self) -> str:
        """``tinygpt.py:58 Block.forward`` (``tinygpt.py:Block.forward+3`` without a line); a pseudo-site's meaning."""
        if self.pseudo:
            return _PSEUDO.get(self.function, self.function)
        if self.line:
            return f"{self.file}:{self.line} {self.function}"
        return self.key

    @classmethod
    def from_key(cls, key: str, code: str = "") -> Site:
        """The site a stored ``key`` names (``file:function+offset``, or a pseudo-site's key)."""
        match = _KEY_RE.match(key)
        if match is None:
            return cls("", key)
        return cls(match["file"], match["function"], int(match["offset"]), 0, code)


_KEY_RE = re.compile(r"^(?P<file>[^:]+):(?P<function>.+)\+(?P<offset>\d+)$")
_ROW_RE = re.compile(r"^(?P<site>.*) (?P<category>[a-z_]+)$")


def split_row_key(key: str) -> tuple[str, str | None]:
    """A stored row's key as (site key, category): ``"t.py:f+3 gradients"``; an older one-row-a-site key has None."""
    match = _ROW_RE.match(key)
    if match is None or match["category"] not in CATEGORIES:
        return key, None
    site = match["site"]
    return (site, match["category"]) if _KEY_RE.match(site) or site in _PSEUDO else (key, None)


def _flat_site(site: Site) -> dict[str, Any]:
    return dict(
        key=site.key, file=site.file, function=site.function, line=site.line, offset=site.offset, code=site.code
    )


@dataclass(frozen=True)
class SiteFigures(Coded):
    """One site's bytes of one category in a span: alive at the peak and at the end, the storages, the phase that made
    most of them, and one or two example shapes."""

    site: Site = field(metadata=coded(flat=True, write=_flat_site, read=lambda data: from_data(Site, data)))
    peak: int
    end: int
    count: int
    category: str = "other"
    phase: str = ""
    examples: tuple[str, ...] = ()
    #: what holds the row's storages alive at the end, (name, bytes), largest first: a failing test's second run only;
    #: never stored
    holders: tuple[tuple[str, int], ...] = ()

    @property
    def key(self) -> str:
        """The row's key: its site's and its category, ``tinygpt.py:Block.forward+3 activations``."""
        return f"{self.site.key} {self.category}"

    def stored(self) -> str:
        """The figures as the baseline file keeps them: ``peak=N end=N n=N category phase examples | code``."""
        text = f"peak={self.peak} end={self.end} n={self.count} {self.category} {self.phase or '-'}"
        if self.examples:
            text += " " + "; ".join(self.examples)
        if self.site.code:
            text += " | " + self.site.code
        return text


_STORED_RE = re.compile(
    r"^peak=(?P<peak>\d+) end=(?P<end>\d+) n=(?P<count>\d+)"
    r"(?: (?P<category>[a-z_]+) (?P<phase>[a-z_-]+))?"
    r"(?: (?P<examples>[^|]*?))?(?: \| (?P<code>.*))?$"
)


def parse_stored_site(key: str, value: object) -> SiteFigures:
    """One stored site's row (``key``: ``value``) read back; ``ValueError`` saying what is wrong otherwise."""
    where = f"site {key!r}"
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string such as 'peak=1024 end=0 n=1 activations forward'")
    match = _STORED_RE.match(value)
    if match is None:
        raise ValueError(f"{where}: {value[:60]!r} is not 'peak=<bytes> end=<bytes> n=<count> <category> <phase> ...'")
    category = match["category"] or "other"
    phase = "" if match["phase"] in (None, "-") else match["phase"]
    if key != OTHER_SITES and category not in CATEGORIES:
        raise ValueError(f"{where}: unknown category {category!r} (one of {', '.join(CATEGORIES)})")
    site_key, row_category = split_row_key(key)
    if row_category is not None and row_category != category:
        raise ValueError(f"{where}: the key's category {row_category!r} is not the figures' {category!r}")
    if phase and phase not in PHASES:
        raise ValueError(f"{where}: unknown phase {phase!r} (one of {', '.join(PHASES)}, or -)")
    examples = tuple(e.strip() for e in (match["examples"] or "").split(";") if e.strip())
    site = Site.from_key(site_key, match["code"] or "")
    peak, end, count = int(match["peak"]), int(match["end"]), int(match["count"])
    return SiteFigures(site, peak, end, count, category, phase, examples)


@dataclass(frozen=True)
class SiteProfile(Coded):
    """The sites of one span, one row per site and category, the largest first; with the ``rest_*`` sums of the sites
    left out, they add up to the span's peak, end and breakdown."""

    sites: tuple[SiteFigures, ...] = ()
    rest_peak: int = field(default=0, metadata=coded(key="rest.peak"))
    rest_end: int = field(default=0, metadata=coded(key="rest.end"))
    rest_sites: int = field(default=0, metadata=coded(key="rest.sites"))
    second_run: bool = False
    note: str = ""
    by_category: bool = field(default=True, metadata=coded(missing=False))  # False: stored before rows split

    def top(self, count: int) -> SiteProfile:
        """The profile with its ``count`` largest sites listed, the others summed in the rest."""
        kept, left = self.sites[:count], self.sites[count:]
        return replace(
            self,
            sites=kept,
            rest_peak=self.rest_peak + sum(s.peak for s in left),
            rest_end=self.rest_end + sum(s.end for s in left),
            rest_sites=self.rest_sites + len(left),
        )

    def to_stored(self, budget: int = SITES_BUDGET) -> dict[str, str]:
        """The profile as the baseline file keeps it: row key → :meth:`SiteFigures.stored`, the largest rows first up to
        ``budget`` characters, the rest under :data:`OTHER_SITES`."""
        stored: dict[str, str] = {}
        used = 0
        left = [s for s in self.sites if s.site.key != BEFORE]  # the span's start, not a site of it
        coded: set[str] = set()  # sites whose code a larger row of theirs already gives
        while left:
            row = left[0]
            text = row.stored() if row.site.key not in coded else replace(row, site=replace(row.site, code="")).stored()
            coded.add(row.site.key)
            used += len(row.key) + len(text) + 24  # quotes, colon, indent, comma, newline
            if used > budget and stored:
                break
            stored[left.pop(0).key] = text
        rest = replace(self, sites=tuple(left)).top(0)
        if rest.rest_sites:
            stored[OTHER_SITES] = f"peak={rest.rest_peak} end={rest.rest_end} n={rest.rest_sites}"
        return stored

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> SiteProfile:
        """A profile read from the baseline file (``ValueError`` naming the site for a bad one)."""
        sites = []
        rest = (0, 0, 0)
        split = True
        for key, value in stored.items():
            figures = parse_stored_site(str(key), value)
            if key == OTHER_SITES:
                rest = (figures.peak, figures.end, figures.count)
            else:
                sites.append(figures)
                split = split and split_row_key(str(key))[1] is not None
        code = {s.site.key: s.site.code for s in sites if s.site.code}  # a site's other rows give it once
        sites = [s if s.site.code else replace(s, site=replace(s.site, code=code.get(s.site.key, ""))) for s in sites]
        return cls(tuple(sorted(sites, key=_order)), *rest, by_category=split)


def parse_sites_mode(value: object) -> str:
    """One of :data:`SITES_MODES` (``True`` is "always", ``False`` "off"); ``ValueError`` naming the value otherwise."""
    if isinstance(value, bool):
        return "always" if value else "off"
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in SITES_MODES:
        raise ValueError(f"sites={value!r} is not one of {', '.join(map(repr, SITES_MODES))} (or True/False)")
    return text


def _order(figures: SiteFigures) -> tuple[int, int, str]:
    return (-figures.peak, -figures.end, figures.key)


def build_profile(
    found: Iterable[tuple[Site, str, SiteCounts | None, SiteCounts | None, tuple[str, ...]]] | None,
) -> SiteProfile | None:
    """A profile of what the engines found, a row per site and category, its :data:`CARRIED_SITES` largest listed."""
    if found is None:
        return None
    rows: dict[tuple[str, int], _Row] = {}
    for site, phase, peak, end, examples in found:
        peak, end = peak or SiteCounts(), end or SiteCounts()
        counts = zip(peak.nbytes, end.nbytes, peak.by_category_counts(), end.by_category_counts(), strict=True)
        for index, (at_peak, at_end, peak_count, end_count) in enumerate(counts):
            if not (at_peak or at_end):
                continue
            row = rows.setdefault((site.key, index), _Row(site))
            row.peak += at_peak
            row.end += at_end
            row.peak_count += peak_count
            row.end_count += end_count
            row.phases[phase] = row.phases.get(phase, 0) + max(at_peak, at_end)
            row.examples = tuple(dict.fromkeys(row.examples + examples))[:2]
    figures = []
    for (_, index), row in rows.items():
        phase = max(row.phases, key=lambda name: (row.phases[name], name))
        count = row.peak_count if row.peak else row.end_count
        figures.append(SiteFigures(row.site, row.peak, row.end, count, CATEGORIES[index], phase, row.examples))
    return SiteProfile(tuple(sorted(figures, key=_order))).top(CARRIED_SITES)


class _Row:
    """One site's bytes of one category while :func:`build_profile` sums them."""

    __slots__ = ("end", "end_count", "examples", "peak", "peak_count", "phases", "site")

    def __init__(self, site: Site) -> None:
        self.site = site
        self.peak = self.end = self.peak_count = self.end_count = 0
        self.phases: dict[str, int] = {}
        self.examples: tuple[str, ...] = ()


@dataclass
class SiteCounts:
    """A site's bytes and storages by category (:data:`CATEGORIES` order), at one moment (engines fill it)."""

    nbytes: list[int] = field(default_factory=lambda: [0] * len(CATEGORIES))
    count: int = 0
    #: storages by category (None: not known by category, all counted under the largest)
    tensors: list[int] | None = None

    @property
    def total(self) -> int:
        return sum(self.nbytes)

    def by_category_counts(self) -> list[int]:
        """Storages by category: :attr:`tensors`, or :attr:`count` all under the largest category."""
        if self.tensors is not None:
            return list(self.tensors)
        found = [0] * len(CATEGORIES)
        found[CATEGORIES.index(self.category)] = self.count
        return found

    @property
    def category(self) -> str:
        return CATEGORIES[max(range(len(CATEGORIES)), key=lambda i: (self.nbytes[i], -i))]
