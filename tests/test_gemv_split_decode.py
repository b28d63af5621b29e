"""Split-K GEMVs (codegen.GEMV_SPLIT_MIN_K, off by default) in a Llama decode step, through the
CPU reference executor: the down projection's partial rows summed by a reduction kernel that
also applies the residual add, logits against eager over a prompt and decode steps, and the
race proof of the graph."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

SPLIT = parse_variant("split:codegen.GEMV_SPLIT_MIN_K=2048")
MAX_SEQ = 16


def test_split_down_projection_in_a_decode_step(tmp_path):
    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=2048,
                        max_seq=MAX_SEQ).eval()
    t = Dim("seq", min=1, max=MAX_SEQ)
    with applied(SPLIT):
        path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / "m.grace", progress=False, fp32_matmul="ieee",
                             dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, MAX_SEQ]}, sm_count={"sm_90": 2})
    pkg = read_package(path)
    m = pkg.manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    kernels = [m["kernels"][n["kernel"]] for n in decode["nodes"]]
    sources = {k["name"]: bytes(pkg.section(k["source"])).decode() for k in kernels
               if k["family"] == "matmul"}
    split = [i for i, k in enumerate(kernels) if "k_lo = " in sources.get(k["name"], "")]
    assert len(split) == 2   # the two layers' down projections (K 2048; the rest is K 64)
    for i in split:   # then the reduction of its partial rows
        assert kernels[i + 1]["family"] == "reduction"
    assert races.check_races(m) == [] and races.check_pre_wait(pkg) == []

    idx = torch.randint(0, 96, (1, 9))
    sess = InterpretSession(path)
    with torch.no_grad():
        model.reset_cache()
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
            ref = model(idx[:, lo:hi], torch.arange(lo, hi)).double().numpy()
            got = sess.run({"idx": idx[:, lo:hi].numpy(), "input_pos": np.arange(lo, hi)})["out"]
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < 1e-5, (lo, hi, err)
