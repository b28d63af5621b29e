"""ATen handlers for order-dependent ops: scans (cumsum, cumprod), arg-reductions (argmax,
argmin, max/min with indices) and sorting (sort, topk).

Each of these writes an int64 index tensor (argreduce, sort) or the scanned values (scan) with a
kernel of its own family (codegen.argreduce / scan / sort). The values of max.dim, sort and topk
are then a lazy gather of the input at those indices, so one kernel serves both outputs and the
values come out bit for bit as torch returns them (NaN payloads, -0.0).

Torch semantics kept: NaN is the largest value for sort and topk and wins max/min/argmax/argmin
(the first NaN's index); ties go to the first index; sorts are stable (sort.default as well, so
indices are deterministic); -0.0 and 0.0 compare equal.
"""
from __future__ import annotations

import operator

import torch

from . import extents, views
from .families import Argreduce, Scan, Sort
from .ir import Acc, DimMap, Kernel, Op, Reindex, compute_dtype, numel
from .lower import LoweringError, as_operand, handles
from .views import TV

aten = torch.ops.aten

MAX_SORT_COLUMNS = 4096   # one row per block: the whole row lives in registers
MAX_INDEX = 2**31 - 1     # indices ride in 32 bits inside the kernels


def _users_of_output(node, i: int) -> bool:
    """Some consumer reads output `i` of a multi-output node (getitem i)."""
    return any(u.target is operator.getitem and u.args[1] == i for u in node.users)


def _one_dynamic_factor(x: TV, dim: int, what: str) -> None:
    entry = x.dim_ext(dim)
    if entry is not None and len(entry) > 1:
        raise LoweringError(f"{what} along a dimension that merges dynamic dimensions is not "
                            "supported (do it before the reshape)")


def _take(x: TV, dim: int, idx: TV) -> TV:
    """x gathered along `dim` at `idx` (same rank as x): out[i] = x[i with i[dim] := idx[i]]."""
    maps = [DimMap("dim", d) for d in range(len(x.shape))]
    maps[dim] = DimMap("expr", expr=idx.expr)
    return TV(Reindex(x.expr, maps), idx.shape)


# ---- arg-reductions ----------------------------------------------------------------------------
def _arg_index(L, x: TV, dim, op: str, keepdim: bool) -> TV:
    """The int64 index of the max/min along `dim` (None: of the flattened tensor), torch's shape."""
    nd = len(x.shape)
    if nd == 0:
        x = views.view(x, (1,))
        out = _arg_index(L, x, 0, op, False)
        return views.view(out, ())
    if dim is None:
        rdims = list(range(nd))
        exts = x.exts()
        if any(e is not None for e in exts[1:]) or not extents.is_prefix(exts[0]):
            raise LoweringError("argmax/argmin over a whole tensor with a dynamic dimension other "
                                "than the first is not supported (flat indices would depend on "
                                "the true sizes); reduce along a dimension instead")
    else:
        rdims = [dim % nd]
        _one_dynamic_factor(x, rdims[0], "argmax/argmin")
    if numel([x.shape[d] for d in rdims]) > MAX_INDEX:
        raise LoweringError("argmax/argmin over more than 2**31 - 1 elements is not supported")
    if x.dtype == "bool":
        x = TV(Op("cast", [x.expr], "int32"), x.shape, x.ext)
    kept = [d for d in range(nd) if d not in rdims]
    out_shape = tuple(x.shape[d] for d in kept)
    out_ext = tuple(x.dim_ext(d) for d in kept)
    buf = L.new_buffer(out_shape, "int64")
    spec = Argreduce(src=x.expr, src_shape=x.shape, src_ext=x.ext, rdims=tuple(rdims), op=op)
    result = L.emit(Kernel(spec, buf, out_shape, Acc("int64"), ext=out_ext))
    if keepdim:
        result = views.view(result, tuple(1 if d in rdims else x.shape[d] for d in range(nd)))
    return result


@handles(aten.argmax.default, aten.argmin.default)
def _argmax(L, node, x, dim=None, keepdim=False):
    op = "max" if node.target == aten.argmax.default else "min"
    out = _arg_index(L, x, dim, op, keepdim)
    return views.view(out, L.out_meta(node)[0]) if out.shape != L.out_meta(node)[0] else out


