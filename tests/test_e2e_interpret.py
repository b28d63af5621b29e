"""End to end on the CPU: compile → package → run the package's own kernels through Triton's
interpreter (same memory plan, same argument table, arena poisoned with NaN) → compare with an
fp64 eager reference on fresh random inputs."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grace.tools import models  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402

pytestmark = pytest.mark.slow


def interpret(path, inputs: dict, tmp_path) -> dict:
    """`grace run --interpret` in a fresh process: Triton's interpreter must own its process
    (its standard library is decorated differently once the compiler has imported triton)."""
    args = []
    for name, value in inputs.items():
        f = tmp_path / f"in_{name}.npy"
        np.save(f, value)
        args += ["--input", f"{name}={f}"]
    out = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-m", "grace.tools.cli", "run", str(path), "--interpret",
                           "--output", str(out)] + args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(out))


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check(model, make_inputs, tmp_path, tol=1e-5, dtype=torch.float32):
    torch.manual_seed(0)
    model = model.eval().to(dtype)
    example = make_inputs()
    path = grace_compile(model, example, output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee")
    fresh = make_inputs()   # not the example the package was traced with
    from grace.formats import read_package
    names = [i["name"] for i in read_package(path).manifest["inputs"]]
    outs = interpret(path, {n: x.numpy() for n, x in zip(names, fresh)}, tmp_path)
    with torch.no_grad():
        ref = model.double()(*[x.double() if x.is_floating_point() else x for x in fresh])
    got = next(iter(outs.values()))
    assert not np.isnan(got).any(), "NaN in the output: a kernel read memory nobody wrote"
    assert got.shape == tuple(ref.shape)
    err = rel_err(got, ref.numpy())
    assert err < tol, f"relative error {err:.2e}"
    return err


def test_mlp(tmp_path):
    check(models.MLP(), lambda: (torch.randn(5, 64),), tmp_path)


def test_mlp_fp16(tmp_path):
    torch.manual_seed(0)
    check(models.MLP(), lambda: (torch.randn(5, 64).half(),), tmp_path, tol=2e-3,
          dtype=torch.float16)


def test_llama_block(tmp_path):
    check(models.LlamaBlock(), lambda: (torch.randn(2, 19, 64),), tmp_path)


def test_hf_gpt2(tmp_path):
    check(models.hf_gpt2(n_layer=2), lambda: (torch.randint(0, 128, (2, 17)),), tmp_path)


def test_hf_bert(tmp_path):
    check(models.hf_bert(), lambda: (torch.randint(0, 128, (1, 23)),), tmp_path)


def test_tiny_vit(tmp_path):
    check(models.TinyViT(), lambda: (torch.randn(1, 3, 32, 32),), tmp_path)


def test_many_op_kinds(tmp_path):
    class Ops(torch.nn.Module):
        def forward(self, x, idx):
            a = torch.softmax(x, dim=0) + torch.log_softmax(x, dim=-1)
            b = torch.where(x > 0, x.tanh(), torch.nn.functional.silu(x)).amax(-1, keepdim=True)
            c = torch.nn.functional.pad(x, (1, 2)).mean(-1, keepdim=True)
            d = x[idx].sum(0)                       # gather rows
            e = torch.cat([x[:, :3], x[:, 3:] * 2], dim=1).var(dim=1, keepdim=True)
            return a + b + c + d + e + torch.arange(x.shape[1])

    check(Ops(), lambda: (torch.randn(6, 10), torch.randint(0, 6, (4,))), tmp_path)


def test_split_k_gemm(tmp_path):
    """M tiny, K deep: partial sums in the arena, reduced by a second kernel with the epilogue."""
    model = torch.nn.Sequential(torch.nn.Linear(2048, 48), torch.nn.Tanh())
    check(model, lambda: (torch.randn(2, 2048),), tmp_path)


def test_split_k_of_a_batched_matmul(tmp_path):
    """Split-K over a batch: the partial sums of batch b, K range s sit at [s, b] where the
    reduction reads them (they were stored at b * split + s, summing other batches' partials:
    fixed in the twelfth session)."""
    from grace.aot import codegen
    assert codegen.gemm_plan(16, 32, 4096, 3, 4, 132).split > 1

    class Bmm(torch.nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b)

    check(Bmm(), lambda: (torch.randn(3, 16, 4096), torch.randn(3, 4096, 32)), tmp_path)


def test_attention_longer_than_one_key_block(tmp_path):
    """Key loops of several blocks, a partial last block, causal skipping and an additive mask."""
    class Attn(torch.nn.Module):
        def forward(self, q, k, v, bias):
            causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return causal + masked

    def inputs():
        return (torch.randn(1, 2, 150, 32), torch.randn(1, 2, 150, 32), torch.randn(1, 2, 150, 32),
                torch.randn(150, 150))

    check(Attn(), inputs, tmp_path)
