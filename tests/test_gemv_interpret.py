"""GEMV (one row of A: decode steps, batch-1 vectors) through the CPU reference executor against
torch in fp64: ragged N and K, bias and activation epilogues, W or W^T, batched, fp16, a
dynamic row count whose bucket is 1, and a dynamic K. One kernel per product (no split-K
partial sums), checked from the package. Rows of 2049-4096 columns take the persistent form
(codegen._gemv_persistent); the long-row form (the next K step's weights in flight) is a knob."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402

from test_buckets_interpret import rel_err, run_cases  # noqa: E402

pytestmark = pytest.mark.slow


class Proj(torch.nn.Module):
    """A linear layer with a GELU and a residual: the decode step's shape of work."""

    def __init__(self, k, n, bias=True):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=bias)
        self.skip = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) + self.skip


class RightWeight(torch.nn.Module):
    """x @ W with W stored [K, N] (the weight's contiguous axis is N, not K)."""

    def __init__(self, k, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x):
        return x @ self.w


class Batched(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


def _kernels(path, graph=None):
    m = read_package(path).manifest
    graphs = m["graphs"] if graph is None else [g for g in m["graphs"] if g["name"] == graph]
    return [m["kernels"][node["kernel"]]["family"] for g in graphs for node in g["nodes"]]


def _check(model, inputs: dict, tmp_path, dynamic_shapes=None, buckets=None, runs=None, tol=1e-6,
           **options):
    model = model.eval()
    names = list(inputs)
    path = grace_compile(model, tuple(torch.as_tensor(v) for v in inputs.values()),
                         output=tmp_path / "m.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes=dynamic_shapes, buckets=buckets, **options)
    runs = runs or [inputs]
    got = run_cases(path, {f"r{i}": {n: np.asarray(v) for n, v in r.items()}
                           for i, r in enumerate(runs)}, tmp_path)
    for i, r in enumerate(runs):
        out = got[f"r{i}"]
        assert "error" not in out, out.get("error")
        with torch.no_grad():
            ref = model.double()(*[torch.as_tensor(r[n]).double()
                                   if torch.as_tensor(r[n]).is_floating_point()
                                   else torch.as_tensor(r[n]) for n in names])
        model.float()
        assert out["out"].shape == tuple(ref.shape)
        assert np.isfinite(out["out"]).all()
        assert rel_err(out["out"], ref.numpy()) < tol, (i, rel_err(out["out"], ref.numpy()))
    return path


def test_linear_with_ragged_sizes_and_epilogue(tmp_path):
    torch.manual_seed(0)
    path = _check(Proj(300, 37), {"x": torch.randn(1, 300)}, tmp_path)
    # one kernel computes the product and its epilogue: no split-K partial sums to reduce
    assert _kernels(path).count("matmul") == 1 and "reduction" not in _kernels(path)


def test_long_k_without_bias(tmp_path):
    torch.manual_seed(1)
    _check(Proj(2500, 70, bias=False), {"x": torch.randn(1, 1, 2500)}, tmp_path)


def test_weight_stored_k_by_n(tmp_path):
    torch.manual_seed(2)
    _check(RightWeight(96, 130), {"x": torch.randn(1, 96)}, tmp_path)


def test_batched_rows(tmp_path):
    torch.manual_seed(3)
    _check(Batched(), {"a": torch.randn(3, 1, 40), "b": torch.randn(3, 40, 24)}, tmp_path)


def _check_half(model, k: int, tmp_path, **options):
    """`model` in float16 on a float16 row of K columns, against float64: the package's path."""
    model, x = model.half().eval(), torch.randn(1, k).half()
    path = grace_compile(model, (x,), output=tmp_path / "m.grace", progress=False, **options)
    got = run_cases(path, {"r": {"x": x.numpy()}}, tmp_path)["r"]["out"]
    with torch.no_grad():
        ref = model.double()(x.double())
    assert got.dtype == np.float16 and rel_err(got, ref.numpy()) < 2e-3
    return path


def test_half_precision(tmp_path):
    torch.manual_seed(4)
    _check_half(Proj(96, 64), 96, tmp_path)


def test_dynamic_rows_in_a_bucket_of_one(tmp_path):
    torch.manual_seed(5)
    x = torch.randn(3, 64)
    path = _check(Proj(64, 48), {"x": x}, tmp_path,
                  dynamic_shapes={"x": {0: Dim("rows", min=1, max=8)}}, buckets={"rows": [1, 8]},
                  runs=[{"x": torch.randn(1, 64)}, {"x": torch.randn(5, 64)}])
    assert "reduction" not in _kernels(path, "rows=1")


def test_dynamic_k(tmp_path):
    torch.manual_seed(6)
    s = Dim("s", min=1, max=64)
    _check(Batched(), {"a": torch.randn(2, 1, 20), "b": torch.randn(2, 20, 8)}, tmp_path,
           dynamic_shapes={"a": {2: s}, "b": {1: s}}, buckets={"s": [16, 64]},
           runs=[{"a": torch.randn(2, 1, n), "b": torch.randn(2, n, 8)} for n in (10, 16, 40)])


def test_weights_of_several_k_steps_load_before_the_wait(tmp_path, monkeypatch):
    """GEMV_PREFETCH_STEPS > 1 (measured slower in the decode graph, kept as a knob): each early
    step's weight tile is loaded before gdc_wait(), the ragged last step after it, and the
    product is unchanged."""
    from grace.aot import codegen
    from grace.formats.races import check_pre_wait

    monkeypatch.setattr(codegen, "GEMV_PREFETCH_STEPS", 2)
    monkeypatch.setattr(codegen, "GEMV_PREFETCH_ALL_MAX_BYTES", 0)   # not every step: 288 KB
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_MAX_K", 0)   # the template, not persistent
    torch.manual_seed(5)
    path = _check(Proj(3000, 24, bias=False), {"x": torch.randn(1, 3000)}, tmp_path, tol=1e-5)
    pkg = read_package(path)
    assert check_pre_wait(pkg) == []
    src = next(bytes(pkg.section(k["source"])).decode() for k in pkg.manifest["kernels"]
               if k["family"] == "matmul")
    before, after = src.split("gdc_wait()")
    assert "b_early =" in before and "b_early1 =" in before and "b_early2" not in src
    assert "for kk in range(2048, 3000, 1024)" in after


@pytest.fixture
def gemv_forms(monkeypatch):
    """The long-row GEMV form, off by default (it slowed the 8B decode graph: the comment at
    codegen.GEMV_PERSISTENT_MIN_K), turned on as a variant would, beside the persistent form."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "GEMV_LONG_K", 4096)


def test_default_plans_of_the_decode_gemvs():
    """Llama-3-8B's decode GEMVs of K 4096 (qkv, gate+up) take the persistent form at 2 programs
    per SM, tiles of 4 rows; the down projection (K 14336) and every K-2048 GEMV (Llama-3.2-1B)
    the template, one K step of 1024 columns a time, nothing ahead."""
    from grace.aot import codegen
    for n, k in ((6144, 4096), (28672, 4096), (128256, 4096)):
        plan = codegen.gemm_plan(1, n, k, 1, 2, 132)
        assert (plan.gemv, plan.bn, plan.bk, plan.programs, plan.split) == \
            (True, 4, 4096, 2 * 132, 1), (n, k)
    for n, k in ((4096, 14336), (3072, 2048), (16384, 2048), (2048, 8192)):
        plan = codegen.gemm_plan(1, n, k, 1, 2, 132)
        assert (plan.gemv, plan.bk, plan.programs, plan.ahead) == (True, 1024, 0, 0), (n, k, plan)


def test_the_long_row_knob_picks_its_tiles(gemv_forms):
    from grace.aot import codegen
    plan = codegen.gemm_plan(1, 4096, 14336, 1, 2, 132)
    assert (plan.bn, plan.bk, plan.programs, plan.ahead) == (4, 512, 0, 1)


def _matmul_source(path) -> str:
    pkg = read_package(path)
    return next(bytes(pkg.section(k["source"])).decode() for k in pkg.manifest["kernels"]
                if k["family"] == "matmul")


def test_persistent_gemv_walks_ragged_tiles_in_several_turns(tmp_path):
    """K 3000 (one tile of 4096 columns, masked) and N 37 (10 tiles of 4 rows, the last ragged) on
    a part of 2 multiprocessors: 4 programs, 3 turns each, the last turn past the last tile for
    two; the first tile's weights before gdc_wait() and nothing else."""
    from grace.formats.races import check_pre_wait

    torch.manual_seed(7)
    path = _check(Proj(3000, 37), {"x": torch.randn(1, 3000)}, tmp_path, tol=1e-5,
                  sm_count={"sm_90": 2})
    assert check_pre_wait(read_package(path)) == []
    before, after = _matmul_source(path).split("gdc_wait()")
    assert "b_next =" in before and "for turn in range(0, 3)" in after


@pytest.mark.parametrize("model, k", [(lambda: Proj(3000, 1), 3000), (lambda: Proj(4096, 0), 4096),
                                      (lambda: RightWeight(2500, 3), 2500)],
                         ids=["one-output", "no-output", "weight-k-major"])
def test_persistent_gemv_edges(tmp_path, model, k):
    """One output column (one ragged tile), none (an empty product), and W stored [K, N]."""
    torch.manual_seed(12)
    _check(model(), {"x": torch.randn(1, k)}, tmp_path, tol=1e-5)


def test_persistent_gemv_of_batched_activations(tmp_path):
    """Both operands activations (no weight to load before the wait), three batch rows."""
    torch.manual_seed(8)
    path = _check(Batched(), {"a": torch.randn(3, 1, 2304), "b": torch.randn(3, 2304, 10)},
                  tmp_path, tol=1e-5)
    src = _matmul_source(path)
    assert "for turn in range(" in src and "b_next =" in src.split("gdc_wait()")[1]


class BatchedOfIntermediates(torch.nn.Module):
    """The row a softmax written to the arena (decode attention's probabilities times values):
    past its true K the arena holds whatever it held (NaN in the executor), so only the
    kernel's own K mask keeps it out of the sum."""

    def forward(self, a, b):
        return torch.bmm(torch.softmax(a, -1), b)


def test_persistent_gemv_of_a_dynamic_k(tmp_path):
    """K a dynamic extent served by a bucket of 4096 (the persistent form's one tile): columns
    past the true K are masked, not summed, at sizes that are not the bucket's."""
    torch.manual_seed(11)
    s = Dim("s", min=2049, max=4096)
    path = _check(BatchedOfIntermediates(),
                  {"a": torch.randn(2, 1, 3000), "b": torch.randn(2, 3000, 8)},
                  tmp_path, dynamic_shapes={"a": {2: s}, "b": {1: s}}, buckets={"s": [4096]},
                  runs=[{"a": torch.randn(2, 1, n), "b": torch.randn(2, n, 8)}
                        for n in (2049, 3001, 4096)], tol=1e-5)
    assert "for turn in range(" in _matmul_source(path)


def test_long_row_loads_the_next_k_step_ahead(tmp_path, gemv_forms):
    """K 5000 (past GEMV_LONG_K): 4 x 512 tiles, the ragged last step masked, each step's
    weights loaded one step ahead of the sum; the first step's before gdc_wait()."""
    torch.manual_seed(9)
    path = _check(Proj(5000, 30), {"x": torch.randn(1, 5000)}, tmp_path, tol=1e-5)
    before, after = _matmul_source(path).split("gdc_wait()")
    assert "rk_next = tl.arange(0, 512)" in before and "b_next =" in before
    assert "for kk in range(0, 5000, 512)" in after and "b = b_next" in after


def test_long_row_in_half_precision(tmp_path, gemv_forms):
    torch.manual_seed(10)
    path = _check_half(Proj(4608, 16), 4608, tmp_path)
    assert "b = b_next" in _matmul_source(path)


def test_persistent_tiles_widened_at_the_multiply(tmp_path, monkeypatch):
    """GEMV_PERSISTENT_CAST_LATE (a --variant knob): the weight tiles stay half precision in
    flight and are widened where they are multiplied; same results, ragged N and K over turns."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_CAST_LATE", True)
    torch.manual_seed(11)
    path = _check_half(Proj(3000, 37), 3000, tmp_path, sm_count={"sm_90": 2})
    source = _matmul_source(path)
    assert "b.to(tl.float32) * a" in source and "for turn in range(0, 3)" in source


@pytest.fixture
def gemv_split(monkeypatch):
    """Split-K GEMVs (off by default: codegen.GEMV_SPLIT_MIN_K) for K >= 8192, and only
    GEMV_PREFETCH_STEPS of each chunk before the wait (not all of a small GEMV's weights)."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "GEMV_SPLIT_MIN_K", 8192)
    monkeypatch.setattr(codegen, "GEMV_PREFETCH_ALL_MAX_BYTES", 0)


def test_split_gemv_sums_partials_in_a_reduction(tmp_path, gemv_split):
    """K 8192 over 2 multiprocessors: 10 programs of 4 rows (N 37, the last ragged) split K in
    2 chunks of 4 steps; the reduction applies GELU and the residual. The first step of each
    chunk's weights before gdc_wait(), nothing else."""
    from grace.aot import codegen
    from grace.formats.races import check_pre_wait

    assert codegen.gemm_plan(1, 37, 8192, 1, 4, 2).split == 2
    torch.manual_seed(12)
    path = _check(Proj(8192, 37), {"x": torch.randn(1, 8192)}, tmp_path, tol=1e-5,
                  sm_count={"sm_90": 2})
    assert check_pre_wait(read_package(path)) == []
    assert _kernels(path) == ["table_writer", "matmul", "reduction"]
    before, after = _matmul_source(path).split("gdc_wait()")
    assert "k_lo = (tl.program_id(1) // 1) * 4096" in before and "rk = k_lo + tl.arange" in before
    assert "for kk in range(1024, 4096, 1024)" in after and "rk = k_lo + kk + tl.arange" in after


def test_split_gemv_of_a_batch_in_half_precision(tmp_path, gemv_split):
    """Batched rows: partial row z is batch z % 3 of chunk z // 3, where the reduction reads
    [split, batch]; half-precision operands, float32 partials."""
    torch.manual_seed(13)
    a, b = torch.randn(3, 1, 8192).half(), (torch.randn(3, 8192, 24) / 90).half()
    path = grace_compile(Batched(), (a, b), output=tmp_path / "m.grace", progress=False,
                         sm_count={"sm_90": 4})   # 18 programs, split 2
    assert _kernels(path) == ["table_writer", "matmul", "reduction"]
    assert "bz = tl.program_id(1) % 3" in _matmul_source(path)
    got = run_cases(path, {"r": {"a": a.numpy(), "b": b.numpy()}}, tmp_path)["r"]["out"]
    ref = torch.bmm(a.double(), b.double()).numpy()
    assert got.dtype == np.float16 and rel_err(got, ref) < 2e-3


@pytest.mark.parametrize("knob", ["gemv_split", "persistent_split"])
def test_split_gemv_leaves_dynamic_k_whole(tmp_path, knob, request):
    """A K the table sizes (a softmax row of a bucketed length times values) is never split,
    by the template's split-K or by the persistent form's chunks: its partial chunks would
    depend on the extent. Exact at sizes that are not the bucket's."""
    request.getfixturevalue(knob)

    class Mix(torch.nn.Module):
        def forward(self, p, v):
            return torch.softmax(p, dim=-1) @ v

    t = Dim("t", min=2, max=8192)
    torch.manual_seed(14)
    runs = [{"p": torch.randn(1, n), "v": torch.randn(n, 8)} for n in (8192, 5000)]
    path = _check(Mix(), runs[0], tmp_path, dynamic_shapes={"p": {1: t}, "v": {0: t}},
                  buckets={"t": [8192]}, runs=runs, tol=1e-5, sm_count={"sm_90": 2})
    source = _matmul_source(path)
    assert "k_lo" not in source and "for turn in range(" not in source


@pytest.mark.parametrize("model, n", [(lambda: Proj(8192, 1), 1), (lambda: Proj(8192, 0), 0),
                                      (lambda: RightWeight(8192, 3), 3)],
                         ids=["one-output", "no-output", "weight-k-major"])
def test_split_gemv_edges(tmp_path, gemv_split, model, n):
    """One output column (one program, K in 8 chunks of one step), none (an empty product: no
    GEMV at all), and W stored [K, N], with extreme values: x of ±0.5, 1e-30 and 1e3."""
    torch.manual_seed(15)
    x = torch.randn(1, 8192)
    x[0, ::3], x[0, 1::7], x[0, 2::11] = 0.5, -1e-30, 1e3
    path = _check(model(), {"x": x}, tmp_path, tol=1e-5, sm_count={"sm_90": 2})
    if n:
        assert "k_lo = " in _matmul_source(path)


@pytest.fixture
def persistent_split(monkeypatch):
    """The persistent form over K chunks (off by default: codegen.GEMV_PERSISTENT_SPLIT_MIN_K)."""
    from grace.aot import codegen
    monkeypatch.setattr(codegen, "GEMV_PERSISTENT_SPLIT_MIN_K", 4097)


def test_persistent_split_plans(persistent_split):
    """Llama-3-8B's down projection: K 14336 in 4 chunks of 3584 (one 4096-column tile each),
    2 programs per SM in all; Llama-3.2-1B's (K 8192): 2 chunks of 4096. A K no power-of-two
    split brings to 4096 even columns (4097 * 3) keeps the template; a dynamic K is not split,
    and past 4096 is not persistent."""
    from grace.aot import codegen
    plan = codegen.gemm_plan(1, 4096, 14336, 1, 2, 132)
    assert (plan.bn, plan.bk, plan.split, plan.programs) == (4, 4096, 4, 66)
    plan = codegen.gemm_plan(1, 2048, 8192, 1, 2, 132)
    assert (plan.bn, plan.bk, plan.split, plan.programs) == (4, 4096, 2, 132)
    assert codegen.gemm_plan(1, 64, 4097 * 3, 1, 2, 132).programs == 0
    plan = codegen.gemm_plan(1, 2048, 8192, 1, 2, 132, split_k=False)
    assert (plan.split, plan.programs) == (1, 0)


def test_persistent_split_sums_chunks_in_a_reduction(tmp_path, persistent_split):
    """K 6000 in 2 chunks of 3000 (masked within the 4096-column tile) and N 37 (10 tiles of 4
    rows, the last ragged) on a part of 2 multiprocessors: 2 programs per chunk walking 5 turns,
    float32 partial rows summed by the reduction, which applies GELU and the residual. Each
    program's first tile before gdc_wait(), nothing else; ±0.5, tiny and huge values in x."""
    from grace.formats.races import check_pre_wait

    torch.manual_seed(16)
    x = torch.randn(1, 6000)
    x[0, ::5], x[0, 1::9], x[0, 2::13] = 0.5, -1e-30, 1e3
    path = _check(Proj(6000, 37), {"x": x}, tmp_path, tol=1e-5, sm_count={"sm_90": 2})
    assert check_pre_wait(read_package(path)) == []
    assert _kernels(path) == ["table_writer", "matmul", "reduction"]
    before, after = _matmul_source(path).split("gdc_wait()")
    assert "rk = (tl.program_id(1) // 1) * 3000 + rc" in before and "(rc[None, :] < 3000)" in before
    assert "b_next =" in before and "for turn in range(0, 5)" in after and "bo * 37" in after


def test_persistent_split_of_a_batch_in_half_precision(tmp_path, persistent_split):
    """Three batch rows, K 8192 in 2 unmasked chunks: program (i, z) sums batch z % 3 of chunk
    z // 3 into partial row z, where the reduction reads [split, batch]; fp16 operands, float32
    partials."""
    torch.manual_seed(17)
    a, b = torch.randn(3, 1, 8192).half(), (torch.randn(3, 8192, 24) / 90).half()
    path = grace_compile(Batched(), (a, b), output=tmp_path / "m.grace", progress=False,
                         sm_count={"sm_90": 4})
    assert _kernels(path) == ["table_writer", "matmul", "reduction"]
    source = _matmul_source(path)
    assert "bz = tl.program_id(1) % 3" in source and "for turn in range(" in source
    assert "rc[None, :] <" not in source   # chunks of exactly the tile: no column mask
    got = run_cases(path, {"r": {"a": a.numpy(), "b": b.numpy()}}, tmp_path)["r"]["out"]
    ref = torch.bmm(a.double(), b.double()).numpy()
    assert got.dtype == np.float16 and rel_err(got, ref) < 2e-3
