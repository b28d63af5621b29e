"""The decode kernels on the real runtime (H200): split-KV attention over a 2048-slot cache
filled to several positions (whole splits masked out), and GEMV projections at Llama-1B widths,
in fp32 (against fp64) and bf16 (against torch's bf16), in NaN-poisoned sessions.

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import copy
import pathlib
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot.codegen import attention_plan  # noqa: E402
from grace.aot.lower import DEFAULT_OPTIONS  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.runtime import load  # noqa: E402

try:
    from tests.gemv_forms import FORMS, MlpStep, check_form_sources, set_form  # noqa: E402
except ImportError:  # run from another directory: tests/ is the parent of this file's directory
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from gemv_forms import FORMS, MlpStep, check_form_sources, set_form  # noqa: E402


class DecodeAttention(torch.nn.Module):
    """q [1, 32, 1, 64] against an 8-head cache of 2048 slots, GQA, additive mask, o-projection."""

    def __init__(self):
        super().__init__()
        self.wo = torch.nn.Linear(2048, 2048, bias=False)

    def forward(self, q, k, v, mask):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(1, 1, 2048))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(pos, dtype, gen):
    q = torch.randn(1, 32, 1, 64, generator=gen).to(dtype)
    k = torch.randn(1, 8, 2048, 64, generator=gen).to(dtype)
    v = torch.randn(1, 8, 2048, 64, generator=gen).to(dtype)
    mask = torch.zeros(1, 1, 1, 2048, dtype=dtype)
    mask[..., pos + 1:] = float("-inf")
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_attention_and_gemv(tmp_path, dtype):
    assert attention_plan(1, 32, 1, 2048, DEFAULT_OPTIONS["sm_count"]).split >= 8
    torch.manual_seed(0)
    model = DecodeAttention().eval().to(dtype)
    gen = torch.Generator().manual_seed(1)
    path = grace_compile(model, _inputs(10, dtype, gen), output=tmp_path / "d.grace",
                         progress=False, fp32_matmul="ieee")
    pkg = load(path)
    sess = pkg.session(poison=True)
    for pos in (0, 200, 1000, 1500, 2047):
        args = _inputs(pos, dtype, gen)
        got = sess.run(*[a.cuda() for a in args])
        got = torch.from_numpy(np.asarray(next(iter(got.values())).numpy(), np.float32))
        with torch.no_grad():
            ref64 = model.double()(*[a.double() for a in args])
            model.to(dtype)
            ref = model.cuda()(*[a.cuda() for a in args]).float().cpu()
            model.cpu()
        assert torch.isfinite(got).all()
        if dtype == torch.float32:
            assert _rel(got, ref64) < 1e-5, (pos, _rel(got, ref64))
        else:   # bf16: as far from fp64 as torch's own bf16 is, give or take
            assert _rel(got, ref64) < 2 * _rel(ref, ref64) + 1e-3, (pos, _rel(got, ref64))
    sess.close()
    pkg.close()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_forms_with_programmatic_edges(tmp_path, dtype, form, monkeypatch):
    """Each GEMV form of tests/gemv_forms.py (set_form: the knobs of each, all but
    `paired-persistent` off by default) behind programmatic edges, 100 calls with fresh inputs in
    a NaN-poisoned session (a race shows up as a rare mismatch), against fp64 (fp32) or torch's
    bf16. tests/test_gemv_form_packages.py checks the same packages' sources without a GPU."""
    set_form(monkeypatch, form)
    torch.manual_seed(0)
    model = MlpStep().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    path = grace_compile(model, (torch.randn(1, 1, 4096, generator=gen).to(dtype),),
                         output=tmp_path / "m.grace", progress=False, fp32_matmul="ieee")
    check_form_sources(read_package(path), form)
    gpu_model, model64 = copy.deepcopy(model).cuda(), copy.deepcopy(model).double()
    pkg = load(path)
    sess = pkg.session(poison=True)
    for _ in range(100):
        x = torch.randn(1, 1, 4096, generator=gen).to(dtype)
        got = torch.from_dlpack(sess.run(x.cuda())["out"]).float().cpu()
        with torch.no_grad():
            ref = gpu_model(x.cuda()).float().cpu()
            ref64 = model64(x.double())
        assert torch.isfinite(got).all()
        err = _rel(got, ref64)
        if dtype == torch.float32:
            assert err < 1e-5, err
        else:   # bf16: as far from fp64 as torch's own bf16 is, give or take
            assert err < 2 * _rel(ref, ref64) + 1e-3, (err, _rel(ref, ref64))
    sess.close()
    pkg.close()


