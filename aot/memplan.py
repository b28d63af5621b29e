"""Stage `memplan` (compiler.PIPELINE): the static memory plan and the graph's dependency edges.

Intermediates share one arena. A buffer is live from the kernel that writes it to the last kernel
that reads it (to the end of the graph when a kernel off the critical path reads it:
`ir.Kernel.off_path`); offsets are assigned greedily, largest first, at the lowest address that no
overlapping-lifetime buffer occupies. Because ranges are reused, graph edges must follow
write-after-read and write-after-write on byte ranges as well as read-after-write — the CUDA graph
then is a true DAG in which independent kernels may overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import families
from .ir import Buffer, Kernel, numel

ALIGN = 256


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Placement:
    buffer: Buffer
    offset: int
    nbytes: int
    first: int      # index of the writing kernel
    last: int       # index of the last reading kernel


@dataclass
class MemoryPlan:
    arena_nbytes: int
    arena: dict[int, Placement]        # Buffer.index -> placement
    weights_nbytes: int
    weights: dict[int, int]            # Buffer.index -> offset in the weights region
    state_nbytes: int = 0
    state: dict = None                 # Buffer.index -> offset in the state region


def drop_empty(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels that have something to do. One whose index space holds no element (an output
    or intermediate with a 0 dimension: linspace with 0 points, a 0-size split part, a scatter
    of nothing) would launch a grid of 0 programs, which CUDA (and the package format) refuse;
    it writes nothing, so it is dropped. Kernels that write a size into the extents (nonzero of
    an empty tensor still writes count 0) always run. A dropped kernel's buffer holds no bytes,
    so whatever still reads it reads nothing (plan_memory gives it no memory)."""
    return [k for k in kernels if numel(k.out_shape) > 0 or families.of(k).writes_extents]


def plan_memory(kernels: list[Kernel], weights: list[Buffer],
                state: list[Buffer] = ()) -> MemoryPlan:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    bufs: dict[int, Buffer] = {}
    for i, k in enumerate(kernels):
        for out in k.writes():
            if out.kind == "arena":   # a buffer may be written twice (a copy, then a scatter)
                first.setdefault(out.index, i)
                last[out.index] = i
                bufs[out.index] = out
        for b in k.reads():
            if b.kind == "arena":
                if b.index not in first:   # read before (or without) being written
                    if b.nbytes:
                        raise AssertionError(f"memory plan: {b.name} is read by kernel {i} "
                                             "before any kernel writes it")
                    first[b.index] = i     # empty: its writer was dropped (drop_empty)
                    bufs[b.index] = b
                last[b.index] = i
    for k in kernels:   # off the critical path: its inputs are never reused (ir.Kernel.off_path)
        if k.off_path:
            for b in k.reads():
                if b.kind == "arena":
                    last[b.index] = len(kernels) - 1
    order = sorted(bufs, key=lambda key: (-bufs[key].nbytes, first[key]))
    placed: list[Placement] = []
    for key in order:
        buf = bufs[key]
        if not buf.nbytes:   # no bytes to hold: a zero-length range that overlaps nothing
            placed.append(Placement(buf, 0, 0, first[key], last[key]))
            continue
        size = align(buf.nbytes)
        busy = sorted((p.offset, p.offset + p.nbytes) for p in placed
                      if not (p.last < first[key] or last[key] < p.first))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append(Placement(buf, offset, size, first[key], last[key]))
    arena_nbytes = max((p.offset + p.nbytes for p in placed), default=0)
    woffsets, wcursor = _pack(weights)
    soffsets, scursor = _pack(state)
    return MemoryPlan(arena_nbytes, {p.buffer.index: p for p in placed}, wcursor, woffsets,
                      scursor, soffsets)


def _pack(buffers) -> tuple[dict[int, int], int]:
    """Back-to-back, 256-aligned offsets (weights and state are live for the whole call)."""
    offsets, cursor = {}, 0
    for buf in buffers:
        offsets[buf.index] = cursor
        cursor += align(max(buf.nbytes, 1))
    return offsets, cursor


def check_plan(plan: MemoryPlan) -> None:
    """No two buffers with overlapping lifetimes share bytes (the plan's one invariant)."""
    items = list(plan.arena.values())
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            lives = not (a.last < b.first or b.last < a.first)
            overlaps = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
            if lives and overlaps:
                raise AssertionError(f"memory plan: {a.buffer.name} and {b.buffer.name} overlap")


def dependencies(kernels: list[Kernel], plan: MemoryPlan,
                 extents_readers: list[bool] | None = None) -> list[list[int]]:
    """deps[j] = earlier kernels that j must wait for (RAW, WAR, WAW on arena byte ranges, I/O
    slots and the extents words that data-dependent sizes are written to). Transitively implied
    edges are dropped. `extents_readers[j]`: kernel j reads size symbols (known after codegen)."""

    def ranges(bufs):
        out = []
        for b in bufs:
            if b.kind == "arena":
                p = plan.arena[b.index]
                out.append(("arena", p.offset, p.offset + p.nbytes))
            elif b.kind in ("input", "output"):
                out.append((f"io:{b.name}", 0, 1))
            elif b.kind == "state":   # one range per buffer: scatters order against every reader
                out.append((f"state:{b.name}", 0, 1))
        return out

    writes = [ranges(k.writes()) for k in kernels]
    reads = [ranges(k.reads()) for k in kernels]
    for j, k in enumerate(kernels):
        if families.of(k).writes_extents:
            writes[j].append(("extents", 0, 1))
        if extents_readers and extents_readers[j]:
            reads[j].append(("extents", 0, 1))

    def conflict(xs, ys):
        return any(a[0] == b[0] and a[1] < b[2] and b[1] < a[2] for a in xs for b in ys)

    deps: list[list[int]] = []
    ancestors: list[set[int]] = []
    for j in range(len(kernels)):
        direct = [i for i in range(j) if conflict(writes[i], reads[j])
                  or conflict(reads[i], writes[j]) or conflict(writes[i], writes[j])]
        reach: set[int] = set()
        for i in direct:
            reach |= ancestors[i]
        minimal = [i for i in direct if i not in reach]
        deps.append(minimal)
        ancestors.append(reach | set(direct))
    return deps
