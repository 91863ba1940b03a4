"""Parsing and formatting byte sizes: K, M, G and T are 1024-based with or without ``i`` (as GPU spec sheets and
pytest-memray)."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

__all__ = [
    "CUDA_BLOCK",
    "MAX_BYTES",
    "UNITS",
    "SizeError",
    "cuda_rounded",
    "format_delta",
    "format_percent",
    "format_size",
    "format_sizes",
    "parse_size",
    "shown",
]

#: Multiplier of each unit prefix (1024-based).
UNITS: dict[str, int] = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

_SIZE_RE = re.compile(
    r"""^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*
        (?P<prefix>[KMGT]?)(?P<i>I?)(?P<b>B?)\s*$""",
    re.IGNORECASE | re.VERBOSE,
)


#: The largest number of bytes a size, limit, tolerance or baseline may hold: 2**63 - 1, as PyTorch's allocators count.
MAX_BYTES = 2**63 - 1

#: Digits (before a decimal point, leading zeros aside) beyond which a number is too large at once.
_MAX_DIGITS = 20

#: The CUDA caching allocator rounds every block up to a multiple of 512 bytes.
CUDA_BLOCK = 512


def cuda_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up as the CUDA caching allocator sizes a block (0 stays 0)."""
    return 0 if nbytes <= 0 else -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


class SizeError(ValueError):
    """A value that is not a valid byte size."""


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` for a message, its middle cut out beyond ``limit`` characters (never converted whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}…{text[-(limit // 4) :]} ({len(text)} characters)"


def too_large(value: object) -> SizeError:
    """The error for a size beyond :data:`MAX_BYTES`."""
    return SizeError(f"{shown(value)} is too large: a size is at most 2**63 - 1 bytes (8 EiB)")


def parse_size(value: object) -> int:
    """The bytes ``value`` (an ``int`` ≥ 0 or a string such as ``"4GB"``, ``"1.5GiB"``) stands for, else
    :class:`SizeError` (booleans and floats included); a fraction of a unit rounds to the byte."""
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is not a size: use an int number of bytes or a string like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{shown(value)} is not a size: sizes cannot be negative")
        if value > MAX_BYTES:
            raise too_large(value)
        return value
    if isinstance(value, float):
        raise SizeError(
            f"{value!r} is not a size: a float number of bytes is not allowed, use an int or a string like '1.5GiB'"
        )
    if not isinstance(value, str):
        raise SizeError(f"{value!r} is not a size: expected an int or a string like '4GiB', got {type(value).__name__}")
    text = value.strip()
    bad = f"{value!r} is not a size"
    if not text:
        raise SizeError("'' is not a size: the string is empty")
    if text.startswith(("-", "+")):
        sign = "negative" if text.startswith("-") else "signed"
        raise SizeError(f"{bad}: {sign} sizes are not allowed")
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeError(f"{bad}: expected a number and a unit such as '4GiB', '512 MiB', '300KB' or '0B'")
    prefix = match["prefix"].upper()
    if match["i"] and not prefix:
        raise SizeError(f"{bad}: 'i' must follow K, M, G or T")
    whole, _, fraction = match["number"].partition(".")
    if len(whole.lstrip("0")) > _MAX_DIGITS:
        raise too_large(value)
    if len(fraction) > _MAX_DIGITS:
        raise SizeError(f"{shown(value)} is not a size: more than {_MAX_DIGITS} digits after the point")
    number = Decimal(match["number"])
    if not prefix and number != number.to_integral_value():
        raise SizeError(f"{shown(value)} is not a size: a number of bytes must be whole")
    nbytes = number * UNITS[prefix]
    if nbytes > MAX_BYTES:
        raise too_large(value)
    return int(nbytes.to_integral_value(rounding=ROUND_HALF_UP))


def format_size(nbytes: int | None, precision: int = 2) -> str:
    """Format a byte count for people: ``"512 B"``, ``"1.50 KiB"``; ``None`` is ``"n/a"``, negatives keep their sign."""
    if nbytes is None:
        return "n/a"
    sign = "-" if nbytes < 0 else ""
    magnitude = abs(nbytes)
    if magnitude > MAX_BYTES:
        return f"{sign}more than 8 EiB"
    if magnitude < UNITS["K"]:
        return f"{sign}{magnitude} B"
    prefix = next(prefix for prefix in "TGMK" if magnitude >= UNITS[prefix])
    return f"{sign}{magnitude / UNITS[prefix]:.{precision}f} {prefix}iB"


def format_delta(nbytes: int | None, precision: int = 2) -> str:
    """Format a signed difference of bytes: ``"+1.50 MiB"``, ``"-512 B"``, ``"0 B"``."""
    text = format_size(nbytes, precision)
    return "+" + text if nbytes is not None and nbytes > 0 else text


def format_sizes(*counts: int | None) -> tuple[str, ...]:
    """Format byte counts to read side by side: counts that differ never read the same (more decimals, then bytes)."""
    distinct = len({count for count in counts if count is not None})
    for precision in (2, 4):
        texts = tuple(format_size(count, precision) for count in counts)
        if len({text for text, count in zip(texts, counts, strict=True) if count is not None}) == distinct:
            return texts
    return tuple("n/a" if count is None else f"{count:,} B" for count in counts)


def format_percent(numerator: int | None, denominator: int | None) -> str:
    """``numerator / denominator`` as a signed percentage: two significant digits when small (never ``"+0.0%"``), a
    factor from 1000% (``"×8,192"``)."""
    if numerator is None or denominator is None:
        return "n/a"
    if denominator == 0:
        return "n/a" if numerator else "+0.0%"
    percent = 100.0 * numerator / abs(denominator)
    if percent >= 1000:
        factor = 1 + numerator / abs(denominator)
        return f"×{factor:,.0f}" if factor >= 100 else f"×{factor:.1f}"
    if numerator and abs(percent) < 0.05:
        if abs(percent) < 0.001:
            return f"{'+' if numerator > 0 else '-'}<0.001%"
        return f"{percent:+.2g}%"
    return f"{percent:+.1f}%"
