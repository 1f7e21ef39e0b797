"""A calculator that cannot be turned into anything else: arithmetic over a parsed tree, no eval.

The expression is parsed with ``ast`` and walked by hand. Only numbers, ``+ - * / // % **``,
unary signs, parentheses, a few functions (``sqrt log sin cos abs round min max``) and the
constants ``pi`` and ``e`` are understood; any other node (a name, an attribute, a call of
anything else, a subscript, a string, a lambda, a comprehension) is refused by name. Nothing
can loop, and what could be slow is bounded before it is computed: the input's length, the
tree's size, the exponent (|n| <= 1000) and the size of every integer result (so
``9**9**9**9`` is refused after one small power, in microseconds). ``^`` means power and
``×``/``÷`` are read as ``*``/``/``, as people write them.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from collections.abc import Callable
from typing import Any, Final

from pipeline.tools.base import Tool, ToolContext, ToolError

MAX_CHARS: Final = 500
MAX_NODES: Final = 256
MAX_EXPONENT: Final = 1000
MAX_INT_BITS: Final = 3300  # about 1000 decimal digits
MAX_ROUND_DIGITS: Final = 100
MAX_FUNCTION_ARGS: Final = 100

Number = int | float

# Digits, letters (function names, constants, exponents), operators, parentheses, commas.
_ALLOWED_CHARS: Final = re.compile(r"[0-9A-Za-z_+\-*/%()., \t\n]*")

CONSTANTS: Final[dict[str, float]] = {"pi": math.pi, "e": math.e}

_REFUSED: Final = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Lambda: "lambdas",
    ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators",
    ast.IfExp: "conditional expressions",
    ast.NamedExpr: "assignments",
    ast.Starred: "starred arguments",
    ast.JoinedStr: "strings",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dictionaries",
    ast.Set: "sets",
    ast.Await: "await",
}


class CalculatorError(ToolError):
    """The expression is refused or has no finite real value; the message says why."""


def _bits(value: Number) -> int:
    return value.bit_length() if isinstance(value, int) else 0


def _check_int(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("the result is too large (more than about 1000 digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large" if math.isinf(value) else "not a number")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent is too large (at most {MAX_EXPONENT} in size)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        # Checked before computing: the result has about bits(base) * exponent bits.
        if (_bits(base) - 1) * exponent > MAX_INT_BITS:
            raise CalculatorError("the result is too large (more than about 1000 digits)")
        return int(base**exponent)
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    return math.pow(base, exponent)  # floats: OverflowError or ValueError, never complex


def _multiply(left: Number, right: Number) -> Number:
    if (
        isinstance(left, int)
        and isinstance(right, int)
        and _bits(left) + _bits(right) > (MAX_INT_BITS + 1)
    ):
        raise CalculatorError("the result is too large (more than about 1000 digits)")
    return left * right


_BINARY: Final[dict[type[ast.operator], Callable[[Any, Any], Number]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _multiply,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}


def _round(value: Number, digits: Number = 0) -> Number:
    if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round() takes a whole number of digits up to {MAX_ROUND_DIGITS}")
    return round(value, digits) if digits else round(value)


def _log(value: Number, base: Number | None = None) -> Number:
    return math.log(value) if base is None else math.log(value, base)


# name -> (function, fewest arguments, most arguments)
FUNCTIONS: Final[dict[str, tuple[Callable[..., Number], int, int]]] = {
    "sqrt": (math.sqrt, 1, 1),
    "log": (_log, 1, 2),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, MAX_FUNCTION_ARGS),
    "max": (max, 1, MAX_FUNCTION_ARGS),
}


def normalise(expression: str) -> str:
    """The expression in Python's operators: ``^`` is power, ``×`` and ``÷`` multiply, divide."""
    return expression.replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")


def parse(expression: str) -> ast.expr:
    """The checked tree of ``expression``; refuses what is too long, too big or not arithmetic."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is too long (at most {MAX_CHARS} characters)")
    text = normalise(expression).strip()
    if not text:
        raise CalculatorError("the expression is empty")
    readable = _ALLOWED_CHARS.match(text)
    if readable is not None and readable.end() < len(text):
        shown = text[readable.end()]
        raise CalculatorError(f"only arithmetic is allowed, not the character {shown!r}")
    try:
        with warnings.catch_warnings():
            # Some odd inputs make the parser warn; under warnings-as-errors that is no answer.
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression that can be read") from None
    for count, node in enumerate(ast.walk(tree.body), start=1):
        if count > MAX_NODES:
            raise CalculatorError(f"the expression is too complex (at most {MAX_NODES} parts)")
        refused = _REFUSED.get(type(node))
        if refused is not None:
            raise CalculatorError(f"only arithmetic is allowed, not {refused}")
    return tree.body


def _evaluate(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError("only numbers are allowed (no strings, complex numbers or None)")
        return _check_int(value)
    if isinstance(node, ast.BinOp):
        function = _BINARY.get(type(node.op))
        if function is None:
            raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed")
        return _check_int(function(_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name '{node.id}' (only the constants pi and e)")
    if isinstance(node, ast.Call):
        return _check_int(_call(node))
    raise CalculatorError(f"only arithmetic is allowed, not {type(node).__name__}")


def _call(node: ast.Call) -> Number:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name not in FUNCTIONS or node.keywords:
        allowed = ", ".join(FUNCTIONS)
        raise CalculatorError(f"only these functions may be called: {allowed}")
    function, fewest, most = FUNCTIONS[name]
    if not fewest <= len(node.args) <= most:
        raise CalculatorError(f"{name}() takes {fewest} to {most} arguments")
    return function(*(_evaluate(arg) for arg in node.args))


def calculate(expression: str) -> Number:
    """The value of ``expression``, or ``CalculatorError`` saying why there is none."""
    tree = parse(expression)
    try:
        return _evaluate(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None
    except ValueError as exc:  # math domain errors: sqrt(-1), log(0)
        raise CalculatorError(f"no real result ({exc})") from None
    except TypeError:
        raise CalculatorError("not an arithmetic expression that can be computed") from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


async def _run(arguments: dict[str, Any], context: ToolContext) -> str:
    expression = str(arguments["expression"])
    return f"{expression.strip()} = {format_number(calculate(expression))}"


def calculator_tool(*, timeout_s: float = 1.0, max_concurrency: int = 64) -> Tool:
    return Tool(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** (or ^), "
            "parentheses, sqrt, log, sin, cos, abs, round, min, max, pi, e."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression, e.g. (3 + 4) ** 2 / 7",
                    "maxLength": MAX_CHARS,
                    # Only what an expression can hold: under structured output (a forced
                    # call) this keeps the small model from writing prose into the argument.
                    "pattern": "[-0-9a-z+*/().,%^ ]+",
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        function=_run,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
    )
