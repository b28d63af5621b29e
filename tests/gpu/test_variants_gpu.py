"""Per-arch variants (format 3.5) and measured GEMM tiles on the H200.

- A package for sm_80 + sm_90 with PDL runs its sm_90 graphs here (programmatic edges, sm_90
  cubins), bit-identical to an sm_90-only build of the same model, in a NaN-poisoned session.
- With gemm_tiles=True, GEMMs of >= 128 rows are tiled from aot/gemm_tiles/sm_90.json (4-stage
  pipelines, other warp counts): shapes on and off the table's grid, fp32 (tf32x3) and bf16,
  against an fp64 reference on fresh inputs.

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.runtime import load  # noqa: E402
from grace.tools import models  # noqa: E402


def test_a_two_variant_package_runs_its_sm90_graphs_like_an_sm90_build(tmp_path):
    torch.manual_seed(0)
    model = models.LlamaBlock(dim=256, n_heads=8, n_kv_heads=4, hidden=688).eval()
    x = torch.randn(1, 40, 256)
    both = grace_compile(model, (x,), output=tmp_path / "both.grace", archs=("sm_80", "sm_90"),
                         pdl=True)
    only = grace_compile(model, (x,), output=tmp_path / "only.grace", archs=("sm_90",), pdl=True)
    graphs = read_package(both).manifest["graphs"]
    assert {tuple(g.get("archs", ())) for g in graphs} == {("sm_80",), ("sm_90",)}
    a, b = load(both), load(only)
    assert a.arch == "sm_90"
    sa, sb = a.session(poison=True), b.session(poison=True)
    with torch.no_grad():
        for _ in range(20):
            xi = torch.randn(1, 40, 256)
            got = next(iter(sa.run(xi.cuda()).values())).numpy()
            ref = next(iter(sb.run(xi.cuda()).values())).numpy()
            assert not np.isnan(got).any() and np.array_equal(got, ref)
            want = model.double()(xi.double()).numpy()
            model.float()
            assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (197, 1152, 384), (1024, 3072, 1024),
                                   (300, 1000, 3072)])
def test_gemms_tiled_by_the_table_match_an_fp64_reference(tmp_path, dtype, m, n, k):
    torch.manual_seed(m + n + k)
    lin = torch.nn.Linear(k, n).eval().to(dtype)
    path = grace_compile(lin, (torch.randn(m, k, dtype=dtype),), output=tmp_path / "lin.grace",
                         gemm_tiles=True)
    kernels = read_package(path).manifest["kernels"]
    assert any(kr["family"] == "matmul" for kr in kernels)
    pkg = load(path)
    sess = pkg.session(poison=True)
    for _ in range(3):
        x = torch.randn(m, k, dtype=dtype)
        out = next(iter(sess.run(x.cuda()).values()))
        got = torch.from_dlpack(out).double().cpu().numpy()   # bf16 has no numpy dtype
        with torch.no_grad():
            want = (x.double() @ lin.weight.double().T + lin.bias.double()).numpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
    pkg.close()
