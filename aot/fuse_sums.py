"""Stage `fuse`, after the row statistics: a split-K reduction read only by GEMVs goes into them.

A Llama decode layer ends with a down projection split over K (codegen.gemm_plan: a long row
leaves most of the chip idle otherwise) and a reduction kernel that adds its partial rows and the
residual: the new residual stream x. Two kernels read x, both GEMVs: the next layer's q/k/v
projection (its RMSNorm folded in, fuse_stats.py), which loads the whole row in every program,
and the o projection, whose epilogue adds x to its sums element by element. Each can add the
partial rows itself where it loads x: the reduction kernel and its boundary go, and x is never
stored. A persistent GEMV's programs load 3 rows from L2 where they loaded 1 (2 float32 partials
and the residual); the epilogue 3 elements where it loaded 1.

When (INLINE_SPLIT_SUMS): the reduction sums a load of at most fuse_norm.MAX_PARTS partials over
its leading axis, with a pointwise epilogue; it and its readers are static; every reader is a
one-row matmul (a GEMV) whose every expression that loads x reads it element for element over as
many elements as x has (identity load, pointwise ops above it); nothing between the reduction and
its last reader writes what the reduction reads.
"""
from __future__ import annotations

from dataclasses import replace

from .families import Matmul
from .fuse import _joined, substitute
from .fuse_norm import _static, stored_split_sum
from .ir import Kernel, identity_load, loads, numel, only_ops_above
from .views import reshape

# Off: timed on an H100 (docs/performance.md, 2026-12-05, twenty-third session; one process,
# bench_decode --shape 8b --variant sums:...): generate() 5.332 -> 5.350 ms/token at the median,
# run() 5.385 -> 5.381, 32 kernels a token fewer. Not yet timed on an H200.
INLINE_SPLIT_SUMS = False


def inline_split_sums(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels with every such reduction inlined into its readers, as a new list
    (`kernels` unchanged)."""
    kernels = list(kernels)
    i = 0
    while i < len(kernels):
        inlined = _inline(kernels, i)
        if inlined is None:
            i += 1
            continue
        kernels = kernels[:i] + inlined   # the next kernel moved to `i`: look at it next
    return kernels


def _inline(kernels: list[Kernel], i: int) -> list[Kernel] | None:
    """kernels[i + 1:] with kernels[i]'s sums in its readers, or None when it does not qualify."""
    red = kernels[i]
    value = stored_split_sum(red)
    x = red.out
    if value is None or x.kind != "arena" or x.dynamic or not _static(red.ext):
        return None
    later = kernels[i + 1:]
    readers = [j for j, k in enumerate(later) if any(b.index == x.index for b in k.reads())]
    if not readers:
        return None
    read = {b.index for b in red.reads()} | {x.index}
    if any(b.index in read for k in later[:readers[-1] + 1] for b in k.writes()):
        return None   # what it reads (or x) changes before its last reader has run
    out = list(later)
    for j in readers:
        fused = _into(later[j], x, value, red)
        if fused is None:
            return None
        out[j] = fused
    return out


def _into(kernel: Kernel, x, value, red: Kernel) -> Kernel | None:
    """`kernel` (a GEMV) reading `value` where it read `x`, or None when it cannot."""
    spec = kernel.spec
    if not isinstance(spec, Matmul) or spec.m != 1 or spec.batch != 1 or not _static(kernel.ext):
        return None
    if spec.partial is not None or spec.k_ext is not None:
        return None
    spaces = {"epilogue": tuple(kernel.out_shape), **spec.index_spaces(kernel.out_shape)}
    exprs = {"epilogue": kernel.epilogue, **dict(spec.exprs())}
    changed = {}
    for name, expr in exprs.items():
        if not any(ld.buf.index == x.index for ld in loads(expr)):
            continue
        space = spaces.get(name)
        if space is None or numel(space) != numel(x.shape):
            return None
        if not (identity_load(expr, space, x) and only_ops_above(expr, x)):
            return None
        changed[name] = substitute(expr, x, reshape(value, red.out_shape, space))
    epilogue = changed.pop("epilogue", kernel.epilogue)
    return replace(kernel, epilogue=epilogue, spec=replace(spec, **changed),
                   label=_joined(red.label, kernel.label))
