"""Measured GEMM tiles for M >= 128, per GPU architecture (issue 8, item 5).

The tile heuristic (codegen.gemm_plan) fills the chip first: it takes the largest tile that still
gives every multiprocessor a program, which for 128..1024 rows means 16-row tiles or 128x128 ones.
Timed on the H200 (tools/gemm_sweep.py, CUPTI kernel time, docs/performance.md "sixth session"),
that left 6% (tf32x3), 17% (bf16) and 19% (tf32) of GEMM time on the table in geometric mean, up
to 2x on some shapes: 64-row tiles with fewer programs, 4-stage pipelines and narrower N tiles won.

A table is `gemm_tiles/<arch>.json`: the fastest (bm, bn, bk, warps, stages) per operand kind on a
grid of (M, N, K). A GEMM takes the entry of the nearest grid point (distance in log2 of each
extent); an arch without a table, or a kind the sweep did not time (fp32 with "ieee" dots), keeps
the heuristic. The grid spans 128..1024 rows and 128..3072 columns; beyond it the nearest corner
is used, which still beats the heuristic's choice there (the largest shapes of the sweep).

Opt-in (`gemm_tiles=True`, `grace compile --gemm-tiles`): on whole models the table lost on the
H200 (ViT-S 0.602 -> 0.686 ms, ResNet-50 0.475 -> 0.622, EfficientNet-B0 0.356 -> 0.385;
docs/performance.md, sixth session). The sweep times a mirror of the template, not the generated
kernels (whose A loads go through the expression emitter, and convolutions' through an im2col
gather), so its winners do not carry over; the next table should be measured on generated
kernels: tools/tile_sweep.py does that (every GEMM of a whole model forced to each candidate,
`forced`, timed per kernel on the GPU) and writes its winners, split-K factor included, in this
format.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

TABLE_DIR = Path(__file__).with_name("gemm_tiles")
MIN_ROWS = 128   # below this the heuristic (GEMV, split-K, 16-row tiles) decides


@dataclass(frozen=True)
class Tile:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    split: int = 1   # split-K factor (partial sums reduced by a second kernel)


# A tile every GEMM of >= MIN_ROWS rows takes while `forced` is active (tools/tile_sweep.py times
# each candidate tile on the kernels a whole model generates).
_forced: Tile | None = None


@contextlib.contextmanager
def forced(tile: Tile | None):
    """Within the block, `measured_tile` answers `tile` for every GEMM it would look up (M >=
    MIN_ROWS, a swept operand kind), table or not; None: the heuristic's own plan (no table)."""
    global _forced
    before, _forced = _forced, tile or _HEURISTIC
    try:
        yield
    finally:
        _forced = before


_HEURISTIC = Tile(0, 0, 0, 0, 0)   # `forced(None)`: no measured tile at all


def operand_kind(dot_dtype: str, fp32_precision: str) -> str | None:
    """The sweep's name for a GEMM's operands: bf16 and fp16 dots share the bf16 entries (same
    MMA shapes and bytes per element); fp32 dots by their input precision."""
    if dot_dtype in ("bfloat16", "float16"):
        return "bf16"
    return fp32_precision if fp32_precision in ("tf32", "tf32x3") else None


@functools.lru_cache(maxsize=None)
def _table(arch: str) -> dict:
    """{kind: [(log2 M, log2 N, log2 K, Tile)]} of the arch's table; {} when there is none."""
    path = TABLE_DIR / f"{arch}.json"
    if not path.is_file():
        return {}
    out: dict = {}
    for e in json.loads(path.read_text())["entries"]:
        point = (math.log2(e["M"]), math.log2(e["N"]), math.log2(e["K"]))
        out.setdefault(e["kind"], []).append(
            (point, Tile(e["bm"], e["bn"], e["bk"], e["warps"], e["stages"], e.get("split", 1))))
    return out


def table_arch(arch: str) -> str | None:
    """`arch` if there is a measured table for it, else None (the heuristic plans its GEMMs)."""
    return arch if _table(arch) else None


def measured_tile(arch: str | None, kind: str | None, m: int, n: int, k: int) -> Tile | None:
    """The table's tile for an [m, k] x [k, n] GEMM, or None (no table, kind or too few rows).
    `arch`: the table to use (lowering's options["tile_table"], the compile target's arch)."""
    if m < MIN_ROWS or kind is None:
        return None
    if _forced is not None:
        return None if _forced is _HEURISTIC else _forced
    if not arch:
        return None
    entries = _table(arch).get(kind)
    if not entries:
        return None
    at = (math.log2(m), math.log2(n), math.log2(k))
    _, tile = min(entries, key=lambda e: sum((a - b) ** 2 for a, b in zip(e[0], at)))
    return tile
