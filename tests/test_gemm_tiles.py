"""The measured GEMM tile table (aot/gemm_tiles.py, issue 8 item 5): its file, the nearest-shape
lookup, and that lowering plans GEMMs of >= 128 rows by it (and only those) when a target has a
table. Timing lives in docs/performance.md, not here."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from grace.aot import export, gemm_tiles, lower  # noqa: E402
from grace.aot.codegen import generate  # noqa: E402
from grace.aot.families import Matmul  # noqa: E402
from grace.tools import gemm_sweep  # noqa: E402

TABLE = json.loads((gemm_tiles.TABLE_DIR / "sm_90.json").read_text())


def test_the_sm90_table_covers_the_sweep_grid_with_configurations_it_timed():
    assert TABLE["gpu"] == "NVIDIA H200" and TABLE["date"]
    points = {(e["kind"], e["M"], e["N"], e["K"]) for e in TABLE["entries"]}
    assert len(points) == len(TABLE["entries"])
    assert points == {(kind, m, n, k) for kind in gemm_sweep.KINDS for m in gemm_sweep.ROWS
                      for n in gemm_sweep.COLS for k in gemm_sweep.COLS}
    for e in TABLE["entries"]:
        timed = gemm_sweep.configs(e["kind"], e["M"], e["N"], e["K"])
        assert (e["bm"], e["bn"], e["bk"], e["warps"], e["stages"]) in timed
        assert 0 < e["us"] <= e["heuristic_us"]   # the heuristic's tile was one of those timed


def _entry(kind, m, n, k):
    (e,) = [e for e in TABLE["entries"] if (e["kind"], e["M"], e["N"], e["K"]) == (kind, m, n, k)]
    return gemm_tiles.Tile(e["bm"], e["bn"], e["bk"], e["warps"], e["stages"])


def test_lookup_takes_the_nearest_measured_shape_in_log_space():
    # on a grid point: that entry; ViT-S's qkv (197 x 1152 x 384): the (256, 1024, 384) entry
    assert gemm_tiles.measured_tile("sm_90", "tf32", 256, 1024, 384) == _entry("tf32", 256, 1024, 384)
    assert gemm_tiles.measured_tile("sm_90", "tf32", 197, 1152, 384) == _entry("tf32", 256, 1024, 384)
    # beyond the grid: the nearest corner
    assert gemm_tiles.measured_tile("sm_90", "bf16", 8192, 8192, 8192) == _entry("bf16", 1024, 3072, 3072)


def test_no_measured_tile_below_128_rows_for_ieee_or_without_a_table():
    assert gemm_tiles.measured_tile("sm_90", "tf32", 127, 1024, 1024) is None
    assert gemm_tiles.measured_tile("sm_90", None, 512, 1024, 1024) is None
    assert gemm_tiles.measured_tile("sm_80", "tf32", 512, 1024, 1024) is None   # no sm_80 table
    assert gemm_tiles.measured_tile(None, "tf32", 512, 1024, 1024) is None


def test_operand_kinds():
    assert gemm_tiles.operand_kind("bfloat16", "tf32x3") == "bf16"
    assert gemm_tiles.operand_kind("float16", "ieee") == "bf16"
    assert gemm_tiles.operand_kind("float32", "tf32") == "tf32"
    assert gemm_tiles.operand_kind("float32", "tf32x3") == "tf32x3"
    assert gemm_tiles.operand_kind("float32", "ieee") is None


class _TwoLinears(torch.nn.Module):
    """A GEMM of 256 rows (the table's) and one of 64 rows (the heuristic's)."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(384, 1024)
        self.small = torch.nn.Linear(384, 1024)

    def forward(self, x, y):
        return self.big(x), self.small(y)


def _matmuls(options):
    program = export.to_core_aten(export.export_model(
        _TwoLinears().eval(), (torch.randn(256, 384), torch.randn(64, 384))))
    prog = lower.lower(program, options=options)
    return {k.spec.m: k for k in prog.kernels if isinstance(k.spec, Matmul)}


def test_lowering_plans_big_gemms_by_the_table_and_codegen_launches_its_warps_and_stages():
    with_table = _matmuls({"fp32_matmul": "tf32", "tile_table": "sm_90"})
    without = _matmuls({"fp32_matmul": "tf32"})
    tile = _entry("tf32", 256, 1024, 384)
    plan = with_table[256].spec.plan
    assert (plan.bm, plan.bn, plan.bk, plan.split, plan.warps, plan.stages) == \
        (tile.bm, tile.bn, tile.bk, 1, tile.warps, tile.stages)
    src = generate(with_table[256])
    assert (src.num_warps, src.num_stages) == (tile.warps, tile.stages)
    assert f"tl.arange(0, {tile.bm})" in src.source and f"tl.arange(0, {tile.bk})" in src.source
    # 64 rows: the heuristic with or without a table; and no table: the heuristic at 256 rows too
    assert with_table[64].spec.plan == without[64].spec.plan
    assert without[256].spec.plan.warps == 0 and without[256].spec.plan.stages == 0


def test_an_sm90_package_uses_the_table_and_computes_what_eager_does(tmp_path):
    """Through the compiler, with gemm_tiles=True (off by default: docs/performance.md, sixth
    session): the sm_90 target reads the sm_90 table (recorded in options.targets),
    the 256-row GEMM launches the table's warps and stages, and the results match eager."""
    import numpy as np

    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.interpret import run_package

    torch.manual_seed(0)
    model = _TwoLinears().eval()
    x, y = torch.randn(256, 384), torch.randn(64, 384)
    path = grace_compile(model, (x, y), output=tmp_path / "m.grace", fp32_matmul="tf32",
                         gemm_tiles=True)
    manifest = read_package(path).manifest
    assert [t["gemm_tiles"] for t in manifest["options"]["targets"]] == ["sm_90"]
    tile = _entry("tf32", 256, 1024, 384)
    launched = {(k["num_warps"], k["num_stages"]) for k in manifest["kernels"]
                if k["family"] == "matmul"}
    assert (tile.warps, tile.stages) in launched
    got = run_package(path, {"x": x.numpy(), "y": y.numpy()})
    with torch.no_grad():
        want = model(x, y)
    for g, w in zip(got.values(), want):
        np.testing.assert_allclose(g, w.numpy(), rtol=2e-2, atol=2e-2)   # tf32 dots


def test_the_table_is_off_by_default(tmp_path):
    from grace.aot import compile as grace_compile
    from grace.formats import read_package

    path = grace_compile(_TwoLinears().eval(), (torch.randn(256, 384), torch.randn(64, 384)),
                         output=tmp_path / "m.grace", fp32_matmul="tf32")
    manifest = read_package(path).manifest
    assert [t["gemm_tiles"] for t in manifest["options"]["targets"]] == [None]
    assert {k["num_stages"] for k in manifest["kernels"] if k["family"] == "matmul"} == {3}
