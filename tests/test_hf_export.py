"""Hugging Face models as users export them (issue 11, items 1 and 2), on the CPU.

- transformers' GPT-2 and BERT (tiny random configs) exported by the user's own one-liner,
  `torch.export.save(torch.export.export(model, (ids,)), "m.pt2")`, no wrapper: `grace compile`
  reads the file in a fresh process (transformers' ModelOutput pytree types are imported because
  the file names them), the package's outputs carry the model's names (`logits`;
  `last_hidden_state`, `pooler_output`) and `grace run --interpret` matches eager under them.
- a pytree type nobody can import is read by name (a stand-in container keyed by its context).
- `grace.aot.compile(model, args, kwargs=...)` with `None` arguments, as torch.export takes them.
- output names from ModelOutput / dict / namedtuple keys; plain tensors keep out / out0, out1.
- the documented recipe for a decoder LM with a dynamic sequence (docs/hf.md): attention_mask
  passed explicitly (without it transformers' packed-sequence check is a cat along the dynamic
  dimension, which grace refuses — asserted too, so the recipe stays needed and true).
- weights: one buffer per storage (tied embeddings once; views of one storage read one buffer).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from torch.export import Dim  # noqa: E402

import grace.aot  # noqa: E402
from grace.aot import lower  # noqa: E402
from grace.aot.compiler import decompose, program_output_names  # noqa: E402
from grace.formats import read_package  # noqa: E402

HERE = Path(__file__).parent
VOCAB = 256


def cli(*args, timeout=300):
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "grace.tools.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def interpret_cases(package, cases: dict, tmp_path) -> dict:
    """Several input sets through the CPU reference executor in one fresh process."""
    spec, result = tmp_path / "cases.npz", tmp_path / "result.npz"
    np.savez(spec, **{f"{case}/{name}": value for case, inputs in cases.items()
                      for name, value in inputs.items()})
    proc = subprocess.run([sys.executable, str(HERE / "interpret_cases.py"), str(package),
                           str(spec), str(result)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(result))


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def gpt2(n_positions=64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                  n_positions=n_positions, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=VOCAB,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def unique_storage_nbytes(ep) -> tuple[int, int]:
    """(bytes of the program's parameters counted once per storage, counted once per name), each
    rounded up to the package's 256-byte weight alignment."""
    def aligned(n):
        return (n + 255) // 256 * 256
    by_storage, by_name = {}, 0
    for name, t in ep.state_dict.items():
        nbytes = t.numel() * t.element_size()
        by_name += aligned(nbytes)
        by_storage[t.untyped_storage().data_ptr()] = aligned(nbytes)
    return sum(by_storage.values()), by_name


# ---- the user's one-liner, through the CLI ------------------------------------------------------


@pytest.mark.slow
def test_gpt2_one_liner_compiles_and_runs_with_its_output_names(tmp_path):
    model = gpt2()
    ids = torch.randint(0, VOCAB, (1, 12))
    ep = torch.export.export(model, (ids,))            # the user's one-liner, no wrapper
    torch.export.save(ep, tmp_path / "m.pt2")
    r = cli("compile", tmp_path / "m.pt2", "-o", tmp_path / "m.grace")
    assert r.returncode == 0, r.stderr
    man = read_package(tmp_path / "m.grace").manifest
    assert [o["name"] for o in man["outputs"]] == ["logits"]
    assert [i["name"] for i in man["inputs"]] == ["input_ids"]
    # tied weights once: the LM head is the embedding table (one buffer under the first name)
    names = [w["name"] for w in man["weights"]]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    once, per_name = unique_storage_nbytes(ep)
    wte = VOCAB * 64 * 4
    assert per_name - once == wte                     # the export holds the table under two names
    # the package holds it once: its weights are the parameters by storage (plus a few folded
    # masks and position ids), one embedding table less than the parameters by name
    assert once <= man["regions"]["weights"] < once + 4096

    np.save(tmp_path / "ids.npy", ids.numpy())
    r = cli("run", tmp_path / "m.grace", "--interpret", "--input", f"input_ids={tmp_path / 'ids.npy'}",
            "--output", tmp_path / "out.npz")
    assert r.returncode == 0, r.stderr
    assert "logits" in r.stdout
    got = np.load(tmp_path / "out.npz")
    assert got.files == ["logits"]
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    assert got["logits"].shape == ref.shape
    assert rel_err(got["logits"], ref) < 1e-5


@pytest.mark.slow
def test_bert_one_liner_compiles_and_runs_with_its_output_names(tmp_path):
    model = bert()
    ids = torch.randint(0, VOCAB, (1, 11))
    torch.export.save(torch.export.export(model, (ids,)), tmp_path / "m.pt2")
    r = cli("compile", tmp_path / "m.pt2", "-o", tmp_path / "m.grace")
    assert r.returncode == 0, r.stderr
    man = read_package(tmp_path / "m.grace").manifest
    assert [o["name"] for o in man["outputs"]] == ["last_hidden_state", "pooler_output"]

    np.save(tmp_path / "ids.npy", ids.numpy())
    r = cli("run", tmp_path / "m.grace", "--interpret", "--input", f"input_ids={tmp_path / 'ids.npy'}",
            "--output", tmp_path / "out.npz")
    assert r.returncode == 0, r.stderr
    assert "last_hidden_state" in r.stdout and "pooler_output" in r.stdout   # not cut short
    got = np.load(tmp_path / "out.npz")
    assert sorted(got.files) == ["last_hidden_state", "pooler_output"]
    with torch.no_grad():
        ref = model(ids)
    for key in ("last_hidden_state", "pooler_output"):
        assert got[key].shape == tuple(ref[key].shape)
        assert rel_err(got[key], ref[key].numpy()) < 1e-5, key


def test_loading_imports_transformers_only_when_the_file_names_it(tmp_path):
    """A fresh process without transformers imported reads a transformers .pt2 (the module that
    defines its output type is imported), and a plain .pt2 does not import transformers."""
    model = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16)).eval()
    torch.export.save(torch.export.export(model, (torch.randint(0, 64, (1, 5)),)),
                      tmp_path / "hf.pt2")

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x + 1
    torch.export.save(torch.export.export(Plain(), (torch.ones(3),)), tmp_path / "plain.pt2")
    code = (
        "import sys, json\n"
        "from grace.aot.export import load, register_pytree_types\n"
        "from grace.aot.compiler import decompose, program_output_names\n"
        "out = []\n"
        "for f in sys.argv[1:]:\n"
        "    ep = load(f)\n"
        "    out.append([program_output_names(decompose(ep)), 'transformers' in sys.modules,\n"
        "                register_pytree_types(f)])\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plain.pt2"),
                        str(tmp_path / "hf.pt2")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    plain, hf = json.loads(r.stdout.strip().splitlines()[-1])
    assert plain == [["out"], False, []]
    # the real classes, not stand-ins
    assert hf == [["last_hidden_state", "pooler_output"], True, []]


