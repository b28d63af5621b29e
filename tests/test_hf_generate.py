"""Hugging Face decoder LMs with a static KV cache, end to end on the CPU: tiny LlamaForCausalLM
(sdpa attention, untied head) and Qwen2ForCausalLM (eager attention, q/k/v biases, tied head)
with random weights, wrapped by `grace.tools.hf_decoder.StaticCacheLM`, compiled with a dynamic
token count and `generate=`, and driven through the CPU reference executor (NaN-poisoned arena).
The references are the HF models themselves run without any cache (full recompute per token), so
they share nothing with the wrapper: greedy tokens, prefill logits of two prompts that fit no
bucket exactly, and the logits of one decode step after a prefill."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools.hf_decoder import StaticCacheLM, export_kwargs, greedy  # noqa: E402

pytestmark = pytest.mark.slow
MAX_CACHE, NEW = 48, 6
PROMPTS = (7, 21)   # no bucket size (buckets: 1 for decode, 16, 48)
MODELS = ("llama", "qwen2")

# The interpreter must be switched on before triton is imported, and this process has imported
# it already (grace.aot): run it in a process of its own, as tests/generate_cases.py does.
WORKER = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np
from grace.tools.interpret import InterpretSession

package, spec_path, out_path = sys.argv[1:4]
with np.load(spec_path) as data:
    prompts = [data[k] for k in sorted(k for k in data.files if k.startswith("prompt"))]
    new = int(data["new"])
sess = InterpretSession(package)
gen = sess.manifest["generate"]
tok, pos, logits = gen["tokens"], gen["positions"], gen["logits"]
out = {}
for i, p in enumerate(prompts):
    out[f"gen{i}"] = sess.generate(p, new)
    sess.reset_state()
    out[f"prefill{i}"] = sess.run({tok: p[None], pos: np.arange(len(p))})[logits]
    if i == 0:   # one decode step on top of this prefill's cache
        nxt = int(np.argmax(out["prefill0"][0, -1]))
        out["next0"] = np.array(nxt)
        out["decode0"] = sess.run({tok: np.array([[nxt]]), pos: np.array([len(p)])})[logits]
np.savez(out_path, **out)
"""


def _hf_model(name: str):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=64,
                  initializer_range=0.2)   # wider than the default 0.02: varied greedy tokens
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, tie_word_embeddings=False,
                                       attn_implementation="sdpa", **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(vocab_size=192, tie_word_embeddings=True,
                                       attn_implementation="eager", **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.float().eval()


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Compile each model, and interpret each package while the next one compiles."""
    tmp = tmp_path_factory.mktemp("hf")
    out, procs = {}, {}
    try:
        for name in MODELS:
            model = _hf_model(name)
            path = grace_compile(StaticCacheLM(model, MAX_CACHE), output=tmp / f"{name}.grace",
                                 progress=False, fp32_matmul="ieee",
                                 **export_kwargs(MAX_CACHE, buckets=[16, MAX_CACHE]))
            gen = torch.Generator().manual_seed(1)
            vocab = model.config.vocab_size
            prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPTS]
            np.savez(tmp / f"{name}_spec.npz", new=np.array(NEW),
                     **{f"prompt{i}": p.numpy() for i, p in enumerate(prompts)})
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(path), str(tmp / f"{name}_spec.npz"),
                 str(tmp / f"{name}_out.npz")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            out[name] = {"model": model, "prompts": prompts,
                         "manifest": read_package(path).manifest}
        for name, proc in procs.items():
            _, stderr = proc.communicate()
            assert proc.returncode == 0, stderr[-4000:]
            with np.load(tmp / f"{name}_out.npz") as data:
                out[name]["out"] = {k: data[k] for k in data.files}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.parametrize("name", MODELS)
def test_package_keeps_the_caches_as_session_state(results, name):
    manifest = results[name]["manifest"]
    state = {e["name"]: e for e in manifest["state"]}
    for i in range(2):
        for kind in ("k", "v"):
            entry = state[f"{kind}_cache_{i}"]
            assert entry["shape"] == [1, 2, MAX_CACHE, 16] and entry["init"] == "zeros"
    gen = manifest["generate"]
    assert (gen["tokens"], gen["positions"], gen["capacity"]) == \
        ("input_ids", "cache_position", MAX_CACHE)
    assert manifest["graphs"][gen["decode_graph"]]["bucket"] == {"seq": 1}


@pytest.mark.parametrize("name", MODELS)
def test_generated_tokens_equal_eager_greedy(results, name):
    r = results[name]
    refs = [greedy(r["model"], p, NEW) for p in r["prompts"]]
    assert any(len(set(ref)) > 1 for ref in refs), refs   # a sequence that tells models apart
    for i, ref in enumerate(refs):
        assert r["out"][f"gen{i}"].tolist() == ref, (i, ref)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match_eager(results, name):
    r = results[name]
    model, out = r["model"], r["out"]
    with torch.no_grad():
        for i, p in enumerate(r["prompts"]):
            ref = model(input_ids=p[None], use_cache=False).logits.double().numpy()
            assert out[f"prefill{i}"].shape == ref.shape
            assert rel_err(out[f"prefill{i}"], ref) < 1e-4, i
        seq = torch.cat([r["prompts"][0], torch.tensor([int(out["next0"])])])
        ref = model(input_ids=seq[None], use_cache=False).logits[:, -1:].double().numpy()
    assert int(out["next0"]) == int(np.argmax(out["prefill0"][0, -1]))
    assert out["decode0"].shape == ref.shape
    assert rel_err(out["decode0"], ref) < 1e-4


def test_wrapper_rejects_other_batch_sizes():
    lm = StaticCacheLM(_hf_model("llama"), MAX_CACHE)
    with pytest.raises(ValueError, match="batch size 1 only"):
        lm(torch.zeros(2, 3, dtype=torch.long), torch.arange(3))
