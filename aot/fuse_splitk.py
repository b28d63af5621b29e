"""Stage `fuse`, last pass (off: `SPLIT_K_IN_KERNEL`, slower on the H200): a split-K matmul
sums its own splits, and the reduction kernel behind it goes.

Lowering splits K when a matmul's tiles alone would leave most of the chip idle (gemm_plan):
the matmul stores float32 partial sums [split, batch, m, n] and a reduction kernel adds them up
and applies the epilogue (a bias, a residual add). That reduction is a kernel boundary (~1 µs
under PDL on the H200) and a dependent trip to memory: ViT-S has 37 of them among its 125
kernels, a Llama-1B decode token 16 (its down projections). Here the matmul keeps the partial
sums as scratch (`Matmul.partial`) and counts each program in an arrival word per output tile
(`Matmul.arrivals`, session state shared by every such kernel, zero between kernels); the last
program of a tile adds the splits and stores the epilogue (codegen._reduce_own_splits). The
"last program finishes" pattern of the generation step (docs/design-state.md); the design and
what it needs from a GPU test are in docs/design-pdl.md.

On the H200 it is correct (100 NaN-poisoned ViT-S calls against eager) and slower: ViT-S 0.436
-> 0.519 ms, Llama-1B 0.821 -> 0.842 ms/token (docs/performance.md, sixteenth session). The
tile's last program adds every split alone, serial work that the reduction kernel spread over
many programs. Where a kernel that owns whole rows reads the sum, fuse_norm takes the reduction
instead (it runs first).

When: the reduction is the next kernel, sums the matmul's whole partial buffer over its split
axis, and is the buffer's only reader; the two share their extents; the tiles fit the arrival
words. The arrival words are one state buffer that every kernel of this kind writes, so the
graph's edges order them all (memplan.dependencies): a kernel finds every word at zero because
the one before it finished, its last programs having put their words back.
"""
from __future__ import annotations

from dataclasses import replace

from .codegen import cdiv
from .families import Matmul, Reduction
from .ir import Kernel, Load, Program, contiguous_strides, with_zero_state

SPLIT_K_IN_KERNEL = False
ARRIVALS = "grace.split_k_arrivals"   # the state entry (a model buffer of this name is refused)
ARRIVAL_WORDS = 4096                  # output tiles a split-K kernel may have


def add_state(program: Program) -> Program:
    """The lowered program with the arrival words after its own state (every graph gets them,
    so they have the same offset in each)."""
    from .lower import LoweringError
    if any(b.name == ARRIVALS for b in program.state):
        raise LoweringError(f"the model has a buffer named {ARRIVALS}, which grace uses")
    return with_zero_state(program, [(ARRIVALS, "int32", (ARRIVAL_WORDS,))])


def reduce_in_kernel(kernels: list[Kernel], program: Program) -> list[Kernel]:
    arrivals = next((b for b in program.state if b.name == ARRIVALS), None)
    if arrivals is None:
        return kernels
    return merge_with_next(kernels, _fusable,
                           lambda k: replace(k.spec, partial=k.out, arrivals=arrivals))


def merge_with_next(kernels: list[Kernel], fusable, spec_of) -> list[Kernel]:
    """The kernels with every k that `fusable(k, next, kernels)` accepts made one kernel with
    the next: spec `spec_of(k)` (k's, now keeping its output as scratch), the next kernel's out,
    shape, epilogue, label and extents. Here and in aot/fuse_combine.py."""
    out: list[Kernel] = []
    i = 0
    while i < len(kernels):
        k = kernels[i]
        if i + 1 < len(kernels) and fusable(k, kernels[i + 1], kernels):
            r = kernels[i + 1]
            out.append(Kernel(spec_of(k), r.out, r.out_shape, r.epilogue, label=r.label,
                              ext=r.ext))
            i += 2
        else:
            out.append(k)
            i += 1
    return out


def _tiles(spec: Matmul) -> int:
    plan = spec.plan
    if plan.gemv:
        return cdiv(spec.n, plan.bn) * spec.batch
    return cdiv(spec.m, plan.bm) * cdiv(spec.n, plan.bn) * spec.batch


def _fusable(k: Kernel, r: Kernel, kernels: list[Kernel]) -> bool:
    spec = k.spec
    if not isinstance(spec, Matmul) or not spec.writes_partials or spec.plan.programs:
        return False
    if _tiles(spec) > ARRIVAL_WORDS or (k.ext or None) != (r.ext or None):
        return False
    red = r.spec
    if not isinstance(red, Reduction) or red.op != "sum" or tuple(red.rdims) != (0,):
        return False
    partial = k.out
    src = red.src
    if not (isinstance(src, Load) and src.buf.index == partial.index and src.offset == 0
            and tuple(src.strides) == contiguous_strides(partial.shape)
            and tuple(red.src_shape) == tuple(partial.shape)):
        return False
    if tuple(r.out_shape) != (spec.batch, spec.m, spec.n):
        return False
    # the partial sums are the reduction's alone (then they are the kernel's scratch)
    return not any(b.index == partial.index for other in kernels if other is not r
                   for b in other.reads())
