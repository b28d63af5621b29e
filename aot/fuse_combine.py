"""Stage `fuse`, after the appends (off: `COMBINE_IN_ATTENTION`, it lost): a split-KV attention
combines its own key splits, and the attn_combine kernel behind it goes.

A decode step's attention splits its keys over many programs (flash-decoding,
codegen.attention_plan): each stores its partial output and log-sum-exp, and a combine kernel
weights them and applies the epilogue. That combine is one boundary on the chain from the QKV
projection to the o projection, which the o projection (its weights loaded before its wait,
codegen.GEMV_PREFETCH_ALL_MAX_BYTES) waits for: 1.63 µs a layer on the H200 in the Llama-1B
timeline (thirty-first session), 26 µs a token.

Here the attention keeps its partials as scratch (`Attention.partial`) and counts each program
in an arrival word per query tile (`Attention.arrivals`, the state entry of aot/fuse_splitk.py,
zero between kernels); the tile's last program reads every split of its rows back around L1,
combines them and stores the epilogue (codegen._combine_own_splits). Unlike the split-K sum
(fuse_splitk, which lost: one program added 64 KB of partials alone), the work the last program
takes on is what one program of attn_combine did: a Llama-1B group's 16 splits x 4 heads x 64
values, 16 KB read from L2.

When: the combine is the next kernel and the partial buffer's only reader; the two share their
extents; the attention's query tiles fit the arrival words. Every kernel that uses the words is
ordered by the graph's edges (they all write the one state buffer), so each finds them at zero.
"""
from __future__ import annotations

from dataclasses import replace

from .codegen import cdiv
from .families import Attention, AttnCombine
from .fuse_splitk import ARRIVAL_WORDS, ARRIVALS, merge_with_next
from .ir import Kernel, Load, Program, contiguous_strides

# Off: correct on the GPU (tests/gpu/test_fuse_combine_gpu.py, 200 NaN-poisoned calls in fp32 and
# bf16; the `combine` decode knob) and slower. H100, Llama-1B (docs/performance.md, thirty-second
# session, one process): GPU span 965.9 -> 1011.0 µs a token with 16 nodes fewer (151 -> 135),
# run() 1.018 -> 1.059, generate() 0.981 -> 1.023 ms. Each packed tile's last program does the
# work of 4 attn_combine programs (4 heads) behind an atomic round trip; the run's per-node
# timeline was not kept, so where the 45 µs went is not pinned down.
COMBINE_IN_ATTENTION = False


def combine_in_attention(kernels: list[Kernel], program: Program) -> list[Kernel]:
    """The kernels with every such attention + combine pair made one attention kernel (the
    program's state must hold the arrival words: fuse_splitk.add_state)."""
    arrivals = next((b for b in program.state if b.name == ARRIVALS), None)
    if arrivals is None:
        return kernels
    return merge_with_next(kernels, _fusable,
                           lambda k: replace(k.spec, partial=k.out, arrivals=arrivals))


def query_tiles(spec: Attention) -> int:
    """The attention's program tiles over its query rows (grid dimensions 0 and 1): one arrival
    word each, counted by the tile's `split` programs."""
    return cdiv(spec.lq * spec.plan.pack, spec.plan.bm) * spec.b * spec.h // spec.plan.pack


def _fusable(k: Kernel, c: Kernel, kernels: list[Kernel]) -> bool:
    spec = k.spec
    if not isinstance(spec, Attention) or not spec.writes_partials:
        return False
    if query_tiles(spec) > ARRIVAL_WORDS or (k.ext or None) != (c.ext or None):
        return False
    comb = c.spec
    if not isinstance(comb, AttnCombine) or comb.parts != spec.plan.split or (
            comb.b, comb.h, comb.lq, comb.dv) != (spec.b, spec.h, spec.lq, spec.dv):
        return False
    partial = k.out
    src = comb.partial
    if not (isinstance(src, Load) and src.buf.index == partial.index and src.offset == 0
            and tuple(src.strides) == contiguous_strides(partial.shape)):
        return False
    # the partials are the combine's alone (then they are the attention's scratch)
    return not any(b.index == partial.index for other in kernels if other is not c
                   for b in other.reads())
