"""torch.compile(model, backend="grace") on the CPU: every Dynamo graph becomes a grace package run by
the CPU reference executor (Triton's interpreter), compared with eager; what grace cannot compile
runs eagerly after one GraceBackendWarning. The GPU twin is tests/gpu/test_backend_gpu.py."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import grace.aot  # noqa: E402,F401  (registers backend="grace")
from grace.aot import backend as B  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools import models  # noqa: E402

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()
    yield
    torch._dynamo.reset()


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(b.norm(), 1e-30))


class Graphs:
    """The GraceGraphs made since this object was: what grace served and built."""

    def __init__(self):
        self.before = list(B.compiled_graphs())  # held: a freed graph's id is reused

    def new(self) -> list:
        return [g for g in B.compiled_graphs() if not any(g is old for old in self.before)]


def grace_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, B.GraceBackendWarning)]


def run(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, grace_warnings(caught)


# ---- models that grace compiles -------------------------------------------------------------------


def test_mlp_matches_eager_and_is_served_by_grace():
    torch.manual_seed(0)
    model, graphs = models.MLP().eval(), Graphs()
    compiled = torch.compile(model, backend="grace")
    with torch.no_grad():
        for _ in range(2):   # fresh inputs, the same package
            x = torch.randn(8, 64)
            y, warned = run(compiled, x)
            assert not warned, warned
            assert y.shape == (8, 32) and y.dtype == torch.float32
            assert rel(y, model(x)) < 1e-5
    (g,) = graphs.new()
    assert g.calls == {"grace": 2, "eager": 0} and len(g.paths) == 1 and g.eager_reason is None
    man = read_package(g.paths[0]).manifest
    assert [i["name"] for i in man["inputs"]] == ["x"]
    # the parameters are the package's weights, not per-call inputs
    assert {w["name"] for w in man["weights"]} >= {"fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"}


def test_transformer_block_matches_eager():
    torch.manual_seed(0)
    model, graphs = models.LlamaBlock().eval(), Graphs()   # RMS norm, rotary, causal GQA SDPA, SwiGLU
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        y, warned = run(torch.compile(model, backend="grace"), x)
        ref = model(x)
    assert not warned, warned
    assert rel(y, ref) < 1e-4
    (g,) = graphs.new()
    assert g.calls["grace"] == 1
    names = {w["name"] for w in read_package(g.paths[0]).manifest["weights"]}
    assert {"attn_norm_weight", "cos", "sin"} <= names   # parameters, and buffers too


def test_torch_transformer_layer_fast_path_is_named_and_avoidable():
    """nn.TransformerEncoderLayer takes its fused inference fast path under Dynamo (not under
    torch.export): grace cannot lower that op, and the warning says how to keep the plain ops."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        y, warned = run(torch.compile(layer, backend="grace"), x)
        assert rel(y, layer(x)) < 1e-5
        assert len(warned) == 1 and "_transformer_encoder_layer_fwd" in warned[0]
        assert "torch.backends.mha.set_fastpath_enabled(False)" in warned[0]
        torch._dynamo.reset()
        graphs = Graphs()
        before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            y, warned = run(torch.compile(layer, backend="grace"), x)
        finally:
            torch.backends.mha.set_fastpath_enabled(before)
        assert not warned and rel(y, layer(x)) < 1e-4
    assert [g.calls for g in graphs.new()] == [{"grace": 1, "eager": 0}]


class WithBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = F.gelu(self.a(x))
        print("between the graphs")   # a graph break: the print runs eagerly
        return self.b(h) * 2


def test_a_graph_break_gives_two_graphs_both_served(capsys):
    torch.manual_seed(0)
    model, graphs = WithBreak().eval(), Graphs()
    x = torch.randn(4, 16)
    with torch.no_grad():
        y, warned = run(torch.compile(model, backend="grace"), x)
        ref = model(x)
    assert not warned, warned
    assert rel(y, ref) < 1e-5
    assert capsys.readouterr().out.count("between the graphs") == 2   # compiled run + eager ref
    new = graphs.new()
    assert len(new) == 2 and all(g.calls == {"grace": 1, "eager": 0} for g in new)


def test_several_outputs_keep_their_order_dtypes_and_shapes():
    def f(x, w):
        h = x @ w
        return h.relu(), h > 0, h.sum(-1), (h * 2).to(torch.float16)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.no_grad():
        got, warned = run(torch.compile(f, backend="grace"), x, w)
    assert not warned, warned
    for a, b in zip(got, f(x, w)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), atol=1e-5), (a, b)


# ---- dynamic sizes ------------------------------------------------------------------------------------


