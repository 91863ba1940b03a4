"""Where a measured pytest session spends its time: one session under cProfile, the functions by
own and cumulative time.

    python benchmarks/profile_session.py DIR [--out FILE] [--top 40] [-- PYTEST_ARGS ...]

Arguments after ``--`` go to pytest.

``DIR`` is a suite, such as the one ``bench_overhead.py --keep DIR`` writes. The session runs in
this process (``pytest.main``) with the plugin as installed (or as ``PYTEST_PLUGINS`` names it),
so the profile holds the plugin's hooks, the engines and the collector beside the tests' own
work. ``--out`` keeps the raw profile for ``python -m pstats``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", type=Path, help="the suite's folder")
    parser.add_argument("--out", type=Path, default=None, help="write the raw profile here")
    parser.add_argument("--top", type=int, default=40, help="functions listed by each ordering (default 40)")
    parser.add_argument("--dry-run", action="store_true", help="check the options; run nothing")
    arguments = list(sys.argv[1:] if argv is None else argv)
    extra = arguments[arguments.index("--") + 1 :] if "--" in arguments else []
    options = parser.parse_args(arguments[: len(arguments) - len(extra) - (1 if "--" in arguments else 0)])
    if options.top < 1:
        parser.error(f"--top must be at least 1 (got {options.top})")
    if options.dry_run:
        return 0
    if not options.suite.is_dir():
        parser.error(f"{options.suite}: no such folder")
    import pytest

    profile = cProfile.Profile()
    os.chdir(options.suite)
    code = profile.runcall(pytest.main, ["-q", "-p", "no:cacheprovider", *extra])
    if options.out is not None:
        profile.dump_stats(str(options.out))
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(options.top)
        print(f"\n=== by {order} ===\n{text.getvalue()}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
