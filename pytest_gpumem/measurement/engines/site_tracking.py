"""Where storages are made: the user's frames (:class:`SiteFilter`), the bytes by line (:class:`SiteRecorder`)."""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from types import CodeType, FrameType
from typing import Any

from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.data.site_figures import BEFORE, CODE_CHARS, ELSEWHERE, EXAMPLE_CHARS, Site, SiteConfig, SiteCounts

__all__ = ["Found", "SiteFilter", "SiteRecorder", "SiteSnapshot"]

#: What the engines hand the recorder: (site, phase, bytes at the peak, bytes at the end, examples).
Found = tuple[Site, str, SiteCounts | None, SiteCounts | None, tuple[str, ...]]

#: Packages whose frames are never a site unless named: PyTorch, the plugin, pytest, pluggy.
_NEVER = ("torch", "pytest_gpumem", "_pytest", "pytest", "pluggy", "functorch", "typing_extensions")


def _package_dirs(name: str) -> list[str]:
    """The folders of the package ``name`` without importing it (a dotted name imports its parents); empty if absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [os.path.normcase(os.path.abspath(p)) + os.sep for p in spec.submodule_search_locations]
    if spec.origin:
        return [os.path.normcase(os.path.abspath(spec.origin))]
    return []


class SiteFilter:
    """Decides which frames are the user's code (rootdir, ``include``'d packages), and names their files."""

    def __init__(self, config: SiteConfig) -> None:
        self.root = os.path.normcase(os.path.abspath(config.root)) + os.sep
        self.included: list[tuple[str, str]] = []  # (a package's folder, the folder its names start from)
        for name in config.include:
            dirs = _package_dirs(name)
            if not dirs:
                raise ValueError(f"sites include {name!r}: no package or module of that name is installed")
            depth = name.count(".") + 1
            for folder in dirs:
                base = folder.rstrip(os.sep)
                for _ in range(depth):
                    base = os.path.dirname(base)
                self.included.append((folder, base + os.sep))
        paths = sysconfig.get_paths()
        libraries = [
            os.path.normcase(os.path.abspath(p)) + os.sep for p in {paths.get("stdlib"), paths.get("platstdlib")} if p
        ]
        #: the folders of never-site packages and of the standard library
        self.never = tuple(
            folder
            for name in _NEVER
            if not any(name == inc or name.startswith(inc + ".") for inc in config.include)
            for folder in _package_dirs(name)
        ) + tuple(libraries)
        self._codes: dict[CodeType, tuple[str, str] | None] = {}
        self._files: dict[str, str | None] = {}

    def file(self, filename: str) -> str | None:
        """The name ``filename`` goes by in a site (``/``-separated), or None when it is not the user's code."""
        if filename not in self._files:
            self._files[filename] = self._name(filename)
        return self._files[filename]

    def _name(self, filename: str) -> str | None:
        if filename.startswith("<"):
            return None
        path = os.path.normcase(os.path.abspath(filename))
        for folder, base in self.included:
            if path.startswith(folder):
                return path[len(base) :].replace(os.sep, "/")
        if not path.startswith(self.root) or path.startswith(self.never):
            return None
        relative = path[len(self.root) :]
        parts = relative.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            return None
        return relative.replace(os.sep, "/")

    def code(self, code: CodeType) -> tuple[str, str] | None:
        """(file, qualified function name) of ``code`` when it is the user's; None otherwise (cached)."""
        known = self._codes.get(code, False)
        if known is not False:
            return known  # type: ignore[return-value]
        file = self.file(code.co_filename)
        found = None if file is None else (file, getattr(code, "co_qualname", code.co_name))
        self._codes[code] = found
        return found


def source_line(filename: str, line: int) -> str:
    """The stripped source line, shortened to :data:`CODE_CHARS` characters ("" when unknown)."""
    linecache.checkcache(filename)  # the file as it is now, not as an earlier read cached it
    text = " ".join(linecache.getline(filename, line).split())
    return text if len(text) <= CODE_CHARS else text[: CODE_CHARS - 1] + "…"


def example(tensor: Any) -> str:
    """``"(8, 256, 1024) float32"``: a tensor's shape and dtype, shortened to :data:`EXAMPLE_CHARS`."""
    text = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 1] + "…"


class _State:
    """One (line, phase) that made storages while sites were recorded: its counts now."""

    __slots__ = ("code", "counts", "examples", "filename", "line", "owner", "phase", "where")

    def __init__(
        self, owner: SiteRecorder, code: CodeType | None, line: int, phase: str, where: tuple[str, str] | None
    ) -> None:
        self.owner = owner
        self.code = code
        self.line = line
        self.phase = phase
        self.counts = SiteCounts(tensors=[0] * len(CATEGORIES))
        #: the two largest storages' (bytes, shape and dtype as text, (shape, dtype))
        self.examples: list[tuple[int, str, Any]] = []
        self.where = where  # (file, function) in the user's code
        self.filename = "" if code is None else code.co_filename

    def site(self) -> Site:
        if self.code is None or self.where is None:
            return Site("", ELSEWHERE)
        file, function = self.where
        return Site(
            file, function, self.line - self.code.co_firstlineno, self.line, source_line(self.filename, self.line)
        )


