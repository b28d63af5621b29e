"""tools/tile_sweep.py, the parts that need no GPU: candidate tiles parsed, every GEMM of >= 128
rows forced to a tile (`gemm_tiles.forced`, split-K included) and mapped back from its kernels,
the forced packages still computing the product (CPU reference executor against fp64 torch), and
the table and summary built from timings."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grace.aot import gemm_tiles  # noqa: E402
from grace.aot.gemm_tiles import Tile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools import tile_sweep  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402


class TwoLinears(torch.nn.Module):
    """Two GEMM shapes with 160 rows (padding in every row tile), a GELU between them."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(96, 80)
        self.b = torch.nn.Linear(80, 48)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def test_tiles_parse_and_print_back():
    assert tile_sweep.parse_tile("64x32x64w4s3") == Tile(64, 32, 64, 4, 3, 1)
    assert tile_sweep.parse_tile("64x64x32w8s4k2") == Tile(64, 64, 32, 8, 4, 2)
    for text in ("64x64x32w4s3", "32x64x128w8s2k4"):
        assert tile_sweep.tile_name(tile_sweep.parse_tile(text)) == text
    assert tile_sweep.tile_name(None) == "heuristic"
    for bad in ("64x64", "64x48x32w4s3", "64x64x32w4s0", "big"):
        with pytest.raises(ValueError, match="tile"):
            tile_sweep.parse_tile(bad)


def _grid(path):
    m = read_package(path).manifest
    return [(m["kernels"][n["kernel"]]["name"], n["grid"]) for g in m["graphs"] for n in g["nodes"]
            if m["kernels"][n["kernel"]]["family"] in ("matmul", "reduction")]


