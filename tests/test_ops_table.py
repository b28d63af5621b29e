"""The op table (aot/ops.py) is the one place pointwise ops are defined: every op the lowering
builds has a row, every row can be emitted, and the ATen overloads it names are the ones lowered."""
from __future__ import annotations

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

from grace.aot import codegen_expr, lower, ops  # noqa: E402
from grace.aot.ir import Op, walk  # noqa: E402
from grace.aot import lower_ops  # noqa: E402,F401  (registers the handlers)

AOT = pathlib.Path(codegen_expr.__file__).parent


def test_every_op_the_compiler_builds_has_a_row():
    built = set()
    for path in AOT.glob("*.py"):
        built |= set(re.findall(r'\bOp\("(\w+)"', path.read_text()))
    built |= {"floordiv", "truncdiv"}   # built from a variable in _div_mode
    assert built, "no Op(...) found: the pattern no longer matches the sources"
    assert built <= set(ops.POINTWISE), sorted(built - set(ops.POINTWISE))


def test_every_row_has_code():
    branches = set(re.findall(r'op == "(\w+)"', (AOT / "codegen_expr.py").read_text()))
    for name, row in ops.POINTWISE.items():
        assert (row.template or hasattr(codegen_expr.ExprEmitter, f"_op_{name}")
                or name in branches), f"{name}: no template, no _op_{name}, no branch"


def test_rows_cast_rules_and_costs_are_known():
    for row in ops.POINTWISE.values():
        assert row.operands in ("same", "float", "keep") and row.cost in ("cheap", "costly")
        assert row.aten_operands in ("result", "common", "self")


def test_the_aten_overloads_of_a_row_lower_to_it():
    for row in ops.POINTWISE.values():
        for name in row.aten:
            packet, overload = name.split(".")
            target = getattr(getattr(torch.ops.aten, packet), overload)
            assert target in lower.HANDLERS, f"{name} ({row.name}) has no handler"


def test_a_pointwise_model_lowers_through_the_table():
    from grace.aot.export import export_model, to_core_aten

    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.sigmoid(x) * y + torch.expm1(x) - (x < y).float()

    program = lower.lower(to_core_aten(export_model(M(), (torch.randn(4), torch.randn(4)))))
    names = {n.op for k in program.kernels for e in k.exprs() for n in walk(e)
             if isinstance(n, Op)}
    assert {"sigmoid", "mul", "expm1", "lt"} <= names
