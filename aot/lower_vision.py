"""ATen handlers for vision models: convolutions, batch norm, pooling, resampling and the index
shuffles CNNs use (flip, repeat, diagonal, unfold)."""
from __future__ import annotations

import torch

from .ir import Const, DimMap, Index, Op, Reindex
from .lower import LoweringError, handles
from .lower_ops import _matmul
from .views import TV
from . import views

aten = torch.ops.aten


@handles(aten.convolution.default)
def _convolution(L, node, x, w, bias, stride, padding, dilation, transposed, output_padding,
                 groups):
    """2-D convolution as im2col + GEMM (bias fused into the GEMM's epilogue)."""
    shape, dtype = L.out_meta(node)
    if transposed or groups != 1 or len(x.shape) != 4:
        raise LoweringError("only 2-D, non-transposed, groups=1 convolutions are supported")
    if x.ext is not None:
        raise LoweringError("convolution over dynamic dimensions is not supported")
    nb, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    _, _, oh, ow = shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    # window: [N, OH, OW, C, KH, KW] -> x[n, c, oh*sh + kh*dh - ph, ow*sw + kw*dw - pw]
    def axis(out_dim, k_dim, s, d, p):
        e = Op("add", [Op("mul", [Index(out_dim), Const(s, "int64")], "int64"),
                       Op("mul", [Index(k_dim), Const(d, "int64")], "int64")], "int64")
        return DimMap("expr", expr=Op("sub", [e, Const(p, "int64")], "int64"))
    maps = [DimMap("dim", 0), DimMap("dim", 3), axis(1, 4, sh, dh, ph), axis(2, 5, sw, dw, pw)]
    window = TV(Reindex(x.expr, maps, bounds=x.shape, fill=0.0), (nb, oh, ow, c, kh, kw))
    cols = L.realize(views.view(window, (nb * oh * ow, c * kh * kw)))
    wmat = views.permute(views.view(w, (o, c * kh * kw)), [1, 0])
    bias_fn = None
    if bias is not None:
        def bias_fn(acc, out_shape):
            b = views.expand(views.view(bias, (1, 1, o)), out_shape).expr
            return Op("add", [acc, b if bias.dtype == "float32" else Op("cast", [b], "float32")],
                      "float32")
    fake = _FakeNode((nb * oh * ow, o), dtype)
    out = _matmul(L, fake, cols, wmat, bias_fn)
    return views.permute(views.view(out, (nb, oh, ow, o)), [0, 3, 1, 2])


class _FakeNode:
    """Lets an op handler call another handler for an intermediate result shape."""

    def __init__(self, shape, dtype):
        self.meta = {"val": torch.empty(shape, dtype=getattr(torch, dtype), device="meta")}


