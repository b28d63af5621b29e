"""Stage `fuse`, after the row statistics (`STORE_GEMV_ROWS`, on): an RMSNorm's mean kernel also
stores the normalised row, and the GEMV behind it streams a plain vector.

In a decode step a template GEMV (codegen._gemv: K walked in steps, a few weight rows a program)
reads its row operand as an expression, an RMSNorm's x * rsqrt(mean + eps) * w, which every
program recomputes for each K step: two extra vector loads beside the weights' and the mean's.
Realized as kernels of their own (a probe, twenty-fourth session, H100, Llama-1B: docs/
performance.md) the GEMVs got ~40 µs a token faster with a plain row (gate+up 23.3 -> 22.1 µs,
down 11.8 -> 10.8, qkv 4.2 -> 3.9), but the 49 added kernel boundaries cost 50. Here the row is
stored by the kernel that already exists: the mean's one-program reduction (codegen.
_reduction_with_row) loads x and w together, reduces, and stores the row, bf16 as eager's
RMSNorm output (the GEMV used to multiply the unrounded float32 row).

When: a one-output reduction (a fixed row of at most MAX_COLS elements, an epilogue of arithmetic
on its value) whose only reader is a GEMV reading it in its row operand alone, under pointwise ops
(fuse_stats._gemv_reader's conditions, with the template allowed); one batch row whose K is the
reduction's row length, so one block walks both (the row is evaluated in the GEMV's own index
space; the reduced value does not depend on the index). Persistent GEMVs fold the mean instead
(fuse_stats.FOLD_INTO_PERSISTENT runs first and takes them).

Timed on an H100 (Llama-1B, docs/performance.md). Twenty-fourth session: the gate+up GEMVs
23.30 -> 21.94 µs each, but each mean 1.04 -> 1.76 µs, its norm weight loaded after the reduction
(one more trip to memory at the end of the kernel the GEMV waits for). Twenty-fifth session, the
weight loaded before gdc_wait(): the means back at 1.05 µs, GPU span 1022.8 -> 1009.4 µs,
generate() 1.028 -> 1.008 ms/token. On.

The down projection's row, silu(gate) * up, has no reduction to store it: the gate+up GEMV
stores it (`PAIR_GATE_UP`, on; `pair_gemv_rows`). Its programs take gate column j and up column
j + n/2 side by side (`Matmul.pair`: a second accumulator over the partner weight rows, read in
the epilogue as `ir.Partner`), so the epilogue holds both and stores the row's element j. The
weights keep their layout, so prefill's GEMMs are untouched. H200, Llama-1B (thirty-first
session): the down GEMVs 9.49 -> 8.6 µs each, GPU span -15 to -17 µs a token. The tile knobs
after it (`PLAIN_ROW_TILE`, `EXPR_ROW_TILE`) were timed and lost; they stay, off, for A/B runs.
"""
from __future__ import annotations

from dataclasses import replace

from .codegen import cdiv, next_pow2
from .families import Matmul
from .fuse import _readers, replace_nodes, substitute
from .fuse_stats import _factor, _foldable, _gemv_reader
from .ir import Acc, Buffer, Const, Kernel, Load, Op, Partner, contiguous_strides, loads, numel, walk

