"""A calculator tool: arithmetic on numbers, parsed with `ast` and evaluated node by node (no
`eval`): + - * / // % ** and unary minus, parentheses, and a few functions of `math`. Exponents
and results are bounded so that no expression can take unbounded time or memory."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPONENT = 1000  # |b| in a ** b; 10 ** 1000 is a 3322-bit integer, computed at once
MAX_DIGITS = 4300  # Python's own limit on int -> str conversion
MAX_LENGTH = 2000  # characters of an expression
BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "floor": math.floor,
    "ceil": math.ceil,
}
CONSTANTS = {"pi": math.pi, "e": math.e}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression, e.g. "2 * (3 + 4) ** 2" -> 98."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg})") from None
    try:
        return _value(tree.body)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        if isinstance(e, CalculatorError):
            raise
        raise CalculatorError(f"{type(e).__name__}: {e}") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        out = BINARY[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        if node.keywords:
            raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
        return FUNCTIONS[node.func.id](*(_value(a) for a in node.args))
    what = ast.unparse(node) if hasattr(ast, "unparse") else type(node).__name__
    raise CalculatorError(f"unsupported expression: {what}")
