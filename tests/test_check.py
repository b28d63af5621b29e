"""grace.aot.check (`grace check`): every op the compiler cannot lower, at once, with the user's line.

The ground truth is the compiler itself: `compiles_up_to_build` runs grace.aot.compile_program
with the build stage replaced by a stop, so "the compiler lowers it" means every stage before
the Triton build passed (decomposition, symbols, lowering of every bucket, fusion, memory plan,
codegen, argument table) — what check() claims without building anything.
"""
from __future__ import annotations

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from grace.aot import build, compiler  # noqa: E402
from grace.aot import check as grace_check  # noqa: E402  (the function)
from grace.aot.check import CheckReport, Frame, relocate, user_frame, user_location  # noqa: E402
from grace.aot.lower import LoweringError  # noqa: E402
from grace.tools import models  # noqa: E402

HERE = os.path.abspath(__file__)


# ---- models: the lines below are what the report must point at ---------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.ELU()              # aten.elu: no lowering
        self.norm = nn.GroupNorm(4, 16)  # aten.native_group_norm: no lowering

    def forward(self, x):
        y = self.act(self.fc(x))  # LINE_ACT
        y = self.norm(y.unsqueeze(-1)).squeeze(-1)  # LINE_NORM
        return torch.cosh(y) + torch.tan(x)  # LINE_COSH


