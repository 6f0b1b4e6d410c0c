"""The calculator tool's arithmetic: numbers, + - * / (also × ÷ −), brackets; parsed here, never by eval.

    evaluate("12 + 3*(4 - 1)")   # -> Fraction(21)

Exact rational arithmetic (fractions), with limits on the text, the numbers, the nesting
and the size of every intermediate result, so no input can take long or much memory.
Anything else is an ArithError whose message the tool returns to the model.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 200
MAX_DIGITS = 18  # per number written, and per intermediate result's numerator and denominator
MAX_DEPTH = 16  # brackets and unary signs nested
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|([-+*/()]))")
_SYMBOLS = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "x": "*", "X": "*", ",": ""})


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


def format_number(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _tokens(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            if text[i:].strip() == "":
                break
            raise ArithError(f"unexpected character {text[i]!r}")
        number, op = m.groups()
        if number is not None and len(number.replace(".", "")) > MAX_DIGITS:
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
