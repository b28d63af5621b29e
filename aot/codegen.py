"""Stage `codegen` (compiler.PIPELINE): kernel IR → Triton source, one template per kernel family.

Each template fixes the index variables and the loop structure, and lets `ExprEmitter` fill in
the operands (prologues) and the stored value (epilogue). Sizes are literals in the source, so
identical layers give byte-identical sources and are compiled once. The function name is derived
from the source's hash for the same reason.

A template reads its kernel's spec (aot/families.py, which also maps each family to its template)
and never decides what lowering already did: the tile plans (`gemm_plan`, `attention_plan`) are
computed by lowering, which needs their splits, and stored in the spec.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from .codegen_expr import TL_TYPE, Ctx, ExprEmitter, NotBeforeWait, Writer, and_mask, factor_terms
from .ir import EXTENTS, ITEMSIZE, Index, Kernel, Load, Op, contiguous_strides, loads, numel
from .extents import is_prefix, true_size
from .gemm_tiles import Tile

HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
# Programmatic dependent launch (docs/design-pdl.md): a kernel lets the next one launch at once,
# runs the weight loads that need nothing from earlier nodes, then waits for them to finish.
PDL_HEADER = ("import triton\nimport triton.language as tl\n"
              "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait\n\n\n"
              "@triton.jit\n")


@dataclass
class KernelSource:
    name: str
    family: str
    source: str
    param_types: list[str]
    buffers: list            # the Buffer bound to each parameter, in order
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    writes: list = field(default_factory=list)   # indices of the parameters it stores through


def stored_params(text: str) -> list[int]:
    """The parameters a generated kernel stores through: every store starts `tl.store(p<i> ...`
    (the Writer names parameter i's pointer p<i>), or an atomic (`tl.atomic_add(p<i> ...`) for an
    accumulating scatter: what the race checker needs to know."""
    return sorted({int(i) for i in re.findall(r"tl\.(?:store|atomic_\w+)\(p(\d+)\b", text)})


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def generate(kernel: Kernel, symbols: dict | None = None, pdl: bool = False) -> KernelSource:
    """`symbols`: size symbol -> word of the extents table (dynamic programs). `pdl`: the kernel
    may be the target of programmatic edges: it calls gdc_launch_dependents() first, then what
    its template can run before the wait (weight loads), then gdc_wait(), before it reads or writes
    anything another node touches; every program passes the wait, early exits come after it."""
    try:
        return _generate(kernel, symbols, pdl, prefetch=pdl)
    except NotBeforeWait:   # the template's pre-wait stretch needs the table: no prefetch
        return _generate(kernel, symbols, pdl, prefetch=False)


def _generate(kernel: Kernel, symbols, pdl: bool, prefetch: bool) -> KernelSource:
    from .families import of   # the registry names the templates below, so it imports this module
    template = of(kernel).template
    w = Writer(symbols, prefetch=prefetch)
    grid, num_warps, num_stages = template(kernel, w)
    names = w.param_names()
    lines = [f"def KERNEL({', '.join(names)}):"]
    if pdl:
        lines += ["    gdc_launch_dependents()"] + w.pre_wait + ["    gdc_wait()"]
    lines += ["    " + ln for ln in w.prologue]
    lines += w.lines
    text = (PDL_HEADER if pdl else HEADER) + "\n".join(lines) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = f"{kernel.family}_{digest}"
    return KernelSource(name, kernel.family, text.replace("def KERNEL(", f"def {name}("),
                        w.param_types(), list(w.params), grid, num_warps, num_stages,
                        stored_params(text))


def _store(w: Writer, kernel: Kernel, value: str, ctx: Ctx, shape_expr: str):
    ptr = w.ptr(kernel.out)
    out_t = TL_TYPE[kernel.out.dtype]
    addr, masks = ctx.linear, [] if ctx.mask == "None" else [ctx.mask]
    if kernel.out.dynamic:
        # a user tensor of the true size: its runtime strides (fusion leaves these stores to a
        # pointwise kernel over the output's own shape)
        assert tuple(ctx.shape) == tuple(kernel.out.shape), (ctx.shape, kernel.out.shape)
        addr, bounds = w.user_address(kernel.out, [ctx.dim(d) for d in range(len(ctx.shape))])
        masks = [f"({m})" for m in masks] + bounds
    mask = f", mask={' & '.join(masks)}" if masks else ""
    w.emit(f"tl.store({ptr} + {addr}, tl.broadcast_to({value}, {shape_expr}).to({out_t}){mask})")


def _exit_beyond(w: Writer, entry, start: str):
    """Return early from a program whose tile starts past the real elements of a dimension whose
    valid indices are a prefix (padding is never computed)."""
    if entry is not None and is_prefix(entry):
        w.emit(f"if {start} >= {w.extent(true_size(entry, 0))}:")
        w.emit("    return")


def _exit_outer(w: Writer, shape, ext, first_flat: str):
    """Early exit for a flat (row-major) block starting at `first_flat`, when the outermost
    dimension that is not 1 is dynamic with a prefix of valid indices."""
    outer = next((d for d, size in enumerate(shape) if size != 1), None)
    if outer is not None and ext[outer] is not None:
        _exit_beyond(w, ext[outer], f"{first_flat} // {numel(shape[outer + 1:])}")


def _and_into(w: Writer, var: str, cond: str | None):
    """`var &= cond`, when there is a condition."""
    if cond:
        w.emit(f"{var} = {var} & {cond}")


def _dim_valid(w: Writer, entry, idx: str) -> str | None:
    terms = factor_terms(w, entry, idx) if entry is not None else []
    return " & ".join(terms) if terms else None


# ---- pointwise --------------------------------------------------------------------------------
def _flat_block(kernel: Kernel, w: Writer) -> tuple[int, Ctx]:
    """A flat block of the kernel's index space per program, masked past its end and past the
    true extents (returning early from programs wholly past them)."""
    n = numel(kernel.out_shape)
    block = min(1024, next_pow2(max(n, 16)))
    idx_t = "tl.int64" if n >= 2**31 else "tl.int32"
    w.emit(f"offs = tl.program_id(0).to({idx_t}) * {block} + tl.arange(0, {block})")
    mask = _mask(w, "mask", None if n % block == 0 else f"offs < {n}")
    w.emit(f"zero = tl.zeros([{block}], tl.int32)")
    ctx = Ctx(w, kernel.out_shape, linear="offs", mask=mask, zero="zero")
    if kernel.ext is not None:
        _exit_outer(w, kernel.out_shape, kernel.ext, f"tl.program_id(0) * {block}")
        ctx.mask = and_mask(w, "valid", mask, ctx.valid(kernel.ext))
    return block, ctx


def _flat_launch(kernel: Kernel, block: int):
    return (cdiv(numel(kernel.out_shape), block), 1, 1), (4 if block >= 512 else 2 if block >= 128
                                                         else 1), 1


def pointwise(kernel: Kernel, w: Writer):
    block, ctx = _flat_block(kernel, w)
    value = ExprEmitter(w).value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{block}]")
    return _flat_launch(kernel, block)


# ---- in-place partial writes (KV-cache updates) ---------------------------------------------
def scatter(kernel: Kernel, w: Writer):
    """Store a value per element of an index space at a computed position of `out` (a state
    buffer, or an arena copy): `out[coords(i)] = value(i)`. Positions outside `out` are not
    written (an out-of-range index would otherwise corrupt neighbouring state)."""
    block, ctx = _flat_block(kernel, w)
    _scatter_store(w, kernel.out, kernel.spec.coords, kernel.epilogue, ctx, block,
                   kernel.spec.accumulate)
    return _flat_launch(kernel, block)


def _scatter_store(w: Writer, out, coords, epilogue, ctx: Ctx, block: int,
                   accumulate: str | None = None, later: list | None = None):
    """`out[coords(i)] = epilogue(i)` for the flat block of index space `ctx` (Scatter's
    semantics; also a decode attention's own KV-cache appends). `later`: the store line goes
    there, for the caller to emit further down, instead of here (its value and address are
    computed here, so their loads are issued here)."""
    emitter = ExprEmitter(w)
    value = emitter.value(epilogue, ctx)
    shape = out.shape
    strides = contiguous_strides(shape)
    terms, bounds = [], []
    for d, coord in enumerate(coords):
        c = emitter.value(coord, ctx)
        if not isinstance(coord, Index):
            bounds.append(f"({c} >= 0) & ({c} < {shape[d]})")
        if shape[d] != 1:
            terms.append(f"{c}.to(tl.int64) * {strides[d]}")
    masks = ([] if ctx.mask == "None" else [f"({ctx.mask})"]) + bounds
    addr = " + ".join(terms) or ctx.zero   # a block even when every dimension has size 1
    store_mask = f", mask=tl.broadcast_to({' & '.join(masks)}, [{block}])" if masks else ""
    # accumulate: index_put(accumulate=True), scatter_add, scatter_reduce sum/amax/amin —
    # duplicate destinations combine atomically (float sums in an unspecified order)
    store = {None: "tl.store", "add": "tl.atomic_add", "max": "tl.atomic_max",
             "min": "tl.atomic_min"}[accumulate]
    line = (f"{store}({w.ptr(out)} + tl.broadcast_to({addr}, [{block}]), "
            f"tl.broadcast_to({value}, [{block}]).to({TL_TYPE[out.dtype]}){store_mask})")
    if later is None:
        w.emit(line)
    else:
        later.append(line)


# ---- reductions -------------------------------------------------------------------------------
REDUCE_INIT = {"sum": "0", "max": '-float("inf")', "min": 'float("inf")'}
# how a reduction folds a value into its accumulator, and the reduction across a block
REDUCE_COMBINE = {"sum": "{acc} + {v}", "max": "tl.maximum({acc}, {v})",
                  "min": "tl.minimum({acc}, {v})"}
REDUCE_FN = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}


def _row_blocks(w: Writer, spec, start_acc) -> tuple[int, int, int, Ctx]:
    """The loop both reductions share: programs of `br` rows (the kept dimensions, flattened),
    each walking the reduced dimensions (flattened) in blocks of `bn` columns, masked past their
    end and the true extents. `start_acc(br, bn)` emits the accumulators before the loop. Leaves
    the writer inside the loop; returns (rows, cols, br, the index context of a block). `spec`:
    a Reduction or an Argreduce."""
    src_shape, rdims = spec.src_shape, spec.rdims
    kept = [d for d in range(len(src_shape)) if d not in rdims]
    rows = numel([src_shape[d] for d in kept])
    cols = numel([src_shape[d] for d in rdims])
    bn = min(next_pow2(max(cols, 2)), 1024)
    br = max(1, min(next_pow2(rows), 4096 // bn, 64))
    src_ext = spec.src_ext or (None,) * len(src_shape)
    w.emit(f"rows = tl.program_id(0) * {br} + tl.arange(0, {br})[:, None]")
    w.emit(f"rmask = rows < {rows}")
    kept_ctx = Ctx(w, [src_shape[d] for d in kept], linear="rows")
    _and_into(w, "rmask", kept_ctx.valid([src_ext[d] for d in kept]))
    w.emit(f"zero = tl.zeros([{br}, {bn}], tl.int32)")
    start_acc(br, bn)
    w.emit(f"for start in range(0, {cols}, {bn}):")
    w.indent += 1
    w.emit(f"cols = start + tl.arange(0, {bn})[None, :]")
    w.emit(f"mask = rmask & (cols < {cols})")
    red_ctx = Ctx(w, [src_shape[d] for d in rdims], linear="cols")
    _and_into(w, "mask", red_ctx.valid([src_ext[d] for d in rdims]))
    dims = [None] * len(src_shape)
    for i, d in enumerate(kept):
        dims[d] = kept_ctx.dim(i)
    for i, d in enumerate(rdims):
        dims[d] = red_ctx.dim(i)
    return rows, cols, br, Ctx(w, src_shape, dims, mask="mask", zero="zero")


def _store_rows(w: Writer, kernel: Kernel, rows: int, br: int):
    """Store each row's reduced value `red` through the epilogue; the launch of `_row_blocks`."""
    w.emit(f"orow = tl.program_id(0) * {br} + tl.arange(0, {br})")
    w.emit(f"omask = orow < {rows}")
    w.emit(f"ozero = tl.zeros([{br}], tl.int32)")
    out_ctx = Ctx(w, kernel.out_shape, linear="orow", mask="omask", zero="ozero")
    _and_into(w, "omask", out_ctx.valid(kernel.ext))
    value = ExprEmitter(w, acc="red").value(kernel.epilogue, out_ctx)
    _store(w, kernel, value, out_ctx, f"[{br}]")
    return (cdiv(rows, br), 1, 1), 4, 1


# A reduction over at most this many elements per row, with many rows (depthwise convolutions and
# pooling windows: 9 or 25 taps over every output pixel and channel), is unrolled: programs of
# 1-D row blocks, one load per tap. Neighbouring rows are neighbouring channels, so each tap's load
# is contiguous (vectorized), where the [rows, next_pow2(taps)] tile wasted 7 of 16 lanes and
# interleaved the taps' addresses within a warp.
UNROLL_TAPS = 32
UNROLL_MIN_ROWS = 4096


def _unrolled_rows(kernel: Kernel) -> bool:
    spec = kernel.spec
    src_shape, rdims = spec.src_shape, spec.rdims
    src_ext = spec.src_ext or (None,) * len(src_shape)
    cols = numel([src_shape[d] for d in rdims])
    rows = numel(src_shape) // max(cols, 1)
    return (1 < cols <= UNROLL_TAPS and rows >= UNROLL_MIN_ROWS
            and all(src_ext[d] is None for d in rdims))


def _unrolled_reduction(kernel: Kernel, w: Writer, op: str, init: str, tl_acc: str):
    spec = kernel.spec
    src_shape, rdims = spec.src_shape, spec.rdims
    src_ext = spec.src_ext or (None,) * len(src_shape)
    kept = [d for d in range(len(src_shape)) if d not in rdims]
    rows = numel([src_shape[d] for d in kept])
    cols = numel([src_shape[d] for d in rdims])
    br = 512 if rows >= 512 * 256 else 256 if rows >= 256 * 256 else 128
    w.emit(f"rows = tl.program_id(0) * {br} + tl.arange(0, {br})")
    w.emit(f"rmask = rows < {rows}")
    kept_ctx = Ctx(w, [src_shape[d] for d in kept], linear="rows")
    _and_into(w, "rmask", kept_ctx.valid([src_ext[d] for d in kept]))
    w.emit(f"zero = tl.zeros([{br}], tl.int32)")
    w.emit(f"acc = tl.full([{br}], {init}, {tl_acc})")
    w.emit(f"for cols in tl.static_range({cols}):")
    w.indent += 1
    red_ctx = Ctx(w, [src_shape[d] for d in rdims], linear="cols")
    dims = [None] * len(src_shape)
    for i, d in enumerate(kept):
        dims[d] = kept_ctx.dim(i)
    for i, d in enumerate(rdims):
        dims[d] = red_ctx.dim(i)
    ctx = Ctx(w, src_shape, dims, mask="rmask", zero="zero")
    value = ExprEmitter(w).value(spec.src, ctx)
    w.emit("acc = " + REDUCE_COMBINE[op].format(
        acc="acc", v=f"tl.where(rmask, {value}.to({tl_acc}), {init})"))
    w.indent -= 1
    w.emit("red = acc")
    return _store_rows(w, kernel, rows, br)


def reduction(kernel: Kernel, w: Writer):
    spec = kernel.spec
    op, acc_t = spec.op, spec.acc_dtype
    init = REDUCE_INIT[op]
    if not acc_t.startswith("float") and op != "sum":
        init = "-9223372036854775807" if op == "max" else "9223372036854775807"
    tl_acc = TL_TYPE[acc_t]
    if spec.row is not None:
        return _reduction_with_row(kernel, w, op, init, tl_acc)
    if _unrolled_rows(kernel) and spec.keep is None:
        return _unrolled_reduction(kernel, w, op, init, tl_acc)
    rows, cols, br, ctx = _row_blocks(
        w, spec, lambda br, bn: w.emit(f"acc = tl.full([{br}, {bn}], {init}, {tl_acc})"))
    emitter = ExprEmitter(w)
    value = emitter.value(spec.src, ctx)
    _store_kept(w, spec, emitter, ctx, cols)   # reduced dimensions last: (row, col) in order
    w.emit(f"value = tl.where(mask, {value}.to({tl_acc}), {init})")
    w.emit("acc = " + REDUCE_COMBINE[op].format(acc="acc", v="value"))
    w.indent -= 1
    w.emit(f"red = {REDUCE_FN[op]}(acc, axis=1)")
    return _store_rows(w, kernel, rows, br)


def _reduction_with_row(kernel: Kernel, w: Writer, op: str, init: str, tl_acc: str):
    """One program, the whole row in one block (aot/fuse_rows.py): the source and the row's
    factors free of the value (x and the norm's weight) are loaded together, so storing the
    normalised row after the reduction adds arithmetic, not another trip to memory."""
    spec = kernel.spec
    cols = numel(spec.src_shape)
    bn = next_pow2(max(cols, 2))
    row_ctx = Ctx(w, spec.row_shape, linear="cols", mask="mask", zero="zero")

    def setup():
        w.emit(f"cols = tl.arange(0, {bn})[None, :]")
        w.emit(f"mask = cols < {cols}")
        w.emit(f"zero = tl.zeros([1, {bn}], tl.int32)")

    if w.prefetch:
        # The row's weights (the norm's scale) load before gdc_wait(), beside the kernels before
        # this one: loaded after the reduction they were one more trip to memory on the path.
        with w.before_wait():
            setup()
            for load in _weight_loads_at_row(spec.row_value):
                ExprEmitter(w).value(load, row_ctx)   # memoised: the row reuses the variable
    else:
        setup()
    src_ctx = Ctx(w, spec.src_shape, linear="cols", mask="mask", zero="zero")
    value = ExprEmitter(w).value(spec.src, src_ctx)
    free = ExprEmitter(w).value(spec.row_value, row_ctx) if spec.row_scale is not None else None
    w.emit(f"acc = tl.where(mask, {value}.to({tl_acc}), {init})")
    w.emit(f"red = {REDUCE_FN[op]}(acc, axis=1)")
    launch = _store_rows(w, kernel, 1, 1)
    w.emit("stat = red[:, None]")
    if free is None:   # the row reads the value inside (not a product)
        row = ExprEmitter(w, acc="stat").value(spec.row_value, row_ctx)
    else:
        scale = ExprEmitter(w, acc="stat").value(spec.row_scale, row_ctx)
        row = f"{free}.to(tl.float32) * {scale}"
    w.emit(f"tl.store({w.ptr(spec.row)} + cols, ({row}).to({TL_TYPE[spec.row.dtype]}), mask=mask)")
    return launch


def _weight_loads_at_row(expr) -> list:
    """The weight loads of `expr` evaluated at the row's own index (under pointwise ops only, so
    the row's context and memo serve them)."""
    if isinstance(expr, Load):
        return [expr] if expr.buf.kind == "weight" else []
    if isinstance(expr, Op):
        return [ld for a in expr.args for ld in _weight_loads_at_row(a)]
    return []


def _store_kept(w: Writer, spec, emitter: ExprEmitter, ctx: Ctx, cols: int):
    """A row walk's `kept` value (aot/fuse_norm.py) into `keep`, element (rows, cols) of a
    [rows, cols] row-major view, inside the walk's mask; nothing when the spec keeps none."""
    if spec.keep is not None:
        w.emit(f"tl.store({w.ptr(spec.keep)} + rows * {cols} + cols, "
               f"{emitter.value(spec.kept, ctx)}.to({TL_TYPE[spec.keep.dtype]}), mask=mask)")


# ---- row-wise normalisations (softmax, log-softmax, layer norm) -------------------------------
def _row_setup(kernel: Kernel, w: Writer, shape):
    cols = shape[-1]
    rows = numel(shape) // cols
    bn = min(next_pow2(max(cols, 2)), 4096)
    br = max(1, min(next_pow2(rows), 2048 // bn, 16))
    ext = kernel.ext or (None,) * len(shape)
    _exit_outer(w, shape[:-1], ext[:-1], f"tl.program_id(0) * {br}")
    w.emit(f"rows = tl.program_id(0) * {br} + tl.arange(0, {br})[:, None]")
    w.emit(f"rmask = rows < {rows}")
    _and_into(w, "rmask", Ctx(w, shape[:-1], linear="rows").valid(ext[:-1]))
    w.emit(f"zero = tl.zeros([{br}, {bn}], tl.int32)")
    return rows, cols, br, bn


def _row_ctx(w: Writer, shape, cols, mask="mask"):
    """An index context over `shape` for the element (rows, cols) of a [rows, cols] view."""
    return Ctx(w, shape, linear=f"(rows * {cols} + cols)", mask=mask, zero="zero")


def _row_loop(w: Writer, cols, bn, col_entry=None):
    w.emit(f"for start in range(0, {cols}, {bn}):")
    w.indent += 1
    w.emit(f"cols = start + tl.arange(0, {bn})[None, :]")
    w.emit(f"mask = rmask & (cols < {cols})")
    _and_into(w, "mask", _dim_valid(w, col_entry, "cols"))


def softmax(kernel: Kernel, w: Writer):
    shape = kernel.out_shape
    rows, cols, br, bn = _row_setup(kernel, w, shape)
    src = kernel.spec.src
    # fp64 softmax computes in fp64 (torch's softmax(dtype=float64)); everything else in fp32
    acc = "tl.float64" if kernel.out.dtype == "float64" else "tl.float32"
    w.emit(f"m = tl.full([{br}, 1], -float(\"inf\"), {acc})")
    w.emit(f"s = tl.zeros([{br}, 1], {acc})")
    col_entry = kernel.ext[-1] if kernel.ext else None
    _row_loop(w, cols, bn, col_entry)
    x = ExprEmitter(w).value(src, _row_ctx(w, shape, cols))
    w.emit(f"x = tl.where(mask, {x}.to({acc}), -float(\"inf\"))")
    w.emit("m_new = tl.maximum(m, tl.max(x, axis=1)[:, None])")
    w.emit("m_safe = tl.where(m_new == -float(\"inf\"), 0.0, m_new)")
    w.emit("s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=1)[:, None]")
    w.emit("m = m_new")
    w.indent -= 1
    _row_loop(w, cols, bn, col_entry)
    ctx = _row_ctx(w, shape, cols)
    x = ExprEmitter(w).value(src, ctx)
    if kernel.spec.log:
        w.emit(f"y = {x}.to({acc}) - m - tl.log(s)")
    else:
        w.emit(f"y = tl.exp({x}.to({acc}) - m) / s")
    value = ExprEmitter(w, acc="y").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{br}, {bn}]")
    w.indent -= 1
    return (cdiv(rows, br), 1, 1), 4 if bn >= 256 else 2, 1


def layer_norm(kernel: Kernel, w: Writer):
    """Each program normalises whole rows. A row that fits one block (up to 4096 columns) is
    loaded once and kept in registers for its mean, variance and output; a longer one is walked
    three times. With `keep` (aot/fuse_norm.py: src adds a split-K sum that later kernels read
    too) that sum, `kept`, is stored there as well, once per element."""
    shape = kernel.out_shape
    rows, cols, br, bn = _row_setup(kernel, w, shape)
    spec = kernel.spec

    def last_walk():
        """The walk that leaves `x` (the source) for the output, storing `kept` on the way."""
        _row_loop(w, cols, bn)
        ctx = _row_ctx(w, shape, cols)
        emitter = ExprEmitter(w)
        w.emit(f"x = {emitter.value(spec.src, ctx)}")
        _store_kept(w, spec, emitter, ctx, cols)
        return emitter, ctx

    if cols <= bn:   # one block a row: the source is evaluated once
        emitter, ctx = last_walk()
        w.emit("x = tl.where(mask, x.to(tl.float32), 0.0)")
        w.emit(f"mean = tl.sum(x, axis=1)[:, None] / {cols}")
        w.emit("d = tl.where(mask, x - mean, 0.0)")
        w.emit(f"rstd = tl.rsqrt(tl.sum(d * d, axis=1)[:, None] / {cols} + {spec.eps!r})")
        w.emit("y = d * rstd")
    else:
        w.emit(f"total = tl.zeros([{br}, 1], tl.float32)")
        _row_loop(w, cols, bn)
        x = ExprEmitter(w).value(spec.src, _row_ctx(w, shape, cols))
        w.emit(f"total += tl.sum(tl.where(mask, {x}.to(tl.float32), 0.0), axis=1)[:, None]")
        w.indent -= 1
        w.emit(f"mean = total / {cols}")
        w.emit(f"sq = tl.zeros([{br}, 1], tl.float32)")
        _row_loop(w, cols, bn)
        x = ExprEmitter(w).value(spec.src, _row_ctx(w, shape, cols))
        w.emit(f"d = tl.where(mask, {x}.to(tl.float32) - mean, 0.0)")
        w.emit("sq += tl.sum(d * d, axis=1)[:, None]")
        w.indent -= 1
        w.emit(f"rstd = tl.rsqrt(sq / {cols} + {spec.eps!r})")
        emitter, ctx = last_walk()
        w.emit("y = (x.to(tl.float32) - mean) * rstd")
    if spec.weight is not None:
        w.emit(f"y = y * {emitter.value(spec.weight, ctx)}.to(tl.float32)")
    if spec.bias is not None:
        w.emit(f"y = y + {emitter.value(spec.bias, ctx)}.to(tl.float32)")
    value = ExprEmitter(w, acc="y").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{br}, {bn}]")
    w.indent -= 1
    return (cdiv(rows, br), 1, 1), 4 if bn >= 256 else 2, 1


# ---- GEMM -------------------------------------------------------------------------------------
def _dot_dtype(*exprs) -> str:
    kinds = {e.dtype for e in exprs}
    for low in ("bfloat16", "float16"):
        if low in kinds:
            return low
    return "float32"


def matmul(kernel: Kernel, w: Writer):
    spec = kernel.spec
    m, n, k, batch = spec.m, spec.n, spec.k, spec.batch
    plan = spec.plan
    if plan.gemv:
        return _gemv_persistent(kernel, w, plan) if plan.programs else _gemv(kernel, w, plan)
    bm, bn, bk, split = plan.bm, plan.bn, plan.bk, plan.split
    dot_t = _dot_dtype(spec.a, spec.b)
    prec = ""
    if dot_t == "float32":
        prec = f", input_precision=\"{spec.fp32_precision}\""
    ext = kernel.ext or (None, None, None)
    k_ext = spec.k_ext
    skip_k = k_ext is not None and is_prefix(k_ext)
    even_k = k % (bk * split) == 0 and k_ext is None
    chunk = cdiv(cdiv(k, split), bk) * bk if split > 1 else k
    tl_dot = TL_TYPE[dot_t]
    # With PDL the first K step's weight tiles are loaded before gdc_wait(), while the kernels
    # before this one finish (the weight operand of a linear layer: docs/design-pdl.md).
    operands = {"a": spec.a, "b": spec.b}
    early = [op for op in operands if w.prefetch and not skip_k and _weights_only(operands[op])]

    def ids():
        w.emit(f"rm = tl.program_id(0) * {bm} + tl.arange(0, {bm})")
        w.emit(f"rn = tl.program_id(1) * {bn} + tl.arange(0, {bn})")
        if split > 1:
            # split-K: program z handles batch z % batch and the K range (z // batch) * chunk,
            # and stores its partial sums at z: the reduction reads them as [split, batch, m, n]
            w.emit(f"bz = tl.program_id(2) % {batch}")
            w.emit(f"k_lo = (tl.program_id(2) // {batch}) * {chunk}")
        else:
            w.emit("bz = tl.program_id(2)")
            w.emit("k_lo = 0")

    # Masks only where a tile can overrun or padding begins: a mask Triton cannot prove constant
    # along the contiguous axis turns 16-byte vector loads into scalar ones.
    def m_term():
        return _and_terms(None if m % bm == 0 else f"(rm[:, None] < {m})",
                          _dim_valid(w, ext[1], "rm[:, None]"), _dim_valid(w, ext[0], "bz"))

    def n_term():
        return _and_terms(None if n % bn == 0 else f"(rn[None, :] < {n})",
                          _dim_valid(w, ext[2], "rn[None, :]"))

    def operand(op: str, kk: str) -> str:
        """Emit the `op` tile of the K step at `kk` (rk already set); return its variable."""
        if op == "a":
            mask = _mask(w, "mask_a", m_term(), None if even_k else _and_terms(
                f"(rk[None, :] < {k})", _dim_valid(w, k_ext, "rk[None, :]")))
            ctx = Ctx(w, (batch, m, k), ["bz", "rm[:, None]", "rk[None, :]"], mask=mask,
                      zero="zero_a")
        else:
            mask = _mask(w, "mask_b", None if even_k else _and_terms(
                f"(rk[:, None] < {k})", _dim_valid(w, k_ext, "rk[:, None]")), n_term())
            ctx = Ctx(w, (batch, k, n), ["bz", "rk[:, None]", "rn[None, :]"], mask=mask,
                      zero="zero_b")
        value = ExprEmitter(w).value(operands[op], ctx)
        var = f"{op}{'_early' if kk == 'early' else ''}"
        w.emit(f"{var} = {_masked(value, mask)}.to({tl_dot})")
        return var

    def k_step(kk: str, ready: dict):
        w.emit(f"rk = k_lo + {kk} + tl.arange(0, {bk})")
        a = ready.get("a") or operand("a", kk)
        b = ready.get("b") or operand("b", kk)
        w.emit(f"acc = tl.dot({a}, {b}, acc{prec})")

    def zeros():
        w.emit(f"zero_a = tl.zeros([{bm}, {bk}], tl.int32)")
        w.emit(f"zero_b = tl.zeros([{bk}, {bn}], tl.int32)")

    ready = {}
    if early:
        with w.before_wait():
            ids()
            zeros()
            w.emit(f"rk = k_lo + tl.arange(0, {bk})")
            ready = {op: operand(op, "early") for op in early}
    else:
        ids()
    _exit_beyond(w, ext[1], f"tl.program_id(0) * {bm}")
    _exit_beyond(w, ext[0], "bz")
    if not early:
        zeros()
    w.emit(f"acc = tl.zeros([{bm}, {bn}], tl.float32)")
    if early:   # the first K step, its weight tile in hand; the loop does the rest
        k_step("0", ready)
    w.emit(f"for kk in range({bk if early else 0}, {chunk}, {bk}):")   # static bounds: the
    w.indent += 1                                                     # interpreter needs them
    if skip_k:   # K blocks past the true K are all padding
        w.emit(f"if k_lo + kk < {w.extent(true_size(k_ext, 0))}:")
        w.indent += 1
    k_step("kk", {})
    w.indent -= 2 if skip_k else 1
    m_term, n_term = m_term(), n_term()
    mask = _mask(w, "mask", m_term, n_term)
    w.emit(f"zero = tl.zeros([{bm}, {bn}], tl.int32)")
    own = spec.partial is not None   # split-K summed here (aot/fuse_splitk.py): out [batch, m, n]
    if split > 1 and not own:
        w.emit("bz = tl.program_id(2)")   # partial sums: [split * batch, m, n], z-major
    offsets = f"bz * {m * n} + rm[:, None] * {n} + rn[None, :]"
    ctx = Ctx(w, (batch if own else batch * split, m, n), ["bz", "rm[:, None]", "rn[None, :]"],
              linear=f"({offsets})", mask=mask, zero="zero")
    if own:
        _reduce_own_splits(w, kernel, "acc", f"(tl.program_id(2) // {batch})", offsets,
                           f"(bz * {cdiv(m, bm)} + tl.program_id(0)) * {cdiv(n, bn)} + tl.program_id(1)",
                           mask, f"[{bm}, {bn}]", ctx)
    else:
        value = ExprEmitter(w, acc="acc").value(kernel.epilogue, ctx)
        _store(w, kernel, value, ctx, f"[{bm}, {bn}]")
    warps = plan.warps or (4 if bm * bn <= 64 * 64 else 8)
    return (cdiv(m, bm), cdiv(n, bn), batch * split), warps, plan.stages or 3


def _gemv(kernel: Kernel, w: Writer, plan: GemmPlan):
    """One row of A (a decode step, a batch-1 vector): each program streams `bn` rows of the
    weights through a [bn, bk] fp32 accumulator, reduced once after the K loop. No tensor cores
    (a 1-row MMA tile wastes 15/16 of them) and, by default, no split-K (a program per `bn`
    output columns gives enough programs, and no second kernel to sum partials): on the H200
    this beat cuBLAS on every Llama decode shape (docs/gemv-sweep-2026-12-01.json).

    `plan.ahead`: each K step loads the next step's weight tile before it sums its own, so a
    program with many K steps (a down projection's long K) keeps two tiles in flight: Triton's
    num_stages pipelines only loads that feed a dot.

    `plan.split` (GEMV_SPLIT_MIN_K): program (i, z) sums the K range (z // batch) * chunk of
    batch z % batch into the float32 partial row z, which a reduction kernel sums with the
    epilogue (lowering emits it). A GEMV of few output rows and a long K (Llama-3.2-1B's down
    projection: 512 programs walking 8 serial K steps, 2.5 TB/s in the decode graph) gets more
    programs with fewer steps each, so more weights are in flight.

    `spec.pair` (fuse_rows.pair_gemv_rows): each program also streams the weight rows `pair`
    further on (`bh`, summed into `acc_hi`), so that its epilogue holds a gate and its up side by
    side and stores silu(gate) * up, the next GEMV's row, instead of both."""
    spec = kernel.spec
    n, k, batch = spec.n, spec.k, spec.batch
    pair = spec.pair
    outs = pair or n   # output columns: a paired GEMV's are its first `pair` weight columns
    bn, bk, split = plan.bn, plan.bk, plan.split
    chunk = k // split
    ext = kernel.ext or (None, None, None)
    k_ext = spec.k_ext
    skip_k = k_ext is not None and is_prefix(k_ext)
    even_k = k % bk == 0 and k_ext is None
    ahead = plan.ahead > 0 and not skip_k and cdiv(k, bk) > 1
    operands = {"a": spec.a, "b": spec.b, **({"bh": spec.b} if pair else {})}
    early = [op for op in operands if w.prefetch and not skip_k and _weights_only(operands[op])
             and not (ahead and op == "a")]

    def ids():
        w.emit(f"rn = tl.program_id(0) * {bn} + tl.arange(0, {bn})")
        if pair:
            w.emit(f"rn_hi = rn + {pair}")
        if split > 1:
            w.emit(f"bz = tl.program_id(1) % {batch}")
            w.emit(f"k_lo = (tl.program_id(1) // {batch}) * {chunk}")
        else:
            w.emit("bz = tl.program_id(1)")
        w.emit(f"zero_a = tl.zeros([1, {bk}], tl.int32)")

    def operand(op: str, kk: str, rk: str = "rk", var: str | None = None) -> str:
        """Emit the `op` tile of the K step whose columns are `rk`; return its variable (`var`,
        else one named after `kk`). Masked past K where K is uneven or `rk` may run past it."""
        k_term = None if even_k and rk == "rk" else _and_terms(
            f"({rk}[None, :] < {k})", _dim_valid(w, k_ext, f"{rk}[None, :]"))
        b_term = _dim_valid(w, ext[0], "bz")
        if op == "a":
            mask = _mask(w, "mask_a", k_term, b_term)
            ctx = Ctx(w, (batch, 1, k), ["bz", "zero_a", f"{rk}[None, :]"], mask=mask,
                      zero="zero_a")
        else:   # rows rn (`bh`: rn_hi, a paired GEMV's partner rows) of the weights
            n_term = _and_terms(None if outs % bn == 0 else f"(rn[:, None] < {outs})",
                                _dim_valid(w, ext[2], "rn[:, None]"))
            mask = _mask(w, "mask_b", k_term, n_term, b_term)
            w.emit(f"zero_b = tl.zeros([{bn}, {bk}], tl.int32)")
            rows = "rn_hi" if op == "bh" else "rn"
            ctx = Ctx(w, (batch, k, n), ["bz", f"{rk}[None, :]", f"{rows}[:, None]"], mask=mask,
                      zero="zero_b")
        value = ExprEmitter(w, acc="stat" if op == "a" else None).value(operands[op], ctx)
        # early K steps' tiles: b_early (the first, its name before there were more), b_early1...
        var = var or (op if not kk.startswith("early") else
                      f"{op}_{'early' if kk == 'early0' else kk}")
        w.emit(f"{var} = {_masked(value, mask)}.to(tl.float32)")
        return var

    in_loop = spec.stat is not None and spec.stat_scale is not None
    init = REDUCE_INIT[spec.stat_op] if spec.stat is not None else None

    def k_step(kk: str, ready: dict):
        w.emit(f"rk = {kk} + tl.arange(0, {bk})")
        if ahead:   # this step's weights were loaded a step ago; the next step's go in flight
            w.emit("b = b_next")
            w.emit(f"rk_next = rk + {bk}")
            operand("b", "next", rk="rk_next", var="b_next")
        a = ready.get("a") or operand("a", kk)
        b = "b" if ahead else ready.get("b") or operand("b", kk)
        w.emit(f"acc += {b} * {a}")
        if pair:
            w.emit(f"acc_hi += {ready.get('bh') or operand('bh', kk)} * {a}")
        if in_loop:   # the row statistic from the elements this step walks (fuse_stats.py)
            mask = "None" if even_k else _mask(w, "mask_s", f"(rk[None, :] < {k})")
            v = _stat_elements(w, spec, mask)
            w.emit("s_acc = " + REDUCE_COMBINE[spec.stat_op].format(acc="s_acc", v=v))

    def first_weights():   # ahead: the first K step's weight tile, before the loop
        w.emit(f"rk_next = tl.arange(0, {bk})")
        operand("b", "next", rk="rk_next", var="b_next")

    steps = cdiv(chunk, bk)
    early_steps = 0 if ahead or not early else min(steps, GEMV_PREFETCH_STEPS)
    if early and not ahead and n * k * ITEMSIZE[spec.b.dtype] <= GEMV_PREFETCH_ALL_MAX_BYTES:
        early_steps = steps   # a small GEMV: all of its weights in flight before the wait
    lo = "k_lo + " if split > 1 else ""   # where this program's K range starts
    ready = []
    if early:
        with w.before_wait():
            ids()
            if ahead:
                first_weights()
            for i in range(early_steps):
                w.emit(f"rk = {lo}{f'{i * bk} + ' if i else ''}tl.arange(0, {bk})")
                ready.append({op: operand(op, f"early{i}") for op in early})
    else:
        ids()
    _exit_beyond(w, ext[1], "0")
    _exit_beyond(w, ext[0], "bz")
    if ahead and not early:
        first_weights()
    if in_loop:
        w.emit(f"s_acc = tl.full([1, {bk}], {init}, tl.float32)")
    elif spec.stat is not None:
        _row_stat(w, spec)
    w.emit(f"acc = tl.zeros([{bn}, {bk}], tl.float32)")
    if pair:
        w.emit(f"acc_hi = tl.zeros([{bn}, {bk}], tl.float32)")
    for i, got in enumerate(ready):
        k_step(f"{lo}{i * bk}", got)
    if early_steps < steps:
        w.emit(f"for kk in range({early_steps * bk}, {chunk}, {bk}):")   # static trip count
        w.indent += 1
        if skip_k:
            w.emit(f"if kk < {w.extent(true_size(k_ext, 0))}:")
            w.indent += 1
        k_step(f"{lo}kk", {})
        w.indent -= 2 if skip_k else 1
    w.emit("acc_n = tl.sum(acc, axis=1)")
    if pair:
        w.emit("acc_p = tl.sum(acc_hi, axis=1)")
    if in_loop:
        w.emit(f"stat = {REDUCE_FN[spec.stat_op]}(s_acc)")
        scale = ExprEmitter(w, acc="stat").value(spec.stat_scale, Ctx(w, ()))
        w.emit(f"acc_n = acc_n * {scale}")
        if pair:
            w.emit(f"acc_p = acc_p * {scale}")
    mask = _mask(w, "mask", None if outs % bn == 0 else f"(rn < {outs})",
                 _dim_valid(w, ext[2], "rn"), _dim_valid(w, ext[0], "bz"))
    w.emit(f"zero = tl.zeros([{bn}], tl.int32)")
    own = spec.partial is not None   # split-K summed here (aot/fuse_splitk.py): out [batch, 1, n]
    if split > 1 and not own:
        w.emit("bz = tl.program_id(1)")   # partial sums: [split * batch, 1, n], split-major
    offsets = f"bz * {outs} + rn"
    ctx = Ctx(w, (batch if own else batch * split, 1, outs), ["bz", "zero", "rn"],
              linear=f"({offsets})", mask=mask, zero="zero")
    if own:
        _reduce_own_splits(w, kernel, "acc_n", f"(tl.program_id(1) // {batch})", offsets,
                           f"bz * {cdiv(n, bn)} + tl.program_id(0)", mask, f"[{bn}]", ctx)
    else:
        value = ExprEmitter(w, acc="acc_n", partner="acc_p" if pair else None).value(
            kernel.epilogue, ctx)
        _store(w, kernel, value, ctx, f"[{bn}]")
    return (cdiv(outs, bn), batch * split, 1), GEMV_WARPS, GEMV_STAGES


def _gemv_persistent(kernel: Kernel, w: Writer, plan: GemmPlan):
    """A GEMV whose row fits one tile (K <= GEMV_PERSISTENT_MAX_K): `plan.programs` programs per
    batch row, each computing the row once for the whole K (an RMSNorm expression costs a pass
    over L2 per program, not per tile) and then walking every `programs`-th tile of `bn` weight
    rows, the next tile's weights loaded before this one is summed. The template above recomputes
    the row per program and walks K in serial steps; at K = 4096 this ran the Llama-3-8B decode
    GEMVs 6-16% faster on the H200 timed alone, and the whole decode graph 2% faster at 2
    programs per SM (4 per SM, the best alone, made it 6% slower: the comment at
    GEMV_PERSISTENT_MIN_K). The loop has static bounds (Triton's interpreter runs these kernels
    on the CPU): a program whose last turn is past the last tile loads and stores nothing in it.
    A dynamic K is masked at its extent.

    `plan.split` (GEMV_PERSISTENT_SPLIT_MIN_K): K in `split` even chunks; program (i, z) holds
    chunk z // batch of batch row z % batch and stores its partial sums at row z, which the
    split-K reduction (lowering emits it) sums with the epilogue, as the template's split does.

    `spec.pair`: each tile's weight rows `pair` further on come with it (`b_hi`), as in the
    template (_gemv)."""
    spec = kernel.spec
    n, k, batch, split = spec.n, spec.k, spec.batch, plan.split
    bn, kp, programs = plan.bn, plan.bk, plan.programs
    pair = spec.pair
    outs = pair or n   # output columns: a paired GEMV's are its first `pair` weight columns
    chunk = k // split
    ext = kernel.ext or (None, None, None)
    turns = cdiv(cdiv(outs, bn), programs)

    # asked for where they are used: a dynamic extent comes from the table, which the code before
    # gdc_wait() must not read (Writer raises NotBeforeWait there, and the kernel is generated
    # again without the early load). A chunk's mask is on the column within it (a constant bound:
    # the loads stay 16-byte vectors); the dynamic extent's on the column in the whole row.
    def k_term():
        bound = None if chunk == kp else (f"(rc[None, :] < {chunk})" if split > 1 else
                                          f"(rk[None, :] < {k})")
        return _and_terms(bound, _dim_valid(w, spec.k_ext, "rk[None, :]"))

    def b_term():
        return _dim_valid(w, ext[0], "bz")

    early = w.prefetch and _weights_only(spec.b)

    def ids():
        if split > 1:
            w.emit(f"bz = tl.program_id(1) % {batch}")
            w.emit(f"rc = tl.arange(0, {kp})")
            w.emit(f"rk = (tl.program_id(1) // {batch}) * {chunk} + rc")
        else:
            w.emit("bz = tl.program_id(1)")
            w.emit(f"rk = tl.arange(0, {kp})")
        w.emit(f"rn_next = tl.program_id(0) * {bn} + tl.arange(0, {bn})")
        w.emit(f"zero_b = tl.zeros([{bn}, {kp}], tl.int32)")

    def weights():   # the tile at rn_next into b_next; the tile past the last loads nothing
        n_term = _and_terms(f"(rn_next[:, None] < {outs})",
                            _dim_valid(w, ext[2], "rn_next[:, None]"))
        mask = _mask(w, "mask_b", k_term(), n_term, b_term())
        cast = "" if GEMV_PERSISTENT_CAST_LATE else ".to(tl.float32)"
        if pair:
            w.emit(f"rn_next_hi = rn_next + {pair}")
        for var, rows in (("b_next", "rn_next"), ("b_next_hi", "rn_next_hi"))[:2 if pair else 1]:
            ctx = Ctx(w, (batch, k, n), ["bz", "rk[None, :]", f"{rows}[:, None]"], mask=mask,
                      zero="zero_b")
            w.emit(f"{var} = {_masked(ExprEmitter(w).value(spec.b, ctx), mask)}{cast}")

    if early:
        with w.before_wait():
            ids()
            weights()
    else:
        ids()
    _exit_beyond(w, ext[1], "0")
    _exit_beyond(w, ext[0], "bz")
    if not early:
        weights()
    w.emit(f"zero_a = tl.zeros([1, {kp}], tl.int32)")
    mask = _mask(w, "mask_a", k_term(), b_term())
    if spec.stat is not None:
        _row_stat_whole(w, spec, mask)
    ctx = Ctx(w, (batch, 1, k), ["bz", "zero_a", "rk[None, :]"], mask=mask, zero="zero_a")
    w.emit(f"a = {_masked(ExprEmitter(w, acc='stat').value(spec.a, ctx), mask)}.to(tl.float32)")
    scale = None   # the statistic factored out of the row (fuse_stats._factor) scales the sums
    if spec.stat_scale is not None:
        scale = ExprEmitter(w, acc="stat").value(spec.stat_scale, Ctx(w, ()))
        w.emit(f"scale = {scale}")
    # where the sums go: the output row, or with split-K the partial row [split * batch, 1, n]
    out_z, out_rows = ("bz", batch) if split == 1 else ("bo", batch * split)
    if split > 1:
        w.emit("bo = tl.program_id(1)")
    w.emit(f"for turn in range(0, {turns}):")
    w.indent += 1
    w.emit(f"rn = (tl.program_id(0) + turn * {programs}) * {bn} + tl.arange(0, {bn})")
    w.emit("b = b_next")
    if pair:
        w.emit("b_hi = b_next_hi")
    w.emit(f"rn_next = rn + {programs * bn}")
    weights()
    for acc, b in (("acc_n", "b"), ("acc_p", "b_hi"))[:2 if pair else 1]:
        w.emit(f"{acc} = tl.sum({b}.to(tl.float32) * a, axis=1)" if GEMV_PERSISTENT_CAST_LATE
               else f"{acc} = tl.sum({b} * a, axis=1)")
        if scale is not None:
            w.emit(f"{acc} = {acc} * scale")
    mask = _mask(w, "mask", f"(rn < {outs})", _dim_valid(w, ext[2], "rn"), b_term())
    w.emit(f"zero = tl.zeros([{bn}], tl.int32)")
    ctx = Ctx(w, (out_rows, 1, outs), [out_z, "zero", "rn"], linear=f"({out_z} * {outs} + rn)",
              mask=mask, zero="zero")
    value = ExprEmitter(w, acc="acc_n", partner="acc_p" if pair else None).value(kernel.epilogue,
                                                                                   ctx)
    _store(w, kernel, value, ctx, f"[{bn}]")
    w.indent -= 1
    return (programs, batch * split, 1), plan.warps or GEMV_PERSISTENT_WARPS, 1


def _row_stat_whole(w: Writer, spec, mask: str):
    """The persistent GEMV's row statistic (fuse_stats.py) into `stat`: the row is one tile of
    `rk` columns, so the statistic is one block reduction over the elements the program loads
    for its row anyway (fuse_stats._gemv_reader folds here only along K, batch 1: the stat's one
    long dimension is the row's). Its loads go in parallel with the row's, after the wait."""
    w.emit(f"stat = {REDUCE_FN[spec.stat_op]}({_stat_elements(w, spec, mask)})")


def _stat_elements(w: Writer, spec, mask: str) -> str:
    """The row statistic's elements at the row's columns `rk` (its one long dimension is K:
    fuse_stats._along_k), in float32, the reduction's identity where `mask` is off."""
    dims = ["rk[None, :]" if size != 1 else "zero_a" for size in spec.stat_shape]
    value = ExprEmitter(w).value(spec.stat, Ctx(w, spec.stat_shape, dims, mask=mask,
                                                zero="zero_a"))
    value = f"{value}.to(tl.float32)"
    return value if mask == "None" else f"tl.where({mask}, {value}, {REDUCE_INIT[spec.stat_op]})"


def _row_stat(w: Writer, spec):
    """The GEMV's row statistic (fuse_stats.py) into `stat`, a scalar its row operand reads as
    `Acc`: the one-row reduction its own kernel would have stored, reduced by this program in a
    pass before its K loop (the form without `stat_scale`)."""
    shape, rdims = spec.stat_shape, spec.stat_rdims
    cols = numel([shape[d] for d in rdims])
    bs = min(next_pow2(max(cols, 2)), 1024)
    init = REDUCE_INIT[spec.stat_op]
    w.emit(f"s_zero = tl.zeros([{bs}], tl.int32)")
    w.emit(f"s_acc = tl.full([{bs}], {init}, tl.float32)")
    w.emit(f"for s0 in range(0, {cols}, {bs}):")
    w.indent += 1
    w.emit(f"s_cols = s0 + tl.arange(0, {bs})")
    mask = "None"
    if cols % bs:
        w.emit(f"s_mask = s_cols < {cols}")
        mask = "s_mask"
    red_ctx = Ctx(w, [shape[d] for d in rdims], linear="s_cols")
    dims = [red_ctx.dim(rdims.index(d)) if d in rdims else "s_zero" for d in range(len(shape))]
    value = ExprEmitter(w).value(spec.stat, Ctx(w, shape, dims, mask=mask, zero="s_zero"))
    value = f"{value}.to(tl.float32)"
    if mask != "None":
        value = f"tl.where(s_mask, {value}, {init})"
    w.emit("s_acc = " + REDUCE_COMBINE[spec.stat_op].format(acc="s_acc", v=value))
    w.indent -= 1
    w.emit(f"stat = {REDUCE_FN[spec.stat_op]}(s_acc, axis=0)")


ATTN_MAX_BLOCK_N = 128  # keys per attention step: fewer, larger steps shorten the serial loop
# Split-KV attention (a decode step) loads a key block's values with its keys, before the scores:
# both tiles in flight at once. Its splits walk one block or a few, so the loads were two serial
# trips to memory. In the Llama-1B decode graph on the H200: attention and combine 94.6 -> 89.9 µs
# a token, generate() 0.834 -> 0.820 ms (docs/performance.md, fourteenth session). Unsplit
# attention keeps its order: its loop is software-pipelined.
ATTN_V_EARLY = True
# Unsplit attention (an encoder's, a prefill's): its warps, pipeline stages and query-row tile
# (ATTN_BM = 0: attention_plan's rule, 16 or 32 rows to fill the chip), and whether it loads a key
# block's values with its keys. Knobs for A/B runs (`--variant`). On ViT-S (H200, seventeenth
# session, one run, ms a call against 0.415): 8 warps 0.412, 1 stage 0.411, 3 stages 0.427, values
# early 0.412 (ties); 32-row tiles 0.437, 64-row 0.469 (fewer programs: slower).
ATTN_WARPS = 4
ATTN_STAGES = 2
ATTN_BM = 0
ATTN_V_EARLY_UNSPLIT = False
GEMM_MIN_BM = 16  # smallest row tile (64 measured no faster once masks were fixed, and split more)


def _weights_only(expr) -> bool:
    """An operand computed from weights alone (a linear layer's W or W^T), so loading it needs
    nothing another node writes."""
    found = loads(expr)
    return bool(found) and all(ld.buf.kind == "weight" for ld in found)


def _mask(w: Writer, name: str, *terms) -> str:
    """Bind the conjunction of the non-None terms to `name`; "None" when nothing can overrun."""
    terms = [t for t in terms if t]
    if not terms:
        return "None"
    w.emit(f"{name} = {' & '.join(terms)}")
    return name


def _and_terms(*terms) -> str | None:
    terms = [t for t in terms if t]
    return " & ".join(terms) if terms else None


def _masked(value: str, mask: str) -> str:
    return value if mask == "None" else f"tl.where({mask}, {value}, 0.0)"


def _reduce_own_splits(w: Writer, kernel: Kernel, acc: str, z: str, part: str, tile: str,
                       mask: str, tile_shape: str, final_ctx: Ctx):
    """A split-K matmul that sums its own splits (aot/fuse_splitk.py): store this program's
    partial sums `acc` into split `z` of the float32 partial buffer ([split, batch, m, n]) at
    `part` (the offsets within one split), count the program in the tile's arrival word, and
    let the tile's last program add up every split
    (reading around L1: the arena's bytes were other buffers' earlier in the graph), apply the
    epilogue through `final_ctx` and put the word back to zero for the next kernel. The barrier
    before the count orders the program's stores before its one-thread atomic (acq_rel at GPU
    scope, as Triton emits it); the program that sees the others' counts sees their stores."""
    spec = kernel.spec
    split = spec.plan.split
    partial, arrivals = w.ptr(spec.partial), w.ptr(spec.arrivals)
    step = numel(spec.partial.shape) // split
    w.emit(f"tl.store({partial} + {z} * {step} + {part}, {acc}"
           + ("" if mask == "None" else f", mask={mask}") + ")")
    w.emit("tl.debug_barrier()")
    w.emit(f"arrived = tl.atomic_add({arrivals} + {tile}, 1)")
    w.emit(f"if arrived == {split - 1}:")
    w.indent += 1
    w.emit(f"total = tl.zeros({tile_shape}, tl.float32)")
    w.emit(f"for s in tl.static_range({split}):")
    w.emit(f"    total += tl.load({partial} + s * {step} + {part}"
           + ("" if mask == "None" else f", mask={mask}, other=0.0")
           + ", cache_modifier=\".cg\")")
    value = ExprEmitter(w, acc="total").value(kernel.epilogue, final_ctx)
    _store(w, kernel, value, final_ctx, tile_shape)
    w.emit(f"tl.atomic_xchg({arrivals} + {tile}, 0)")
    w.indent -= 1


@dataclass(frozen=True)
class GemmPlan:
    """A GEMM's tiles, decided once by lowering (gemm_plan) and kept in its spec
    (families.Matmul.plan): lowering emits the split-K reduction, the template tiles by it."""

    bm: int
    bn: int
    bk: int
    split: int       # split-K factor: partial sums are reduced by a second kernel
    gemv: bool = False   # M = 1: the GEMV template (bn output columns per program, no MMA)
    # from a measured tile (gemm_tiles.py); 0: the template's default for the tile
    warps: int = 0
    stages: int = 0
    programs: int = 0    # GEMV: a persistent grid of this many programs per batch row (0: none)
    ahead: int = 0       # GEMV: K steps of weights loaded ahead of the one being summed


# The GEMV's tile, measured inside the Llama-1B decode graph on the H200 (docs/performance.md,
# 2026-12-02, eighth session: one package per setting, ms per token of run()). In a graph the row
# operand is an expression (an RMSNorm's x * rsqrt(mean) * w) that every program recomputes for
# its K step, so rows per program amortise it: 4 x 1024 beat 2 x 1024 (the isolated-GEMV sweep's
# choice, docs/gemv-sweep-2026-12-01.json, where the row was a plain vector) by 6-7%, and 8 x 512
# by 2%. Loading more K steps before gdc_wait() (2 or 4) lost 6%, 8 warps lost 18%, 2 stages
# changed nothing (docs/bench-2026-12-02-decode-1b-gemv-variants.json). 8 x 1024 lost 12% (H200,
# fifteenth session: generate() 0.823 -> 0.926 ms/token, the GEMVs 602 -> 680 us a token).
GEMV_PREFETCH_STEPS = 1   # K steps of its weights a GEMV loads before gdc_wait() (PDL)
# ...and every K step, for a GEMV of at most this many weight bytes (0: none). Meant for the small
# projections behind attention (Llama-1B's o: 8 MB, 512 programs of 2 steps, ran at 2 TB/s in the
# decode graph, half its weights loaded before the wait). At 16 MB the 1B's o projections gained
# 7.8 µs a token but its attention lost 7.2 and the big GEMVs 4.8: run() 0.862 -> 0.865 ms
# (docs/performance.md, fourteenth session). At 8 MB (the o projections only) an H100 gained
# 8.8 and 11.1 µs of span a token, run() -1.9% and -1.1% (twenty-fourth and twenty-ninth
# sessions). On the H200 at 8 MB (thirty-first session): span 791.5 -> 783.9 µs, run() 0.837 ->
# 0.819, generate() 0.796 -> 0.790 ms/token; with fuse_rows.PAIR_GATE_UP 774.6 -> 767.8 µs and
# generate() 0.789 -> 0.769. On: it reaches only decode GEMVs (M = 1) of at most 8 MB. At 70 MB
# (every 1B GEMV but the head) an H100 lost 38 µs of span, generate() 0.988 -> 1.017 ms: the
# plain GEMVs gained 19 µs, the o projections with their adds lost 48 (thirty-fourth session).
GEMV_PREFETCH_ALL_MAX_BYTES = 8 << 20
GEMV_BK = 1024     # K step: the columns of a weight row a program loads per step
GEMV_WARPS = 4
GEMV_STAGES = 1
GEMV_TILE = 4096   # weight elements per program per K step (rows = GEMV_TILE // K step)
# Two other GEMV forms. The persistent form (_gemv_persistent) takes a row of K in
# [GEMV_PERSISTENT_MIN_K, GEMV_PERSISTENT_MAX_K], one tile of next_pow2(K) columns: tiles of
# GEMV_PERSISTENT_ROWS weight rows, GEMV_PERSISTENT_PER_SM programs per SM, GEMV_PERSISTENT_WARPS
# warps. The long-row form (off: GEMV_LONG_K = 0) takes K past GEMV_LONG_K: GEMV_LONG_TILE tiles
# with the next K step's weights in flight. Timed alone on the H200 as graph chains with the row a
# decode graph gives each GEMV (`gemv_sweep --rows`, docs/performance.md, 2026-12-02), us per
# GEMV: Llama-3-8B qkv 16.6 -> 13.9 (persistent, 4 per SM), o 10.7 -> 10.0, gate+up 58.4 -> 54.6,
# down (K 14336) 32.3 -> 30.8 (long row); Llama-3.2-1B down (K 8192) 14.0 -> 12.6. Inside the 8B
# decode graph, behind programmatic edges (2026-12-03, bench_decode --variant), ms/token: neither
# 4.578, long row 4.734, both 4.994, both at 2 per SM 4.680; then in one later run neither 4.574,
# persistent at 2 per SM 4.472 (the default), at 1 per SM 5.607. At K = 2048 (the 1B's GEMVs) the
# persistent form tied or lost alone (gate+up 17.8 -> 18.5) and lost in the Llama-1B decode graph
# (2 per SM: 0.973 -> 1.134 ms/token, 2026-12-03), so the template keeps those.
GEMV_PERSISTENT_MIN_K = 2049
GEMV_PERSISTENT_MAX_K = 4096
# 4 rows a tile, not 2: a program holds one tile in flight while it sums the one before, so at
# 2 programs per SM the rows set the bytes in flight per SM (2 x 16 KiB at 2 rows), and that
# bounded the 8B's big GEMVs at ~4.0 TB/s. At 4 rows (32 KiB a tile, 105 registers a thread: two
# programs still fit an SM) the 8B decode token took 4.081 ms against 4.182 (generate(), one
# process; gate+up 4.0 -> 4.2 TB/s, the head 4.2 -> 4.5; docs/performance.md, 2026-12-04
# twenty-first session). 8 rows (184 registers) leave one program an SM.
GEMV_PERSISTENT_ROWS = 4
GEMV_PERSISTENT_PER_SM = 2
GEMV_PERSISTENT_WARPS = 8
# Keep the weight tiles in flight in their stored dtype and widen them at the multiply: half the
# registers of two fp32 tiles (2 x 4096 at 8 warps: 32 a thread each), so more programs can be
# resident beside a PDL predecessor. Off until timed in the decode graph (--variant).
GEMV_PERSISTENT_CAST_LATE = False
# Split-K for a GEMV of K >= GEMV_SPLIT_MIN_K (0: off) while it stays within GEMV_SPLIT_PER_SM
# programs per SM (even K chunks only): its partial rows are summed by a reduction kernel that
# applies the epilogue. For GEMVs whose few programs walk long rows serially: in the Llama-3.2-1B
# decode graph on the H200 the down projection (2048 x 8192: 512 programs of 8 K steps) streamed
# 2.5 TB/s, the gate+up GEMVs (4096 programs of 2 steps) 3.6-4.2 (profile_kernels --timeline,
# docs/performance.md, 2026-12-03). Split 4 ways there: 0.972 -> 0.920 ms/token alone, 0.869 with
# the shared residual stream and packed GQA heads (bench_decode --variant, 2026-12-03).
GEMV_SPLIT_MIN_K = 8192
# The persistent form for a K past GEMV_PERSISTENT_MAX_K (from this K; 0: off): K split in the
# fewest power-of-two chunks of at most GEMV_PERSISTENT_MAX_K columns, each chunk's programs
# holding their chunk of the row and walking the weight tiles of it; the float32 partial rows are
# summed by the split-K reduction. For Llama-3-8B's down projection (K 14336: 4 chunks of 3584),
# which the template streams at ~4.0 TB/s in the decode graph where the persistent gate+up before
# it reaches 4.2. Timed on the H200 (bench_decode --variant, 2026-12-04): the 8B's down 943 -> 916
# µs a token, its 4 partial rows' sums 36 -> 51; generate() 4.062 -> 4.058 ms/token, Llama-1B
# 0.799 -> 0.805. Off until its sums go (into the RMSNorm that reads them).
GEMV_PERSISTENT_SPLIT_MIN_K = 0
GEMV_SPLIT_PER_SM = 16
GEMV_LONG_K = 0         # past this K: GEMV_LONG_TILE tiles, GEMV_LONG_AHEAD steps ahead; 0: off
GEMV_LONG_TILE = (4, 512)
GEMV_LONG_AHEAD = 1


def gemm_plan(m: int, n: int, k: int, batch: int, itemsize: int, sm_count: int,
              measured: Tile | None = None, split_k: bool = True) -> GemmPlan:
    """Tiles for a batch-1-sized GEMM on a part with `sm_count` multiprocessors (a grid smaller
    than that leaves some idle). `measured`: the GPU's measured tile for this shape (M >= 128,
    gemm_tiles.measured_tile), taken as it is, with its split-K factor (it was timed so). One row of
    A: a GEMV, when its programs fill the chip or K is short enough that a program's serial walk
    is. Otherwise the largest output tile that still gives every multiprocessor a program; a K
    step as deep as ~32 KiB of operands per pipeline stage allows (few, deep iterations hide load
    latency); and split-K when even the smallest tiles leave most of the chip idle and K is
    deep. `split_k` False (a dynamic batch or K: no partial sums over them): no split-K."""
    if measured is not None:
        bk = min(measured.bk, max(16, next_pow2(k)))
        split = measured.split if (split_k and measured.split > 1
                                   and k // measured.split >= bk) else 1
        return GemmPlan(min(measured.bm, max(16, next_pow2(m))),
                        min(measured.bn, max(32, next_pow2(n))), bk, split,
                        warps=measured.warps, stages=measured.stages)
    if m == 1:
        split = 1
        if split_k and GEMV_PERSISTENT_SPLIT_MIN_K and k >= max(GEMV_PERSISTENT_SPLIT_MIN_K,
                                                                GEMV_PERSISTENT_MAX_K + 1):
            split = 2
            while k % split == 0 and k // split > GEMV_PERSISTENT_MAX_K:
                split *= 2
        if GEMV_PERSISTENT_MIN_K <= k <= GEMV_PERSISTENT_MAX_K or (
                split > 1 and k % split == 0 and k // split <= GEMV_PERSISTENT_MAX_K):
            bn = GEMV_PERSISTENT_ROWS
            programs = min(cdiv(n, bn), max(1, GEMV_PERSISTENT_PER_SM * sm_count // (batch * split)))
            return GemmPlan(1, bn, next_pow2(k // split), split, gemv=True, programs=programs)
        bk = min(GEMV_BK, max(16, next_pow2(k)))
        bn = min(max(2, GEMV_TILE // bk), max(2, next_pow2(n)))
        ahead = 0
        if GEMV_LONG_K and k > GEMV_LONG_K:
            bn, bk = min(GEMV_LONG_TILE[0], max(2, next_pow2(n))), GEMV_LONG_TILE[1]
            ahead = GEMV_LONG_AHEAD
        if cdiv(n, bn) * batch >= sm_count // 2 or k <= 8192:
            split = 1
            if split_k and GEMV_SPLIT_MIN_K and k >= GEMV_SPLIT_MIN_K and not ahead:
                while (cdiv(n, bn) * batch * split * 2 <= GEMV_SPLIT_PER_SM * sm_count
                       and k % (split * 2 * bk) == 0):
                    split *= 2
            return GemmPlan(1, bn, bk, split, gemv=True, ahead=ahead)
    # (32, 32) is left out: with tf32x3 and a deep K step it ran 2-5x slower than both its
    # neighbours on the H200 (docs/performance.md, run 8).
    fits = [(bm, bn) for bm, bn in ((128, 128), (128, 64), (64, 128), (64, 64), (64, 32),
                                    (32, 64), (16, 64), (16, 32))
            if bm <= max(16, next_pow2(m)) and bn <= max(32, next_pow2(n))
            and (bm >= GEMM_MIN_BM or m < GEMM_MIN_BM)]
    bm, bn = fits[-1]
    for cand in fits:
        if cdiv(m, cand[0]) * cdiv(n, cand[1]) * batch >= sm_count:
            bm, bn = cand
            break
    bk = 1 << ((32768 // ((bm + bn) * itemsize)).bit_length() - 1)
    bk = max(16, min(bk, 256, next_pow2(k)))
    programs = cdiv(m, bm) * cdiv(n, bn) * batch
    split = 1
    while split_k and programs * split * 2 <= 2 * sm_count and k // (split * 2) >= 4 * bk:
        split *= 2
    return GemmPlan(bm, bn, bk, split)


# ---- attention --------------------------------------------------------------------------------
def head_block(d: int) -> int:
    """The columns an attention tile gives a head dimension of `d` (a dot needs at least 16)."""
    return max(16, next_pow2(d))


def attention(kernel: Kernel, w: Writer):
    p = kernel.spec
    b, h, lq, lk, d, dv = p.b, p.h, p.lq, p.lk, p.d, p.dv
    dot_t = _dot_dtype(p.q, p.k, p.v)
    tl_dot = TL_TYPE[dot_t]
    bm, bn, split, pack = p.plan.bm, p.plan.bn, p.plan.split, p.plan.pack
    chunk = lk // split
    bd, bdv = head_block(d), head_block(dv)
    prec = f", input_precision=\"{p.fp32_precision}\"" if dot_t == "float32" else ""
    # the query rows' head and row: one head per program, or (pack > 1) a key/value head's query
    # heads packed as rows (head ig * pack + rm // lq, row rm % lq); `ih` is where keys and values
    # are read, the same head for every query head of the group (their head map is h // pack)
    heads, rows_q = ("ihr[:, None]", "rq") if pack > 1 else ("ih", "rm")

    def header():
        if pack > 1:
            w.emit(f"rm = tl.arange(0, {bm})")
            w.emit("grp = tl.program_id(1)")
            w.emit(f"ib = grp // {h // pack}")
            w.emit(f"ih = (grp % {h // pack}) * {pack}")
            w.emit(f"ihr = ih + rm // {lq}")
            w.emit(f"rq = rm % {lq}")
        else:
            w.emit(f"rm = tl.program_id(0) * {bm} + tl.arange(0, {bm})")
            w.emit("bh = tl.program_id(1)")
            w.emit(f"ib = bh // {h}")
            w.emit(f"ih = bh % {h}")
        w.emit(f"rd = tl.arange(0, {bd})")
        w.emit(f"rdv = tl.arange(0, {bdv})")

    lq_rows = lq * pack   # query rows a program's tile holds
    appended = p.new_pos is not None
    lk_ext = p.lk_ext
    n_even = lk % bn == 0 and lk_ext is None

    def kv_masks(suffix=""):
        mk = _mask(w, "mask_k" + suffix, None if d == bd else f"(rd[:, None] < {d})",
                   None if n_even else _and_terms(f"(rn[None, :] < {lk})",
                                                  _dim_valid(w, lk_ext, "rn[None, :]")))
        mv = _mask(w, "mask_v" + suffix, None if n_even else _and_terms(
                       f"(rn[:, None] < {lk})", _dim_valid(w, lk_ext, "rn[:, None]")),
                   None if dv == bdv else f"(rdv[None, :] < {dv})")
        return mk, mv

    def load_tile(var, expr, width, dims, mask, new=None, at=None):
        """The key block transposed (`kt`, [bd, bn]) or the value block (`v`, [bn, bdv]); an
        appended position (`new` at `at`) takes this call's key or value instead of the
        cache's."""
        w.emit(f"zero_{var[0]} = tl.zeros([{bd if var[0] == 'k' else bn}, "
               f"{bn if var[0] == 'k' else bdv}], tl.int32)")
        ctx = Ctx(w, (b, h, lk, width), ["ib", "ih"] + dims, mask=mask, zero=f"zero_{var[0]}")
        w.emit(f"{var} = {_masked(ExprEmitter(w).value(expr, ctx), mask)}.to({tl_dot})")
        if new is not None:
            w.emit(f"{var} = tl.where({at} == new_pos, {new}, {var})")

    k_dims, v_dims = ["rn[None, :]", "rd[:, None]"], ["rn[:, None]", "rdv[None, :]"]
    # The KV blocks before the wait (ATTN_KV_BEFORE_WAIT): once fuse_append has moved a decode
    # step's appends after this attention, no node before it writes the caches, so a split
    # program can load its one key block while the QKV projection still runs. Only a block that
    # starts at or before the appended position is loaded early (the keys a causal decode step
    # keeps); the mask test after the wait decides as before, and loads any other block it keeps.
    kv_early = (ATTN_KV_BEFORE_WAIT and w.prefetch and appended and split > 1 and chunk == bn
                and lk_ext is None)
    if kv_early:
        with w.before_wait():
            w.allow_before_wait({ld.buf for e in (p.k, p.v, p.new_pos) for ld in loads(e)})
            header()
            pos = ExprEmitter(w).value(p.new_pos, Ctx(w, (b, h, lk, d), ["ib", "ih", "0", "0"]))
            w.emit(f"new_pos = {pos}")
            w.emit(f"n0 = tl.program_id(2) * {chunk}")
            w.emit(f"rn = n0 + tl.arange(0, {bn})")
            w.emit("early = n0 <= new_pos")
            mk, mv = kv_masks("_e")
            load_tile("kt_early", p.k, d, k_dims, _mask(w, "mask_ke", None if mk == "None" else mk,
                                                        "early"))
            load_tile("v_early", p.v, dv, v_dims, _mask(w, "mask_ve", None if mv == "None" else mv,
                                                        "early"))
    else:
        header()
    ext = kernel.ext or (None,) * 4
    _exit_beyond(w, ext[2], f"tl.program_id(0) * {bm}")
    _exit_beyond(w, ext[0], "ib")
    _exit_beyond(w, ext[1], "ih")
    q_valid = _and_terms(_dim_valid(w, ext[2], "rm[:, None]"), _dim_valid(w, ext[0], "ib"),
                         _dim_valid(w, ext[1], "ih"))   # rows that are not padding
    m_term = _and_terms(None if lq_rows % bm == 0 else f"(rm[:, None] < {lq_rows})", q_valid)
    d_term = None if d == bd else f"(rd[None, :] < {d})"
    mask_q = _mask(w, "mask_q", m_term, d_term)
    w.emit(f"zero_q = tl.zeros([{bm}, {bd}], tl.int32)")
    qctx = Ctx(w, (b, h, lq, d), ["ib", heads, f"{rows_q}[:, None]", "rd[None, :]"], mask=mask_q,
               zero="zero_q")
    q = ExprEmitter(w).value(p.q, qctx)
    w.emit(f"q = {_masked(q, mask_q)}.to({tl_dot})")
    if appended:   # this call's key and value at one position, once per program (fuse_append)
        _appended_key_value(w, p, bd, bdv, tl_dot, pos=not kv_early)
    # and stored into the caches here (APPEND_IN_ATTENTION): their values loaded now, the stores
    # themselves after the partial or output store (ATTN_APPEND_STORES_LAST)
    append_stores = _store_appends(w, p, b * h // pack) if p.k_cache is not None else []
    w.emit(f"m_i = tl.full([{bm}], -float(\"inf\"), tl.float32)")
    w.emit(f"l_i = tl.zeros([{bm}], tl.float32)")
    w.emit(f"acc = tl.zeros([{bm}, {bdv}], tl.float32)")
    if split == 1:
        w.emit(f"for n0 in range(0, {lk}, {bn}):")
        w.indent += 1
    else:   # split-KV: program z walks the keys [z * chunk, (z + 1) * chunk)
        w.emit(f"for j0 in range(0, {chunk}, {bn}):")
        w.indent += 1
        w.emit(f"n0 = tl.program_id(2) * {chunk} + j0")
    skips = []
    if p.causal:
        # key blocks wholly after this query block are masked: skip them
        skips.append(f"(n0 < (tl.program_id(0) + 1) * {bm})")
    if lk_ext is not None and is_prefix(lk_ext):
        skips.append(f"(n0 < {w.extent(true_size(lk_ext, 0))})")   # blocks of padded keys
    if skips:
        w.emit(f"if {' & '.join(skips)}:")
        w.indent += 1
    w.emit(f"rn = n0 + tl.arange(0, {bn})")
    mask_k, mask_v = kv_masks()
    kvalid = _dim_valid(w, lk_ext, "rn[None, :]")
    masked_block = p.mask is not None
    if p.mask is not None:
        # the mask first: a key block it rules out entirely (False, or -inf when additive: a decode
        # step's keys past the current position in a static cache) contributes nothing to the
        # softmax, so it is skipped before its keys and values are loaded
        w.emit(f"mask_s = (rm[:, None] < {lq_rows}) & (rn[None, :] < {lk})"
               + (f" & {q_valid}" if q_valid else "") + (f" & {kvalid}" if kvalid else ""))
        w.emit(f"zero_s = tl.zeros([{bm}, {bn}], tl.int32)")
        sctx = Ctx(w, (b, h, lq, lk), ["ib", heads, f"{rows_q}[:, None]", "rn[None, :]"],
                   mask="mask_s", zero="zero_s")
        mv = ExprEmitter(w).value(p.mask, sctx)
        if p.mask.dtype == "bool":
            w.emit(f"keep = mask_s & ({mv} != 0)")
        else:
            w.emit(f"madd = {mv}.to(tl.float32)")
            w.emit("keep = mask_s & (madd > -float(\"inf\"))")
        w.emit("if tl.max(keep.to(tl.int32)) > 0:")
        w.indent += 1
    def tile(var, expr, width, dims, mask, new, at):
        if not kv_early:
            load_tile(var, expr, width, dims, mask, new if appended else None, at)
            return
        # loaded early unless this block starts past the appended position (a masked load and a
        # select: a branch instead measured slower on Llama-8B, 4249 -> 4337 us a token)
        late = _mask(w, f"mask_{var[0]}l", None if mask == "None" else mask, "(n0 > new_pos)")
        load_tile(var, expr, width, dims, late)
        w.emit(f"{var} = tl.where(early, {var}_early, {var})")
        w.emit(f"{var} = tl.where({at} == new_pos, {new}, {var})")

    tile("kt", p.k, d, k_dims, mask_k, "k_new[:, None]", "rn[None, :]")

    def load_v():
        tile("v", p.v, dv, v_dims, mask_v, "v_new[None, :]", "rn[:, None]")
    v_early = ATTN_V_EARLY if split > 1 else ATTN_V_EARLY_UNSPLIT
    if v_early:
        load_v()
    w.emit(f"s = tl.dot(q, kt{prec}) * {p.scale!r}")
    w.emit(f"valid = (rn[None, :] < {lk}) & (rm[:, None] >= 0)")
    _and_into(w, "valid", kvalid)
    if p.causal:
        w.emit("valid = valid & (rn[None, :] <= rm[:, None])")
    if p.mask is not None:
        if p.mask.dtype == "bool":
            w.emit("valid = valid & keep")
        else:
            w.emit("s = s + madd")
    w.emit("s = tl.where(valid, s, -float(\"inf\"))")
    w.emit("m_new = tl.maximum(m_i, tl.max(s, axis=1))")
    w.emit("m_safe = tl.where(m_new == -float(\"inf\"), 0.0, m_new)")
    w.emit("alpha = tl.exp(m_i - m_safe)")
    w.emit("pr = tl.exp(s - m_safe[:, None])")
    w.emit("l_i = l_i * alpha + tl.sum(pr, axis=1)")
    if not v_early:
        load_v()
    w.emit(f"acc = acc * alpha[:, None] + tl.dot(pr.to({tl_dot}), v{prec})")
    w.emit("m_i = m_new")
    w.indent -= 1 + bool(skips) + bool(masked_block)
    if split > 1:
        _store_attention_partial(w, kernel, split, m_term, bm, bdv)
        if p.partial is not None:   # and combined by the last program (aot/fuse_combine.py)
            _combine_own_splits(w, kernel, m_term, heads, rows_q, bm, bdv)
        for line in append_stores:
            w.emit(line)
        return (cdiv(lq_rows, bm), b * h // pack, split), 4, 2
    assert pack == 1, "grouped-query heads are packed for split-KV only (attention_plan)"
    # a row whose keys are all masked out is 0, as torch's SDPA gives (left padding)
    w.emit("o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]")
    mask = _mask(w, "mask", m_term, None if dv == bdv else f"(rdv[None, :] < {dv})")
    w.emit(f"zero = tl.zeros([{bm}, {bdv}], tl.int32)")
    ctx = Ctx(w, (b, h, lq, dv), ["ib", "ih", "rm[:, None]", "rdv[None, :]"],
              linear=f"(bh * {lq * dv} + rm[:, None] * {dv} + rdv[None, :])", mask=mask,
              zero="zero")
    value = ExprEmitter(w, acc="o").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{bm}, {bdv}]")
    for line in append_stores:
        w.emit(line)
    return (cdiv(lq, bm), b * h, 1), ATTN_WARPS, ATTN_STAGES


def _appended_key_value(w: Writer, p, bd: int, bdv: int, tl_dot: str, pos: bool = True):
    """`new_pos` (unless `pos` is False: already loaded before the wait), `k_new` [bd] and
    `v_new` [bdv] of an attention that takes this call's key and value at one position from its
    spec rather than from the cache (aot/fuse_append.py). They do not depend on the key index:
    evaluated at key 0, once per program."""
    shape_k, shape_v = (p.b, p.h, p.lk, p.d), (p.b, p.h, p.lk, p.dv)
    if pos:
        value = ExprEmitter(w).value(p.new_pos, Ctx(w, shape_k, ["ib", "ih", "0", "0"]))
        w.emit(f"new_pos = {value}")
    for name, expr, shape, block, size, lane in (("k_new", p.k_new, shape_k, bd, p.d, "rd"),
                                                ("v_new", p.v_new, shape_v, bdv, p.dv, "rdv")):
        mask = "None" if size == block else f"({lane} < {size})"
        w.emit(f"zero_{name} = tl.zeros([{block}], tl.int32)")
        ctx = Ctx(w, shape, ["ib", "ih", "0", lane], mask=mask, zero=f"zero_{name}")
        value = ExprEmitter(w).value(expr, ctx)
        w.emit(f"{name} = {_masked(value, mask)}.to({tl_dot})")


def _store_appends(w: Writer, p, programs: int) -> list[str]:
    """A decode attention's KV-cache appends (fuse_append.APPEND_IN_ATTENTION), stored by the
    programs of its first query block and first key split: the `programs` of grid dimension 1
    share each append's index space ([b, h_kv, 1, d]) in flat slices. Every program of the
    attention takes the appended key and value from k_new / v_new, so whether another program
    has stored them yet does not matter (a cache load of that position is replaced).

    Emits the values and addresses; returns the two store lines when ATTN_APPEND_STORES_LAST
    (the caller emits them at the end of the kernel), else emits them too and returns []."""
    later = [] if ATTN_APPEND_STORES_LAST else None
    for name, value, pos, cache in (("k", p.k_store, p.k_store_pos, p.k_cache),
                                    ("v", p.v_store, p.v_store_pos, p.v_cache)):
        shape = p.append_space(cache)
        n = numel(shape)
        per = cdiv(n, programs)
        block = next_pow2(max(per, 16))
        lane, at = f"a{name}_lane", f"a{name}_at"
        w.emit(f"{lane} = tl.arange(0, {block})")
        w.emit(f"{at} = tl.program_id(1) * {per} + {lane}")
        w.emit(f"a{name}_mask = ({lane} < {per}) & ({at} < {n}) & (tl.program_id(0) == 0) "
               f"& (tl.program_id(2) == 0)")
        w.emit(f"a{name}_zero = tl.zeros([{block}], tl.int32)")
        ctx = Ctx(w, shape, linear=at, mask=f"a{name}_mask", zero=f"a{name}_zero")
        _scatter_store(w, cache, (Index(0), Index(1), pos, Index(3)), value, ctx, block,
                       later=later)
    return later or []


@dataclass(frozen=True)
class AttentionPlan:
    """An attention's tiles, decided once by lowering (attention_plan) and kept in its spec
    (families.Attention.plan): lowering emits attn_combine when it splits, the template tiles
    by it."""

    bm: int          # query rows per program
    bn: int          # keys per step
    split: int       # key splits (split-KV: partials combined by attn_combine)
    # grouped-query attention packed: the `pack` query heads that share a key/value head are one
    # program's rows (pack * lq of them), so each key block is read once for the group; 1: none
    pack: int = 1


# An unsplit attention whose whole key axis fits one block of at most this many key elements
# (keys x head dimension) takes it in one step: no serial loop, every key and value load issued
# at once. ViT-S (197 keys of 64) on the H200: its 12 attentions 7.1 -> 5.0 us each in the
# graph, 0.413 -> 0.385 ms a call (docs/performance.md, seventeenth session). 16384: 256 keys of
# 64, 64 KiB of fp32 keys in 4 warps' registers. 0: off (ATTN_MAX_BLOCK_N keys a step).
ATTN_ONE_BLOCK_ELEMS = 16384
# A split decode attention whose appends aot/fuse_append.py moved after it loads its key and value
# blocks before gdc_wait() (see attention()). On the H200 (docs/performance.md), against both
# off: a Llama-1B token's GPU span 824.1 -> 804.9 us (nineteenth session); Llama-8B's went
# 4175.7 -> 4249.4 us with 128-key blocks (registers: ATTN_SPLIT_BLOCK_ELEMS) and 4174.4 ->
# 4127.7 us with 64-key ones (twentieth session).
ATTN_KV_BEFORE_WAIT = True
# The KV-cache appends an attention stores itself (fuse_append.APPEND_IN_ATTENTION) are stored
# at the end of the kernel, their values loaded where they were. Stored before the key loop, a
# warp stalls at the store until the appended values have arrived, and only then issues the
# loop's first loads (the mask at this position): one more dependent trip to memory a layer.
# Llama-1B on an H100 (docs/performance.md, twenty-seventh session): GPU span 999.2 -> 995.1 and
# 997.7 us (two builds of the same package), generate() 1.012 -> 1.005 and 1.012 ms: within the
# spread of the two identical builds, not worse; kept for the stall it removes by construction.
ATTN_APPEND_STORES_LAST = True
ATTN_SPLIT_PROGRAMS_PER_SM = 4   # split keys while the programs stay within this many per SM
# The largest key block (keys x head columns) of a split-KV decode program (one query tile):
# fewer keys a step, and more splits, past it. Such a program may load its key and value blocks
# before gdc_wait() (ATTN_KV_BEFORE_WAIT) and holds both in registers beside the loop's own; ptxas
# (sm_90) gave Llama-8B's 128 keys x 128 columns 255 registers and a 144-byte stack, Llama-1B's
# 128 x 64 182 registers, 64 x 128 178. At 255 a program shares no multiprocessor with two programs of the
# persistent GEMV before it (66 registers x 256 threads each), so it could not load early at all.
# H200, Llama-8B decode (docs/performance.md, twentieth session): with the KV blocks before the
# wait, 16 splits of 128 keys 4249 us a token against 4175 without; 32 splits of 64 keys 4128.
# Without early loads the 8B block size made no difference (4182 vs 4174).
ATTN_SPLIT_BLOCK_ELEMS = 8192
# Pack a decode step's grouped-query heads into one program (AttentionPlan.pack) when the
# query heads per key/value head times the query rows fit one 16-row tile; 0: off. In the Llama-1B
# decode graph on the H200 attention and its combine took 7.5 us a layer (profile_kernels
# --timeline, docs/performance.md, 2026-12-03) with 512 programs each reading its own copy of its
# key/value head's keys (4 query heads per key/value head). Packed: 7.5 -> 5.9 us a layer and
# 0.972 -> 0.933 ms/token alone (bench_decode --variant, 2026-12-03).
ATTN_PACK_GQA = 1


def attention_plan(b: int, h: int, lq: int, lk: int, sm_count: int, rep: int = 1,
                   packable: bool = False, d: int = 64) -> AttentionPlan:
    """The tiles of an attention on a part with `sm_count` multiprocessors. Few query rows and a
    long key axis (a decode step over a static cache: one program per head would walk 2048 keys
    serially) split the keys over more programs, each leaving its normalised partial output and
    log-sum-exp for a combining kernel (flash-decoding). `rep`: query heads per key/value head
    (grouped-query attention); `packable`: lowering allows them packed (ATTN_PACK_GQA); `d`: the
    head dimension (the keys' or the values', the larger), which bounds a one-step key block."""
    bm = 16 if lq <= 16 or b * h * cdiv(lq, 32) < sm_count // 2 else 32  # fill the chip
    if ATTN_BM and lq > 16:
        bm = ATTN_BM
    bn = 16 if lk <= 16 else 32 if lk <= 32 else 64 if lk <= 64 else ATTN_MAX_BLOCK_N
    pack = rep if ATTN_PACK_GQA and packable and rep > 1 and rep * lq <= 16 else 1
    programs = cdiv(lq * pack, bm) * b * (h // pack)

    def splits(bn):
        split = 1
        while (programs * split * 2 <= ATTN_SPLIT_PROGRAMS_PER_SM * sm_count
               and lk % (split * 2 * bn) == 0 and lk // (split * 2) >= bn):
            split *= 2
        return split
    split = splits(bn)
    if (split > 1 and lq * pack <= bm and ATTN_SPLIT_BLOCK_ELEMS
            and bn * head_block(d) > ATTN_SPLIT_BLOCK_ELEMS):   # a decode step (one query tile)
        bn = max(16, ATTN_SPLIT_BLOCK_ELEMS // head_block(d))
        split = splits(bn)
    if pack > 1 and split == 1:   # packing is for split-KV decode steps only
        return attention_plan(b, h, lq, lk, sm_count, d=d)
    if split == 1 and lk > bn and next_pow2(lk) * head_block(d) <= ATTN_ONE_BLOCK_ELEMS:
        bn = next_pow2(lk)
    return AttentionPlan(bm, bn, split, pack)


def _store_attention_partial(w: Writer, kernel: Kernel, split: int, m_term, bm: int, bdv: int):
    """A key split's output, normalised over its own keys, and its log-sum-exp (-inf when it saw
    no key), into the float32 partial buffer: [split, b*h, lq, dv] outputs, then
    [split, b*h, lq] log-sum-exps."""
    p = kernel.spec
    bh, lq, dv, pack = p.b * p.h, p.lq, p.dv, p.plan.pack
    ptr = w.ptr(p.partial if p.partial is not None else kernel.out)
    w.emit("seen = l_i > 0")
    w.emit("o = acc / tl.where(seen, l_i, 1.0)[:, None]")
    w.emit("lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), -float(\"inf\"))")
    if pack > 1:   # each row its own query head (attention())
        w.emit(f"row = (tl.program_id(2) * {bh} + ib * {p.h} + ihr) * {lq} + rq")
    else:
        w.emit(f"row = (tl.program_id(2) * {bh} + bh) * {lq} + rm")
    rows = _and_terms(None if (lq * pack) % bm == 0 else f"(rm < {lq * pack})")
    mask = _mask(w, "mask", m_term, None if p.dv == bdv else f"(rdv[None, :] < {dv})")
    w.emit(f"tl.store({ptr} + row[:, None] * {dv} + rdv[None, :], o"
           + (f", mask={mask})" if mask != "None" else ")"))
    w.emit(f"tl.store({ptr} + {split * bh * lq * dv} + row, lse"
           + (f", mask={rows})" if rows else ")"))


def _combine_own_splits(w: Writer, kernel: Kernel, m_term, heads: str, rows_q: str, bm: int,
                        bdv: int):
    """A split-KV attention that combines its own splits (aot/fuse_combine.py), after each
    program stored its partial (_store_attention_partial): count the program in its query tile's
    arrival word; the tile's last program reads every split's log-sum-exps and outputs for its
    rows around L1 (the arena's bytes were other buffers' earlier in the graph), weights them as
    attn_combine does, stores the epilogue, and puts the word back to zero for the next kernel.
    The barrier before the count orders the program's stores before its one-thread atomic
    (acq_rel at GPU scope, as Triton emits it), as in _reduce_own_splits."""
    p = kernel.spec
    bh, h, lq, dv, split = p.b * p.h, p.h, p.lq, p.dv, p.plan.split
    lq_rows = lq * p.plan.pack
    partial, arrivals = w.ptr(p.partial), w.ptr(p.arrivals)
    head = heads.replace("[:, None]", "")   # [bm] (packed query heads) or the program's head
    w.emit("tl.debug_barrier()")
    w.emit(f"c_tile = tl.program_id(1) * {cdiv(lq_rows, bm)} + tl.program_id(0)")
    w.emit(f"c_arrived = tl.atomic_add({arrivals} + c_tile, 1)")
    w.emit(f"if c_arrived == {split - 1}:")
    w.indent += 1
    w.emit(f"c_row = (ib * {h} + {head}) * {lq} + {rows_q}")   # [bm]: the row in one split
    w.emit(f"c_rs = tl.arange(0, {split})")
    rows = lq_rows % bm != 0
    row_mask = f", mask=(rm < {lq_rows})" if rows else ""
    w.emit(f"c_lse = tl.load({partial} + {split * bh * lq * dv} + c_rs[:, None] * {bh * lq} "
           f"+ c_row[None, :]" + (f", mask=(rm[None, :] < {lq_rows}), other=-float(\"inf\")"
                                  if rows else "") + ", cache_modifier=\".cg\")")
    w.emit("c_top = tl.max(c_lse, axis=0)")
    w.emit("c_top = tl.where(c_top == -float(\"inf\"), 0.0, c_top)")
    # 0: every split saw no key (the row is 0, as in torch)
    w.emit("c_den = tl.sum(tl.exp(c_lse - c_top[None, :]), axis=0)")
    w.emit(f"c_total = tl.zeros([{bm}, {bdv}], tl.float32)")
    o_mask = _and_terms(f"(rm[:, None] < {lq_rows})" if rows else None,
                        None if dv == bdv else f"(rdv[None, :] < {dv})")
    w.emit(f"for c_s in tl.static_range({split}):")
    w.indent += 1
    w.emit(f"c_wt = tl.exp(tl.load({partial} + {split * bh * lq * dv} + c_s * {bh * lq} + c_row"
           + (f"{row_mask}, other=-float(\"inf\")" if rows else "")
           + ", cache_modifier=\".cg\") - c_top)")
    w.emit(f"c_total += tl.load({partial} + (c_s * {bh * lq} + c_row)[:, None] * {dv} "
           f"+ rdv[None, :]" + (f", mask={o_mask}, other=0.0" if o_mask else "")
           + ", cache_modifier=\".cg\") * c_wt[:, None]")
    w.indent -= 1
    w.emit("o = c_total / tl.where(c_den > 0, c_den, 1.0)[:, None]")
    mask = _mask(w, "c_mask", m_term, None if dv == bdv else f"(rdv[None, :] < {dv})")
    w.emit(f"c_zero = tl.zeros([{bm}, {bdv}], tl.int32)")
    ctx = Ctx(w, (p.b, h, lq, dv), ["ib", heads, f"{rows_q}[:, None]", "rdv[None, :]"],
              linear=f"(c_row[:, None] * {dv} + rdv[None, :])", mask=mask, zero="c_zero")
    value = ExprEmitter(w, acc="o").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{bm}, {bdv}]")
    w.emit(f"tl.atomic_xchg({arrivals} + c_tile, 0)")
    w.indent -= 1


def attn_combine(kernel: Kernel, w: Writer):
    """The split-KV partials of one attention, combined: each split's output weighted by
    exp(its log-sum-exp - the largest), then the attention's epilogue."""
    p = kernel.spec
    b, h, lq, dv, split = p.b, p.h, p.lq, p.dv, p.parts
    bh = b * h
    bm = min(16, max(2, next_pow2(lq)))
    bdv = head_block(dv)
    src = w.ptr(p.partial.buf)
    w.emit(f"rm = tl.program_id(0) * {bm} + tl.arange(0, {bm})")
    w.emit("bh = tl.program_id(1)")
    w.emit(f"ib = bh // {h}")
    w.emit(f"ih = bh % {h}")
    w.emit(f"rdv = tl.arange(0, {bdv})")
    w.emit(f"rs = tl.arange(0, {split})")
    ext = kernel.ext or (None,) * 4
    _exit_beyond(w, ext[2], f"tl.program_id(0) * {bm}")
    _exit_beyond(w, ext[0], "ib")
    _exit_beyond(w, ext[1], "ih")
    q_valid = _and_terms(_dim_valid(w, ext[2], "rm[:, None]"), _dim_valid(w, ext[0], "ib"),
                         _dim_valid(w, ext[1], "ih"))
    m_term = _and_terms(None if lq % bm == 0 else f"(rm[:, None] < {lq})", q_valid)
    w.emit(f"row = (rs[:, None] * {bh} + bh) * {lq} + rm[None, :]")   # [split, bm]
    rows = f"(rm[None, :] < {lq})" if lq % bm else None
    w.emit(f"lse = tl.load({src} + {split * bh * lq * dv} + row"
           + (f", mask={rows}, other=-float(\"inf\"))" if rows else ")"))
    w.emit("top = tl.max(lse, axis=0)")
    w.emit("top = tl.where(top == -float(\"inf\"), 0.0, top)")
    w.emit("wt = tl.exp(lse - top[None, :])")
    o_mask = _and_terms(f"(rm[None, :, None] < {lq})" if lq % bm else None,
                        None if dv == bdv else f"(rdv[None, None, :] < {dv})")
    w.emit(f"part = tl.load({src} + row[:, :, None] * {dv} + rdv[None, None, :]"
           + (f", mask={o_mask}, other=0.0)" if o_mask else ")"))
    w.emit("den = tl.sum(wt, axis=0)")   # 0: every split saw no key (the row is 0, as in torch)
    w.emit("o = tl.sum(part * wt[:, :, None], axis=0) / tl.where(den > 0, den, 1.0)[:, None]")
    mask = _mask(w, "mask", m_term, None if dv == bdv else f"(rdv[None, :] < {dv})")
    w.emit(f"zero = tl.zeros([{bm}, {bdv}], tl.int32)")
    ctx = Ctx(w, (b, h, lq, dv), ["ib", "ih", "rm[:, None]", "rdv[None, :]"],
              linear=f"(bh * {lq * dv} + rm[:, None] * {dv} + rdv[None, :])", mask=mask,
              zero="zero")
    value = ExprEmitter(w, acc="o").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{bm}, {bdv}]")
    return (cdiv(lq, bm), bh, 1), 4, 1


# ---- data-dependent sizes ----------------------------------------------------------------------
def compact(kernel: Kernel, w: Writer):
    """Stream compaction in one program: blocks in row-major order, a prefix sum inside each
    block gives every nonzero element its slot after those of earlier blocks; the running count
    ends up in the extents table. Padded elements (the source's extents) never count."""
    spec = kernel.spec
    shape = spec.src_shape
    n, nd = numel(shape), len(shape)
    block = min(1024, next_pow2(max(n, 16)))
    out = w.ptr(kernel.out)
    w.emit("count = tl.zeros([], tl.int32)")
    w.emit(f"for start in range(0, {n}, {block}):")
    w.indent += 1
    w.emit(f"offs = start + tl.arange(0, {block})")
    w.emit(f"inb = offs < {n}")
    w.emit(f"zero = tl.zeros([{block}], tl.int32)")
    ctx = Ctx(w, shape, linear="offs", mask="inb", zero="zero")
    ctx.mask = and_mask(w, "inb", "inb", ctx.valid(spec.src_ext))
    value = ExprEmitter(w).value(spec.src, ctx)
    w.emit(f"flag = (({value}) != 0) & {ctx.mask}")
    w.emit("flag_i = flag.to(tl.int32)")
    w.emit("pos = (count + tl.cumsum(flag_i, 0) - 1).to(tl.int64)")
    for d in range(nd):
        w.emit(f"tl.store({out} + pos * {nd} + {d}, ({ctx.dim(d)} + zero).to(tl.int64), mask=flag)")
    w.emit("count += tl.sum(flag_i, 0)")
    w.indent -= 1
    _store_extent(w, spec.symbol, "count.to(tl.int64)")
    return (1, 1, 1), 4, 1


def to_extent(kernel: Kernel, w: Writer):
    """A tensor's value becomes a size (`n.item()`), clamped to the range torch.export proved."""
    spec = kernel.spec
    value = ExprEmitter(w).value(spec.src, Ctx(w, ()))
    w.emit(f"v = tl.minimum(tl.maximum({value}.to(tl.int64), {spec.lo}), {spec.hi})")
    _store_extent(w, spec.symbol, "v")
    return (1, 1, 1), 1, 1


def _store_extent(w: Writer, symbol, value: str):
    ext = w.ptr(EXTENTS)
    w.emit(f"tl.store({ext} + {w.symbols[symbol]}, {value})")


# ---- order-dependent kernels: arg-reductions, scans, sorting ----------------------------------
# Values are compared through an integer *order key*: a float's bits mapped so that signed integer
# order is the float order (-0.0 first made +0.0, so the two compare equal), NaN given the key of
# its choice. Integer comparisons have no NaN corner cases in either Triton backend, and a key
# with the column in its low bits makes a sort stable.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


def _key_bits(dtype: str) -> int:
    return 64 if dtype in ("float64", "int64") else 32


def _order_key(w: Writer, x: str, dtype: str, flip: bool, nan_key: str | None) -> str:
    """Emit `key`: an int32 (int64 for 64-bit types) increasing with `x` (decreasing when `flip`);
    NaN gets `nan_key` (a literal) after the flip."""
    bits = _key_bits(dtype)
    it = "tl.int64" if bits == 64 else "tl.int32"
    if dtype.startswith("float"):
        ft = "tl.float64" if dtype == "float64" else "tl.float32"
        w.emit(f"v = {x}.to({ft})")
        w.emit("v = tl.where(v == 0.0, 0.0, v)")
        w.emit(f"kb = v.to({it}, bitcast=True)")
        w.emit(f"key = kb ^ ((kb >> {bits - 1}) & {INT64_MAX if bits == 64 else INT32_MAX})")
    else:
        w.emit(f"key = {x}.to({it})")
    if flip:
        w.emit("key = ~key")
    if dtype.startswith("float") and nan_key is not None:
        w.emit(f"key = tl.where(v != v, {nan_key}, key)")
    return "key"


def argreduce(kernel: Kernel, w: Writer):
    """The index of the maximum (op "max") or minimum (op "min") of each row, over the flattened
    `rdims`: NaN wins (torch), and among equal values the first index. Each lane keeps its best
    key and the column it was first seen at; the lanes are then merged by key, ties to the lower
    column."""
    spec = kernel.spec
    op = spec.op
    dtype = spec.src.dtype
    bits = _key_bits(dtype)
    kt = "tl.int64" if bits == 64 else "tl.int32"
    lowest = f"-{2**(bits - 1)}"
    highest = str(INT64_MAX if bits == 64 else INT32_MAX)

    def start_acc(br, bn):
        w.emit(f"best = tl.full([{br}, {bn}], {lowest}, {kt})")
        w.emit(f"besti = tl.zeros([{br}, {bn}], tl.int32)")

    rows, cols, br, ctx = _row_blocks(w, spec, start_acc)
    value = ExprEmitter(w).value(spec.src, ctx)
    key = _order_key(w, value, dtype, flip=op == "min", nan_key=highest)
    w.emit(f"key = tl.where(mask, {key}, {lowest})")
    w.emit("better = key > best")
    w.emit("best = tl.where(better, key, best)")
    w.emit("besti = tl.where(better, cols + zero, besti)")
    w.indent -= 1
    w.emit("top = tl.max(best, axis=1)")
    w.emit(f"red = tl.min(tl.where(best == top[:, None], besti, {cols}), axis=1).to(tl.int64)")
    return _store_rows(w, kernel, rows, br)


def scan(kernel: Kernel, w: Writer):
    """Inclusive prefix sums / products along the last dimension: column blocks in order, each
    scanned with tl.cumsum / tl.cumprod and combined with the carry of the blocks before it.
    Padding (past the row, past the true extent) holds the identity."""
    shape = kernel.out_shape
    spec = kernel.spec
    rows, cols, br, bn = _row_setup(kernel, w, shape)
    acc_t = TL_TYPE[spec.acc_dtype]
    prod = spec.op == "prod"
    ident = "1" if prod else "0"
    w.emit(f"carry = tl.full([{br}, 1], {ident}, {acc_t})")
    col_entry = kernel.ext[-1] if kernel.ext else None
    _row_loop(w, cols, bn, col_entry)
    ctx = _row_ctx(w, shape, cols)
    x = ExprEmitter(w).value(spec.src, ctx)
    w.emit(f"x = tl.where(mask, {x}.to({acc_t}), {ident})")
    if prod:
        w.emit("s = tl.cumprod(x, axis=1) * carry")
    else:
        w.emit("s = tl.cumsum(x, axis=1) + carry")
    value = ExprEmitter(w, acc="s").value(kernel.epilogue, ctx)
    _store(w, kernel, value, ctx, f"[{br}, {bn}]")
    if cols > bn:   # the last column of the block carries into the next one
        w.emit(f"carry = tl.sum(tl.where(tl.arange(0, {bn})[None, :] == {bn - 1}, s, 0), "
               "axis=1)[:, None]")
    w.indent -= 1
    return (cdiv(rows, br), 1, 1), 4 if bn >= 256 else 2, 1


def _bitonic_sort(w: Writer, br: int, bn: int, paired: bool = False):
    """Sort the int64 `key` [br, bn] ascending along axis 1 with a bitonic network, unrolled.
    A step pairs column i with i ^ j: viewing the row as [bn / 2j, 2, j], the partner is the pair's
    sum minus the element (tl.sum over the axis of 2; wrapping int64 arithmetic is exact), then
    each keeps the min or the max. (Triton's own sort does the same with an xor reduction, which
    the interpreter runs element by element in Python: minutes for rows of a thousand.)
    `paired`: the int32 column `idx` travels with each key and breaks ties (64-bit keys, which
    leave no room for the column)."""
    k = 2
    while k <= bn:
        j = k // 2
        while j >= 1:
            cube = f"[{br}, {bn // (2 * j)}, 2, {j}]"
            w.emit(f"h = tl.reshape(key, {cube})")
            w.emit(f"y = tl.reshape(tl.sum(h, axis=2, keep_dims=True) - h, [{br}, {bn}])")
            lower = f"((cols & {j}) == 0)"
            keep = lower if k == bn else f"({lower} == ((cols & {k}) == 0))"   # keeps the min
            if paired:
                w.emit(f"g = tl.reshape(idx, {cube})")
                w.emit(f"yi = tl.reshape(tl.sum(g, axis=2, keep_dims=True) - g, [{br}, {bn}])")
                w.emit(f"swap = ((y < key) | ((y == key) & (yi < idx))) == {keep}")
                w.emit("key = tl.where(swap, y, key)")
                w.emit("idx = tl.where(swap, yi, idx)")
            else:
                w.emit(f"key = tl.where({keep}, tl.minimum(key, y), tl.maximum(key, y))")
            j //= 2
        k *= 2


def sort(kernel: Kernel, w: Writer):
    """The permutation that sorts each row (the last dimension) of `src`, stably, ascending or
    descending with NaN as the largest value; the first out_shape[-1] columns of it are stored
    (topk). The whole row is one block: a key per element — order key in the high 32 bits, column
    in the low ones, padding last — sorted by a bitonic network, the columns decoded. 64-bit
    values sort (key, column) pairs instead."""
    spec = kernel.spec
    shape = spec.src_shape
    n, k = shape[-1], kernel.out_shape[-1]
    rows = numel(shape) // n
    bn = next_pow2(max(n, 2))
    br = max(1, min(next_pow2(rows), max(1, 2048 // bn), 16))
    src_ext = spec.src_ext or (None,) * len(shape)
    descending = spec.descending
    _exit_outer(w, shape[:-1], src_ext[:-1], f"tl.program_id(0) * {br}")
    w.emit(f"rows = tl.program_id(0) * {br} + tl.arange(0, {br})[:, None]")
    w.emit(f"rmask = rows < {rows}")
    _and_into(w, "rmask", Ctx(w, shape[:-1], linear="rows").valid(src_ext[:-1]))
    w.emit(f"cols = tl.arange(0, {bn})[None, :]")
    w.emit(f"mask = rmask & (cols < {n})")
    _and_into(w, "mask", _dim_valid(w, src_ext[-1], "cols"))
    w.emit(f"zero = tl.zeros([{br}, {bn}], tl.int32)")
    ctx = Ctx(w, shape, linear=f"(rows * {n} + cols)", mask="mask", zero="zero")
    value = ExprEmitter(w).value(spec.src, ctx)
    dtype = spec.src.dtype
    wide = _key_bits(dtype) == 64
    top = INT64_MAX if wide else INT32_MAX
    nan_key = f"-{top + 1}" if descending else str(top)
    key = _order_key(w, value, dtype, flip=descending, nan_key=nan_key)
    if wide:   # (key, column) pairs; padding: the largest key and a column past the real ones
        w.emit(f"key = tl.where(mask, {key}, {INT64_MAX})")
        w.emit("idx = cols + zero")
        _bitonic_sort(w, br, bn, paired=True)
    else:
        w.emit(f"key = ({key}.to(tl.int64) << 32) | (cols + zero).to(tl.int64)")
        w.emit(f"key = tl.where(mask, key, {INT64_MAX})")
        _bitonic_sort(w, br, bn)
        w.emit(f"idx = key & {INT32_MAX}")
    if src_ext[-1] is not None:   # past the true length: padding, decoded to a readable column
        w.emit(f"idx = tl.minimum(idx, {n - 1})")
    w.emit(f"omask = rmask & (cols < {k})")
    out_ctx = Ctx(w, kernel.out_shape, linear=f"(rows * {k} + cols)", mask="omask", zero="zero")
    value = ExprEmitter(w, acc="idx").value(kernel.epilogue, out_ctx)
    _store(w, kernel, value, out_ctx, f"[{br}, {bn}]")
    return (cdiv(rows, br), 1, 1), 8 if br * bn >= 4096 else 4 if br * bn >= 256 else 2, 1


def table_writer_source(slots: list[dict], extents: dict | None = None) -> KernelSource:
    """The per-call argument-table update: one store per table word, at the position
    grace.formats.table lays it out (slot by slot, then the size symbols); the parameters carry
    the values."""
    from grace.formats.table import word_positions

    positions = word_positions([(s["offset"], s["rank"]) for s in slots],
                               extents["offset"] if extents else 0, extents["count"] if extents else 0)
    words = len(positions)
    names = ", ".join(f"w{i}" for i in range(words))
    lines = [f"def table_writer(table, {names}):" if words else "def table_writer(table):"]
    lines += [f"    tl.store(table + {pos}, w{i})" for i, pos in enumerate(positions)] or ["    pass"]
    text = HEADER + "\n".join(lines) + "\n"
    return KernelSource("table_writer", "table_writer", text, ["*i64"] + ["i64"] * words, [],
                        (1, 1, 1), 1, 1, [0])



# The generation step's argmax: programs of GENERATE_STEP_BLOCK logits per load round, at most
# GENERATE_STEP_PROGRAMS of them (a 128K vocabulary: 32 programs, one round each). On the H200
# (Llama-1B, docs/performance.md, fourteenth session) one program walking the row serially cost
# generate() 0.873 ms/token with 8192-logit rounds, 0.842 with 16384 (0.829 with the values
# loaded early), and these 32 programs 0.820.
GENERATE_STEP_BLOCK = 4096
GENERATE_STEP_PROGRAMS = 64
GENERATE_STEP_WARPS = 4      # per program (a block below 4096 logits always takes 4)


def generate_step_source(logits, positions, ctrl, out_tokens, next_token,
                         next_position, scratch) -> KernelSource:
    """One greedy decoding step, run on the device after the model (docs/design-state.md):
    token = argmax of the last row of the logits (the first index of the maximum, as torch), stored
    as the next `tokens` input and at `out_tokens[count]`; the next position is the last one + 1;
    ctrl = [count + 1, limit, eos, done] with done = token == eos or count + 1 >= limit.
    `logits` is [1, ..., T, V] and `positions` [T], both read through their table slots (T is
    the prompt length after prefill and 1 in decode).

    Each program walks its slice of the row in rounds of GENERATE_STEP_BLOCK logits, each lane
    keeping its own best value and column (a strictly larger value replaces it, so a lane keeps
    its first maximum; NaN never wins), then reduces across lanes once. The programs meet in
    `scratch` (int64 [2], session state, zero between steps): each folds its best into word 0
    with an atomic max of a key that orders by value, then by the smaller column, and counts
    itself in word 1; the last to arrive reads the winner, puts both words back to zero and
    advances the generation. One program walking a 128K row serially was latency-bound."""
    rank, vocab = len(logits.shape), logits.shape[-1]
    block = min(GENERATE_STEP_BLOCK, next_pow2(vocab))
    rounds = cdiv(cdiv(vocab, block), GENERATE_STEP_PROGRAMS)
    span = rounds * block            # logits per program
    programs = cdiv(vocab, span)
    src_t = TL_TYPE[logits.dtype]
    lines = [
        "def generate_step(logits_slot, positions_slot, ctrl, out_tokens, next_token, next_position,",
        "                  scratch):",
        f"    logits = tl.load(logits_slot).to(tl.pointer_type({src_t}))",
        f"    rows = tl.load(logits_slot + {rank - 1})",          # sizes[rank - 2]: T
        f"    row = logits + (rows - 1) * {vocab}",
        f"    lo = tl.program_id(0) * {span}",
        f"    best = tl.full([{block}], -float(\"inf\"), tl.float32)",
        f"    best_i = lo + tl.arange(0, {block})",   # an all -inf slice: its first column
        f"    for start in range(0, {span}, {block}):",
        f"        cols = lo + start + tl.arange(0, {block})",
        f"        x = tl.load(row + cols, mask=cols < {vocab}, other=-float(\"inf\")).to(tl.float32)",
        "        better = x > best",
        "        best_i = tl.where(better, cols, best_i)",
        "        best = tl.where(better, x, best)",
        "    m = tl.max(best, 0)",
        f"    col = tl.min(tl.where(best == m, best_i, {vocab}), 0).to(tl.int64)",
    ]
    # the program's key: its best value made an order-preserving int32 (argreduce's; -0.0 as
    # +0.0, which compares equal), shifted non-negative, above its column counted down
    key = Writer()
    _order_key(key, "m", "float32", flip=False, nan_key=None)
    lines += key.lines + [
        f"    ordered = key.to(tl.int64) + {INT32_MAX + 1}",
        f"    tl.atomic_max(scratch, (ordered << 31) | ({INT32_MAX} - col))",
        "    tl.debug_barrier()",
        "    arrived = tl.atomic_add(scratch + 1, 1)",
        f"    if arrived == {programs - 1}:",
        "        won = tl.atomic_xchg(scratch, 0)",
        "        tl.atomic_xchg(scratch + 1, 0)",
        f"        token = {INT32_MAX} - (won & {INT32_MAX})",
        "        pos = tl.load(positions_slot).to(tl.pointer_type(tl.int64))",
        "        last = tl.load(pos + tl.load(positions_slot + 1) - 1)",
        "        count = tl.load(ctrl)",
        "        tl.store(out_tokens + count, token)",
        "        tl.store(next_token, token)",
        "        tl.store(next_position, last + 1)",
        "        tl.store(ctrl, count + 1)",
        "        done = (token == tl.load(ctrl + 2)) | (count + 1 >= tl.load(ctrl + 1))",
        "        tl.store(ctrl + 3, done.to(tl.int64))",
    ]
    text = HEADER + "\n".join(lines) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = f"generate_step_{digest}"
    buffers = [logits, positions, ctrl, out_tokens, next_token, next_position, scratch]
    return KernelSource(name, "generate_step", text.replace("def generate_step(", f"def {name}("),
                        ["*i64"] * 7, buffers, (programs, 1, 1),
                        GENERATE_STEP_WARPS if block >= 4096 else 4, 1, [2, 3, 4, 5, 6])