class Unsupported(nn.Module):
    """Five ops that are not lowered (docs/op-conformance.md's not_lowered list), three of them
    twice, two of them inside nn modules."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2 = Block(), Block()

    def forward(self, x):
        return torch.log10(self.b2(self.b1(x)).abs())  # LINE_LOG10


def _line(tag: str) -> int:
    with open(HERE, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {tag}"):
                return i
    raise AssertionError(tag)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)  # LINE_FN


def export(model, *xs, dynamic_shapes=None):
    return torch.export.export(model.eval(), xs, dynamic_shapes=dynamic_shapes)


class _ReachedBuild(Exception):
    pass


def compiles_up_to_build(ep, monkeypatch, tmp_path, buckets=None):
    """None when the compiler gets as far as building kernels; else the compile error."""
    def stop(*a, **k):
        raise _ReachedBuild()

    monkeypatch.setattr(compiler, "_build_with_progress", stop)
    options = compiler.CompileOptions(
        buckets=tuple((k, tuple(v)) for k, v in (buckets or {}).items()))
    try:
        compiler.compile_program(ep, tmp_path / "m.grace", "m", options)
    except _ReachedBuild:
        return None
    except LoweringError as exc:
        return exc
    raise AssertionError("compile_program wrote a package although the build was stopped")


@pytest.fixture
def no_build(monkeypatch):
    """check() must build nothing: any Triton build fails the test."""
    def refuse(*a, **k):
        raise AssertionError("check() built a kernel")

    monkeypatch.setattr(build, "compile_all", refuse)
    monkeypatch.setattr(build, "compile_one", refuse)
    import triton
    monkeypatch.setattr(triton, "compile", refuse)


# ---- several unsupported ops at once ----------------------------------------------------------------


def test_every_unsupported_op_once_with_count_and_user_line(no_build):
    ep = export(Unsupported(), torch.randn(4, 16))
    t0 = time.perf_counter()
    report = grace_check(ep, name="unsupported")
    seconds = time.perf_counter() - t0
    assert isinstance(report, CheckReport) and not report.ok
    by_op = {p.op: p for p in report.problems}
    assert set(by_op) == {"aten.elu.default", "aten.native_group_norm.default", "aten.cosh.default",
                          "aten.tan.default", "aten.log10.default"}
    assert [by_op[o].count for o in ("aten.elu.default", "aten.native_group_norm.default",
                                     "aten.cosh.default", "aten.tan.default",
                                     "aten.log10.default")] == [2, 2, 2, 2, 1]
    # the user's line, not torch/nn/modules/activation.py or normalization.py
    expect = {"aten.elu.default": "LINE_ACT", "aten.native_group_norm.default": "LINE_NORM",
              "aten.cosh.default": "LINE_COSH", "aten.tan.default": "LINE_COSH",
              "aten.log10.default": "LINE_LOG10"}
    for op, tag in expect.items():
        p = by_op[op]
        assert p.locations == [f'File "{HERE}", line {_line(tag)}, in forward: '
                               + _source(_line(tag))], (op, p.locations)
        assert p.reasons == ["no lowering for this op"] and not p.internal
    assert not any("torch/nn" in loc for p in report.problems for loc in p.locations)
    assert seconds < 20   # about 1 s on 2 busy cores (decomposition is most of it)
    text = report.format()
    assert "5 ops cannot be lowered" in text and "aten.elu.default ×2" in text
    assert f"line {_line('LINE_NORM')}" in text


def _source(lineno: int) -> str:
    with open(HERE, encoding="utf-8") as f:
        return f.read().splitlines()[lineno - 1].strip()


def test_the_compiler_agrees_and_its_error_names_the_user_line(monkeypatch, tmp_path):
    """The compile stops at the first of those ops; its "used at" is the user's line too (the
    innermost frame outside torch), not torch/nn/modules/activation.py."""
    ep = export(Unsupported(), torch.randn(4, 16))
    err = compiles_up_to_build(ep, monkeypatch, tmp_path)
    assert err is not None
    msg = str(err)
    assert "cannot lower aten.elu.default" in msg
    assert f'used at File "{HERE}", line {_line("LINE_ACT")}, in forward' in msg
    assert "torch/nn/modules" not in msg
    first = grace_check(ep).problems[0]
    assert first.op == "aten.elu.default"


def test_the_check_json_round_trips():
    report = grace_check(export(Unsupported(), torch.randn(4, 16)), name="u")
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is False and d["model"] == "u" and d["graphs"] == 1
    assert d["ops"] >= 20 and d["distinct_ops"] < d["ops"]
    elu = next(p for p in d["problems"] if p["op"] == "aten.elu.default")
    assert elu["count"] == 2 and elu["nodes"] == ["elu", "elu_1"] and len(elu["locations"]) == 1


# ---- check ok <=> the compiler lowers it ------------------------------------------------------------


REFUSED = {
    # handlers that exist but refuse these arguments
    "sort_too_long": (lambda x: torch.sort(x, dim=-1)[0], (torch.randn(2, 8000),),
                      "aten.sort.default", "at most 4096"),
    "max_pool_indices": (lambda x: F.max_pool2d(x, 2, return_indices=True), (torch.randn(1, 2, 4, 4),),
                         "aten.max_pool2d_with_indices.default", "indices"),
    "attention_dropout": (lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
                          (torch.randn(1, 2, 8, 16),), "aten.scaled_dot_product_attention.default",
                          "dropout"),
    # refused by kernel source generation, after lowering
    "std_all_dims": (lambda x: torch.std(x, dim=(0, 1, 2)), (torch.randn(5, 5, 5),),
                     "aten.var.correction", "cannot evaluate the size"),
    # a dtype the compiler has no lowering for, downstream of an op without a handler
    "complex": (lambda x: torch.view_as_real(torch.view_as_complex(x) * 2), (torch.randn(4, 2),),
                "aten.view_as_complex.default", "no lowering"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_compiler_refuses_check_reports(name, monkeypatch, tmp_path, no_build):
    fn, xs, op, words = REFUSED[name]
    ep = export(Fn(fn), *xs)
    report = grace_check(ep)
    assert not report.ok
    p = next((p for p in report.problems if p.op == op), None)
    assert p is not None, report.format()
    assert any(words in r for r in p.reasons), p.reasons
    assert p.locations == [f'File "{HERE}", line {_line("LINE_FN")}, in forward: '
                           "return self.fn(*xs)  # LINE_FN"]
    monkeypatch.undo()   # the compiler may build again (it is stopped before it does)
    assert compiles_up_to_build(ep, monkeypatch, tmp_path) is not None


def _supported_cases():
    seq = torch.export.Dim("seq", min=1, max=128)
    return {
        "mlp": lambda: export(models.MLP(), torch.randn(3, 64)),
        "llama_block_dynamic": lambda: export(models.LlamaBlock(), torch.randn(1, 32, 64),
                                              dynamic_shapes={"x": {1: seq}}),
        "tiny_vit": lambda: export(models.TinyViT(), torch.randn(2, 3, 32, 32)),
        "sort_short_rows": lambda: export(Fn(lambda x: torch.sort(x, dim=-1)[0]), torch.randn(2, 100)),
    }


@pytest.mark.parametrize("name", sorted(_supported_cases()))
def test_a_supported_model_checks_ok_and_lowers(name, monkeypatch, tmp_path, no_build):
    ep = _supported_cases()[name]()
    report = grace_check(ep)
    assert report.ok, report.format()
    assert report.problems == [] and "every op can be lowered" in report.format()
    monkeypatch.undo()
    assert compiles_up_to_build(ep, monkeypatch, tmp_path) is None


class Sort(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1)[0]


def test_every_bucket_is_checked(monkeypatch, tmp_path, no_build):
    """A sort over a dynamic dimension of up to 8000 lowers in the buckets up to 4096 and not in
    the last one: the check lowers every bucket, as the compiler does."""
    n = torch.export.Dim("n", min=2, max=8000)
    ep = export(Sort(), torch.randn(2, 64), dynamic_shapes={"x": {1: n}})
    report = grace_check(ep)
    assert not report.ok and report.graphs == 10   # 16, 32, ..., 4096, 8000
    (p,) = report.problems
    assert p.op == "aten.sort.default" and p.count == 1 and "8000" in p.reasons[0]
    # the buckets a compile would use: here only the last one is refused
    assert not grace_check(ep, buckets={"x.1": [4096, 8000]}).ok
    assert grace_check(ep, buckets={"x.1": [4096, 8000]}).graphs == 2
    monkeypatch.undo()
    assert compiles_up_to_build(ep, monkeypatch, tmp_path) is not None
    small = export(Sort(), torch.randn(2, 64),
                   dynamic_shapes={"x": {1: torch.export.Dim("n", min=2, max=4096)}})
    assert grace_check(small).ok
    assert compiles_up_to_build(small, monkeypatch, tmp_path) is None


def test_program_level_problems_and_the_ops_behind_them(no_build):
    """A program that mutates its input stops the walk before any op; the ops without a lowering
    are still named (the handler table), with the program's problem first."""
    ep = export(Fn(lambda x: x.add_(1).cosh()), torch.randn(4))
    report = grace_check(ep)
    assert not report.ok
    assert report.problems[0].op is None and "mutates its inputs" in report.problems[0].reasons[0]
    assert [p.op for p in report.problems[1:]] == ["aten.cosh.default"]
    assert "(program)" in report.format()