class _Outputs(dict):
    """A container type registered with torch's pytree under a name no process can import."""


torch.utils._pytree.register_pytree_node(
    _Outputs, lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: _Outputs(zip(keys, values)),
    serialized_type_name="grace_test_absent_library.outputs.Outputs")


def test_an_unregistered_output_type_is_read_by_name(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            return _Outputs(scores=x * 2, hidden=x + 1)

    torch.export.save(torch.export.export(M(), (torch.ones(2, 3),)), tmp_path / "m.pt2")
    raw = cli("compile", tmp_path / "m.pt2", "-o", tmp_path / "m.grace")
    assert raw.returncode == 0, raw.stderr
    man = read_package(tmp_path / "m.grace").manifest
    assert [o["name"] for o in man["outputs"]] == ["scores", "hidden"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = interpret_cases(tmp_path / "m.grace", {"a": {"x": x}}, tmp_path)
    np.testing.assert_array_equal(got["a/scores"], x * 2)
    np.testing.assert_array_equal(got["a/hidden"], x + 1)


# ---- output names -----------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "mean spread")


class _Returns(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn, names", [
    (lambda x: x + 1, ["out"]),
    (lambda x: (x + 1,), ["out"]),
    (lambda x: (x + 1, x * 2), ["out0", "out1"]),
    (lambda x: [x + 1, (x * 2, x - 1)], ["out0", "out1", "out2"]),
    (lambda x: {"logits": x + 1}, ["logits"]),
    (lambda x: {"a.b": x + 1, "c": (x * 2, x - 1)}, ["a_b", "c_0", "c_1"]),
    (lambda x: (x + 1, {"k": x * 2}), ["out0", "out1_k"]),
    (lambda x: Pair(x.mean(), x.std()), ["mean", "spread"]),
    (lambda x: {"x": x + 1, "a-b": x * 2, "a_b": x - 1, "0": x * 3},
     ["x_2", "a_b", "a_b_2", "out0"]),   # unique, not the input's name, identifiers
])
def test_output_names_follow_the_model(fn, names):
    ep = torch.export.export(_Returns(fn), (torch.randn(2, 3),))
    assert program_output_names(decompose(ep)) == names


def test_output_names_of_a_model_output_with_nested_hidden_states():
    model = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16), add_pooling_layer=False).eval()
    ep = torch.export.export(model, (torch.randint(0, 64, (1, 5)),),
                             {"output_hidden_states": True})
    assert program_output_names(decompose(ep)) == [
        "last_hidden_state", "hidden_states_0", "hidden_states_1", "hidden_states_2"]


