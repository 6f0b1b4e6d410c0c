"""The calculator tool's arithmetic: numbers, + - * / (also × ÷ −), brackets; parsed here, never by eval.

    evaluate("12 + 3*(4 - 1)")   # -> Fraction(21)

Exact rational arithmetic (fractions), with limits on the text, the numbers, the nesting
and the size of every intermediate result, so no input can take long or much memory.
A number is ASCII digits only (other scripts' digits are refused, not read), with a decimal
point and optional thousands commas in groups of three (`1,500`); any other comma (`1,5`) is
an error rather than a guess at what was meant. Results are formatted from the fraction
itself, never through a float. Anything else is an ArithError whose message the tool
returns to the model.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 200
MAX_DIGITS = 18  # per number written, and per intermediate result's numerator and denominator
MAX_DEPTH = 16  # brackets and unary signs nested
PLACES = 6  # decimals of a result that is not exact at fewer
_TOKEN = re.compile(r"\s*(?:([0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)|([-+*/()]))")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?|[1-9][0-9]{0,2}(?:,[0-9]{3})+(?:\.[0-9]+)?|\.[0-9]+")
_SYMBOLS = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "x": "*", "X": "*"})


class ArithError(ValueError):
    pass


def evaluate(text: str) -> Fraction:
    if len(text) > MAX_CHARS:
        raise ArithError(f"expression longer than {MAX_CHARS} characters")
    tokens = _tokens(text.translate(_SYMBOLS))
    if not tokens:
        raise ArithError("empty expression")
    parser = _Parser(tokens)
    value = parser.sum(0)
    if parser.i < len(tokens):
        raise ArithError(f"unexpected {tokens[parser.i]!r}")
    return value


def calculate(text: str) -> tuple[str, bool]:
    """A calculator tool's answer to an expression: (its value formatted, False), or ("error: why", True)."""
    try:
        return format_number(evaluate(text)), False
    except ArithError as e:
        return f"error: {e}", True


def format_number(value: Fraction) -> str:
    """Exact when it can be (`7`, `0.125`), else rounded half away from zero to PLACES decimals, all shown
    (`0.333333`, `-0.000000` for a small negative), so a rounded result reads as one. Integer arithmetic on the
    fraction: a float would lose digits past 2**53."""
    scale = 10 ** PLACES
    scaled = abs(value) * scale
    units = int(scaled + Fraction(1, 2))
    sign = "-" if value < 0 else ""
    whole, frac = divmod(units, scale)
    digits = f"{frac:0{PLACES}d}"
    if scaled.denominator == 1:  # exact at PLACES decimals: no trailing zeros
        digits = digits.rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def _tokens(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            if text[i:].strip() == "":
                break
            raise ArithError(f"unexpected character {text[i]!r}")
        number, op = m.groups()
        if number is not None:
            if not _NUMBER.fullmatch(number):
                raise ArithError(f"{number!r} is not a number: commas only between groups of three digits "
                                 "(1,500); write a decimal with a point (1.5)")
            number = number.replace(",", "")
            if len(number.replace(".", "")) > MAX_DIGITS:
                raise ArithError(f"number with more than {MAX_DIGITS} digits")
        out.append(number if number is not None else op)
        i = m.end()
    return out


class _Parser:
    """sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*;
    unary := ('+'|'-') unary | atom; atom := number | '(' sum ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ArithError("expression ends too early")
        self.i += 1
        return tok

    def sum(self, depth: int) -> Fraction:
        value = self.product(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.product(depth)
            value = _bounded(value + rhs if op == "+" else value - rhs)
        return value

    def product(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.unary(depth)
            if op == "/" and rhs == 0:
                raise ArithError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ArithError(f"nested deeper than {MAX_DEPTH}")
        if self.peek() in ("+", "-"):
            sign = -1 if self.take() == "-" else 1
            return sign * self.unary(depth + 1)
        return self.atom(depth)

    def atom(self, depth: int) -> Fraction:
        tok = self.take()
        if tok == "(":
            value = self.sum(depth + 1)
            if self.peek() != ")":
                raise ArithError("missing ')'")
            self.take()
            return value
        if tok in "+-*/)":
            raise ArithError(f"unexpected {tok!r}")
        return Fraction(tok)


def _bounded(value: Fraction) -> Fraction:
    limit = 10 ** MAX_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise ArithError("result too large")
    return value
