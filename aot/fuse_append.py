"""Stage `fuse`, third pass (on: `APPEND_AFTER_ATTENTION`; see "Measured" below): a decode step's
KV-cache appends leave the attention's critical path.

A decode step writes this token's key and value into the caches (two scatter kernels, after the
QKV projection) and then attends over the caches, so every layer runs QKV -> appends ->
attention -> combine -> output projection, each arrow a kernel boundary (~1.1 µs under PDL on
the H200, plus the appends' own latency). Here the attention takes this token's key and value
from the expressions the appends store (`Attention.k_new`, `v_new`, at key index `new_pos`)
instead of from the cache, and the appends move after it: they then wait for the attention (it
reads the caches they write) and run beside the combine, off the path to the next layer.

Exactly equivalent: the append writes one position, `new_pos`; the attention reads the cache at
every other position as before and, at `new_pos`, the very value (cast to the cache's dtype) the
append stores; a position outside the cache is skipped by the append and matches no key.

When, per attention: its keys and values are each one state buffer read whole (a plain load, or
grouped-query attention's head map), written last by a scatter of one position (index space
[b, h_kv, 1, d], destination [i0, i1, pos, i3]) into that buffer, both at the same position; the
attention reads the caches only through `k` and `v`; the kernels between an append and the
attention neither touch the caches nor write what the appends read, and the attention does not
write it either. Static shapes only (a decode step's graph: `seq=1`).

With APPEND_IN_ATTENTION (on) the appends are not launched at all: the attention's
spec takes their values, positions and caches (`Attention.k_store`, `v_store`, `k_cache`, ...)
and the programs of its first key split store them (codegen._store_appends), after gdc_wait(),
the appends' own values at their own positions. The attention is then the only node of the step
that writes the caches; another of its programs may load the appended position while it is
stored, and discards that load (it takes `k_new` / `v_new` there). Two kernels a layer fewer.

Measured, four times. Alone the pass lost: the ninth session 0.972 -> 0.992 ms a token, the
fifteenth (packed grouped-query heads) 0.858 -> 0.893. Two causes were found in the eighteenth
session. (1) The memory plan gave the combine's output the bytes of the QKV projection's output,
which the moved appends read: a write-after-read edge put the appends back on the path (combine
after appends). The appends are now `Kernel.off_path`, and memplan keeps their inputs to the end
of the graph. (2) Every cache load waited for gdc_wait(); now that nothing before the attention
writes the caches, codegen.ATTN_KV_BEFORE_WAIT loads the key and value blocks before the wait.
Nineteenth session, H200, one process per model (docs/performance.md): with both, a Llama-1B
token's GPU span 824.1 -> 804.9 µs (generate() 0.821 -> 0.801 ms), but Llama-8B's 4175.7 ->
4249.4 µs (generate() 4.179 -> 4.259); the pass alone, 1B: 824.1 -> 848.5 µs. The 8B loss was
registers (twentieth session): its 128-key x 128-column early blocks took 255 registers and
spilled, and such a program fits no multiprocessor beside the QKV GEMV it should overlap.
With 64-key blocks at head dimension 128 (codegen.ATTN_SPLIT_BLOCK_ELEMS) the 8B span went
4174.4 -> 4127.7 µs (generate() 4.192 -> 4.142 ms). On by default since, with
ATTN_KV_BEFORE_WAIT. To time without: `--variant off:fuse_append.APPEND_AFTER_ATTENTION=False,
codegen.ATTN_KV_BEFORE_WAIT=False` of tools/bench_decode.py.

APPEND_IN_ATTENTION, twenty-seventh session, H100, two 1B runs and one 8B run: the GPU span is
unchanged (1B 1010.1 -> 1009.5 and 1011.7 -> 1013.2 µs, 8B 5326.7 -> 5323.0 µs) because the
appends' 0.87 µs each were the attention's own drain, which the combine now waits for instead
(attention + appends + combine 5.96 µs a layer either way); generate() moved within the order
noise of a run (1B -0.4% and +0.7%, 8B +0.2%). run() gained on the 1B (-2.4%, -1.9%; 8B -0.6%):
a decode graph of 151 nodes instead of 183 (8B 230 instead of 294) starts sooner. On by default.
"""
from __future__ import annotations

from dataclasses import replace

from .families import Attention, Scatter
from .ir import Acc, DimMap, Index, Kernel, Load, Op, Reindex, contiguous_strides, loads, walk

APPEND_AFTER_ATTENTION = True
# With it, the appends go into the attention itself: its first key split's programs store this
# call's key and value into the caches (families.Attention.k_store..., codegen._store_appends),
# and the two scatter kernels a layer are not launched. On (twenty-seventh session, below).
APPEND_IN_ATTENTION = True
# The moved appends of an attention whose caches and inputs no later kernel touches (reads or
# writes the caches, writes what the appends read) go to the end of the kernel list instead of
# right after it: the graph then issues every critical-path kernel before
# them (their edges are the same: the QKV projection's output and the attention's reads).
APPENDS_LAST = False


