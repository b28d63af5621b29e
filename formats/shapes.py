"""Shape expressions (SPEC.md §3.1): the sizes of dynamic outputs as small integer formulas.

An expression is an int ≥ 0, a symbol name (str), or `[op, a, b]` with `op` in `SHAPE_OPS` and `a`,
`b` expressions, e.g. `["+", "seq", 1]` for `seq + 1`. The compiler writes them into
`outputs[i].shape`; the runtime evaluates them per call, from the symbol values it resolved from
the inputs, to fill the output slots' sizes (SPEC.md §5). Both sides must agree on the arithmetic,
so it lives here, in the format package, with no dependency beyond the standard library.

`check_shape_expr` is the schema rule (used by `validate_manifest`); `eval_shape_expr` and
`expr_symbols` assume an expression that passed it. `select_graph` is the bucket-selection rule
(SPEC.md §5), kept beside the arithmetic so the runtime and the tools pick the same graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .errors import ManifestError
from .limits import I64_MAX

__all__ = ["SHAPE_OPS", "MAX_EXPR_DEPTH", "check_shape_expr", "eval_shape_expr", "expr_symbols",
           "expr_magnitude", "format_shape_expr", "select_graph"]

# Python semantics: `//` is floor division and `-` may go below 0 (a caller that needs a size
# checks the result; intermediate values may be negative, as in `max(seq - 4, 0)`). Every value,
# intermediate ones included, is an int64 on the device and in the table (SPEC §3.1).
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "max": max,
    "min": min,
}
SHAPE_OPS = tuple(_OPS)
# Bounds the recursion of every walker here; real shapes nest 2-3 levels (`(a * b) // c + 1`).
MAX_EXPR_DEPTH = 16
_SATURATE = 1 << 64   # expr_magnitude's bounds stop growing here (anything above int64 is refused)
_INFIX = ("+", "-", "*", "//")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape_expr(expr, path: str, symbols: Mapping | set | None = None, _depth: int = 0) -> None:
    """Raise ManifestError (message starting with `path`) unless `expr` is a valid shape expression.

    `symbols`, when given, is the set (or map) of declared symbol names; a name outside it is an
    error. Nesting is capped at MAX_EXPR_DEPTH operators so that no walker can recurse unboundedly
    on a hostile manifest, and a divisor without symbols must not be 0 (evaluating the expression
    at load would divide by it).
    """
    if _is_int(expr):
        if expr < 0:
            raise ManifestError(f"{path}: {expr} is negative (constants in shapes are ints >= 0)")
        return
    if isinstance(expr, str):
        if symbols is not None and expr not in symbols:
            raise ManifestError(f"{path}: {expr!r} is not a declared symbol")
        return
    if not isinstance(expr, (list, tuple)):
        raise ManifestError(f"{path}: expected an int, a symbol name or [op, a, b], "
                            f"got {type(expr).__name__}")
    if len(expr) != 3:
        raise ManifestError(f"{path}: expected [op, a, b], got a list of {len(expr)}")
    op = expr[0]
    if not isinstance(op, str) or op not in _OPS:
        raise ManifestError(f"{path}[0]: unknown operator {op!r} (expected one of {' '.join(SHAPE_OPS)})")
    if _depth >= MAX_EXPR_DEPTH:
        raise ManifestError(f"{path}: shape expression nests deeper than {MAX_EXPR_DEPTH} operators")
    check_shape_expr(expr[1], f"{path}[1]", symbols, _depth + 1)
    check_shape_expr(expr[2], f"{path}[2]", symbols, _depth + 1)
    if op == "//" and not expr_symbols(expr[2]):   # a constant divisor: it must not be 0
        try:
            divisor = eval_shape_expr(expr[2], {})
        except ManifestError as e:
            raise ManifestError(f"{path}[2]: {e}") from None
        if divisor == 0:
            raise ManifestError(f"{path}: divides by {format_shape_expr(expr[2])}, which is 0")


def eval_shape_expr(expr, values: Mapping[str, int]) -> int:
    """The value of `expr` with every symbol replaced by `values[name]`.

    Raises KeyError for a symbol missing from `values`, and ManifestError for a division by zero
    or a value (intermediate ones included) outside int64: the expression cannot be evaluated at
    these values. The result may be negative (the caller decides whether that is an error for a
    size).
    """
    if _is_int(expr):
        return expr
    if isinstance(expr, str):
        return int(values[expr])
    op, a, b = expr
    x, y = eval_shape_expr(a, values), eval_shape_expr(b, values)
    if op == "//" and y == 0:
        raise ManifestError(f"shape expression {format_shape_expr(expr)!r} divides by zero at {dict(values)}")
    value = _OPS[op](x, y)
    if not -I64_MAX - 1 <= value <= I64_MAX:
        raise ManifestError(f"shape expression {format_shape_expr(expr)!r} is {value} at {dict(values)}, "
                            "outside int64")
    return value


def expr_magnitude(expr, magnitudes: Mapping[str, int]) -> tuple[int, int]:
    """(bound on |value|, bound on |any value computed inside it|, itself included) of `expr`
    when each symbol's |value| is at most `magnitudes[name]`: |a ± b| <= |a| + |b|,
    |a * b| <= |a| |b|, |a // b| <= |a| (b != 0), |max/min(a, b)| <= max(|a|, |b|). One pass over a
    checked expression, so the validator bounds what the runtime computes at any symbol values (the
    allocations, the int64 table words) without trying them."""
    if _is_int(expr):
        return abs(expr), abs(expr)
    if isinstance(expr, str):
        return magnitudes[expr], magnitudes[expr]
    op, a, b = expr
    (x, px), (y, py) = expr_magnitude(a, magnitudes), expr_magnitude(b, magnitudes)
    if op in ("+", "-"):
        top = x + y
    elif op == "*":
        top = x * y
    elif op == "//":
        top = x
    else:
        top = max(x, y)
    top = min(top, _SATURATE)   # past int64 the exact bound does not matter: keep the ints small
    return top, max(top, px, py)


def expr_symbols(expr) -> set[str]:
    """The symbol names `expr` uses (empty for a constant)."""
    if isinstance(expr, str):
        return {expr}
    if isinstance(expr, (list, tuple)) and len(expr) == 3:
        return expr_symbols(expr[1]) | expr_symbols(expr[2])
    return set()


def format_shape_expr(expr) -> str:
    """Human-readable text, e.g. `["+", ["*", "b", "s"], 1]` → `b*s + 1`; for messages and inspect.

    Infix operators nested inside another infix operator are parenthesised unless they are
    products (which bind tighter than + and -), so the text parses back to the same tree.
    """
    if not isinstance(expr, (list, tuple)) or len(expr) != 3:
        return str(expr)
    op, a, b = expr
    if op not in _INFIX:
        return f"{op}({format_shape_expr(a)}, {format_shape_expr(b)})"
    if op in ("*", "//"):
        return f"{_operand(a, left=True, tight=True)}{op}{_operand(b, left=False, tight=True)}"
    return f"{_operand(a, left=True, tight=False)} {op} {_operand(b, left=False, tight=False)}"


def _operand(expr, *, left: bool, tight: bool) -> str:
    """Format an operand of an infix operator, parenthesised when precedence requires it."""
    text = format_shape_expr(expr)
    if not isinstance(expr, (list, tuple)) or len(expr) != 3 or expr[0] not in _INFIX:
        return text
    inner_tight = expr[0] in ("*", "//")
    # a+b inside * or //, anything but a left-nested product on the right/left of a product,
    # and a right operand of - (a - (b + c)) need parentheses.
    if tight and (not inner_tight or not left):
        return f"({text})"
    if not tight and not inner_tight and not left:
        return f"({text})"
    return text


def select_graph(graphs, input_symbols, values: Mapping[str, int], arch: str | None = None) -> int | None:
    """The index of the graph that serves `values` (SPEC.md §5, runtime rule 2), or None.

    `graphs` are the manifest's graphs, `input_symbols` the names of the input-kind symbols and
    `values` their resolved values. Among the graphs whose bucket bound is ≥ the value of every
    input symbol, the one with the smallest product of its input-symbol bounds wins (the least
    padded work), the first one on ties. A package without input symbols always selects graph 0.
    `arch` (format 3.5): only the graphs of that arch's variant take part (a graph without
    `archs` serves every arch); the index is still the graph's in `graphs`.
    """
    best, best_cost = None, None
    for i, g in enumerate(graphs):
        if arch is not None and "archs" in g and arch not in g["archs"]:
            continue
        bucket = g["bucket"]
        if any(bucket[name] < values[name] for name in input_symbols):
            continue
        cost = 1
        for name in input_symbols:
            cost *= bucket[name]
        if best_cost is None or cost < best_cost:
            best, best_cost = i, cost
    return best
