"""Session state and greedy generation end to end on the CPU: a gpt-fast-style decoder (GQA,
RoPE, SwiGLU, RMSNorm, a static KV cache as registered buffers written at device-side positions)
compiled with `generate=` and driven through the CPU reference executor (NaN-poisoned arena),
against torch eager: the generated tokens, the logits of prefill and decode steps, the cache after
them, two sessions that do not share state, reset_state(), and the limits that are errors before
anything runs."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = pathlib.Path(__file__).with_name("generate_cases.py")
MAX_SEQ, NEW = 48, 6
PROMPTS = (7, 21)   # no bucket size (buckets: 1, 16, 48)


def _model():
    torch.manual_seed(0)
    return CachedLlama(vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96,
                       max_seq=MAX_SEQ).eval()


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    model = _model()
    t = Dim("seq", min=1, max=MAX_SEQ)
    path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=tmp / "lm.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         buckets={"seq": [16, MAX_SEQ]},
                         generate={"tokens": "idx", "positions": "input_pos"})
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in PROMPTS]
    spec = {f"prompt{i}": p.numpy() for i, p in enumerate(prompts)}
    np.savez(tmp / "spec.npz", new=np.array(NEW), **spec)
    proc = subprocess.run([sys.executable, str(WORKER), str(path), str(tmp / "spec.npz"),
                           str(tmp / "out.npz")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(tmp / "out.npz") as data:
        out = {k: data[k] for k in data.files}
    return model, prompts, read_package(path).manifest, out


def test_package_describes_state_and_generation(results):
    _, _, manifest, _ = results
    names = [e["name"] for e in manifest["state"]]
    assert "layers.0.attention.kv_cache.k_cache" in names and "generate.ctrl" in names
    assert all(e["init"] == "zeros" for e in manifest["state"])   # zero caches: no bytes stored
    gen = manifest["generate"]
    assert gen["capacity"] == MAX_SEQ
    assert manifest["graphs"][gen["decode_graph"]]["bucket"] == {"seq": 1}


def test_generated_tokens_equal_eager_greedy(results):
    model, prompts, _, out = results
    for i, prompt in enumerate(prompts):
        assert out[f"gen{i}"].tolist() == model.greedy(prompt, NEW), i


def test_prefill_decode_and_cache_match_eager(results):
    model, prompts, _, out = results
    model.reset_cache()
    p0 = prompts[0]
    with torch.no_grad():
        ref_prefill = model(p0[None], torch.arange(len(p0))).double().numpy()
        nxt = int(np.argmax(out["prefill"][0, -1]))
        ref_decode = model(torch.tensor([[nxt]]), torch.tensor([len(p0)])).double().numpy()
    assert rel_err(out["prefill"], ref_prefill) < 1e-5
    assert rel_err(out["decode"], ref_decode) < 1e-5
    for i, layer in enumerate(model.layers):
        for kind in ("k_cache", "v_cache"):
            ref = getattr(layer.attention.kv_cache, kind).numpy()
            got = out[f"stateA/layers.{i}.attention.kv_cache.{kind}"]
            assert rel_err(got, ref) < 1e-5, (i, kind)
            assert not got[:, :, len(p0) + 1:].any()   # slots past the written positions stay 0


def test_sessions_do_not_share_state_and_reset_restores_it(results):
    model, prompts, _, out = results
    model.reset_cache()
    with torch.no_grad():
        ref = model(prompts[1][None], torch.arange(len(prompts[1]))).numpy()
    assert rel_err(out["other"], ref) < 1e-5   # session B started from zeros
    for key in [k for k in out if k.startswith("stateA/")]:
        name = key.split("/", 1)[1]
        np.testing.assert_array_equal(out[f"stateA_after/{name}"], out[key])
        assert not out[f"reset/{name}"].any(), name


def test_generation_limits_are_errors_before_running(results):
    _, _, _, out = results
    assert "the prompt has 49 tokens" in str(out["error_long"])   # longer than the cache
    assert "exceeds the cache capacity of 48" in str(out["error_past"])


class _Counter(torch.nn.Module):
    """A buffer updated by a whole-value write (not a scatter): stored after its readers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.full((4,), 2.0))   # a nonzero initial value: stored

    def forward(self, x):
        old = x * self.n
        self.n.add_(1)
        return old + self.n


def _session_calls(model, x, tmp_path, calls: int = 3) -> None:
    """Compile `model`, run it `calls` times in one interpreted session on `x`, and compare every
    call's output with eager calls of a fresh copy of the model (state carried across calls)."""
    path = grace_compile(model, (torch.from_numpy(x),), output=tmp_path / "c.grace",
                         progress=False)
    cases = {f"c{i}": {"x": x} for i in range(calls)}
    spec, result = tmp_path / "cases.npz", tmp_path / "result.npz"
    np.savez(spec, **{f"{c}/{n}": a for c, inputs in cases.items() for n, a in inputs.items()})
    worker = pathlib.Path(__file__).with_name("interpret_cases.py")
    proc = subprocess.run([sys.executable, str(worker), str(path), str(spec), str(result),
                           "session"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = type(model)()
    with np.load(result) as data, torch.no_grad():
        for i in range(calls):
            ref = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(data[f"c{i}/out"], ref, rtol=1e-6)


def test_counter_state_carries_across_calls_of_one_session(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    _session_calls(_Counter(), x, tmp_path)
    manifest = read_package(tmp_path / "c.grace").manifest
    assert [(e["name"], e["init"]) for e in manifest["state"]] == [("n", "data")]


class _Exchange(torch.nn.Module):
    """New state values read old ones that a state update overwrites: `b`'s reads the old `a`,
    which is stored first, and `a`'s reads itself upside down (each program of its store would
    read rows another program already overwrote)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("a", torch.randn(64, 64, generator=g))
        self.register_buffer("b", torch.randn(64, 64, generator=g))

    def forward(self, x):
        new_a, new_b = self.a.flip(0) + x, self.a * 2 + self.b
        self.a.copy_(new_a)
        self.b.copy_(new_b)
        return new_b - x


def test_state_updates_read_the_old_values(tmp_path):
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    _session_calls(_Exchange(), x, tmp_path)
