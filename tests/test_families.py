"""Kernel families (aot/families.py): the registry covers every spec and template, a spec is a
checked contract (a missing, unknown or mistyped field fails where lowering builds the kernel),
the IR finds every expression of a spec, and the tile plans are decided once, by lowering, for
the multiprocessor count it is given."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from torch.export import Dim  # noqa: E402

from grace.aot import codegen, export, families, fuse, lower, memplan  # noqa: E402
from grace.aot.codegen import gemm_plan  # noqa: E402
from grace.aot.families import FAMILIES, LayerNorm, Pointwise, Scatter  # noqa: E402
from grace.aot.ir import Buffer, Const, Index, Kernel, Load, Spec, format_kernel  # noqa: E402
from grace.aot.views import contiguous_load  # noqa: E402

X = Buffer("x", "input", "float32", (4, 8), 1)
W = Buffer("w", "weight", "float32", (8,), 2)
OUT = Buffer("out", "arena", "float32", (4, 8), 3)
SMS = lower.DEFAULT_OPTIONS["sm_count"]


def _lowered(model, *inputs, options=None, dynamic_shapes=None, bound=None):
    """The lowering of one bucket: every size symbol at `bound`."""
    program = export.to_core_aten(export.export_model(model, inputs, dynamic_shapes))
    bucket = {s: bound for s in program.range_constraints} if dynamic_shapes else None
    return lower.lower(program, options=options, bucket=bucket)


def test_the_registry_names_every_spec_and_a_template_for_each():
    specs = {cls for _, cls in inspect.getmembers(families, inspect.isclass)
             if issubclass(cls, Spec) and cls.__module__ == families.__name__ and cls.family}
    assert {f.spec for f in FAMILIES.values()} == specs
    for name, family in FAMILIES.items():
        assert family.name == name == family.spec.family
        assert family.template is getattr(codegen, family.template.__name__)


def test_a_spec_is_a_checked_contract():
    src = Load(X, 0, (8, 1))
    with pytest.raises(TypeError, match="eps"):
        LayerNorm(src=src)                                   # a missing field
    with pytest.raises(TypeError, match="epsilon"):
        LayerNorm(src=src, eps=1e-5, epsilon=1e-5)           # an unknown one
    with pytest.raises(TypeError, match=r"LayerNorm.src must be an Expr, not TV"):
        LayerNorm(src=contiguous_load(X), eps=1e-5)          # a value, not its expression
    with pytest.raises(TypeError, match=r"LayerNorm.weight must be an Expr or None"):
        LayerNorm(src=src, eps=1e-5, weight=1.0)
    with pytest.raises(TypeError, match=r"Scatter.coords must be an Expr tuple"):
        Scatter(coords=[Index(0), Index(1)])
    with pytest.raises(TypeError, match="a kernel's spec is an ir.Spec"):
        Kernel({"src": src}, OUT, OUT.shape, src)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LayerNorm(src=src, eps=1e-5).eps = 0.1


def test_the_ir_finds_every_expression_of_a_spec():
    """Kernel.reads() walks every expression field (plain, optional, tuple) found by
    dataclasses.fields, so the memory plan and the graph's dependencies see every buffer; the IR
    printer shows every field."""
    k = Kernel(LayerNorm(src=Load(X, 0, (8, 1)), eps=1e-5, bias=Load(W, 0, (0, 1))),
               OUT, OUT.shape, Const(0.0, "float32"))
    assert [b.name for b in k.reads()] == ["x", "w"]
    text = format_kernel(k)
    for field in ("src", "eps", "weight", "bias"):
        assert f"    {field} " in text
    s = Kernel(Scatter(coords=(Index(0), Load(W, 0, (0, 1)))), OUT, (4, 8), Load(X, 0, (8, 1)))
    assert [name for name, _ in s.spec.exprs()] == ["coords[0]", "coords[1]"]
    assert [b.name for b in s.reads()] == ["x", "w"]


def test_the_registry_traits():
    k = Kernel(Pointwise(), OUT, (0, 8), Load(X, 0, (8, 1)))
    assert memplan.drop_empty([k]) == []   # writes no extents: an empty one is dropped
    assert FAMILIES["compact"].writes_extents and FAMILIES["to_extent"].writes_extents
    assert FAMILIES["scatter"].scatters and not FAMILIES["pointwise"].scatters


def test_the_gemm_plan_is_decided_once_by_lowering(monkeypatch):
    """Split-K: the plan lowering stored is the one codegen tiles by (codegen never plans)."""
    model = torch.nn.Sequential(torch.nn.Linear(4096, 64), torch.nn.ReLU())
    program = _lowered(model, torch.randn(4, 4096))
    kernels = memplan.drop_empty(fuse.fuse_epilogues(program.kernels))
    gemm = kernels[0]
    assert gemm.spec.plan == gemm_plan(4, 64, 4096, 1, 4, SMS) and gemm.spec.plan.split > 1
    assert gemm.spec.writes_partials
    assert kernels[1].spec.src_shape[0] == gemm.spec.plan.split   # the reduction of the partials

    def no_plan(*args):
        raise AssertionError("codegen planned again")

    monkeypatch.setattr(codegen, "gemm_plan", no_plan)
    monkeypatch.setattr(codegen, "attention_plan", no_plan)
    src = codegen.generate(gemm)
    assert src.grid[2] == gemm.spec.plan.split


def test_plans_follow_the_multiprocessor_count():
    """A part with fewer multiprocessors splits K less (its programs fill it sooner)."""
    model = torch.nn.Linear(65536, 64)
    plans = [_lowered(model, torch.randn(4, 65536), options={"sm_count": n}).kernels[0].spec.plan
             for n in (SMS, 8)]
    assert plans[0].split > plans[1].split >= 1


def test_a_dynamic_k_keeps_the_tiles_without_splitting():
    """Partial sums over a dynamic K are not taken: the plan is the static one with split 1."""
    class MM(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    k = Dim("k", min=1, max=4096)
    program = _lowered(MM(), torch.randn(4, 3000), torch.randn(3000, 32),
                       dynamic_shapes={"a": {1: k}, "b": {0: k}}, bound=4096)
    assert "reduction" not in [kk.family for kk in program.kernels]
    plan = program.kernels[0].spec.plan
    static = gemm_plan(4, 32, 4096, 1, 4, SMS)
    assert static.split > 1 and plan == dataclasses.replace(static, split=1)