@handles(aten.max.dim, aten.min.dim)
def _max_dim(L, node, x, dim, keepdim=False):
    op = "max" if node.target == aten.max.dim else "min"
    if not x.shape:   # 0-d: the value itself, index 0
        return x, TV(as_operand(0, (), "int64"), ())
    dim %= len(x.shape)
    if _users_of_output(node, 0):
        x = L.operand(x)   # read twice (index kernel, gather): computed once if costly
    idx = _arg_index(L, x, dim, op, True)
    values = _take(x, dim, idx)
    if not keepdim:
        values, idx = views.squeeze(values, [dim]), views.squeeze(idx, [dim])
    return values, idx


@handles(aten.max.default, aten.min.default)
def _max_all(L, node, x):
    """The largest / smallest element (NaN if there is one, as torch)."""
    op = "max" if node.target == aten.max.default else "min"
    if not x.shape:
        return x
    x = L.operand(x)
    idx = _arg_index(L, x, None, op, False)   # flat index, 0-d
    flat = views.view(x, (numel(x.shape),))
    return TV(Reindex(flat.expr, [DimMap("expr", expr=idx.expr)]), ())


# ---- scans -------------------------------------------------------------------------------------
@handles(aten.cumsum.default, aten.cumprod.default)
def _scan(L, node, x, dim, dtype=None):
    shape, out_dtype = L.out_meta(node)
    nd = len(x.shape)
    if nd == 0:
        return TV(as_operand(x, (), out_dtype), ())
    dim %= nd
    _one_dynamic_factor(x, dim, "cumsum/cumprod")
    acc = compute_dtype(out_dtype)
    if acc == "bool":
        acc = "int64"
    perm = [d for d in range(nd) if d != dim] + [dim]
    src = views.permute(x, perm)
    epilogue = Acc(acc) if acc == out_dtype else Op("cast", [Acc(acc)], out_dtype)
    buf = L.new_buffer(src.shape, out_dtype)
    op = "sum" if node.target == aten.cumsum.default else "prod"
    out = L.emit(Kernel(Scan(src=src.expr, op=op, acc_dtype=acc), buf, src.shape, epilogue,
                        ext=src.ext))
    return views.permute(out, [perm.index(d) for d in range(nd)])


# ---- sorting -----------------------------------------------------------------------------------
def _sort_index(L, x: TV, dim: int, descending: bool, k: int | None) -> TV:
    """The int64 indices that sort x along `dim` (stably; NaN largest), the first k of them."""
    nd = len(x.shape)
    n = x.shape[dim]
    what = "sort" if k is None else "topk"
    if n > MAX_SORT_COLUMNS:
        raise LoweringError(f"{what} along a dimension of {n} elements is not supported (at most "
                            f"{MAX_SORT_COLUMNS}: a row is sorted within one block)")
    _one_dynamic_factor(x, dim, what)
    if x.dtype == "bool":
        x = TV(Op("cast", [x.expr], "int32"), x.shape, x.ext)
    perm = [d for d in range(nd) if d != dim] + [dim]
    src = views.permute(x, perm)
    ext = src.exts()
    out_ext = ext[:-1] + ((ext[-1] if k is None else None),)   # topk: k is static
    k = n if k is None else k
    out_shape = src.shape[:-1] + (k,)
    buf = L.new_buffer(out_shape, "int64")
    spec = Sort(src=src.expr, src_shape=src.shape, src_ext=src.ext, descending=bool(descending))
    out = L.emit(Kernel(spec, buf, out_shape, Acc("int64"), ext=out_ext))
    return views.permute(out, [perm.index(d) for d in range(nd)])


def _sorted(L, node, x, dim, descending, k):
    if not x.shape:   # 0-d: itself, index 0
        return x, TV(as_operand(0, (), "int64"), ())
    dim %= len(x.shape)
    if _users_of_output(node, 0):
        x = L.operand(x)
    idx = _sort_index(L, x, dim, descending, k)
    return _take(x, dim, idx), idx


@handles(aten.sort.default, aten.sort.stable)
def _sort(L, node, x, dim=-1, descending=False, stable=None):
    return _sorted(L, node, x, dim, descending, None)


@handles(aten.topk.default)
def _topk(L, node, x, k, dim=-1, largest=True, sorted=True):
    if not isinstance(k, int) or extents.sym_expr(k) is not None:
        raise LoweringError("topk with a dynamic k is not supported")
    if x.shape and not 0 < k <= x.shape[dim % len(x.shape)]:
        raise LoweringError(f"topk: k={k} is out of range")
    return _sorted(L, node, x, dim, largest, k)
