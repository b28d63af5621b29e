"""Order-dependent ops end to end on the CPU (aot/lower_scan.py): argmax/argmin, max/min with
indices, cumsum/cumprod, sort and topk compiled, run through the package's own kernels in Triton's
interpreter and compared with torch eager — indices exactly, with torch's rules for ties (first
index, stable sorts), NaN (largest; wins max/min) and -0.0 == 0.0."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot.lower import LoweringError  # noqa: E402
from tests.test_buckets_interpret import run_cases  # noqa: E402

pytestmark = pytest.mark.slow


def check(model, example, cases: dict, tmp_path, exact=(), tol=1e-5, dynamic_shapes=None,
          skip=None):
    """Compile `model` at `example`, run every case (a tuple of inputs) and compare each output
    with eager at the inputs' own dtype: outputs whose position is in `exact` (or that are
    integers) must be equal, the others within `tol` relative error (NaN where eager has NaN);
    `skip`: {case: output positions not compared}."""
    model = model.eval()
    path = grace_compile(model, example, output=tmp_path / "m.grace", progress=False,
                         dynamic_shapes=dynamic_shapes)
    from grace.formats import read_package
    names = [i["name"] for i in read_package(path).manifest["inputs"]]
    results = run_cases(path, {c: {n: x.numpy() for n, x in zip(names, xs)}
                               for c, xs in cases.items()}, tmp_path)
    for case, xs in cases.items():
        got = results[case]
        assert "error" not in got, got["error"]
        with torch.no_grad():
            refs = [r.numpy() for r in tree_leaves(model(*xs))]
        outs = [got[k] for k in sorted((k for k in got if k.startswith("out")),
                                       key=lambda k: int(k[3:] or 0))]
        assert len(outs) == len(refs)
        for i, (o, r) in enumerate(zip(outs, refs)):
            if i in (skip or {}).get(case, ()):
                continue
            where = f"case {case}, output {i}"
            assert o.shape == r.shape and o.dtype == r.dtype, (where, o.shape, r.shape, o.dtype,
                                                                r.dtype)
            if i in exact or not np.issubdtype(r.dtype, np.floating):
                np.testing.assert_array_equal(o, r, err_msg=where)
            else:
                o64, r64 = o.astype(np.float64), r.astype(np.float64)
                assert (np.isnan(o64) == np.isnan(r64)).all(), where
                ok = ~np.isnan(r64)
                err = np.linalg.norm(o64[ok] - r64[ok]) / max(np.linalg.norm(r64[ok]), 1e-30)
                assert err < tol, f"{where}: relative error {err:.2e}"


def ties_and_nans(shape, seed):
    """Few distinct values (many ties), some NaN, -0.0 next to 0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float() * 0.5
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 11)]] = float("nan")
    flat[torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 7)]] = -0.0
    return x


class ArgOps(torch.nn.Module):
    def forward(self, x, y, z):
        mx = torch.max(x, 1)
        mn = torch.min(y, 0, keepdim=True)
        return (torch.argmax(x, 1), torch.argmin(x, 0, keepdim=True), torch.argmax(y),
                torch.argmin(y, dim=1), mx.values, mx.indices, mn.values, mn.indices,
                x.max(), y.min(), torch.argmax(z), torch.max(z, 0).indices,
                torch.argmax(x.exp() - 1.0, dim=0))


def test_arg_reductions(tmp_path):
    torch.manual_seed(0)
    cases = {
        "random": (torch.randn(6, 33), torch.randn(7, 1000), torch.randint(-5, 5, (9,))),
        "ties_nan": (ties_and_nans((6, 33), 1), ties_and_nans((7, 1000), 2),
                     torch.tensor([3, -1, 3, 4, 4, 0, 4, 2, 1])),
        "all_equal": (torch.zeros(6, 33), torch.full((7, 1000), -0.0),
                      torch.full((9,), -2**63, dtype=torch.int64)),
    }
    check(ArgOps(), cases["random"], cases, tmp_path, exact=range(13))


class ScanOps(torch.nn.Module):
    def forward(self, x, p, n, s):
        return (torch.cumsum(x, 1), torch.cumprod(p, 0), torch.cumsum(n, -1),
                torch.cumprod(n, 0), torch.cumsum(x.t(), 0, dtype=torch.float64),
                torch.cumsum(s, 0), torch.cumsum(x > 0, 1), torch.cumsum(x[:, :1], 1))