class NormGemvStep(torch.nn.Module):
    """An RMSNorm then a projection of K 2048 (the template GEMV, as Llama-1B's q/k/v)."""

    def __init__(self):
        super().__init__()
        self.norm_w = torch.nn.Parameter(torch.rand(2048) + 0.5)
        self.proj = torch.nn.Linear(2048, 3072, bias=False)

    def forward(self, x):
        return self.proj(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_gemv_row_with_programmatic_edges(tmp_path, dtype, monkeypatch):
    """fuse_rows.STORE_GEMV_ROWS (the default, set here so the test holds if the default moves):
    the mean's kernel stores the normalised row, the template GEMV behind a programmatic edge
    streams it; 100 fresh calls in a NaN-poisoned session (a race
    shows up as a rare mismatch), against fp64 (fp32) or torch's bf16."""
    from grace.aot import fuse_rows
    monkeypatch.setattr(fuse_rows, "STORE_GEMV_ROWS", True)
    torch.manual_seed(0)
    model = NormGemvStep().eval()
    with torch.no_grad():
        model.proj.weight.normal_(0, 0.02)
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    path = grace_compile(model, (torch.randn(1, 1, 2048, generator=gen).to(dtype),),
                         output=tmp_path / "m.grace", progress=False, fp32_matmul="ieee")
    pkg = read_package(path)
    assert any("stat = red[:, None]" in bytes(pkg.section(k["source"])).decode()
               for k in pkg.manifest["kernels"] if k["family"] == "reduction")
    gpu_model, model64 = copy.deepcopy(model).cuda(), copy.deepcopy(model).double()
    pkg = load(path)
    sess = pkg.session(poison=True)
    for _ in range(100):
        x = torch.randn(1, 1, 2048, generator=gen).to(dtype)
        got = torch.from_dlpack(sess.run(x.cuda())["out"]).float().cpu()
        with torch.no_grad():
            ref = gpu_model(x.cuda()).float().cpu()
            ref64 = model64(x.double())
        assert torch.isfinite(got).all()
        err = _rel(got, ref64)
        if dtype == torch.float32:
            assert err < 1e-5, err
        else:
            assert err < 2 * _rel(ref, ref64) + 1e-3, (err, _rel(ref, ref64))
    sess.close()
    pkg.close()


class SoftmaxTimesValues(torch.nn.Module):
    """Decode attention's second product, unfused: a softmax row of dynamic length times values."""

    def forward(self, scores, values):
        return torch.bmm(torch.softmax(scores, -1), values)


def test_persistent_gemv_of_a_dynamic_k(tmp_path):
    """The persistent GEMV over a dynamic K served by a 4096 bucket: the columns past the true
    length hold NaN in a poisoned arena and must be masked, at lengths that are not the
    bucket's, 20 fresh calls each, against fp64."""
    from torch.export import Dim
    model = SoftmaxTimesValues().eval()
    gen = torch.Generator().manual_seed(2)
    s = Dim("s", min=2049, max=4096)
    path = grace_compile(model, (torch.randn(2, 1, 3000, generator=gen),
                                 torch.randn(2, 3000, 8, generator=gen)),
                         output=tmp_path / "m.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"scores": {2: s}, "values": {1: s}}, buckets={"s": [4096]})
    pkg = read_package(path)
    assert any("for turn in range(" in bytes(pkg.section(k["source"])).decode()
               for k in pkg.manifest["kernels"] if k["family"] == "matmul")
    pkg = load(path)
    sess = pkg.session(poison=True)
    for n in (2049, 3001, 4095, 4096):
        for _ in range(20):
            args = (torch.randn(2, 1, n, generator=gen) * 4, torch.randn(2, n, 8, generator=gen))
            got = torch.from_dlpack(sess.run(*[a.cuda() for a in args])["out"]).cpu()
            ref64 = model(*[a.double() for a in args])
            assert torch.isfinite(got).all()
            assert _rel(got, ref64) < 1e-5, (n, _rel(got, ref64))
    sess.close()
    pkg.close()
