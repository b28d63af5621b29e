"""Stage `fuse`, after epilogue fusion: a split-K reduction folded into the LayerNorm that reads it.

A transformer block ends its attention and its MLP the same way: a projection whose few tiles
leave the chip idle is split over K (codegen.gemm_plan), a reduction kernel adds the float32
partial sums and applies the epilogue (bias, residual add), and a LayerNorm kernel reads that
sum, whole, as its source. ViT-S at batch 1 has 24 such pairs, GPT-2 6L at 32 tokens 6, BERT
at short lengths some. The LayerNorm's programs already own whole rows, so they can add the
splits themselves: the reduction kernel, its boundary and the round trip of its result through
memory go. When later kernels read the sum as well (the residual stream of a pre-norm block:
`x = x + proj(...)`, then `norm(x)` and later `x + mlp(...)`), the LayerNorm stores it
(`LayerNorm.keep`); a post-norm block (BERT: `norm(x + proj(...))`) needs no copy.

When: the reduction sums a load of partials over its leading axis of at most MAX_PARTS splits;
the LayerNorm's source reads its result element for element (identity load, pointwise ops
above it), and nothing else does until the LayerNorm; no kernel in between writes what the
reduction reads; the two agree on their extents (or both are static).
"""
from __future__ import annotations

from dataclasses import replace

from .families import LayerNorm, Reduction
from .fuse import _joined, replace_nodes, substitute
from .ir import Acc, Kernel, Load, Op, identity_load, loads, numel, only_ops_above, walk
from .views import reshape

# On the H200 (docs/performance.md, 2026-12-03, sixteenth session): ViT-S fp32 0.439 -> 0.426 ms
# (125 -> 101 kernels), GPT-2 6L 0.258 -> 0.254 ms (benchmark --variant, one run).
FOLD_SPLIT_K_INTO_NORM = True
# ...also into a reduction of its source's last dimensions (an RMSNorm's mean of squares). Off:
# in the Llama-1B decode graph the down projection's 4 splits were summed by the one program of
# the mean (2048 columns) instead of the reduction's 32, and a token took longer with 16 kernels
# fewer: generate() 0.814 -> 0.836 ms, run() 0.860 -> 0.872 (bench_decode --variant, same run).
FOLD_INTO_ROW_REDUCTIONS = False
MAX_PARTS = 8   # splits a norm adds in its source (codegen's split-K takes 2 to 8)


