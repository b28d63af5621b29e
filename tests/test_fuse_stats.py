"""A one-row reduction folded into the GEMV that reads it (aot/fuse_stats.py, `fold_row_stats`, and
by default into persistent GEMVs):
an RMSNorm or an amax scaling in front of a linear layer is one kernel in a decode step, and its
results through the CPU reference executor still match torch in fp64 (ragged rows, a masked last
block, max as well as sum). Where the reduction has another reader, or the product is not a GEMV,
it stays; without the option (the default) it stays too."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from grace.aot import compile as grace_compile  # noqa: E402

from grace.formats import read_package  # noqa: E402

from test_fuse_append import _decode, _eager  # noqa: E402
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


class CenterProj(torch.nn.Module):
    """The row minus its mean: not a product, so the statistic is reduced in a pass of its own
    before the K loop."""

    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.lin(x - x.mean(-1, keepdim=True))


class NormTwice(NormProj):
    """The norm's statistic also feeds an output of its own: it keeps its kernel."""

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.lin(x * torch.rsqrt(ms + 1e-6) * self.norm_w), ms * 2




def _gemv_source(path):
    pkg = read_package(path)
    return next(bytes(pkg.section(k["source"])).decode() for k in pkg.manifest["kernels"]
                if k["family"] == "matmul")


@pytest.mark.parametrize("k", [300, 2048])
def test_rms_norm_folds_into_the_gemv(tmp_path, k):
    torch.manual_seed(0)
    path = _check(NormProj(k, 37), {"x": torch.randn(1, k) * 3}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]
    src = _gemv_source(path)   # a product: the mean of squares accumulated in the K loop
    assert "for s0 in" not in src and "acc_n = acc_n * " in src


def test_off_by_default(tmp_path):
    """Off for the template GEMV; fuse_stats.FOLD_INTO_TEMPLATE (a benchmark variant's handle
    on the option) folds as fold_row_stats does, to the same kernel."""
    from grace.tools.variants import applied, parse_variant
    torch.manual_seed(0)
    model, x = NormProj(256, 16), {"x": torch.randn(1, 256)}
    path = _check(model, x, tmp_path, tol=1e-5)
    assert _kernels(path) == ["table_writer", "reduction", "matmul"]
    (tmp_path / "constant").mkdir()
    (tmp_path / "option").mkdir()
    with applied(parse_variant("fold:fuse_stats.FOLD_INTO_TEMPLATE=True")):
        folded = _check(model, x, tmp_path / "constant", tol=1e-5)
    assert _kernels(folded) == ["table_writer", "matmul"]
    assert _gemv_source(folded) == _gemv_source(_check(model, x, tmp_path / "option", tol=1e-5,
                                                       fold_row_stats=True))


def test_amax_scaling_folds_with_a_masked_last_block(tmp_path):
    torch.manual_seed(1)
    x = torch.randn(1, 1500)
    x[0, 1400] = -40.0   # the largest magnitude sits in the masked second block
    path = _check(AmaxProj(1500, 20), {"x": x}, tmp_path, tol=1e-5, fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]
    assert "mask_s" in _gemv_source(path)   # K = 1500: the last step's statistic is masked


@pytest.mark.parametrize("k", [96, 1500])
def test_a_row_that_is_no_product_reduces_before_the_k_loop(tmp_path, k):
    torch.manual_seed(4)
    path = _check(CenterProj(k, 12), {"x": torch.randn(1, k) + 2}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]
    src = _gemv_source(path)
    assert "for s0 in" in src and "acc_n = acc_n * " not in src


def test_a_statistic_with_another_reader_keeps_its_kernel(tmp_path):
    torch.manual_seed(2)
    model = NormTwice(64, 16).eval()
    path = grace_compile(model, (torch.randn(1, 64),), output=tmp_path / "m.grace", progress=False,
                         fold_row_stats=True)
    assert "reduction" in _kernels(path)


@pytest.mark.parametrize("model, x", [
    (NormProj, torch.randn(1, 3000) * 3),
    (AmaxProj, torch.randn(1, 3000)),   # a max statistic, K masked in its 4096 tile
    (CenterProj, torch.randn(1, 3000) + 2),   # no product: the row reads the statistic
])
def test_a_persistent_gemv_reduces_the_row_it_holds(tmp_path, model, x):
    """K 3000: the persistent GEMV (codegen._gemv_persistent) reduces the statistic over the row
    every program holds whole, one block reduction; the product form scales the sums."""
    torch.manual_seed(5)
    path = _check(model(3000, 24), {"x": x}, tmp_path, tol=1e-5, fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]
    src = _gemv_source(path)
    assert "for turn in range(" in src and "for s0 in" not in src
    assert ("acc_n = acc_n * scale" in src) == (model is not CenterProj)


