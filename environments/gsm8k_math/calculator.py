"""A calculator for model-written arithmetic, evaluated by walking the syntax tree.

The expression comes from a sampled model, so it is treated as hostile: it is parsed (never run) and only
numbers, arithmetic operators, parentheses and a handful of named math functions are evaluated. Everything
else (names, attributes, other calls, strings, subscripts, comprehensions, lambdas) is refused with a
message the model can act on, and limits on length, exponents and magnitudes keep one call from eating
the CPU or memory that thousands of concurrent rollouts share.
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["CalculatorError", "evaluate", "calculate", "format_number", "FUNCTIONS",
           "MAX_EXPRESSION_CHARS", "MAX_EXPONENT", "MAX_MAGNITUDE"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # |exponent| of a power
MAX_MAGNITUDE = 1e30  # |value| of any constant, intermediate or result
MAX_POWER_DIGITS = 30  # a power's estimated size in decimal digits, checked before computing it


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is meant for the model."""


def _round(x, ndigits=0):
    if not isinstance(ndigits, int) or not 0 <= ndigits <= 12:
        raise CalculatorError("round() takes a whole number of digits between 0 and 12")
    return round(x, ndigits) if ndigits else round(x)


def _sqrt(x):
    if x < 0:
        raise CalculatorError("sqrt() of a negative number")
    return math.sqrt(x)


# name → (function, smallest and largest number of arguments)
FUNCTIONS = {
    "sqrt": (_sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 2, 20),
    "max": (max, 2, 20),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

# What each refused node is, in words, so the refusal says what to change.
_REFUSED = {
    ast.Name: "names", ast.Attribute: "attributes", ast.Subscript: "subscripts", ast.Lambda: "lambdas",
    ast.ListComp: "comprehensions", ast.SetComp: "comprehensions", ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions", ast.List: "lists", ast.Dict: "dicts",
    ast.Tuple: "commas between numbers (write 1234, not 1,234)",
    ast.Set: "sets", ast.Compare: "comparisons", ast.BoolOp: "boolean logic", ast.IfExp: "conditionals",
    ast.JoinedStr: "strings", ast.NamedExpr: "assignments", ast.Starred: "starred arguments",
}


def _check(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds the limit of {MAX_MAGNITUDE:g} in magnitude")
    return value


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are limited to {MAX_EXPONENT} in magnitude")
    if base != 0 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_POWER_DIGITS:
        raise CalculatorError(f"a value exceeds the limit of {MAX_MAGNITUDE:g} in magnitude")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass; True + 1 is not arithmetic anyone meant.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "strings" if isinstance(value, (str, bytes)) else f"{type(value).__name__} values"
            raise CalculatorError(f"{kind} are not allowed; use numbers only")
        return _check(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed; use + - * / // % **")
    what = _REFUSED.get(type(node), f"{type(node).__name__} expressions")
    raise CalculatorError(f"{what} are not allowed; use numbers, + - * / // % ** and parentheses")


def _call(node: ast.Call):
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
        shown = node.func.id if isinstance(node.func, ast.Name) else "that"
        raise CalculatorError(f"calling {shown!s} is not allowed; the functions are {', '.join(FUNCTIONS)}")
    name = node.func.id
    fn, low, high = FUNCTIONS[name]
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise CalculatorError(f"{name}() takes plain positional arguments only")
    if not low <= len(node.args) <= high:
        raise CalculatorError(f"{name}() takes {low}" + (f" to {high}" if high != low else "") + " argument(s)")
    args = [_eval(a) for a in node.args]
    if name == "round" and len(args) == 2 and isinstance(args[1], float) and args[1].is_integer():
        args[1] = int(args[1])
    return _check(fn(*args))


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises CalculatorError for anything else.

    "^" is read as a power, since that is what it means in the arithmetic models write.
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError("invalid syntax; write arithmetic such as (3 + 4) * 2") from None
    except (ValueError, RecursionError, MemoryError):  # e.g. null bytes, absurd nesting
        raise CalculatorError("the expression cannot be parsed") from None
    try:
        return _eval(tree.body)
    except CalculatorError:
        raise
    except (OverflowError, RecursionError):
        raise CalculatorError("the computation is too large") from None
    except (ArithmeticError, ValueError, TypeError) as e:
        raise CalculatorError(str(e) or type(e).__name__) from None


def format_number(value: int | float) -> str:
    """Whole numbers without a decimal point, others to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def calculate(expression: str) -> str:
    """The expression's value as text, or "Error: …" saying why it was refused."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"
