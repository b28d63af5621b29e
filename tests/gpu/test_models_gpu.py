"""End to end on the GPU: compile with grace.aot, run with the torch-free runtime, compare with eager.

Run on the H200 with `pytest -m gpu tests/gpu`. Each case draws fresh random inputs, poisons the
arena with NaN, and measures ‖out − ref‖ / ‖ref‖ against an fp64 eager reference (fp32 models; tf32
GEMMs allowed) or an fp32 eager run of the same weights (bf16 models).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from grace.tools import models  # noqa: E402
from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import load  # noqa: E402


def _timm_vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_small_patch16_224", pretrained=False).eval()


CASES = {
    # name: (model factory, input factory, fp32 tolerance, bf16 tolerance)
    "mlp": (lambda: models.MLP(), lambda: torch.randn(8, 64), 1e-3, 2e-2),
    "llama_block": (lambda: models.LlamaBlock(dim=256, n_heads=8, n_kv_heads=4, hidden=688),
                    lambda: torch.randn(1, 40, 256), 1e-3, 3e-2),
    "gpt2_6l": (lambda: models.hf_gpt2(n_layer=6, n_embd=768, n_head=12, vocab=50257,
                                       n_positions=1024),
                lambda: torch.randint(0, 50257, (1, 32)), 1e-3, 3e-2),
    "bert": (lambda: models.hf_bert(layers=4, hidden=768, heads=12, vocab=30522, max_pos=512),
             lambda: torch.randint(0, 30522, (1, 128)), 1e-3, 3e-2),
    "vit_s": (_timm_vit, lambda: torch.randn(1, 3, 224, 224), 1e-3, 3e-2),
}


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_models")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_eager(case, dtype, workdir):
    make_model, make_input, tol32, tol16 = CASES[case]
    torch.manual_seed(0)
    model = make_model().eval()
    example = make_input()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        if example.is_floating_point():
            example = example.to(torch.bfloat16)
    path = workdir / f"{case}_{dtype}.grace"
    grace_compile(model, (example,), output=path, archs=("sm_90",), progress=False)
    pkg = load(path)
    sess = pkg.session(poison=True)
    for trial in range(2):  # fresh inputs each time; the same graph serves both
        x = make_input()
        if dtype == "bfloat16" and x.is_floating_point():
            x = x.to(torch.bfloat16)
        out = sess.run(x.cuda())
        got = next(iter(out.values())).numpy()
        with torch.no_grad():
            if dtype == "float32":
                ref_model = model.double()
                ref = ref_model(x.double() if x.is_floating_point() else x)
                model.float()
            else:
                ref_model = model.float()
                ref = ref_model(x.float() if x.is_floating_point() else x)
                model.to(torch.bfloat16)
        ref = ref.float().numpy()
        assert not np.isnan(got).any(), f"{case}/{dtype}: NaN in output (unwritten memory read?)"
        err = _rel(got, ref)
        tol = tol32 if dtype == "float32" else tol16
        print(f"{case} {dtype} trial {trial}: rel err {err:.2e} "
              f"kernels {pkg.manifest['graphs'][0]['stats']['kernels']}")
        assert err <= tol, f"{case}/{dtype}: relative error {err:.3e} > {tol}"
    pkg.close()


@pytest.mark.parametrize("case", ["gpt2_6l", "vit_s"])
def test_torch_free_process_runs_package(case, workdir):
    """`grace run` in a process that never imports torch: inputs and outputs through .npy files,
    compared with fp64 eager here."""
    make_model, make_input, tol32, _ = CASES[case]
    torch.manual_seed(0)
    model = make_model().eval()
    x = make_input()
    path = workdir / f"{case}_torchfree.grace"
    grace_compile(model, (x,), output=path, progress=False)
    pkg_input = load(path).manifest["inputs"][0]["name"]
    np.save(workdir / "x.npy", x.numpy())
    guard = ("import sys, runpy; sys.argv = ['grace', 'run', %r, '--input', '%s=%s', "
             "'--output', %r]; "
             "\ntry:\n    runpy.run_module('grace.tools.cli', run_name='__main__')\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "bad = [m for m in ('torch', 'triton') if m in sys.modules]\n"
             "assert not bad, bad\nprint('TORCH_FREE_OK')") % (
        str(path), pkg_input, str(workdir / "x.npy"), str(workdir / "out.npz"))
    proc = subprocess.run([sys.executable, "-c", guard], capture_output=True, text=True)
    assert proc.returncode == 0 and "TORCH_FREE_OK" in proc.stdout, proc.stdout + proc.stderr
    got = next(iter(np.load(workdir / "out.npz").values()))
    with torch.no_grad():
        ref = model.double()(x.double() if x.is_floating_point() else x).numpy()
    err = _rel(got, ref)
    print(f"{case} torch-free process: rel err {err:.2e}")
    assert err <= tol32
