"""Decode-graph knobs, on by default since they were timed on the H200 (`bench_decode --variant`,
docs/performance.md 2026-12-03), through the CPU reference executor: logits against eager over
a prompt and decode steps, the race proof, and the graph shape each knob promises, against the
knob turned off.

- split-K GEMVs (codegen.GEMV_SPLIT_MIN_K, K >= 8192 by default; 2048 here for a small model):
  the down projection's partial rows are summed by a reduction kernel;
- a shared residual stream (lower.SHARE_MIN_READS): every residual add is stored by the GEMV
  that computes its last term, so norms and GEMV rows read one vector, with no extra kernel;
- grouped-query heads packed into one attention program (codegen.ATTN_PACK_GQA);
- all three at once;
- split-KV attention loading a key block's values with its keys (codegen.ATTN_V_EARLY, on);
- small GEMVs loading all their weights before gdc_wait() (codegen.GEMV_PREFETCH_ALL_MAX_BYTES,
  8 MB since the thirty-first session's H200 run)."""
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

MAX_SEQ = 16
N_LAYERS = 2   # a layer after another and the last one: every position a knob treats apart


def _compile(tmp_path, variant, name, max_seq=MAX_SEQ, hidden=2048, n_heads=4):
    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=N_LAYERS, n_heads=n_heads, n_kv_heads=2,
                        hidden=hidden, max_seq=max_seq).eval()
    t = Dim("seq", min=1, max=MAX_SEQ)
    with applied(parse_variant(variant) if variant else None):
        path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / f"{name}.grace", progress=False,
                             fp32_matmul="ieee", dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, MAX_SEQ]}, sm_count={"sm_90": 2})
    return model, path


def _decode_graph(path):
    pkg = read_package(path)
    m = pkg.manifest
    assert races.check_races(m) == [] and races.check_pre_wait(pkg) == []
    g = next(g for g in m["graphs"] if g["name"] == "seq=1")
    return pkg, g, [m["kernels"][n["kernel"]] for n in g["nodes"]]


def _check_against_eager(model, path, after_step=lambda sess: None):
    """A prompt of 6 tokens, then 3 decode steps, each against eager; `after_step(session)`
    checks more after each call (tests/test_fuse_splitk.py: the arrival words)."""
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    sess = InterpretSession(path)
    with torch.no_grad():
        model.reset_cache()
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
            ref = model(idx[:, lo:hi], torch.arange(lo, hi)).double().numpy()
            got = sess.run({"idx": idx[:, lo:hi].numpy(), "input_pos": np.arange(lo, hi)})["out"]
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < 1e-5, (lo, hi, err)
            after_step(sess)


def test_split_down_projection_in_a_decode_step(tmp_path):
    model, path = _compile(tmp_path, "split:codegen.GEMV_SPLIT_MIN_K=2048", "split")
    pkg, graph, kernels = _decode_graph(path)
    split = [i for i, k in enumerate(kernels) if k["family"] == "matmul"
             and "k_lo = " in bytes(pkg.section(k["source"])).decode()]
    assert len(split) == N_LAYERS   # the layers' down projections (K 2048; the rest is K 64)
    for i in split:          # each followed by the reduction of its partial rows
        assert kernels[i + 1]["family"] == "reduction"
    _check_against_eager(model, path)


def _arena_args(node) -> int:
    return sum(1 for a in node["args"] if isinstance(a, dict) and a.get("region") == "arena")


def test_shared_residual_stream_in_a_decode_step(tmp_path):
    """Off, the residual adds chain in the readers' expressions until one outgrows the size
    rule; on, every layer's two adds are the epilogues of its output and down projections, the
    kernel count is unchanged, and every norm statistic reads one vector (and writes one)."""
    # stored GEMV rows (fuse_rows, on by default) off in both: a mean that stores its row writes
    # a second vector, and the arena arguments counted here are the shared stream's alone
    _, plain = _compile(tmp_path, "noshare:lower.SHARE_MIN_READS=0,fuse_rows.STORE_GEMV_ROWS=False",
                        "plain")
    model, path = _compile(tmp_path, "share:fuse_rows.STORE_GEMV_ROWS=False", "share")
    _, g_off, k_off = _decode_graph(plain)
    _, g_on, k_on = _decode_graph(path)
    assert len(k_on) == len(k_off)
    fused = [n["label"] for n in g_on["nodes"] if "+add" in n["label"]]
    assert len(fused) == 2 * N_LAYERS, fused
    means = [n for n, k in zip(g_on["nodes"], k_on) if n["label"].startswith("mean")]
    assert means and all(_arena_args(n) == 2 for n in means)
    assert max(_arena_args(n) for n in g_off["nodes"] if n["label"].startswith("mean")) > 2
    _check_against_eager(model, path)


