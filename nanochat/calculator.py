"""Safe arithmetic for the engine's calculator tool.

The model writes `<|python_start|> expr <|python_end|>`; the engine hands `expr` to
`use_calculator`, which evaluates it WITHOUT `eval`: the text is parsed with `ast` and only a small
whitelist of node types is interpreted by hand:

- int / float literals, `+ - * / // % **`, unary `+ -`, parentheses;
- `"literal".count("literal")` (the form nanochat's spelling task teaches), string literals only.

Everything else (names, attribute access other than `.count` on a literal, calls, subscripts,
comprehensions, lambdas, ...) is rejected. Sizes are bounded so no input can hang the process:
the expression length, the number of AST nodes, exponent sizes and the magnitude of every
intermediate integer are checked *before* the operation runs.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
import threading
import warnings
from decimal import Decimal

MAX_EXPR_CHARS = 300        # the model's tool calls are short; longer text is not arithmetic
MAX_NODES = 100             # bounds the work of the tree walk
MAX_INT_BITS = 1024         # ~308 decimal digits; every intermediate int is checked
MAX_STRING_CHARS = 200      # literals handed to .count()


def _div(a, b):
    """`a / b`, an exact int when both are ints and b divides a: Python's true division rounds every
    quotient to a double, so 2**60 / 2 lost its last digits (and anything past 2**53 could); where
    the quotient is not whole, or a side is a float, the float quotient as before."""
    if type(a) is int and type(b) is int and b and a % b == 0:
        return a // b
    return a / b


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# "1,234,567" -> "1234567" (a thousands separator, not a tuple); only outside string literals. A
# grouped number is a whole run of digits: 1-3 digits that follow no digit, letter or point, then
# groups of exactly 3. A comma after any digit went before: "1.5,000" read as 1.5 and "12345,678"
# as 12345678, answers to something nobody wrote; those stay tuples now, and tuples are refused.
_GROUPED = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d_])")
# What the parser can warn about: a number run into a name or keyword ("2if"), an escape in a string.
# Only such text is parsed with the warnings off: catch_warnings swaps the process-wide filters, which
# the server's worker threads share, so the plain arithmetic of nearly every call leaves them alone,
# and the lock keeps two guarded parses from restoring each other's filters.
_MAY_WARN = re.compile(r"\d[^\W\d]|\\")
_PARSE_LOCK = threading.Lock()


class CalculatorError(ValueError):
    """The expression is not allowed, malformed, or too large to evaluate."""


def _check_number(value):
    """Reject results that are too big to keep computing with (or not finite)."""
    if isinstance(value, bool):  # True/False only arise from bugs; keep numbers numeric
        raise CalculatorError("booleans are not supported")
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise CalculatorError(f"integer result exceeds {MAX_INT_BITS} bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("result is not finite")
    else:
        raise CalculatorError(f"unsupported value type {type(value).__name__}")
    return value


def _pow(base, exp):
    """`base ** exp` with the cost bounded before computing it."""
    if isinstance(exp, int) and isinstance(base, int) and exp >= 0:
        # the result has about bit_length(base) * exp bits: refuse before computing it
        if abs(base) > 1 and (abs(base).bit_length() - 1) * exp > MAX_INT_BITS:
            raise CalculatorError(f"integer result exceeds {MAX_INT_BITS} bits")
        return base ** exp
    try:  # float(base) itself overflows for ints near MAX_INT_BITS, e.g. (2**1023 * 2 - 1) ** -1
        result = float(base) ** float(exp)
    except OverflowError as e:
        raise CalculatorError("result is not finite") from e
    except ZeroDivisionError as e:
        raise CalculatorError("division by zero") from e
    if isinstance(result, complex):
        raise CalculatorError("complex results are not supported")
    return result


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _check_number(node.value)
        raise CalculatorError(f"literal {node.value!r} is not a number")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        return _check_number(_UNARYOPS[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_number(_pow(left, right))
        try:
            return _check_number(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
        except OverflowError as e:
            raise CalculatorError("result is not finite") from e
    if isinstance(node, ast.Call):
        return _eval_count(node)
    raise CalculatorError(f"{type(node).__name__} is not allowed")


def _string_literal(node: ast.AST) -> str:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        raise CalculatorError("only string literals may be used with .count()")
    if len(node.value) > MAX_STRING_CHARS:
        raise CalculatorError(f"string literal longer than {MAX_STRING_CHARS} characters")
    return node.value


def _eval_count(node: ast.Call) -> int:
    """`"strawberry".count("r")`: both sides literals, one positional argument."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "count"):
        raise CalculatorError("only the \"text\".count(\"x\") call is allowed")
    if node.keywords or len(node.args) != 1:
        raise CalculatorError(".count() takes exactly one string argument")
    haystack, needle = _string_literal(func.value), _string_literal(node.args[0])
    return haystack.count(needle)


