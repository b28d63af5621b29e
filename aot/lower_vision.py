"""ATen handlers for vision models: convolutions, batch norm, pooling, resampling and the index
shuffles CNNs use (flip, repeat, diagonal, unfold).

Most of these are index maps plus an existing kernel family, so they cost no new template:
- a convolution with groups=1 is im2col (a gather into memory) + GEMM, a grouped one a batched
  GEMM with one batch per group, a depthwise one a *direct* `reduction` over its window (no
  im2col: every output reads kh·kw inputs and as many weights);
- pooling is a `reduction` over a window of the input read through a `Reindex` (padding reads as
  the reduction's identity), adaptive pooling the same with per-output window bounds;
- inference batch norm is folded into the preceding convolution's weights at compile time when
  it follows one, else it is a per-channel affine whose scale and shift are computed at compile
  time (fused into whatever kernel produces its input).
"""
from __future__ import annotations

import math
import operator

import numpy as np
import torch

from . import views
from .ir import Const, DimMap, Index, Load, Op, Reindex, contiguous_strides
from .lower import LoweringError, handles
from .lower_ops import _matmul, _reduce
from .views import TV

aten = torch.ops.aten


# ---- helpers ---------------------------------------------------------------------------------
def _weight_tensor(L, tv) -> torch.Tensor | None:
    """The compile-time value of a TV that is a whole weight (a parameter or buffer), else None."""
    if not isinstance(tv, TV) or not isinstance(tv.expr, Load):
        return None
    e = tv.expr
    if (e.buf.kind != "weight" or e.offset or e.buf.shape != tv.shape
            or e.strides != contiguous_strides(tv.shape)):
        return None
    return L.weight_data.get(e.buf.name)


def _first_meta(L, node):
    """Shape and dtype of a node's first result (pooling also returns indices)."""
    val = node.meta["val"]
    val = val[0] if isinstance(val, (tuple, list)) else val
    return tuple(L.size_of(s) for s in val.shape), str(val.dtype).replace("torch.", "")


def _int_list(v, n: int) -> list[int]:
    if isinstance(v, int):
        return [v] * n
    v = [int(x) for x in v]
    return v * n if len(v) == 1 else v


def _axis(out_dim: int, k_dim: int, stride: int, dilation: int, pad: int) -> DimMap:
    """The input position o·stride + k·dilation − pad of output position o and window offset k."""
    e = Op("add", [Op("mul", [Index(out_dim), Const(stride, "int64")], "int64"),
                   Op("mul", [Index(k_dim), Const(dilation, "int64")], "int64")], "int64")
    return DimMap("expr", expr=Op("sub", [e, Const(pad, "int64")], "int64"))


def _window(x: TV, out_sp, kernel, stride, padding, dilation, fill) -> TV:
    """x [N, C, *S] read as [N, C, *O, *K]: element (n, c, o, k) is x[n, c, o·s + k·d − p], or
    `fill` where that falls outside x (padding, ceil-mode overhang)."""
    nsp = len(kernel)
    maps = [DimMap("dim", 0), DimMap("dim", 1)]
    maps += [_axis(2 + i, 2 + nsp + i, stride[i], dilation[i], padding[i]) for i in range(nsp)]
    shape = tuple(x.shape[:2]) + tuple(out_sp) + tuple(kernel)
    ext = tuple(x.exts()[:2]) + (None,) * (2 * nsp)
    return TV(Reindex(x.expr, maps, bounds=x.shape, fill=fill), shape, ext)


def _static_spatial(x: TV, what: str) -> None:
    if any(e is not None for e in x.exts()[1:]):
        raise LoweringError(f"{what} over a dynamic channel or spatial dimension is not "
                            "supported (only the batch may be dynamic)")


def _channel_vector(t: TV | torch.Tensor, L, x: TV, name: str) -> TV:
    """A per-channel [C] value broadcast over x [N, C, ...] in fp32."""
    if isinstance(t, torch.Tensor):
        t = L.derived_weight(name, t.to(torch.float32))
    shape = (1, t.shape[0]) + (1,) * (len(x.shape) - 2)
    e = views.expand(views.view(t, shape), x.shape)
    return TV(e.expr if e.dtype == "float32" else Op("cast", [e.expr], "float32"), x.shape, x.ext)


def _lowest(dtype: str):
    if dtype.startswith("float") or dtype == "bfloat16":
        return float("-inf")
    if dtype == "bool":
        return False
    return int(np.iinfo(dtype).min)