def test_packed_grouped_query_heads_in_a_decode_step(tmp_path):
    """8 query heads over 2 key/value heads and a 256-slot cache: the decode step's attention
    runs 2 programs per key split, one per key/value head, each with its 4 query heads as rows
    (off: one program per query head, too many on this 2-SM target to split the keys)."""
    for variant, programs in ((None, 2), ("nogqa:codegen.ATTN_PACK_GQA=0", 8)):
        model, path = _compile(tmp_path, variant, f"gqa{programs}", max_seq=256, hidden=96,
                               n_heads=8)
        pkg, graph, kernels = _decode_graph(path)
        att = [(n, k) for n, k in zip(graph["nodes"], kernels) if k["family"] == "attention"]
        assert len(att) == N_LAYERS
        for node, k in att:
            assert node["grid"][1] == programs and (node["grid"][2] > 1) == (programs == 2)
            assert ("ihr = ih + rm // 1" in bytes(pkg.section(k["source"])).decode()) == (
                programs == 2)
        _check_against_eager(model, path)


def test_all_three_knobs_together(tmp_path):
    """Split down projections whose reductions also take the shared residual add, beside packed
    attention: the knobs compose, and the logits still match eager."""
    model, path = _compile(tmp_path, "all:codegen.GEMV_SPLIT_MIN_K=2048", "all", max_seq=256,
                           n_heads=8)
    pkg, graph, kernels = _decode_graph(path)
    labels = [(n["label"], k["family"]) for n, k in zip(graph["nodes"], kernels)]
    assert sum(f == "reduction" and "+add" in lab for lab, f in labels) == N_LAYERS
    assert sum("ihr = " in bytes(pkg.section(k["source"])).decode()
               for k in kernels if k["family"] == "attention") == N_LAYERS
    _check_against_eager(model, path)


def test_values_load_with_their_keys(tmp_path):
    """codegen.ATTN_V_EARLY (on): a split-KV attention loads a key block's values right after its keys,
    before the scores, so both are in flight at once; off, after the softmax update. The same
    values either way: the logits match eager in both."""
    for variant, early in ((None, True), ("vlate:codegen.ATTN_V_EARLY=False", False)):
        model, path = _compile(tmp_path, variant, f"v{early}", max_seq=256, hidden=96, n_heads=8)
        pkg, graph, kernels = _decode_graph(path)
        for k in kernels:
            if k["family"] != "attention":
                continue
            src = bytes(pkg.section(k["source"])).decode()
            v_at = src.index(" v = tl.where(mask_v")
            assert (v_at < src.index("s = tl.dot(")) == early, variant
        _check_against_eager(model, path)


def test_small_gemvs_load_all_their_weights_before_the_wait(tmp_path):
    """codegen.GEMV_PREFETCH_ALL_MAX_BYTES: a GEMV of at most that many weight bytes loads every
    K step before gdc_wait(), the rest keep GEMV_PREFETCH_STEPS (1). 8 MB by default (the
    thirty-first session's H200 run), so these 512-KiB GEMVs take it unless it is 0 or under them."""
    for variant, all_k in (("pfoff:codegen.GEMV_PREFETCH_ALL_MAX_BYTES=0", False),
                           ("pfsmall:codegen.GEMV_PREFETCH_ALL_MAX_BYTES=500000", False),
                           (None, True)):
        model, path = _compile(tmp_path, variant, f"pf{all_k}", hidden=2048)
        pkg, graph, kernels = _decode_graph(path)
        sources = [bytes(pkg.section(k["source"])).decode() for k in kernels
                   if k["family"] == "matmul"]
        down = [src for src in sources if "2048" in src and "gdc_wait()" in src
                and "rn_hi" not in src]   # not the paired gate+up (its partner rows: 2048 on)
        assert down   # the down projections: K 2048, 64 x 2048 fp32 = 512 KiB of weights
        for src in down:
            before = src.split("gdc_wait()")[0]
            assert ("b_early1" in before) == all_k
        _check_against_eager(model, path)
