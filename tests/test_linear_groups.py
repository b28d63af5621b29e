"""Sibling linear layers (aot/linear_groups.py) fused into one GEMM over concatenated weights,
through the CPU reference executor against torch in fp64: a SwiGLU MLP (no bias), separate
q/k/v projections with biases, one row (a GEMV) and several, a dynamic row count with buckets,
and the cases that must not fuse (a weight something else reads too)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402

from test_buckets_interpret import rel_err, run_cases  # noqa: E402

pytestmark = pytest.mark.slow


class SwiGLU(torch.nn.Module):
    def __init__(self, dim=48, hidden=80):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        f = self.norm(x)
        return x + self.w2(F.silu(self.w1(f)) * self.w3(f))


class QKV(torch.nn.Module):
    def __init__(self, dim=40):
        super().__init__()
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, 16)
        self.v = torch.nn.Linear(dim, 24)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x) * 2.0, self.v(x).relu()], dim=-1)


class SharedWeight(torch.nn.Module):
    """w1's weight is also read directly: it must stay a weight of its own (no fusion)."""

    def __init__(self, dim=32):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.w1(x) + self.w3(x) + self.w1.weight.sum()


def _weights(path):
    return [w["name"] for w in read_package(path).manifest["weights"]]


def _matmuls(path, graph=None):
    m = read_package(path).manifest
    return [m["kernels"][n["kernel"]]["family"] for g in m["graphs"] for n in g["nodes"]
            if graph is None or g["name"] == graph].count("matmul")


def _check(model, x, tmp_path, runs=None, **kw):
    torch.manual_seed(0)
    model = model.eval()
    path = grace_compile(model, (x,), output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee", **kw)
    runs = runs or [x]
    got = run_cases(path, {f"r{i}": {"x": r.numpy()} for i, r in enumerate(runs)}, tmp_path)
    for i, r in enumerate(runs):
        out = got[f"r{i}"]
        assert "error" not in out, out.get("error")
        with torch.no_grad():
            ref = model.double()(r.double())
        model.float()
        assert rel_err(out["out"], ref.numpy()) < 1e-6, (i, rel_err(out["out"], ref.numpy()))
    return path


@pytest.mark.parametrize("rows", [1, 5])
def test_gate_and_up_are_one_gemm(tmp_path, rows):
    torch.manual_seed(1)
    path = _check(SwiGLU(), torch.randn(1, rows, 48), tmp_path)
    names = _weights(path)
    assert "fused.p_w1_weight+p_w3_weight" in names
    assert not {"p_w1_weight", "p_w3_weight"} & set(names)   # stored once, inside the fused one
    assert _matmuls(path) == 2   # gate+up, down


def test_separate_q_k_v_with_biases(tmp_path):
    torch.manual_seed(2)
    path = _check(QKV(), torch.randn(3, 40), tmp_path)
    names = _weights(path)
    assert any(n.startswith("fused.") and n.endswith(".bias") for n in names)
    assert _matmuls(path) == 1


def test_dynamic_rows_fuse_in_every_bucket(tmp_path):
    torch.manual_seed(3)
    path = _check(SwiGLU(), torch.randn(1, 4, 48), tmp_path,
                  runs=[torch.randn(1, n, 48) for n in (1, 3, 8)],
                  dynamic_shapes={"x": {1: Dim("seq", min=1, max=8)}}, buckets={"seq": [1, 8]})
    assert _matmuls(path, "seq=1") == 2 and _matmuls(path, "seq=8") == 2


def test_a_weight_read_elsewhere_is_not_fused(tmp_path):
    torch.manual_seed(4)
    path = _check(SharedWeight(), torch.randn(2, 32), tmp_path)
    assert not any(n.startswith("fused.") for n in _weights(path))
