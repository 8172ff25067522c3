"""A safe calculator: `ast` parse, then a walk over number / + - * / // % / unary-sign nodes.

Nothing is evaluated by Python itself: the expression is parsed with `ast.parse(mode="eval")`
and only the node types below are interpreted, on exact `Fraction`s. Every failure is a
`CalcError` with a short lowercase `code` the arithmetic env shows the model:
  "syntax"  not an expression of the allowed form (names, calls, '**', strings, ...)
  "long"    expression longer than `max_chars`
  "div0"    division or modulo by zero
  "big"     a literal or an intermediate result with |x| > `max_abs`
"""

from __future__ import annotations

import ast
import fractions
import operator

MAX_CHARS = 48
MAX_ABS = 10**12

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
OP_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
}


class CalcError(ValueError):
    """The expression cannot be evaluated; `code` is a short lowercase reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse(expr: str, *, max_chars: int = MAX_CHARS) -> ast.expr:
    """The expression's `ast` body; CalcError("syntax" | "long") otherwise."""
    if not isinstance(expr, str):
        raise CalcError("syntax", f"expression must be a str, got {type(expr).__name__}")
    if len(expr) > max_chars:
        raise CalcError("long", f"expression has {len(expr)} characters > {max_chars}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError("syntax", f"cannot parse {expr!r}: {type(e).__name__}") from None
    return tree.body


def _walk(node: ast.expr, max_abs: int) -> fractions.Fraction:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise CalcError("syntax", f"literal {v!r} is not a number")
        if isinstance(v, float) and not abs(v) < float("inf"):
            raise CalcError("big", f"literal {v!r} is not finite")
        x = fractions.Fraction(v)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        x = _UNARY[type(node.op)](_walk(node.operand, max_abs))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _walk(node.left, max_abs), _walk(node.right, max_abs)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise CalcError("div0", "division by zero")
        x = fractions.Fraction(_BINARY[type(node.op)](a, b))
    else:
        raise CalcError("syntax", f"{type(node).__name__} is not allowed")
    if abs(x) > max_abs:
        raise CalcError("big", f"|{float(x):.3g}| > {max_abs}")
    return x


def evaluate(
    expr: str, *, max_chars: int = MAX_CHARS, max_abs: int = MAX_ABS
) -> fractions.Fraction:
    """Exact value of `expr` (ints, + - * / // %, unary +/-, parentheses).

    Magnitudes are checked after every node, so no intermediate exceeds `max_abs` and the
    work is bounded by `max_chars`.
    """
    return _walk(parse(expr, max_chars=max_chars), max_abs)


def format_number(x: fractions.Fraction, *, decimals: int = 6) -> str:
    """Integers as digits; other values rounded to `decimals` places, trailing zeros cut."""
    if x.denominator == 1:
        return str(x.numerator)
    text = f"{float(round(x, decimals)):.{decimals}f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def calculate(expr: str, *, max_chars: int = MAX_CHARS, max_abs: int = MAX_ABS) -> str:
    """`format_number(evaluate(expr))`; raises CalcError."""
    return format_number(evaluate(expr, max_chars=max_chars, max_abs=max_abs))
