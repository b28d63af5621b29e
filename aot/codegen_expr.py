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

from grace.formats.dtypes import POINTER_TYPES

from .ir import (ERRORS, EXTENTS, FLOATS, Acc, Cat, Const, Expr, Index, Load, Op, Partner, Reindex,
                 Reshape, SymValue, compute_dtype, contiguous_strides, is_contiguous, numel)
from .ops import FLOAT_OPERANDS, SAME_TYPE_OPERANDS, TEMPLATES  # what each Op means
from .extents import is_static_size

TL_TYPE = {
    "float64": "tl.float64", "float32": "tl.float32", "float16": "tl.float16",
    "bfloat16": "tl.bfloat16", "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16",
    "int8": "tl.int8", "uint8": "tl.uint8", "bool": "tl.int1",
}
PTR_TYPE = POINTER_TYPES  # formats.dtypes: the cross-check reads the same table


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
    NotBeforeWait, and the kernel is generated again without the stretch. A template may also
    allow state and input buffers there (`allow_before_wait`) when the graph guarantees that no
    node before this one writes them (a decode attention's KV caches once aot/fuse_append.py has
    moved their appends after it)."""

    def __init__(self, symbols: dict | None = None, prefetch: bool = False):
        self.prefetch = prefetch
        self.pre_wait: list[str] = []
        self._before_wait = False
        self._early: set[int] = set()   # Buffer.index of the non-weights allowed before the wait
        self.lines: list[str] = []
        self.indent = 1
        self.params: list = []          # Buffers, in parameter order
        self._ptr: dict = {}            # Buffer.index (, "unaligned") -> its pointer variable
        self.prologue: list[str] = []
        self._n = 0
        self.symbols = symbols or {}
        self._sizes: dict = {}
        self.gather_depth = 0           # > 0 while emitting loads at computed indices (ptr(aligned=False))

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

    def ptr(self, buf, aligned: bool = True) -> str:
        """The typed pointer variable of a buffer; I/O buffers are read from their table slot.

        `aligned=False`: the same address with its alignment hidden from Triton (plus
        `program_id(0) >> 31`, always 0), so loads through it are never vectorized. Triton 3.6
        miscompiles some vectorized masked loads at computed indices: a 16-bit adaptive average
        pooling gave twice the right value in a quarter of its outputs on the H200, right again
        with scalar loads (docs/op-conformance.md). Gathers at computed indices use it."""
        if not aligned:
            base = self.ptr(buf)
            key = (buf.index, "unaligned")
            if key not in self._ptr:
                self.prologue.append(f"{base}u = {base} + (tl.program_id(0) >> 31)")
                self._ptr[key] = f"{base}u"
            return self._ptr[key]
        if self._before_wait and buf.kind != "weight" and buf.index not in self._early:
            raise NotBeforeWait(f"{buf.kind} buffer {buf.name} before gdc_wait()")
        key = buf.index
        if key not in self._ptr:
            name = f"p{len(self.params)}"
            self.params.append(buf)
            if buf.kind in ("input", "output"):   # its pointer from the table, where first used
                into = self.pre_wait if self._before_wait else self.prologue
                ind = "    " if self._before_wait else ""
                into.append(f"{ind}{name} = tl.load({name}_slot)"
                            f".to(tl.pointer_type({TL_TYPE[buf.dtype]}))")
                into.append(f"{ind}{name} = tl.multiple_of({name}, 16)")
            self._ptr[key] = name
        return self._ptr[key]

    def allow_before_wait(self, bufs) -> None:
        """Let loads through these state and input buffers go before gdc_wait(): the caller
        vouches that no node ordered before this kernel writes them (the table words behind an
        input are written by the table writer, whose edges are full). Never the arena, an
        output or the extents."""
        for buf in bufs:
            if buf.kind not in ("state", "input"):
                raise NotBeforeWait(f"{buf.kind} buffer {buf.name} before gdc_wait()")
            self._early.add(buf.index)

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
            ext = self._ptr[EXTENTS.index]
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
        return self._prologue_value((buf.index, word),
                                    f"tl.load({self._ptr[buf.index]}_slot + {word})", "io")

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
        dimensions (extents.py), or None when every element is."""
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
                # index 0, as a block when the context has one: an address built from nothing
                # but size-1 dimensions (a dynamic output of bound 1, e.g. nonzero of a 0-d
                # tensor) must still be a block of pointers for a block-shaped store
                self._dims[d] = self.zero
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


