"""The rest of the CNN families of test_cnn_gpu.py (which says what is checked and how they
spread over the workers).

    pytest -m gpu tests/gpu/test_cnn_gpu.py tests/gpu/test_cnn_more_gpu.py
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)
pytest.importorskip("timm")

from test_cnn_gpu import check_cnn, workdir  # noqa: E402,F401 (workdir: the fixture)

MODELS = ["efficientnet_b0", "convnext_tiny"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"cnn-{n}"))
                                  for n in MODELS])
def test_timm_cnn_matches_eager(name, dtype, workdir):
    check_cnn(name, dtype, workdir)
