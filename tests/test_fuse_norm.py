"""aot/fuse_norm.py: a split-K reduction folded into the LayerNorm that reads its sum. Through the
CPU reference executor (NaN-poisoned arena), against fp64 eager and bit for bit against the
package compiled without the pass, on the three shapes of transformer block it meets: pre-norm
with the sum kept for the residual (HF ViT, GPT-2), post-norm (BERT, dynamic sequence length at
lengths that are not bucket sizes)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("transformers")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import fuse_norm  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools import models  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

OFF = "nofold:fuse_norm.FOLD_SPLIT_K_INTO_NORM=False"


def _compile(model, args, path, fold, fp32_matmul="ieee", **options):
    with applied(None if fold else parse_variant(OFF)):
        return grace_compile(model, args, output=path, progress=False, fp32_matmul=fp32_matmul,
                             archs=("sm_90",), **options)


def _graphs(path):
    """Per graph: the family and the label of each node, and the source of each layer norm."""
    pkg = read_package(path)
    m = pkg.manifest
    nodes = [[(m["kernels"][n["kernel"]]["family"], n.get("label", "")) for n in g["nodes"]]
             for g in m["graphs"]]
    norms = [(k, bytes(pkg.section(k["source"])).decode()) for k in m["kernels"]
             if k["family"] == "layer_norm"]
    return nodes, norms


def _folded(nodes) -> list[str]:
    """Labels of the LayerNorm nodes that took a reduction (its ops come first in the label)."""
    return [label for family, label in nodes
            if family == "layer_norm" and not label.startswith("native_layer_norm")]


def _keeps(source: str) -> bool:
    """The LayerNorm stores two row-shaped values: its output and the kept sum."""
    return sum("tl.store(" in line and "rows * " in line for line in source.splitlines()) == 2


def _run(path, feeds):
    sess = InterpretSession(path)   # poisoned: a value read before it is written is NaN
    out = sess.run(feeds)
    return np.asarray(next(iter(out.values())))


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), ref.detach().double().numpy()
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


class _HiddenStates(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


def _hf_vit():
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=1536, image_size=64, patch_size=8,
                    attn_implementation="sdpa")
    return _HiddenStates(ViTModel(cfg, add_pooling_layer=False).eval())


def _check_pair(tmp_path, model, args, feeds, reference, **options):
    """Compile with and without the pass; returns the folded package's graphs."""
    on = _compile(model, args, tmp_path / "on.grace", True, **options)
    off = _compile(model, args, tmp_path / "off.grace", False, **options)
    pkg = read_package(on)
    assert races.check_races(pkg.manifest) == [] and races.check_pre_wait(pkg) == []
    for feed, ref in zip(feeds, reference):
        got_on, got_off = _run(on, feed), _run(off, feed)
        assert np.isfinite(got_on).all()
        np.testing.assert_array_equal(got_on, got_off)   # the same sums in the same order
        assert _rel(got_on, ref) < 1e-5
    return _graphs(on), _graphs(off)


def test_pre_norm_vit_keeps_the_residual_sum(tmp_path):
    """Two HF ViT blocks at batch 1 on a 64-pixel image, 192 wide with ViT-S's 1536-wide MLP
    (65 rows: the MLP's second GEMM splits its K of 1536, the others do not): its split-K
    reduction goes into the LayerNorm after it, which in the first block also stores the
    residual branch's sum for the next residual add."""
    torch.manual_seed(0)
    model = _hf_vit()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = model.double()(x.double())
    model.float()
    (on, norms), (off, _) = _check_pair(tmp_path, model, (x,), [{"pixel_values": x.numpy()}],
                                        [ref])
    reductions_on = sum(f == "reduction" for f, _ in on[0])
    reductions_off = sum(f == "reduction" for f, _ in off[0])
    folded = _folded(on[0])
    assert len(folded) == 2 and reductions_on == reductions_off - len(folded)
    assert len(on[0]) == len(off[0]) - len(folded)
    # the first block's folded norm keeps the sum for the second block's residual add; the
    # last one (the final norm) has no later reader
    assert sum(_keeps(src) for _, src in norms) == 1


def test_pre_norm_gpt2(tmp_path):
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=2, n_embd=256, n_head=4, vocab=100, n_positions=64).eval()
    feeds, refs = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ids = torch.randint(0, 100, (1, 32))
        feeds.append({"input_ids": ids.numpy()})
        with torch.no_grad():
            refs.append(model.double()(ids))
        model.float()
    (on, norms), (off, _) = _check_pair(tmp_path, model, (torch.randint(0, 100, (1, 32)),),
                                        feeds, refs)
    assert _folded(on[0]) and any(_keeps(src) for _, src in norms)   # the residual stream
    assert sum(f == "reduction" for f, _ in on[0]) < sum(f == "reduction" for f, _ in off[0])


