"""aot/fuse_combine.py (off by default: it lost on the GPU): a split-KV attention combines its
own key splits, the last program of each query tile applying the epilogue, and the attn_combine
kernel goes. Through the CPU reference executor (programs one after another, so the arrival counting
is exercised but not its memory ordering: the `combine` knob of
tests/gpu/test_decode_knobs_gpu.py), against fp64 torch and the package without the pass: packed
and unpacked grouped-query heads, splits that see no key, ragged query rows, a fused epilogue,
edge values, half precision, and a Llama decode step whose attention also stores the KV-cache
appends. The race proof holds and the arrival words are back at zero after every call."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import fuse_combine, fuse_splitk  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402
from test_attention_split_interpret import Attend  # noqa: E402
from test_decode_knobs import N_LAYERS, _check_against_eager, _compile as _compile_llama  # noqa: E402
from test_fuse_splitk import _arrivals_zero  # noqa: E402

ON = "comb:fuse_combine.COMBINE_IN_ATTENTION=True"


def _mask(lq, lk, pos):
    """Additive: query row i sees keys 0..pos+i (a static cache filled up to pos)."""
    keep = torch.arange(lk)[None, :] <= pos + torch.arange(lq)[:, None]
    return torch.zeros(lq, lk).masked_fill(~keep, float("-inf"))[None, None]


def _compile(model, args, path, on, **options):
    with applied(parse_variant(ON) if on else None):
        return grace_compile(model, args, output=path, progress=False, fp32_matmul="ieee",
                             **options)


def _families(path):
    m = read_package(path).manifest
    return [m["kernels"][n["kernel"]]["family"] for g in m["graphs"] for n in g["nodes"]]


def _combining_sources(path):
    """The source of every graph node that is an attention combining its own splits."""
    pkg = read_package(path)
    m = pkg.manifest
    kernels = [m["kernels"][n["kernel"]] for g in m["graphs"] for n in g["nodes"]]
    sources = [bytes(pkg.section(k["source"])).decode() for k in kernels
               if k["family"] == "attention"]
    return [src for src in sources if "c_arrived" in src]


def _check_package(path, attentions=1):
    """`attentions`: graph nodes that combine their own splits."""
    pkg = read_package(path)
    assert races.check_races(pkg.manifest) == [] and races.check_pre_wait(pkg) == []
    assert fuse_splitk.ARRIVALS in [e["name"] for e in pkg.manifest["state"]]
    assert "attn_combine" not in _families(path)
    sources = _combining_sources(path)
    assert len(sources) == attentions
    for src in sources:
        assert src.index("tl.debug_barrier()") < src.index("tl.atomic_add(")
        assert src.index("tl.atomic_add(") < src.index("tl.atomic_xchg(")
        assert 'cache_modifier=".cg"' in src


def test_off_by_default(tmp_path):
    assert fuse_combine.COMBINE_IN_ATTENTION is False
    q, k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 512, 64), torch.randn(1, 2, 512, 64)
    path = grace_compile(Attend().eval(), (q, k, v, _mask(1, 512, 100)),
                         output=tmp_path / "m.grace", progress=False)
    assert "attn_combine" in _families(path)
    assert fuse_splitk.ARRIVALS not in [e["name"] for e in read_package(path).manifest["state"]]


# (query heads, key/value heads, query rows, gqa, epilogue): packed grouped-query heads (4 a
# program), one head a program, 3 ragged query rows in a 16-row tile, and a fused epilogue
CASES = [(8, 2, 1, True, False), (3, 3, 1, False, True), (2, 2, 3, False, False),
         (8, 2, 1, True, True)]


@pytest.mark.parametrize("h, h_kv, lq, gqa, epilogue", CASES)
def test_a_split_attention_combines_its_own_splits(tmp_path, h, h_kv, lq, gqa, epilogue):
    """Over positions whose mask rules out all but the first split, some, and none: the
    values are fp64 torch's and the unfused package's, and every word is back at zero."""
    torch.manual_seed(0)
    model = Attend(gqa, epilogue).eval()
    lk, d = 512, 64
    args = (torch.randn(1, h, lq, d), torch.randn(1, h_kv, lk, d), torch.randn(1, h_kv, lk, d),
            _mask(lq, lk, 5))
    off = _compile(model, args, tmp_path / "off.grace", False)
    on = _compile(model, args, tmp_path / "on.grace", True)
    assert "attn_combine" in _families(off)
    _check_package(on)
    sess_on, sess_off = InterpretSession(on), InterpretSession(off)
    for pos in (3, 200, lk - lq):
        q, k, v = torch.randn(1, h, lq, d), torch.randn(1, h_kv, lk, d), torch.randn(1, h_kv, lk, d)
        feed = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "mask": _mask(lq, lk, pos).numpy()}
        got, want = sess_on.run(feed)["out"], sess_off.run(feed)["out"]
        with torch.no_grad():
            ref = model(q.double(), k.double(), v.double(), _mask(lq, lk, pos).double()).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5, pos
        _arrivals_zero(sess_on)


def test_edge_values_and_half_precision(tmp_path):
    """Keys of ±0.5, tiny (1e-20) and huge (1e3: scores ~1e7, one key takes all the weight)
    magnitudes, in float32 against fp64 torch; then the same attention in float16 (the
    interpreter refuses bfloat16) against fp64 torch within its rounding."""
    torch.manual_seed(1)
    lk, d = 512, 64
    model = Attend(True).eval()
    args = (torch.randn(1, 8, 1, d), torch.randn(1, 2, lk, d), torch.randn(1, 2, lk, d),
            _mask(1, lk, 300))
    on = _compile(model, args, tmp_path / "on.grace", True)
    _check_package(on)
    sess = InterpretSession(on)
    for scale in (0.5, -0.5, 1e-20, 1e3):
        q = torch.randn(1, 8, 1, d)
        k = (torch.full((1, 2, lk, d), scale) if abs(scale) == 0.5   # every score equal
             else torch.randn(1, 2, lk, d) * scale)
        v = torch.randn(1, 2, lk, d)
        mask = _mask(1, lk, 300)
        feed = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "mask": mask.numpy()}
        got = sess.run(feed)["out"]
        with torch.no_grad():
            ref = model(q.double(), k.double(), v.double(), mask.double()).numpy()
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5, scale
        _arrivals_zero(sess)
    half = tuple(a.half() for a in args)
    on16 = _compile(model, half, tmp_path / "on16.grace", True)
    _check_package(on16)
    q, k, v = (torch.randn(1, 8, 1, d).half(), torch.randn(1, 2, lk, d).half(),
               torch.randn(1, 2, lk, d).half())
    mask = _mask(1, lk, 400).half()
    got = InterpretSession(on16).run({"q": q.numpy(), "k": k.numpy(), "v": v.numpy(),
                                      "mask": mask.numpy()})["out"]
    with torch.no_grad():
        ref = model(q.double(), k.double(), v.double(), mask.double()).numpy()
    assert np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref) < 2e-3


def test_a_llama_decode_step(tmp_path):
    """A 2-layer Llama over a 512-slot cache, its attentions split 2 ways on the 2
    multiprocessors the plan fills: the decode step's (grouped-query heads packed, storing the
    KV-cache appends too) and the 16-row prefill bucket's. A prompt and decode steps
    against eager, and the arrival words at zero after each call."""
    model, path = _compile_llama(tmp_path, ON, "on", max_seq=512)
    _check_package(path, attentions=2 * N_LAYERS)   # each layer x 2 buckets
    _check_against_eager(model, path, after_step=_arrivals_zero)