def test_bad_buckets_are_a_problem_not_a_crash():
    n = torch.export.Dim("n", min=2, max=64)
    ep = export(models.MLP(), torch.randn(4, 64), dynamic_shapes=({0: n},))
    report = grace_check(ep, buckets={"nope": [8, 64]})
    assert not report.ok and report.problems[0].op is None
    assert "nope" in report.problems[0].reasons[0]


def test_check_takes_an_nn_module():
    report = grace_check(models.MLP(), (torch.randn(3, 64),))
    assert report.ok and report.name == "MLP"
    with pytest.raises(ValueError, match="example_inputs"):
        grace_check(models.MLP())
    with pytest.raises(TypeError):
        grace_check("model.pt2")


class _Keywords(nn.Module):
    """An unsupported op (cosh) on a path only a keyword argument takes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask=None, gate=None):
        h = self.proj(x)
        if mask is not None:
            h = h * mask
        if gate is not None:
            h = h * torch.cosh(gate)  # LINE_GATE
        return h


def test_check_takes_kwargs_like_compile(no_build):
    """check(model, args, kwargs=...) exports what compile(model, args, kwargs=...) exports: the
    keyword inputs are real inputs (their ops are checked), a None argument is no input, and a
    Dim on a keyword input names the symbol."""
    model, x = _Keywords(), torch.randn(2, 5, 8)
    assert grace_check(model, (x,)).ok                       # gate=None: the cosh is never traced
    assert grace_check(model, (x,), kwargs={"mask": torch.ones(2, 5, 8)}).ok
    report = grace_check(model, (x, None), kwargs={"gate": torch.randn(2, 5, 8)})
    assert [p.op for p in report.problems] == ["aten.cosh.default"]
    assert report.problems[0].locations == [
        f'File "{HERE}", line {_line("LINE_GATE")}, in forward: {_source(_line("LINE_GATE"))}']
    # keyword inputs only, with a dynamic dimension named by its Dim
    n = torch.export.Dim("n", min=2, max=32)
    report = grace_check(model, kwargs={"x": x, "mask": torch.ones(2, 5, 8)},
                         dynamic_shapes={"x": {1: n}, "mask": {1: n}}, buckets={"n": [8, 32]})
    assert report.ok and report.graphs == 2
    report = grace_check(model, kwargs={"x": x}, dynamic_shapes={"x": {1: n}},
                         buckets={"seq": [32]})
    reason = report.problems[0].reasons[0]
    assert not report.ok and reason.endswith("dynamic dimensions are: n"), reason   # not x.1
    with pytest.raises(ValueError, match="example_inputs"):
        grace_check(model, kwargs={})


# ---- the source location helper -----------------------------------------------------------------------


class _Node:
    def __init__(self, trace):
        self.meta = {"stack_trace": trace}


def test_user_frame_skips_torch_frames():
    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "activation.py")
    trace = (f'  File "/home/u/model.py", line 17, in forward\n    return self.b(x)\n'
             f'  File "/home/u/block.py", line 9, in forward\n    y = self.act(x)\n'
             f'  File "{torch_file}", line 500, in forward\n    return F.elu(input)\n')
    frame = user_frame(_Node(trace))
    assert frame == Frame("/home/u/block.py", 9, "forward", "y = self.act(x)")
    assert str(frame) == 'File "/home/u/block.py", line 9, in forward: y = self.act(x)'
    only_torch = f'  File "{torch_file}", line 500, in forward\n    return F.elu(input)\n'
    assert user_frame(_Node(only_torch)).file == torch_file   # nothing else: the innermost
    assert user_frame(_Node(None)) is None
    assert user_location(_Node("")) == "(no source location recorded)"


def test_relocate_rewrites_only_a_torch_location():
    ep = export(Unsupported(), torch.randn(4, 16))
    core = compiler.decompose(ep)
    node = next(n for n in core.graph_module.graph.nodes if n.name == "elu")
    from grace.aot.lower import source_line

    exc = LoweringError(f"cannot lower aten.elu.default (node 'elu'), used at {source_line(node)}")
    assert "activation.py" in str(exc)
    relocate(exc, core)
    assert str(exc) == (f"cannot lower aten.elu.default (node 'elu'), used at "
                        f'File "{HERE}", line {_line("LINE_ACT")}, in forward: {_source(_line("LINE_ACT"))}')
    other = LoweringError("buckets of x must be positive")
    assert str(relocate(other, core)) == "buckets of x must be positive"