# ---- convolution -----------------------------------------------------------------------------
@handles(aten.convolution.default)
def _convolution(L, node, x, w, bias, stride, padding, dilation, transposed, output_padding,
                 groups):
    shape, dtype = L.out_meta(node)
    nsp = len(x.shape) - 2
    if nsp not in (1, 2, 3):
        raise LoweringError(f"a convolution over {nsp} spatial dimensions is not supported")
    if transposed:
        return _conv_transposed(L, node, x, w, bias, stride, padding, dilation, output_padding,
                                groups)
    _static_spatial(x, "convolution")
    stride, padding, dilation = (_int_list(v, nsp) for v in (stride, padding, dilation))
    folded = _fold_following_batch_norm(L, node, w, bias)
    if folded is not None:
        w, bias = folded
    if nsp == 1:   # conv1d is a conv2d over a height of 1
        x4, w4 = views.unsqueeze(x, 2), views.unsqueeze(w, 2)
        out = _conv2d(L, x4, w4, bias, [1] + stride, [0] + padding, [1] + dilation, groups,
                      shape[:2] + (1,) + shape[2:], dtype)
        return views.squeeze(out, [2])
    if nsp == 3:
        return _conv_nd(L, x, w, bias, stride, padding, dilation, groups, shape, dtype)
    return _conv2d(L, x, w, bias, stride, padding, dilation, groups, shape, dtype)