#: Counts by site at one moment: a (line, phase) state or :data:`BEFORE` → its counts (copies).
SiteSnapshot = dict[Any, SiteCounts]


class SiteRecorder:
    """The sites of the storages a tracker sees made, and their counts now (see the module)."""

    def __init__(self, config: SiteConfig) -> None:
        self.filter = SiteFilter(config)
        #: the phase running now ("" outside phases), set by the recorder
        self.phase = ""
        self._states: dict[tuple[CodeType | None, int, str], _State] = {}

    def here(self, frame: FrameType | None) -> _State:
        """The state of the innermost user frame from ``frame`` outwards, in the current phase."""
        code_of = self.filter.code
        where = None
        while frame is not None and (where := code_of(frame.f_code)) is None:
            frame = frame.f_back
        code, line = (None, 0) if frame is None else (frame.f_code, frame.f_lineno)
        key = (code, line, self.phase)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _State(self, code, line, self.phase, where)
        return state

    def made(self, entry: Any, tensor: Any) -> None:
        """``entry`` (a storage just counted) was made for ``tensor`` here."""
        state = self.here(sys._getframe(2))
        entry.site = state
        counts = state.counts
        counts.nbytes[entry.category] += entry.nbytes
        counts.count += 1
        if counts.tensors is not None:
            counts.tensors[entry.category] += 1
        examples = state.examples
        if len(examples) < 2 or entry.nbytes > examples[-1][0]:  # the two largest, each shape once
            kind = (tensor.shape, tensor.dtype)  # an example's already: no text to make (a line run again)
            if all(kind != seen for _, _, seen in examples):
                text = example(tensor)
                if all(text != known for _, known, _ in examples):
                    examples.append((entry.nbytes, text, kind))
                    examples.sort(key=lambda item: -item[0])
                    del examples[2:]

    def freed(self, entry: Any) -> None:
        state = getattr(entry, "site", None)
        if state is not None and state.owner is self:
            state.counts.nbytes[entry.category] -= entry.nbytes
            state.counts.count -= 1
            if state.counts.tensors is not None:
                state.counts.tensors[entry.category] -= 1

    def moved(self, entry: Any, old: int, new: int, window: SiteSnapshot | None) -> None:
        """``entry`` changes category from ``old`` to ``new``, in the window's peak snapshot ``window`` too."""
        state: _State | None = getattr(entry, "site", None)
        mine = state is not None and state.owner is self
        if state is not None and mine:
            _move(state.counts, entry.nbytes, old, new)
        if window is not None:
            counts = window.get(state if mine else BEFORE)
            if counts is not None:
                _move(counts, entry.nbytes, old, new)

    def resized(self, entry: Any, delta: int) -> None:
        state = getattr(entry, "site", None)
        if state is not None and state.owner is self:
            state.counts.nbytes[entry.category] += delta

    def snapshot(self, by_category: Sequence[int], storages: int) -> SiteSnapshot:
        """The counts now, by state; what no state holds (made before sites were recorded) under :data:`BEFORE`."""
        found: SiteSnapshot = {}
        before = list(by_category)
        left = storages
        for state in self._states.values():
            counts = state.counts
            if counts.count or any(counts.nbytes):
                found[state] = SiteCounts(list(counts.nbytes), counts.count, list(counts.tensors or ()) or None)
                for i, nbytes in enumerate(counts.nbytes):
                    before[i] -= nbytes
                left -= counts.count
        if any(before):
            found[BEFORE] = SiteCounts(before, max(left, 0))
        return found


def _move(counts: SiteCounts, nbytes: int, old: int, new: int) -> None:
    """One storage of ``nbytes`` counted under category ``old`` is of ``new``."""
    counts.nbytes[old] -= nbytes
    counts.nbytes[new] += nbytes
    if counts.tensors is not None:
        counts.tensors[old] -= 1
        counts.tensors[new] += 1


def found_sites(peak: Mapping[Any, SiteCounts] | None, end: Mapping[Any, SiteCounts] | None) -> list[Found]:
    """(site, phase, at the peak, at the end, examples) of every state in either snapshot."""
    peak, end = peak or {}, end or {}
    result: list[Found] = []
    for state in dict.fromkeys([*peak, *end]):
        if state == BEFORE:
            result.append((Site("", BEFORE), "", peak.get(state), end.get(state), ()))
        else:
            examples = tuple(text for _, text, _ in state.examples)
            result.append((state.site(), state.phase, peak.get(state), end.get(state), examples))
    return result
