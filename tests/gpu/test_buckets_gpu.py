"""Shape buckets on the GPU: one package with a dynamic sequence dimension serves every length with
one graph per bucket, results equal to exact-size eager runs, and no graph is instantiated twice.

Run on the H200 with `pytest -m gpu tests/gpu`. The arena is poisoned with NaN; fp32 models are
compared with fp64 eager (tf32x3 GEMMs), bf16 models with an fp32 eager run of the same weights.
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
from grace.tools import models  # noqa: E402

MAX = 512
LENGTHS = (1, 17, 100, 129, 300, MAX)
CASES = {
    # name: (model factory, input factory (length) -> tensor, input name, fp32 tol, bf16 tol)
    "bert": (lambda: models.hf_bert(layers=4, hidden=768, heads=12, vocab=30522, max_pos=MAX),
             lambda n: torch.randint(0, 30522, (1, n)), "input_ids", 1e-3, 3e-2),
    "llama_block": (lambda: models.LlamaBlock(dim=256, n_heads=8, n_kv_heads=4, hidden=688,
                                              max_seq=MAX),
                    lambda n: torch.randn(1, n, 256), "x", 1e-3, 3e-2),
}


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_buckets")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_length_matches_eager(case, dtype, workdir):
    make_model, make_input, name, tol32, tol16 = CASES[case]
    torch.manual_seed(0)
    model = make_model().eval()
    cast = (lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t) \
        if dtype == "bfloat16" else (lambda t: t)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    path = workdir / f"{case}_{dtype}.grace"
    grace_compile(model, (cast(make_input(17)),), output=path, progress=False,
                  dynamic_shapes={name: {1: Dim("seq", min=1, max=MAX)}})
    sess = load(path).session(poison=True)
    errors = {}
    for n in LENGTHS + (5, 99):           # back into smaller buckets after larger ones
        x = cast(make_input(n))
        got = next(iter(sess.run(x.cuda()).values())).numpy()
        with torch.no_grad():
            if dtype == "float32":
                ref = model.double()(x.double() if x.is_floating_point() else x)
                model.float()
            else:
                ref = model.float()(x.float() if x.is_floating_point() else x)
                model.to(torch.bfloat16)
        ref = ref[0] if isinstance(ref, tuple) else getattr(ref, "last_hidden_state", ref)
        ref = ref.float().numpy()
        assert got.shape == ref.shape, (n, got.shape, ref.shape)
        assert not np.isnan(got.astype(np.float32)).any(), f"length {n}: NaN in the output"
        errors[n] = _rel(got, ref)
    print(f"\n{case} {dtype}: " + ", ".join(f"L={n}: {e:.1e}" for n, e in errors.items()))
    tol = tol32 if dtype == "float32" else tol16
    assert max(errors.values()) < tol, errors
    # one instantiation per bucket touched, however often the length changed inside it
    assert all(count == 1 for count in sess.instantiations.values()), sess.instantiations


def test_no_reinstantiation_inside_a_bucket(workdir):
    torch.manual_seed(0)
    model = models.LlamaBlock(dim=64, max_seq=256).eval()
    path = workdir / "llama_small.grace"
    grace_compile(model, (torch.randn(1, 20, 64),), output=path, progress=False,
                  buckets={"seq": [64, 256]},
                  dynamic_shapes={"x": {1: Dim("seq", min=1, max=256)}})
    sess = load(path).session()
    for n in (33, 34, 64, 1, 63, 200, 65, 256, 2):
        sess.run(torch.randn(1, n, 64, device="cuda"))
        assert sess.last_graph == ("seq=64" if n <= 64 else "seq=256")
    assert sess.instantiations == {"seq=64": 1, "seq=256": 1}


class _Prefix(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        return x[:k] * 2


@pytest.mark.parametrize("model, make", [
    (None, lambda g: (torch.randn(64, 33, generator=g),)),
    (_Prefix(), lambda g: (torch.randn(40, 8, generator=g), torch.randint(0, 41, (), generator=g))),
], ids=["mask_select", "slice_by_item"])
def test_data_dependent_sizes(model, make, workdir):
    class MaskRows(torch.nn.Module):
        def forward(self, x):
            return x[x[:, 0] > 0] + 1

    model = model or MaskRows()
    g = torch.Generator().manual_seed(0)
    path = workdir / f"dd_{type(model).__name__}.grace"
    grace_compile(model, make(g), output=path, progress=False)
    sess = load(path).session(poison=True)
    for _ in range(3):
        args = make(g)
        out = sess.run(*[a.cuda() for a in args])["out"]
        ref = model(*args)
        assert tuple(out.shape) == tuple(ref.shape)
        assert np.allclose(out.numpy(), ref.numpy(), atol=1e-6)