def test_post_norm_bert_with_dynamic_rows(tmp_path):
    """BERT (post-norm: LayerNorm(x + proj(...)), the sum read by nothing else, so not kept)
    with a dynamic sequence: the folded LayerNorm masks the rows past the length as the
    reduction did; lengths inside a bucket, not at its size. Both buckets split K and fold."""
    torch.manual_seed(0)
    model = models.hf_bert(layers=2, hidden=256, heads=4, vocab=100, max_pos=128).eval()
    feeds, refs = [], []
    for n in (20, 45):
        ids = torch.randint(0, 100, (1, n))
        feeds.append({"input_ids": ids.numpy()})
        with torch.no_grad():
            refs.append(model.double()(ids))
        model.float()
    (on, norms), (off, _) = _check_pair(
        tmp_path, model, (torch.randint(0, 100, (1, 32)),), feeds, refs,
        dynamic_shapes=({1: Dim("seq", min=1, max=64)},), buckets={"seq": [32, 64]})
    for graph_on, graph_off in zip(on, off):   # each bucket: split-K GEMMs, folded
        assert (sum(f == "reduction" for f, _ in graph_on)
                < sum(f == "reduction" for f, _ in graph_off))
        assert _folded(graph_on)
    assert not any(_keeps(src) for _, src in norms)   # post-norm


class _Block(torch.nn.Module):
    """A residual branch and its norm; the sum is an output's source too (so it is kept)."""

    def __init__(self, k=1536):
        super().__init__()
        self.proj = torch.nn.Linear(k, 384)
        self.norm = torch.nn.LayerNorm(384)

    def forward(self, h, r):
        x = r + self.proj(h)
        return self.norm(x), x * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_split_gemv_into_its_norm(tmp_path, dtype):
    """A single row: the projection is a GEMV split over K (as the default splits K >= 8192;
    here K 2048, two chunks of the GEMV's 1024-column step), and its split sums go into the
    LayerNorm of that one row. In fp16 the norm rounds the sum through fp16 as the reduction
    stored it (fuse_norm.stored_split_sum): still bit for bit."""
    torch.manual_seed(0)
    model = _Block(k=2048).eval().to(dtype)
    h, r = torch.randn(1, 2048).to(dtype), torch.randn(1, 384).to(dtype)
    paths = {}
    for fold in (True, False):
        variant = "split:codegen.GEMV_SPLIT_MIN_K=2048" + (
            "" if fold else ",fuse_norm.FOLD_SPLIT_K_INTO_NORM=False")
        with applied(parse_variant(variant)):
            paths[fold] = grace_compile(model, (h, r), output=tmp_path / f"{int(fold)}.grace",
                                        progress=False, fp32_matmul="ieee", archs=("sm_90",))
    (on, norms), (off, _) = _graphs(paths[True]), _graphs(paths[False])
    assert _folded(on[0]) and "reduction" in [f for f, _ in off[0]]
    assert "reduction" not in [f for f, _ in on[0]] and any(_keeps(src) for _, src in norms)
    feed = {"h": h.numpy(), "r": r.numpy()}
    a, b = InterpretSession(paths[True]).run(feed), InterpretSession(paths[False]).run(feed)
    with torch.no_grad():
        want = model.double()(h.double(), r.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, ref in zip(a, want):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
        np.testing.assert_allclose(np.asarray(a[name], np.float64), ref.numpy(), rtol=tol,
                                   atol=tol)


def test_edge_values_through_a_folded_norm(tmp_path):
    """±0.5, huge and tiny rows (a variance far under eps), and rows of one repeated value
    (variance 0, where the output is the LayerNorm's bias). Every row is its own case (the GEMM
    and the norm work row by row), so the five kinds share one call: 13 rows each."""
    torch.manual_seed(0)
    model = _Block().eval()
    h = torch.randn(65, 1536)   # 65 rows: the GEMM splits K
    kinds = [(h[:13], torch.randn(13, 384)),
             (torch.full((13, 1536), 0.5), torch.full((13, 384), -0.5)),
             (h[13:26] * 1e-30, 1e4 * torch.randn(13, 384)),
             (torch.zeros(13, 1536), 1e-20 * torch.randn(13, 384)),
             (torch.zeros(13, 1536), torch.full((13, 384), 3.0))]
    hh, rr = torch.cat([k[0] for k in kinds]), torch.cat([k[1] for k in kinds])
    on = _compile(model, (h, rr), tmp_path / "on.grace", True)
    off = _compile(model, (h, rr), tmp_path / "off.grace", False)
    nodes, norms = _graphs(on)
    assert _folded(nodes[0]) and any(_keeps(src) for _, src in norms)   # x * 2 reads x later
    feed = {"h": hh.numpy(), "r": rr.numpy()}
    a = InterpretSession(on).run(feed)
    b = InterpretSession(off).run(feed)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    with torch.no_grad():
        want = model.double()(hh.double(), rr.double())
    for got, ref in zip(a.values(), want):
        got, ref = np.asarray(got, np.float64), ref.numpy()
        for kind in range(len(kinds)):   # each kind's tolerance by its own scale
            rows = slice(13 * kind, 13 * kind + 13)
            np.testing.assert_allclose(got[rows], ref[rows], rtol=1e-4,
                                       atol=1e-4 * max(1.0, np.abs(ref[rows]).max()),
                                       err_msg=f"kind {kind}")


def test_off_switch(tmp_path):
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=1, n_embd=256, n_head=4, vocab=100, n_positions=64).eval()
    ids = torch.randint(0, 100, (1, 32))
    off = _compile(model, (ids,), tmp_path / "off.grace", False)
    nodes, norms = _graphs(off)
    assert not _folded(nodes[0]) and "reduction" in [f for f, _ in nodes[0]]
    # the defaults, restored after the variant
    assert fuse_norm.FOLD_SPLIT_K_INTO_NORM and not fuse_norm.FOLD_INTO_ROW_REDUCTIONS