def test_scans(tmp_path):
    """cumsum over 5000 columns (two column blocks: the carry), cumprod down the rows, int64
    input (exact), a dtype kwarg, a 0-d input, bool input (int64 result) and a single column."""
    torch.manual_seed(0)

    def inputs():
        return (torch.randn(3, 5000), 1 + 0.1 * torch.randn(33, 7),
                torch.randint(-2**20, 2**20, (5, 7)), torch.randn(()))

    check(ScanOps(), inputs(), {"a": inputs(), "b": inputs()}, tmp_path, tol=1e-5)


class SortOps(torch.nn.Module):
    def forward(self, x, y, w, one, n):
        s = torch.sort(x)                                         # last dim, 7 columns
        d = torch.sort(y, dim=0, descending=True, stable=True)    # 33 rows, down the columns
        t = torch.topk(w, 5)                                      # 1000 columns
        u = torch.topk(w, 3, dim=1, largest=False)
        # torch's topk orders tied elements arbitrarily: its indices are checked through the
        # values they pick (ours put the first index first, as the stable sort does)
        return (s.values, s.indices, d.values, d.indices, t.values, w.gather(1, t.indices),
                u.values, w.gather(1, u.indices),
                torch.argsort(x, dim=1, descending=True, stable=True),
                torch.sort(one).indices, torch.sort(one, dim=0).values, torch.sort(x[0, 0]).values,
                torch.topk(x[:, 0] * 2, 1).values, torch.sort(y > 0, dim=0, stable=True).indices,
                t.indices, u.indices,
                # 64-bit values: (key, column) pairs
                torch.sort(n, dim=0, descending=True, stable=True).indices,
                torch.sort(x.double(), dim=0, stable=True).indices,
                torch.topk(y.double(), 2, 0).values)


def test_sort_and_topk(tmp_path):
    torch.manual_seed(0)

    def make(f):
        ints = torch.randint(-2**40, 2**40, (9, 4), generator=torch.Generator().manual_seed(7))
        return (f((4, 7), 1), f((33, 3), 2), f((2, 1000), 3), f((5, 1), 4), (ints % 5 - 2) * 2**40)

    def rand(shape, seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    cases = {"random": make(rand), "ties_nan": make(ties_and_nans)}
    check(SortOps(), cases["random"], cases, tmp_path, exact=range(19),
          skip={"ties_nan": {14, 15}})


class HalfOps(torch.nn.Module):
    def forward(self, x):
        s = torch.sort(x, dim=1, descending=True, stable=True)
        return s.values, s.indices, torch.cumsum(x, 1), torch.argmax(x, 1), torch.topk(x, 4).values


def test_fp16(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(5, 37).half()
    check(HalfOps(), (x,), {"a": (x,), "ties": (ties_and_nans((5, 37), 5).half(),)}, tmp_path,
          exact=(0, 1, 3, 4), tol=2e-3)


class DynOps(torch.nn.Module):
    def forward(self, x):
        s = torch.sort(x, dim=1, descending=True, stable=True)
        return (torch.cumsum(x, 1), torch.argmax(x, 1), torch.max(x, 0).indices, s.values,
                s.indices, torch.topk(x, 2, dim=0).indices)


def test_dynamic_dimension(tmp_path):
    """The scanned / sorted / reduced dimension is dynamic: padding past the true length never
    takes part (buckets of 16 and 64, true lengths below them)."""
    torch.manual_seed(0)
    cases = {f"L{n}": (torch.randn(3, n),) for n in (1, 13, 40)}
    cases["L40_ties"] = (ties_and_nans((3, 40), 6),)
    check(DynOps(), (torch.randn(3, 20),), cases, tmp_path, exact=(1, 2, 3, 4, 5),
          dynamic_shapes={"x": {1: Dim("n", min=1, max=64)}})


def test_refusals(tmp_path):
    class Long(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x).values

    with pytest.raises(LoweringError, match="at most 4096"):
        grace_compile(Long(), (torch.randn(2, 5000),), output=tmp_path / "a.grace",
                      progress=False)