STORE_GEMV_ROWS = True
MAX_COLS = 4096   # one block of the row in the reduction's registers
# Weight elements per program per K step for a template GEMV whose row is a plain vector (a stored
# row, an attention's output); 0: every GEMV keeps codegen.GEMV_TILE. 4 rows x 1024 won over 2 x
# 1024 when every program recomputed an RMSNorm row (codegen.GEMV_TILE's comment); a plain row
# costs nothing to load again. H100, Llama-1B (docs/performance.md, thirtieth session), exposed
# µs a token: all GEMVs at 2 x 1024, QKV 67.2 -> 61.8, o 84.0 -> 78.4, gate+up 352.9 -> 352.0, the
# down projection (a SwiGLU row, an expression) 187.2 -> 233.6; this knob at 2048, QKV 67.0 ->
# 61.9, o 83.1 -> 77.8, but gate+up 348.2 -> 364.3 and the down after it 185.1 -> 190.6: span
# 996.0 -> 1005.8, generate() 1.005 -> 1.004. Off. What gained were the GEMVs of few programs
# (QKV 768, o 512 at 4 rows), so the rule by grid below was timed next, and lost too.
PLAIN_ROW_TILE = 0
# With PLAIN_ROW_TILE set: retile only a GEMV whose grid at its own tile is under this many
# programs per multiprocessor (None: every such GEMV). At 6 on a 132-SM part, Llama-1B's QKV (768
# programs) and o projection (512) take 2 rows and its gate+up (4096) keeps 4: on the H200 (with
# PLAIN_ROW_TILE 2048, thirty-first session) span 791.5 -> 820.7 µs a token, generate() 0.796 ->
# 0.823 ms. Off.
PLAIN_ROW_MAX_PER_SM = None
# A gate+up GEMV whose only reader is a GEMV reading it as act(gate) * up (Llama's SwiGLU MLP in a
# decode step) computes that row in its own epilogue and stores it (pair_gemv_rows): the down
# projection streams a plain vector instead of recomputing silu(gate) * up in every program and
# K step. The twenty-fourth session's probe (H100, Llama-1B) took the down GEMV 11.77 -> 10.80 µs
# with a plain row, lost then to a kernel of its own that stored it; here no kernel is added.
# H200, Llama-1B (docs/performance.md, thirty-first session): span 791.5 -> 776.2 and 792.1 ->
# 774.6 µs a token, run() 0.837 -> 0.817 and 0.831 -> 0.814 ms; generate() 0.796 -> 0.795 and
# 0.796 -> 0.789. On.
PAIR_GATE_UP = True
# ...the persistent GEMV too (codegen._gemv_persistent: Llama-3-8B's gate+up, K 4096, its RMSNorm's
# mean folded in), whose reader, the 8B's down projection (K 14336), is the template. H100,
# Llama-3-8B (docs/performance.md, thirty-second session): the down projections 39.95 -> 38.40 µs
# a node, the gate+up unchanged (51.47 -> 51.50); span 5324.4 -> 5270.7 µs a token, run() 5.370
# -> 5.311, generate() 5.336 -> 5.312 ms. On.
PAIR_PERSISTENT = True

# Weight elements per program per K step for a template GEMV whose row is an expression (0: keep
# codegen.GEMV_TILE). At 2 rows x 1024 the 1B's down projection lost 46 µs a token (H100,
# thirtieth session): each program recomputes silu(gate) * up over its K steps, so rows per
# program divide that work; 8 rows (8192) halves it against the default 4. H200, thirty-first
# session, at 8192: span 791.5 -> 804.8 µs a token, generate() 0.796 -> 0.807 ms. Off (and since
# PAIR_GATE_UP the down projection's row is a plain vector).
EXPR_ROW_TILE = 0


def store_gemv_rows(kernels: list[Kernel], next_index: int) -> tuple[list[Kernel], int]:
    """(the kernels with every such reduction storing its GEMV's row, the program's next buffer
    index after the row buffers made here); `kernels` unchanged."""
    kernels = list(kernels)
    for i, red in enumerate(kernels):
        if not _foldable(red) or numel(red.spec.src_shape) > MAX_COLS or red.spec.keep is not None:
            continue
        j = _gemv_reader(red, kernels, i, template=True)
        if j is None:
            continue
        g = kernels[j]
        spec = g.spec
        shape = (spec.batch, spec.m, spec.k)
        if spec.batch != 1 or spec.k != numel(red.spec.src_shape) or spec.plan.programs:
            continue
        stored = red.epilogue if red.epilogue.dtype == red.out.dtype \
            else Op("cast", [red.epilogue], red.out.dtype)
        a = substitute(spec.a, red.out, stored)   # its `Acc`: the reduction's raw value
        factored = _factor(a)
        row = Buffer(f"row{next_index}", "arena", spec.a.dtype, shape, next_index)
        next_index += 1
        value, scale = factored if factored is not None else (a, None)
        kernels[i] = replace(red, spec=replace(red.spec, row=row, row_value=value,
                                               row_scale=scale, row_shape=shape))
        kernels[j] = replace(g, spec=replace(spec, a=Load(row, 0, contiguous_strides(shape))))
    return kernels, next_index