def test_a_decode_steps_rms_norm_adds_the_split_down_projection(tmp_path):
    """Llama decode with FOLD_INTO_ROW_REDUCTIONS (off by default: slower on the H200): the down
    projection split over K (as the default splits K >= 8192; here K 2048) and the residual add
    are summed by the next RMSNorm's mean of squares, which keeps the residual stream for the
    next block. Prompt and decode steps bit for bit against the
    package without the pass and against eager; generate() gives eager's greedy tokens."""
    from grace.tools.interpret import generate_package
    from grace.tools.models import CachedLlama

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=2048,
                        max_seq=16).eval()
    t = Dim("seq", min=1, max=16)
    paths = {}
    for fold in (True, False):
        # stored GEMV rows (fuse_rows, on by default) off in both: the two builds then differ by
        # the fold alone, so their results can be compared bit for bit
        variant = "split:codegen.GEMV_SPLIT_MIN_K=2048,fuse_rows.STORE_GEMV_ROWS=False" + (
            ",fuse_norm.FOLD_INTO_ROW_REDUCTIONS=True" if fold else "")
        with applied(parse_variant(variant)):
            paths[fold] = grace_compile(
                model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                output=tmp_path / f"d{int(fold)}.grace", progress=False, fp32_matmul="ieee",
                dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}}, buckets={"seq": [1, 16]},
                sm_count={"sm_90": 2}, generate={"tokens": "idx", "positions": "input_pos"})
    graphs = {}
    for fold, path in paths.items():
        m = read_package(path).manifest
        decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
        graphs[fold] = [m["kernels"][n["kernel"]]["family"] for n in decode["nodes"]]
        assert races.check_races(m) == [] and races.check_pre_wait(read_package(path)) == []
    # layer 1 takes the down projection of layer 0; the last one's goes into the final norm:
    # two reduction kernels fewer
    assert graphs[True].count("reduction") == graphs[False].count("reduction") - 2
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    sessions = {fold: InterpretSession(path) for fold, path in paths.items()}
    with torch.no_grad():
        model.reset_cache()
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
            ref = model(idx[:, lo:hi], torch.arange(lo, hi)).double().numpy()
            feed = {"idx": idx[:, lo:hi].numpy(), "input_pos": np.arange(lo, hi)}
            got = sessions[True].run(feed)["out"]
            np.testing.assert_array_equal(got, sessions[False].run(feed)["out"])
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5, (lo, hi)
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(3))
    assert generate_package(paths[True], prompt.numpy(), 4).tolist() == model.greedy(prompt, 4)


def test_a_kept_sum_needs_its_value_and_its_size():
    """The IR verifier's rules for a LayerNorm that keeps a sum (families.LayerNorm)."""
    from grace.aot.families import LayerNorm
    from grace.aot.ir import Buffer, Load

    x = Buffer("x", "arena", "float32", (4, 8), 1)
    keep = Buffer("keep", "arena", "float32", (4, 8), 2)
    src = Load(x, 0, (8, 1))
    assert LayerNorm(src=src, eps=1e-5, keep=keep, kept=src).shape_problems((4, 8)) == []
    assert LayerNorm(src=src, eps=1e-5, keep=keep, kept=src).extra_writes() == [keep]
    assert "go together" in LayerNorm(src=src, eps=1e-5, keep=keep).shape_problems((4, 8))[0]
    small = Buffer("small", "arena", "float32", (4, 4), 3)
    assert "not 32 elements" in LayerNorm(src=src, eps=1e-5, keep=small,
                                          kept=src).shape_problems((4, 8))[0]