def _parse(expr: str) -> ast.Expression:
    """ast.parse with the parser's own warnings silenced. A number run into a keyword ("2if", "5and 3",
    "0x1for") is a SyntaxWarning, which Python wrote to stderr for every such call, "<unknown>:1:
    SyntaxWarning: invalid decimal literal" in the middle of chat_cli's streamed answer (and in the
    server's log); from Python 3.12 an invalid escape in a .count() string ("a\\d") warns so too. The
    call is refused or evaluated as before: only the warning goes."""
    if not _MAY_WARN.search(expr):
        return ast.parse(expr, mode="eval")
    with _PARSE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(expr, mode="eval")


def evaluate(expr: str) -> int | float:
    """Evaluate a whitelisted arithmetic / `.count` expression; CalculatorError otherwise."""
    if not isinstance(expr, str):
        raise CalculatorError(f"expression must be str, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS} characters")
    if "'" not in expr and '"' not in expr:
        expr = _GROUPED.sub(lambda m: m.group().replace(",", ""), expr)
    try:
        tree = _parse(expr)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"cannot parse expression: {type(e).__name__}") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} syntax nodes")
    return _eval(tree)


def format_result(value: int | float) -> str:
    """How a result is written back into the token stream. An int (and a quotient of ints that
    divides, see _div) exactly, every digit. A whole float as an integer below 1e16 (6/2.0 -> "3",
    like a person would write it): it is exact there (every integer to 2**53 is a double, and a whole
    double below 1e16 has no more digits than repr shows), where 15 significant digits wrote
    1e15 + 1 as "1e+15". Larger floats (and any past 1e15 with a fraction) in repr's shortest
    form that reads back as the same double ("1.152921504606847e+18", "1e+20"), not 15 digits that
    do not; so are subnormals ("1e-320"). Other floats with 15 significant digits, which hides binary noise (0.1 + 0.2 -> "0.3")."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        if abs(value) >= 1e15 or 0 < abs(value) < sys.float_info.min:
            # (a subnormal holds fewer than 15 significant digits: .15g wrote 1e-320 as
            # 9.99988867182683e-321, digits of rounding noise; repr's shortest form is exact)
            return repr(value)
        # 15 significant digits: every decimal a double holds exactly enough to print back (0.1 + 0.2
        # shows as 0.3, not 0.30000000000000004), where 12 wrote 100000000000.5 + 1 as 100000000002
        text = format(value, ".15g")
        if "e-" in text and abs(value) >= 1e-9:
            # .15g switches to exponent form below 1e-4 ("3e-05"); a model trained on worked
            # arithmetic reads and copies positional decimals, so write 0.00003 down to 1e-9
            text = format(Decimal(text), "f")
        return text
    return str(value)


def use_calculator(expr: str) -> str | None:
    """The result as text, or None when the expression is refused (what training data and the
    chat API's history check compare against; the engine forces `tool_output`)."""
    try:
        return format_result(evaluate(expr))
    except CalculatorError:
        return None


# What the engine forces as a refused call's output: the call then reads "<<2^3=error>>" in the chat
# and the API, not "<<2^3=>>" (an empty result that looked like a display glitch), and the model
# sees that no number came back. One short word: forced tokens count toward max_tokens.
REFUSED_OUTPUT = "error"


def tool_output(expr: str) -> str:
    """The tool's output for a call: use_calculator's result, or REFUSED_OUTPUT for a refused one."""
    result = use_calculator(expr)
    return REFUSED_OUTPUT if result is None else result
