"""Session state and on-device greedy generation with the real runtime (H200): a gpt-fast-style
decoder with a static KV cache, compiled with `generate=`. fp32 (ieee GEMMs) must give eager's
greedy tokens exactly; bf16 logits must stay within 2e-2 of an fp32 run of the same weights; the
WHILE loop must stop at EOS; sessions keep separate caches and reset_state() clears them.

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import load  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402

MAX_SEQ, NEW = 256, 24
PROMPTS = (5, 77)   # no bucket size


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = CachedLlama(vocab=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, hidden=688,
                    max_seq=MAX_SEQ).eval()
    return m.to(dtype)


def _compile(model, path, **kw):
    t = Dim("seq", min=1, max=MAX_SEQ)
    return grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=path, progress=False, dynamic_shapes={"idx": {1: t},
                                                                      "input_pos": {0: t}},
                         generate={"tokens": "idx", "positions": "input_pos"}, **kw)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    model = _model()
    path = _compile(model, tmp_path_factory.mktemp("gen") / "lm32.grace", fp32_matmul="ieee")
    pkg = load(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen) for n in PROMPTS]
    return model, pkg, prompts


def test_generate_fp32_equals_eager_greedy(fp32):
    model, pkg, prompts = fp32
    sess = pkg.session(poison=True)
    for prompt in prompts:
        got = sess.generate(prompt.numpy(), NEW)
        assert got.tolist() == model.greedy(prompt, NEW)


def test_generate_stops_at_eos(fp32):
    model, pkg, prompts = fp32
    ref = model.greedy(prompts[0], NEW)
    eos = ref[5]
    first = ref.index(eos)
    got = pkg.session().generate(prompts[0].numpy(), NEW, eos_token_id=eos)
    assert got.tolist() == ref[:first + 1]


def test_state_is_per_session_and_reset(fp32):
    model, pkg, prompts = fp32
    a, b = pkg.session(poison=True), pkg.session(poison=True)
    p0, p1 = prompts
    out_a = a.run(idx=p0[None].numpy(), input_pos=np.arange(len(p0)))["out"].numpy()
    b.run(idx=p1[None].numpy(), input_pos=np.arange(len(p1)))
    model.reset_cache()
    with torch.no_grad():
        ref = model(p0[None], torch.arange(len(p0))).numpy()
    assert _rel(out_a, ref) < 1e-5
    state = a.read_state()
    for i, layer in enumerate(model.layers):
        got = state[f"layers.{i}.attention.kv_cache.k_cache"]
        assert _rel(got, layer.attention.kv_cache.k_cache.numpy()) < 1e-5
    a.reset_state()
    assert not any(v.any() for v in a.read_state().values())


def test_bf16_logits_close_to_fp32(tmp_path):
    model32 = _model()
    model16 = _model(torch.bfloat16)
    pkg = load(_compile(model16, tmp_path / "lm16.grace"))
    sess = pkg.session(poison=True)
    prompt = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(2))
    got = sess.run(idx=prompt[None].numpy(), input_pos=np.arange(33))["out"]
    got = torch.from_dlpack(got).float().cpu().numpy()
    model32.reset_cache()
    with torch.no_grad():
        ref = model32(prompt[None], torch.arange(33)).numpy()
    assert _rel(got, ref) < 2e-2
    tokens = sess.generate(prompt.numpy(), 8)
    assert len(tokens) == 8 and ((0 <= tokens) & (tokens < 512)).all()


def _logits_and_tokens(pkg, prompt):
    """A NaN-poisoned session's logits for a 37-token prefill and 3 decode steps of `prompt`
    (40 tokens), then generate()'s NEW tokens after the whole prompt."""
    sess = pkg.session(poison=True)
    logits = [torch.from_dlpack(sess.run(idx=prompt[None, :37].numpy(),
                                         input_pos=np.arange(37))["out"]).float().cpu()]
    for p in range(37, 40):
        logits.append(torch.from_dlpack(sess.run(idx=prompt[None, p:p + 1].numpy(),
                                                 input_pos=np.array([p]))["out"]).float().cpu())
    return logits, sess.generate(prompt.numpy(), NEW).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_appends_after_attention_change_no_value(tmp_path, dtype):
    """aot/fuse_append.py (off by default: it measured slower): with the KV-cache appends moved after
    the attention, prefill and decode logits equal the default package's bit for bit (the
    attention reads the very values the appends store), and generate() gives the same tokens."""
    from grace.tools.variants import applied, parse_variant

    model = _model(dtype)
    kw = {"fp32_matmul": "ieee"} if dtype == torch.float32 else {}
    with applied(parse_variant("append:fuse_append.APPEND_AFTER_ATTENTION=True")):
        moved = load(_compile(model, tmp_path / "moved.grace", **kw))
    plain = load(_compile(model, tmp_path / "plain.grace", **kw))
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))
    (got, got_tokens), (want, want_tokens) = (_logits_and_tokens(pkg, prompt)
                                              for pkg in (moved, plain))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert got_tokens == want_tokens
    if dtype == torch.float32:
        assert got_tokens == model.greedy(prompt, NEW)