# ---- keyword and None example inputs ------------------------------------------------------------


class _Optional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, bias=None, scale: float = 1.0):
        h = self.proj(x) * scale
        if mask is not None:
            h = h * mask
        if bias is not None:
            h = h + bias
        return {"hidden": h, "total": h.sum(-1)}


def test_compile_takes_none_and_keyword_inputs(tmp_path):
    torch.manual_seed(0)
    model = _Optional().eval()
    x, bias = torch.randn(2, 6, 8), torch.randn(6, 8)
    n = Dim("n", min=1, max=8)
    path = grace.aot.compile(model, (x, None), kwargs={"bias": bias, "scale": 0.5},
                             dynamic_shapes={"x": {1: n}, "mask": None, "bias": {0: n},
                                             "scale": None},
                             buckets={"n": [8]}, output=tmp_path / "m.grace")
    man = read_package(path).manifest
    assert [(i["name"], i["shape"]) for i in man["inputs"]] == [("x", [2, "n", 8]),
                                                                 ("bias", ["n", 8])]
    assert [o["name"] for o in man["outputs"]] == ["hidden", "total"]
    assert man["symbols"][0]["name"] == "n"
    assert man["symbols"][0]["sources"] == [[0, 1], [1, 0]]   # indices among the tensor inputs
    x5, b5 = torch.randn(2, 5, 8), torch.randn(5, 8)
    got = interpret_cases(path, {"a": {"x": x5.numpy(), "bias": b5.numpy()}}, tmp_path)
    with torch.no_grad():
        ref = model(x5, None, bias=b5, scale=0.5)
    for key in ("hidden", "total"):
        assert rel_err(got[f"a/{key}"], ref[key].numpy()) < 1e-5, key
    # grace check takes a None argument the same way
    assert grace.aot.check(model, (x, None)).ok


# ---- a decoder LM with a dynamic sequence: the recipe of docs/hf.md ------------------------------


def test_gpt2_dynamic_sequence_needs_the_attention_mask():
    """Without attention_mask, transformers checks position_ids for packed sequences with
    torch.diff(prepend=...): a cat along the dynamic dimension, which grace cannot lower."""
    model = gpt2()
    ids = torch.randint(0, VOCAB, (1, 12))
    ep = torch.export.export(model, (ids,), dynamic_shapes={"input_ids": {1: Dim("seq", max=32)}})
    report = grace.aot.check(ep, buckets={"input_ids.1": [32]}, codegen=False)
    assert [p.op for p in report.problems] == ["aten.cat.default"]


