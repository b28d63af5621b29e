"""The CNN family on the GPU: timm models with random weights and random batch-norm statistics,
compiled with grace.aot, run by the torch-free runtime (arena poisoned with NaN) and compared
with eager — fp32 against an fp64 reference (≤ 1e-4 relative), bf16 against fp32 eager of the
same weights (≤ 2e-2). The families are shared with test_cnn_more_gpu.py, and each family is an
xdist group of its own (tests/gpu/conftest.py), so that `pytest -n 8 --dist loadgroup` spreads
them over workers: in one queue they were the GPU suite's longest (mobilenetv3 88 s and
efficientnet 79 s among them), and the fourteenth session's suite was cut at 325 s inside it.

    pytest -m gpu tests/gpu/test_cnn_gpu.py tests/gpu/test_cnn_more_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)
timm = pytest.importorskip("timm")

from grace.aot import compile as grace_compile  # noqa: E402
from grace.runtime import load  # noqa: E402

MODELS = ["resnet50", "mobilenetv3_small_100", "regnety_002"]   # here; the rest in the other file
BF16 = ["resnet50", "mobilenetv3_small_100", "efficientnet_b0"]


def make_model(name: str):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():   # fresh norms are the identity: give them real statistics
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
    return model


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_cnn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"cnn-{n}"))
                                  for n in MODELS])
def test_timm_cnn_matches_eager(name, dtype, workdir):
    check_cnn(name, dtype, workdir)


def check_cnn(name: str, dtype: str, workdir):
    if dtype == "bfloat16" and name not in BF16:
        pytest.skip("bf16 is checked on three of the five families (device time)")
    model = make_model(name)
    example = torch.randn(1, 3, 224, 224)
    if dtype == "bfloat16":
        model, example = model.to(torch.bfloat16), example.to(torch.bfloat16)
    path = workdir / f"{name}_{dtype}.grace"
    grace_compile(model, (example,), output=path, progress=False, fp32_matmul="ieee")
    pkg = load(path)
    sess = pkg.session(poison=True)
    x = torch.randn(1, 3, 224, 224)
    got = next(iter(sess.run((x.to(torch.bfloat16) if dtype == "bfloat16" else x).cuda())
                    .values())).numpy().astype(np.float64)
    with torch.no_grad():
        ref = (model.double()(x.double()) if dtype == "float32"
               else model.float()(x)).double().numpy()
    err = _rel(got, ref)
    print(f"{name} {dtype}: rel err {err:.2e}, kernels "
          f"{pkg.manifest['graphs'][0]['stats']['kernels']}")
    assert not np.isnan(got).any(), "NaN in the output: a kernel read memory nobody wrote"
    assert err <= (1e-4 if dtype == "float32" else 2e-2), f"relative error {err:.3e}"
    pkg.close()
