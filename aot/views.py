"""Index transforms: views, broadcasts and reshapes as rewrites of an expression's index.

A view never copies. `remap` pushes an index mapping down to the `Load` leaves, where it folds into
the leaf's offset and strides; only nodes that cannot absorb it (concatenations, gathers, padded
reads, user tensors whose strides are only known at run time) keep an explicit `Reindex`.
`reshape` does the same through torch's own view rules (on meta tensors), falling back to an
explicit `Reshape` (ravel/unravel in the kernel) where strides cannot express it.

Each view also carries the value's extents along (`TV.ext`, see extents.py): which elements of the
bucket-sized index space are real.
"""
from __future__ import annotations

import torch

from . import extents
from .ir import (Cat, Const, DimMap, Expr, Index, Load, Op, Reindex, Reshape, contiguous_strides,
                 numel)


class TV:
    """A tensor value during lowering: an expression over the index space `shape` (bucket sizes).
    `ext`: per-dimension extents (extents.py), or None when every dimension is static."""

    __slots__ = ("expr", "shape", "ext")

    def __init__(self, expr: Expr, shape, ext=None):
        self.expr, self.shape = expr, tuple(int(s) for s in shape)
        if ext is not None and all(e is None for e in ext):
            ext = None
        assert ext is None or len(ext) == len(self.shape), (ext, self.shape)
        self.ext = tuple(ext) if ext is not None else None

    def dim_ext(self, d: int):
        return None if self.ext is None else self.ext[d]

    def exts(self) -> tuple:
        return self.ext if self.ext is not None else (None,) * len(self.shape)

    @property
    def dtype(self) -> str:
        return self.expr.dtype

    def __repr__(self):
        return f"TV({type(self.expr).__name__}, {self.dtype}{list(self.shape)})"


def remap(expr: Expr, maps: list[DimMap], ndim: int) -> Expr:
    """`expr` read at child index = maps(parent index), as an expression over `ndim` parent dims."""
    memo: dict[int, Expr] = {}

    def go(node: Expr) -> Expr:
        key = id(node)
        if key in memo:
            return memo[key]
        if isinstance(node, Load) and not node.buf.dynamic and all(m.kind != "expr" for m in maps):
            offset, strides = node.offset, [0] * ndim
            for stride, m in zip(node.strides, maps):
                offset += m.start * stride
                if m.kind == "dim":
                    strides[m.src] += m.step * stride
            out = Load(node.buf, offset, strides)
        elif isinstance(node, Const):
            out = node
        elif isinstance(node, Index):
            out = _index_value(maps[node.dim])
        elif isinstance(node, Op):
            out = Op(node.op, [go(a) for a in node.args], node.dtype, node.param)
        elif isinstance(node, Reindex) and node.bounds is None:
            out = remap(node.child, [_compose(m, maps, ndim) for m in node.maps], ndim)
        else:
            out = Reindex(node, maps)
        memo[key] = out
        return out

    return go(expr)


def _index_value(m: DimMap) -> Expr:
    if m.kind == "const":
        return Const(m.start, "int64")
    if m.kind == "expr":
        return m.expr if m.expr.dtype == "int64" else Op("cast", [m.expr], "int64")
    value: Expr = Index(m.src)
    if m.step != 1:
        value = Op("mul", [value, Const(m.step, "int64")], "int64")
    if m.start:
        value = Op("add", [value, Const(m.start, "int64")], "int64")
    return value


def _compose(inner: DimMap, outer: list[DimMap], ndim: int) -> DimMap:
    """inner maps a middle index to a child index; outer maps the parent index to the middle."""
    if inner.kind == "const":
        return inner
    if inner.kind == "expr":
        return DimMap("expr", expr=remap(inner.expr, outer, ndim))
    o = outer[inner.src]
    if o.kind == "const":
        return DimMap("const", start=o.start * inner.step + inner.start)
    if o.kind == "dim":
        return DimMap("dim", o.src, o.step * inner.step, o.start * inner.step + inner.start)
    value = _index_value(o)
    if inner.step != 1:
        value = Op("mul", [value, Const(inner.step, "int64")], "int64")
    if inner.start:
        value = Op("add", [value, Const(inner.start, "int64")], "int64")
    return DimMap("expr", expr=value)