class ExprEmitter:
    def __init__(self, w: Writer, acc: str | None = None, partner: str | None = None):
        self.w = w
        self.acc = acc
        self.partner = partner   # a paired GEMV's second sum (ir.Partner)

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
        if isinstance(e, Partner):
            if self.partner is None:
                raise TypeError("a partner sum (ir.Partner) outside a paired GEMV's epilogue")
            return self.partner
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
        ptr = w.ptr(e.buf, aligned=not w.gather_depth)
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
        ptr = w.ptr(e.buf, aligned=not w.gather_depth)
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
        if e.op == "check_index":
            return self._check_index(e, ctx)
        out_c = compute_dtype(e.dtype)
        args = []
        for a in e.args:
            v = self.value(a, ctx)
            a_c = compute_dtype(a.dtype)
            if e.op in SAME_TYPE_OPERANDS and a_c != out_c:
                v = _cast(v, a_c, out_c)
            elif e.op == "where" and a is not e.args[0] and a_c != out_c:
                v = _cast(v, a_c, out_c)
            elif e.op == "pow" and not out_c.startswith("float"):
                v = _cast(v, a_c, out_c) if a_c != out_c else v   # integer pow stays exact
            elif e.op in FLOAT_OPERANDS and not a_c.startswith("float"):
                v = _cast(v, a_c, "float32")
            args.append(v)
        special = getattr(self, f"_op_{e.op}", None)
        code = special(e, args, out_c) if special is not None else None
        if code is None:
            code = _op_code(e, args, out_c, [compute_dtype(a.dtype) for a in e.args])
        v = w.var()
        w.emit(f"{v} = {code}")
        return v

    def _check_index(self, e: Op, ctx: Ctx) -> str:
        """A gather index (format 3.3, SPEC §5.4): out of [0, size) it becomes 0, so the read
        stays inside the table, and the elements the context really computes (its mask) store
        the check's code into the error word. Any code reports an error, so concurrent stores
        need no order. The mask is combined with tl.where, not `&`: in Triton's interpreter `&`
        fails between a scalar bool and a block."""
        w = self.w
        idx = self.value(e.args[0], ctx)
        size = self.value(e.args[1], ctx)
        err = w.ptr(ERRORS)
        bad = w.var("bad")
        w.emit(f"{bad} = ({idx} < 0) | ({idx} >= {size})")
        hit = bad
        if ctx.mask != "None":
            hit = w.var("hit")
            w.emit(f"{hit} = tl.where({ctx.mask}, {bad}, False)")
        # one address per lane (the shape of `hit`), all of them the error word
        w.emit(f"tl.store({err} + {hit}.to(tl.int32) * 0, {int(e.param)}, mask={hit})")
        v = w.var()
        w.emit(f"{v} = tl.where({bad}, 0, {idx})")
        return v

    # -- ops whose code needs intermediate values --------------------------------------------
    # Each returns the code of the final value (bound to a variable by `_op`) after emitting
    # what it needs, or None to fall back to the one-line template of `_op_code`.
    def _bind(self, code: str) -> str:
        v = self.w.var()
        self.w.emit(f"{v} = {code}")
        return v

    def _op_floor(self, e, a, out_c):
        return a[0] if not out_c.startswith("float") else None   # an integer is its own floor

    _op_ceil = _op_trunc = _op_floor

    def _op_round(self, e, a, out_c):
        """Round half to even, as torch (and IEEE nearbyint): floor(x + 0.5) would round 2.5 to
        3 and, in fp32, 0.49999997 to 1. With r = floor(x), x - r is exact; a tie goes to the
        even neighbour. |x| >= 2^mantissa (and inf) is already an integer, NaN stays NaN."""
        if not out_c.startswith("float"):
            return a[0]
        x = a[0]
        big = 2.0 ** (52 if out_c == "float64" else 23)
        r = self._bind(f"tl.floor({x})")
        d = self._bind(f"{x} - {r}")
        odd = self._bind(f"{r} - 2.0 * tl.floor({r} * 0.5)")   # 1 for an odd r, else 0
        near = self._bind(f"tl.where({d} > 0.5, {r} + 1.0, tl.where({d} < 0.5, {r}, {r} + {odd}))")
        return f"tl.where(tl.abs({x}) >= {big!r}, {x}, {near})"

    def _op_log1p(self, e, a, out_c):
        """log(1 + x) accurate near 0, where tl.log(1.0 + x) loses every digit (log1p(1e-8) would
        be 0): with u = 1 + x rounded, log(u) * x / (u - 1) corrects for the rounding of u
        (Goldberg, "What every computer scientist should know about floating-point", thm 4).
        Needs only an accurate tl.log, so it is the same under the interpreter and on the GPU
        (no libdevice). u == 1: log1p(x) = x to working precision; x = +inf: inf."""
        x = a[0]
        u = self._bind(f"1.0 + {x}")
        d = self._bind(f"{u} - 1.0")
        ratio = self._bind(f"{x} / tl.where({d} == 0.0, 1.0, {d})")
        value = self._bind(f"tl.where({d} == 0.0, {x}, tl.log({u}) * {ratio})")
        return f"tl.where({x} == float(\"inf\"), {x}, {value})"

    def _op_expm1(self, e, a, out_c):
        """exp(x) - 1 accurate near 0 (tl.exp(x) - 1.0 gives expm1(1e-8) = 0): Kahan's
        (u - 1) * x / log(u) with u = exp(x) — the error of u cancels in the ratio. u == 1:
        x; u == 0 (x very negative): -1; u == inf (x large, or +inf): inf. Needs only tl.exp and
        tl.log (no libdevice)."""
        x = a[0]
        u = self._bind(f"tl.exp({x})")
        d = self._bind(f"{u} - 1.0")
        ok = self._bind(f"({d} != 0.0) & ({d} != -1.0) & ({u} != float(\"inf\"))")
        lg = self._bind(f"tl.log(tl.where({ok}, {u}, 2.0))")
        return f"tl.where({ok}, {d} * ({x} / {lg}), tl.where({d} == 0.0, {x}, {d}))"

    def _op_floordiv(self, e, a, out_c):
        """a // b rounded toward -inf (torch floor_divide). Triton's integer `//` truncates
        toward 0 (C, like `%`), so a non-zero remainder whose sign differs from b's steps the
        quotient down. Exact for all integers (no float round trip). Index arithmetic (a
        provably non-negative dividend over a positive constant) is the plain `//`."""
        if out_c.startswith("float"):
            return self._float_floordiv(a[0], a[1], out_c)
        if _positive_const(e.args[1]) and _non_negative(e.args[0]):
            return f"{a[0]} // {a[1]}"
        q = self._bind(f"{a[0]} // {a[1]}")
        r = self._bind(f"{a[0]} - {q} * {a[1]}")
        if _positive_const(e.args[1]):   # one test
            return f"tl.where({r} < 0, {q} - 1, {q})"
        return f"tl.where(({r} != 0) & (({r} < 0) != ({a[1]} < 0)), {q} - 1, {q})"

    def _float_floordiv(self, a: str, b: str, out_c: str) -> str:
        """ATen's div_floor for floats: from the C remainder, not floor(a / b), which rounds
        -tiny / huge to -0 where the floor is -1. A zero quotient keeps the sign of a / b;
        b = 0 gives a / b (±inf or NaN)."""
        mod = self._bind(self._fmod(a, b) if out_c == "float32" else f"{a} % {b}")
        div = self._bind(f"({a} - {mod}) / {b}")
        div = self._bind(f"tl.where(({mod} != 0.0) & (({b} < 0.0) != ({mod} < 0.0)), "
                         f"{div} - 1.0, {div})")
        fl = self._bind(f"tl.floor({div})")
        fl = self._bind(f"tl.where({div} - {fl} > 0.5, {fl} + 1.0, {fl})")
        q = self._bind(f"{a} / {b}")
        res = self._bind(f"tl.where({div} == 0.0, {q} * 0.0, {fl})")
        return f"tl.where({b} == 0.0, {q}, {res})"

    def _op_truncdiv(self, e, a, out_c):
        """a / b rounded toward 0 (torch div(rounding_mode="trunc")): Triton's integer `//`."""
        if out_c.startswith("float"):
            q = self._bind(f"{a[0]} / {a[1]}")
            return f"tl.where({q} < 0, tl.ceil({q}), tl.floor({q}))"
        return f"{a[0]} // {a[1]}"

    def _op_fmod(self, e, a, out_c):
        return self._fmod(a[0], a[1]) if out_c == "float32" else None

    def _fmod(self, x: str, y: str) -> str:
        """C fmod of fp32 values, exactly, on the GPU too: the compiled float `%` is
        x - trunc(x / y) * y, wrong once x / y is large (1e30 % 7) and -inf once it overflows.
        In fp64, r - q·|y| is exact while q has at most 29 significant bits (24 + 29 <= 53), so
        each of 12 steps strips 26+ bits of the quotient (fp32 spans at most 2^277); a quotient
        rounded up leaves r slightly negative, which adding |y| repairs."""
        w = self.w
        r = self._bind(f"tl.abs({x}.to(tl.float64))")
        m = self._bind(f"tl.abs({y}.to(tl.float64))")
        safe = self._bind(f"tl.where({m} > 0.0, tl.where({m} < float(\"inf\"), {m}, 1.0), 1.0)")
        k = w.var("k")
        w.emit(f"for {k} in range(12):")
        w.indent += 1
        q = w.var("q")
        w.emit(f"{q} = tl.floor({r} / {safe})")
        w.emit(f"{q} = tl.where({q} > 536870912.0, tl.floor({q} * tl.exp2(27.0 - "
               f"tl.floor(tl.log2({q})))) * tl.exp2(tl.floor(tl.log2({q})) - 27.0), {q})")
        w.emit(f"{r} = {r} - {q} * {safe}")
        w.emit(f"{r} = tl.where({r} < 0.0, {r} + {safe}, {r})")
        w.indent -= 1
        res = self._bind(f"tl.where({r} >= {safe}, {r} - {safe}, {r}).to(tl.float32)")
        signed = self._bind(f"tl.where({x} < 0, -{res}, {res})")
        # fmod(x, ±inf) = x for finite x; x = ±inf, y = 0 or NaN operands give NaN
        special = self._bind(f"tl.where(tl.abs({y}) == float(\"inf\"), {x}, float(\"nan\"))")
        ok = self._bind(f"tl.where(tl.abs({x}) < float(\"inf\"), tl.where({y} != 0.0, "
                        f"tl.abs({y}) < float(\"inf\"), False), False)")
        return f"tl.where({ok}, {signed}, tl.where(tl.abs({x}) < float(\"inf\"), {special}, float(\"nan\")))"

    def _op_remainder(self, e, a, out_c):
        """Python-style remainder (the sign of b; torch.remainder), as ATen computes it: the
        C-style `%` (fmod: exact for integers, and for floats where a / b is large, where
        a - floor(a / b) * b is 0), moved by b when its sign differs from b's."""
        r = self._fmod(a[0], a[1]) if out_c == "float32" else f"{a[0]} % {a[1]}"
        r = self._bind(r)
        zero = "0.0" if out_c.startswith("float") else "0"
        return (f"tl.where(({r} != {zero}) & (({r} < {zero}) != ({a[1]} < {zero})), "
                f"{r} + {a[1]}, {r})")

    def _op_pow(self, e, a, out_c):
        if not out_c.startswith("float"):
            if len(a) == 1:
                return self._ipow_const(a[0], e.param)
            return self._ipow(a[0], a[1], out_c)
        if len(a) == 1:
            return self._pow_const(a[0], e.param)
        return self._pow(a[0], a[1])

    def _pow(self, x: str, y: str) -> str:
        """x ** y for float tensors, with torch's (C pow's) special cases: exp(y * log|x|) gives
        the magnitude; a negative base takes the sign of (-1)^y when y is an integer and is NaN
        otherwise (exp(y * log(x)) alone is NaN for every negative base) except for -inf, whose
        magnitude it takes; x ** 0 = 1 and 1 ** y = 1 even for NaN; (-1) ** ±inf = 1;
        0 ** y = 0 / inf for y > 0 / y < 0."""
        mag = self._bind(f"tl.exp({y} * tl.log(tl.abs({x})))")
        integral = self._bind(f"tl.floor({y}) == {y}")
        odd = self._bind(f"({y} - 2.0 * tl.floor({y} * 0.5)) == 1.0")
        fraction = self._bind(f"tl.where({x} == -float(\"inf\"), {mag}, float(\"nan\"))")
        # -0.0 to an odd integer power keeps its sign ((-0) ** -1 = -inf, as torch); to any
        # other power it is +0 or +inf
        neg_zero = self._bind(f"tl.where({x} == 0.0, (1.0 / tl.where({x} == 0.0, {x}, 1.0)) < 0, "
                              f"{x} < 0)")
        zero_sign = self._bind(f"tl.where({neg_zero}, tl.where({integral}, tl.where({odd}, "
                               f"-{mag}, {mag}), {mag}), {mag})")
        signed = self._bind(f"tl.where({x} < 0, tl.where({integral}, tl.where({odd}, -{mag}, "
                            f"{mag}), {fraction}), {zero_sign})")
        # nested wheres, not `|`: x or y may be a scalar (2.0 ** t), and Triton's interpreter
        # cannot `|` a scalar bool with a block
        value = self._bind(f"tl.where(({y} == 0.0), 1.0, tl.where({x} == 1.0, 1.0, {signed}))")
        return f"tl.where({x} == -1.0, tl.where(tl.abs({y}) == float(\"inf\"), 1.0, {value}), {value})"

    def _pow_const(self, x: str, p: float) -> str:
        """x ** p for a float tensor and a constant p: square-and-multiply for an integer p
        (exact signs for negative bases, and more accurate than exp/log), sqrt / rsqrt for ±0.5,
        exp(p * log|x|) with the sign of (-1)^p (integer p) or NaN for negative bases otherwise."""
        if p != p:
            return f"tl.where({x} == 1.0, 1.0, float(\"nan\"))"   # torch: 1 ** nan = 1, else nan
        if p == 0:
            return f"tl.where({x} == {x}, 1.0, 1.0)"   # 1 everywhere, even NaN and inf
        if p in (0.5, -0.5):
            return f"tl.sqrt({x})" if p > 0 else f"tl.rsqrt({x})"
        if abs(p) != float("inf") and p == int(p) and abs(p) <= 1024:
            power = self._square_multiply(x, int(abs(p)))
            return power if p > 0 else f"1.0 / {power}"
        mag = self._bind(f"tl.exp({_literal(p, 'float32')} * tl.log(tl.abs({x})))")
        if abs(p) == float("inf"):   # (-x) ** ±inf = x ** ±inf, and (±1) ** ±inf = 1
            return f"tl.where(tl.abs({x}) == 1.0, 1.0, {mag})"
        if p != int(p):   # a negative base has no real power, but -inf has inf ** p
            return (f"tl.where({x} < 0, tl.where({x} == -float(\"inf\"), {mag}, float(\"nan\")), "
                    f"{mag})")
        return f"tl.where({x} < 0, -{mag}, {mag})" if int(p) % 2 else mag

    def _square_multiply(self, x: str, n: int) -> str:
        """x ** n (n >= 1) by binary exponentiation: about 2·log2(n) multiplications."""
        result, base = None, x
        while True:
            if n & 1:
                result = base if result is None else self._bind(f"{result} * {base}")
            n >>= 1
            if not n:
                return result
            base = self._bind(f"{base} * {base}")

    def _ipow_const(self, x: str, p) -> str:
        """An integer tensor to a constant integer power: exact (wrapping like torch on
        overflow). A negative power is 1 / x ** -p truncated: 1, ±1 or 0."""
        p = int(p)
        if p == 0:
            return f"{x} * 0 + 1"
        if p > 0:
            return self._square_multiply(x, p)
        odd = "-1" if p % 2 else "1"
        return f"tl.where({x} == 1, 1, tl.where({x} == -1, {odd}, 0)) + {x} * 0"

    def _ipow(self, x: str, y: str, out_c: str) -> str:
        """Integer x ** y for tensors, exactly: square-and-multiply over every bit of y in a loop
        (64 steps for int64; the float route exp(y log x) is wrong past 2^24 and for negative
        bases). A negative y gives 1 / x ** -y truncated, as torch: 1 for x = 1, ±1 for x = -1,
        else 0."""
        w = self.w
        bits = {"int64": 64, "int32": 32, "int16": 16}.get(out_c, 8)
        base = self._bind(f"{x} + {y} * 0")
        exp_ = self._bind(f"tl.maximum({y} + {x} * 0, 0)")
        acc = self._bind(f"{base} * 0 + 1")
        k = w.var("k")
        w.emit(f"for {k} in range({bits}):")
        w.indent += 1
        w.emit(f"{acc} = tl.where(({exp_} & 1) != 0, {acc} * {base}, {acc})")
        w.emit(f"{base} = {base} * {base}")
        w.emit(f"{exp_} = {exp_} >> 1")
        w.indent -= 1
        odd = f"(({y} & 1) != 0)"
        neg = f"tl.where({x} == 1, 1, tl.where({x} == -1, tl.where({odd}, -1, 1), 0))"
        return f"tl.where({y} < 0, {neg}, {acc})"

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
        computed = inb is not None and any(m.kind == "expr" and _divides(m.expr) for m in e.maps)
        w.gather_depth += computed   # padded reads at computed indices: scalar loads (Writer.ptr)
        try:
            value = self.value(e.child, child)
        finally:
            w.gather_depth -= computed
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