@pytest.mark.parametrize("tile", [None, "64x32x32w4s3", "32x32x32w4s2k2"])
def test_forced_tiles_are_used_mapped_and_correct(tmp_path, tile):
    torch.manual_seed(0)
    model = TwoLinears().eval()
    x = torch.randn(160, 96)
    forced = None if tile is None else tile_sweep.parse_tile(tile)
    path = tmp_path / "m.grace"
    kernels = tile_sweep.compile_with(model, x, path, forced, "tf32x3")
    grid = _grid(path)
    assert set(kernels.values()) == {"tf32x3 160 80 96", "tf32x3 160 48 80"}
    # every matmul kernel, and a split-K GEMM's reduction, maps to its GEMM
    assert {name for name, _ in grid} == set(kernels)
    if forced is not None:
        first = grid[0][1]
        assert first[0] == -(-160 // forced.bm) and first[1] == -(-80 // forced.bn)
        assert first[2] == forced.split
        assert len(grid) == (4 if forced.split > 1 else 2)
    out = InterpretSession(path).run({"x": x.numpy()})
    got = next(iter(out.values())) if isinstance(out, dict) else out["out"]
    with torch.no_grad():
        ref = model.double()(x.double()).numpy()
    err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-5


def test_forced_leaves_no_trace_and_small_gemms_alone():
    with gemm_tiles.forced(Tile(64, 64, 32, 4, 3)):
        assert gemm_tiles.measured_tile(None, "tf32", 256, 384, 1536) == Tile(64, 64, 32, 4, 3)
        assert gemm_tiles.measured_tile(None, "tf32", 64, 384, 1536) is None   # < MIN_ROWS
        assert gemm_tiles.measured_tile(None, None, 256, 384, 1536) is None    # ieee dots
        with gemm_tiles.forced(None):   # the heuristic, even where a table exists
            assert gemm_tiles.measured_tile("sm_90", "tf32", 256, 384, 1536) is None
    assert gemm_tiles.measured_tile(None, "tf32", 256, 384, 1536) is None


def test_best_table_and_summary():
    results = {"tf32 197 384 1536": {"heuristic": 120.0, "64x64x32w4s3": 80.0,
                                     "64x64x32w4s3k2": 70.0},
               "tf32 197 1152 384": {"heuristic": 50.0, "64x64x32w4s3": 60.0,
                                     "64x64x32w4s3k2": 55.0}}
    table = tile_sweep.best_table(results)
    assert table == [{"kind": "tf32", "M": 197, "N": 384, "K": 1536, "bm": 64, "bn": 64,
                      "bk": 32, "warps": 4, "stages": 3, "split": 2, "us": 70.0,
                      "heuristic_us": 120.0}]   # the heuristic keeps the other shape
    text = "\n".join(tile_sweep.summary(results))
    assert "70.0*" in text and "50.0*" in text
    assert "fastest per GEMM combined: 120.0" in text
    # a table with split entries reads back with them
    json.dumps(table)


def test_a_gemm_the_profile_missed_is_left_out_not_free():
    kernels = {"matmul_a": "tf32 197 384 384", "matmul_b": "tf32 197 384 1536",
               "reduction_b": "tf32 197 384 1536"}
    us, missing = tile_sweep.per_gemm_us({"matmul_a": 5.0, "reduction_b": 2.0, "other": 1.0},
                                         kernels)
    assert us == {"tf32 197 384 384": 5.0}     # matmul_b unseen: its GEMM has no time at all
    assert missing == {"tf32 197 384 1536"}
    assert tile_sweep.rel_error(np.ones(4), np.ones(4)) == 0.0
    assert tile_sweep.rel_error(np.array([1.0, 1.1]), np.array([1.0, 1.0])) > 0.05


def test_a_table_grows_by_each_model_swept_and_refuses_another_gpu(tmp_path):
    def entry(m, n, k, split, us):
        return {"kind": "tf32", "M": m, "N": n, "K": k, "bm": 64, "bn": 64, "bk": 32, "warps": 4,
                "stages": 3, "split": split, "us": us, "heuristic_us": 2 * us}

    path = tmp_path / "sm_90.json"
    tile_sweep.write_table(path, [entry(197, 384, 384, 4, 40.0), entry(197, 1152, 384, 1, 70.0)],
                           "vit_s", "NVIDIA H200", "python -m grace.tools.tile_sweep --model vit_s")
    table = tile_sweep.write_table(path, [entry(197, 384, 384, 2, 30.0), entry(784, 192, 96, 1, 9.0)],
                                   "convnext_tiny", "NVIDIA H200", "python -m grace.tools.tile_sweep")
    assert json.loads(path.read_text()) == table
    got = {(e["M"], e["N"], e["K"]): (e["split"], e["model"]) for e in table["entries"]}
    assert got == {(197, 384, 384): (2, "convnext_tiny"),     # the same shape: the newer sweep's
                   (197, 1152, 384): (1, "vit_s"), (784, 192, 96): (1, "convnext_tiny")}
    assert [s["model"] for s in table["sweeps"]] == ["vit_s", "convnext_tiny"]
    with pytest.raises(SystemExit, match="NVIDIA H100"):
        tile_sweep.write_table(path, [], "vit_s", "NVIDIA H100", "python -m grace.tools.tile_sweep")


def test_a_table_from_the_timings_of_a_sweep_cut_short(tmp_path, capsys):
    out, table = tmp_path / "sweep.json", tmp_path / "tiles.json"
    out.write_text(json.dumps({"model": "vit_s", "fp32_matmul": "tf32", "gpu": "NVIDIA H200",
                               "results": {"tf32 197 384 1536": {"heuristic": 150.0,
                                                                 "64x64x32w4s3k4": 120.0}}}))
    tile_sweep.main(["--from-out", "--out", str(out), "--table", str(table)])
    (entry,) = json.loads(table.read_text())["entries"]
    assert (entry["M"], entry["split"], entry["us"], entry["model"]) == (197, 4, 120.0, "vit_s")
    assert "120.0*" in capsys.readouterr().out
    with pytest.raises(SystemExit):   # nothing to build the table from
        tile_sweep.main(["--from-out", "--out", str(tmp_path / "none.json"), "--table", str(table)])


def test_the_default_candidates_parse():
    assert len({tile_sweep.parse_tile(t) for t in tile_sweep.DEFAULT_TILES}) == \
        len(tile_sweep.DEFAULT_TILES)


def test_table_entries_with_split_are_read(tmp_path, monkeypatch):
    (tmp_path / "sm_90.json").write_text(json.dumps({"entries": [
        {"kind": "tf32", "M": 197, "N": 384, "K": 1536, "bm": 64, "bn": 64, "bk": 32, "warps": 4,
         "stages": 3, "split": 2}]}))
    monkeypatch.setattr(gemm_tiles, "TABLE_DIR", tmp_path)
    gemm_tiles._read_table.cache_clear()
    try:
        assert gemm_tiles.measured_tile("sm_90", "tf32", 256, 384, 1536).split == 2
    finally:
        gemm_tiles._read_table.cache_clear()


def test_help_runs(capsys):
    with pytest.raises(SystemExit) as e:
        tile_sweep.main(["--help"])
    assert e.value.code == 0
    assert "gemm_tiles.forced" in capsys.readouterr().out


def test_table_name_picks_another_table_and_refuses_a_missing_one(tmp_path, monkeypatch):
    """gemm_tiles.TABLE_NAME (a `--variant` A/B of a new sweep against the shipped table): the
    named file answers instead of <arch>.json; a name with no file is an error, never a silent
    fall back to the heuristic."""
    entry = {"kind": "tf32", "M": 197, "N": 384, "K": 1536, "bm": 64, "bn": 64, "bk": 32,
             "warps": 4, "stages": 3}
    (tmp_path / "sm_90.json").write_text(json.dumps({"entries": [{**entry, "split": 4}]}))
    (tmp_path / "before.json").write_text(json.dumps({"entries": [{**entry, "split": 2}]}))
    monkeypatch.setattr(gemm_tiles, "TABLE_DIR", tmp_path)
    assert gemm_tiles.measured_tile("sm_90", "tf32", 197, 384, 1536).split == 4
    monkeypatch.setattr(gemm_tiles, "TABLE_NAME", "before.json")
    assert gemm_tiles.measured_tile("sm_90", "tf32", 197, 384, 1536).split == 2
    monkeypatch.setattr(gemm_tiles, "TABLE_NAME", "missing.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        gemm_tiles.measured_tile("sm_90", "tf32", 197, 384, 1536)