@pytest.mark.slow
def test_gpt2_dynamic_sequence_recipe(tmp_path):
    model = gpt2()
    ids = torch.randint(0, VOCAB, (1, 12))
    seq = Dim("seq", min=1, max=24)
    ep = torch.export.export(model, (ids,), {"attention_mask": torch.ones_like(ids)},
                             dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    torch.export.save(ep, tmp_path / "gpt2.pt2")
    # what `grace compile gpt2.pt2 --buckets input_ids.1=24` does, in this process (the CLI's
    # reading of a transformers .pt2 is tested above)
    grace.aot.compile(grace.aot.export.load(tmp_path / "gpt2.pt2"), output=tmp_path / "gpt2.grace",
                      buckets={"input_ids.1": [24]})
    man = read_package(tmp_path / "gpt2.grace").manifest
    assert [i["name"] for i in man["inputs"]] == ["input_ids", "attention_mask"]
    assert [o["name"] for o in man["outputs"]] == ["logits"]
    cases, refs = {}, {}
    for case, n, pad in (("short", 7, 0), ("padded", 20, 4)):   # two lengths in one bucket
        x = torch.randint(0, VOCAB, (1, n))
        mask = torch.ones_like(x)
        if pad:
            mask[:, -pad:] = 0   # right padding: the padded positions' logits are not compared
        cases[case] = {"input_ids": x.numpy(), "attention_mask": mask.numpy()}
        with torch.no_grad():
            refs[case] = (model(x, attention_mask=mask).logits.numpy(), n - pad)
    got = interpret_cases(tmp_path / "gpt2.grace", cases, tmp_path)
    for case, (ref, real) in refs.items():
        out = got[f"{case}/logits"]
        assert out.shape == ref.shape, case
        assert rel_err(out[:, :real], ref[:, :real]) < 1e-5, case


# ---- weights: one buffer per storage ------------------------------------------------------------


class _Shared(torch.nn.Module):
    """Weights that share storage every way a module can: a tie by assignment (one Parameter
    under two names), a second Parameter object over the same storage and view, a buffer over it,
    a Parameter that is a slice of another, and Parameters that are views of a storage no weight
    spans whole (q, k, v rows of one fused matrix, and v transposed)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight                       # same Parameter
        self.head2 = torch.nn.Parameter(self.emb.weight)        # same storage, same view
        self.register_buffer("table", self.emb.weight.detach())  # a buffer over it
        self.rows = torch.nn.Parameter(self.emb.weight[8:24])   # a slice of it
        fused = torch.randn(48, 16)
        self.q = torch.nn.Parameter(fused[:16])
        self.k = torch.nn.Parameter(fused[16:32])
        self.v = torch.nn.Parameter(fused[32:])
        self.vt = torch.nn.Parameter(fused[32:].t())
        self.other = torch.nn.Linear(16, 16)                    # storage of its own

    def forward(self, ids):
        h = self.emb(ids)
        g = self.other(h)
        attn = (g @ self.q.t()) * (g @ self.k.t()) + g @ self.v.t() - g @ self.vt
        out = self.head(h) + h @ self.head2.t() + self.table[ids].sum(-1, keepdim=True)
        return out + (h @ self.rows.t()).sum(-1, keepdim=True) + attn.sum(-1, keepdim=True)


@pytest.mark.filterwarnings("ignore:No complete tensor found:UserWarning")   # torch.export.load
def test_weights_are_stored_once_per_storage(tmp_path):
    torch.manual_seed(0)
    model = _Shared().eval()
    ids = torch.randint(0, 40, (2, 7))
    ep = torch.export.export(model, (ids,))
    torch.export.save(ep, tmp_path / "m.pt2")   # and the same once saved and loaded
    for program in (ep, grace.aot.export.load(tmp_path / "m.pt2")):
        lowered = lower.lower(decompose(program))
        weights = {b.name: b.shape for b in lowered.weights}
        # the embedding's storage under the first of its names in the module's order
        assert weights == {"head2": (40, 16), "q.storage": (48 * 16,),
                           "other.weight": (16, 16), "other.bias": (16,)}, weights

    path = grace.aot.compile(model, (ids,), output=tmp_path / "m.grace")
    man = read_package(path).manifest
    # emb.weight 2560 B, q.storage 3072 B, other.weight 1024 B, other.bias 64 B (256 aligned)
    assert man["regions"]["weights"] == 2560 + 3072 + 1024 + 256
    fresh = torch.randint(0, 40, (2, 7))
    got = interpret_cases(path, {"a": {"ids": fresh.numpy()}}, tmp_path)
    with torch.no_grad():
        ref = model(fresh).numpy()
    assert rel_err(got["a/out"], ref) < 1e-5
