"""ATen op handlers: each turns one core-ATen node into lazy expressions or kernels.

Handlers receive the lowering context, the FX node (for its result shape/dtype in `meta["val"]`)
and the node's arguments with FX nodes replaced by their values (`TV`, tuples of TV, or Python
scalars).
"""
from __future__ import annotations

import dataclasses
import math
import operator

import sympy
import torch

from . import extents, gemm_tiles, linear_groups, views
from .codegen import attention_plan, gemm_plan
from .families import (Attention, AttnCombine, Compact, LayerNorm, Matmul, Reduction, Scatter,
                       Softmax, ToExtent)
from .ir import (EXTENTS, FLOATS, Acc, Buffer, Const, DimMap, Index, Kernel, Load, Op, Reindex,
                 SymValue, compute_dtype, loads, numel)
from .lower import LoweringError, as_operand, dtype_name, handles
from .ops import POINTWISE
from .extents import sym_expr
from .views import TV

aten = torch.ops.aten


def _pointwise(L, node, op, *xs, param=None, in_dtype=None):
    shape, dtype = L.out_meta(node)
    args = [as_operand(x, shape, in_dtype or dtype) for x in xs]
    return TV(Op(op, args, dtype, param), shape)


def _common_dtype(node) -> str:
    """The dtype torch compares two operands in (their promoted type)."""
    a, b = (x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in node.args[:2])
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return "float32"
    return dtype_name(torch.result_type(a, b))


# ---- pointwise ---------------------------------------------------------------------------------
def _aten(name: str):
    """'mul.Tensor' -> torch.ops.aten.mul.Tensor"""
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


# the same-dtype pointwise ops come from the op table (aot/ops.py)
for _row in POINTWISE.values():
    for _name in _row.aten:
        if _row.aten_operands == "common":   # comparisons read both sides in the promoted type
            handles(_aten(_name))(lambda L, node, a, b, _op=_row.name:
                                  _pointwise(L, node, _op, a, b, in_dtype=_common_dtype(node)))
        else:
            handles(_aten(_name))(lambda L, node, *xs, _op=_row.name: _pointwise(L, node, _op, *xs))


@handles(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar)
def _add_sub(L, node, a, b, alpha=1):
    shape, dtype = L.out_meta(node)
    name = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) else "sub"
    if node.target == aten.rsub.Scalar:
        a, b = b, a
    rhs = as_operand(b, shape, dtype)
    if alpha != 1:
        rhs = Op("mul", [rhs, Const(alpha, dtype)], dtype)
    return TV(Op(name, [as_operand(a, shape, dtype), rhs], dtype), shape)


@handles(aten.div.Tensor_mode)
def _div_mode(L, node, a, b, rounding_mode=None):
    """torch.div with rounding_mode. Integer operands (an integer result) divide exactly in
    integer arithmetic — a float32 round trip is wrong past 2^24 (100000001 // 3) — with floor
    (toward -inf) or trunc (toward 0) semantics; floats divide in their own precision."""
    shape, dtype = L.out_meta(node)
    if rounding_mode is None:
        return _pointwise(L, node, "div", a, b)
    if rounding_mode not in ("floor", "trunc"):
        raise LoweringError(f"div with rounding_mode={rounding_mode!r} is not supported")
    if dtype not in FLOATS or rounding_mode == "floor":
        # floats floor-divide as ATen's div_floor does (codegen_expr `floordiv`): floor(a / b)
        # would round -tiny / huge to -0 where the floor is -1
        return _pointwise(L, node, "floordiv" if rounding_mode == "floor" else "truncdiv", a, b)
    q = Op("div", [as_operand(a, shape, dtype), as_operand(b, shape, dtype)], dtype)
    return TV(Op(rounding_mode, [q], dtype), shape)


@handles(aten.logical_not.default)
def _not(L, node, x):
    return _pointwise(L, node, "not", x)


@handles(aten.bitwise_not.default)
def _bitwise_not(L, node, x):
    return _pointwise(L, node, "not" if L.out_meta(node)[1] == "bool" else "bitnot", x)


@handles(aten.isnan.default)
def _isnan(L, node, x):
    return _pointwise(L, node, "isnan", x, in_dtype=x.dtype)


@handles(aten.pow.Tensor_Scalar)
def _pow_scalar(L, node, x, exponent):
    if sym_expr(exponent) is not None:   # a size as the exponent: a tensor pow
        return _pointwise(L, node, "pow", x, exponent)
    return _pointwise(L, node, "pow", x, param=float(exponent))


