"""The unsplit attention's tiles (codegen.ATTN_ONE_BLOCK_ELEMS, on: the whole key axis in one
step) and knobs (ATTN_BM, ATTN_MAX_BLOCK_N, ATTN_V_EARLY_UNSPLIT, ATTN_WARPS, ATTN_STAGES), each
set as a `--variant` sets it, through the CPU reference executor against fp64 eager on a
ViT-sized encoder attention (197 tokens: ragged against every key block) with an epilogue. The
knobs are for A/B runs on the H200; a setting that changes the tiles must keep the values."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools.inspect import kernel_source  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

from test_buckets_interpret import rel_err, run_cases  # noqa: E402

pytestmark = pytest.mark.slow


class Attend(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2.0 + 1.0


KNOBS = {
    "rule": None,   # 197 keys of 64: one block of 256 (codegen.ATTN_ONE_BLOCK_ELEMS)
    "steps_of_128": "o:codegen.ATTN_ONE_BLOCK_ELEMS=0",
    "bm64_bn256_vearly": "a:codegen.ATTN_BM=64,codegen.ATTN_MAX_BLOCK_N=256,"
                         "codegen.ATTN_V_EARLY_UNSPLIT=True",
    "bn64_w8_s1": "b:codegen.ATTN_ONE_BLOCK_ELEMS=0,codegen.ATTN_MAX_BLOCK_N=64,"
                  "codegen.ATTN_WARPS=8,codegen.ATTN_STAGES=1",
    "bm32_s3": "c:codegen.ATTN_BM=32,codegen.ATTN_STAGES=3",
}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_attention_knobs_keep_the_values(tmp_path, knob):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 197, 64) for _ in range(3))
    with applied(parse_variant(KNOBS[knob]) if KNOBS[knob] else None):
        path = grace_compile(Attend().eval(), (q, k, v), output=tmp_path / "a.grace",
                             progress=False, fp32_matmul="ieee")
    m = read_package(path).manifest
    [att] = [kern for kern in m["kernels"] if kern["family"] == "attention"]
    src = kernel_source(read_package(path), att["name"])
    if knob == "rule":
        assert "tl.arange(0, 256)" in src and "tl.arange(0, 128)" not in src
    if knob == "steps_of_128":
        assert "tl.arange(0, 128)" in src and "tl.arange(0, 256)" not in src
    if knob == "bn64_w8_s1":
        assert (att["num_warps"], att["num_stages"]) == (8, 1)
        assert "tl.arange(0, 64)" in src and "tl.arange(0, 128)" not in src
    if knob == "bm64_bn256_vearly":
        assert "tl.program_id(0) * 64 + tl.arange(0, 64)" in src and "tl.arange(0, 256)" in src
        assert src.index("v = ") < src.index("s = tl.dot")
    got = run_cases(path, {"r": {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}}, tmp_path)["r"]
    assert "error" not in got, got.get("error")
    ref = Attend()(q.double(), k.double(), v.double()).numpy()
    assert np.isfinite(got["out"]).all()
    assert rel_err(got["out"], ref) < 1e-6


def test_one_block_only_where_it_fits():
    """The one-step plan takes an unsplit attention of up to 256 keys of head size 64; a longer
    axis, a wider head, or a split-KV decode step keeps steps of ATTN_MAX_BLOCK_N keys."""
    from grace.aot.codegen import ATTN_MAX_BLOCK_N, attention_plan
    assert attention_plan(1, 6, 197, 197, 132).bn == 256
    assert attention_plan(1, 6, 197, 197, 132, d=128).bn == ATTN_MAX_BLOCK_N
    assert attention_plan(1, 12, 512, 512, 132).bn == ATTN_MAX_BLOCK_N
    assert attention_plan(1, 4, 100, 100, 132).bn == ATTN_MAX_BLOCK_N   # 100 keys: one step anyway
    decode = attention_plan(1, 32, 1, 2048, 132, rep=4, packable=True)
    assert decode.split > 1 and decode.bn == ATTN_MAX_BLOCK_N


def test_split_key_blocks_fit_registers():
    """A split-KV program's key block stays within ATTN_SPLIT_BLOCK_ELEMS (keys x head columns),
    so its key and value blocks can load before gdc_wait() without spilling: Llama-1B's decode
    step (head dimension 64) keeps 16 splits of 128 keys, Llama-8B's (128) takes 32 of 64. An
    attention of many query tiles keeps its blocks."""
    from grace.aot import codegen
    from grace.aot.codegen import attention_plan
    one_b = attention_plan(1, 32, 1, 2048, 132, rep=4, packable=True, d=64)
    eight_b = attention_plan(1, 32, 1, 2048, 132, rep=4, packable=True, d=128)
    assert (one_b.bn, one_b.split, one_b.pack) == (128, 16, 4)
    assert (eight_b.bn, eight_b.split, eight_b.pack) == (64, 32, 4)
    assert eight_b.bn * 128 <= codegen.ATTN_SPLIT_BLOCK_ELEMS
    assert attention_plan(1, 12, 512, 512, 132, d=128).bn == codegen.ATTN_MAX_BLOCK_N


class Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_one_block_causal_and_dynamic_lengths(tmp_path):
    """The one-step block with the rules that skipped whole key blocks before: causal rows (a
    query row sees only the keys up to it, inside the one block) and a dynamic sequence whose
    keys past the call's length are padding (a bucket of 200: one block of 256, lengths 1, 77
    and 200)."""
    from torch.export import Dim
    torch.manual_seed(0)
    s = Dim("s", min=1, max=200)
    q, k, v = (torch.randn(1, 2, 150, 64) for _ in range(3))
    path = grace_compile(Causal().eval(), (q, k, v), output=tmp_path / "c.grace", progress=False,
                         fp32_matmul="ieee", dynamic_shapes={n: {2: s} for n in "qkv"},
                         buckets={"s": [200]})
    m = read_package(path).manifest
    [att] = [kern for kern in m["kernels"] if kern["family"] == "attention"]
    assert "tl.arange(0, 256)" in kernel_source(read_package(path), att["name"])
    runs = {f"L{n}": [torch.randn(1, 2, n, 64) for _ in range(3)] for n in (1, 77, 200)}
    got = run_cases(path, {c: dict(zip("qkv", (a.numpy() for a in r))) for c, r in runs.items()},
                    tmp_path)
    for case, r in runs.items():
        assert "error" not in got[case], got[case].get("error")
        ref = Causal()(*(a.double() for a in r)).numpy()
        assert got[case]["out"].shape == ref.shape
        assert rel_err(got[case]["out"], ref) < 1e-6, case
