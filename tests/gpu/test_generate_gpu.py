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


@pytest.mark.parametrize("inside", [False, True], ids=["after", "inside"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_appends_after_attention_change_no_value(tmp_path, dtype, inside):
    """aot/fuse_append.py (on by default): with the KV-cache appends moved after the attention,
    or (APPEND_IN_ATTENTION) stored by the attention itself, prefill and decode logits equal
    those of the package without the pass bit for bit (the attention reads the very values the
    appends store), and generate() gives the same tokens."""
    from grace.tools.variants import applied, parse_variant

    model = _model(dtype)
    kw = {"fp32_matmul": "ieee"} if dtype == torch.float32 else {}
    with applied(parse_variant("append:fuse_append.APPEND_AFTER_ATTENTION=True,"
                               f"fuse_append.APPEND_IN_ATTENTION={inside}")):
        moved = load(_compile(model, tmp_path / "moved.grace", **kw))
    with applied(parse_variant("plain:fuse_append.APPEND_AFTER_ATTENTION=False,"
                               "codegen.ATTN_KV_BEFORE_WAIT=False")):
        plain = load(_compile(model, tmp_path / "plain.grace", **kw))
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))
    (got, got_tokens), (want, want_tokens) = (_logits_and_tokens(pkg, prompt)
                                              for pkg in (moved, plain))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert got_tokens == want_tokens
    if dtype == torch.float32:
        assert got_tokens == model.greedy(prompt, NEW)