@handles(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(L, node, a, b):
    return _pointwise(L, node, "pow", a, b)


@handles(aten.round.decimals)
def _round_decimals(L, node, x, decimals=0):
    """torch.round(x, decimals=d) as ATen computes it, in the value's own precision:
    round(x * 10^d) / 10^d, or round(x / 10^-d) * 10^-d for d < 0 (half to even)."""
    shape, dtype = L.out_meta(node)
    cdt = compute_dtype(dtype)
    e = as_operand(x, shape, dtype)
    if decimals == 0 or dtype not in FLOATS:
        return TV(Op("round", [e], dtype), shape)
    scale = Const(float(10 ** abs(decimals)), cdt)
    inner, outer = ("mul", "div") if decimals > 0 else ("div", "mul")
    scaled = Op("round", [Op(inner, [e, scale], cdt)], cdt)
    return TV(Op(outer, [scaled, scale], dtype), shape)


@handles(aten.gelu.default)
def _gelu(L, node, x, approximate="none"):
    return _pointwise(L, node, "gelu", x, param=approximate)


@handles(aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default)
def _clamp(L, node, x, lo=None, hi=None):
    shape, dtype = L.out_meta(node)
    expr = as_operand(x, shape, dtype)
    if lo is not None:
        expr = Op("maximum", [expr, as_operand(lo, shape, dtype)], dtype)
    if hi is not None:
        expr = Op("minimum", [expr, as_operand(hi, shape, dtype)], dtype)
    return TV(expr, shape)


@handles(aten.leaky_relu.default)
def _leaky_relu(L, node, x, slope=0.01):
    shape, dtype = L.out_meta(node)
    e = as_operand(x, shape, dtype)
    cond = Op("gt", [e, Const(0.0, dtype)], "bool")
    return TV(Op("where", [cond, e, Op("mul", [e, Const(slope, dtype)], dtype)], dtype), shape)


@handles(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(L, node, cond, a, b):
    shape, dtype = L.out_meta(node)
    return TV(Op("where", [as_operand(cond, shape, "bool"), as_operand(a, shape, dtype),
                           as_operand(b, shape, dtype)], dtype), shape)


@handles(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(L, node, x, mask, value):
    shape, dtype = L.out_meta(node)
    return TV(Op("where", [as_operand(mask, shape, "bool"), as_operand(value, shape, dtype),
                           as_operand(x, shape, dtype)], dtype), shape)


@handles(aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
         aten.lift_fresh_copy.default, aten.contiguous.default, aten.copy.default)
def _copy(L, node, x, *rest, **kwargs):
    shape, dtype = L.out_meta(node)
    if node.target == aten.copy.default:  # copy(dst, src): the value of src in dst's shape/dtype
        x = rest[0]
    return TV(as_operand(x, shape, dtype), shape)


# ---- constants -------------------------------------------------------------------------------
@handles(aten.full.default, aten.full_like.default, aten.scalar_tensor.default,
         aten.zeros.default, aten.ones.default, aten.zeros_like.default, aten.ones_like.default,
         aten.empty.memory_format, aten.empty_like.default, aten.new_zeros.default,
         aten.new_ones.default, aten.new_full.default, aten.new_empty.default)
def _full(L, node, *args, **kwargs):
    shape, dtype = L.out_meta(node)
    t = node.target
    if t in (aten.full.default, aten.full_like.default):
        value = args[1]
    elif t == aten.new_full.default:
        value = args[2]
    elif t == aten.scalar_tensor.default:
        value = args[0]
    elif t in (aten.ones.default, aten.ones_like.default, aten.new_ones.default):
        value = 1
    else:
        value = 0
    return TV(as_operand(value, shape, dtype), shape)


@handles(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(L, node, *args, **kwargs):
    shape, dtype = L.out_meta(node)
    if node.target == aten.arange.default:
        start, step = 0, 1
    else:
        start = args[0]
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    kind = "float32" if dtype in ("float32", "float16", "bfloat16", "float64") else "int64"
    # a start or step that is a size (arange(P, P + S)) is read on the device
    value = Op("add", [Op("mul", [Op("cast", [Index(0)], kind), as_operand(step, (), kind)], kind),
                       as_operand(start, (), kind)], kind)
    return TV(Op("cast", [value], dtype) if kind != dtype else value, shape)


# ---- views -----------------------------------------------------------------------------------
@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(L, node, x, shape):
    return views.view(x, L.out_meta(node)[0])


@handles(aten.permute.default)
def _permute(L, node, x, dims):
    return views.permute(x, dims)


@handles(aten.transpose.int)
def _transpose(L, node, x, d0, d1):
    dims = list(range(len(x.shape)))
    if not dims:   # a 0-d tensor: transpose(0, -1) is the tensor itself
        return x
    d0, d1 = d0 % len(dims), d1 % len(dims)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return views.permute(x, dims)


@handles(aten.t.default)
def _t(L, node, x):
    return views.permute(x, [1, 0]) if len(x.shape) == 2 else x


@handles(aten.expand.default, aten.expand_copy.default)
def _expand(L, node, x, shape, implicit=False):
    return views.expand(x, L.out_meta(node)[0], ext=L.out_ext(node))


@handles(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(L, node, x, dim=0, start=None, end=None, step=1):
    dim %= len(x.shape)
    if sym_expr(start) is not None:
        raise LoweringError("slicing from a dynamic offset (x[n:...] with n a size) is not "
                            "supported: the offset is only known on the device")
    if sym_expr(end) is not None:
        _tighten_item_bound(L, end, x.shape[dim] - (start or 0))
    entry = L.out_ext(node)[dim]
    if entry is None and x.dim_ext(dim) is None:
        return views.slice_(x, dim, start, end, step)
    if (start or 0) < 0 or step != 1:
        raise LoweringError("slicing a dynamic dimension needs a static start >= 0 and step 1")
    inner = x.dim_ext(dim)
    if inner is not None and len(inner) > 1 and entry != inner:
        raise LoweringError("slicing a merged dynamic dimension is not supported")
    return views.slice_(x, dim, start, end, step, entry=entry)


@handles(aten.select.int, aten.select_copy.int)
def _select(L, node, x, dim, index):
    entry = x.dim_ext(dim % len(x.shape))
    if sym_expr(index) is not None:
        raise LoweringError("indexing at a dynamic position (x[n] with n a size) is not "
                            "supported: the position is only known on the device")
    if entry is not None and (index < 0 or len(entry) > 1):
        raise LoweringError("indexing a dynamic dimension from its end, or a dimension that "
                            "merges dynamic ones, is not supported: the position would move "
                            "with the true sizes")
    return views.select(x, dim, index)


@handles(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def _unsqueeze(L, node, x, dim):
    return views.unsqueeze(x, dim)


@handles(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(L, node, x, dims=None):
    if isinstance(dims, int):
        dims = [dims]
    return views.squeeze(x, dims)


@handles(aten.split_with_sizes.default, aten.split.Tensor)
def _split(L, node, x, sizes, dim=0):
    dim %= len(x.shape)
    if x.dim_ext(dim) is not None:
        raise LoweringError("splitting a dynamic dimension is not supported")
    if isinstance(sizes, int):
        sizes = [sizes] * ((x.shape[dim] + sizes - 1) // sizes)
    parts, start = [], 0
    for size in sizes:
        parts.append(views.slice_(x, dim, start, start + size))
        start += size
    return tuple(parts)


@handles(aten.unbind.int)
def _unbind(L, node, x, dim=0):
    if x.dim_ext(dim % len(x.shape)) is not None:
        raise LoweringError("unbinding a dynamic dimension is not supported")
    return tuple(views.select(x, dim, i) for i in range(x.shape[dim]))


@handles(aten.cat.default)
def _cat(L, node, tensors, dim=0):
    shape, dtype = L.out_meta(node)
    tensors = [t for t in tensors if numel(t.shape) > 0 or len(t.shape) == len(shape)]
    return views.cat(tensors, dim, dtype)


@handles(aten.stack.default)
def _stack(L, node, tensors, dim=0):
    shape, dtype = L.out_meta(node)
    dim %= len(shape)
    return views.cat([views.unsqueeze(t, dim) for t in tensors], dim, dtype)


@handles(aten.constant_pad_nd.default)
def _pad(L, node, x, pad, value=0.0):
    if sym_expr(value) is not None or any(sym_expr(p) is not None for p in pad):
        raise LoweringError("padding by a dynamic size (or with a size as the value) is not "
                            "supported")
    return views.pad(x, list(pad), value)


@handles(operator.getitem)
def _getitem(L, node, seq, i):
    value = seq[i]
    if value is None:
        raise LoweringError(f"output {i} of {node.args[0].target} is not supported")
    return value


@handles(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
         aten.sym_constrain_range_for_size.default)
def _ignore(L, node, *args, **kwargs):
    return None


# ---- gathers ---------------------------------------------------------------------------------
def _index_expr(idx: TV, x: TV, dim: int, L=None, node=None) -> object:
    """An index tensor's value with negative indices wrapped by the true size of x's `dim`
    (torch semantics). Gathering along a dimension that merges dynamic ones is refused: its
    bucket layout does not put true position i at index i.

    With the lowering `L` and the gather's `node`, the index is also checked (L.check_index):
    clamped into the table, an out-of-range one reported through the error word. The scatter
    of a KV-cache update passes neither: it skips out-of-range destinations instead."""
    entry = x.dim_ext(dim)
    if entry is not None and len(entry) > 1:
        raise LoweringError("indexing along a dimension that merges dynamic dimensions is not "
                            "supported (index it before the reshape)")
    true = x.shape[dim] if entry is None else extents.true_size(entry, 0)
    size = Const(true, "int64") if entry is None else SymValue(true)
    e = idx.expr if idx.dtype == "int64" else Op("cast", [idx.expr], "int64")
    neg = Op("lt", [e, Const(0, "int64")], "bool")
    wrapped = Op("where", [neg, Op("add", [e, size], "int64"), e], "int64")
    if L is None:
        return wrapped
    return L.check_index(node, wrapped, idx.expr, size, int(true) if entry is None else true)


@handles(aten.embedding.default)
def _embedding(L, node, weight, indices, padding_idx=-1, *rest):
    shape, _ = L.out_meta(node)
    n = len(indices.shape)
    idx = TV(_index_expr(indices, weight, 0, L, node), indices.shape)
    idx_in_out = views.remap(idx.expr, [DimMap("dim", d) for d in range(n)], n + 1)
    maps = [DimMap("expr", expr=idx_in_out), DimMap("dim", n)]
    return TV(Reindex(weight.expr, maps), shape)


# ---- data-dependent sizes ----------------------------------------------------------------------
def _compact(L, node, mask: TV) -> TV:
    """The row-major indices of mask's nonzero elements, [count, ndim] int64: one kernel writes
    them at the front of a buffer sized for the worst case and writes `count` into the extents
    table, so consumers read the size on the device — no host round trip. A 0-d mask is one
    element with no coordinates: [count, 0], count 0 or 1 (the buffer holds no bytes)."""
    if any(e is not None and len(e) > 1 for e in mask.exts()):
        raise LoweringError("nonzero over a dimension that merges dynamic dimensions is not "
                            "supported (its bucket positions are not the true positions)")
    bound = numel(mask.shape)
    if bound == 0:   # an empty mask: torch.export knows the result is [0, ndim] (no symbol)
        shape, _ = L.out_meta(node)
        if numel(shape) == 0:
            return TV(Const(0, "int64"), shape)
    sym = L.data_symbol(node, bound)
    nd = len(mask.shape)
    buf = L.new_buffer((bound, nd), "int64")
    ext = (extents.simple(bound, sym), None)
    return L.emit(Kernel(Compact(src=mask.expr, src_shape=mask.shape, src_ext=mask.ext,
                                 symbol=sym), buf, (bound, nd), Acc("int64"), ext=ext))


@handles(aten.nonzero.default)
def _nonzero(L, node, x):
    return _compact(L, node, x)


@handles(aten._local_scalar_dense.default)
def _item(L, node, x):
    """`n.item()` used as a size: a one-thread kernel copies the value into the extents table
    (clamped to the range torch.export proved, which bounds the buffers sized by it)."""
    val = node.meta["val"]
    expr = sym_expr(val)
    if expr is None or x.dtype not in ("int64", "int32", "int16", "int8", "uint8", "bool"):
        raise LoweringError(".item() is only supported as an integer size")
    rng = L.program.range_constraints.get(expr)
    hi = extents.range_bound(rng.upper) if rng is not None else None
    if hi is None:
        raise LoweringError(f"the size {expr} taken from a tensor has no upper bound: add "
                            "torch._check(n <= LIMIT) in the model")
    lo = max(extents.range_bound(rng.lower) or 0, 0)
    sym = L.data_symbol(node, hi)
    if x.shape:
        x = views.view(x, ())
    L.emit(Kernel(ToExtent(src=x.expr, symbol=sym, lo=lo, hi=hi), EXTENTS, (), Acc("int64")))
    L.item_kernels[sym] = len(L.kernels) - 1
    return extents.SymSize(hi, sym)


def _tighten_item_bound(L, end, size: int):
    """x[:n.item()]: n is at most x's size in this bucket (torch._check says so; a violated check
    would otherwise read past x), so the clamp on the device and the bound of every buffer sized
    by n shrink to it."""
    sym = sym_expr(end)
    at = L.item_kernels.get(sym)
    kernel = L.kernels[at] if at is not None else None
    if kernel is not None and size < kernel.spec.hi:
        L.replace_kernel(at, dataclasses.replace(kernel, spec=dataclasses.replace(kernel.spec,
                                                                                  hi=size)))
        L.bucket[sym] = size


@handles(aten.index.Tensor)
def _index(L, node, x, indices):
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
        raise LoweringError("only adjacent tensor indices are supported in x[...]")
    k, m = dims[0], len(dims)
    if any(indices[d].dtype == "bool" for d in dims):
        return _select_by_mask(L, node, x, k, [indices[d] for d in dims])
    shape, _ = L.out_meta(node)
    bshape = tuple(torch.broadcast_shapes(*[indices[d].shape for d in dims]))
    nb = len(bshape)
    maps = []
    for d in range(len(x.shape)):
        if d < k:
            maps.append(DimMap("dim", d))
        elif d < k + m:
            idx = views.expand(indices[d], bshape)
            e = _index_expr(TV(idx.expr, bshape), x, d, L, node)
            e = views.remap(e, [DimMap("dim", k + j) for j in range(nb)], len(shape))
            maps.append(DimMap("expr", expr=e))
        else:
            maps.append(DimMap("dim", d - m + nb))
    return TV(Reindex(x.expr, maps), shape)


def _select_by_mask(L, node, x: TV, k: int, masks) -> TV:
    """x[..., mask, ...]: the elements where mask is true, in row-major order (`_compact`), read
    through their indices."""
    if len(masks) != 1:
        raise LoweringError("only one boolean mask per index expression is supported")
    mask = masks[0]
    nd = len(mask.shape)
    if tuple(x.shape[k:k + nd]) != tuple(mask.shape):
        raise LoweringError("a boolean mask must have the shape of the dimensions it selects")
    idx = _compact(L, node, mask)
    shape, _ = L.out_meta(node)
    idx_buf = idx.expr.buf
    maps = [DimMap("dim", d) for d in range(k)]
    for j in range(nd):
        strides = [0] * len(shape)
        strides[k] = nd
        maps.append(DimMap("expr", expr=Load(idx_buf, j, strides)))
    maps += [DimMap("dim", d - nd + 1) for d in range(k + nd, len(x.shape))]
    return TV(Reindex(x.expr, maps), shape)


@handles(aten.index_select.default)
def _index_select(L, node, x, dim, index):
    if not x.shape:   # a 0-d x: the only valid index is 0 (dim 0 / -1), the result is x
        return TV(x.expr, ())
    indices = [None] * len(x.shape)
    indices[dim % len(x.shape)] = index
    return _index(L, node, x, indices)


@handles(aten.gather.default)
def _gather(L, node, x, dim, index, sparse_grad=False):
    shape, _ = L.out_meta(node)
    if not x.shape:   # a 0-d x: the only valid index is 0, so the result is x at index's shape
        return views.expand(x, shape) if shape else x
    dim %= len(x.shape)
    maps = [DimMap("dim", d) for d in range(len(x.shape))]
    maps[dim] = DimMap("expr", expr=_index_expr(index, x, dim, L, node))
    return TV(Reindex(x.expr, maps), shape)


# ---- reductions ------------------------------------------------------------------------------
def _count(x: TV, dims):
    """How many elements `dims` of x hold: an int, or a size expression when one is dynamic."""
    total = 1
    for d in dims:
        e = x.dim_ext(d)
        total = total * (x.shape[d] if e is None else extents.true_size(e, x.shape[d]))
    return total


def _reduce(L, x: TV, dims, op: str, keepdim: bool, out_dtype: str, divisor=None) -> TV:
    """A reduction kernel; `divisor` (int or size expression) scales the result (mean, var)."""
    ndim = len(x.shape)
    dims = sorted({d % ndim for d in (dims if dims else range(ndim))}) if ndim else []
    kept = [d for d in range(ndim) if d not in dims]
    out_shape = tuple(x.shape[d] for d in kept)
    out_ext = tuple(x.dim_ext(d) for d in kept)
    acc_dtype = "float32" if out_dtype in ("float32", "float16", "bfloat16") else (
        "float64" if out_dtype == "float64" else "int64")
    if op in ("any", "all"):
        acc_dtype = "int64"
    epilogue = Acc(acc_dtype)
    if isinstance(divisor, int):
        # an empty reduction (mean of nothing, var with no degree of freedom) divides by 0 like
        # torch: sum * inf is nan for a zero sum, inf for a positive one
        scale = 1.0 / divisor if divisor > 0 else float("inf")
        epilogue = Op("mul", [epilogue, Const(scale, acc_dtype)], acc_dtype)
    elif divisor is not None:
        count = Op("cast", [SymValue(divisor)], acc_dtype)
        epilogue = Op("div", [epilogue, count], acc_dtype)
    if op in ("any", "all"):
        epilogue = Op("ne", [epilogue, Const(0, "int64")], "bool")
    elif acc_dtype != out_dtype:
        epilogue = Op("cast", [epilogue], out_dtype)
    buf = L.new_buffer(out_shape, out_dtype)
    spec = Reduction(src=x.expr, src_shape=x.shape, src_ext=x.ext, rdims=tuple(dims), op=op,
                     acc_dtype=acc_dtype)
    result = L.emit(Kernel(spec, buf, out_shape, epilogue, ext=out_ext))
    if keepdim:
        full = tuple(1 if d in dims else x.shape[d] for d in range(ndim))
        result = views.view(result, full)
    return result


def _dims_arg(dims):
    if dims is None:
        return None
    return [dims] if isinstance(dims, int) else list(dims)


def _reduced_dims(x: TV, dims) -> list[int]:
    """The dimensions a reduction over `dims` (None or empty: all) covers, normalised. A 0-d
    tensor accepts dim 0 / -1 (torch treats it as one element) and reduces over nothing."""
    nd = len(x.shape)
    if not nd:
        return []
    return sorted({d % nd for d in dims}) if dims else list(range(nd))


@handles(aten.sum.dim_IntList, aten.sum.default)
def _sum(L, node, x, dims=None, keepdim=False, dtype=None):
    shape, out_dtype = L.out_meta(node)
    return _reduce(L, x, _dims_arg(dims), "sum", keepdim, out_dtype)


@handles(aten.mean.dim, aten.mean.default)
def _mean(L, node, x, dims=None, keepdim=False, dtype=None):
    shape, out_dtype = L.out_meta(node)
    dims = _dims_arg(dims)
    count = _count(x, _reduced_dims(x, dims))
    return _reduce(L, x, dims, "sum", keepdim, out_dtype, divisor=count)


@handles(aten.amax.default, aten.amin.default)
def _amax(L, node, x, dims=(), keepdim=False):
    shape, out_dtype = L.out_meta(node)
    op = "max" if node.target == aten.amax.default else "min"
    return _reduce(L, x, _dims_arg(dims) or None, op, keepdim, out_dtype)


@handles(aten.any.dim, aten.any.dims, aten.any.default)
def _any(L, node, x, dims=None, keepdim=False):
    src = TV(Op("cast", [Op("ne", [x.expr, Const(0, x.dtype)], "bool")], "int64"), x.shape, x.ext)
    return _reduce(L, src, _dims_arg(dims), "max", keepdim, "bool")


@handles(aten.var.correction, aten.var_mean.correction)
def _var(L, node, x, dims=None, correction=None, keepdim=False):
    rd = _reduced_dims(x, _dims_arg(dims))
    count = _count(x, rd)
    correction = 1 if correction is None else correction
    dtype = x.dtype
    mean = _reduce(L, x, rd, "sum", True, dtype, divisor=count)
    diff = Op("sub", [x.expr, views.expand(mean, x.shape).expr], dtype)
    sq = TV(Op("mul", [diff, diff], dtype), x.shape, x.ext)
    dof = max(count - correction, 0) if isinstance(count, int) else sympy.Max(count - correction, 1)
    var = _reduce(L, sq, rd, "sum", keepdim, dtype, divisor=dof)
    if node.target == aten.var_mean.correction:
        return var, (mean if keepdim else views.squeeze(mean, rd))
    return var


@handles(aten._softmax.default, aten._log_softmax.default)
def _softmax(L, node, x, dim, half_to_float=False):
    shape, dtype = L.out_meta(node)
    nd = len(x.shape)
    dim %= max(nd, 1)
    if nd == 0:
        return TV(Const(0.0 if node.target == aten._log_softmax.default else 1.0, dtype), shape)
    perm = [d for d in range(nd) if d != dim] + [dim]
    src = views.permute(x, perm)
    buf = L.new_buffer(src.shape, dtype)
    acc = "float64" if dtype == "float64" else "float32"
    spec = Softmax(src=src.expr, log=node.target == aten._log_softmax.default)
    out = L.emit(Kernel(spec, buf, src.shape, Acc(acc), ext=src.ext))
    inverse = [perm.index(d) for d in range(nd)]
    return views.permute(out, inverse)


@handles(aten.native_layer_norm.default)
def _layer_norm(L, node, x, normalized_shape, weight, bias, eps):
    val = node.meta["val"][0]
    shape, dtype = tuple(L.size_of(s) for s in val.shape), dtype_name(val.dtype)
    n = numel(normalized_shape)
    rows = numel(x.shape) // max(n, 1)
    if any(e is not None for e in x.exts()[len(x.shape) - len(normalized_shape):]):
        raise LoweringError("layer norm over a dynamic dimension is not supported")
    src = views.view(x, (rows, n))

    def affine(t):
        return None if t is None else views.expand(views.view(t, (n,)), (rows, n)).expr

    spec = LayerNorm(src=src.expr, eps=float(eps), weight=affine(weight), bias=affine(bias))
    buf = L.new_buffer((rows, n), dtype)
    out = L.emit(Kernel(spec, buf, (rows, n), Acc("float32"), ext=src.ext))
    if any(len(u.users) for u in node.users if u.args[1] != 0):  # getitem 1, 2
        raise LoweringError("layer_norm's mean/rstd outputs are not supported (inference only)")
    return views.view(out, shape), None, None


# ---- contractions ----------------------------------------------------------------------------
def _matmul(L, node, a: TV, b: TV, epilogue_fn=None, meta=None) -> TV:
    shape, dtype = meta or L.out_meta(node)
    if len(a.shape) == 2:
        a, b = views.unsqueeze(a, 0), views.unsqueeze(b, 0)
    a, b = L.operand(a, row=a.shape[1] == 1), L.operand(b)
    batch, m, k = a.shape
    n = b.shape[2]
    out_shape = (batch, m, n)
    epilogue = Acc("float32")
    if epilogue_fn is not None:
        epilogue = epilogue_fn(epilogue, out_shape)
    low = {a.dtype, b.dtype} & {"float16", "bfloat16"}   # dots in half precision (_dot_dtype)
    kind = gemm_tiles.operand_kind("bfloat16" if low else "float32", L.options["fp32_matmul"])
    measured = gemm_tiles.measured_tile(L.options.get("tile_table"), kind, m, n, k)
    # no partial sums over a dynamic batch or K
    split_k = a.dim_ext(0) is None and a.dim_ext(2) is None
    plan = gemm_plan(m, n, k, batch, 2 if low else 4, L.options["sm_count"], measured, split_k)
    ext = (a.dim_ext(0), a.dim_ext(1), b.dim_ext(2))
    spec = Matmul(a=a.expr, b=b.expr, m=m, n=n, k=k, batch=batch,
                  fp32_precision=L.options["fp32_matmul"], plan=plan,
                  k_ext=a.dim_ext(2) if a.dim_ext(2) is not None else b.dim_ext(1))
    buf = L.new_buffer(shape, dtype)
    split = plan.split
    if split == 1:
        return views.view(L.emit(Kernel(spec, buf, out_shape, epilogue, ext=ext)), shape)
    # split-K: fp32 partial sums [split, batch, m, n], then a reduction that applies the epilogue
    partial = L.new_buffer((split, batch, m, n), "float32")
    sums = L.emit(Kernel(spec, partial, (split * batch, m, n), Acc("float32"),
                         ext=ext))   # read back as the partial buffer: [split, batch, m, n]
    total = Reduction(src=sums.expr, src_shape=(split, batch, m, n), src_ext=sums.ext, rdims=(0,),
                      op="sum", acc_dtype="float32")
    L.emit(Kernel(total, buf, out_shape, epilogue, ext=ext))
    return views.view(views.contiguous_load(buf, extents.regroup(out_shape, ext, buf.shape)),
                      shape)


@handles(aten.mm.default, aten.bmm.default)
def _mm(L, node, a, b):
    if node in L.precomputed:
        return L.precomputed.pop(node)
    group = linear_groups.group_of(node, L.is_weight_node) if node.target == aten.mm.default else []
    if group:
        return _linear_group(L, group, a)
    return _matmul(L, node, a, b)


def _linear_group(L, group, rows: TV, bias=None) -> TV:
    """The first of sibling linear layers (aot/linear_groups.py): one GEMM over their weights
    (and biases) concatenated at compile time; each layer's result is its column slice."""
    weights = [linear_groups.projection(m, L.is_weight_node) for m in group]
    w = torch.cat([L.weight_tensor(wn) for wn, _ in weights], dim=0)
    names = "+".join(wn.name for wn, _ in weights)
    wt = views.permute(L.derived_weight(f"fused.{names}", w), [1, 0])
    widths = [L.out_meta(m)[0][-1] for m in group]
    shape, dtype = L.out_meta(group[0])
    meta = (shape[:-1] + (sum(widths),), dtype)
    if bias is None:
        out = _matmul(L, group[0], rows, wt, meta=meta)
    else:
        b = torch.cat([L.weight_tensor(bn) for _, bn in weights], dim=0)
        bias_tv = L.derived_weight(f"fused.{names}.bias", b)
        out = _matmul(L, group[0], rows, wt, _bias_epilogue(bias_tv, meta[0]), meta=meta)
    start = 0
    parts = []
    for m, width in zip(group, widths):
        parts.append(views.slice_(out, len(shape) - 1, start, start + width))
        start += width
    for m, part in zip(group[1:], parts[1:]):
        L.precomputed[m] = part
    return parts[0]


def _bias_epilogue(bias, shape, beta=1, alpha=1):
    def epilogue(acc, out_shape):
        bias_e = views.unsqueeze(views.expand(bias, shape), 0).expr
        if bias.dtype != "float32":
            bias_e = Op("cast", [bias_e], "float32")
        value = acc if alpha == 1 else Op("mul", [acc, Const(alpha, "float32")], "float32")
        if beta != 1:
            bias_e = Op("mul", [bias_e, Const(beta, "float32")], "float32")
        return Op("add", [value, bias_e], "float32")

    return epilogue


@handles(aten.addmm.default)
def _addmm(L, node, bias, a, b, beta=1, alpha=1):
    if node in L.precomputed:
        return L.precomputed.pop(node)
    group = linear_groups.group_of(node, L.is_weight_node)
    if group:
        return _linear_group(L, group, a, bias=True)
    shape, dtype = L.out_meta(node)
    return _matmul(L, node, a, b, _bias_epilogue(bias, shape, beta, alpha))


ROW_QUERIES = 16   # query rows (one attention tile) that each program may recompute


@handles(aten.scaled_dot_product_attention.default)
def _sdpa(L, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    shape, dtype = L.out_meta(node)
    if dropout_p:
        raise LoweringError("attention dropout is not supported (export the model in eval mode)")
    # [..., L, E] -> [B, H, L, E]: leading dims fold into B (rank > 4) or gain a unit B (rank 3)
    def as4d(t: TV) -> TV:
        if len(t.shape) == 4:
            return t
        if len(t.shape) < 4:
            return as4d(views.unsqueeze(t, 0))
        return views.view(t, (numel(t.shape[:-3]),) + t.shape[-3:])

    q4, k4, v4 = as4d(q), as4d(k), as4d(v)
    b, h, lq, d = q4.shape
    hk, lk, dv = k4.shape[1], k4.shape[2], v4.shape[3]
    rep = 1
    if hk != h:
        if not enable_gqa or h % hk:
            raise LoweringError(f"query has {h} heads but key/value have {hk}")
        rep = h // hk
        def widen(t):
            head = Op("floordiv", [Index(1), Const(rep, "int64")], "int64")
            maps = [DimMap("dim", 0), DimMap("expr", expr=head), DimMap("dim", 2), DimMap("dim", 3)]
            return TV(Reindex(t.expr, maps), (b, h) + t.shape[2:], t.ext)
        k4, v4 = widen(k4), widen(v4)
    q4, k4, v4 = L.operand(q4, row=lq <= ROW_QUERIES), L.operand(k4), L.operand(v4)
    if q4.dim_ext(3) is not None or k4.dim_ext(3) is not None or v4.dim_ext(3) is not None:
        raise LoweringError("attention with a dynamic head dimension is not supported")
    mask = None
    if attn_mask is not None:
        m4 = attn_mask
        while len(m4.shape) < 4:
            m4 = views.unsqueeze(m4, 0)
        mask = views.expand(m4, (b, h, lq, lk)).expr
    # grouped heads may share a program when nothing about the queries is dynamic and no causal
    # rule ties a row's position to its tile (codegen.ATTN_PACK_GQA)
    packable = (rep > 1 and not is_causal
                and all(q4.dim_ext(i) is None for i in range(3)))
    plan = attention_plan(b, h, lq, lk, L.options["sm_count"], rep=rep, packable=packable,
                          d=max(d, dv))
    spec = Attention(q=q4.expr, k=k4.expr, v=v4.expr, b=b, h=h, lq=lq, lk=lk, d=d, dv=dv,
                     causal=bool(is_causal),
                     scale=float(scale) if scale is not None else 1.0 / math.sqrt(d),
                     fp32_precision=L.options["fp32_matmul"], lk_ext=k4.dim_ext(2), plan=plan,
                     mask=mask)
    buf = L.new_buffer((b, h, lq, dv), dtype)
    ext = (q4.dim_ext(0), q4.dim_ext(1), q4.dim_ext(2), None)
    split = plan.split
    if split == 1:
        out = L.emit(Kernel(spec, buf, (b, h, lq, dv), Acc("float32"), ext=ext))
        return views.view(out, shape)
    # split-KV: every split's output and log-sum-exp into one float32 buffer, then a kernel that
    # combines them and applies the epilogue (codegen.attention_plan)
    partial = L.new_buffer((split * b * h * lq * (dv + 1),), "float32")
    L.emit(Kernel(spec, partial, (b, h, lq, dv), Acc("float32"), ext=ext), value=False)
    combine = AttnCombine(partial=views.contiguous_load(partial).expr, parts=split, b=b, h=h,
                          lq=lq, dv=dv)
    out = L.emit(Kernel(combine, buf, (b, h, lq, dv), Acc("float32"), ext=ext))
    return views.view(out, shape)



# ---- in-place updates (KV caches) --------------------------------------------------------------
@handles(aten.index_put.default, aten.index_put_.default)
def _index_put(L, node, x, indices, values, accumulate=False):
    """x[indices] = values. When x is a state buffer whose old value nothing else reads (a KV
    cache: `k_cache[:, :, input_pos] = k`), a scatter kernel stores `values` into it in place at
    the positions the index tensor holds on the device — no copy of the cache. Otherwise x is
    copied into a fresh buffer first, then scattered into."""
    indices = list(indices) + [None] * (len(x.shape) - len(indices))
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
        raise LoweringError("only adjacent tensor indices are supported in x[...] = v")
    if any(indices[d].dtype == "bool" for d in dims):
        raise LoweringError("assignment through a boolean mask (x[mask] = v) is not supported; "
                            "use torch.where")
    target = L.in_place_target(node)
    if target is None:
        target = L.new_buffer(x.shape, x.dtype)
        L.realize(x, into=target)
    _check_atomic("add" if accumulate else None, x.dtype)
    _scatter(L, target, x, indices, dims, values, "add" if accumulate else None)
    return views.contiguous_load(target)


@handles(aten.index_copy.default, aten.index_copy_.default)
def _index_copy(L, node, x, dim, index, source):
    """x.index_copy(dim, index, source): transformers' StaticCache update."""
    dim %= len(x.shape)
    indices = [None] * dim + [index]
    return _index_put(L, node, x, indices, source)


def _scatter(L, target: Buffer, x: TV, indices, dims, values, accumulate=None) -> None:
    """Store `values` at x[indices] into `target` (laid out like x, contiguous). The kernel
    iterates over the index space of x[indices] — x's dims before the indexed ones, the broadcast
    index shape, then x's remaining dims — and computes each destination from the index values
    (negative ones wrapped). Destinations outside the buffer are not written."""
    k, m = dims[0], len(dims)
    bshape = tuple(torch.broadcast_shapes(*[indices[d].shape for d in dims]))
    nb = len(bshape)
    space = tuple(x.shape[:k]) + bshape + tuple(x.shape[k + m:])
    coords = []
    for d in range(len(x.shape)):
        if d < k:
            coords.append(Index(d))
        elif d < k + m:
            idx = views.expand(indices[d], bshape)
            e = _index_expr(TV(idx.expr, bshape, idx.ext), x, d)
            coords.append(views.remap(e, [DimMap("dim", k + j) for j in range(nb)], len(space)))
            _note_state_index(L, target, indices[d], x.shape[d])
        else:
            coords.append(Index(d - m + nb))
    vals = values if isinstance(values, TV) else TV(as_operand(values, (), target.dtype), ())
    vals = views.expand(vals, space) if vals.shape != space else vals
    value = vals.expr if vals.dtype == target.dtype else Op("cast", [vals.expr], target.dtype)
    ext = list(vals.exts())
    for d in dims:   # a dynamic index length that (broadcast) values do not carry
        iext = indices[d].exts()
        for j, e in enumerate(iext[len(iext) - nb:] if iext else ()):
            if e is not None and ext[k + j] is None:
                ext[k + j] = e
    L.emit(Kernel(Scatter(coords=tuple(coords), accumulate=accumulate), target, space, value,
                  ext=tuple(ext)))


def _note_state_index(L, target: Buffer, index: TV, size: int) -> None:
    """Remember which user input indexes a state buffer, and how many positions that dimension
    has: `--generate` derives the cache capacity from it."""
    if target.kind != "state":
        return
    for load in loads(index.expr):
        if load.buf.kind == "input":
            L.state_index_sizes.append((load.buf.name, int(size)))


SCATTER_REDUCE = {"sum": "add", "add": "add", "amax": "max", "amin": "min"}
# the dtypes Triton's atomics take on sm_90 (no fp16/bf16 max/min, no 8/16-bit integers)
ATOMIC_DTYPES = {"add": ("float32", "float64", "float16", "bfloat16", "int32", "int64"),
                 "max": ("float32", "float64", "int32", "int64"),
                 "min": ("float32", "float64", "int32", "int64")}


def _check_atomic(mode, dtype: str) -> None:
    if mode is not None and dtype not in ATOMIC_DTYPES[mode]:
        raise LoweringError(f"an accumulating scatter ({mode}) into {dtype} is not supported "
                            f"(the device atomics take {', '.join(ATOMIC_DTYPES[mode])})")


@handles(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter.reduce,
         aten.scatter.value_reduce, aten.scatter_reduce.two)
def _scatter_along(L, node, x, dim, index, src, reduce=None, include_self=True):
    """torch.scatter family: out = x with out[..., index[i], ...] = src[i] (or combined with it)
    along `dim`, over the index tensor's own index space. Out-of-range destinations are not
    written. Plain scatter with repeated destinations keeps one of the values, as on CUDA."""
    mode = "add" if node.target == aten.scatter_add.default else None
    if reduce is not None:
        if reduce not in SCATTER_REDUCE:
            raise LoweringError(f"scatter with reduce={reduce!r} is not supported (sum, amax, "
                                "amin are)")
        mode = SCATTER_REDUCE[reduce]
    _check_atomic(mode, x.dtype)
    nd = len(x.shape)
    if nd == 0 or len(index.shape) != nd:
        raise LoweringError("scatter of a 0-d tensor is not supported")
    if x.ext is not None or index.ext is not None:
        raise LoweringError("scatter over dynamic dimensions is not supported")
    dim %= nd
    target = L.new_buffer(x.shape, x.dtype)
    L.realize(x, into=target)
    space = tuple(index.shape)
    idx = index.expr if index.dtype == "int64" else Op("cast", [index.expr], "int64")
    coords = tuple(idx if d == dim else Index(d) for d in range(nd))
    if isinstance(src, TV):
        for d in range(nd):   # src may be larger than index: its leading corner is read
            src = views.slice_(src, d, 0, space[d])
        value = src.expr
    else:
        value = as_operand(src, space, x.dtype)
    if value.dtype != x.dtype:
        value = Op("cast", [value], x.dtype)
    if not include_self:   # the destinations start from the reduction's identity
        identity = {"add": 0, "max": float("-inf"), "min": float("inf")}[mode]
        if not x.dtype.startswith(("float", "bfloat")) and mode != "add":
            identity = -2**63 if mode == "max" else 2**63 - 1
        L.emit(Kernel(Scatter(coords=coords), target, space, as_operand(identity, space, x.dtype)))
    L.emit(Kernel(Scatter(coords=coords, accumulate=mode), target, space, value))
    return views.contiguous_load(target)
