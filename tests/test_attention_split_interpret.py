"""Split-KV attention (few query rows, a long key axis: a decode step over a static cache) through
the CPU reference executor against torch in fp64: masks that rule out whole splits (the cache
past the current position), boolean and additive masks, GQA, a fused epilogue, ragged query
rows, half precision, and a dynamic key length. Checked from the package that the split and
its combining kernel are what ran."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot.codegen import attention_plan  # noqa: E402
from grace.aot.lower import DEFAULT_OPTIONS  # noqa: E402
from grace.formats import read_package  # noqa: E402

from test_buckets_interpret import rel_err, run_cases  # noqa: E402

pytestmark = pytest.mark.slow


class Attend(torch.nn.Module):
    def __init__(self, gqa=False, epilogue=False):
        super().__init__()
        self.gqa, self.epilogue = gqa, epilogue

    def forward(self, q, k, v, mask):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)
        return y * 2.0 + 1.0 if self.epilogue else y


def _families(path):
    m = read_package(path).manifest
    return [m["kernels"][n["kernel"]]["family"] for g in m["graphs"] for n in g["nodes"]]


def _valid_upto(lq, lk, pos, additive, dtype=torch.float32):
    """Query row i sees keys 0..pos+i (a cache filled up to pos)."""
    keep = torch.arange(lk)[None, :] <= pos + torch.arange(lq)[:, None]
    if not additive:
        return keep[None, None]
    return torch.zeros(lq, lk, dtype=dtype).masked_fill(~keep, float("-inf"))[None, None]


def _run(model, args, tmp_path, runs, dynamic_shapes=None, buckets=None, tol=1e-6, dtype=None):
    path = grace_compile(model.eval(), args, output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee", dynamic_shapes=dynamic_shapes, buckets=buckets)
    names = ["q", "k", "v", "mask"]
    got = run_cases(path, {f"r{i}": {n: a.numpy() for n, a in zip(names, r)}
                           for i, r in enumerate(runs)}, tmp_path)
    for i, r in enumerate(runs):
        out = got[f"r{i}"]
        assert "error" not in out, out.get("error")
        with torch.no_grad():
            ref = model(*[a.double() if a.is_floating_point() else a for a in r])
        assert out["out"].shape == tuple(ref.shape)
        assert np.isfinite(out["out"]).all()
        assert rel_err(out["out"], ref.numpy()) < tol, (i, rel_err(out["out"], ref.numpy()))
    return path


def _qkv(b, h, hk, lq, lk, d, dtype=torch.float32):
    return (torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, hk, lk, d, dtype=dtype),
            torch.randn(b, hk, lk, d, dtype=dtype))


def test_the_plan_splits_decode_and_not_prefill():
    sms = DEFAULT_OPTIONS["sm_count"]
    assert attention_plan(1, 32, 1, 2048, sms).split > 1
    assert attention_plan(1, 32, 1024, 2048, sms).split == 1
    assert attention_plan(1, 4, 1, 100, sms).split == 1   # no whole key blocks to split


@pytest.mark.parametrize("additive", [False, True])
def test_decode_step_over_a_partly_filled_cache(tmp_path, additive):
    torch.manual_seed(0)
    lk = 1024
    runs = []
    for pos in (0, 130, 700, lk - 1):   # whole splits ruled out, and none
        q, k, v = _qkv(1, 4, 4, 1, lk, 32)
        runs.append((q, k, v, _valid_upto(1, lk, pos, additive)))
    path = _run(Attend(), runs[0], tmp_path, runs)
    fams = _families(path)
    assert fams.count("attention") == 1 and fams.count("attn_combine") == 1


def test_gqa_ragged_rows_and_fused_epilogue(tmp_path):
    torch.manual_seed(1)
    lk = 512
    runs = []
    for pos in (3, 300):
        q, k, v = _qkv(1, 8, 2, 3, lk, 24)
        runs.append((q, k, v, _valid_upto(3, lk, pos, additive=False)))
    path = _run(Attend(gqa=True, epilogue=True), runs[0], tmp_path, runs)
    assert "attn_combine" in _families(path)
    # the epilogue went into the combining kernel: no pointwise kernel after it
    assert _families(path)[-1] == "attn_combine"


def test_half_precision(tmp_path):
    torch.manual_seed(2)
    q, k, v = _qkv(1, 4, 4, 1, 512, 64, torch.float16)
    mask = _valid_upto(1, 512, 200, additive=False)
    model = Attend().eval()
    path = grace_compile(model, (q, k, v, mask), output=tmp_path / "m.grace", progress=False)
    got = run_cases(path, {"r": {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(),
                                 "mask": mask.numpy()}}, tmp_path)["r"]["out"]
    with torch.no_grad():
        ref = model(q.double(), k.double(), v.double(), mask)
    assert got.dtype == np.float16 and rel_err(got, ref.numpy()) < 2e-3


@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])   # plain; grouped, packed
def test_dynamic_key_length(tmp_path, monkeypatch, heads):
    """Keys of a bucketed length (5, 300, 1024 in a 1024 bucket): padded key blocks skipped,
    padded keys masked; grouped-query heads packed into one program (ATTN_PACK_GQA) too."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "ATTN_PACK_GQA", 1)
    h, hk = heads
    torch.manual_seed(3)
    s = Dim("s", min=1, max=1024)
    runs = []
    for lk in (5, 300, 1024):
        q, k, v = _qkv(1, h, hk, 1, lk, 16)
        runs.append((q, k, v, torch.ones(1, 1, 1, lk, dtype=torch.bool)))
    path = _run(Attend(gqa=h != hk), runs[1], tmp_path, runs,
                dynamic_shapes={"q": None, "k": {2: s}, "v": {2: s}, "mask": {3: s}},
                buckets={"s": [1024]})
    assert "attn_combine" in _families(path)
    assert ("ihr = " in _attention_source(path)) == (h != hk)


