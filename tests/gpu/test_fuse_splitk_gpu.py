"""Split-K matmuls that sum their own splits (aot/fuse_splitk.py, off by default) on the H200:
ViT-S (37 split-K GEMMs at batch 1 with tf32 dots, which take the measured tiles of
aot/gemm_tiles/) compiled with the pass, run 100 times with fresh inputs in a
NaN-poisoned session, each call against eager. The CPU tests run the programs one after another;
only here do the arrival counts race, so a missing fence shows as a rare wrong tile (or NaN from
the poisoned arena) in some call. The decode GEMVs run in tests/gpu/test_decode_knobs_gpu.py
(`splitk`)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.runtime import load  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

CALLS = 100


def test_vit_s_with_split_k_summed_in_kernel(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    with applied(parse_variant("sk:fuse_splitk.SPLIT_K_IN_KERNEL=True")):
        path = grace_compile(model, (x,), output=tmp_path / "vit.grace", archs=("sm_90",),
                             progress=False, fp32_matmul="tf32")   # the measured tiles
    m = read_package(path).manifest
    fams = [m["kernels"][n["kernel"]]["family"] for g in m["graphs"] for n in g["nodes"]]
    fused = sum("atomic_add" in bytes(read_package(path).section(k["source"])).decode()
                for k in m["kernels"] if k["family"] == "matmul")
    assert fused, "no split-K GEMM took the pass"
    sess = load(path).session(poison=True)
    reference = copy.deepcopy(model).double().cuda()   # fp64 eager, on the GPU for speed
    worst = 0.0
    with torch.no_grad():
        for call in range(CALLS):
            x = torch.randn(1, 3, 224, 224)
            got = next(iter(sess.run(x.cuda()).values())).numpy().astype(np.float64)
            ref = reference(x.double().cuda()).cpu().numpy()
            assert np.isfinite(got).all(), f"call {call}: non-finite values"
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            # tf32 dots give ~2e-3 (docs/performance.md); a tile missing a split, or summing a
            # stale one from the call before, is off by far more
            assert err < 1e-2, f"call {call}: rel. err {err:.2e}"
    print(f"{fused} fused split-K kernels, {fams.count('reduction')} reductions left, "
          f"worst rel. err over {CALLS} calls {worst:.2e}")