def _conv2d(L, x, w, bias, stride, padding, dilation, groups, shape, dtype):
    c, o, cg = x.shape[1], w.shape[0], w.shape[1]
    if groups == c and cg == 1:
        return _conv_direct(L, x, w, bias, stride, padding, dilation, groups, shape, dtype)
    if groups != 1:
        return _conv_grouped(L, x, w, bias, stride, padding, dilation, groups, shape, dtype)
    nb, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    _, _, oh, ow = shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    if kh == kw == 1 and ph == pw == 0:
        # a 1x1 convolution reads x itself as the GEMM operand: [N·OH·OW, C] is a strided
        # view of x (every s-th row and column), no im2col copy
        sub = views.slice_(views.slice_(x, 2, 0, None, sh), 3, 0, None, sw)
        cols = L.operand(views.view(views.permute(sub, [0, 2, 3, 1]), (nb * oh * ow, c)))
    else:
        # im2col: [N, OH, OW, C, KH, KW] -> x[n, c, oh*sh + kh*dh - ph, ow*sw + kw*dw - pw]
        maps = [DimMap("dim", 0), DimMap("dim", 3), _axis(1, 4, sh, dh, ph),
                _axis(2, 5, sw, dw, pw)]
        window = TV(Reindex(x.expr, maps, bounds=x.shape, fill=0.0), (nb, oh, ow, c, kh, kw),
                    (x.dim_ext(0),) + (None,) * 5)
        cols = views.view(window, (nb * oh * ow, c * kh * kw))
        kdim, wt = c * kh * kw, _weight_tensor(L, w)
        if kdim % 32 and wt is not None:
            # rows of 147 floats (a 7x7 RGB stem) are misaligned for vector loads: pad the
            # columns and the weights with zeros to a multiple of 32
            kp = -(-kdim // 32) * 32
            cols = views.pad(cols, [0, kp - kdim], 0.0)
            padded = torch.zeros((o, kp), dtype=wt.dtype)
            padded[:, :kdim] = wt.reshape(o, kdim)
            name = w.expr.buf.name
            w = views.view(L.derived_weight(f"{name}.padded", padded), (o, kp, 1, 1))
        cols = L.realize(cols)
    wmat = views.permute(views.view(w, (o, cols.shape[1])), [1, 0])
    out = _matmul(L, _FakeNode((nb * oh * ow, o), dtype), cols, wmat, _bias_epilogue(bias, 1, o))
    return views.permute(views.view(out, (nb, oh, ow, o)), [0, 3, 1, 2])


def _conv_grouped(L, x, w, bias, stride, padding, dilation, groups, shape, dtype):
    """A batched GEMM, one batch per group: [G, N·OH·OW, Cg·KH·KW] @ [G, Cg·KH·KW, Og]."""
    nb, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    _, _, oh, ow = shape
    og = o // groups
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    chan = Op("add", [Op("mul", [Index(0), Const(cg, "int64")], "int64"), Index(4)], "int64")
    maps = [DimMap("dim", 1), DimMap("expr", expr=chan), _axis(2, 5, sh, dh, ph),
            _axis(3, 6, sw, dw, pw)]
    window = TV(Reindex(x.expr, maps, bounds=x.shape, fill=0.0),
                (groups, nb, oh, ow, cg, kh, kw), (None, x.dim_ext(0)) + (None,) * 5)
    cols = L.realize(views.view(window, (groups, nb * oh * ow, cg * kh * kw)))
    wmat = views.permute(views.view(w, (groups, og, cg * kh * kw)), [0, 2, 1])
    out = _matmul(L, _FakeNode((groups, nb * oh * ow, og), dtype), cols, wmat,
                  _bias_epilogue(bias, groups, og))
    out = views.permute(views.view(out, (groups, nb, oh, ow, og)), [1, 0, 4, 2, 3])
    return views.view(out, (nb, o, oh, ow))


def _bias_epilogue(bias, groups: int, og: int):
    """acc + bias[g·Og + o'] over a GEMM result [G, M, Og]."""
    if bias is None:
        return None

    def epilogue(acc, out_shape):
        b = views.expand(views.view(bias, (groups, 1, og)), out_shape).expr
        return Op("add", [acc, b if bias.dtype == "float32" else Op("cast", [b], "float32")],
                  "float32")
    return epilogue


def _conv_direct(L, x, w, bias, stride, padding, dilation, groups, shape, dtype):
    """Depthwise (every group one input channel): out[n, o] = Σ_k x[n, o // mult, window] · w[o, k]
    as one reduction kernel per output over the kh·kw window — no im2col copy."""
    nsp = len(x.shape) - 2
    mult = w.shape[0] // groups
    kernel = tuple(w.shape[2:])
    win = _window(x, shape[2:], kernel, stride, padding, dilation, 0.0)
    if mult != 1:   # output channel o reads input channel o // mult
        chan = Op("floordiv", [Index(1), Const(mult, "int64")], "int64")
        maps = [DimMap("dim", 0), DimMap("expr", expr=chan)]
        maps += [DimMap("dim", d) for d in range(2, 2 + 2 * nsp)]
        win = TV(Reindex(win.expr, maps), (win.shape[0], w.shape[0]) + win.shape[2:], win.ext)
    wmaps = [DimMap("dim", 1), DimMap("const", start=0)]
    wmaps += [DimMap("dim", 2 + nsp + i) for i in range(nsp)]
    wexpr = views.remap(w.expr, wmaps, len(win.shape))
    prod = TV(Op("mul", [_f32(win.expr), _f32(wexpr)], "float32"), win.shape, win.ext)
    # reduce in [N, *O, C, *K] order: the result is stored channels-last, like the GEMMs'
    # around it, and neighbouring programs read neighbouring channels
    order = [0] + list(range(2, 2 + nsp)) + [1] + list(range(2 + nsp, 2 + 2 * nsp))
    rdims = list(range(2 + nsp, 2 + 2 * nsp))
    out = _reduce(L, views.permute(prod, order), rdims, "sum", False, "float32")
    out = views.permute(out, [0, 1 + nsp] + list(range(1, 1 + nsp)))
    value = out.expr
    if bias is not None:
        value = Op("add", [value, _channel_vector(bias, L, out, "").expr], "float32")
    return TV(Op("cast", [value], dtype) if dtype != "float32" else value, out.shape, out.ext)


def _conv_nd(L, x, w, bias, stride, padding, dilation, groups, shape, dtype):
    """3-D convolution: im2col over [N, *O, C, *K] + GEMM (groups=1), or the direct kernel when
    depthwise."""
    if groups == x.shape[1] and w.shape[1] == 1:
        return _conv_direct(L, x, w, bias, stride, padding, dilation, groups, shape, dtype)
    if groups != 1:
        raise LoweringError("grouped 3-D convolution is not supported (groups=1 or depthwise)")
    nsp = len(kernel := tuple(w.shape[2:]))
    nb, c = x.shape[:2]
    o = w.shape[0]
    out_sp = tuple(shape[2:])
    # [N, *O, C, *K]: input dim 0 <- 0, 1 <- 1 + nsp, spatial i <- (1 + i, 2 + nsp + i)
    maps = [DimMap("dim", 0), DimMap("dim", 1 + nsp)]
    maps += [_axis(1 + i, 2 + nsp + i, stride[i], dilation[i], padding[i]) for i in range(nsp)]
    wshape = (nb,) + out_sp + (c,) + kernel
    window = TV(Reindex(x.expr, maps, bounds=x.shape, fill=0.0), wshape,
                (x.dim_ext(0),) + (None,) * (len(wshape) - 1))
    m, k = nb * math.prod(out_sp), c * math.prod(kernel)
    cols = L.realize(views.view(window, (m, k)))
    wmat = views.permute(views.view(w, (o, k)), [1, 0])
    out = _matmul(L, _FakeNode((m, o), dtype), cols, wmat, _bias_epilogue(bias, 1, o))
    out = views.view(out, (nb,) + out_sp + (o,))
    return views.permute(out, [0, nsp + 1] + list(range(1, nsp + 1)))


def _conv_transposed(L, node, x, w, bias, stride, padding, dilation, output_padding, groups):
    """A transposed convolution as a direct reduction: out[n, o, y] = Σ_{c,k} x[n, c, (y + p −
    k·d) / s] · w[c, o, k] over the terms where that division is exact and in range."""
    shape, dtype = L.out_meta(node)
    _static_spatial(x, "transposed convolution")
    nsp = len(x.shape) - 2
    stride, padding, dilation = (_int_list(v, nsp) for v in (stride, padding, dilation))
    cg, og = w.shape[0] // groups, w.shape[1]
    kernel = tuple(w.shape[2:])
    # index space [N, O, *Y, Cg, *K]
    nd = 2 + nsp + 1 + nsp
    cdim = 2 + nsp
    gidx = Op("floordiv", [Index(1), Const(og, "int64")], "int64")
    chan = Op("add", [Op("mul", [gidx, Const(cg, "int64")], "int64"), Index(cdim)], "int64")
    maps, ok = [DimMap("dim", 0), DimMap("expr", expr=chan)], None
    for i in range(nsp):
        num = Op("sub", [Op("add", [Index(2 + i), Const(padding[i], "int64")], "int64"),
                         Op("mul", [Index(cdim + 1 + i), Const(dilation[i], "int64")], "int64")],
                 "int64")
        # num may be negative: test divisibility on num + s·K (a non-negative shift by a
        # multiple of s), and let the bounds mask reject the negative quotient
        shift = stride[i] * (x.shape[2 + i] + kernel[i] * dilation[i] + padding[i] + 1)
        pos = Op("add", [num, Const(shift, "int64")], "int64")
        exact = Op("eq", [Op("fmod", [pos, Const(stride[i], "int64")], "int64"),
                          Const(0, "int64")], "bool")
        ok = exact if ok is None else Op("and", [ok, exact], "bool")
        q = Op("sub", [Op("floordiv", [pos, Const(stride[i], "int64")], "int64"),
                       Const(shift // stride[i], "int64")], "int64")
        maps.append(DimMap("expr", expr=q))
    space = (shape[0], shape[1]) + tuple(shape[2:]) + (cg,) + kernel
    xval = Reindex(x.expr, maps, bounds=x.shape, fill=0.0)
    # w [C, Og, *K]: w[g·Cg + c, o mod Og, k]
    wo = Op("sub", [Index(1), Op("mul", [gidx, Const(og, "int64")], "int64")], "int64")
    wmaps = [DimMap("expr", expr=chan), DimMap("expr", expr=wo)]
    wmaps += [DimMap("dim", cdim + 1 + i) for i in range(nsp)]
    wval = Reindex(w.expr, wmaps)
    prod = Op("mul", [_f32(xval), _f32(wval)], "float32")
    prod = Op("where", [ok, prod, Const(0.0, "float32")], "float32")
    rdims = list(range(cdim, nd))
    out = _reduce(L, TV(prod, space, (x.dim_ext(0),) + (None,) * (nd - 1)), rdims, "sum",
                  False, "float32")
    value = out.expr
    if bias is not None:
        value = Op("add", [value, _channel_vector(bias, L, out, "").expr], "float32")
    return TV(Op("cast", [value], dtype) if dtype != "float32" else value, out.shape, out.ext)


def _f32(e):
    return e if e.dtype == "float32" else Op("cast", [e], "float32")


class _FakeNode:
    """Lets an op handler call another handler for an intermediate result shape."""

    def __init__(self, shape, dtype):
        self.meta = {"val": torch.empty(shape, dtype=getattr(torch, dtype), device="meta")}


# ---- batch norm (inference) ------------------------------------------------------------------
BATCH_NORM = (aten._native_batch_norm_legit_no_training.default,)


def _bn_args(node):
    """(weight, bias, mean, var, eps) nodes/values of an inference batch norm node, or None."""
    if node.target in BATCH_NORM:
        _, w, b, mean, var, _momentum, eps = node.args
        return w, b, mean, var, eps
    if node.target == aten._native_batch_norm_legit.default and not node.args[5]:
        _, w, b, mean, var, _training, _momentum, eps = node.args
        return w, b, mean, var, eps
    if node.target == aten.native_batch_norm.default and not node.args[5]:
        _, w, b, mean, var, _training, _momentum, eps = node.args
        return w, b, mean, var, eps
    return None


def _bn_affine(L, w, b, mean, var, eps, channels: int):
    """scale = w / sqrt(var + eps), shift = b − mean·scale as fp64 tensors, when every statistic
    is known at compile time; else None."""
    vals = [_weight_tensor(L, t) if t is not None else None for t in (w, b, mean, var)]
    if vals[2] is None or vals[3] is None or any(t is not None and v is None
                                                 for t, v in zip((w, b), vals[:2])):
        return None
    wt, bt, mt, vt = (v.double() if v is not None else None for v in vals)
    scale = (wt if wt is not None else torch.ones(channels, dtype=torch.float64)) / torch.sqrt(
        vt + float(eps))
    shift = (bt if bt is not None else torch.zeros(channels, dtype=torch.float64)) - mt * scale
    return scale, shift


def _fold_following_batch_norm(L, node, w, bias):
    """When the convolution's only reader is an inference batch norm with compile-time
    statistics (and its weight is a compile-time tensor), fold the norm into the weights:
    w' = w·scale[o], b' = b·scale + shift. The batch norm then passes its input through."""
    users = list(node.users)
    if len(users) != 1 or _bn_args(users[0]) is None:
        return None
    bn = users[0]
    if any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in bn.users):
        return None
    wt = _weight_tensor(L, w)
    if wt is None or (bias is not None and _weight_tensor(L, bias) is None):
        return None
    args = [L.env.get(a) if hasattr(a, "op") else a for a in _bn_args(bn)[:4]]
    affine = _bn_affine(L, *args, _bn_args(bn)[4], wt.shape[0])
    if affine is None:
        return None
    scale, shift = affine
    new_w = (wt.double() * scale.view(-1, *([1] * (wt.dim() - 1)))).to(wt.dtype)
    old_b = _weight_tensor(L, bias).double() if bias is not None else torch.zeros_like(scale)
    new_b = (old_b * scale + shift).to(wt.dtype)
    L.absorbed.add(bn)
    name = node.name
    return L.derived_weight(f"fold.{name}.weight", new_w), L.derived_weight(f"fold.{name}.bias",
                                                                            new_b)


@handles(aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit.default,
         aten.native_batch_norm.default)
def _batch_norm(L, node, x, w, b, mean, var, *rest):
    if _bn_args(node) is None:
        raise LoweringError("batch norm in training mode is not supported (export the model "
                            "in eval mode)")
    if node in L.absorbed:   # folded into the convolution that produced x
        return x, None, None
    if any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users):
        raise LoweringError("batch norm's saved mean/rstd outputs are not supported (inference "
                            "only)")
    shape, dtype = _first_meta(L, node)
    eps = _bn_args(node)[4]
    if len(x.shape) < 2:
        raise LoweringError("batch norm needs a channel dimension")
    c = x.shape[1]
    affine = _bn_affine(L, w, b, mean, var, eps, c)
    if affine is not None:
        scale = _channel_vector(affine[0], L, x, f"bn.{node.name}.scale")
        shift = _channel_vector(affine[1], L, x, f"bn.{node.name}.shift")
    else:   # statistics computed by the model: evaluate the affine per element
        inv = Op("rsqrt", [Op("add", [_channel_vector(var, L, x, "").expr,
                                      Const(float(eps), "float32")], "float32")], "float32")
        if w is not None:
            inv = Op("mul", [inv, _channel_vector(w, L, x, "").expr], "float32")
        scale = TV(inv, x.shape, x.ext)
        sh = Op("mul", [Op("neg", [_channel_vector(mean, L, x, "").expr], "float32"), inv],
                "float32")
        if b is not None:
            sh = Op("add", [sh, _channel_vector(b, L, x, "").expr], "float32")
        shift = TV(sh, x.shape, x.ext)
    y = Op("add", [Op("mul", [_f32(x.expr), scale.expr], "float32"), shift.expr], "float32")
    out = TV(Op("cast", [y], dtype) if dtype != "float32" else y, x.shape, x.ext)
    return out, None, None


# ---- pooling ---------------------------------------------------------------------------------
def _pool_window_args(x, kernel_size, stride, padding, dilation):
    nsp = len(x.shape) - 2
    kernel = _int_list(kernel_size, nsp)
    stride = _int_list(stride, nsp) if stride else list(kernel)
    padding = _int_list(padding, nsp)
    dilation = _int_list(dilation, nsp)
    return kernel, stride, padding, dilation


def _unused_indices(node, what: str):
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        raise LoweringError(f"{what}'s indices output is not supported (inference uses the "
                            "values only)")


@handles(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool(L, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    _unused_indices(node, "max pooling")
    _static_spatial(x, "max pooling")
    shape, dtype = _first_meta(L, node)
    batched = len(x.shape) == len(shape) and len(x.shape) == len(kernel_size) + 2
    if not batched:   # [C, *S] without a batch
        x = views.unsqueeze(x, 0)
        shape = (1,) + shape
    kernel, stride, padding, dilation = _pool_window_args(x, kernel_size, stride, padding,
                                                          dilation)
    win = _window(x, shape[2:], kernel, stride, padding, dilation, _lowest(x.dtype))
    nsp = len(kernel)
    out = _reduce(L, win, list(range(2 + nsp, 2 + 2 * nsp)), "max", False, dtype)
    return (out if batched else views.squeeze(out, [0])), None


@handles(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(L, node, x, kernel_size, stride=(), padding=0, ceil_mode=False,
              count_include_pad=True, divisor_override=None):
    _static_spatial(x, "average pooling")
    shape, dtype = L.out_meta(node)
    batched = len(x.shape) == len(kernel_size) + 2
    if not batched:
        x = views.unsqueeze(x, 0)
        shape = (1,) + shape
    kernel, stride, padding, _ = _pool_window_args(x, kernel_size, stride, padding, 1)
    nsp = len(kernel)
    win = _window(x, shape[2:], kernel, stride, padding, [1] * nsp, 0.0)
    total = _reduce(L, win, list(range(2 + nsp, 2 + 2 * nsp)), "sum", False, "float32")
    if divisor_override:
        count = Const(float(divisor_override), "float32")
    else:   # torch's rule: the window clipped to the padded input, or to the input itself
        count = None
        for i in range(nsp):
            size = x.shape[2 + i]
            start = Op("sub", [Op("mul", [Index(2 + i), Const(stride[i], "int64")], "int64"),
                               Const(padding[i], "int64")], "int64")
            end = Op("minimum", [Op("add", [start, Const(kernel[i], "int64")], "int64"),
                                 Const(size + padding[i], "int64")], "int64")
            if not count_include_pad:
                start = Op("maximum", [start, Const(0, "int64")], "int64")
                end = Op("minimum", [end, Const(size, "int64")], "int64")
            n = Op("sub", [end, start], "int64")
            count = n if count is None else Op("mul", [count, n], "int64")
        count = Op("cast", [count], "float32")
    value = Op("div", [total.expr, count], "float32")
    out = TV(Op("cast", [value], dtype) if dtype != "float32" else value, total.shape, total.ext)
    return out if batched else views.squeeze(out, [0])


def _adaptive(L, node, x, output_size, op: str):
    """Adaptive pooling: output o along a dimension of size S covers [⌊o·S/O⌋, ⌈(o+1)·S/O⌉).
    The window is as long as the longest of these; offsets past an output's own end read the
    reduction's identity."""
    _static_spatial(x, "adaptive pooling")
    shape, dtype = _first_meta(L, node)
    batched = len(x.shape) == len(output_size) + 2
    if not batched:
        x = views.unsqueeze(x, 0)
        shape = (1,) + shape
    nsp = len(output_size)
    out_sp = shape[2:]
    in_sp = x.shape[2:]
    if op == "sum" and all(o == 1 for o in out_sp):   # global average pooling: a mean
        total = _reduce(L, x, list(range(2, 2 + nsp)), "sum", True, "float32",
                        divisor=math.prod(in_sp))
        value = total.expr
        out = TV(Op("cast", [value], dtype) if dtype != "float32" else value, total.shape,
                 total.ext)
        return out if batched else views.squeeze(out, [0])
    kernel, maps, valid, count = [], [DimMap("dim", 0), DimMap("dim", 1)], None, None
    for i, (s, o) in enumerate(zip(in_sp, out_sp)):
        k = max(-(-((j + 1) * s) // o) - (j * s) // o for j in range(o))
        kernel.append(k)
        start = Op("floordiv", [Op("mul", [Index(2 + i), Const(s, "int64")], "int64"),
                                Const(o, "int64")], "int64")
        end = Op("floordiv", [Op("add", [Op("mul", [Index(2 + i), Const(s, "int64")], "int64"),
                                         Const(s + o - 1, "int64")], "int64"),
                              Const(o, "int64")], "int64")
        maps.append(DimMap("expr", expr=Op("add", [start, Index(2 + nsp + i)], "int64")))
        inside = Op("lt", [Index(2 + nsp + i), Op("sub", [end, start], "int64")], "bool")
        valid = inside if valid is None else Op("and", [valid, inside], "bool")
        n = Op("sub", [end, start], "int64")
        count = n if count is None else Op("mul", [count, n], "int64")
    space = tuple(x.shape[:2]) + tuple(out_sp) + tuple(kernel)
    fill = 0.0 if op == "sum" else _lowest(x.dtype)
    read = Reindex(x.expr, maps, bounds=x.shape, fill=fill)
    src = Op("where", [valid, read, Const(fill, x.dtype)], x.dtype)
    red = _reduce(L, TV(src, space, tuple(x.exts()[:2]) + (None,) * (2 * nsp)),
                  list(range(2 + nsp, 2 + 2 * nsp)), op, False,
                  "float32" if op == "sum" else dtype)
    if op == "sum":
        # the count is evaluated at the output index: Index(2 + i) there is the output position
        count_out = views.remap(count, [DimMap("dim", d) for d in range(2 + nsp)], 2 + nsp)
        value = Op("div", [red.expr, Op("cast", [count_out], "float32")], "float32")
        red = TV(Op("cast", [value], dtype) if dtype != "float32" else value, red.shape, red.ext)
    return red if batched else views.squeeze(red, [0])


@handles(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
         aten.adaptive_avg_pool2d.default)
def _adaptive_avg(L, node, x, output_size):
    return _adaptive(L, node, x, list(output_size), "sum")


@handles(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max(L, node, x, output_size):
    _unused_indices(node, "adaptive max pooling")
    return _adaptive(L, node, x, list(output_size), "max"), None


# ---- resampling ------------------------------------------------------------------------------
def _scales(x: TV, shape, scale_factors, nsp: int):
    """torch's source-per-destination scale of each spatial dimension: 1/scale_factor when a
    factor was given, else in/out (as fp32, the type torch computes it in)."""
    out = []
    for i in range(nsp):
        s_in, s_out = x.shape[2 + i], shape[2 + i]
        if scale_factors:
            out.append(float(np.float32(1.0 / float(scale_factors[i]))))
        else:
            out.append(float(np.float32(s_in / s_out)) if s_out else 0.0)
    return out


@handles(aten.upsample_nearest2d.vec, aten.upsample_nearest1d.vec, aten.upsample_nearest3d.vec,
         aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact1d.vec,
         aten._upsample_nearest_exact3d.vec)
def _upsample_nearest(L, node, x, output_size, scale_factors):
    _static_spatial(x, "upsampling")
    shape, _ = L.out_meta(node)
    nsp = len(shape) - 2
    exact = "exact" in str(node.target)
    maps = [DimMap("dim", 0), DimMap("dim", 1)]
    for i, scale in enumerate(_scales(x, shape, scale_factors, nsp)):
        s_in, s_out = x.shape[2 + i], shape[2 + i]
        if s_in == s_out and not exact:
            maps.append(DimMap("dim", 2 + i))
            continue
        pos = Op("cast", [Index(2 + i)], "float32")
        if exact:
            pos = Op("add", [pos, Const(0.5, "float32")], "float32")
        src = Op("cast", [Op("floor", [Op("mul", [pos, Const(scale, "float32")], "float32")],
                                "float32")], "int64")
        maps.append(DimMap("expr", expr=Op("minimum", [src, Const(s_in - 1, "int64")], "int64")))
    return TV(Reindex(x.expr, maps), shape, tuple(x.exts()[:2]) + (None,) * nsp)


@handles(aten.upsample_bilinear2d.vec, aten.upsample_linear1d.vec, aten.upsample_trilinear3d.vec)
def _upsample_linear(L, node, x, output_size, align_corners, scale_factors):
    """(Bi/tri)linear interpolation: per spatial dimension a source position, its two
    neighbours and a weight; the output is the weighted sum over the 2^d corners."""
    _static_spatial(x, "upsampling")
    shape, dtype = L.out_meta(node)
    nsp = len(shape) - 2
    scales = _scales(x, shape, scale_factors, nsp)
    axes = []
    for i in range(nsp):
        s_in, s_out = x.shape[2 + i], shape[2 + i]
        pos = Op("cast", [Index(2 + i)], "float32")
        if align_corners:
            step = (s_in - 1) / (s_out - 1) if s_out > 1 else 0.0
            src = Op("mul", [pos, Const(float(np.float32(step)), "float32")], "float32")
        else:
            src = Op("sub", [Op("mul", [Op("add", [pos, Const(0.5, "float32")], "float32"),
                                        Const(scales[i], "float32")], "float32"),
                             Const(0.5, "float32")], "float32")
            src = Op("maximum", [src, Const(0.0, "float32")], "float32")
        i0 = Op("minimum", [Op("cast", [Op("floor", [src], "float32")], "int64"),
                            Const(s_in - 1, "int64")], "int64")
        i1 = Op("minimum", [Op("add", [i0, Const(1, "int64")], "int64"),
                            Const(s_in - 1, "int64")], "int64")
        lam = Op("sub", [src, Op("cast", [i0], "float32")], "float32")
        axes.append((i0, i1, lam))
    total = None
    for corner in range(1 << nsp):
        maps, weight = [DimMap("dim", 0), DimMap("dim", 1)], None
        for i, (i0, i1, lam) in enumerate(axes):
            hi = corner >> i & 1
            maps.append(DimMap("expr", expr=i1 if hi else i0))
            wgt = lam if hi else Op("sub", [Const(1.0, "float32"), lam], "float32")
            weight = wgt if weight is None else Op("mul", [weight, wgt], "float32")
        term = Op("mul", [weight, _f32(Reindex(x.expr, maps))], "float32")
        total = term if total is None else Op("add", [total, term], "float32")
    out = Op("cast", [total], dtype) if dtype != "float32" else total
    return TV(out, shape, tuple(x.exts()[:2]) + (None,) * nsp)


# ---- index shuffles --------------------------------------------------------------------------
@handles(aten.flip.default)
def _flip(L, node, x, dims):
    nd = len(x.shape)
    dims = {d % nd for d in dims} if nd else set()
    if any(x.dim_ext(d) is not None for d in dims):
        raise LoweringError("flipping a dynamic dimension is not supported")
    maps = [DimMap("dim", d, -1, x.shape[d] - 1) if d in dims and x.shape[d] > 1
            else DimMap("dim", d) for d in range(nd)]
    return TV(views.remap(x.expr, maps, nd), x.shape, x.ext)


@handles(aten.repeat.default)
def _repeat(L, node, x, repeats):
    """x.repeat(r): x broadcast over [r0, s0, r1, s1, ...], read as [r0·s0, r1·s1, ...]."""
    shape, _ = L.out_meta(node)
    lead = len(repeats) - len(x.shape)
    sizes = (1,) * lead + tuple(x.shape)
    if any(e is not None for e, r in zip(x.exts(), repeats[lead:]) if r != 1):
        raise LoweringError("repeating a dynamic dimension is not supported")
    inter, bshape = [], []
    for r, s in zip(repeats, sizes):
        inter += [1, s]
        bshape += [r, s]
    ext = (None,) * (2 * lead) + sum(((None, e) for e in x.exts()), ())
    tv = views.view(x, inter) if x.ext is None else TV(views.reshape(x.expr, x.shape, inter),
                                                       inter, ext)
    tv = views.expand(tv, bshape)
    return views.view(tv, shape)


@handles(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(L, node, x, offset=0, dim1=0, dim2=1):
    nd = len(x.shape)
    dim1, dim2 = dim1 % nd, dim2 % nd
    if x.dim_ext(dim1) is not None or x.dim_ext(dim2) is not None:
        raise LoweringError("the diagonal of a dynamic dimension is not supported")
    shape, _ = L.out_meta(node)
    rest = [d for d in range(nd) if d not in (dim1, dim2)]
    last = len(rest)
    maps = [None] * nd
    for i, d in enumerate(rest):
        maps[d] = DimMap("dim", i)
    maps[dim1] = DimMap("dim", last, 1, max(-offset, 0))
    maps[dim2] = DimMap("dim", last, 1, max(offset, 0))
    return TV(views.remap(x.expr, maps, len(shape)), shape,
              [x.dim_ext(d) for d in rest] + [None])


@handles(aten.unfold.default)
def _unfold(L, node, x, dim, size, step):
    """x.unfold(dim, size, step): windows along `dim` as a new last dimension."""
    nd = len(x.shape)
    dim = dim % nd if nd else 0
    if nd and x.dim_ext(dim) is not None:
        raise LoweringError("unfolding a dynamic dimension is not supported")
    shape, _ = L.out_meta(node)
    if nd == 0:
        return views.view(x, shape)
    maps = [DimMap("dim", d) for d in range(nd)]
    pos = Op("add", [Op("mul", [Index(dim), Const(step, "int64")], "int64"), Index(nd)], "int64")
    maps[dim] = DimMap("expr", expr=pos)
    return TV(Reindex(x.expr, maps), shape, tuple(x.exts()) + (None,))


@handles(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(L, node, x, size, stride, storage_offset=None):
    """x.as_strided(size, stride, offset) reads x's *storage*, laid out as torch laid out x
    (decompositions restride to channels-last this way). When that layout is dense — a
    permutation of a contiguous one — x is stored in that order and the view reads it."""
    src = node.args[0].meta["val"]
    if x.ext is not None or any(not isinstance(s, int) for s in tuple(size) + tuple(stride)):
        raise LoweringError("as_strided over dynamic sizes is not supported")
    nd = len(x.shape)
    order = sorted(range(nd), key=lambda d: (-int(src.stride()[d]), d))
    permuted = [x.shape[d] for d in order]
    dense = all(int(src.stride()[d]) == s or x.shape[d] == 1
                for d, s in zip(order, contiguous_strides(permuted)))
    if not dense:
        raise LoweringError("as_strided of a tensor whose storage is not dense (overlapping or "
                            "with gaps) is not supported")
    stored = L.realize(views.permute(x, order) if nd else x)
    base = int(src.storage_offset())
    offset = (base if storage_offset is None else int(storage_offset)) - base
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    last = offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if min(size, default=1) > 0 and (offset < 0 or last >= max(math.prod(x.shape), 1)):
        raise LoweringError("as_strided reads outside its input's storage")
    buf = stored.expr.buf
    return TV(Load(buf, offset, tuple(stride)), size)