def view_strides(shape, strides, new_shape):
    """Strides of a view to `new_shape`, or None when no view exists (torch's rules)."""
    base = torch.empty_strided(tuple(shape), tuple(strides), device="meta")
    try:
        return tuple(base.view(tuple(new_shape)).stride())
    except RuntimeError:
        return None


def reshape(expr: Expr, old_shape, new_shape) -> Expr:
    old_shape, new_shape = tuple(old_shape), tuple(new_shape)
    if old_shape == new_shape:
        return expr
    memo: dict[int, Expr] = {}

    def go(node: Expr) -> Expr:
        key = id(node)
        if key in memo:
            return memo[key]
        out = None
        if isinstance(node, Load) and not node.buf.dynamic:
            strides = view_strides(old_shape, node.strides, new_shape)
            if strides is not None:
                out = Load(node.buf, node.offset, strides)
        elif isinstance(node, Const):
            out = node
        elif isinstance(node, Op):
            out = Op(node.op, [go(a) for a in node.args], node.dtype, node.param)
        if out is None:
            out = Reshape(node, old_shape, new_shape)
        memo[key] = out
        return out

    return go(expr)


# ---- the view ops, each as an index map ------------------------------------------------------
def expand(tv: TV, shape, ext=None) -> TV:
    """Broadcast to `shape`; `ext` gives the extents of the result where a dimension is new or
    grows from 1 (a broadcast to a dynamic size), else they come from `tv`."""
    shape = tuple(int(s) if s != -1 else None for s in shape)
    lead = len(shape) - len(tv.shape)
    shape = tuple(tv.shape[i - lead] if s is None else s for i, s in enumerate(shape))
    if shape == tv.shape:
        return tv
    given = tuple(ext) if ext is not None else (None,) * len(shape)
    out_ext = list(given[:lead])
    maps = []
    for d, size in enumerate(tv.shape):
        if size == 1 and shape[d + lead] != 1:
            maps.append(DimMap("const", start=0))
            out_ext.append(given[d + lead])
        else:
            maps.append(DimMap("dim", d + lead))
            out_ext.append(tv.dim_ext(d))
    return TV(remap(tv.expr, maps, len(shape)), shape, out_ext)


def permute(tv: TV, dims) -> TV:
    dims = [d % len(tv.shape) for d in dims]
    if dims == list(range(len(dims))):
        return tv
    maps = [None] * len(dims)
    for new, old in enumerate(dims):
        maps[old] = DimMap("dim", new)
    return TV(remap(tv.expr, maps, len(dims)), [tv.shape[d] for d in dims],
              [tv.dim_ext(d) for d in dims])


def slice_(tv: TV, dim: int, start, end, step: int = 1, entry="keep") -> TV:
    """`entry`: the extent of the sliced dimension in the result ("keep": unchanged)."""
    dim %= len(tv.shape)
    size = tv.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else end
    start = max(0, min(size, start + size if start < 0 else start))
    end = max(start, min(size, end + size if end < 0 else end))
    new_size = (end - start + step - 1) // step
    ext = list(tv.exts())
    if entry != "keep":
        ext[dim] = entry
    if start == 0 and step == 1 and new_size == size:
        return TV(tv.expr, tv.shape, ext)
    maps = [DimMap("dim", d) for d in range(len(tv.shape))]
    maps[dim] = DimMap("dim", dim, step, start)
    shape = list(tv.shape)
    shape[dim] = new_size
    return TV(remap(tv.expr, maps, len(shape)), shape, ext)


