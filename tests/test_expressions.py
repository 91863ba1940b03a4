"""Budget expressions: examples, error messages, and hypothesis properties against a reference built from the parts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pytest_gpumem.budgets.expressions import BudgetError, BudgetExpr, parse_budget
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.plugin.marker import parse_marker
from pytest_gpumem.units import MAX_BYTES, parse_size, shown

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize(
    ("text", "psi", "expected", "canonical"),
    [
        ("16Ψ", 1000, 16_000, "16Ψ"),
        ("16 Ψ", 1000, 16_000, "16Ψ"),
        ("16P", 1000, 16_000, "16Ψ"),
        ("16psi", 1000, 16_000, "16Ψ"),
        ("16 PSI", 1000, 16_000, "16Ψ"),
        ("16Ψ + 2GiB", 1000, 16_000 + 2 * GiB, "16Ψ + 2GiB"),
        ("(2+2+12)*psi", 7, 16 * 7, "(2 + 2 + 12) * Ψ"),
        ("18 * P - 1MiB", 10**6, 18 * 10**6 - MiB, "18 * Ψ - 1MiB"),
        ("4GB", None, 4 * GiB, "4GiB"),
        ("4GiB", None, 4 * GiB, "4GiB"),
        ("512 MiB", None, 512 * MiB, "512MiB"),
        ("300KB", None, 300 * KiB, "300KiB"),
        ("0B", None, 0, "0B"),
        ("1024", None, 1024, "1024"),
        ("1.5GiB", None, 3 * GiB // 2, "1.5GiB"),
        ("0.1KB", None, 102, "0.1KiB"),  # as parse_size reads it: 102.4 rounds to 102
        ("512m + 1 g", None, 512 * MiB + GiB, "512MiB + 1GiB"),
        ("1GiB / 2Ψ", 4, GiB // 8, "1GiB / 2Ψ"),  # implicit multiplication binds tighter than /
        ("1GiB / 2 * Ψ", 4, 2 * GiB, "1GiB / 2 * Ψ"),
        ("2 * (3 + 4)", None, 14, "2 * (3 + 4)"),
        ("2 * 3 + 4", None, 10, "2 * 3 + 4"),
        ("10 - (3 - 1)", None, 8, "10 - (3 - 1)"),
        ("10 - 3 - 1", None, 6, "10 - 3 - 1"),
        ("-1KiB + 2KiB", None, KiB, "-1KiB + 2KiB"),
        ("2 - -1", None, 3, "2 - -1"),
        ("-(-(3))", None, 3, "-(-3)"),
        ("1 / 3", None, 0, "1 / 3"),
        ("3 / 2", None, 2, "3 / 2"),  # halves round up
        ("5 / 2", None, 3, "5 / 2"),
        ("0.5Ψ", 3, 2, "0.5Ψ"),
        (".5 * 2", None, 1, ".5 * 2"),
        ("  16Ψ\t+\n2GiB  ", 1, 16 + 2 * GiB, "16Ψ + 2GiB"),
        ("Ψ", 123, 123, "Ψ"),
        ("ψ * 2", 5, 10, "Ψ * 2"),
    ],
)
def test_examples(text: str, psi: int | None, expected: int, canonical: str) -> None:
    expr = parse_budget(text)
    assert expr.text == text
    assert expr.evaluate(psi) == expected
    assert str(expr) == canonical
    assert parse_budget(str(expr)).evaluate(psi) == expected
    assert expr.uses_psi == (psi is not None)


def test_int_is_a_number_of_bytes() -> None:
    assert parse_budget(4096).evaluate() == 4096
    assert not parse_budget(0).uses_psi
    with pytest.raises(BudgetError, match="cannot be below 0 bytes"):
        parse_budget(-1)
    with pytest.raises(BudgetError, match="expected a string"):
        parse_budget(True)
    with pytest.raises(BudgetError, match="expected a string"):
        parse_budget(1.5)  # type: ignore[arg-type]


def test_exact_value() -> None:
    assert parse_budget("1/3 + Ψ").exact(1) == Fraction(4, 3)
    assert parse_budget("0.1KB").exact() == 102


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("16Ψ +", "'16Ψ +': expected a number, size, Ψ or '(' at position 5 (end of text)"),
        ("", "'': the budget expression is empty"),
        ("   ", "'   ': the budget expression is empty"),
        ("16Ψ GiB", "'16Ψ GiB': a unit cannot follow Ψ: 'GiB' at position 4"),
        ("16ΨGiB", "'16ΨGiB': a unit cannot follow Ψ: 'GiB' at position 3"),
        ("16PGiB", "'16PGiB': a unit cannot follow Ψ: 'PGiB' at position 2"),
        ("16psiMB", "'16psiMB': a unit cannot follow Ψ: 'psiMB' at position 2"),
        ("psi KiB", "'psi KiB': a unit cannot follow Ψ: 'KiB' at position 4"),
        ("2 3", "'2 3': expected an operator between '2' and '3' at position 2"),
        ("2GiB 3", "'2GiB 3': expected an operator between '2GiB' and '3' at position 5"),
        ("1.5 .5", "'1.5 .5': expected an operator between '1.5' and '.5' at position 4"),
        ("Ψ Ψ", "'Ψ Ψ': expected an operator between 'Ψ' and 'Ψ' at position 2"),
        ("Ψ 2", "'Ψ 2': expected an operator between 'Ψ' and '2' at position 2"),
        ("2 (3)", "'2 (3)': expected an operator between '2' and '(' at position 2"),
        ("(2)(3)", "'(2)(3)': expected an operator after ')' but found '(' at position 3"),
        ("(2)Ψ", "'(2)Ψ': expected an operator after ')' but found 'Ψ' at position 3"),
        (
            "(2 + 3",
            "'(2 + 3': unbalanced parentheses: expected ')' to close '(' at position 0, "
            "found end of text at position 6 (end of text)",
        ),
        ("2 + 3)", "'2 + 3)': unbalanced parentheses: ')' without '(' at position 5"),
        ("()", "'()': expected a number, size, Ψ or '(' but found ')' at position 1"),
        ("4XB", "'4XB': unknown unit 'XB' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 1"),
        ("16 p", "'16 p': unknown unit 'p' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 3"),
        ("2 PB", "'2 PB': unknown unit 'PB' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 2"),
        ("2PiB", "'2PiB': unknown unit 'PiB' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 1"),
        ("1i", "'1i': unknown unit 'i' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 1"),
        ("1e9", "'1e9': unknown unit 'e' (expected B, KiB, MiB, GiB, TiB or Ψ) at position 1"),
        ("GiB", "'GiB': unit 'GiB' without a number at position 0"),
        ("params", "'params': unknown word 'params' at position 0"),
        ("2 % 3", "'2 % 3': unexpected character '%' at position 2"),
        ("2 ** 3", "'2 ** 3': expected a number, size, Ψ or '(' but found '*' at position 3"),
        ("__import__('os')", "\"__import__('os')\": unexpected character '_' at position 0"),
        ("1GiB / (2 - 2)", "'1GiB / (2 - 2)': division by zero (2 - 2 = 0)"),
        ("16Ψ/0", "'16Ψ/0': division by zero"),
        ("Ψ / (Ψ / 0)", "'Ψ / (Ψ / 0)': division by zero"),
        ("1.5B", "'1.5B': invalid size '1.5B' ('1.5B' is not a size: a number of bytes must be whole) at position 0"),
    ],
)
def test_errors(text: str, message: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("text", "psi", "message"),
    [
        ("16Ψ", None, "'16Ψ' uses Ψ but the number of trainable parameters is unknown"),
        ("1 / (Ψ - 3)", 3, "'1 / (Ψ - 3)': division by zero"),
        ("1MiB - 2MiB", None, "'1MiB - 2MiB' is negative (-1.00 MiB): a size or budget cannot be below 0 bytes"),
        ("Ψ - 1", 0, "'Ψ - 1' is negative (-1 B with Ψ=0): a size or budget cannot be below 0 bytes"),
        ("Ψ", -1, "Ψ must be a non-negative int, got -1"),
    ],
)
def test_evaluation_errors(text: str, psi: int | None, message: str) -> None:
    expr = parse_budget(text)
    with pytest.raises(BudgetError) as info:
        expr.evaluate(psi)
    assert str(info.value) == message


def test_limits_on_size_of_input() -> None:
    with pytest.raises(BudgetError, match="nested too deeply"):
        parse_budget("(" * 60 + "1" + ")" * 60)
    with pytest.raises(BudgetError, match="too long"):
        parse_budget(" + ".join(["1"] * 200))
    assert parse_budget("(" * 40 + "1" + ")" * 40).evaluate() == 1
    assert parse_budget(" + ".join(["1"] * 100)).evaluate() == 100


# --------------------------------------------------------------------------- properties


def round_half_up(value: Fraction) -> int:
    return math.floor(value + Fraction(1, 2))


@dataclass(frozen=True)
class Gen:
    """A generated expression: its text, its reference value, and how tightly it binds."""

    text: str
    value: Callable[[int], Fraction]  # raises ZeroDivisionError where the expression divides by zero
    precedence: int  # 1: + -, 2: * /, 3: unary, 4: atom
    uses_psi: bool
    #: divides by a constant that is zero (``16Ψ/(2-2)``): refused when parsed, whatever Ψ
    constant_zero_divisor: bool = False


def _is_zero(gen: Gen) -> bool:
    try:
        return gen.value(0) == 0
    except ZeroDivisionError:
        return False


spaces = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def numbers(draw: st.DrawFn) -> tuple[str, Fraction]:
    whole = draw(st.integers(0, 10**6))
    form = draw(st.sampled_from(["int", "decimal", "leading-dot", "trailing-dot"]))
    if form == "int":
        return str(whole), Fraction(whole)
    if form == "trailing-dot":
        return f"{whole}.", Fraction(whole)
    digits = draw(st.text("0123456789", min_size=1, max_size=4))
    fraction = Fraction(int(digits), 10 ** len(digits))
    if form == "leading-dot":
        return f".{digits}", fraction
    return f"{whole}.{digits}", whole + fraction


@st.composite
def sizes(draw: st.DrawFn) -> tuple[str, int]:
    """A size as written and its bytes, computed from the parts (not by parse_size)."""
    power = draw(st.integers(0, 4))
    if power == 0:
        count = draw(st.integers(0, 10**9))
        number, value = str(count), Fraction(count)
        unit = draw(st.sampled_from(["B", "b"]))
    else:
        number, value = draw(numbers())
        prefix = "KMGT"[power - 1]
        prefix = draw(st.sampled_from([prefix, prefix.lower()]))
        unit = prefix + draw(st.sampled_from(["", "i", "I"])) + draw(st.sampled_from(["", "B", "b"]))
    return f"{number}{draw(spaces)}{unit}", round_half_up(value * 1024**power)


psi_spellings = st.sampled_from(["Ψ", "P", "psi", "PSI", "Psi", "pSi"])


@st.composite
def leaves(draw: st.DrawFn) -> Gen:
    kind = draw(st.sampled_from(["number", "size", "psi", "scaled"]))
    if kind == "number":
        text, number = draw(numbers())
        return Gen(text, lambda psi: number, 4, False)
    if kind == "size":
        text, nbytes = draw(sizes())
        return Gen(text, lambda psi: Fraction(nbytes), 4, False)
    spelling = draw(psi_spellings)
    if kind == "psi":
        return Gen(spelling, lambda psi: Fraction(psi), 4, True)
    text, coefficient = draw(numbers())
    return Gen(f"{text}{draw(spaces)}{spelling}", lambda psi: coefficient * psi, 4, True)


def _wrap(child: Gen, parens: bool) -> str:
    return f"({child.text})" if parens else child.text


def _apply(op: str, left: Fraction, right: Fraction) -> Fraction:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left / right  # ZeroDivisionError when right == 0


@st.composite
def binaries(draw: st.DrawFn, children: st.SearchStrategy[Gen]) -> Gen:
    op = draw(st.sampled_from("+-*/"))
    left, right = draw(children), draw(children)
    precedence = 1 if op in "+-" else 2
    extra = st.booleans()
    left_text = _wrap(left, left.precedence < precedence or draw(extra))
    right_needs = right.precedence < precedence or (right.precedence == precedence and op in "-/")
    right_text = _wrap(right, right_needs or draw(extra))
    text = f"{left_text}{draw(spaces)}{op}{draw(spaces)}{right_text}"
    return Gen(
        text,
        lambda psi: _apply(op, left.value(psi), right.value(psi)),
        precedence,
        left.uses_psi or right.uses_psi,
        left.constant_zero_divisor
        or right.constant_zero_divisor
        or (op == "/" and not right.uses_psi and _is_zero(right)),
    )


@st.composite
def unaries(draw: st.DrawFn, children: st.SearchStrategy[Gen]) -> Gen:
    sign = draw(st.sampled_from("+-"))
    child = draw(children)
    text = f"{sign}{draw(spaces)}{_wrap(child, child.precedence < 3 or draw(st.booleans()))}"
    return Gen(
        text,
        lambda psi: -child.value(psi) if sign == "-" else child.value(psi),
        3,
        child.uses_psi,
        child.constant_zero_divisor,
    )


def _extend(children: st.SearchStrategy[Gen]) -> st.SearchStrategy[Gen]:
    return st.one_of(binaries(children), binaries(children), unaries(children))


expressions = st.recursive(leaves(), _extend, max_leaves=10)
psis = st.integers(0, 10**12)


def reference(gen: Gen, psi: int) -> int | None:
    """The expected bytes, or None where the expression must raise BudgetError."""
    try:
        value = gen.value(psi)
    except ZeroDivisionError:
        return None
    if value < 0 or value > MAX_BYTES:  # no memory holds more: the evaluator refuses it
        return None
    return round_half_up(value)


def outcome(expr: BudgetExpr, psi: int | None) -> int | None:
    try:
        return expr.evaluate(psi)
    except BudgetError:
        return None


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(expressions, psis)
def test_evaluates_like_the_reference(gen: Gen, psi: int) -> None:
    if gen.constant_zero_divisor:
        with pytest.raises(BudgetError, match="division by zero"):
            parse_budget(gen.text)
        return
    expr = parse_budget(gen.text)
    assert expr.text == gen.text
    assert expr.uses_psi == gen.uses_psi
    assert outcome(expr, psi) == reference(gen, psi)
    if not gen.uses_psi:
        assert outcome(expr, None) == outcome(expr, psi)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(expressions, psis)
def test_canonical_form_round_trips(gen: Gen, psi: int) -> None:
    assume(not gen.constant_zero_divisor)
    expr = parse_budget(gen.text)
    again = parse_budget(str(expr))
    assert str(again) == str(expr)
    assert again.uses_psi == expr.uses_psi
    assert outcome(again, psi) == outcome(expr, psi)
    try:
        exact = expr.exact(psi)
    except BudgetError:
        with pytest.raises(BudgetError, match="division by zero"):
            again.exact(psi)
    else:
        assert again.exact(psi) == exact


@given(sizes())
def test_a_plain_size_reads_like_parse_size(size: tuple[str, int]) -> None:
    text, nbytes = size
    assert parse_size(text) == nbytes
    assert parse_budget(text).evaluate(None) == nbytes
    assert not parse_budget(text).uses_psi


@given(expressions, st.integers(0, 10**6))
def test_truncated_text_raises_or_parses(gen: Gen, cut: int) -> None:
    """Any prefix of a valid expression either parses or raises BudgetError: never another exception."""
    text = gen.text[: cut % (len(gen.text) + 1)]
    try:
        parse_budget(text)
    except BudgetError as exc:
        # the text itself, or its ends and length when it is long (80 characters kept where a
        # position is named in it, 40 elsewhere)
        assert str(exc).startswith((shown(text, 80) + ": ", shown(text) + ": ", shown(text) + " is "))


@pytest.mark.parametrize(
    ("value", "shown"), [(-1, "-1 is negative (-1 B)"), ("-1GB", "'-1GB' is negative (-1.00 GiB)")]
)
def test_a_negative_limit_reads_the_same_as_an_int_and_as_a_string(value: object, shown: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_marker([((), {"peak": value})])
    assert str(caught.value) == f"peak={value!r}: {shown}: a size or budget cannot be below 0 bytes"
