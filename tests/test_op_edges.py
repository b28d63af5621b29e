"""Edge cases found by running PyTorch OpInfo samples through grace: empty and 0-d tensors,
unbounded data-dependent sizes, and the numerics of pow, round, expm1/log1p and integer division.

Each model is compiled, its package run by the CPU reference executor (`grace run --interpret`,
the package's own kernels under Triton's interpreter) and every output compared with torch eager:
shape and dtype with the fp32 run, values with the fp64 run (rounded to the output's dtype, so an
overflow to inf in fp32 is expected), element by element in relative error; integer outputs must
be exact, NaN and inf must sit where torch puts them."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot.lower import LoweringError  # noqa: E402

pytestmark = pytest.mark.slow


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def interpret(path, names, inputs, tmp_path, tag) -> list[np.ndarray]:
    args = []
    for name, value in zip(names, inputs):
        f = tmp_path / f"{tag}_{name}.npy"
        np.save(f, value.numpy())
        args += ["--input", f"{name}={f}"]
    out = tmp_path / f"{tag}_out.npz"
    proc = subprocess.run([sys.executable, "-m", "grace.tools.cli", "run", str(path), "--interpret",
                           "--output", str(out)] + args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = dict(np.load(out))
    return [outs[k] for k in sorted(outs, key=lambda k: int(k[3:] or 0))]


def check(fn, *input_sets, tmp_path, rtol=2e-6):
    """Compile fn on the first input set, run every set, compare with eager torch."""
    from grace.formats import read_package

    model = Fn(fn).eval()
    path = grace_compile(model, input_sets[0], output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee")
    names = [i["name"] for i in read_package(path).manifest["inputs"]]
    for n, inputs in enumerate(input_sets):
        got = interpret(path, names, inputs, tmp_path, f"run{n}")
        with torch.no_grad():
            ref32 = fn(*inputs)
            ref64 = fn(*[x.double() if x.is_floating_point() else x for x in inputs])
        if isinstance(ref32, torch.Tensor):
            ref32, ref64 = (ref32,), (ref64,)
        assert len(got) == len(ref32)
        for k, (g, r32, r64) in enumerate(zip(got, ref32, ref64)):
            where = f"input set {n}, output {k}"
            assert g.shape == tuple(r32.shape), f"{where}: shape {g.shape} != {tuple(r32.shape)}"
            assert str(g.dtype) == str(r32.dtype).replace("torch.", ""), f"{where}: dtype {g.dtype}"
            ref = r64.to(r32.dtype).numpy()
            if not r32.is_floating_point():
                np.testing.assert_array_equal(g, ref, err_msg=where)
                continue
            g64, ref64_ = g.astype(np.float64), ref.astype(np.float64)
            assert np.array_equal(np.isnan(g64), np.isnan(ref64_)), f"{where}: NaN at {g} vs {ref}"
            finite = np.isfinite(ref64_)
            assert np.array_equal(g64[~finite], ref64_[~finite], equal_nan=True), f"{where}: {g} vs {ref}"
            err = np.abs(g64[finite] - ref64_[finite]) / np.maximum(np.abs(ref64_[finite]), 1e-37)
            assert err.size == 0 or err.max() <= rtol, \
                f"{where}: relative error {err.max():.2e} at {g[finite][err.argmax()]} " \
                f"(torch: {ref[finite][err.argmax()]})"


# ---- crashes ---------------------------------------------------------------------------------
def test_empty_outputs_and_inputs(tmp_path):
    """Kernels with nothing to write are dropped (a grid of 0 programs is invalid); outputs with
    a 0 dimension come back empty, in their shape and dtype; reductions over nothing give
    torch's 0 (sum) and nan (mean)."""
    def fn(x, e):
        return (torch.linspace(0, 1, 0) + x.sum(), torch.logspace(0, 1, 0),
                torch.eye(0), torch.signal.windows.hann(0),
                torch.split_with_sizes(x, [0, 3], 0)[0] * 2, x + 1,
                e * 2, e.sum(0), e.mean(0), torch.cat([e, e + 1], 1), e.long(),
                torch.nonzero(e))
    check(fn, (torch.randn(3), torch.randn(0, 3)), tmp_path=tmp_path)


def test_zero_dim_tensors(tmp_path):
    """0-d tensors take dim 0 / -1 (mean, var, index_select, gather, transpose), nonzero gives
    [1, 0] or [0, 0], and softplus / soft_margin_loss on 0-d values (their wrong results were
    log1p's cancellation: exp(-24) vanished in 1.0 + x)."""
    def fn(x, i, v):
        return (x.mean(0, keepdim=True), x.mean(-1), x.var(0, correction=0),
                torch.index_select(x, 0, i.view(1)), torch.index_select(v, 0, i),
                torch.gather(x, 0, i), x.transpose(0, -1) * 3,
                torch.nonzero(x), torch.nonzero(x, as_tuple=True)[0],
                F.softplus(x, beta=3, threshold=0.2),
                F.soft_margin_loss(x, x * 0.5 + 2.0))
    check(fn, (torch.tensor(-8.3), torch.tensor(0), torch.randn(4)),
          (torch.tensor(0.0), torch.tensor(0), torch.randn(4)),
          (torch.tensor(5.0), torch.tensor(0), torch.randn(4)), tmp_path=tmp_path)


