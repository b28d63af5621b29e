"""Split-K sums inlined into the GEMVs that read them (aot/fuse_sums.py, INLINE_SPLIT_SUMS): the
Llama decode step's down projection split over K, its partial rows and the residual added by the
next layer's q/k/v GEMV (with its RMSNorm's statistic, fuse_stats.py) and by the o projection's
epilogue, so no reduction kernel is left in the decode graph; the tokens through the CPU
reference executor equal the package built without the pass bit for bit (the same float32 adds
in the same order) and match eager. Where something other than a GEMV reads the sums (a model
output), the reduction stays."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grace.aot import codegen, fuse_sums  # noqa: E402
from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402

from test_buckets_interpret import run_cases  # noqa: E402
from test_fuse_append import _same_decodes  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def persistent_small(monkeypatch):
    """This small decoder's GEMVs in the persistent form, its down projection (K 96) over 2 K
    chunks whose partial rows a reduction sums (as the Llama-3-8B's 14336 columns are split)."""
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_MIN_K", 33)
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_MAX_K", 64)
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_SPLIT_MIN_K", 65)


def _decoder(tmp_path, name):
    from torch.export import Dim

    from grace.tools.models import CachedLlama

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96,
                        max_seq=32).eval()
    t = Dim("seq", min=1, max=32)
    path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=tmp_path / f"{name}.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         buckets={"seq": [1, 32]})
    return model, path


def _decode_families(path):
    m = read_package(path).manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    return [(m["kernels"][n["kernel"]]["family"], n.get("label", "")) for n in decode["nodes"]]


def test_decoder_sums_in_its_gemvs(tmp_path, monkeypatch, persistent_small):
    _, plain = _decoder(tmp_path, "plain")
    monkeypatch.setattr(fuse_sums, "INLINE_SPLIT_SUMS", True)
    model, inlined = _decoder(tmp_path, "inlined")
    before, after = _decode_families(plain), _decode_families(inlined)
    assert sum(f == "reduction" for f, _ in before) == 2   # the down projections' sums
    assert not any(f == "reduction" for f, _ in after)
    assert len(after) == len(before) - 2
    # layer 2's q/k/v (with the norm), the o projection after it, and the LM head took them
    taken = [label for f, label in after if "add_" in label and "mean" in label]
    assert len(taken) == 2 and any("mm_6+add" in label for _, label in after)

    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    _same_decodes(inlined, plain, idx, prompts=[6], model=model)   # the same adds, same order


class SumsAlsoOut(torch.nn.Module):
    """A split GEMV's sums plus a residual, read by a GEMV and returned as well."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Linear(96, 64, bias=False)
        self.proj = torch.nn.Linear(64, 40, bias=False)

    def forward(self, x, r):
        h = r + self.down(x)
        return self.proj(h), h * 2


def test_sums_with_another_reader_keep_their_kernel(tmp_path, monkeypatch, persistent_small):
    monkeypatch.setattr(fuse_sums, "INLINE_SPLIT_SUMS", True)
    torch.manual_seed(3)
    model = SumsAlsoOut().eval()
    x, r = torch.randn(1, 96), torch.randn(1, 64)
    path = grace_compile(model, (x, r), output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee")
    m = read_package(path).manifest
    assert "reduction" in {k["family"] for k in m["kernels"]}


class SumsIntoProj(torch.nn.Module):
    """A split GEMV's sums plus a residual (a weight here), read by one GEMV alone."""

    def __init__(self):
        super().__init__()
        self.r = torch.nn.Parameter(torch.randn(64) * 300)   # sums that round coarsely in fp16
        self.down = torch.nn.Linear(96, 64, bias=False)
        self.proj = torch.nn.Linear(64, 40, bias=False)

    def forward(self, x):
        return self.proj(self.r + self.down(x))


def test_half_precision_sums_are_rounded_as_stored(tmp_path, monkeypatch, persistent_small):
    """fp16: the GEMV adds the float32 partial rows and rounds their sum through fp16, as the
    reduction stored it (fuse_norm.stored_split_sum; the residual add stays in the GEMV's row, as
    in the package with the reduction): bit for bit that package."""
    from test_gemv_interpret import _check_half, _kernels

    torch.manual_seed(4)
    model = SumsIntoProj()
    (tmp_path / "off").mkdir()
    plain = _check_half(model, 96, tmp_path / "off")
    monkeypatch.setattr(fuse_sums, "INLINE_SPLIT_SUMS", True)
    inlined = _check_half(model, 96, tmp_path)
    assert _kernels(plain) == ["table_writer", "matmul", "reduction", "matmul"]
    assert _kernels(inlined) == ["table_writer", "matmul", "matmul"]
    x = {"x": torch.randn(1, 96).half().numpy()}
    got = run_cases(inlined, {"r": x}, tmp_path)["r"]["out"]
    want = run_cases(plain, {"r": x}, tmp_path / "off")["r"]["out"]
    np.testing.assert_array_equal(got, want)
    pkg = read_package(inlined)
    proj = bytes(pkg.section(pkg.manifest["kernels"][-1]["source"])).decode()
    row = proj.split("gdc_wait()")[1].split("for turn")[0]
    assert "t6 = t5.to(tl.float16).to(tl.float32)" in row and "t7 = x2 + t6" in row
