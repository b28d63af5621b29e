"""aot/fuse_splitk.py (off by default: correct on the H200, and slower): a split-K matmul sums
its own splits, the tile's last program applying the epilogue, and the reduction kernel goes.
Through the CPU reference executor (programs one after another, so the arrival counting is
exercised but not its memory ordering: tests/gpu/test_fuse_splitk_gpu.py): values against eager
and against the package without the pass, the race proof, and the arrival words back at zero
after each call."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import fuse_splitk  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402
from test_decode_knobs import _check_against_eager  # noqa: E402

ON = "sk:fuse_splitk.SPLIT_K_IN_KERNEL=True"


class _LinearResidual(torch.nn.Module):
    """Few rows, deep K (a split-K GEMM, or a GEMV at one row) with an epilogue that reads
    another input: tanh(x W^T + b) + r."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2048, 48)

    def forward(self, x, r):
        return torch.tanh(self.lin(x)) + r


class _Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


def _compile(model, args, path, on, **options):
    with applied(parse_variant(ON) if on else None):
        return grace_compile(model, args, output=path, progress=False, fp32_matmul="ieee",
                             **options)


def _families(path):
    m = read_package(path).manifest
    return [[m["kernels"][n["kernel"]]["family"] for n in g["nodes"]] for g in m["graphs"]]


def _fused_sources(path):
    pkg = read_package(path)
    return [(k, bytes(pkg.section(k["source"])).decode()) for k in pkg.manifest["kernels"]
            if k["family"] == "matmul" and "atomic_add" in bytes(pkg.section(k["source"])).decode()]


def _check_package(path):
    pkg = read_package(path)
    assert races.check_races(pkg.manifest) == [] and races.check_pre_wait(pkg) == []
    assert fuse_splitk.ARRIVALS in [e["name"] for e in pkg.manifest["state"]]
    fused = _fused_sources(path)
    assert fused
    for kernel, src in fused:
        # stores its partial sums, counts itself, and the last program stores the output and
        # puts the word back: three parameters written
        assert len(kernel["writes"]) == 3
        assert src.index("tl.debug_barrier()") < src.index("tl.atomic_add(")
        assert src.index("tl.atomic_add(") < src.index("tl.atomic_xchg(")
        assert 'cache_modifier=".cg"' in src


def _arrivals_zero(sess):
    assert not sess.read_state()[fuse_splitk.ARRIVALS].any()


def test_off_by_default(tmp_path):
    torch.manual_seed(0)
    model = _LinearResidual().eval()
    path = grace_compile(model, (torch.randn(2, 2048), torch.randn(2, 48)),
                         output=tmp_path / "m.grace", progress=False)
    assert fuse_splitk.SPLIT_K_IN_KERNEL is False
    assert "reduction" in _families(path)[0]
    assert fuse_splitk.ARRIVALS not in [e["name"] for e in read_package(path).manifest["state"]]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_split_k_gemm_reduces_its_own_splits(tmp_path, dynamic):
    """Static rows, and dynamic ones (padding rows masked, the bucket's GEMM split 4 ways, the
    one-row bucket a GEMV): no reduction kernel is left, and the values are eager's and the
    unfused package's, over several calls (the arrival words go back to zero each time)."""
    torch.manual_seed(0)
    model = _LinearResidual().eval()
    args = (torch.randn(3, 2048), torch.randn(3, 48))
    dyn = None
    if dynamic:
        rows = Dim("rows", min=1, max=16)
        dyn = ({0: rows}, {0: rows})
    off = _compile(model, args, tmp_path / "off.grace", False, dynamic_shapes=dyn)
    on = _compile(model, args, tmp_path / "on.grace", True, dynamic_shapes=dyn)
    assert any("reduction" in f for f in _families(off))
    assert not any("reduction" in f for f in _families(on))
    _check_package(on)
    sess_on, sess_off = InterpretSession(on), InterpretSession(off)
    for n in ((1, 5, 16) if dynamic else (3, 3)):
        x, r = torch.randn(n, 2048), torch.randn(n, 48)
        got = sess_on.run({"x": x.numpy(), "r": r.numpy()})["out"]
        want = sess_off.run({"x": x.numpy(), "r": r.numpy()})["out"]
        with torch.no_grad():
            ref = model.double()(x.double(), r.double()).numpy()
        model.float()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
        _arrivals_zero(sess_on)