def row_tiles(kernels: list[Kernel], sm_count: int) -> list[Kernel]:
    """The kernels with the template GEMVs retiled by the kind of their row (as a new list):
    - a plain load, unsplit, whose grid is small (PLAIN_ROW_MAX_PER_SM programs per multiprocessor
      of `sm_count`): PLAIN_ROW_TILE weight elements per program and K step;
    - an expression (the down projection's SwiGLU row, recomputed by every program each K step):
      EXPR_ROW_TILE, fewer programs sharing each recomputed element, split-K kept (its partial
      rows are per output column, whatever the tile).
    Each program sums its own rows over the same K steps in the same order, so the results do not
    change."""
    most = None if PLAIN_ROW_MAX_PER_SM is None else PLAIN_ROW_MAX_PER_SM * sm_count
    out = []
    for k in kernels:
        spec = k.spec
        if isinstance(spec, Matmul) and spec.stat is None and spec.partial is None:
            plan = spec.plan
            template = plan.gemv and not plan.programs and not plan.ahead
            plain = isinstance(spec.a, Load)
            tile = PLAIN_ROW_TILE if plain else EXPR_ROW_TILE
            if template and tile and (not plain or plan.split == 1 and
                                      (most is None or cdiv(spec.n, plan.bn) < most)):
                bn = min(max(2, tile // plan.bk), max(2, next_pow2(spec.n)))
                k = replace(k, spec=replace(spec, plan=replace(plan, bn=bn)))
        out.append(k)
    return out


def pair_gemv_rows(kernels: list[Kernel], next_index: int) -> tuple[list[Kernel], int]:
    """(the kernels with every gate+up GEMV whose output only a GEMV's row reads, as
    f(gate) * up, paired: each program sums gate column j beside up column j + n/2 and stores
    the row's element j; the reader loads that row), the next buffer index). Each program keeps
    its weight bytes (half the rows, each with its partner) and sums in the same order, so the
    results are the unpaired package's, up to the row's rounding to its dtype (as eager's)."""
    kernels = list(kernels)
    read_by = _readers(kernels)   # a pairing moves its reader onto a new buffer: no other changes
    for i, g in enumerate(kernels):
        spec = g.spec
        if not _pairable(g):
            continue
        readers = read_by.get(g.out.index, [])
        if len(readers) != 1 or readers[0] <= i:
            continue
        j = readers[0]
        d = kernels[j]
        pair = spec.n // 2
        if not _reads_halves(d, g.out, pair):
            continue
        # the row as the reader computed it, from the values the GEMV would have stored
        lo = g.epilogue if g.epilogue.dtype == g.out.dtype \
            else Op("cast", [g.epilogue], g.out.dtype)
        hi = replace_nodes(lo, lambda node: isinstance(node, Acc), Partner(g.epilogue.dtype))
        value = replace_nodes(d.spec.a, lambda node: isinstance(node, Load) and node.offset == 0,
                              lo)
        value = replace_nodes(value, lambda node: isinstance(node, Load), hi)   # at offset pair
        shape = (1, 1, pair)
        row = Buffer(f"row{next_index}", "arena", d.spec.a.dtype, shape, next_index)
        next_index += 1
        plan = replace(spec.plan, bn=max(2, spec.plan.bn // 2))
        kernels[i] = replace(g, spec=replace(spec, pair=pair, plan=plan), out=row, out_shape=shape,
                             epilogue=value)
        kernels[j] = replace(d, spec=replace(d.spec, a=Load(row, 0, contiguous_strides(shape))))
    return kernels, next_index


def _pairable(g: Kernel) -> bool:
    """An unsplit GEMV (the template, or the persistent one of the 8B's K 4096, its RMSNorm's
    statistic folded in or not) of one row and an even number of columns, into the arena, whose
    epilogue is arithmetic on its sum alone (so it is the same at a column's partner)."""
    spec = g.spec
    if not isinstance(spec, Matmul) or spec.pair or spec.partial is not None:
        return False
    plan = spec.plan
    return (plan.gemv and plan.split == 1 and not plan.ahead
            and (not plan.programs or PAIR_PERSISTENT)
            and spec.batch == 1 and spec.m == 1 and spec.n % 2 == 0 and g.out.kind == "arena"
            and not any(g.ext or ()) and tuple(g.out_shape) in ((1, 1, spec.n), (1, spec.n))
            and all(isinstance(node, (Acc, Const, Op)) for node in walk(g.epilogue)))


def _reads_halves(d: Kernel, buf: Buffer, pair: int) -> bool:
    """`d` is a one-row GEMV of K `pair` that reads `buf` in its row operand alone, pointwise,
    each element at its own K index in the first half and the second (a SwiGLU's gate and up)."""
    spec = d.spec
    if not isinstance(spec, Matmul) or not spec.plan.gemv or spec.batch != 1 or spec.m != 1 \
            or spec.k != pair or spec.stat is not None or spec.pair or any(d.ext or ()):
        return False
    if any(ld.buf.index == buf.index for e in (d.epilogue, spec.b) for ld in loads(e)):
        return False
    nodes = list(walk(spec.a))
    if not all(isinstance(node, (Load, Const, Op)) for node in nodes):
        return False
    got = {node.offset for node in nodes if isinstance(node, Load)}
    return got == {0, pair} and all(node.buf.index == buf.index and node.strides[-1] == 1
                                    for node in nodes if isinstance(node, Load))