def test_mark_dynamic_is_served_from_buckets_without_recompiling():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, graphs = models.MLP().eval(), Graphs()
    compiled = torch.compile(model, backend="grace", options={"buckets": {"x.0": [4, 16]}})
    x = torch.randn(6, 64)
    torch._dynamo.mark_dynamic(x, 0)
    before = counters["stats"]["unique_graphs"]
    served = []
    with torch.no_grad():
        for n, bucket in ((6, "x.0=16"), (3, "x.0=4"), (13, "x.0=16"), (16, "x.0=16")):
            xn = x if n == 6 else torch.randn(n, 64)
            y, warned = run(compiled, xn)
            assert not warned, warned
            assert y.shape == (n, 32) and rel(y, model(xn)) < 1e-5
            (g,) = graphs.new()
            served.append((n, g.last_graph))
            assert g.last_graph == bucket, served
        assert counters["stats"]["unique_graphs"] - before == 1   # one Dynamo graph for every size
        assert g.calls == {"grace": 4, "eager": 0} and len(g.paths) == 1
        symbol = read_package(g.paths[0]).manifest["symbols"][0]
        assert (symbol["name"], symbol["max"]) == ("x.0", 16)
        # above the largest bucket: that call runs eagerly, with one warning for the graph
        for n in (20, 24):
            xn = torch.randn(n, 64)
            y, warned = run(compiled, xn)
            assert rel(y, model(xn)) < 1e-5
            if n == 20:
                assert len(warned) == 1 and "outside its buckets" in warned[0] and "x.0" in warned[0]
            else:
                assert not warned
    assert g.calls == {"grace": 4, "eager": 2}
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_range_export_refuses_is_inferred_instead(monkeypatch):
    """torch 2.11's export refused the Dim built from Dynamo's range for a LlamaBlock's sequence
    ('Constraints violated', on the H200): the backend exports again with Dim.AUTO and cuts the
    buckets to the range export found (LlamaBlock's rotary tables: at most 128)."""
    real = torch.export.export

    def picky(*args, **kwargs):
        shapes = kwargs.get("dynamic_shapes") or ()
        if any(type(v).__name__ != "_DimHint" for spec in shapes if spec for v in spec.values()):
            raise torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION,
                                              "Constraints violated (x_1)! (as torch 2.11 said)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", picky)
    torch.manual_seed(0)
    model, graphs = models.LlamaBlock().eval(), Graphs()
    compiled = torch.compile(model, backend="grace", options={"buckets": {"x.1": [16, 64, 512]}})
    x = torch.randn(1, 10, 64)
    torch._dynamo.mark_dynamic(x, 1)
    with torch.no_grad():
        for n, bucket in ((10, "x.1=16"), (40, "x.1=64")):
            xn = x if n == 10 else torch.randn(1, n, 64)
            y, warned = run(compiled, xn)
            assert not warned, warned
            assert rel(y, model(xn)) < 1e-5
            (g,) = graphs.new()
            assert g.last_graph == bucket
    symbol = read_package(g.paths[0]).manifest["symbols"][0]
    assert (symbol["name"], symbol["max"]) == ("x.1", 128)


def test_dynamo_ranges_and_automatic_dynamic_shapes():
    """mark_dynamic(max=) is the package's range (grace's default buckets up to it); automatic
    dynamic (a second size recompiles with a dynamic dim) is bounded by options['max_size']."""
    torch.manual_seed(0)
    model, graphs = models.MLP().eval(), Graphs()
    with torch.no_grad():
        x = torch.randn(5, 64)
        torch._dynamo.mark_dynamic(x, 0, min=2, max=32)
        y, warned = run(torch.compile(model, backend="grace"), x)
        assert not warned and rel(y, model(x)) < 1e-5
        (g,) = graphs.new()
        man = read_package(g.paths[0]).manifest
        assert (man["symbols"][0]["min"], man["symbols"][0]["max"]) == (2, 32)
        assert [gr["bucket"] for gr in man["graphs"]] == [{"x.0": 16}, {"x.0": 32}]

        torch._dynamo.reset()
        graphs = Graphs()
        auto = torch.compile(model, backend="grace", options={"max_size": 32})
        for n in (4, 9, 20):   # 4: a static graph; 9: Dynamo recompiles it with a dynamic dim 0
            xn = torch.randn(n, 64)
            y, warned = run(auto, xn)
            assert not warned and rel(y, model(xn)) < 1e-5
    by_symbols = {bool(read_package(g.paths[0]).manifest["symbols"]): g for g in graphs.new()}
    assert len(graphs.new()) == 2 and set(by_symbols) == {False, True}   # a static, a dynamic graph
    static, dynamic = by_symbols[False], by_symbols[True]
    assert static.calls == {"grace": 1, "eager": 0} and dynamic.calls == {"grace": 2, "eager": 0}
    assert read_package(dynamic.paths[0]).manifest["symbols"][0]["max"] == 32
    assert dynamic.last_graph == "x.0=32"


