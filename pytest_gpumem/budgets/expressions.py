"""Budget expressions: byte limits written in Ψ, such as ``"16Ψ + 2GiB"`` (grammar in docs/budgets.md).

A tokenizer and a recursive-descent parser, never ``eval``; arithmetic is exact (:class:`fractions.Fraction`) and the
result is rounded to the nearest byte, halves up.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, Union

from pytest_gpumem.units import MAX_BYTES, SizeError, format_size, parse_size, shown

__all__ = ["BudgetError", "BudgetExpr", "parse_budget"]

#: Digits a number may have before its point, and after it: a larger one is no size or budget.
_MAX_DIGITS = 20
_NUMBER_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_WORD_RE = re.compile(r"[A-Za-z]+")
_UNIT_RE = re.compile(r"(?:[KMGT]I?B?|B)", re.IGNORECASE)
_PSI_SYMBOLS = ("Ψ", "ψ")
_OPERAND = "a number, size, Ψ or '('"
_OPERATIONS: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class BudgetError(ValueError):
    """A budget expression that cannot be parsed or evaluated."""


# --------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Leaf:
    """A number, a size (``value`` in bytes) or Ψ times ``value`` (``16Ψ``); ``text`` in canonical form."""

    kind: Literal["number", "size", "psi"]
    value: Fraction
    text: str


@dataclass(frozen=True)
class Operation:
    """``op`` (``+ - * /``) on two ``operands``, or a sign (``+`` or ``-``) on one."""

    op: str
    operands: tuple[Node, ...]


Node = Union[Leaf, Operation]  # noqa: UP007 - a runtime alias, Python 3.10


# --------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class _Token:
    kind: str  # "operand", "op", "(", ")", "end"
    pos: int
    text: str
    node: Node | None = None


def _error(text: str, message: str, pos: int) -> BudgetError:
    where = f"at position {pos} (end of text)" if pos >= len(text) else f"at position {pos}"
    return BudgetError(f"{shown(text, 80)}: {message} {where}")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _is_psi_word(word: str) -> bool:
    return word == "P" or word.lower() == "psi"


def _psi_then_unit(word: str) -> bool:
    """Whether a word is a Ψ spelling followed by a unit (``"PGiB"``; ``"PB"`` is petabytes, not Ψ bytes)."""
    return word.upper() not in ("PB", "PIB") and any(
        _is_psi_word(word[:n]) and _UNIT_RE.fullmatch(word[n:]) for n in (3, 1)
    )


def _psi(coefficient: str = "") -> Leaf:
    return Leaf("psi", Fraction(coefficient or 1), f"{coefficient}Ψ")


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = _skip_space(text, 0)
    while pos < len(text):
        char = text[pos]
        number = _NUMBER_RE.match(text, pos)
        word = _WORD_RE.match(text, pos)
        if number:
            token = _number_token(text, number)
        elif char in _PSI_SYMBOLS:
            token = _Token("operand", pos, char, _psi())
        elif char in "+-*/":
            token = _Token("op", pos, char)
        elif char in "()":
            token = _Token(char, pos, char)
        elif word:
            token = _word_token(text, word, tokens)
        else:
            raise _error(text, f"unexpected character {char!r}", pos)
        tokens.append(token)
        pos = _skip_space(text, token.pos + len(token.text))
    tokens.append(_Token("end", len(text), ""))
    return tokens


def _number_token(text: str, match: re.Match[str]) -> _Token:
    """A number, possibly followed (after spaces) by a unit or Ψ: one operand token."""
    start, digits = match.start(), match.group()
    whole, _, fraction = digits.partition(".")
    if len(whole.lstrip("0")) > _MAX_DIGITS:
        raise BudgetError(f"{shown(text)}: the number {shown(digits)} is too large for a size or budget")
    if len(fraction) > _MAX_DIGITS:
        raise BudgetError(
            f"{shown(text)}: the number {shown(digits)} has more than {_MAX_DIGITS} digits after the point"
        )
    after = _skip_space(text, match.end())
    if after < len(text) and text[after] in _PSI_SYMBOLS:
        return _Token("operand", start, text[start : after + 1], _psi(digits))
    word = _WORD_RE.match(text, after)
    if word is None:
        return _Token("operand", start, digits, Leaf("number", Fraction(digits), digits))
    name, written = word.group(), text[start : word.end()]
    if _is_psi_word(name):
        return _Token("operand", start, written, _psi(digits))
    if _UNIT_RE.fullmatch(name):
        try:
            nbytes = parse_size(digits + name)
        except SizeError as exc:
            raise _error(text, f"invalid size {written!r} ({exc})", start) from None
        prefix = name[0].upper()
        unit = "B" if prefix == "B" else f"{prefix}iB"
        return _Token("operand", start, written, Leaf("size", Fraction(nbytes), f"{digits}{unit}"))
    if _psi_then_unit(name):
        raise _error(text, f"a unit cannot follow Ψ: {name!r}", word.start())
    raise _error(text, f"unknown unit {name!r} (expected B, KiB, MiB, GiB, TiB or Ψ)", word.start())


def _word_token(text: str, match: re.Match[str], tokens: list[_Token]) -> _Token:
    """A word that does not follow a number: Ψ, or an error."""
    name = match.group()
    if _is_psi_word(name):
        return _Token("operand", match.start(), name, _psi())
    after_psi = bool(tokens) and isinstance(tokens[-1].node, Leaf) and tokens[-1].node.kind == "psi"
    if (after_psi and _UNIT_RE.fullmatch(name)) or _psi_then_unit(name):
        raise _error(text, f"a unit cannot follow Ψ: {name!r}", match.start())
    if _UNIT_RE.fullmatch(name):
        raise _error(text, f"unit {name!r} without a number", match.start())
    raise _error(text, f"unknown word {name!r}", match.start())


# --------------------------------------------------------------------------- parser


class _Parser:
    _MAX_DEPTH = 50  # nested parentheses and signs
    _MAX_TOKENS = 256  # bounds the depth of the tree, hence of the recursion that walks it

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        if len(self.tokens) > self._MAX_TOKENS:
            raise BudgetError(f"{text[:40]!r}...: the expression is too long (more than {self._MAX_TOKENS} tokens)")
        self.index = 0
        self.depth = 0

    @property
    def token(self) -> _Token:
        return self.tokens[self.index]

    def describe(self, token: _Token) -> str:
        return "end of text" if token.kind == "end" else repr(token.text)

    def parse(self) -> Node:
        node = self.expression()
        token = self.token
        if token.kind == ")":
            raise _error(self.text, "unbalanced parentheses: ')' without '('", token.pos)
        if token.kind != "end":
            raise _error(self.text, f"expected an operator but found {self.describe(token)}", token.pos)
        return node

    def expression(self, ops: str = "+-") -> Node:
        """A sum of terms (``ops`` ``"+-"``), or a term: a product of unary operands (``"*/"``)."""
        operand = self.unary if ops == "*/" else functools.partial(self.expression, "*/")
        node = operand()
        while self.token.kind == "op" and self.token.text in ops:
            op = self.token.text
            self.index += 1
            node = Operation(op, (node, operand()))
        return node

    def unary(self) -> Node:
        token = self.token
        if token.kind == "op" and token.text in "+-":
            self.index += 1
            return Operation(token.text, (self.nested(self.unary),))
        return self.atom()

    def nested(self, rule: Callable[[], Node]) -> Node:
        self.depth += 1
        if self.depth > self._MAX_DEPTH:
            raise _error(self.text, "expression nested too deeply", self.token.pos)
        try:
            return rule()
        finally:
            self.depth -= 1

    def atom(self) -> Node:
        token = self.token
        if token.kind == "operand":
            assert token.node is not None
            self.index += 1
            following = self.token
            if following.kind in ("operand", "("):
                raise _error(
                    self.text,
                    f"expected an operator between {token.text!r} and {self.describe(following)}",
                    following.pos,
                )
            return token.node
        if token.kind == "(":
            self.index += 1
            node = self.nested(self.expression)
            closing = self.token
            if closing.kind != ")":
                found = self.describe(closing)
                raise _error(
                    self.text,
                    f"unbalanced parentheses: expected ')' to close '(' at position {token.pos}, found {found}",
                    closing.pos,
                )
            self.index += 1
            if self.token.kind in ("operand", "("):
                raise _error(
                    self.text, f"expected an operator after ')' but found {self.describe(self.token)}", self.token.pos
                )
            return node
        if token.kind == ")":
            raise _error(self.text, f"expected {_OPERAND} but found ')'", token.pos)
        found = "" if token.kind == "end" else f" but found {self.describe(token)}"
        raise _error(self.text, f"expected {_OPERAND}{found}", token.pos)


# --------------------------------------------------------------------------- evaluation and formatting


def _evaluate(node: Node, psi: int | None, text: str) -> Fraction:
    if isinstance(node, Leaf):
        if node.kind != "psi":
            return node.value
        if psi is None:
            raise BudgetError(f"{text!r} uses Ψ but the number of trainable parameters is unknown")
        return Fraction(psi) * node.value
    values = [_evaluate(operand, psi, text) for operand in node.operands]
    if len(values) == 1:
        return -values[0] if node.op == "-" else values[0]
    if node.op == "/" and values[1] == 0:
        raise BudgetError(f"{text!r}: division by zero")
    return _OPERATIONS[node.op](*values)


def _precedence(node: Node) -> int:
    if isinstance(node, Leaf):
        return 4
    return 3 if len(node.operands) == 1 else _PRECEDENCE[node.op]


def _format(node: Node) -> str:
    if isinstance(node, Leaf):
        return node.text
    if len(node.operands) == 1:
        inner = _format(node.operands[0])
        return f"{node.op}({inner})" if _precedence(node.operands[0]) < 4 else f"{node.op}{inner}"
    precedence = _PRECEDENCE[node.op]
    left, right = node.operands
    left_text, right_text = _format(left), _format(right)
    if _precedence(left) < precedence:
        left_text = f"({left_text})"
    if _precedence(right) < precedence or (_precedence(right) == precedence and node.op in "-/"):
        right_text = f"({right_text})"
    return f"{left_text} {node.op} {right_text}"


def _uses_psi(node: Node) -> bool:
    return node.kind == "psi" if isinstance(node, Leaf) else any(map(_uses_psi, node.operands))


@dataclass(frozen=True)
class BudgetExpr:
    """A parsed budget expression: its ``text`` as written and its syntax tree ``root``."""

    text: str
    root: Node

    @property
    def uses_psi(self) -> bool:
        """True when the expression mentions Ψ."""
        return _uses_psi(self.root)

    def exact(self, psi: int | None = None) -> Fraction:
        """The exact value in bytes for ``psi`` trainable parameters, before rounding."""
        if psi is not None and (isinstance(psi, bool) or not isinstance(psi, int) or psi < 0):
            raise BudgetError(f"Ψ must be a non-negative int, got {psi!r}")
        return _evaluate(self.root, psi, self.text)

    def evaluate(self, psi: int | None = None) -> int:
        """The budget in bytes for ``psi`` trainable parameters, rounded to the nearest byte (halves up).

        Raises :class:`BudgetError` for a missing Ψ, a division by zero or a negative value.
        """
        value = self.exact(psi)
        if value < 0:
            raise negative(self.text, value, psi)
        if value > MAX_BYTES:
            where = "" if psi is None else f" with Ψ={psi:,}"
            raise BudgetError(
                f"{shown(self.text)} is too large{where}: a size or budget is at most 2**63 - 1 bytes (8 EiB)"
            )
        return math.floor(value + Fraction(1, 2))

    def __str__(self) -> str:
        """The canonical form: ``Ψ`` for every spelling, units as ``KiB``/``MiB``/``GiB``, minimal parentheses."""
        return _format(self.root)


def negative(text: str | int, value: Fraction, psi: int | None = None) -> BudgetError:
    """The error for a size or budget below zero: one wording whether written as an int or a string."""
    where = "" if psi is None else f" with Ψ={psi:,}"
    size = format_size(-math.ceil(-value))
    return BudgetError(f"{shown(text)} is negative ({size}{where}): a size or budget cannot be below 0 bytes")


def parse_budget(text: str | int) -> BudgetExpr:
    """Parse a budget expression such as ``"16Ψ + 2GiB"``; an ``int`` ≥ 0 is a number of bytes.

    Raises :class:`BudgetError` naming the text and the position of the problem.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise negative(text, Fraction(text))
        if text > MAX_BYTES:
            raise BudgetError(f"{shown(text)} is too large: a size or budget is at most 2**63 - 1 bytes (8 EiB)")
        return BudgetExpr(str(text), Leaf("number", Fraction(text), str(text)))
    if not isinstance(text, str):
        raise BudgetError(f"{text!r} is not a budget: expected a string like '16Ψ + 2GiB'")
    return _parse_text(text)


@functools.lru_cache(maxsize=1024)
def _parse_text(text: str) -> BudgetExpr:
    """:func:`parse_budget` of a string, cached: every test's marker and record give the same few texts."""
    if not text.strip():
        raise BudgetError(f"{text!r}: the budget expression is empty")
    root = _Parser(text).parse()
    _check_divisors(root, text)
    return BudgetExpr(text, root)


def _check_divisors(node: Node, text: str) -> None:
    """Refuse a division by a constant zero (``"16Ψ/0"``, ``"Ψ/(2-2)"``): wrong for every Ψ."""
    if isinstance(node, Leaf):
        return
    for operand in node.operands:
        _check_divisors(operand, text)
    divisor = node.operands[-1]
    if node.op == "/" and not _uses_psi(divisor) and _evaluate(divisor, None, text) == 0:
        plain = isinstance(divisor, Leaf) and divisor.kind == "number"
        raise BudgetError(f"{text!r}: division by zero{'' if plain else f' ({_format(divisor)} = 0)'}")