def _divides(e) -> bool:
    """An index computed with a division (adaptive pooling's window starts, transposed
    convolutions): not affine in the output index."""
    if isinstance(e, Op) and e.op in ("floordiv", "truncdiv", "fmod", "remainder"):
        return True
    return any(_divides(c) for c in e.children() if c is not None)


def _cast(v: str, src: str, dst: str) -> str:
    if dst == "bool":
        return f"({v} != 0)"
    return _convert(v, src, compute_dtype(dst))


def _convert(v: str, src: str, dst: str) -> str:
    """A float goes to uint8 through int64, as torch defines it (c10's static_cast_with_inter_type:
    -1.5 -> -1 -> 255, where a direct conversion is undefined and the GPU saturates to 0)."""
    if dst == "uint8" and src in FLOATS:
        return f"{v}.to(tl.int64).to(tl.uint8)"
    return f"{v}.to({TL_TYPE[dst]})"


def _op_code(e: Op, a: list[str], out_c: str, arg_c: list[str]) -> str:
    op = e.op
    if op in TEMPLATES:
        return TEMPLATES[op].format(*a)
    if op == "not":
        return f"{a[0]} == 0" if arg_c[0] != "bool" else f"{a[0]} ^ 1"
    if op == "bitnot":  # unsigned: xor with all ones (Triton's interpreter overflows ~x there)
        bits = {"uint8": 0xFF, "uint16": 0xFFFF, "uint32": 0xFFFFFFFF}.get(arg_c[0])
        return f"~{a[0]}" if bits is None else f"{a[0]} ^ {bits}"
    if op == "cast":
        if e.dtype == "bool":
            return f"{a[0]} != 0"
        # round through the storage type, so an explicit cast to bf16/fp16 rounds like torch
        if e.dtype in ("float16", "bfloat16"):
            return f"{a[0]}.to({TL_TYPE[e.dtype]}).to(tl.float32)"
        return _convert(a[0], arg_c[0], out_c)
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
    raise NotImplementedError(f"no code for pointwise op {op!r}")


def _tanh(x: str) -> str:
    """tanh without libdevice (Triton's interpreter has none): a series near 0, exp elsewhere."""
    x2 = f"(({x}) * ({x}))"
    series = f"({x}) * (1.0 + {x2} * (-0.3333333333333333 + {x2} * (0.13333333333333333 + {x2} * (-0.05396825396825397 + {x2} * 0.021869488536155203))))"
    big = f"(1.0 - 2.0 / (tl.exp(2.0 * ({x})) + 1.0))"
    return f"tl.where(tl.abs({x}) < 0.3, {series}, {big})"


def _non_negative(expr) -> bool:
    """Provably >= 0: an index, a non-negative constant, or sums, products and quotients of
    those (the arithmetic of views and gathers)."""
    if isinstance(expr, Index):
        return True
    if isinstance(expr, Const):
        return not isinstance(expr.value, bool) and expr.value >= 0
    if isinstance(expr, Op) and expr.op in ("add", "mul", "floordiv", "cast"):
        return all(_non_negative(a) for a in expr.args)
    return False


def _positive_const(expr) -> bool:
    return isinstance(expr, Const) and not isinstance(expr.value, bool) and expr.value > 0
