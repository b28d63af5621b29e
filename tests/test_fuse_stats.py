"""A one-row reduction folded into the GEMV that reads it (aot/fuse_stats.py, `fold_row_stats`):
an RMSNorm or an amax scaling in front of a linear layer is one kernel in a decode step, and its
results through the CPU reference executor still match torch in fp64 (ragged rows, a masked last
block, max as well as sum). Where the reduction has another reader, or the product is not a GEMV,
it stays; without the option (the default) it stays too."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from grace.aot import compile as grace_compile  # noqa: E402

from test_gemv_interpret import _check, _kernels  # noqa: E402

pytestmark = pytest.mark.slow


class NormProj(torch.nn.Module):
    """RMSNorm (as Llama writes it: mean of squares, rsqrt, weight) then a linear layer."""

    def __init__(self, k, n):
        super().__init__()
        self.norm_w = torch.nn.Parameter(torch.rand(k) + 0.5)
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        return self.lin(h)


class AmaxProj(torch.nn.Module):
    """The row scaled by its largest magnitude (a max reduction) then a linear layer."""

    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n)

    def forward(self, x):
        return self.lin(x / x.abs().amax(-1, keepdim=True))


class NormTwice(NormProj):
    """The norm's statistic also feeds an output of its own: it keeps its kernel."""

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.lin(x * torch.rsqrt(ms + 1e-6) * self.norm_w), ms * 2




@pytest.mark.parametrize("k", [300, 2048])
def test_rms_norm_folds_into_the_gemv(tmp_path, k):
    torch.manual_seed(0)
    path = _check(NormProj(k, 37), {"x": torch.randn(1, k) * 3}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]


def test_off_by_default(tmp_path):
    torch.manual_seed(0)
    path = _check(NormProj(256, 16), {"x": torch.randn(1, 256)}, tmp_path, tol=1e-5)
    assert _kernels(path) == ["table_writer", "reduction", "matmul"]


def test_amax_scaling_folds_with_a_masked_last_block(tmp_path):
    torch.manual_seed(1)
    x = torch.randn(1, 1500)
    x[0, 1400] = -40.0   # the largest magnitude sits in the masked second block
    path = _check(AmaxProj(1500, 20), {"x": x}, tmp_path, tol=1e-5, fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]


def test_a_statistic_with_another_reader_keeps_its_kernel(tmp_path):
    torch.manual_seed(2)
    model = NormTwice(64, 16).eval()
    path = grace_compile(model, (torch.randn(1, 64),), output=tmp_path / "m.grace", progress=False,
                         fold_row_stats=True)
    assert "reduction" in _kernels(path)


def test_rows_of_a_gemm_keep_the_reduction(tmp_path):
    torch.manual_seed(3)
    path = _check(NormProj(64, 32), {"x": torch.randn(8, 64)}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    assert "reduction" in _kernels(path)
