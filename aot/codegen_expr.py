"""Expression → Triton code, evaluated at a block of indices.

A kernel template owns the index variables (a flat block for pointwise kernels, row/column blocks
for reductions, M×K / K×N tiles for GEMMs) and asks `ExprEmitter.value(expr, ctx)` for a variable
holding `expr` at those indices. Index arithmetic for a dimension is emitted only when some load
needs it, and a load whose strides match the context's contiguous layout uses the flat index
directly, so the common case compiles to `tl.load(p + offs)`.
"""
from __future__ import annotations

import contextlib
import math

import sympy

from .ir import (EXTENTS, Acc, Cat, Const, Expr, Index, Load, Op, Reindex, Reshape, SymValue,
                 compute_dtype, contiguous_strides, is_contiguous, numel)
from .shapes import is_static_size

TL_TYPE = {
    "float64": "tl.float64", "float32": "tl.float32", "float16": "tl.float16",
    "bfloat16": "tl.bfloat16", "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16",
    "int8": "tl.int8", "uint8": "tl.uint8", "bool": "tl.int1",
}
PTR_TYPE = {
    "float64": "*fp64", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16",
    "int64": "*i64", "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1",
}


class NotBeforeWait(Exception):
    """Code meant to run before the kernel's gdc_wait() touched something other than weights."""


class Writer:
    """Lines of one kernel body plus its pointer parameters (one per distinct buffer).

    `symbols` maps each size symbol to its word in the extents table; sizes the kernel needs at
    run time are loaded once, in the prologue.

    With programmatic dependent launch (docs/design-pdl.md) a kernel may run while the nodes before
    it still do, until its gdc_wait(): `prefetch` tells a template it may emit code for that
    stretch, inside `with w.before_wait():`. There only index math and loads of weights are allowed;
    anything else (an I/O pointer or size from the table, the arena, state, extents) raises
    NotBeforeWait, and the kernel is generated again without the stretch."""

    def __init__(self, symbols: dict | None = None, prefetch: bool = False):
        self.prefetch = prefetch
        self.pre_wait: list[str] = []
        self._before_wait = False
        self.lines: list[str] = []
        self.indent = 1
        self.params: list = []          # Buffers, in parameter order
        self._ptr: dict[int, str] = {}
        self.prologue: list[str] = []
        self._n = 0
        self.symbols = symbols or {}
        self._sizes: dict = {}

    def var(self, prefix="t") -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def emit(self, line: str):
        (self.pre_wait if self._before_wait else self.lines).append("    " * self.indent + line)

    @contextlib.contextmanager
    def before_wait(self):
        assert self.prefetch and not self._before_wait
        self._before_wait = True
        try:
            yield
        finally:
            self._before_wait = False

    def ptr(self, buf) -> str:
        """The typed pointer variable of a buffer; I/O buffers are read from their table slot."""
        if self._before_wait and buf.kind != "weight":
            raise NotBeforeWait(f"{buf.kind} buffer {buf.name} before gdc_wait()")
        key = id(buf)
        if key not in self._ptr:
            name = f"p{len(self.params)}"
            self.params.append(buf)
            if buf.kind in ("input", "output"):
                self.prologue.append(
                    f"{name} = tl.load({name}_slot).to(tl.pointer_type({TL_TYPE[buf.dtype]}))")
                self.prologue.append(f"{name} = tl.multiple_of({name}, 16)")
            self._ptr[key] = name
        return self._ptr[key]

    def param_names(self) -> list[str]:
        return [f"p{i}_slot" if b.kind in ("input", "output") else f"p{i}"
                for i, b in enumerate(self.params)]

    def param_types(self) -> list[str]:
        return ["*i64" if b.kind in ("input", "output", "extents") else PTR_TYPE[b.dtype]
                for b in self.params]

    # -- run-time sizes -------------------------------------------------------------------------
    def _prologue_value(self, key, code: str, prefix: str) -> str:
        if self._before_wait:   # prologue values come from the table
            raise NotBeforeWait(f"{code} before gdc_wait()")
        if key not in self._sizes:
            name = f"{prefix}{len(self._sizes)}"
            self.prologue.append(f"{name} = {code}")
            self._sizes[key] = name
        return self._sizes[key]

    def extent(self, expr) -> str:
        """Code for a size expression over the symbols, from the extents table."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return str(int(expr))
        if expr.is_Symbol:
            if expr not in self.symbols:
                raise ValueError(f"size symbol {expr} has no word in the extents table")
            self.ptr(EXTENTS)
            ext = self._ptr[id(EXTENTS)]
            return self._prologue_value(expr, f"tl.load({ext} + {self.symbols[expr]})", "sz")
        args = [self.extent(a) for a in expr.args]
        if isinstance(expr, sympy.Add):
            code = " + ".join(args)
        elif isinstance(expr, sympy.Mul):
            code = " * ".join(args)
        elif isinstance(expr, (sympy.Max, sympy.Min)):
            fn = "tl.maximum" if isinstance(expr, sympy.Max) else "tl.minimum"
            code = args[0]
            for a in args[1:]:
                code = f"{fn}({code}, {a})"
        elif type(expr).__name__ == "FloorDiv":
            code = f"{args[0]} // {args[1]}"
        elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer and 0 < int(expr.exp) <= 8:
            code = " * ".join([args[0]] * int(expr.exp))
        else:
            raise ValueError(f"cannot evaluate the size {expr} in a kernel")
        return self._prologue_value(expr, f"({code})", "sz")

    def slot_word(self, buf, word: int) -> str:
        """Word `word` of an I/O buffer's table slot: 1 + d is size d, 1 + rank + d stride d."""
        self.ptr(buf)
        return self._prologue_value((id(buf), word), f"tl.load({self._ptr[id(buf)]}_slot + {word})",
                                    "io")

    def user_address(self, buf, dims) -> tuple[str, list[str]]:
        """Element offset and bounds terms for a user tensor with dynamic dimensions, at the index
        variables `dims` (one per dimension). The runtime passes C-contiguous tensors, so strides
        below the innermost dynamic dimension are constants (which keeps vector loads); the others
        and the sizes come from the table slot."""
        rank = len(buf.shape)
        last_dynamic = max(d for d in range(rank) if buf.dynamic[d])
        terms, bounds = [], []
        for d in range(rank):
            if buf.shape[d] == 1 and not buf.dynamic[d]:
                continue
            if d > last_dynamic:
                stride = str(math.prod(buf.shape[d + 1:]))
            else:
                stride = self.slot_word(buf, 1 + rank + d)
            terms.append(dims[d] if stride == "1" else f"{dims[d]} * {stride}")
            if buf.dynamic[d]:
                bounds.append(f"({dims[d]} < {self.slot_word(buf, 1 + d)})")
        return (" + ".join(terms) or "0"), bounds


