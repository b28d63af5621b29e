"""torch.compile(model, backend="grace") on the H200: the GPU suite's models (tests/gpu/test_models_gpu.py,
same tolerances) through Dynamo, each graph compiled in process and served by the real runtime with
CUDA graphs, zero-copy torch tensors in and out, compared with eager. Every call must be served by
grace (no GraceBackendWarning, no eager call): a fallback would match eager trivially.

Run on the H200 with `pytest -m gpu tests/gpu/test_backend_gpu.py`.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import grace.aot  # noqa: E402,F401  (registers backend="grace")
from grace.aot import backend as B  # noqa: E402

try:
    from test_models_gpu import CASES   # the GPU suite's models and tolerances
except ImportError:  # tests/ imported as a package
    from tests.gpu.test_models_gpu import CASES


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class Graphs:
    """The GraceGraphs made since this object was: the earlier ones are held, not just their ids
    (a freed graph's id is reused by the next one CPython allocates at that address)."""

    def __init__(self):
        self.before = list(B.compiled_graphs())

    def new(self) -> list:
        return [g for g in B.compiled_graphs() if not any(g is old for old in self.before)]


def _served_by_grace(graphs: Graphs, caught, calls: int) -> list:
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, B.GraceBackendWarning)]
    assert not fallbacks, fallbacks
    new = graphs.new()
    assert new, "no graph went through grace"
    assert all(g.calls["eager"] == 0 for g in new), [(g.label, g.calls, g.eager_reason) for g in new]
    assert sum(g.calls["grace"] for g in new) >= calls
    return new


def _reference(model, x, dtype: str):
    """The suite's reference: fp64 eager for fp32 models, fp32 eager of the same weights for bf16,
    on a CPU copy (converting the compiled model itself would swap its parameters' memory)."""
    ref_model = copy.deepcopy(model).cpu()
    x = x.cpu()
    with torch.no_grad():
        if dtype == "float32":
            return ref_model.double()(x.double() if x.is_floating_point() else x).float().numpy()
        return ref_model.float()(x.float() if x.is_floating_point() else x).float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_eager(case, dtype):
    make_model, make_input, tol32, tol16 = CASES[case]
    torch.manual_seed(0)
    model = make_model().eval().cuda()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    compiled = torch.compile(model, backend="grace")
    graphs = Graphs()
    tol = tol32 if dtype == "float32" else tol16
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for trial in range(2):   # fresh inputs, the same package and graph
            x = make_input()
            if dtype == "bfloat16" and x.is_floating_point():
                x = x.to(torch.bfloat16)
            x = x.cuda()
            out = compiled(x)
            assert isinstance(out, torch.Tensor) and out.is_cuda
            got = out.float().cpu().numpy()
            assert not np.isnan(got).any(), f"{case}/{dtype}: NaN in output"
            err = _rel(got, _reference(model, x, dtype))
            print(f"backend {case} {dtype} trial {trial}: rel err {err:.2e}")
            assert err <= tol, f"{case}/{dtype}: relative error {err:.3e} > {tol}"
    new = _served_by_grace(graphs, caught, calls=2)
    print(f"backend {case} {dtype}: {len(new)} graph(s), packages "
          f"{[p.name for g in new for p in g.paths]}")


def test_backend_dynamic_sequence_is_served_from_buckets():
    """mark_dynamic on the sequence: one Dynamo graph, one package, every length from its buckets."""
    from torch._dynamo.utils import counters

    make_model, make_input, tol32, _ = CASES["llama_block"]
    torch.manual_seed(0)
    model = make_model().eval().cuda()
    compiled = torch.compile(model, backend="grace", options={"buckets": {"x.1": [64, 128]}})
    graphs = Graphs()
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n, bucket in ((40, "x.1=64"), (77, "x.1=128"), (64, "x.1=64"), (128, "x.1=128")):
            x = torch.randn(1, n, 256, device="cuda")
            if n == 40:
                torch._dynamo.mark_dynamic(x, 1)
            out = compiled(x)
            err = _rel(out.cpu().numpy(), _reference(model, x, "float32"))
            (g,) = graphs.new()
            print(f"backend dynamic seq {n}: graph {g.last_graph}, rel err {err:.2e}")
            assert g.last_graph == bucket and err <= tol32
    assert counters["stats"]["unique_graphs"] - before == 1
    (g,) = _served_by_grace(graphs, caught, calls=4)
    assert len(g.paths) == 1


def test_backend_outputs_stay_valid_and_work_on_a_side_stream():
    """Outputs are torch tensors written in place (not views of session memory): an older output
    keeps its values after later calls; a call on another stream gets its own session, ordered
    with torch's work on that stream."""
    make_model, _, tol32, _ = CASES["mlp"]
    torch.manual_seed(0)
    model = make_model().eval().cuda()
    compiled = torch.compile(model, backend="grace")
    graphs = Graphs()
    xs = [torch.randn(8, 64, device="cuda") for _ in range(3)]
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [compiled(x) for x in xs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())   # xs were made on the default stream
        with torch.cuda.stream(side):
            x_side = xs[0] * 2          # produced on the side stream, consumed there too
            out_side = compiled(x_side)
            out_side = out_side + 0     # a consumer on the side stream
        torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        assert _rel(out.cpu().numpy(), _reference(model, x, "float32")) <= tol32
    assert _rel(out_side.cpu().numpy(), _reference(model, xs[0] * 2, "float32")) <= tol32
    assert len({o.data_ptr() for o in outs}) == 3
    (g,) = _served_by_grace(graphs, caught, calls=4)
    assert len(g._current.runner.sessions) == 2   # the default stream's session, the side one's


class _WithBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        h = F.gelu(self.a(x))
        print("graph break")
        return self.b(h)


def test_backend_graph_break_gives_two_grace_graphs():
    torch.manual_seed(0)
    model = _WithBreak().eval().cuda()
    compiled = torch.compile(model, backend="grace")
    graphs = Graphs()
    x = torch.randn(4, 64, device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    assert _rel(out.cpu().numpy(), _reference(model, x, "float32")) <= 1e-3
    assert len(_served_by_grace(graphs, caught, calls=2)) == 2
