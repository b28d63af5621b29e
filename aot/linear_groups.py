"""Sibling linear layers: projections that multiply the same rows by weights of their own (a
Llama MLP's gate and up projections, Hugging Face attention's separate q, k and v) become one
GEMM over the weights concatenated at compile time, read back as column slices.

Why: in a decode step each projection is a GEMV that streams its weights once, and two GEMVs of
the same row cost two kernel boundaries and two passes over the row where one will do; the row
they share no longer needs storing either (it is recomputed inside the one GEMV). The grouping
depends only on the graph, not on the bucket, so every bucket lowers to the same weights.

The pattern, in core ATen as torch.export writes `nn.Linear`:
    rows = view(x, [M, K])                  (or x itself when it is 2-D)
    y_i  = mm(rows, permute(W_i, [1, 0]))   or addmm(b_i, rows, permute(W_i, [1, 0]))
with every W_i (and b_i) a weight that nothing else reads, all of one dtype and K.
"""
from __future__ import annotations

from typing import Callable

import torch

aten = torch.ops.aten


def _rows(mm: torch.fx.Node):
    """(the value whose rows `mm` multiplies, the view shape or None)."""
    a = mm.args[0] if mm.target == aten.mm.default else mm.args[1]
    if a.op == "call_function" and a.target == aten.view.default:
        return a.args[0], tuple(a.args[1])
    return a, None


def _sole_weight(node, is_weight: Callable) -> bool:
    return isinstance(node, torch.fx.Node) and is_weight(node) and len(node.users) == 1


def projection(mm: torch.fx.Node, is_weight: Callable):
    """(weight node, bias node or None) when `mm` is a linear layer over weights it alone reads."""
    if mm.op != "call_function" or mm.target not in (aten.mm.default, aten.addmm.default):
        return None
    if mm.target == aten.addmm.default and (mm.kwargs or len(mm.args) > 3):
        return None   # beta / alpha
    t = mm.args[1] if mm.target == aten.mm.default else mm.args[2]
    if (not isinstance(t, torch.fx.Node) or t.target != aten.permute.default
            or list(t.args[1]) != [1, 0] or len(t.users) != 1 or not _sole_weight(t.args[0], is_weight)):
        return None
    bias = mm.args[0] if mm.target == aten.addmm.default else None
    if bias is not None and not _sole_weight(bias, is_weight):
        return None
    return t.args[0], bias


def group_of(mm: torch.fx.Node, is_weight: Callable) -> list[torch.fx.Node]:
    """The linear layers (in graph order, `mm` among them) that share `mm`'s rows; [] when
    there are not two, or they differ in kind (with / without bias) or weight dtype and K."""
    if projection(mm, is_weight) is None:
        return []
    src, shape = _rows(mm)
    found = []
    for user in src.users:
        mms = list(user.users) if (shape is not None and user.target == aten.view.default
                                   and tuple(user.args[1]) == shape) else [user]
        found += [m for m in mms if projection(m, is_weight) is not None and _rows(m) == (src, shape)]
    found = [n for n in mm.graph.nodes if n in set(found)]   # graph order
    if len(found) < 2:
        return []
    metas = {(m.target, projection(m, is_weight)[0].meta["val"].dtype,
              projection(m, is_weight)[0].meta["val"].shape[1]) for m in found}
    return found if len(metas) == 1 else []


def feeds_one_group(node: torch.fx.Node, is_weight: Callable) -> bool:
    """Every reader of `node` is (a view into) one group of sibling linear layers: the value is
    read once, by the fused GEMM, so it need not be stored for its several readers."""
    group = None
    for user in node.users:
        mms = list(user.users) if user.target == aten.view.default else [user]
        for m in mms:
            g = group_of(m, is_weight) if m.op == "call_function" else []
            if not g or (group is not None and g != group):
                return False
            group = g
    return group is not None