class Ctx:
    """An index space: per dimension a way to get the index variable, a mask, and optionally the
    flat (contiguous) index over `shape`."""

    def __init__(self, w: Writer, shape, dims=None, linear=None, mask="None", zero="0",
                 parent=None):
        self.w, self.shape, self.mask, self.zero = w, tuple(shape), mask, zero
        self.linear = linear
        self._dims = dict(enumerate(dims)) if dims is not None else {}
        self.memo: dict[int, str] = {}
        self.children: dict = {}

    def valid(self, ext) -> str | None:
        """The condition that this context's index is a real element, given the extents of its
        dimensions (shapes.py), or None when every element is."""
        if ext is None:
            return None
        terms = []
        for d, entry in enumerate(ext):
            if entry is not None and self.shape[d] != 1:
                terms.extend(factor_terms(self.w, entry, self.dim(d)))
        return " & ".join(terms) if terms else None

    def dim(self, d: int) -> str:
        if d not in self._dims:
            if self.shape[d] == 1:
                self._dims[d] = "0"
            else:
                cs = contiguous_strides(self.shape)[d]
                v = self.w.var("i")
                expr = self.linear if cs == 1 else f"({self.linear} // {cs})"
                if d > 0:
                    expr = f"({expr} % {self.shape[d]})"
                self.w.emit(f"{v} = {expr}")
                self._dims[d] = v
        return self._dims[d]


def factor_terms(w: Writer, entry, idx: str) -> list[str]:
    """Conditions for index `idx` of a dimension with extent factors `entry` (outer to inner):
    each factor's digit is below its true size."""
    terms = []
    for j, (bucket, true) in enumerate(entry):
        if is_static_size(true):
            continue
        inner = math.prod(b for b, _ in entry[j + 1:])
        digit = idx if inner == 1 else f"({idx} // {inner})"
        if j > 0:
            digit = f"({digit} % {bucket})"
        terms.append(f"({digit} < {w.extent(true)})")
    return terms


