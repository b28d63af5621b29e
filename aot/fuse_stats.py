"""Stage `fuse`, second pass (opt-in, `fold_row_stats`): a GEMV computes its row's statistic.

An RMSNorm in front of a linear layer is, after lowering, two kernels in a decode step: a one-row
reduction (the mean of squares, one value) and the GEMV whose row operand recomputes the
normalised row from it (`Lowering.operand(row=True)`). The reduction reads 2-8 KiB and costs a
whole kernel boundary: ~1.4 µs of a ~2.5 µs layer-norm-plus-projection on the H200, twice per
Llama layer. Here the reduction moves into the GEMV: every GEMV program reduces the row once
before its K loop (the row is in L2; each program reads it once more), and the row operand
reads that value where it read the reduction's one-element buffer.

Measured (H200, Llama-1B decode, docs/performance.md, eighth session): 166 -> 133 kernels per
token, but 3.7% slower with 4-row GEMV tiles (0.968 -> 1.005 ms) and 5% with 2-row ones: the
re-reduction is a serial L2 round trip at the head of every program, the row is read by every
program one more time, and the separate one-block reduction it replaces overlaps with the GEMV's
weight prefetch under PDL anyway. Hence opt-in. What would win: accumulating the sum of squares
in the K loop itself (the row is loaded there anyway) and scaling the dot product once at the end
(exact for an RMSNorm in fp32; for bf16 it skips the rounding of the normalised row).

When: the reduction has one row (one output element), a fixed number of columns, an epilogue of
arithmetic on its value alone (no loads: it is re-evaluated at the GEMV's indices), an arena
output that exactly one kernel reads — a GEMV without a statistic, and only in its row operand —
and nothing between the two kernels writes what the reduction reads.
"""
from __future__ import annotations

from dataclasses import replace

from .families import Matmul, Reduction
from .ir import Acc, Const, Kernel, Load, Op, SymValue, loads, numel, walk

STAT_OPS = ("sum", "max", "min")
STAT_MAX_COLS = 16384   # the largest row a GEMV program re-reduces (a 16K hidden size: 32 KiB)


def _value_only(expr) -> bool:
    """Arithmetic on the kernel's value and constants: valid at any index."""
    return all(isinstance(n, (Acc, Const, Op, SymValue)) for n in walk(expr))


def _substitute(expr, buf, value):
    """`expr` with every load of `buf` replaced by `value` (a new tree; `expr` is unchanged)."""
    memo = {}

    def go(node):
        if id(node) in memo:
            return memo[id(node)]
        if isinstance(node, Load) and node.buf is buf:
            out = value
        elif isinstance(node, Op):
            out = Op(node.op, [go(a) for a in node.args], node.dtype, node.param)
        else:
            out = node   # a leaf, or a view (that reads no `buf`: _reads_plainly)
        memo[id(node)] = out
        return out

    return go(expr)


def _reads_plainly(expr, buf) -> bool:
    """Every load of `buf` in `expr` sits under pointwise ops only (no view rewrites its index,
    which is then irrelevant: the buffer holds one element)."""
    def under_views(node, viewed):
        if isinstance(node, Load):
            return not (viewed and node.buf is buf)
        inner = viewed or not isinstance(node, Op)
        return all(under_views(c, inner) for c in node.children())
    return under_views(expr, False)


def _foldable(red: Kernel) -> bool:
    spec = red.spec
    if not isinstance(spec, Reduction) or red.out.kind != "arena" or red.ext and any(red.ext):
        return False
    if numel(red.out_shape) != 1 or spec.src_ext and any(spec.src_ext):
        return False
    if spec.acc_dtype != "float32" or spec.op not in STAT_OPS or not _value_only(red.epilogue):
        return False
    return numel(spec.src_shape) <= STAT_MAX_COLS


def _gemv_reader(red: Kernel, kernels: list[Kernel], i: int) -> int | None:
    """The index of the one kernel after `i` that reads `red.out`, when it is a GEMV that reads it
    in its row operand alone; else None."""
    readers = [j for j, k in enumerate(kernels) if any(b.index == red.out.index for b in k.reads())]
    if len(readers) != 1 or readers[0] <= i:
        return None
    j = readers[0]
    g = kernels[j]
    spec = g.spec
    if not isinstance(spec, Matmul) or not spec.plan.gemv or spec.stat is not None:
        return None
    if any(ld.buf.index == red.out.index for e in (g.epilogue, spec.b) for ld in loads(e)):
        return None
    if not _reads_plainly(spec.a, red.out):
        return None
    read = {b.index for b in red.reads()}
    if g.out.index in read or any(k.out.index in read for k in kernels[i + 1:j]):
        return None   # the row changes before the GEMV runs, or the GEMV overwrites it
    return j


def fold_row_stats(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels with every foldable one-row reduction moved into the GEMV that reads it, as a
    new list (`kernels` and its kernels unchanged)."""
    kernels = list(kernels)
    i = 0
    while i < len(kernels):
        red = kernels[i]
        j = _gemv_reader(red, kernels, i) if _foldable(red) else None
        if j is None:
            i += 1
            continue
        g = kernels[j]
        a = _substitute(g.spec.a, red.out, red.epilogue)
        spec = replace(g.spec, a=a, stat=red.spec.src, stat_shape=tuple(red.spec.src_shape),
                       stat_rdims=tuple(red.spec.rdims), stat_op=red.spec.op)
        label = "+".join([red.label, g.label]) if red.label else g.label
        kernels = kernels[:i] + kernels[i + 1:j] + [replace(g, spec=spec, label=label)] \
            + kernels[j + 1:]
    return kernels
