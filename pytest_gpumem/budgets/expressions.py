"""Budget expressions: byte limits written in Ψ, such as ``"16Ψ + 2GiB"`` (grammar in docs/budgets.md).

A tokenizer and a recursive-descent parser, never ``eval``; arithmetic is exact (:class:`fractions.Fraction`) and the
result is rounded to the nearest byte, halves up.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

from pytest_gpumem.units import MAX_BYTES, UNITS, SizeError, format_size, parse_size, shown

__all__ = ["BudgetError", "BudgetExpr", "parse_budget"]

#: Digits a number may have before its point, and after it: a larger one is no size or budget.
_MAX_DIGITS = 20
_NUMBER_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_WORD_RE = re.compile(r"[A-Za-z]+")
_UNIT_RE = re.compile(r"(?:[KMGT]I?B?|B)", re.IGNORECASE)
_PSI_SYMBOLS = ("Ψ", "ψ")
_OPERATORS = "+-*/"
_OPERAND = "a number, size, Ψ or '('"


class BudgetError(ValueError):
    """A budget expression that cannot be parsed or evaluated."""


# --------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Number:
    """A decimal literal; ``text`` as written."""

    value: Fraction
    text: str


@dataclass(frozen=True)
class Size:
    """A size literal: ``nbytes`` as parse_size reads ``number`` + ``unit``."""

    nbytes: int
    number: str
    unit: str  # canonical: "B", "KiB", "MiB", "GiB" or "TiB"


@dataclass(frozen=True)
class Psi:
    """Ψ, optionally scaled by a number written just before it (``16Ψ``)."""

    coefficient: Number | None = None


@dataclass(frozen=True)
class Unary:
    """``+operand`` or ``-operand``."""

    op: str
    operand: Node


@dataclass(frozen=True)
class Binary:
    """``left op right`` with ``op`` in ``+ - * /``."""

    op: str
    left: Node
    right: Node


Node = Union[Number, Size, Psi, Unary, Binary]  # noqa: UP007 - a runtime alias, Python 3.10


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


def _psi_prefix(word: str) -> str | None:
    """The Ψ spelling a word starts with when the rest is a unit (``"PGiB"``)."""
    if word.upper() in ("PB", "PIB"):  # petabytes, not Ψ bytes
        return None
    for spelling in (word[:3], word[:1]):
        if spelling and _is_psi_word(spelling) and _UNIT_RE.fullmatch(word[len(spelling) :]):
            return spelling
    return None


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = _skip_space(text, 0)
    while pos < len(text):
        token, pos = _next_token(text, pos, tokens)
        tokens.append(token)
        pos = _skip_space(text, pos)
    tokens.append(_Token("end", len(text), ""))
    return tokens


def _next_token(text: str, pos: int, tokens: list[_Token]) -> tuple[_Token, int]:
    """The token starting at ``pos`` and the position just after it."""
    char = text[pos]
    number = _NUMBER_RE.match(text, pos)
    if number:
        token = _number_token(text, number)
        return token, token.pos + len(token.text)
    if char in _PSI_SYMBOLS:
        return _Token("operand", pos, char, Psi()), pos + 1
    if char in _OPERATORS:
        return _Token("op", pos, char), pos + 1
    if char in "()":
        return _Token(char, pos, char), pos + 1
    word = _WORD_RE.match(text, pos)
    if word:
        return _word_token(text, word, tokens), word.end()
    raise _error(text, f"unexpected character {char!r}", pos)


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
    number = Number(Fraction(digits), digits)
    after = _skip_space(text, match.end())
    if after < len(text) and text[after] in _PSI_SYMBOLS:
        return _Token("operand", start, text[start : after + 1], Psi(number))
    word = _WORD_RE.match(text, after)
    if word is None:
        return _Token("operand", start, digits, number)
    name = word.group()
    if _is_psi_word(name):
        return _Token("operand", start, text[start : word.end()], Psi(number))
    if _UNIT_RE.fullmatch(name):
        try:
            nbytes = parse_size(digits + name)
        except SizeError as exc:
            raise _error(text, f"invalid size {text[start : word.end()]!r} ({exc})", start) from None
        prefix = name[0].upper()
        unit = f"{prefix}iB" if prefix in UNITS and prefix else "B"
        return _Token("operand", start, text[start : word.end()], Size(nbytes, digits, unit))
    if _psi_prefix(name):
        raise _error(text, f"a unit cannot follow Ψ: {name!r}", word.start())
    raise _error(text, f"unknown unit {name!r} (expected B, KiB, MiB, GiB, TiB or Ψ)", word.start())


def _word_token(text: str, match: re.Match[str], tokens: list[_Token]) -> _Token:
    """A word that does not follow a number: Ψ, or an error."""
    name = match.group()
    if _is_psi_word(name):
        return _Token("operand", match.start(), name, Psi())
    if tokens and isinstance(tokens[-1].node, Psi) and _UNIT_RE.fullmatch(name):
        raise _error(text, f"a unit cannot follow Ψ: {name!r}", match.start())
    if _psi_prefix(name):
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

    def expression(self) -> Node:
        node = self.term()
        while self.token.kind == "op" and self.token.text in "+-":
            op = self.token.text
            self.index += 1
            node = Binary(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.token.kind == "op" and self.token.text in "*/":
            op = self.token.text
            self.index += 1
            node = Binary(op, node, self.unary())
        return node

    def unary(self) -> Node:
        token = self.token
        if token.kind == "op" and token.text in "+-":
            self.index += 1
            return Unary(token.text, self.nested(self.unary))
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
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Size):
        return Fraction(node.nbytes)
    if isinstance(node, Psi):
        if psi is None:
            raise BudgetError(f"{text!r} uses Ψ but the number of trainable parameters is unknown")
        return Fraction(psi) * (node.coefficient.value if node.coefficient else 1)
    if isinstance(node, Unary):
        value = _evaluate(node.operand, psi, text)
        return -value if node.op == "-" else value
    left = _evaluate(node.left, psi, text)
    right = _evaluate(node.right, psi, text)
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    if right == 0:
        raise BudgetError(f"{text!r}: division by zero")
    return left / right


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _precedence(node: Node) -> int:
    if isinstance(node, Binary):
        return _PRECEDENCE[node.op]
    if isinstance(node, Unary):
        return 3
    return 4


def _format(node: Node) -> str:
    if isinstance(node, Number):
        return node.text
    if isinstance(node, Size):
        return f"{node.number}{node.unit}"
    if isinstance(node, Psi):
        return f"{node.coefficient.text}Ψ" if node.coefficient else "Ψ"
    if isinstance(node, Unary):
        inner = _format(node.operand)
        return f"{node.op}({inner})" if _precedence(node.operand) < 4 else f"{node.op}{inner}"
    precedence = _PRECEDENCE[node.op]
    left = _format(node.left)
    if _precedence(node.left) < precedence:
        left = f"({left})"
    right = _format(node.right)
    right_precedence = _precedence(node.right)
    if right_precedence < precedence or (right_precedence == precedence and node.op in "-/"):
        right = f"({right})"
    return f"{left} {node.op} {right}"


def _uses_psi(node: Node) -> bool:
    if isinstance(node, Psi):
        return True
    if isinstance(node, Unary):
        return _uses_psi(node.operand)
    if isinstance(node, Binary):
        return _uses_psi(node.left) or _uses_psi(node.right)
    return False


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
        return BudgetExpr(str(text), Number(Fraction(text), str(text)))
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
    if isinstance(node, Unary):
        _check_divisors(node.operand, text)
    elif isinstance(node, Binary):
        _check_divisors(node.left, text)
        _check_divisors(node.right, text)
        if node.op == "/" and not _uses_psi(node.right) and _evaluate(node.right, None, text) == 0:
            shown = "" if isinstance(node.right, Number) else f" ({_format(node.right)} = 0)"
            raise BudgetError(f"{text!r}: division by zero{shown}")
