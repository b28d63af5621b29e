"""GEMM tile sweep on the GPU: the measured table behind `gemm_plan` for M >= 128.

A mirror of grace's GEMM template (A [M, K] row-major, a linear layer's W [N, K], masks only where
a tile can overrun, a bias epilogue) is timed by CUPTI (the torch profiler: kernel time only, so
tiles a few microseconds apart are told apart) for every tile (bm, bn), K step, warp count and
pipeline depth, on a grid of shapes, per operand kind (fp32 with tf32x3 or tf32 dots, bf16).

    python -m grace.tools.gemm_sweep --out sweep.json --table aot/gemm_tiles/sm_90.json

`--out` gets every timing; `--table` the fastest configuration per shape, in the format the
compiler reads (aot/gemm_tiles.py: a measured shape within sqrt(2) in each extent applies). Run it
on the GPU the table is for. A grid table measured this way made whole models slower on the H200
(docs/performance.md, sixth session): the table in use comes from tools/tile_sweep.py, which
times the kernels a model generates.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

TILES = [(64, 32), (32, 64), (64, 64), (128, 64), (64, 128), (128, 128)]
K_STEPS = [32, 64, 128]
STAGES = [3, 4]
ROWS = [128, 256, 1024]
COLS = [128, 384, 1024, 3072]   # N and K alike
CALLS = 5
# operand kind -> (torch dtype name, fp32 input_precision or None for a low-precision dot)
KINDS = {"tf32x3": ("float32", "tf32x3"), "bf16": ("bfloat16", None), "tf32": ("float32", "tf32")}


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(a_ptr, w_ptr, bias, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
             FP32: tl.constexpr, PREC: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], tl.float32)
        for kk in range(0, K, BK):
            rk = kk + tl.arange(0, BK)
            if EVEN_M and EVEN_K:
                a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
            else:
                a = tl.load(a_ptr + rm[:, None] * K + rk[None, :],
                            mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
            if EVEN_N and EVEN_K:
                b = tl.load(w_ptr + rk[:, None] + rn[None, :] * K)
            else:
                b = tl.load(w_ptr + rk[:, None] + rn[None, :] * K,
                            mask=(rk[:, None] < K) & (rn[None, :] < N), other=0)
            if FP32:
                acc = tl.dot(a, b, acc, input_precision=PREC)
            else:
                acc = tl.dot(a, b, acc)
        c = acc + tl.load(bias + rn[None, :], mask=rn[None, :] < N, other=0)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], c.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return gemm


def _warps(bm: int, bn: int) -> int:
    return 4 if bm * bn <= 64 * 64 else 8   # as the template sets them for a tile


def heuristic(kind: str, m: int, n: int, k: int) -> tuple:
    """The tile codegen.gemm_plan picks without a table (on 132 SMs, whole: no split-K, since
    the sweep times one kernel), as a configuration."""
    from grace.aot.codegen import gemm_plan

    plan = gemm_plan(m, n, k, 1, 4 if KINDS[kind][0] == "float32" else 2, 132)
    return plan.bm, plan.bn, plan.bk, _warps(plan.bm, plan.bn), 3


def configs(kind: str, m: int, n: int, k: int) -> list:
    """(bm, bn, bk, warps, stages) to time for a shape: the grid, and the heuristic's tile."""
    grid = [(bm, bn, bk, _warps(bm, bn), st)
            for (bm, bn), bk, st in itertools.product(TILES, K_STEPS, STAGES)]
    return grid + [c for c in [heuristic(kind, m, n, k)] if c not in grid]


def sweep_shape(gemm, kind: str, m: int, n: int, k: int) -> dict:
    """{config: median µs of CALLS calls} for every configuration that compiles."""
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    dtype, prec = KINDS[kind]
    dt = getattr(torch, dtype)
    a, w = torch.randn(m, k, device="cuda").to(dt), torch.randn(n, k, device="cuda").to(dt)
    bias, c = torch.randn(n, device="cuda").to(dt), torch.empty(m, n, device="cuda", dtype=dt)
    calls = {}
    for cfg in configs(kind, m, n, k):
        bm, bn, bk, warps, stages = cfg

        def call(grid=(triton.cdiv(m, bm), triton.cdiv(n, bn)), bm=bm, bn=bn, bk=bk, warps=warps,
                 stages=stages):
            gemm[grid](a, w, bias, c, m, n, k, bm, bn, bk, m % bm == 0, n % bn == 0, k % bk == 0,
                       prec is not None, prec or "ieee", num_warps=warps, num_stages=stages)
        try:
            call()                      # compile; too much shared memory raises here
        except Exception:  # noqa: BLE001 - a configuration that does not fit is skipped
            continue
        calls[cfg] = call
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls.values():
            for _ in range(CALLS):
                call()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "gemm" in e.name),
                    key=lambda e: e.time_range.start)
    times = {}
    for i, cfg in enumerate(calls):
        samples = sorted(e.device_time_total for e in events[i * CALLS:(i + 1) * CALLS])
        times[cfg] = samples[len(samples) // 2]
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write every timing as JSON")
    ap.add_argument("--table", type=Path, default=None,
                    help="write the fastest configuration per shape (the compiler's table)")
    args = ap.parse_args(argv)
    import torch

    gemm = _kernel()
    results, entries = [], []
    for kind in KINDS:
        for m, n, k in itertools.product(ROWS, COLS, COLS):
            times = sweep_shape(gemm, kind, m, n, k)
            best = min(times, key=times.get)
            base = times.get(heuristic(kind, m, n, k))
            results.append({"kind": kind, "M": m, "N": n, "K": k,
                            "all": {",".join(map(str, c)): round(t, 2) for c, t in times.items()}})
            entries.append({"kind": kind, "M": m, "N": n, "K": k, "bm": best[0], "bn": best[1],
                            "bk": best[2], "warps": best[3], "stages": best[4],
                            "us": round(times[best], 2),
                            "heuristic_us": None if base is None else round(base, 2)})
            print(kind, m, n, k, best, f"{times[best]:.1f} us (heuristic {base} us)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.table:
        args.table.write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
             "command": "python -m grace.tools.gemm_sweep --table ...", "entries": entries},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
