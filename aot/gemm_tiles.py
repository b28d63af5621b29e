"""Measured GEMM tiles for M >= 128, per GPU architecture (issue 8, item 5).

The tile heuristic (codegen.gemm_plan) fills the chip first: it takes the largest tile that still
gives every multiprocessor a program, which for 128..1024 rows means 16-row tiles or 128x128 ones,
and a single K walk. For ViT-S's GEMMs (197 rows) that is 24-72 programs walking K = 384..1536 in
series, at ~20 TFLOP/s.

A table is `gemm_tiles/<arch>.json`: the fastest tile (bm, bn, bk, warps, stages, split-K) per
operand kind and (M, N, K), timed on the kernels a whole model generates by
tools/tile_sweep.py (every GEMM of the model forced to each candidate, CUPTI time per kernel, the
output checked against the heuristic's). A GEMM takes the nearest entry when it is within a
factor of sqrt(2) in each of M, N and K (`NEAR`, in log2), and the heuristic otherwise: the first
table, a grid measured on a mirror of the template (tools/gemm_sweep.py) and applied to every
shape by nearest point, made ViT-S 14% and ResNet-50 31% slower (docs/performance.md, sixth
session): a tile measured on one shape and operand path does not carry to a far one.

On by default (`gemm_tiles=False`, `grace compile --no-gemm-tiles` turn it off). The sm_90 table
is ViT-S's, measured on the H200: with it ViT-S ran 0.437 ms against 0.550 with the heuristic,
in one benchmark run (docs/performance.md, ninth session); split-K by 4 won on four of its five
GEMM shapes. A second sweep (seventeenth session) added split-K by 8 and 32 x 32 tiles: split 8
won the three N = 384 shapes (fc2: 127 -> 75 us of kernels a call), and ViT-S ran 0.397 -> 0.385
ms (0.429 -> 0.415 with the attention of before). Shapes far from it (ResNet-50's, MobileBERT's,
a decoder's) keep the heuristic and compile to the same kernels as without a table. To extend it,
sweep another model on that GPU: `python -m grace.tools.tile_sweep --model M --table
aot/gemm_tiles/sm_90.json` merges its winners into the table (each entry names the model it was
measured on; `sweeps` lists the commands).
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
NEAR = 0.5       # an entry applies within this distance in log2 of each of M, N, K (x sqrt 2)
# The table file in TABLE_DIR; "" is `<arch>.json`. Another name A/Bs a new sweep's table against
# the shipped one in one benchmark run: `--variant old:gemm_tiles.TABLE_NAME='sm_90.before.json'`.
TABLE_NAME = ""


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


def _table(arch: str) -> dict:
    """{kind: [(log2 M, log2 N, log2 K, Tile)]} of the arch's table; {} when there is none."""
    if TABLE_NAME and not (TABLE_DIR / TABLE_NAME).is_file():
        raise FileNotFoundError(f"gemm_tiles.TABLE_NAME: no table {TABLE_DIR / TABLE_NAME}")
    return _read_table(TABLE_DIR / (TABLE_NAME or f"{arch}.json"))


@functools.lru_cache(maxsize=None)
def _read_table(path: Path) -> dict:
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
    """The table's tile for an [m, k] x [k, n] GEMM, or None (no table, kind or too few rows, or
    no measured shape within a factor of sqrt(2) in each extent: `NEAR`).
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
    point, tile = min(entries, key=lambda e: sum((a - b) ** 2 for a, b in zip(e[0], at)))
    return tile if max(abs(a - b) for a, b in zip(point, at)) <= NEAR + 1e-9 else None
