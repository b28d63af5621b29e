"""Split-KV attentions that combine their own splits (aot/fuse_combine.py, off by default) on
the GPU: a Llama-1B-shaped decode attention (32 query heads over 8 key/value heads, 2048 cache
slots, 16 splits a group) compiled with the pass, 200 calls with fresh inputs and positions in a
NaN-poisoned session, each against fp64 torch. The CPU tests run the programs one after
another; only here do the arrival counts race, so a missing fence shows as a rare wrong row (or
NaN from the poisoned arena) in some call. The whole decoder runs in
tests/gpu/test_decode_knobs_gpu.py (`combine`)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)
import torch.nn.functional as F  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.runtime import load  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

CALLS = 200
H, H_KV, LK, D = 32, 8, 2048, 64


class Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _mask(pos):
    keep = torch.arange(LK)[None, :] <= pos
    return torch.zeros(1, LK).masked_fill(~keep, float("-inf"))[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_combined_in_kernel(tmp_path, dtype):
    torch.manual_seed(0)
    model = Attend().eval()
    args = (torch.randn(1, H, 1, D), torch.randn(1, H_KV, LK, D), torch.randn(1, H_KV, LK, D),
            _mask(1000))
    args = tuple(a.to(dtype) for a in args)
    with applied(parse_variant("comb:fuse_combine.COMBINE_IN_ATTENTION=True")):
        path = grace_compile(model, args, output=tmp_path / "attn.grace", progress=False,
                             fp32_matmul="ieee")
    pkg = read_package(path)
    m = pkg.manifest
    fams = [m["kernels"][n["kernel"]]["family"] for g in m["graphs"] for n in g["nodes"]]
    assert "attn_combine" not in fams and "attention" in fams
    assert any("c_arrived" in bytes(pkg.section(k["source"])).decode() for k in m["kernels"])
    sess = load(path).session(poison=True)
    worst = 0.0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for call in range(CALLS):
            pos = int(torch.randint(0, LK, (), generator=gen))
            q = torch.randn(1, H, 1, D, generator=gen)
            k, v = (torch.randn(1, H_KV, LK, D, generator=gen) for _ in range(2))
            feed = [a.to(dtype).cuda() for a in (q, k, v, _mask(pos))]
            got = next(iter(sess.run(*feed).values())).numpy().astype(np.float64)
            ref = model(*[a.double() for a in feed]).cpu().numpy()
            assert np.isfinite(got).all(), f"call {call} (position {pos}): non-finite values"
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            assert err < tol, f"call {call} (position {pos}): rel. err {err:.2e}"
    print(f"{dtype}: worst rel. err over {CALLS} calls {worst:.2e}")