@pytest.mark.parametrize("lk, heads", [(64, (2, 2)), (512, (2, 2)), (512, (8, 2))],
                         ids=["one-block", "split", "split-packed"])
def test_a_query_row_with_every_key_masked_is_zero(tmp_path, monkeypatch, lk, heads):
    """As torch's SDPA gives: left padding masks whole rows, and a NaN there would spread. Row 0
    is masked for every head, row 2 for the last head only (with grouped heads packed,
    ATTN_PACK_GQA, one row of a program's tile)."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "ATTN_PACK_GQA", 1)
    h, hk = heads
    torch.manual_seed(4)
    runs = []
    for row in (0, 2):
        q, k, v = _qkv(1, h, hk, 3, lk, 16)
        mask = _valid_upto(3, lk, 40, additive=False).expand(1, h, 3, lk).clone()
        mask[:, h - 1 if row else slice(None), row, :] = False
        runs.append((q, k, v, mask))
    path = _run(Attend(gqa=h != hk), runs[0], tmp_path, runs)
    assert ("ihr = " in _attention_source(path)) == (h != hk)


@pytest.fixture
def packed(monkeypatch):
    """Grouped-query heads packed into one program's rows (codegen.ATTN_PACK_GQA, off by
    default until timed on the H200)."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "ATTN_PACK_GQA", 1)


def _attention_source(path) -> str:
    pkg = read_package(path)
    return next(bytes(pkg.section(k["source"])).decode() for k in pkg.manifest["kernels"]
                if k["family"] == "attention")


def test_packing_is_planned_for_grouped_decode_steps_only(packed):
    sms = DEFAULT_OPTIONS["sm_count"]
    plan = attention_plan(1, 32, 1, 2048, sms, rep=4, packable=True)
    assert (plan.pack, plan.split) == (4, 16)     # 8 groups x 16 splits of 128 keys
    assert attention_plan(1, 32, 1, 2048, sms, rep=4).pack == 1            # lowering said no
    assert attention_plan(1, 32, 5, 2048, sms, rep=4, packable=True).pack == 1   # 20 rows
    assert attention_plan(1, 32, 1024, 2048, sms, rep=4, packable=True).pack == 1  # prefill


@pytest.mark.parametrize("additive", [False, True])
def test_packed_gqa_decode_over_a_partly_filled_cache(tmp_path, packed, additive):
    """4 query heads per key/value head in one program: each row's own head and mask, whole
    splits ruled out, the epilogue in the combine; logits as unpacked."""
    torch.manual_seed(2)
    lk = 1024
    runs = []
    for pos in (0, 130, 700, lk - 1):
        q, k, v = _qkv(1, 8, 2, 1, lk, 32)
        runs.append((q, k, v, _valid_upto(1, lk, pos, additive)))
    path = _run(Attend(gqa=True, epilogue=True), runs[0], tmp_path, runs)
    src = _attention_source(path)
    assert "ihr = ih + rm // 1" in src and "grp = tl.program_id(1)" in src
    assert _families(path)[-1] == "attn_combine"


def test_packed_gqa_with_several_query_rows_in_half_precision(tmp_path, packed):
    """3 query rows x 4 heads = 12 packed rows of a 16-row tile (4 padding rows), a mask per
    query row and head, float16."""
    torch.manual_seed(3)
    lk = 512
    runs = []
    for pos in (3, 300):
        q, k, v = _qkv(2, 8, 2, 3, lk, 24, dtype=torch.float16)
        mask = _valid_upto(3, lk, pos, additive=False).expand(2, 8, 3, lk).clone()
        mask[1, 5, 2, :pos // 2] = False       # one head of one batch sees fewer keys
        runs.append((q, k, v, mask))
    path = _run(Attend(gqa=True), runs[0], tmp_path, runs, tol=2e-3)
    assert "rq = rm % 3" in _attention_source(path)

