"""Symbols, buckets and true extents: how one graph serves every size inside a bucket.

A dynamic dimension of the exported program is a sympy symbol (`s0`). A package holds one graph per
*bucket* — an upper bound per symbol — and each graph is lowered with every symbol at its bound, so
tile sizes, grids and arena offsets are static. Tensors live in the bucket's contiguous layout; what
a kernel must know on the device is which elements are real. That is a dimension's *extent*:

    None                                   a static dimension (every index is valid)
    ((bucket, true), (bucket, true), ...)  factors, outer to inner; `true` is a sympy expression

The index i of a dimension decomposes in mixed radix over the factors' bucket sizes and is valid
when each digit is below its factor's true size. A plain dynamic dimension has one factor
`(S_b, S)`; a view that merges `[B, S]` into `[B*S]` keeps both factors, so the valid rows of the
merged dimension need not be a prefix and are still described exactly. Views only regroup factors
(`regroup`); one that would split a dynamic factor has no bucket-layout equivalent and is refused.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


class ShapeError(ValueError):
    pass


class SymSize(int):
    """A size known at compile time only as its bucket value: the int is the bound, `expr` the
    symbolic value (used where a size becomes data: a mean's divisor, a fill value)."""

    expr: sympy.Expr

    def __new__(cls, value: int, expr):
        obj = super().__new__(cls, value)
        obj.expr = sympy.sympify(expr)
        return obj


def sym_expr(value) -> sympy.Expr | None:
    """The sympy expression of a torch SymInt / SymSize, or None for a plain int."""
    if isinstance(value, SymSize):
        return value.expr if value.expr.free_symbols else None
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return None if expr.is_number else expr
    return None


def range_bound(value) -> int | None:
    """One end of a torch.export value range as an int, or None when that end is unbounded.

    torch's ranges use its own `int_oo` / `-int_oo` (torch.utils._sympy.numbers) for "no bound",
    and those claim `is_finite`, so testing `is_finite` alone lets an infinity reach `int()`
    (sympy then fails with "'Infinity' object has no attribute '_mpf_'")."""
    value = sympy.sympify(value)
    if not value.is_Integer:   # oo, -oo, int_oo, -int_oo (and anything else not a plain integer)
        return None
    return int(value)


def is_static_size(true) -> bool:
    """A factor's true size is a plain number (not a size expression)."""
    return sympy.sympify(true).is_number


def true_size(entry, bucket: int):
    """The true size of a dimension (sympy expression or int)."""
    if entry is None:
        return bucket
    return sympy.Mul(*[t for _, t in entry])


def simple(bucket: int, expr) -> tuple | None:
    expr = sympy.sympify(expr)
    if expr.is_number:
        return None
    return ((int(bucket), expr),)


def is_prefix(entry) -> bool:
    """Valid indices form a prefix [0, true): one dynamic factor, outermost, static below it."""
    if entry is None:
        return True
    dyn = [i for i, (_, t) in enumerate(entry) if not is_static_size(t)]
    return dyn == [0] or not dyn


def factors(entry, bucket: int) -> list[tuple[int, object]]:
    if entry is None:
        return [(bucket, bucket)] if bucket != 1 else []
    return [(b, t) for b, t in entry if b != 1]


def regroup(in_shape, in_ext, out_shape) -> tuple:
    """Extents after a view from `in_shape` to `out_shape` (bucket sizes): static factors split
    and merge freely, dynamic factors move whole. Raises ShapeError when a dynamic factor would be
    split — then the bucket layout would not be the view of the true tensor."""
    if 0 in in_shape or 0 in out_shape:  # an empty tensor: no element to index, nothing dynamic
        return (None,) * len(out_shape)
    queue: list[list] = []
    for size, entry in zip(in_shape, in_ext):
        for b, t in factors(entry, size):
            if is_static_size(t) and queue and is_static_size(queue[-1][1]):
                queue[-1] = [queue[-1][0] * b, queue[-1][0] * b]   # adjacent static factors merge
            else:
                queue.append([b, t])
    out = []
    for size in out_shape:
        if size == 1:
            out.append(None)
            continue
        need, got = size, []
        while need > 1:
            if not queue:
                raise ShapeError(f"cannot view {list(in_shape)} as {list(out_shape)}")
            b, t = queue[0]
            dynamic = not is_static_size(t)
            if b <= need and need % b == 0:
                got.append((b, t))
                queue.pop(0)
                need //= b
            elif not dynamic and b % need == 0:
                got.append((need, need))        # split a static factor
                queue[0] = [b // need, b // need]
                need = 1
            elif dynamic:
                raise ShapeError(
                    f"viewing {list(in_shape)} as {list(out_shape)} would split the dynamic "
                    f"dimension of true size {t}; the bucket layout cannot express that view")
            else:
                raise ShapeError(f"cannot view {list(in_shape)} as {list(out_shape)} across a "
                                 "dynamic dimension")
        out.append(tuple(got) if any(not is_static_size(t) for _, t in got) else None)
    if any(not is_static_size(t) or b != 1 for b, t in queue):
        raise ShapeError(f"cannot view {list(in_shape)} as {list(out_shape)}")
    return tuple(out)


# ---- symbols and buckets of an exported program ----------------------------------------------
@dataclass(frozen=True)
class Symbol:
    name: str                   # the manifest name: the Dim's name, or "<input>.<dim>"
    expr: sympy.Symbol
    lo: int
    hi: int | None              # data symbols: None when only the buckets bound it
    sources: tuple              # ((input index, dim), ...); empty for a data symbol
    kind: str = "input"         # input | data (computed on the device: nonzero, .item())


def find_symbols(program, dim_names: dict | None = None) -> list[Symbol]:
    """Input symbols of an exported program, in order of first appearance among the inputs."""
    from torch.export.graph_signature import InputKind

    ranges = program.range_constraints
    found: dict = {}
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for i, spec in enumerate(specs):
        val = nodes[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            expr = sym_expr(size)
            if expr is None:
                continue
            if not isinstance(expr, sympy.Symbol):
                raise ShapeError(f"input '{spec.arg.name}' dim {d} has the derived size {expr}; "
                                 "declare each dynamic input dimension as its own Dim")
            found.setdefault(expr, []).append((i, d, spec.arg.name))
    symbols = []
    for expr, uses in found.items():
        rng = ranges.get(expr)
        lo = (range_bound(rng.lower) if rng is not None else None) or 0
        hi = range_bound(rng.upper) if rng is not None else None
        i, d, input_name = uses[0]
        name = (dim_names or {}).get((input_name, d)) or f"{input_name}.{d}"
        if hi is None:
            raise ShapeError(f"dynamic dimension {name} has no upper bound; give its Dim a max")
        symbols.append(Symbol(name, expr, lo, hi, tuple((u[0], u[1]) for u in uses)))
    return symbols


def find_data_symbols(program, inputs: list[Symbol]) -> list[Symbol]:
    """Unbacked symbols (torch.export's `u0`, ...): sizes that kernels compute on the device."""
    known = {s.expr for s in inputs}
    out = []
    def natural(item):   # u2 before u10
        name = str(item[0])
        return (name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):] or 0))

    for expr, rng in sorted(program.range_constraints.items(), key=natural):
        if expr in known or not isinstance(expr, sympy.Symbol):
            continue
        if not free_unbacked_symbols(expr):
            # a backed symbol that sizes no input (decompositions can leave one behind, e.g.
            # max_unpool's): nothing computes it and nothing reads it
            continue
        lo = max(range_bound(rng.lower) or 0, 0)
        hi = range_bound(rng.upper)
        out.append(Symbol(str(expr), expr, lo, hi, (), "data"))
    return out


