"""Stage `fuse`, second pass (opt-in, `fold_row_stats`): a GEMV computes its row's statistic.

An RMSNorm in front of a linear layer is, after lowering, two kernels in a decode step: a one-row
reduction (the mean of squares, one value) and the GEMV whose row operand recomputes the
normalised row from it (`Lowering.operand(row=True)`). The reduction reads 2-8 KiB and costs a
whole kernel boundary: ~1.4 µs of a ~2.5 µs layer-norm-plus-projection on the H200, twice per
Llama layer. Here the reduction moves into the GEMV: every GEMV program reduces the row itself
(`Matmul.stat`), in one of two forms.

- In the K loop: when the row operand is a product with the statistic only in some factors (an
  RMSNorm: x · rsqrt(mean + eps) · w; an amax scaling: x / amax) and the statistic's row is the
  GEMV's K axis, the factors without it are the row, the statistic is accumulated from the
  elements the loop walks anyway, and the dot product is multiplied by the statistic's factors
  once at the end (`Matmul.stat_scale`). Exact in real arithmetic, a reassociation in floating
  point: only where the un-normalised dot product itself overflows fp32 (rows of magnitude
  ~1e34 and up) does it give inf or NaN where the normalised row stays finite.
- Before the K loop, otherwise: a pass over the row (in L2; each program reads it once more),
  and the row operand reads the value as `Acc` where it read the reduction's one-element buffer.

Into a persistent GEMV (codegen._gemv_persistent, K 2049-4096) the fold is on by default
(FOLD_INTO_PERSISTENT): its programs hold the whole row, so the statistic is one block reduction
over loads they make anyway, in parallel with the row's, and the mean's boundary goes.

Measured (H200, Llama-1B decode, docs/performance.md, eighth session), the pre-pass form: 166 ->
133 kernels per token, but 3.7% slower with 4-row GEMV tiles (0.968 -> 1.005 ms) and 5% with
2-row ones: the pass is a serial L2 round trip at the head of every program, and the one-block
reduction it replaced overlapped with the GEMV's weight prefetch under PDL anyway. The in-loop
form (which an RMSNorm in that decoder takes) was built after that run; it measured the same
per token (0.976 against 0.980 ms, ninth session), and again on the graph of the
thirty-seventh session (stored rows, the paired gate+up; H100): generate() 0.978 against 0.980,
GPU span +15.6 µs, the gate+up slower by 2.6 µs each now that it follows the o projection
directly. Hence opt-in for the template (`fold_row_stats`, or FOLD_INTO_TEMPLATE).

When: the reduction has one row (one output element), a fixed number of columns, an epilogue of
arithmetic on its value alone (no loads: it is re-evaluated at the GEMV's indices), an arena
output that exactly one kernel reads — a GEMV without a statistic, and only in its row operand —
and nothing between the two kernels writes what the reduction reads.
"""
from __future__ import annotations

from dataclasses import replace

from .families import Matmul, Reduction
from .fuse import substitute
from .ir import Acc, Const, Kernel, Load, Op, SymValue, loads, numel, walk

STAT_OPS = ("sum", "max", "min")
# Without the fold_row_stats option: fold into persistent GEMVs alone (codegen._gemv_persistent),
# whose programs hold the whole row anyway, so the statistic is one block reduction over loads
# already made, not a pass. Llama-3-8B decode (its q/k/v, gate+up and head GEMVs are persistent;
# 65 means a token), on an H100 (bench_decode --variant, 2026-12-05): generate() 5.466 -> 5.339
# ms/token, GPU span 5423.8 -> 5324.6 µs (docs/performance.md, twenty-second session).
FOLD_INTO_PERSISTENT = True
# Into the template GEMV as well (what the fold_row_stats option asks for one compile): a module
# constant so that a benchmark variant (tools/variants.py) can time it beside other settings.
FOLD_INTO_TEMPLATE = False
STAT_MAX_COLS = 16384   # the largest row a GEMV program re-reduces (a 16K hidden size: 32 KiB)


def _value_only(expr) -> bool:
    """Arithmetic on the kernel's value and constants: valid at any index."""
    return all(isinstance(n, (Acc, Const, Op, SymValue)) for n in walk(expr))


def _reads_plainly(expr, buf) -> bool:
    """Every load of `buf` in `expr` sits under pointwise ops only (no view rewrites its index,
    which is then irrelevant: the buffer holds one element)."""
    def under_views(node, viewed):
        if isinstance(node, Load):
            return not (viewed and node.buf is buf)
        inner = viewed or not isinstance(node, Op)
        return all(under_views(c, inner) for c in node.children())
    return under_views(expr, False)


def _has_acc(expr) -> bool:
    return any(isinstance(n, Acc) for n in walk(expr))