def _whole_read(expr, shape):
    """(buffer, maps) when `expr`, over the attention's [b, h, lk, d] `shape`, reads one state
    buffer of the same [., ., lk, d] layout at key index i2 — a plain load, or a Reindex of one
    whose key map is the identity and whose other maps ignore the key index (grouped-query
    attention's head map) — else None. `maps` then evaluate the cache's index from the
    attention's."""
    maps, inner = None, expr
    if isinstance(expr, Reindex):
        if expr.bounds is not None or len(expr.maps) != 4:
            return None
        maps, inner = list(expr.maps), expr.child
        key = maps[2]
        if (key.kind, key.src, key.step, key.start) != ("dim", 2, 1, 0):
            return None
        for d, m in enumerate(maps):
            if d == 2:
                continue
            if m.kind == "dim" and m.src == 2:
                return None
            if m.kind == "expr" and any(isinstance(n, Index) and n.dim == 2
                                        for n in walk(m.expr)):
                return None
    if not isinstance(inner, Load) or inner.buf.kind != "state" or len(inner.buf.shape) != 4:
        return None
    buf = inner.buf
    if inner.offset != 0 or inner.strides != contiguous_strides(buf.shape):
        return None
    if buf.shape[2] != shape[2] or buf.shape[3] != shape[3]:
        return None
    if maps is None:   # a plain load: the attention's index is the cache's
        if tuple(buf.shape) != tuple(shape):
            return None
        maps = [DimMap("dim", d) for d in range(4)]
    return buf, maps


def _one_position(scatter: Kernel, cache) -> object | None:
    """The position expression of a scatter that writes one position of `cache` (values
    [b, h_kv, 1, d] to [i0, i1, pos, i3]), else None."""
    spec = scatter.spec
    if not isinstance(spec, Scatter) or spec.accumulate is not None:
        return None
    if any(isinstance(n, Acc) for n in walk(scatter.epilogue)):
        return None
    if scatter.out.index != cache.index or scatter.ext and any(scatter.ext):
        return None
    if tuple(scatter.out_shape) != Attention.append_space(cache) or len(spec.coords) != 4:
        return None
    for dim in (0, 1, 3):
        c = spec.coords[dim]
        if not (isinstance(c, Index) and c.dim == dim):
            return None
    return spec.coords[2]


def _reads(kernel: Kernel) -> set[int]:
    return {b.index for b in kernel.reads()}


def _writer_before(kernels, i, buf) -> int | None:
    for j in range(i - 1, -1, -1):
        if kernels[j].out.index == buf.index:
            return j
    return None


def _at_key_zero(expr, maps):
    """`expr` (over the append's [b, h_kv, 1, d]) at the attention's index, key index 0."""
    at = list(maps)
    at[2] = DimMap("const", start=0)
    return Reindex(expr, at)


def _rewrite(kernels: list[Kernel], ai: int) -> list[Kernel] | None:
    att = kernels[ai]
    spec = att.spec
    if spec.new_pos is not None or spec.lk_ext is not None or att.ext and any(att.ext):
        return None
    k = _whole_read(spec.k, (spec.b, spec.h, spec.lk, spec.d))
    v = _whole_read(spec.v, (spec.b, spec.h, spec.lk, spec.dv))
    if k is None or v is None or k[0].index == v[0].index:
        return None
    caches = {k[0].index, v[0].index}
    # the attention reads the caches through k and v alone
    others = [att.epilogue, spec.q] + [e for e in (spec.mask,) if e is not None]
    if any(ld.buf.index in caches for e in others for ld in loads(e)):
        return None
    if any(ld.buf.index == v[0].index for ld in loads(spec.k)) or \
            any(ld.buf.index == k[0].index for ld in loads(spec.v)):
        return None
    ki, vi = _writer_before(kernels, ai, k[0]), _writer_before(kernels, ai, v[0])
    if ki is None or vi is None:
        return None
    # the appends are the caches' only writers before the attention: once they move, nothing
    # before it writes them (codegen.ATTN_KV_BEFORE_WAIT loads them before gdc_wait() then)
    if any(kernels[j].out.index in caches for j in range(ai) if j not in (ki, vi)):
        return None
    pos_k, pos_v = _one_position(kernels[ki], k[0]), _one_position(kernels[vi], v[0])
    if pos_k is None or pos_v is None or str(pos_k) != str(pos_v):
        return None
    appends = sorted((ki, vi))
    inputs = _reads(kernels[ki]) | _reads(kernels[vi])
    if inputs & caches or att.out.index in inputs:
        return None
    for j in range(appends[0] + 1, ai):
        if j in appends:
            continue
        x = kernels[j]
        if x.out.index in caches | inputs or _reads(x) & caches:
            return None
    sk, sv = kernels[ki], kernels[vi]

    def stored(append: Kernel, cache):
        value = append.epilogue
        if value.dtype != cache.dtype:
            value = Op("cast", [value], cache.dtype)
        return value

    new_spec = replace(spec, k_new=_at_key_zero(stored(sk, k[0]), k[1]),
                       v_new=_at_key_zero(stored(sv, v[0]), v[1]),
                       new_pos=_at_key_zero(pos_k, k[1]))
    rest = [x for j, x in enumerate(kernels) if j not in appends]
    at = rest.index(att)
    if APPEND_IN_ATTENTION:   # the attention stores them: the same values at the same position
        new_spec = replace(new_spec, k_store=sk.epilogue, k_store_pos=pos_k, k_cache=k[0],
                           v_store=sv.epilogue, v_store_pos=pos_v, v_cache=v[0])
        return rest[:at] + [replace(att, spec=new_spec)] + rest[at + 1:]
    moved = [replace(kernels[j], off_path=True) for j in appends]
    after = rest[at + 1:]
    if APPENDS_LAST and not any(_reads(x) & caches or x.out.index in caches | inputs
                                for x in after):
        return rest[:at] + [replace(att, spec=new_spec)] + after + moved
    return rest[:at] + [replace(att, spec=new_spec)] + moved + after


def append_after_attention(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels with every qualifying attention taking its appended key and value from the
    appends' expressions and the appends moved after it, as a new list (`kernels` and its
    kernels unchanged)."""
    kernels = list(kernels)
    for att in [x for x in kernels if isinstance(x.spec, Attention)]:
        new = _rewrite(kernels, next(i for i, x in enumerate(kernels) if x is att))
        if new is not None:
            kernels = new
    return kernels