def and_mask(w: Writer, name: str, mask: str, extra: str | None) -> str:
    """`mask` AND `extra`, bound to a new variable (either may be absent: "None" / None)."""
    if not extra:
        return mask
    v = w.var(name)
    w.emit(f"{v} = {extra}" if mask == "None" else f"{v} = ({mask}) & {extra}")
    return v


def _literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "1" if value else "0"
    if dtype.startswith("int") or dtype == "uint8":
        return str(int(value))
    f = float(value)
    if f != f:
        return 'float("nan")'
    if f in (float("inf"), float("-inf")):
        return 'float("inf")' if f > 0 else '-float("inf")'
    return repr(f)


SAME_TYPE_OPS = {"add", "sub", "mul", "div", "maximum", "minimum", "neg", "remainder", "fmod",
                 "floordiv"}
FLOAT_OPS = {"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "sin", "cos", "log1p",
             "expm1", "gelu", "silu", "reciprocal", "pow"}


class ExprEmitter:
    def __init__(self, w: Writer, acc: str | None = None):
        self.w = w
        self.acc = acc

    # -- public -----------------------------------------------------------------------------
    def value(self, expr: Expr, ctx: Ctx) -> str:
        key = id(expr)
        if key not in ctx.memo:
            ctx.memo[key] = self._emit(expr, ctx)
        return ctx.memo[key]

    # -- nodes ------------------------------------------------------------------------------
    def _emit(self, e: Expr, ctx: Ctx) -> str:
        w = self.w
        if isinstance(e, Acc):
            return self.acc
        if isinstance(e, Const):
            v = w.var()
            w.emit(f"{v} = tl.full([], {_literal(e.value, e.dtype)}, "
                   f"{TL_TYPE[compute_dtype(e.dtype)]})")
            return v
        if isinstance(e, Index):
            v = w.var()
            w.emit(f"{v} = ({ctx.dim(e.dim)} + {ctx.zero}).to(tl.int64)")
            return v
        if isinstance(e, Load):
            return self._load(e, ctx) if not e.buf.dynamic else self._load_user(e, ctx)
        if isinstance(e, SymValue):
            return w.extent(e.expr)
        if isinstance(e, Op):
            return self._op(e, ctx)
        if isinstance(e, Reindex):
            return self._reindex(e, ctx)
        if isinstance(e, Reshape):
            return self._reshape(e, ctx)
        if isinstance(e, Cat):
            return self._cat(e, ctx)
        raise TypeError(f"cannot generate code for {type(e).__name__}")

    def _load(self, e: Load, ctx: Ctx) -> str:
        w = self.w
        ptr = w.ptr(e.buf)
        big = numel(e.buf.shape) >= 2**31
        if (ctx.linear is not None and not big
                and is_contiguous(e.strides, ctx.shape)):
            addr = ctx.linear if e.offset == 0 else f"{ctx.linear} + {e.offset}"
        else:
            terms = [str(e.offset)] if e.offset else []
            for d, stride in enumerate(e.strides):
                if stride == 0 or ctx.shape[d] == 1:
                    continue
                idx = ctx.dim(d)
                if big:
                    idx = f"{idx}.to(tl.int64)"
                terms.append(idx if stride == 1 else f"{idx} * {stride}")
            addr = " + ".join(terms) if terms else "0"
            addr = f"{addr} + {ctx.zero}"
        v = w.var("x")
        cdt = compute_dtype(e.dtype)
        mask = "" if ctx.mask == "None" else f", mask={ctx.mask}, other=0"
        cast = f".to({TL_TYPE[cdt]})" if cdt != e.dtype else ""
        w.emit(f"{v} = tl.load({ptr} + ({addr}){mask}){cast}")
        return v

    def _load_user(self, e: Load, ctx: Ctx) -> str:
        """A user tensor with dynamic dimensions: never remapped (views.remap), so the load's index
        space is the tensor's own; runtime strides and a bounds mask from its slot."""
        w = self.w
        ptr = w.ptr(e.buf)
        addr, bounds = w.user_address(e.buf, [ctx.dim(d) for d in range(len(e.buf.shape))])
        masks = ([] if ctx.mask == "None" else [f"({ctx.mask})"]) + bounds
        v = w.var("x")
        cdt = compute_dtype(e.dtype)
        cast = f".to({TL_TYPE[cdt]})" if cdt != e.dtype else ""
        mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
        w.emit(f"{v} = tl.load({ptr} + ({addr} + {ctx.zero}){mask}){cast}")
        return v

    def _op(self, e: Op, ctx: Ctx) -> str:
        w = self.w
        out_c = compute_dtype(e.dtype)
        args = []
        for a in e.args:
            v = self.value(a, ctx)
            a_c = compute_dtype(a.dtype)
            if e.op in SAME_TYPE_OPS and a_c != out_c:
                v = _cast(v, a_c, out_c)
            elif e.op == "where" and a is not e.args[0] and a_c != out_c:
                v = _cast(v, a_c, out_c)
            elif e.op in FLOAT_OPS and not a_c.startswith("float"):
                v = _cast(v, a_c, "float32")
            args.append(v)
        code = _op_code(e, args, out_c, [compute_dtype(a.dtype) for a in e.args])
        v = w.var()
        w.emit(f"{v} = {code}")
        return v

    def _child_ctx(self, key, ctx: Ctx, shape, dims, linear=None, mask=None) -> Ctx:
        if key not in ctx.children:
            ctx.children[key] = Ctx(self.w, shape, dims, linear, mask or ctx.mask, ctx.zero)
        return ctx.children[key]

    def _reindex(self, e: Reindex, ctx: Ctx) -> str:
        w = self.w
        child_shape = e.bounds or _shape_of_child(e)
        dims = []
        for m in e.maps:
            if m.kind == "const":
                dims.append(str(m.start))
            elif m.kind == "dim":
                idx = ctx.dim(m.src)
                if m.step != 1:
                    idx = f"{idx} * {m.step}"
                if m.start:
                    idx = f"({idx} + {m.start})"
                dims.append(idx)
            else:
                dims.append(self.value(m.expr, ctx))
        # bind each child index to a variable once
        bound = []
        for idx in dims:
            if idx.isidentifier() or idx.lstrip("-").isdigit():
                bound.append(idx)
            else:
                v = w.var("i")
                w.emit(f"{v} = {idx}")
                bound.append(v)
        mask = ctx.mask
        inb = None
        if e.bounds is not None:
            inb = w.var("inb")
            conds = [f"({b} >= 0) & ({b} < {e.bounds[d]})" for d, b in enumerate(bound)]
            w.emit(f"{inb} = " + " & ".join(conds))
            mask = inb if ctx.mask == "None" else f"({ctx.mask}) & {inb}"
        child = Ctx(w, child_shape, bound, None, mask, ctx.zero)
        value = self.value(e.child, child)
        if inb is None:
            return value
        v = w.var()
        w.emit(f"{v} = tl.where({inb}, {value}, "
               f"tl.full([], {_literal(e.fill, e.dtype)}, {TL_TYPE[compute_dtype(e.dtype)]}))")
        return v

    def _reshape(self, e: Reshape, ctx: Ctx) -> str:
        w = self.w
        if ctx.linear is not None and ctx.shape == e.parent_shape:
            linear = ctx.linear
        else:
            cs = contiguous_strides(e.parent_shape)
            terms = [ctx.dim(d) if s == 1 else f"{ctx.dim(d)} * {s}"
                     for d, s in enumerate(cs) if e.parent_shape[d] != 1]
            linear = w.var("lin")
            w.emit(f"{linear} = " + (" + ".join(terms) if terms else "0") + f" + {ctx.zero}")
        child = self._child_ctx(("reshape", id(e)), ctx, e.child_shape, None, linear)
        return self.value(e.child, child)

    def _cat(self, e: Cat, ctx: Ctx) -> str:
        w = self.w
        idx = ctx.dim(e.dim)
        result = None
        for k in reversed(range(len(e.parts))):
            start, size = e.starts[k], e.sizes[k]
            inside = w.var("in")
            w.emit(f"{inside} = ({idx} >= {start}) & ({idx} < {start + size})")
            dims = [ctx.dim(d) if d != e.dim else None for d in range(len(ctx.shape))]
            shifted = w.var("i")
            w.emit(f"{shifted} = {idx} - {start}")
            dims[e.dim] = shifted
            mask = inside if ctx.mask == "None" else f"({ctx.mask}) & {inside}"
            shape = list(ctx.shape)
            shape[e.dim] = size
            part = Ctx(w, shape, dims, None, mask, ctx.zero)
            value = self.value(e.parts[k], part)
            if result is None:
                result = value
            else:
                v = w.var()
                w.emit(f"{v} = tl.where({inside}, {value}, {result})")
                result = v
        return result


