"""``python -m pytest_gpumem``: the command line of :mod:`pytest_gpumem.cli`."""

from __future__ import annotations

import sys

from pytest_gpumem.cli import main

if __name__ == "__main__":
    sys.exit(main())
