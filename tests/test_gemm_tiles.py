"""The measured GEMM tile table (aot/gemm_tiles.py, issue 8 item 5): its file, the lookup (the
nearest measured shape, only within sqrt(2) in each extent), and that lowering plans GEMMs of >=
128 rows by it (and only those). Timing lives in docs/performance.md, not here."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from grace.aot import export, gemm_tiles, lower  # noqa: E402
from grace.aot.codegen import generate  # noqa: E402
from grace.aot.families import Matmul  # noqa: E402
from grace.tools import tile_sweep  # noqa: E402

TABLE = json.loads((gemm_tiles.TABLE_DIR / "sm_90.json").read_text())


def test_the_sm90_table_was_measured_by_tile_sweep_and_beats_the_heuristic():
    assert TABLE["gpu"] == "NVIDIA H200" and TABLE["sweeps"]
    for sweep in TABLE["sweeps"]:
        assert sweep["date"] and sweep["command"].startswith("python -m grace.tools.tile_sweep")
    assert {e["model"] for e in TABLE["entries"]} <= {sw["model"] for sw in TABLE["sweeps"]}
    points = {(e["kind"], e["M"], e["N"], e["K"]) for e in TABLE["entries"]}
    assert len(points) == len(TABLE["entries"]) > 0
    for e in TABLE["entries"]:
        name = f"{e['bm']}x{e['bn']}x{e['bk']}w{e['warps']}s{e['stages']}" + (
            f"k{e['split']}" if e["split"] > 1 else "")
        assert tile_sweep.tile_name(tile_sweep.parse_tile(name)) == name
        assert e["M"] >= gemm_tiles.MIN_ROWS
        assert 0 < e["us"] < e["heuristic_us"]   # an entry only where a candidate won


def _entry(kind, m, n, k):
    (e,) = [e for e in TABLE["entries"] if (e["kind"], e["M"], e["N"], e["K"]) == (kind, m, n, k)]
    return gemm_tiles.Tile(e["bm"], e["bn"], e["bk"], e["warps"], e["stages"], e["split"])


def _qkv():
    """The table's ViT-S qkv projection (197 x 1152 x 384)."""
    return _entry("tf32", 197, 1152, 384)


def test_lookup_takes_a_measured_shape_only_when_it_is_near():
    assert gemm_tiles.measured_tile("sm_90", "tf32", 197, 1152, 384) == _qkv()
    # a ViT-S-like encoder at 256 tokens (x 1.3 in M): still that shape's tile
    assert gemm_tiles.measured_tile("sm_90", "tf32", 256, 1152, 384) == _qkv()
    # twice the rows, a wider model, another operand kind: the heuristic
    assert gemm_tiles.measured_tile("sm_90", "tf32", 394, 1152, 384) is None
    assert gemm_tiles.measured_tile("sm_90", "tf32", 197, 2304, 768) is None
    assert gemm_tiles.measured_tile("sm_90", "bf16", 197, 1152, 384) is None
    assert gemm_tiles.measured_tile("sm_90", "tf32", 3136, 64, 576) is None   # a ResNet conv


def test_no_measured_tile_below_128_rows_for_ieee_or_without_a_table():
    assert gemm_tiles.measured_tile("sm_90", "tf32", 127, 1152, 384) is None
    assert gemm_tiles.measured_tile("sm_90", None, 197, 1152, 384) is None
    assert gemm_tiles.measured_tile("sm_80", "tf32", 197, 1152, 384) is None   # no sm_80 table
    assert gemm_tiles.measured_tile(None, "tf32", 197, 1152, 384) is None


def test_operand_kinds():
    assert gemm_tiles.operand_kind("bfloat16", "tf32x3") == "bf16"
    assert gemm_tiles.operand_kind("float16", "ieee") == "bf16"
    assert gemm_tiles.operand_kind("float32", "tf32") == "tf32"
    assert gemm_tiles.operand_kind("float32", "tf32x3") == "tf32x3"
    assert gemm_tiles.operand_kind("float32", "ieee") is None