def test_edge_values_and_one_row(tmp_path):
    """Five rows of edge values (the rows=16 bucket: its GEMM split 4 ways, summed in the
    kernel): ±0.5, tiny and huge magnitudes, ±inf and NaN in x. Each split's partial sum carries
    them, the last program adds them: inf, -inf and NaN land where the unfused package puts them
    (bit for bit, NaN at NaN) and where eager does; the finite values match eager. One row takes
    the rows=1 bucket (an unsplit GEMV at K 2048; split GEMVs: test_a_decode_steps_split_gemvs),
    which must still agree."""
    torch.manual_seed(0)
    model = _LinearResidual().eval()
    rows = Dim("rows", min=1, max=16)
    args = (torch.randn(3, 2048), torch.randn(3, 48))
    off = _compile(model, args, tmp_path / "off.grace", False, dynamic_shapes=({0: rows}, {0: rows}))
    on = _compile(model, args, tmp_path / "on.grace", True, dynamic_shapes=({0: rows}, {0: rows}))
    x = torch.randn(5, 2048)
    x[0] = 0.5
    x[1] = -0.5
    x[2] *= 1e-30
    x[3] *= 1e30
    x[4, 7], x[4, 1500], x[3, 100] = float("inf"), float("nan"), float("-inf")
    assert _fused_sources(on)   # the rows=16 bucket's GEMM
    cases = {"edge": x, "one row": torch.randn(1, 2048)}
    for name, xs in cases.items():
        r = torch.randn(xs.shape[0], 48)
        got = InterpretSession(on).run({"x": xs.numpy(), "r": r.numpy()})["out"]
        want = InterpretSession(off).run({"x": xs.numpy(), "r": r.numpy()})["out"]
        np.testing.assert_array_equal(got, want, err_msg=name)
        with torch.no_grad():
            ref = model.double()(xs.double(), r.double()).numpy()
        model.float()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=name)
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(got[~finite], ref[~finite], err_msg=name)
        np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_batched_split_k_matmul(tmp_path):
    """Split-K over a batch of 3: each batch's tiles have arrival words of their own."""
    torch.manual_seed(0)
    args = (torch.randn(3, 16, 4096), torch.randn(3, 4096, 32))
    on = _compile(_Bmm(), args, tmp_path / "on.grace", True)
    assert "reduction" not in _families(on)[0]
    _check_package(on)
    sess = InterpretSession(on)
    for _ in range(2):
        a, b = torch.randn(3, 16, 4096), torch.randn(3, 4096, 32)
        got = sess.run({"a": a.numpy(), "b": b.numpy()})["out"]
        ref = torch.bmm(a.double(), b.double()).numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
        _arrivals_zero(sess)


def test_a_decode_steps_split_gemvs(tmp_path):
    """The down projections of a decode step, split as the default splits K >= 8192 (here K
    2048): each GEMV sums its own splits and adds the residual; prompt and decode steps against
    eager; generate() gives eager's greedy tokens."""
    from grace.tools.interpret import generate_package

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=2048,
                        max_seq=16).eval()
    t = Dim("seq", min=1, max=16)
    with applied(parse_variant(f"{ON},codegen.GEMV_SPLIT_MIN_K=2048")):
        path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / "d.grace", progress=False, fp32_matmul="ieee",
                             dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, 16]}, sm_count={"sm_90": 2},
                             generate={"tokens": "idx", "positions": "input_pos"})
    m = read_package(path).manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    names = {k["name"] for k, _ in _fused_sources(path)}
    fused = [n for n in decode["nodes"] if m["kernels"][n["kernel"]]["name"] in names]
    assert len(fused) == 2   # one down projection per layer
    _check_package(path)
    _check_against_eager(model, path, after_step=_arrivals_zero)
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(3))
    assert generate_package(path, prompt.numpy(), 4).tolist() == model.greedy(prompt, 4)


def test_a_model_buffer_of_the_state_entrys_name_is_refused():
    from grace.aot.ir import Buffer, Program
    from grace.aot.lower import LoweringError

    taken = Buffer(fuse_splitk.ARRIVALS, "state", "int32", (4,), 1)
    with pytest.raises(LoweringError, match="which grace uses"):
        fuse_splitk.add_state(Program([], [], [], [], {}, state=[taken], next_index=2))