@pytest.mark.parametrize("scale", [1e-20, 1e17, 0.5])
def test_a_persistent_gemv_statistic_of_tiny_huge_and_half_rows(tmp_path, scale):
    """Squares that underflow, or sum to ~1e37 (near float32's top: 2500 squares of 1e18 overflow
    it in eager float32 too), and ±0.5 exactly."""
    torch.manual_seed(7)
    x = torch.randn(1, 2500) * scale if scale != 0.5 else \
        torch.where(torch.rand(1, 2500) < 0.5, -0.5, 0.5)
    path = _check(NormProj(2500, 9), {"x": x}, tmp_path, tol=1e-5, fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]


@pytest.mark.parametrize("on", [True, False])
def test_fold_into_persistent_by_default(tmp_path, monkeypatch, on):
    """Without the option: the K-3000 GEMV (persistent) takes the RMSNorm (FOLD_INTO_PERSISTENT,
    on by default), the K-2048 one (the template) keeps its reduction."""
    from grace.aot import fuse_stats
    if not on:
        monkeypatch.setattr(fuse_stats, "FOLD_INTO_PERSISTENT", False)
    torch.manual_seed(5)
    path = _check(NormProj(3000, 24), {"x": torch.randn(1, 3000)}, tmp_path, tol=1e-5)
    assert _kernels(path) == ["table_writer"] + ([] if on else ["reduction"]) + ["matmul"]
    (tmp_path / "t").mkdir()
    path = _check(NormProj(2048, 24), {"x": torch.randn(1, 2048)}, tmp_path / "t", tol=1e-5)
    assert _kernels(path) == ["table_writer", "reduction", "matmul"]


def test_rows_of_a_gemm_keep_the_reduction(tmp_path):
    torch.manual_seed(3)
    path = _check(NormProj(64, 32), {"x": torch.randn(8, 64)}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    assert "reduction" in _kernels(path)


@pytest.mark.parametrize("form", ["template", "persistent"])
def test_a_cached_decoder_with_folded_norms_decodes_as_eager(tmp_path, monkeypatch, form):
    """The Llama decode step (RMSNorms before the q/k/v and gate/up GEMVs and the LM head, a KV
    cache written between them): its decode graph has no reduction kernel left, and prefill plus
    decode steps through the CPU reference executor match eager (fp32). `persistent`: every GEMV
    in the persistent form (its K range lowered to this model's), the fold by default there."""
    import numpy as np
    from torch.export import Dim

    from grace.aot import codegen
    from grace.tools.models import CachedLlama

    options = {"fold_row_stats": True}
    if form == "persistent":
        monkeypatch.setattr(codegen, "GEMV_PERSISTENT_MIN_K", 33)
        options = {}
    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96,
                        max_seq=32).eval()
    t = Dim("seq", min=1, max=32)
    path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=tmp_path / "lm.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         buckets={"seq": [1, 32]}, **options)
    m = read_package(path).manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    assert "reduction" not in {m["kernels"][n["kernel"]]["family"] for n in decode["nodes"]}
    pkg = read_package(path)
    gemvs = [bytes(pkg.section(m["kernels"][n["kernel"]]["source"])).decode()
             for n in decode["nodes"] if m["kernels"][n["kernel"]]["family"] == "matmul"]
    in_loop = [src for src in gemvs if "acc_n = acc_n * " in src]
    assert len(in_loop) == 5   # q/k/v and gate/up of both layers, and the LM head
    assert all(("for turn in range(" in src) == (form == "persistent") for src in gemvs)
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    got, ref = _decode(path, idx), _eager(model, idx)
    for g, r in zip(got, ref):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < 1e-5, err


@pytest.mark.parametrize("k, scale", [(1, 1.0), (64, 1e-20), (64, 1e18), (33, 0.5)])
def test_edge_rows_size_one_tiny_and_huge(tmp_path, k, scale):
    """A one-element row (no K axis to walk: the pass form), values whose squares underflow or
    reach 1e36, and ±0.5 exactly."""
    torch.manual_seed(6)
    x = torch.randn(1, k) * scale if scale != 0.5 else torch.where(torch.rand(1, k) < 0.5, -0.5, 0.5)
    path = _check(NormProj(k, 9), {"x": x}, tmp_path, tol=1e-5, fold_row_stats=True)
    assert _kernels(path) == ["table_writer", "matmul"]