class _TwoLinears(torch.nn.Module):
    """A GEMM of 197 rows (the table's ViT-S qkv shape) and one of 64 rows (the heuristic's)."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(384, 1152)
        self.small = torch.nn.Linear(384, 1152)

    def forward(self, x, y):
        return self.big(x), self.small(y)


def _inputs():
    return torch.randn(197, 384), torch.randn(64, 384)


def _matmuls(options):
    program = export.to_core_aten(export.export_model(_TwoLinears().eval(), _inputs()))
    prog = lower.lower(program, options=options)
    return {k.spec.m: k for k in prog.kernels if isinstance(k.spec, Matmul)}


def test_lowering_plans_big_gemms_by_the_table_and_codegen_launches_its_warps_and_stages():
    with_table = _matmuls({"fp32_matmul": "tf32", "tile_table": "sm_90"})
    without = _matmuls({"fp32_matmul": "tf32"})
    tile = _qkv()
    plan = with_table[197].spec.plan
    assert (plan.bm, plan.bn, plan.bk, plan.split, plan.warps, plan.stages) == \
        (tile.bm, tile.bn, tile.bk, tile.split, tile.warps, tile.stages)
    src = generate(with_table[197])
    assert (src.num_warps, src.num_stages) == (tile.warps, tile.stages)
    assert f"tl.arange(0, {tile.bm})" in src.source and f"tl.arange(0, {tile.bk})" in src.source
    # 64 rows: the heuristic with or without a table; and no table: the heuristic at 197 rows too
    assert with_table[64].spec.plan == without[64].spec.plan
    assert without[197].spec.plan.warps == 0 and without[197].spec.plan.stages == 0


def test_an_sm90_package_uses_the_table_by_default_and_computes_what_eager_does(tmp_path):
    """Through the compiler with its defaults: the sm_90 target reads the sm_90 table (recorded in
    options.targets), the 197-row GEMM launches the table's warps and stages, every split-K
    entry's reduction included, and the results match eager."""
    import numpy as np

    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.interpret import run_package

    torch.manual_seed(0)
    model = _TwoLinears().eval()
    x, y = _inputs()
    path = grace_compile(model, (x, y), output=tmp_path / "m.grace", fp32_matmul="tf32")
    manifest = read_package(path).manifest
    assert [t["gemm_tiles"] for t in manifest["options"]["targets"]] == ["sm_90"]
    tile = _qkv()
    launched = {(k["num_warps"], k["num_stages"]) for k in manifest["kernels"]
                if k["family"] == "matmul"}
    assert (tile.warps, tile.stages) in launched
    got = run_package(path, {"x": x.numpy(), "y": y.numpy()})
    with torch.no_grad():
        want = model(x, y)
    for g, w in zip(got.values(), want):
        np.testing.assert_allclose(g, w.numpy(), rtol=2e-2, atol=2e-2)   # tf32 dots


def test_a_split_k_entry_compiles_to_partial_sums_and_their_reduction(tmp_path):
    """ViT-S's fc2 (197 x 384 x 1536) has a split-K entry: its GEMM writes partial sums that a
    reduction adds, and the result still matches eager through the reference executor."""
    import numpy as np

    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.interpret import run_package

    tile = _entry("tf32", 197, 384, 1536)
    assert tile.split > 1
    torch.manual_seed(0)
    model = torch.nn.Linear(1536, 384).eval()
    x = torch.randn(197, 1536)
    path = grace_compile(model, (x,), output=tmp_path / "fc2.grace", fp32_matmul="tf32")
    m = read_package(path).manifest
    grids = [n["grid"] for g in m["graphs"] for n in g["nodes"]
             if "kernel" in n and m["kernels"][n["kernel"]]["family"] == "matmul"]
    assert [g[2] for g in grids] == [tile.split]
    got = next(iter(run_package(path, {"input": x.numpy()}).values()))
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_gemm_tiles_false_keeps_the_heuristic(tmp_path):
    from grace.aot import compile as grace_compile
    from grace.formats import read_package

    path = grace_compile(_TwoLinears().eval(), _inputs(), output=tmp_path / "m.grace",
                         fp32_matmul="tf32", gemm_tiles=False)
    manifest = read_package(path).manifest
    assert [t["gemm_tiles"] for t in manifest["options"]["targets"]] == [None]
    assert {k["num_stages"] for k in manifest["kernels"] if k["family"] == "matmul"} == {3}
