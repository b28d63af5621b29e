"""The pointwise ops of the kernel IR: one table of what each `Op(name, ...)` means, read by every
stage that needs to know — lowering (which ATen overloads become the op, in which dtype its
operands are compared), the IR's cost model (`ir.is_cheap`: recompute per tile, or compute once)
and codegen (the Triton code and how operands are cast before it).

Before this table the same facts lived in four places (the ATen maps of lower_ops, the templates
and the two cast-rule sets of codegen_expr, the cost set of ir) and drifted apart. Adding a
pointwise op is one row here; an op whose code needs more than one line also gets an
`ExprEmitter._op_<name>` method in codegen_expr (the row's `template`, if any, is its fallback).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PointwiseOp:
    name: str
    # Triton code over the operand variables {0}, {1}, {2}; None: only ExprEmitter._op_<name>
    template: str | None = None
    # how operands are cast before the code: "same" — to the result's compute type (arithmetic);
    # "float" — integer operands to fp32 (transcendentals); "keep" — as they come (comparisons,
    # bit ops, where's condition, casts)
    operands: str = "keep"
    # "costly": a value containing it is computed once into memory rather than recomputed in
    # every tile that reads it (ir.is_cheap), and is worth storing when it has several readers
    cost: str = "cheap"
    # ATen overloads lowered directly to this op (lower_ops registers the handlers), with the
    # dtype their operands are read in: "result" (the node's dtype), "common" (torch's promoted
    # type of the two operands: comparisons), "self" (the first operand's own dtype)
    aten: tuple[str, ...] = ()
    aten_operands: str = "result"


_ROWS = [
    # arithmetic
    PointwiseOp("add", "{0} + {1}", "same"),
    PointwiseOp("sub", "{0} - {1}", "same"),
    PointwiseOp("mul", "{0} * {1}", "same", aten=("mul.Tensor", "mul.Scalar")),
    PointwiseOp("div", "{0} / {1}", "same", "costly", aten=("div.Tensor", "div.Scalar")),
    PointwiseOp("floordiv", None, "same"),
    PointwiseOp("truncdiv", None, "same"),
    PointwiseOp("fmod", "{0} % {1}", "same", aten=("fmod.Tensor", "fmod.Scalar")),
    PointwiseOp("remainder", None, "same", aten=("remainder.Tensor", "remainder.Scalar")),
    PointwiseOp("neg", "-{0}", "same", aten=("neg.default",)),
    PointwiseOp("maximum", "tl.maximum({0}, {1})", "same", aten=("maximum.default",)),
    PointwiseOp("minimum", "tl.minimum({0}, {1})", "same", aten=("minimum.default",)),
    PointwiseOp("abs", "tl.abs({0})", aten=("abs.default",)),
    PointwiseOp("relu", "tl.maximum({0}, 0)", aten=("relu.default",)),
    PointwiseOp("sign", None, aten=("sign.default",)),
    PointwiseOp("reciprocal", "1.0 / {0}", "float", aten=("reciprocal.default",)),
    PointwiseOp("pow", None, "float", "costly"),
    # rounding
    PointwiseOp("floor", "tl.floor({0})", aten=("floor.default",)),
    PointwiseOp("ceil", "tl.ceil({0})", aten=("ceil.default",)),
    PointwiseOp("trunc", "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))", aten=("trunc.default",)),
    PointwiseOp("round", None, aten=("round.default",)),
    # transcendentals
    PointwiseOp("exp", "tl.exp({0})", "float", "costly", aten=("exp.default",)),
    PointwiseOp("expm1", None, "float", "costly", aten=("expm1.default",)),
    PointwiseOp("log", "tl.log({0})", "float", "costly", aten=("log.default",)),
    PointwiseOp("log1p", None, "float", "costly", aten=("log1p.default",)),
    PointwiseOp("sqrt", "tl.sqrt({0})", "float", "costly", aten=("sqrt.default",)),
    PointwiseOp("rsqrt", "tl.rsqrt({0})", "float", "costly", aten=("rsqrt.default",)),
    PointwiseOp("sin", "tl.sin({0})", "float", "costly", aten=("sin.default",)),
    PointwiseOp("cos", "tl.cos({0})", "float", "costly", aten=("cos.default",)),
    PointwiseOp("tanh", None, "float", "costly", aten=("tanh.default",)),
    PointwiseOp("erf", "tl.erf({0})", "float", "costly", aten=("erf.default",)),
    PointwiseOp("sigmoid", "tl.sigmoid({0})", "float", "costly", aten=("sigmoid.default",)),
    PointwiseOp("silu", "{0} * tl.sigmoid({0})", "float", "costly", aten=("silu.default",)),
    PointwiseOp("gelu", None, "float", "costly"),
    # logic and comparisons
    PointwiseOp("and", "{0} & {1}", aten=("bitwise_and.Tensor", "logical_and.default")),
    PointwiseOp("or", "{0} | {1}", aten=("bitwise_or.Tensor", "logical_or.default")),
    PointwiseOp("xor", "{0} ^ {1}", aten=("bitwise_xor.Tensor", "logical_xor.default")),
    PointwiseOp("not", None),  # logical: x == 0 (bool: x ^ 1)
    PointwiseOp("bitnot", None),  # bitwise_not of an integer (of a bool it is "not")
    PointwiseOp("eq", "{0} == {1}", aten=("eq.Tensor", "eq.Scalar"), aten_operands="common"),
    PointwiseOp("ne", "{0} != {1}", aten=("ne.Tensor", "ne.Scalar"), aten_operands="common"),
    PointwiseOp("lt", "{0} < {1}", aten=("lt.Tensor", "lt.Scalar"), aten_operands="common"),
    PointwiseOp("le", "{0} <= {1}", aten=("le.Tensor", "le.Scalar"), aten_operands="common"),
    PointwiseOp("gt", "{0} > {1}", aten=("gt.Tensor", "gt.Scalar"), aten_operands="common"),
    PointwiseOp("ge", "{0} >= {1}", aten=("ge.Tensor", "ge.Scalar"), aten_operands="common"),
    PointwiseOp("isnan", "{0} != {0}"),
    PointwiseOp("where", "tl.where({0}, {1}, {2})"),
    # conversions and checks
    PointwiseOp("cast", None),
    PointwiseOp("check_index", None),   # a gather index clamped into range, violations flagged
]

POINTWISE: dict[str, PointwiseOp] = {row.name: row for row in _ROWS}

# the views of the table each consumer reads
TEMPLATES = {n: r.template for n, r in POINTWISE.items() if r.template is not None}
SAME_TYPE_OPERANDS = frozenset(n for n, r in POINTWISE.items() if r.operands == "same")
FLOAT_OPERANDS = frozenset(n for n, r in POINTWISE.items() if r.operands == "float")
COSTLY = frozenset(n for n, r in POINTWISE.items() if r.cost == "costly")