def default_buckets(lo: int, hi: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` covering [lo, hi], the last one being hi itself; sizes below
    `smallest` share the first bucket, except that a range from 1 also gets a bucket of 1.

    Size 1 is what a decode step and a single request send, and it runs other code (a one-row
    GEMM is a GEMV, codegen._gemv; attention has one query); a bucket of 1 for a range from 1
    holds one size only, so it is lowered as a static program (Lowering.pinned). Nothing between 1
    and 16: GEMM row tiles are at least 16 rows (codegen.GEMM_MIN_BM), so sizes 2..16 run the
    same tiles, and every bucket is a graph to lower, build and store; dynamic dimensions
    multiply (batch 1..8 x seq 1..512: 2 x 7 = 14 graphs, 4 x 10 = 40 with every power of two
    from 1). A range from 0 gets no bucket of 1 (bucket_lists says why)."""
    out, b = [], max(smallest, 1)
    while b < hi:
        if b >= lo:
            out.append(b)
        b *= 2
    out.append(hi)
    if lo == 1:
        out.append(1)
    return sorted(set(out))


def bucket_lists(symbols: list[Symbol], overrides: dict | None) -> dict[str, list[int]]:
    overrides = dict(overrides or {})
    names = {s.name for s in symbols}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ShapeError(f"--buckets names {', '.join(unknown)}, but the program's dynamic "
                         f"dimensions are: {', '.join(sorted(names)) or 'none'}")
    out = {}
    for s in symbols:
        if s.kind != "input":
            continue
        if s.name in overrides:
            values = sorted(set(int(v) for v in overrides[s.name]))
            if not values or values[0] < 1:
                raise ShapeError(f"buckets of {s.name} must be positive")
            if values[0] == 1 and s.lo == 0:
                # at bound 1 a dimension is lowered as size 1 (views treat it as broadcastable),
                # so a size-0 call would be computed as size 1
                raise ShapeError(f"a bucket of 1 for {s.name}, whose range starts at 0, would also "
                                 "serve size 0, which a graph at bound 1 computes as size 1; start "
                                 f"its buckets at 2, or export {s.name} with min=1")
            if values[-1] < s.hi:
                raise ShapeError(f"the largest bucket of {s.name} ({values[-1]}) is below the "
                                 f"exported maximum {s.hi}; add a bucket of at least {s.hi}")
            # a bound below the range's minimum could never be selected
            values = [v for v in values if s.lo <= v < s.hi] + [s.hi]
            out[s.name] = values
        else:
            out[s.name] = default_buckets(s.lo, s.hi)
    return out


def combinations(symbols: list[Symbol], lists: dict[str, list[int]]) -> list[dict]:
    """One bucket per combination: {symbol name: bound}."""
    names = [s.name for s in symbols if s.kind == "input"]
    return [dict(zip(names, values))
            for values in itertools.product(*[lists[n] for n in names])] or [{}]


def evaluate(expr, values: dict) -> int:
    """An expression at concrete symbol values (the bucket bounds during lowering)."""
    if isinstance(expr, int):
        return expr
    return int(sympy.sympify(expr).subs(values))


# ---- manifest shape expressions --------------------------------------------------------------
def to_manifest(expr, names: dict) -> object:
    """sympy → the manifest's shape expression: int | symbol name | [op, a, b]."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return names[expr]
    if isinstance(expr, sympy.floor) and isinstance(expr.args[0], sympy.Mul):
        num, den = expr.args[0].as_numer_denom()
        return ["//", to_manifest(num, names), to_manifest(den, names)]
    if type(expr).__name__ == "FloorDiv":
        return ["//", to_manifest(expr.args[0], names), to_manifest(expr.args[1], names)]
    if isinstance(expr, sympy.Add):
        # positive terms first, constants last: s0 - 1 -> ["-", "s0", 1] (no negative literals)
        args = sorted(expr.args, key=lambda a: (a.could_extract_minus_sign(), a.is_Number))
        acc = to_manifest(args[0], names)
        for a in args[1:]:
            acc = (["-", acc, to_manifest(-a, names)] if a.could_extract_minus_sign()
                   else ["+", acc, to_manifest(a, names)])
        return acc
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and 0 < int(expr.exp) <= 8:
        base = to_manifest(expr.base, names)
        acc = base
        for _ in range(int(expr.exp) - 1):
            acc = ["*", acc, base]
        return acc
    ops = {sympy.Mul: "*", sympy.Max: "max", sympy.Min: "min"}
    for cls, op in ops.items():
        if isinstance(expr, cls):
            args = list(expr.args)
            acc = to_manifest(args[0], names)
            for a in args[1:]:
                acc = [op, acc, to_manifest(a, names)]
            return acc
    raise ShapeError(f"the size {expr} cannot be written in the package's shape expressions")


def padding_cost(symbol: Symbol, bounds: list[int]) -> float:
    """Expected padded fraction of work over a uniform size distribution in the symbol's range:
    the cost model behind the default buckets, reported by `grace inspect`."""
    lo = max(symbol.lo, 1)
    total = padded = 0
    prev = 0
    for b in bounds:
        for n in range(max(lo, prev + 1), b + 1):
            total += n
            padded += b - n
        prev = b
    return padded / max(total, 1)