def _shape_of_child(e: Reindex):
    # Without bounds the child shape only matters for unraveling, which Reindex never needs:
    # every child dimension is given explicitly.
    return tuple(1 << 30 for _ in e.maps)


def _cast(v: str, src: str, dst: str) -> str:
    if dst == "bool":
        return f"({v} != 0)"
    return f"{v}.to({TL_TYPE[compute_dtype(dst)]})"


# Pointwise ops as code templates over the argument variables {0}, {1}, {2}.
OP_TEMPLATES = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "floordiv": "{0} // {1}", "fmod": "{0} % {1}", "neg": "-{0}",
    "and": "{0} & {1}", "or": "{0} | {1}", "xor": "{0} ^ {1}",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}",
    "gt": "{0} > {1}", "ge": "{0} >= {1}",
    "exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "erf": "tl.erf({0})", "abs": "tl.abs({0})",
    "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "sigmoid": "tl.sigmoid({0})",
    "reciprocal": "1.0 / {0}", "relu": "tl.maximum({0}, 0)",
    "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
    "where": "tl.where({0}, {1}, {2})", "silu": "{0} * tl.sigmoid({0})",
    "log1p": "tl.log(1.0 + {0})", "expm1": "tl.exp({0}) - 1.0", "isnan": "{0} != {0}",
    "trunc": "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))", "round": "tl.floor({0} + 0.5)",
}