def fold_into_norms(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels with each foldable split-K reduction moved into the norm that reads it, as a
    new list (`kernels` unchanged)."""
    kernels = list(kernels)
    j = 0
    while j < len(kernels):
        folded = _fold(kernels, j)
        if folded is None:
            j += 1
            continue
        i, norm = folded
        kernels = kernels[:i] + kernels[i + 1:j] + [norm] + kernels[j + 1:]
        # the consumer moved up one place; look at the same position (the next kernel) again
    return kernels


def _space(kernel: Kernel):
    """(shape, extents) of the index space over which a foldable consumer evaluates its source,
    or None: a LayerNorm, or (FOLD_INTO_ROW_REDUCTIONS) a reduction of its source's last
    dimensions (an RMSNorm's mean of squares), that keeps nothing yet."""
    spec = kernel.spec
    if isinstance(spec, LayerNorm) and spec.keep is None:
        return tuple(kernel.out_shape), kernel.ext
    if isinstance(spec, Reduction) and spec.keep is None and FOLD_INTO_ROW_REDUCTIONS:
        n = len(spec.src_shape)
        if tuple(spec.rdims) == tuple(range(n - len(spec.rdims), n)):
            return tuple(spec.src_shape), spec.src_ext
    return None


def _fold(kernels: list[Kernel], j: int) -> tuple[int, Kernel] | None:
    """(index of the split-K reduction, the consumer that replaces both) or None."""
    norm = kernels[j]
    space = _space(norm)
    if space is None:
        return None
    shape, ext = space
    for x in norm.reads():
        if x.kind != "arena" or x.dynamic:
            continue
        i = _writer(kernels, j, x)
        if i is None:
            continue
        red = kernels[i]
        value = stored_split_sum(red)
        if value is None or not _may_move(kernels, i, j, red, x, norm, shape, ext):
            continue
        value = reshape(value, red.out_shape, shape)
        src = substitute(norm.spec.src, x, value)
        later = any(x.index == b.index for k in kernels[j + 1:] for b in k.reads())
        spec = replace(norm.spec, src=src, keep=x if later else None,
                       kept=value if later else None)
        return i, replace(norm, spec=spec, label=_joined(red.label, norm.label))
    return None


def _writer(kernels: list[Kernel], j: int, x) -> int | None:
    """The kernel before `j` that writes `x`, if it is the only one that does."""
    writers = [i for i, k in enumerate(kernels[:j]) if any(b.index == x.index for b in k.writes())]
    return writers[0] if len(writers) == 1 else None


def stored_split_sum(red: Kernel):
    """What the split-K reduction `red` stores, as an expression over its output index (the
    partial sums' total through its epilogue, rounded to its output's dtype), or None when it
    is not one (_split_sum) or its epilogue reindexes the sum (not pointwise)."""
    total = _split_sum(red)
    if total is None:
        return None
    value = substitute_acc(red.epilogue, total)
    if any(isinstance(node, Acc) for node in walk(value)):
        return None
    # a half-precision value is computed in float32 (codegen_expr) and rounded where it is
    # stored: a reader that adds the sums itself rounds them through the stored type too
    if value.dtype != red.out.dtype or red.out.dtype in ("float16", "bfloat16"):
        value = Op("cast", [value], red.out.dtype)
    return value


def _split_sum(red: Kernel):
    """The partial sums' total, an expression over the reduction's output index, or None when
    `red` is not a split-K reduction of at most MAX_PARTS splits."""
    spec = red.spec
    if not isinstance(spec, Reduction) or spec.op != "sum" or tuple(spec.rdims) != (0,):
        return None
    parts = spec.src_shape[0]
    src = spec.src
    if not isinstance(src, Load) or not 1 < parts <= MAX_PARTS:
        return None
    ext = spec.src_ext
    if not _static(ext) and (ext[0] is not None or tuple(ext[1:]) != tuple(red.ext or ())):
        return None   # the splits' rows are valid where the reduction's output rows are
    if src.buf.dynamic or len(src.strides) != len(spec.src_shape):
        return None
    terms = [Load(src.buf, src.offset + s * src.strides[0], src.strides[1:]) for s in range(parts)]
    terms = [t if t.dtype == spec.acc_dtype else Op("cast", [t], spec.acc_dtype) for t in terms]
    total = terms[0]
    for t in terms[1:]:
        total = Op("add", [total, t], spec.acc_dtype)
    return total


def _may_move(kernels: list[Kernel], i: int, j: int, red: Kernel, x, norm: Kernel, shape,
              ext) -> bool:
    """The reduction's work may run at the consumer's place (`shape`, `ext`: where it evaluates
    its source) and leave `x` to it."""
    if not (_static(red.ext) and _static(ext)) and (
            _squeezed(red.out_shape, red.ext) != _squeezed(shape, ext)):
        return False   # the same rows are valid in both (a leading 1 aside)
    if numel(red.out_shape) != numel(shape) or numel(x.shape) != numel(shape):
        return False
    if not (identity_load(norm.spec.src, shape, x) and only_ops_above(norm.spec.src, x)):
        return False
    if any(load.buf.index == x.index for name, e in norm.spec.exprs() if name != "src"
           for load in loads(e)):
        return False
    read = {b.index for b in red.reads()}
    between = kernels[i + 1:j]
    if any(b.index in read for k in between for b in k.writes()):
        return False   # it would read what a kernel in between overwrote
    return not any(b.index == x.index for k in between for b in k.reads() + k.writes())


def _squeezed(shape, ext) -> list:
    """(size, extent) of each dimension but those of size 1."""
    ext = ext or (None,) * len(shape)
    return [(size, e) for size, e in zip(shape, ext) if size != 1]


def _static(ext) -> bool:
    return ext is None or all(e is None for e in ext)


def substitute_acc(expr, value):
    """`expr` with every `Acc` (under pointwise ops) replaced by `value` (a new tree)."""
    return replace_nodes(expr, lambda node: isinstance(node, Acc), value)