# ---- what grace does not compile: eager, one warning ------------------------------------------------


class Cosh(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cosh(self.fc(x))  # LINE_COSH


def test_an_unsupported_op_falls_back_with_one_warning_naming_it():
    torch.manual_seed(0)
    model, graphs = Cosh().eval(), Graphs()
    compiled = torch.compile(model, backend="grace")
    with torch.no_grad():
        x = torch.randn(3, 8)
        y, warned = run(compiled, x)
        assert rel(y, model(x)) < 1e-6
        assert len(warned) == 1, warned
        assert "runs eagerly" in warned[0] and "aten.cosh" in warned[0]
        line = next(i for i, t in enumerate(open(HERE), 1) if t.rstrip().endswith("# LINE_COSH"))
        assert f"test_backend.py\", line {line}" in warned[0], warned[0]   # the user's line
        x = torch.randn(3, 8)
        y, warned = run(compiled, x)   # the same graph again: eager, no new warning
        assert not warned and rel(y, model(x)) < 1e-6
    assert graphs.new() == []


def test_autograd_falls_back_and_keeps_the_gradient():
    torch.manual_seed(0)
    model = models.MLP()
    x = torch.randn(4, 64)
    y, warned = run(torch.compile(model, backend="grace"), x)   # grad mode on, parameters need grad
    assert len(warned) == 1 and "autograd" in warned[0] and "torch.no_grad()" in warned[0]
    assert y.grad_fn is not None and rel(y, model(x)) < 1e-6
    y.sum().backward()
    assert model.fc1.weight.grad is not None


def test_a_mutation_falls_back_and_is_applied():
    def f(x, acc):
        acc.add_(x)
        return acc * 2

    x, acc = torch.randn(4, 4), torch.zeros(4, 4)
    with torch.no_grad():
        y, warned = run(torch.compile(f, backend="grace"), x, acc)
    assert len(warned) == 1 and "mutates" in warned[0] and "acc" in warned[0]
    assert torch.equal(acc, x) and torch.equal(y, 2 * x)


@pytest.mark.parametrize("fn, words", [
    (lambda x: (x.t(), x * 2), ["output 0 aliases input x"]),
    (lambda x: (x * 2).view(-1).relu().view(4, 4).transpose(0, 1), []),   # a view of an intermediate: fine
    (lambda x: ((y := x + 1), y.view(-1)), ["output 1 aliases output 0"]),
])
def test_aliasing_outputs_fall_back(fn, words):
    x = torch.randn(4, 4)
    with torch.no_grad():
        y, warned = run(torch.compile(fn, backend="grace"), x)
    ref = fn(x)
    ref, y = (ref, y) if isinstance(ref, tuple) else ((ref,), (y,))
    assert all(torch.allclose(a, b) for a, b in zip(y, ref))
    if words:
        assert len(warned) == 1 and all(w in warned[0] for w in words), warned
    else:
        assert not warned, warned


def test_a_non_tensor_output_falls_back():
    def f(x):
        return x * 2, x.shape[0] * 3

    x = torch.randn(5, 4)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        (y, n), warned = run(torch.compile(f, backend="grace"), x)
    assert n == 15 and torch.equal(y, x * 2)
    assert len(warned) == 1 and "not a tensor" in warned[0], warned


# ---- weights: a snapshot, checked per call -------------------------------------------------------------


def test_weights_changed_in_place_are_compiled_again():
    torch.manual_seed(0)
    model, graphs = models.MLP().eval(), Graphs()
    compiled = torch.compile(model, backend="grace")
    x = torch.randn(2, 64)
    with torch.no_grad():
        run(compiled, x)
        model.fc2.bias.add_(1.0)   # what load_state_dict or an optimizer step does: a new version
        y, warned = run(compiled, x)
        assert rel(y, model(x)) < 1e-5
        assert len(warned) == 1 and "changed in place" in warned[0]
        model.fc1.weight.data = torch.randn(128, 64)   # the same Parameter, other memory
        y, warned = run(compiled, x)
        assert rel(y, model(x)) < 1e-5
        assert len(warned) == 1 and "changed in place" in warned[0]
        y, warned = run(compiled, x)   # unchanged since: the third package serves it
        assert not warned and rel(y, model(x)) < 1e-5
    (g,) = graphs.new()
    assert g.calls == {"grace": 4, "eager": 0} and len(g.paths) == 3


def test_the_per_call_check_uses_torchs_pointer_check_when_there_is_one(monkeypatch):
    """CUDA builds of torch have a C++ check of many data pointers (reduce-overhead's); the CPU
    build does not. With one, a weight's pointer is checked through it, with the same answers."""
    calls = []

    def ptrs_equal(tensors, ptrs, indices):
        calls.append(len(indices))
        return all(tensors[i].data_ptr() == ptrs[i] for i in indices)

    monkeypatch.setattr(torch._C, "_tensors_data_ptrs_at_indices_equal", ptrs_equal, raising=False)
    monkeypatch.setattr(B, "_POINTERS", {})
    w, b, x = nn.Parameter(torch.zeros(3)), torch.ones(2), torch.zeros(1)
    v = B._Variant(None, [1, 2], [w, b], [], None)
    assert v._ptrs_equal is ptrs_equal and v.serves((x, w, b))
    with torch.no_grad():
        w.data = torch.zeros(3)           # same object, same version, other memory
    assert not v.serves((x, w, b)) and v.same_tensors((x, w, b))
    assert not v.serves((x, nn.Parameter(torch.zeros(3)), b))   # another tensor
    assert calls and calls[-1] == 2


def test_two_instances_of_one_module_class_get_their_own_weights():
    torch.manual_seed(0)
    a, b, graphs = models.MLP().eval(), models.MLP().eval(), Graphs()
    ca, cb = torch.compile(a, backend="grace"), torch.compile(b, backend="grace")
    x = torch.randn(2, 64)
    with torch.no_grad():
        (ya, wa), (yb, wb) = run(ca, x), run(cb, x)
        assert not wa and not wb
        assert rel(ya, a(x)) < 1e-5 and rel(yb, b(x)) < 1e-5 and rel(ya, yb) > 1e-2
        assert rel(run(ca, x)[0], a(x)) < 1e-5   # back to the first instance's package
    assert sum(g.calls["grace"] for g in graphs.new()) == 3
    assert sum(len(g.paths) for g in graphs.new()) == 2


# ---- options ------------------------------------------------------------------------------------------


def test_options_reach_the_compiler(tmp_path):
    torch.manual_seed(0)
    model, graphs = models.MLP().eval(), Graphs()
    compiled = torch.compile(model, backend="grace", options={
        "fp32_matmul": "ieee", "archs": ["sm_80"], "cache_dir": str(tmp_path)})
    x = torch.randn(3, 64)
    with torch.no_grad():
        y, warned = run(compiled, x)
    assert not warned and rel(y, model(x)) < 1e-6
    (g,) = graphs.new()
    assert g.paths[0].parent == tmp_path and g.paths[0].exists()   # kept in cache_dir
    man = read_package(g.paths[0]).manifest
    assert man["options"]["fp32_matmul"] == "ieee" and man["archs"] == ["sm_80"]


@pytest.mark.parametrize("options, words", [
    ({"bucket": {"x.0": [8]}}, ["unknown option", "bucket", "buckets"]),
    ({"fp32_matmul": "fp16"}, ["fp32_matmul", "tf32x3"]),
    ({"buckets": {"x.0": [0, 8]}}, ["buckets['x.0']", "positive"]),
    ({"archs": ["sm_70"]}, ["sm_70"]),
    ({"max_size": 0}, ["max_size"]),
])
def test_bad_options_are_errors_not_fallbacks(options, words):
    with pytest.raises(Exception) as info:
        with torch.no_grad():
            torch.compile(models.MLP().eval(), backend="grace", options=options)(torch.randn(2, 64))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_backend_options_parse():
    opts = B.BackendOptions.parse({"buckets": {"x.1": [64, 16, 64]}, "pdl": True, "archs": "sm_90"})
    assert opts.buckets == (("x.1", (16, 64)),) and opts.pdl and opts.archs == ("sm_90",)
    assert B.BackendOptions.parse(None) == B.BackendOptions()


# ---- registration -------------------------------------------------------------------------------------


def test_the_entry_point_finds_the_backend_without_importing_grace(tmp_path):
    """pyproject.toml's torch_dynamo_backends entry point: torch's lookup of backend="grace" in a
    process that never imported grace imports it (torch.compile does that lookup), and
    `import grace.aot` afterwards registers nothing twice."""
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert not [m for m in sys.modules if m == 'grace' or m.startswith('grace.')]\n"
        "fn = lookup_backend('grace')\n"
        "import grace.aot\n"
        "from grace.aot.backend import grace_backend\n"
        "assert fn is grace_backend and lookup_backend('grace') is grace_backend\n"
        "assert 'grace' in torch._dynamo.list_backends()\n"
        "print('ENTRY_POINT_OK')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 0 and "ENTRY_POINT_OK" in r.stdout, r.stdout + r.stderr
