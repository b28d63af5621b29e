"""Hugging Face decoders with a static KV cache (tools/hf_decoder.StaticCacheLM) on the real
runtime (H200): a Llama (sdpa) and a Qwen2 (eager attention, q/k/v biases, tied head) of a few
layers with random weights, fp32 with ieee GEMMs, generate() must give the HF model's own greedy
tokens (full recompute, no cache) for prompts of no bucket size; their prefill logits must match.

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import load  # noqa: E402
from grace.tools.hf_decoder import StaticCacheLM, export_kwargs, greedy  # noqa: E402

MAX_CACHE, NEW = 128, 16
PROMPTS = (9, 70)


def _hf(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, attn_implementation="eager")
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_generate_fp32_equals_hf_greedy(kind, tmp_path):
    hf = _hf(kind)
    lm = StaticCacheLM(hf, MAX_CACHE)
    kw = export_kwargs(MAX_CACHE, buckets=[32, MAX_CACHE])
    path = grace_compile(lm, kw.pop("example_inputs"), output=tmp_path / f"{kind}.grace",
                         progress=False, fp32_matmul="ieee", **kw)
    pkg = load(path)
    sess = pkg.session(poison=True)
    gen = torch.Generator().manual_seed(1)
    for n in PROMPTS:
        prompt = torch.randint(0, 1024, (n,), generator=gen)
        got = sess.generate(prompt.numpy(), NEW)
        assert got.tolist() == greedy(hf, prompt, NEW)
        sess.reset_state()
        logits = sess.run(input_ids=prompt[None].numpy(), cache_position=np.arange(n))
        with torch.no_grad():
            ref = hf(input_ids=prompt[None], use_cache=False).logits.double().numpy()
        out = np.asarray(logits[next(iter(logits))].numpy(), np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-4
    pkg.close()