def test_take_with_0d_negative_and_empty_indices(tmp_path):
    """torch.take: torch's own decomposition (flat[index]) made a 0-d index a data-dependent
    Python int and crashed the compile (the OpInfo sweep's one crash, thirty-ninth session);
    grace decomposes it into an index of the flattened tensor. Positions counted from the end,
    an index of several dimensions and of none, a 0-d source."""
    def fn(x, i, s, j, k, e):
        return (torch.take(x, i), torch.take(s, j), torch.take(x, k), torch.take(s, j.view(1)),
                torch.take(x, e))
    check(fn, (torch.randn(3, 4), torch.tensor([[0, -1], [5, 11]]), torch.tensor(-2.5),
               torch.tensor(0), torch.tensor(7), torch.zeros(0, dtype=torch.long)),
          (torch.randn(3, 4), torch.tensor([[-12, 3], [2, 10]]), torch.tensor(4.0),
           torch.tensor(-1), torch.tensor(-5), torch.zeros(0, dtype=torch.long)),
          tmp_path=tmp_path)


def test_sizes_without_a_bound_are_a_clear_error(tmp_path):
    """tensor_split at indices held in a tensor: .item() sizes with no upper bound. torch's
    int_oo claims is_finite, so it used to reach int() deep inside sympy."""
    model = Fn(lambda x, idx: torch.tensor_split(x, idx)[1])
    with pytest.raises(LoweringError, match="no upper bound"):
        grace_compile(model, (torch.randn(5, 5), torch.tensor([2, 4])),
                      output=tmp_path / "m.grace", progress=False)


def test_max_unpool_with_a_leftover_size_symbol(tmp_path):
    """max_unpool's decomposition leaves a size symbol (with an infinite upper bound) that sizes
    nothing: it is not a data-dependent size."""
    idx = torch.tensor([[[1], [2]]])
    check(lambda x, i: F.max_unpool1d(x, i, 3, 2, 0, output_size=[1, 2, 3]),
          (torch.randn(1, 2, 1), idx), tmp_path=tmp_path)


# ---- numerics --------------------------------------------------------------------------------
SPECIAL = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 8388609.0, 1e-30, -1e-30, 1e-8, -1e-8,
           1e30, -1e30, 0.0, -3.0, 2.0, 88.0, -104.0, 1e-4, -0.9999, float("inf"), float("-inf"),
           float("nan")]


def test_round_half_to_even(tmp_path):
    x = torch.tensor(SPECIAL)
    check(lambda x, one: (torch.round(x), torch.round(x, decimals=1), torch.round(x, decimals=-1),
                          torch.round(one)),
          (x, torch.tensor([2.5])), tmp_path=tmp_path)


def test_expm1_log1p_near_zero(tmp_path):
    x = torch.cat([torch.tensor(SPECIAL), torch.logspace(-30, 1, 40), -torch.logspace(-30, 1, 40)])
    check(lambda x: (torch.expm1(x), torch.log1p(x)), (x,), tmp_path=tmp_path, rtol=1e-6)


def test_pow_negative_bases_and_special_values(tmp_path):
    base = torch.tensor([-2.0, -2.0, -2.0, -1.5, -1.0, -1.0, 0.0, 0.0, 0.0, 3.0, 1.0, float("nan"),
                         -3.0, 0.5, -0.5, 7.0, float("-inf"), 2.0])
    expo = torch.tensor([3.0, 2.0, -3.0, 0.5, float("inf"), 5.0, 0.0, -1.0, 2.0, 0.0, float("nan"),
                         0.0, 4.0, float("inf"), -float("inf"), 1.5, 3.0, -126.0])
    check(lambda a, b: (torch.pow(a, b), a ** 3, a ** -2, a ** 0, a ** 0.5, a ** 2.5, a ** 101,
                        a ** 1000.0, a ** 1e9, a ** float("inf"), a ** float("nan"), 2.0 ** b),
          (base, expo), tmp_path=tmp_path, rtol=1e-5)


BIG = 2**40 + 3


