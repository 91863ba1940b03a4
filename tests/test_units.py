"""Size parsing and formatting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpumem.units import UNITS, SizeError, format_delta, format_percent, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 * 2**30),
        ("4GiB", 4 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("300KB", 300 * 1024),
        ("0B", 0),
        ("0", 0),
        ("1024", 1024),
        ("2T", 2 * 2**40),
        ("7 mib", 7 * 2**20),
        (" 64kb ", 64 * 1024),
        ("0.1KB", 102),
        (1234, 1234),
        (0, 0),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("4XB", "not a size"),
        ("-1GB", "negative"),
        ("4GBxyz", "not a size"),
        ("", "empty"),
        ("   ", "empty"),
        (1.5, "float"),
        (2.0, "float"),
        ("1.5B", "whole"),
        ("1.5", "whole"),
        (-1, "negative"),
        (True, "not a size"),
        (None, "NoneType"),
        ("4 iB", "not a size"),
        ("GB", "not a size"),
        ("+4GB", "signed"),
    ],
)
def test_parse_size_rejects(bad: object, words: str) -> None:
    with pytest.raises(SizeError, match=words) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value) or bad in ("", "   ")


@given(st.integers(min_value=0, max_value=2**50))
def test_int_round_trip(n: int) -> None:
    assert parse_size(n) == n
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}B") == n


@given(st.integers(min_value=0, max_value=2**20), st.sampled_from(["K", "M", "G", "T"]), st.booleans())
def test_unit_multiples_are_1024_based(n: int, prefix: str, with_i: bool) -> None:
    unit = prefix + ("i" if with_i else "") + "B"
    assert parse_size(f"{n}{unit}") == n * UNITS[prefix]
    assert parse_size(f"{n} {unit.lower()}") == n * UNITS[prefix]


@given(st.integers(min_value=0, max_value=2**50))
def test_format_round_trip_within_display_precision(n: int) -> None:
    text = format_size(n)
    back = parse_size(text)
    unit = UNITS[text.split()[1][0]] if text.split()[1] != "B" else 1
    assert abs(back - n) <= unit * 0.005 + 0.5
    if n < 1024:
        assert back == n


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_format_delta_sign(n: int) -> None:
    text = format_delta(n)
    assert text.startswith("+") == (n > 0)
    assert text.startswith("-") == (n < 0)


def test_format_examples() -> None:
    assert format_size(None) == "n/a"
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(2 * 2**30) == "2.00 GiB"
    assert format_delta(None) == "n/a"
    assert format_delta(0) == "0 B"
    assert format_percent(1, 4) == "+25.0%"
    assert format_percent(None, 4) == "n/a"
    assert format_percent(0, 0) == "+0.0%"