def select(tv: TV, dim: int, index: int) -> TV:
    dim %= len(tv.shape)
    index = index + tv.shape[dim] if index < 0 else index
    maps = []
    for d in range(len(tv.shape)):
        if d == dim:
            maps.append(DimMap("const", start=index))
        else:
            maps.append(DimMap("dim", d if d < dim else d - 1))
    shape = tv.shape[:dim] + tv.shape[dim + 1:]
    ext = tv.exts()
    return TV(remap(tv.expr, maps, len(shape)), shape, ext[:dim] + ext[dim + 1:])


def unsqueeze(tv: TV, dim: int) -> TV:
    dim %= len(tv.shape) + 1
    maps = [DimMap("dim", d if d < dim else d + 1) for d in range(len(tv.shape))]
    shape = tv.shape[:dim] + (1,) + tv.shape[dim:]
    ext = tv.exts()
    return TV(remap(tv.expr, maps, len(shape)), shape, ext[:dim] + (None,) + ext[dim:])


def squeeze(tv: TV, dims=None) -> TV:
    ndim = len(tv.shape)
    if dims is None:
        dims = range(ndim)
    # torch ignores dimensions that are not of size 1
    dims = {d % ndim for d in dims if tv.shape[d % ndim] == 1} if ndim else set()
    if not dims:
        return tv
    maps, kept = [], 0
    for d in range(len(tv.shape)):
        if d in dims:
            maps.append(DimMap("const", start=0))
        else:
            maps.append(DimMap("dim", kept))
            kept += 1
    shape = tuple(s for d, s in enumerate(tv.shape) if d not in dims)
    ext = [e for d, e in enumerate(tv.exts()) if d not in dims]
    return TV(remap(tv.expr, maps, len(shape)), shape, ext)


def view(tv: TV, shape) -> TV:
    shape = list(shape)
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        shape[shape.index(-1)] = numel(tv.shape) // known if known else 0
    ext = extents.regroup(tv.shape, tv.ext, shape) if tv.ext is not None else None
    return TV(reshape(tv.expr, tv.shape, shape), shape, ext)


def cat(tvs: list[TV], dim: int, dtype: str) -> TV:
    dim %= len(tvs[0].shape)
    if any(t.dim_ext(dim) is not None for t in tvs):
        raise extents.ShapeError("concatenation along a dynamic dimension is not supported (the "
                                "parts' boundaries would move with the true sizes)")
    ext = next((t.ext for t in tvs if t.ext is not None), None)
    tvs = [t for t in tvs if t.shape[dim] > 0]
    if len(tvs) == 1:
        return tvs[0]
    starts, sizes, acc = [], [], 0
    for t in tvs:
        starts.append(acc)
        sizes.append(t.shape[dim])
        acc += t.shape[dim]
    shape = list(tvs[0].shape)
    shape[dim] = acc
    parts = [t.expr if t.dtype == dtype else Op("cast", [t.expr], dtype) for t in tvs]
    return TV(Cat(parts, dim, starts, sizes, dtype), shape, ext)


def pad(tv: TV, pads, value) -> TV:
    """constant_pad_nd: pads = (last_lo, last_hi, second_last_lo, ...); negative pads crop."""
    ndim = len(tv.shape)
    shape = list(tv.shape)
    maps = [DimMap("dim", d) for d in range(ndim)]
    for i in range(len(pads) // 2):
        d = ndim - 1 - i
        lo, hi = pads[2 * i], pads[2 * i + 1]
        if tv.dim_ext(d) is not None and (lo or hi):
            raise extents.ShapeError("padding a dynamic dimension is not supported")
        shape[d] += lo + hi
        maps[d] = DimMap("dim", d, 1, -lo)
    expr = Reindex(tv.expr, maps, bounds=tv.shape, fill=value)
    return TV(expr, shape, tv.ext)


def contiguous_load(buf, ext=None) -> TV:
    return TV(Load(buf, 0, contiguous_strides(buf.shape)), buf.shape, ext)