def test_integer_division_and_pow_are_exact(tmp_path):
    """Integer floor/trunc division, remainder and fmod with negative operands and values past
    2^24 (exact: no float round trip), and integer pow."""
    a = torch.tensor([100000001, -7, 7, -7, -100000001, BIG, -BIG, 0, 5, 6, -6, 1, -1, 3])
    b = torch.tensor([3, 2, -2, -2, 3, 7, 5, 3, -3, -3, 4, -5, -5, 2])
    e = torch.tensor([2, 3, 0, 5, 1, 1, 1, 7, 2, 3, 4, -1, -3, 39])
    check(lambda a, b, e: (a // b, torch.div(a, b, rounding_mode="trunc"),
                           torch.div(a, b, rounding_mode="floor"), torch.remainder(a, b),
                           torch.fmod(a, b), a % 3, a * 2 - 1, a ** 2, torch.pow(b, e),
                           torch.pow(a, e.clamp(max=1)), a.double() // 3.0),
          (a, b, e), tmp_path=tmp_path)


def test_float_division_modes(tmp_path):
    a = torch.tensor([7.0, -7.0, 7.5, -7.5, 1e-30, 1e30, 0.0, 5.0])
    b = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, 7.0, 3.0, -0.5])
    check(lambda a, b: (torch.div(a, b, rounding_mode="floor"),
                        torch.div(a, b, rounding_mode="trunc"), torch.remainder(a, b),
                        torch.fmod(a, b)),
          (a, b), tmp_path=tmp_path, rtol=1e-6)


# ---- found by the full sweep on the H200 (fp32 + fp16, 2 samples, edge samples) ---------------
def test_matmul_with_an_empty_dimension(tmp_path):
    """mm / linear with M, K or N = 0: an empty result, or zeros plus the bias when K = 0 (the
    extents of a view of an empty tensor divided by 0 before)."""
    check(lambda a, b, w, bias: (a @ b, F.linear(a, w, bias)),
          (torch.randn(0, 5), torch.randn(5, 10), torch.randn(4, 5), torch.randn(4)),
          tmp_path=tmp_path)
    check(lambda a, b, w, bias: (a @ b, F.linear(a, w, bias), a[:, :0] @ b[:0],
                                 F.linear(a[:, :0], w[:, :0], bias), a @ b[:, :0]),
          (torch.randn(3, 5), torch.randn(5, 10), torch.randn(4, 5), torch.randn(4)),
          tmp_path=tmp_path, rtol=1e-5)


def test_bitwise_not_of_integers_and_bools(tmp_path):
    """~x is bitwise for integers (it was a logical not: ~16777217 gave 0) and logical for bools;
    uint8 stays in 8 bits."""
    check(lambda a, b, c: (~a, ~b, ~c, torch.logical_not(a), torch.bitwise_not(a + 1)),
          (torch.tensor([BIG, -BIG, 2**24 + 1, 0, -1, 7]),
           torch.tensor([0, 1, 255, 7], dtype=torch.uint8),
           torch.tensor([True, False])), tmp_path=tmp_path)


def test_float_to_uint8_goes_through_int64(tmp_path):
    """torch defines float -> uint8 as float -> int64 -> uint8 (-1.5 -> 255), where a direct
    conversion is undefined and the GPU saturates to 0: the kernel converts in two steps."""
    from grace.formats import read_package

    x = torch.tensor([-1.5, -0.5, 0.5, 1.5, -100.0, 254.9, -3.0])
    check(lambda x: (x.byte(), x.to(torch.uint8) + 1, x.char()), (x,), tmp_path=tmp_path)
    pkg = read_package(tmp_path / "m.grace")
    sources = [bytes(pkg.section(f"src/{k['name']}.py")).decode() for k in pkg.manifest["kernels"]
               if k["family"] != "table_writer"]
    assert any(".to(tl.int64).to(tl.uint8)" in s for s in sources)


def test_fp16_adaptive_pooling_loads_scalars(tmp_path):
    """Windows at computed indices (adaptive pooling) load through a pointer whose alignment
    Triton cannot see: a vectorized fp16 load there gave twice the right value on the H200
    (tests/gpu/test_op_regressions_gpu.py checks the values there)."""
    from grace.formats import read_package

    x = torch.randn(8, 8, 8, 8, dtype=torch.float16)
    path = grace_compile(Fn(lambda x: F.adaptive_avg_pool3d(x, (5, 7, 4))).eval(), (x,),
                         output=tmp_path / "p.grace", progress=False)
    pkg = read_package(path)
    kernel = next(k for k in pkg.manifest["kernels"] if k["family"] == "reduction")
    source = bytes(pkg.section(f"src/{kernel['name']}.py")).decode()
    assert "p0u = p0 + (tl.program_id(0) >> 31)" in source
    assert "tl.load(p0u + " in source
    got = interpret(path, ["args_0"], (x,), tmp_path, "ap")[0]
    want = F.adaptive_avg_pool3d(x.double(), (5, 7, 4)).numpy()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)