# decode-graph knobs (tests/test_decode_knobs.py on the CPU), each alone and all together, against
# a package with all of them off (the split-K GEMV's default K, 8192, is past this model's 2048)
_OFF = "lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0,codegen.ATTN_V_EARLY=False"
KNOBS_OFF = f"off:{_OFF}"
KNOBS = {
    "split": "split:codegen.GEMV_SPLIT_MIN_K=2048,lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0,"
             "codegen.ATTN_V_EARLY=False",
    "share": "share:codegen.ATTN_PACK_GQA=0,codegen.ATTN_V_EARLY=False",
    "gqa": "gqa:lower.SHARE_MIN_READS=0,codegen.ATTN_V_EARLY=False",
    "vearly": "vearly:lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0",
    "pfall": f"pfall:{_OFF},codegen.GEMV_PREFETCH_ALL_MAX_BYTES=16777216",
    "all": "all:codegen.GEMV_SPLIT_MIN_K=2048,codegen.GEMV_PREFETCH_ALL_MAX_BYTES=16777216",
}


@pytest.fixture(scope="module")
def knob_baseline(tmp_path_factory):
    """Per dtype: the decoder the knobs are tried on (a K-2048 down projection to split), and the
    logits and tokens of its package with every knob off, computed once for all knobs."""
    from grace.tools.variants import applied, parse_variant
    made = {}

    def get(dtype):
        if dtype not in made:
            torch.manual_seed(0)
            model = CachedLlama(vocab=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                hidden=2048, max_seq=MAX_SEQ).eval().to(dtype)
            path = tmp_path_factory.mktemp("knobs") / "plain.grace"
            with applied(parse_variant(KNOBS_OFF)):
                plain = load(_compile(model, path, **_knob_kw(dtype)))
            made[dtype] = model, _logits_and_tokens(plain, KNOB_PROMPT)
        return made[dtype]
    return get


KNOB_PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5))


def _knob_kw(dtype):
    return {"fp32_matmul": "ieee"} if dtype == torch.float32 else {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_decode_knobs_keep_the_logits(tmp_path, knob_baseline, knob, dtype):
    """Split-K GEMVs (the down projection's K 2048 in 2 chunks), the shared residual stream,
    packed grouped-query heads, values loaded with their keys and small GEMVs' weights all
    loaded before the wait: prefill and decode logits as the knobs-off package's (fp32: to
    summation order; bf16: to its rounding), NaN-poisoned sessions, and in fp32 generate() gives
    eager's greedy tokens."""
    from grace.tools.variants import applied, parse_variant

    model, (want, want_tokens) = knob_baseline(dtype)
    with applied(parse_variant(KNOBS[knob])):
        knobbed = load(_compile(model, tmp_path / f"{knob}.grace", **_knob_kw(dtype)))
    got, got_tokens = _logits_and_tokens(knobbed, KNOB_PROMPT)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < tol
    if dtype == torch.float32:
        assert got_tokens == want_tokens == model.greedy(KNOB_PROMPT, NEW)