def _factor(a):
    """(row, scale) with a == row * scale, `row` free of the statistic (`Acc`) and `scale` a
    function of it alone, through products and quotients only (a cast in between would round
    the product, which factoring out would skip); None when `a` is not such a product."""
    free, scale = [], []

    def split(e, inverse: bool) -> bool:
        if not _has_acc(e):
            free.append((e, inverse))
            return True
        if isinstance(e, Op) and e.op == "mul":
            return all(split(x, inverse) for x in e.args)
        if isinstance(e, Op) and e.op == "div":
            return split(e.args[0], inverse) and split(e.args[1], not inverse)
        if _value_only(e):
            scale.append((e, inverse))
            return True
        return False

    if not split(a, False) or not free or not scale:
        return None

    def product(parts, dtype):
        num = [e for e, inv in parts if not inv]
        den = [e for e, inv in parts if inv]
        out = num[0] if num else Const(1.0, dtype)
        for e in num[1:]:
            out = Op("mul", [out, e], dtype)
        for e in den:
            out = Op("div", [out, e], dtype)
        return out

    return product(free, a.dtype), product(scale, "float32")


def _along_k(spec) -> bool:
    """The statistic's row is the GEMV's K axis (one dimension of K elements; the rest 1), so the
    K loop walks its elements."""
    big = [d for d, size in enumerate(spec.stat_shape) if size != 1]
    return (spec.batch == 1 and spec.k_ext is None and len(big) == 1
            and spec.stat_shape[big[0]] == spec.k and big[0] in spec.stat_rdims)


def _foldable(red: Kernel) -> bool:
    spec = red.spec
    if not isinstance(spec, Reduction) or red.out.kind != "arena" or red.ext and any(red.ext):
        return False
    if numel(red.out_shape) != 1 or spec.src_ext and any(spec.src_ext):
        return False
    if spec.acc_dtype != "float32" or spec.op not in STAT_OPS or not _value_only(red.epilogue):
        return False
    return numel(spec.src_shape) <= STAT_MAX_COLS


def _gemv_reader(red: Kernel, kernels: list[Kernel], i: int, template: bool) -> int | None:
    """The index of the one kernel after `i` that reads `red.out`, when it is a GEMV that reads it
    in its row operand alone (a persistent one, or with `template` any unsplit one); else None."""
    readers = [j for j, k in enumerate(kernels) if any(b.index == red.out.index for b in k.reads())]
    if len(readers) != 1 or readers[0] <= i:
        return None
    j = readers[0]
    g = kernels[j]
    spec = g.spec
    if not isinstance(spec, Matmul) or not spec.plan.gemv or spec.stat is not None:
        return None
    if spec.plan.split > 1:
        return None   # a split one sees part of the row
    if not spec.plan.programs and not template:
        return None
    if spec.plan.programs and not _along_k(replace(spec, stat_shape=tuple(red.spec.src_shape),
                                                   stat_rdims=tuple(red.spec.rdims))):
        return None   # the persistent GEMV reduces the statistic over the one row it holds
    if any(ld.buf.index == red.out.index for e in (g.epilogue, spec.b) for ld in loads(e)):
        return None
    if not _reads_plainly(spec.a, red.out):
        return None
    read = {b.index for b in red.reads()}
    if g.out.index in read or any(k.out.index in read for k in kernels[i + 1:j]):
        return None   # the row changes before the GEMV runs, or the GEMV overwrites it
    return j


def fold_row_stats(kernels: list[Kernel], template: bool = True) -> list[Kernel]:
    """The kernels with every foldable one-row reduction moved into the GEMV that reads it, as a
    new list (`kernels` and its kernels unchanged); `template` False: into persistent GEMVs
    only (FOLD_INTO_PERSISTENT)."""
    kernels = list(kernels)
    i = 0
    while i < len(kernels):
        red = kernels[i]
        j = _gemv_reader(red, kernels, i, template) if _foldable(red) else None
        if j is None:
            i += 1
            continue
        g = kernels[j]
        a = substitute(g.spec.a, red.out, red.epilogue)   # _reads_plainly: under ops only
        spec = replace(g.spec, a=a, stat=red.spec.src, stat_shape=tuple(red.spec.src_shape),
                       stat_rdims=tuple(red.spec.rdims), stat_op=red.spec.op)
        factored = _factor(a) if _along_k(spec) else None
        if factored is not None:
            spec = replace(spec, a=factored[0], stat_scale=factored[1])
        label = "+".join([red.label, g.label]) if red.label else g.label
        kernels = kernels[:i] + kernels[i + 1:j] + [replace(g, spec=spec, label=label)] \
            + kernels[j + 1:]
    return kernels
