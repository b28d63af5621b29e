"""Shape buckets end to end on the CPU: one package with a dynamic sequence dimension, run through
the CPU reference executor (the package's own kernels, memory plan and table, arena poisoned with
NaN) at lengths that are and are not bucket sizes, each compared with an exact-size fp64 eager run.
Also the data-dependent sizes (nonzero, boolean masks, a length read from a tensor) and the errors
for sizes outside the exported range."""
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
from grace.tools import models  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = pathlib.Path(__file__).with_name("interpret_cases.py")
MAX = 256
LENGTHS = (1, 17, 100, 129, MAX)


def run_cases(path, cases: dict, tmp_path) -> dict:
    """{case: {input: array}} -> {case: {output / "graph" / "error": value}} in one process."""
    spec, result = tmp_path / "cases.npz", tmp_path / "result.npz"
    np.savez(spec, **{f"{c}/{n}": a for c, inputs in cases.items() for n, a in inputs.items()})
    proc = subprocess.run([sys.executable, str(WORKER), str(path), str(spec), str(result)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict = {}
    with np.load(result) as data:
        for key in data.files:
            case, name = key.split("/", 1)
            out.setdefault(case, {})[name] = data[key]
    return out


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check_lengths(model, make_input, input_name, tmp_path, buckets=None, lengths=LENGTHS):
    model = model.eval()
    path = grace_compile(model, (make_input(17),), output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee", buckets=buckets,
                         dynamic_shapes={input_name: {1: Dim("seq", min=1, max=MAX)}})
    inputs = {f"L{n}": make_input(n) for n in lengths}
    results = run_cases(path, {c: {input_name: x.numpy()} for c, x in inputs.items()}, tmp_path)
    graphs = {}
    with torch.no_grad():
        reference = model.double()
        for case, x in inputs.items():
            got = results[case]
            assert "error" not in got, got.get("error")
            ref = reference(x.double() if x.is_floating_point() else x).numpy()
            out = got["out"]
            assert out.shape == ref.shape, (case, out.shape, ref.shape)
            assert not np.isnan(out).any(), f"{case}: NaN — a kernel read padding or unwritten memory"
            err = rel_err(out, ref)
            assert err < 1e-5, f"{case}: relative error {err:.2e}"
            graphs[case] = str(got["graph"])
    return graphs


def test_llama_block_at_every_length(tmp_path):
    torch.manual_seed(0)
    graphs = check_lengths(models.LlamaBlock(max_seq=MAX), lambda n: torch.randn(1, n, 64), "x",
                           tmp_path)
    # default buckets (1, 16, 32, ..., 256): the smallest that fits serves each length
    assert graphs == {"L1": "seq=1", "L17": "seq=32", "L100": "seq=128", "L129": "seq=256",
                      f"L{MAX}": "seq=256"}


def test_hf_bert_at_every_length(tmp_path):
    torch.manual_seed(0)
    graphs = check_lengths(models.hf_bert(max_pos=MAX), lambda n: torch.randint(0, 128, (1, n)),
                           "input_ids", tmp_path, buckets={"seq": [32, 128, MAX]})
    assert graphs["L1"] == graphs["L17"] == "seq=32" and graphs["L129"] == f"seq={MAX}"


def test_sizes_outside_the_range_are_refused_before_running(tmp_path):
    model = models.MLP().eval()
    path = grace_compile(model, (torch.randn(4, 64),), output=tmp_path / "m.grace",
                         progress=False, dynamic_shapes={"x": {0: Dim("batch", min=2, max=40)}})
    results = run_cases(path, {"big": {"x": np.zeros((41, 64), np.float32)},
                               "small": {"x": np.zeros((1, 64), np.float32)},
                               "width": {"x": np.zeros((4, 65), np.float32)},
                               "ok": {"x": np.ones((3, 64), np.float32)}}, tmp_path)
    assert "41" in str(results["big"]["error"]) and "batch" in str(results["big"]["error"])
    assert "error" in results["small"] and "error" in results["width"]
    with torch.no_grad():
        ref = model(torch.ones(3, 64)).numpy()
    assert np.allclose(results["ok"]["out"], ref, atol=1e-5)


# ---- data-dependent sizes: one graph, sizes computed on the device -----------------------------
class NonZero(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0)


class MaskSelect(torch.nn.Module):
    def forward(self, x, m):
        return x[m] * 2


class PositiveSum(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum() + x.sum()


class Prefix(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        return x[:k] + 1


@pytest.mark.parametrize("model, make", [
    (NonZero(), lambda g: (torch.randn(5, 7, generator=g),)),
    (MaskSelect(), lambda g: (torch.randn(9, 3, generator=g), torch.rand(9, generator=g) > 0.5)),
    (PositiveSum(), lambda g: (torch.randn(33, generator=g),)),
    (Prefix(), lambda g: (torch.randn(12, 4, generator=g), torch.randint(0, 13, (), generator=g))),
], ids=["nonzero", "mask_select", "mask_sum", "slice_by_item"])
def test_data_dependent_sizes(model, make, tmp_path):
    g = torch.Generator().manual_seed(0)
    path = grace_compile(model, make(g), output=tmp_path / "m.grace", progress=False)
    trials = {f"t{i}": make(g) for i in range(3)}
    names = [p for p in model.forward.__code__.co_varnames[1:model.forward.__code__.co_argcount]]
    results = run_cases(path, {t: {n: a.numpy() for n, a in zip(names, args)}
                               for t, args in trials.items()}, tmp_path)
    for t, args in trials.items():
        ref = model(*args).numpy()
        got = results[t]["out"]
        assert got.shape == ref.shape, (t, got.shape, ref.shape)
        if ref.dtype.kind in "iub":
            assert np.array_equal(got, ref)
        else:
            assert np.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_batch_and_sequence_both_dynamic(tmp_path):
    """Two symbols: graphs for the product of their buckets; GEMMs see [B*S] rows whose valid
    rows are not a prefix (both factors masked)."""
    torch.manual_seed(0)
    model = models.hf_bert(max_pos=64).eval()
    path = grace_compile(model, (torch.randint(0, 128, (2, 9)),), output=tmp_path / "m.grace",
                         progress=False, fp32_matmul="ieee",
                         buckets={"batch": [2, 4], "seq": [16, 64]},
                         dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=4),
                                                       1: Dim("seq", min=1, max=64)}})
    from grace.formats import read_package
    assert len(read_package(path).manifest["graphs"]) == 4
    shapes = {"a": (1, 5), "b": (3, 17), "c": (2, 16), "d": (4, 64)}
    inputs = {c: torch.randint(0, 128, s) for c, s in shapes.items()}
    results = run_cases(path, {c: {"input_ids": x.numpy()} for c, x in inputs.items()}, tmp_path)
    with torch.no_grad():
        for c, x in inputs.items():
            ref = model.double()(x).numpy()
            got = results[c]["out"]
            assert got.shape == ref.shape and not np.isnan(got).any()
            assert rel_err(got, ref) < 1e-5, c
    assert str(results["b"]["graph"]) == "batch=4,seq=64"


def test_split_k_gemm_with_dynamic_rows(tmp_path):
    """Few rows, deep K: partial sums per K chunk, reduced by a second kernel, rows masked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 48), torch.nn.Tanh()).eval()
    path = grace_compile(model, (torch.randn(3, 2048),), output=tmp_path / "m.grace",
                         progress=False, fp32_matmul="ieee",
                         dynamic_shapes=({0: Dim("rows", min=1, max=16)},))
    from grace.formats import read_package
    assert "reduction" in [k["family"] for k in read_package(path).manifest["kernels"]]
    inputs = {f"r{n}": torch.randn(n, 2048) for n in (1, 5, 16)}
    results = run_cases(path, {c: {"input": x.numpy()} for c, x in inputs.items()}, tmp_path)
    with torch.no_grad():
        for c, x in inputs.items():
            assert rel_err(results[c]["out"], model.double()(x.double()).numpy()) < 1e-5, c


class _NegativeIndex(torch.nn.Module):
    def forward(self, x):
        return x[:, torch.tensor([-1, 0, -3])] * 2


class _SizedArange(torch.nn.Module):
    """Position ids that start after a cache: arange(P, P + S)."""

    def forward(self, cache, x):
        p, s = cache.shape[0], x.shape[0]
        return x + torch.arange(p, p + s)[:, None].float() + torch.arange(s - 1, -1, -1)[:, None]


class _SquaredSize(torch.nn.Module):
    def forward(self, x):
        return (x @ x.T).mean() + x


class _MaskTwice(torch.nn.Module):
    def forward(self, x, y, m):
        return x[m] + y[m]


@pytest.mark.parametrize("model, make, shapes", [
    (_NegativeIndex(), lambda n: (torch.randn(3, n),), ({1: Dim("s", min=3, max=64)},)),
    (_SizedArange(), lambda n: (torch.randn(n + 2, 4), torch.randn(n, 4)),
     ({0: Dim("p", min=1, max=80)}, {0: Dim("s", min=1, max=64)})),
    (_SquaredSize(), lambda n: (torch.randn(n, 8),), ({0: Dim("s", min=1, max=64)},)),
    (_MaskTwice(), lambda n: (torch.randn(n, 3), torch.randn(n, 3), torch.rand(n) > 0.5),
     ({0: Dim("s", min=2, max=64)}, {0: Dim("s", min=2, max=64)}, {0: Dim("s", min=2, max=64)})),
], ids=["negative_index", "sized_arange", "squared_size", "mask_twice"])
def test_sizes_used_as_values(model, make, shapes, tmp_path):
    """Sizes that become data (an index wrapped by the true size, arange bounds, a mean over S²)
    are read on the device, so non-bucket sizes give exact results."""
    path = grace_compile(model, make(17), output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee", dynamic_shapes=shapes)
    names = model.forward.__code__.co_varnames[1:model.forward.__code__.co_argcount]
    trials = {f"n{n}": make(n) for n in (5, 17, 40)}
    results = run_cases(path, {t: {k: a.numpy() for k, a in zip(names, args)}
                               for t, args in trials.items()}, tmp_path)
    for t, args in trials.items():
        ref = model(*args).numpy()
        got = results[t]["out"]
        assert got.shape == ref.shape, t
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-5), t


def test_item_beyond_its_checked_range_is_clamped_not_read_past(tmp_path):
    """torch raises when n.item() breaks its torch._check; grace clamps n on the device to the
    sliced tensor's size instead of reading past it."""
    path = grace_compile(Prefix(), (torch.randn(12, 4), torch.tensor(3)),
                         output=tmp_path / "m.grace", progress=False)
    x = torch.randn(12, 4)
    results = run_cases(path, {"over": {"x": x.numpy(), "n": np.array(40)}}, tmp_path)
    assert np.allclose(results["over"]["out"], (x + 1).numpy())


class _ExpSum(torch.nn.Module):
    def forward(self, x):
        return x.exp().sum(0)


def test_a_bucket_of_one_on_a_range_from_zero_is_refused(tmp_path):
    """exp(x).sum(0) over no rows is 0, but a graph at bound 1 lowers the dimension as size 1 and
    would sum the one row it assumes is there (exp(0) = 1): a bucket of 1 for a range from 0 is
    refused; from 1 it is the default (one size: a static graph) and right at size 1."""
    from grace.aot.lower import LoweringError

    with pytest.raises(LoweringError, match="range starts at 0, would also serve size 0"):
        grace_compile(_ExpSum(), (torch.randn(3, 4),), output=tmp_path / "m.grace",
                      progress=False, buckets={"n": [1, 16]},
                      dynamic_shapes={"x": {0: Dim("n", min=0, max=16)}})
    path = grace_compile(_ExpSum(), (torch.randn(3, 4),), output=tmp_path / "m1.grace",
                         progress=False, dynamic_shapes={"x": {0: Dim("n", min=1, max=16)}})
    x1, x5 = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)[:, :1], \
        np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    results = run_cases(path, {"one": {"x": x1[0]}, "five": {"x": x5}}, tmp_path)
    assert str(results["one"]["graph"]) == "n=1" and str(results["five"]["graph"]) == "n=16"
    np.testing.assert_allclose(results["one"]["out"], np.exp(x1[0]).sum(0), rtol=1e-6)
    np.testing.assert_allclose(results["five"]["out"], np.exp(x5).sum(0), rtol=1e-6)
