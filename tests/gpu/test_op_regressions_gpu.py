"""Ops the full OpInfo sweep on the H200 found wrong (docs/op-conformance.md, 2026-12-01 session 5),
run through the real runtime against torch on the GPU. Their CPU tests are in tests/test_op_edges.py;
these cases differed only on the GPU (a Triton miscompile, the GPU's float -> uint8 saturation).

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import load  # noqa: E402


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def run_on_gpu(fn, inputs, tmp_path):
    path = grace_compile(Fn(fn).eval(), tuple(inputs), output=tmp_path / "m.grace", progress=False)
    pkg = load(path)
    try:
        sess = pkg.session(poison=True)
        outs = sess.run(*[x.cuda() for x in inputs])
        return [o.numpy() for o in outs.values()]
    finally:
        pkg.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adaptive_average_pooling_with_uneven_windows(dtype, tmp_path):
    """fp16 (5, 7, 4) over 8^3 gave twice the right value in 286 of 1120 outputs with vectorized
    loads at the window's computed indices."""
    torch.manual_seed(0)
    x = torch.randn(8, 8, 8, 8).to(dtype)
    got = run_on_gpu(lambda x: (F.adaptive_avg_pool3d(x, (5, 7, 4)), F.adaptive_avg_pool2d(x, (3, 5))),
                     [x], tmp_path)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, want in zip(got, (F.adaptive_avg_pool3d(x.double(), (5, 7, 4)),
                             F.adaptive_avg_pool2d(x.double(), (3, 5)))):
        np.testing.assert_allclose(g.astype(np.float64), want.numpy(), rtol=tol, atol=tol)


def test_float_to_uint8_wraps_like_torch(tmp_path):
    x = torch.tensor([-1.5, -0.5, 0.5, 1.5, -100.0, 254.9, -3.0, 7.25])
    got = run_on_gpu(lambda x: (x.byte(), x.half().byte()), [x], tmp_path)
    want = x.cuda().byte().cpu().numpy()
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], x.half().cuda().byte().cpu().numpy())


def test_bitwise_not_of_int64_past_2_24(tmp_path):
    a = torch.tensor([2**24 + 1, -(2**24 + 1), 2**40 + 3, 0, -1, 7])
    got = run_on_gpu(lambda a: (~a, torch.logical_not(a)), [a], tmp_path)
    np.testing.assert_array_equal(got[0], (~a).numpy())
    np.testing.assert_array_equal(got[1], torch.logical_not(a).numpy())


def test_topk_fp16_picks_the_same_values(tmp_path):
    """Indices of equal values may come in another order than torch's (torch leaves it open); the
    values and the set of picked elements must match."""
    torch.manual_seed(0)
    x = (torch.randn(5, 10, 5) * 4).round().half()   # many ties
    vals, idx = run_on_gpu(lambda x: torch.topk(x, 3, dim=1), [x], tmp_path)
    want = torch.topk(x.float(), 3, dim=1).values.numpy()
    np.testing.assert_array_equal(vals.astype(np.float32), want)
    picked = np.take_along_axis(x.float().numpy(), idx, 1)
    np.testing.assert_array_equal(picked, want)
    assert all(len(set(idx[i, :, j])) == 3 for i in range(5) for j in range(5))
