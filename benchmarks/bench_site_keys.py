"""How stable a site's name is under real edits: absolute line numbers against the line's offset
from its function's first line (what the baseline file stores), over a file's git history.

For each commit that changed a file, every line the commit left untouched (difflib's equal
blocks) inside a function is a site that did not change: a name that changes for it is noise
in a stored profile's diff. Counted per naming scheme:

- ``line``: ``file:line`` (tracemalloc's, Megatron-Bridge's ``function@file:line``);
- ``offset``: ``file:function+offset``, the offset from the function's first line (its first
  decorator, as Python's ``co_firstlineno``);
- ``offset, then code``: ``offset``, and a site whose offset moved found again by its function and
  source line, as ``judge/site_changes.py`` matches them (a line that is not unique in its function is
  not found that way).

    python benchmarks/bench_site_keys.py REPO FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import subprocess
from collections import Counter
from pathlib import Path

from tabulate import tabulate

from pytest_gpumem.measurement.engines.traces import functions_in


def enclosing(found: tuple[tuple[int, int, str], ...], line: int) -> tuple[int, str] | None:
    inner = [f for f in found if f[0] <= line <= f[1]]
    if not inner:
        return None
    first, _, name = max(inner, key=lambda f: f[0])
    return first, name


def versions(repo: Path, path: str) -> list[tuple[str, str]]:
    commits = subprocess.run(
        ["git", "-C", str(repo), "log", "--reverse", "--format=%h", "--", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    texts = []
    for commit in commits:
        shown = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            texts.append((commit, shown.stdout))
    return texts


def measure(repo: Path, path: str) -> tuple[Counter[str], int, int]:
    """Lines whose name changed per scheme, lines compared, commits compared (and commits with noise)."""
    changed: Counter[str] = Counter()
    noisy: Counter[str] = Counter()
    lines = commits = 0
    history = versions(repo, path)
    for (_, old), (_, new) in itertools.pairwise(history):
        old_lines, new_lines = old.splitlines(), new.splitlines()
        old_funcs, new_funcs = functions_in(old), functions_in(new)
        if not old_funcs or not new_funcs:
            continue
        commits += 1
        hit: set[str] = set()
        matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag != "equal":
                continue
            for a, b in zip(range(i1, i2), range(j1, j2), strict=True):
                text = old_lines[a].strip()
                if not text or text.startswith(("#", "@", "def ", "async def ", "class ")):
                    continue
                was, now = enclosing(old_funcs, a + 1), enclosing(new_funcs, b + 1)
                if was is None or now is None:
                    continue
                lines += 1
                if a != b:
                    changed["line"] += 1
                    hit.add("line")
                if was[1] != now[1] or a + 1 - was[0] != b + 1 - now[0]:
                    changed["offset"] += 1
                    hit.add("offset")
                    body = [line.strip() for line in new_lines[now[0] - 1 : now[0] - 1 + 400]]
                    unique = body.count(text) == 1 and was[1] == now[1]
                    if not unique:
                        changed["offset, then code"] += 1
                        hit.add("offset, then code")
        noisy.update(hit)
    changed.update({f"commits: {k}": v for k, v in noisy.items()})
    return changed, lines, commits


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("repo", type=Path)
    parser.add_argument("files", nargs="+")
    options = parser.parse_args()
    rows = []
    for path in options.files:
        changed, lines, commits = measure(options.repo, path)
        for scheme in ("line", "offset", "offset, then code"):
            rows.append(
                [
                    path,
                    scheme,
                    commits,
                    lines,
                    changed[scheme],
                    f"{100 * changed[scheme] / max(lines, 1):.1f}%",
                    changed[f"commits: {scheme}"],
                ]
            )
    headers = ["file", "site named by", "commits", "untouched lines", "renamed", "renamed %", "commits with noise"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