def _op_code(e: Op, a: list[str], out_c: str, arg_c: list[str]) -> str:
    op = e.op
    if op in OP_TEMPLATES:
        return OP_TEMPLATES[op].format(*a)
    if op == "not":
        return f"{a[0]} == 0" if arg_c[0] != "bool" else f"{a[0]} ^ 1"
    if op == "cast":
        if e.dtype == "bool":
            return f"{a[0]} != 0"
        # round through the storage type, so an explicit cast to bf16/fp16 rounds like torch
        if e.dtype in ("float16", "bfloat16"):
            return f"{a[0]}.to({TL_TYPE[e.dtype]}).to(tl.float32)"
        return f"{a[0]}.to({TL_TYPE[out_c]})"
    if op == "tanh":
        return _tanh(a[0])
    if op == "gelu":
        if e.param == "tanh":
            inner = f"0.7978845608028654 * ({a[0]} + 0.044715 * {a[0]} * {a[0]} * {a[0]})"
            return f"0.5 * {a[0]} * (1.0 + {_tanh(inner)})"
        return f"0.5 * {a[0]} * (1.0 + tl.erf({a[0]} * 0.7071067811865476))"
    if op == "sign":
        t = TL_TYPE[out_c]
        return f"({a[0]} > 0).to({t}) - ({a[0]} < 0).to({t})"
    if op == "remainder":
        if out_c.startswith("float"):
            return f"{a[0]} - tl.floor({a[0]} / {a[1]}) * {a[1]}"
        return f"(({a[0]} % {a[1]}) + {a[1]}) % {a[1]}"
    if op == "pow":
        if len(a) == 1:
            return _pow_const(a[0], e.param)
        return f"tl.exp({a[1]} * tl.log({a[0]}))"
    raise NotImplementedError(f"no code for pointwise op {op!r}")


def _tanh(x: str) -> str:
    """tanh without libdevice (Triton's interpreter has none): a series near 0, exp elsewhere."""
    x2 = f"(({x}) * ({x}))"
    series = f"({x}) * (1.0 + {x2} * (-0.3333333333333333 + {x2} * (0.13333333333333333 + {x2} * (-0.05396825396825397 + {x2} * 0.021869488536155203))))"
    big = f"(1.0 - 2.0 / (tl.exp(2.0 * ({x})) + 1.0))"
    return f"tl.where(tl.abs({x}) < 0.3, {series}, {big})"


def _pow_const(x: str, p: float) -> str:
    if p == int(p) and 0 <= p <= 8:
        n = int(p)
        return "1.0 + 0.0 * " + x if n == 0 else " * ".join([f"({x})"] * n)
    if p == int(p) and -8 <= p < 0:
        return "1.0 / (" + " * ".join([f"({x})"] * int(-p)) + ")"
    if p == 0.5:
        return f"tl.sqrt({x})"
    if p == -0.5:
        return f"tl.rsqrt({x})"
    return f"tl.exp({p!r} * tl.log({x}))"
