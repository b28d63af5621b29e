"""Stage `codegen`, its last step: side nodes that pull a big GEMV's first weights into L2 while
the kernels before it are latency-bound (`L2_PREFETCH`, off until timed on the H200).

In a decode step HBM idles between the weight-streaming GEMVs. In the Llama-1B decode graph on
the H200 (`bench_decode --timeline`, docs/performance.md, fourteenth session) a layer takes 44.5
µs, of which ~11 µs run from the end of the QKV projection to the end of the output projection
(KV appends, attention, its combine, the 8 MB o projection, the norm's mean) and move ~10 MB:
HBM sits mostly idle while the next big GEMV (gate+up, 67 MB) waits its turn, and then streams at
3.9 TB/s where the 525 MB LM head, long enough to have no ramp or tail, reaches 4.55. Prefetched
into L2 during that window, the GEMV's first bytes arrive from L2 once it runs.

For each target (a GEMV whose largest weight buffer holds at least `L2_PREFETCH_MIN_BYTES`),
the anchor is found by walking back from it: the latest kernel such that the kernels between it
and the target stream fewer than `L2_PREFETCH_WINDOW_BYTES` of weights. No kernel between: no
window, no node (the down projection right behind gate+up). The prefetch node depends on the
anchor alone, so it starts when the window starts, and nothing depends on it: it only reads
weights, which nothing writes, and the graph ends after it as after any node. It issues one
`prefetch.global.L2::evict_last` per 128-byte line of the first `L2_PREFETCH_BYTES` of the
weight buffer (a GEMV's programs walk its rows in order, so these are the bytes it reads first).
Under PDL the node is a programmatic dependent like every kernel; the prefetch comes after its
gdc_wait() (the anchor finished: the window has begun), or before it with
`L2_PREFETCH_BEFORE_WAIT` (during the anchor's last wave).

The CPU reference executor skips these nodes (tools/interpret.py): a prefetch changes no value.
"""
from __future__ import annotations

import hashlib

from .codegen import HEADER, PDL_HEADER, KernelSource, cdiv
from .codegen_expr import PTR_TYPE
from .ir import ITEMSIZE

L2_PREFETCH = False
L2_PREFETCH_MIN_BYTES = 16 << 20      # a target's largest weight buffer, at least
L2_PREFETCH_WINDOW_BYTES = 16 << 20   # weights the kernels of its window stream, less than
L2_PREFETCH_BYTES = 24 << 20          # bytes prefetched per target (H200 L2: 50 MB)
L2_PREFETCH_BEFORE_WAIT = False
FAMILY = "l2_prefetch"
LINE = 128        # bytes per prefetch instruction: an L2 line
LANES = 1024      # prefetches per program (4 warps, 8 each)
ASM = "prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;"


def _weights(src: KernelSource) -> list:
    return [b for b in src.buffers if b.kind == "weight"]


def _streamed(src: KernelSource) -> int:
    return sum(b.nbytes for b in _weights(src))


def plan(kernels: list, sources: list, pdl: bool) -> list[tuple[int, KernelSource, str]]:
    """(anchor kernel index, prefetch source, node label) per target, in target order; none when
    off."""
    if not L2_PREFETCH:
        return []
    side = []
    for j, (kernel, src) in enumerate(zip(kernels, sources)):
        if kernel.family != "matmul" or not kernel.spec.plan.gemv or not _weights(src):
            continue   # GEMMs of many rows are not bound by their weights' bandwidth
        weight = max(_weights(src), key=lambda b: b.nbytes)
        if weight.nbytes < L2_PREFETCH_MIN_BYTES:
            continue
        window, anchor = 0, None
        for a in range(j - 1, -1, -1):
            if window + _streamed(sources[a]) >= L2_PREFETCH_WINDOW_BYTES:
                anchor = a
                break
            window += _streamed(sources[a])
        if anchor is None or anchor == j - 1:
            continue   # the graph's start (nothing to overlap), or no kernel between
        side.append((anchor, source(weight, min(weight.nbytes, L2_PREFETCH_BYTES), pdl),
                     f"{FAMILY} {kernel.label}"))
    return side


def source(weight, nbytes: int, pdl: bool) -> KernelSource:
    """A kernel that prefetches the first `nbytes` of `weight` into L2, one line per lane; lanes
    past the end repeat the last line."""
    lines = cdiv(nbytes, LINE)
    per_line = max(1, LINE // ITEMSIZE[weight.dtype])   # elements
    body = [
        "def KERNEL(p0):",
        *(["    gdc_launch_dependents()"] + ([] if L2_PREFETCH_BEFORE_WAIT else ["    gdc_wait()"])
          if pdl else []),
        f"    line = tl.program_id(0) * {LANES} + tl.arange(0, {LANES})",
        f"    line = tl.minimum(line, {lines - 1}).to(tl.int64)",
        f"    tl.inline_asm_elementwise({ASM!r}, \"=r,l\", [p0 + line * {per_line}],",
        "                              dtype=tl.int32, is_pure=False, pack=1)",
    ]
    if pdl and L2_PREFETCH_BEFORE_WAIT:
        body.append("    gdc_wait()")
    text = (PDL_HEADER if pdl else HEADER) + "\n".join(body) + "\n"
    name = f"{FAMILY}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return KernelSource(name, FAMILY, text.replace("def KERNEL(", f"def {name}("),
                        [PTR_TYPE[weight.dtype]], [weight], (cdiv(lines, LANES), 1, 1), 4, 1, [])

