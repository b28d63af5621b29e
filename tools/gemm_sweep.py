"""GEMM tile sweep on the GPU, timed by CUPTI (the torch profiler): kernel time only, no launch
overhead, so tiles that take a few microseconds are told apart (back-to-back Python launches cost
~15 µs each and hide them). The kernel mirrors the generated fp32 GEMM: a row mask with a runtime
extent, early exit past it, a bias epilogue.

    python -m grace.tools.gemm_sweep [--out sweep.json]

Prints the six fastest tiles per shape; `--out` gets every timing (docs/performance.md, the sweep
behind gemm_plan's notes).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TILES = [(16, 32), (16, 64), (32, 64), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128)]
K_STEPS = [32, 64, 128]
ROWS = [16, 64, 128, 256, 512]
SHAPES = [(768, 768), (3072, 768), (768, 3072)]    # (N, K): BERT-base's projections and FFN
PRECISIONS = ["tf32x3", "tf32"]
CALLS = 10


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(ext, a_ptr, w_ptr, bias, c_ptr, n, k, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, PREC: tl.constexpr):
        rows = tl.load(ext)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        if tl.program_id(0) * BM >= rows:
            return
        acc = tl.zeros([BM, BN], tl.float32)
        for kk in range(0, k, BK):
            rk = kk + tl.arange(0, BK)
            mask_a = rm[:, None] < rows
            a = tl.load(a_ptr + rm[:, None] * k + rk[None, :], mask=mask_a, other=0)
            a = tl.where(mask_a, a, 0.0)
            w = tl.load(w_ptr + rk[:, None] + rn[None, :] * k)
            acc = tl.dot(a, w, acc, input_precision=PREC)
        b = tl.load(bias + rn[None, :] + rm[:, None] * 0, mask=rm[:, None] < rows, other=0)
        tl.store(c_ptr + rm[:, None] * n + rn[None, :], acc + b, mask=rm[:, None] < rows)

    return gemm


def sweep_shape(gemm, prec: str, m: int, n: int, k: int) -> dict:
    """{(bm, bn, bk): µs per call} for every tile that fits the GPU's shared memory."""
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    a, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    bias, c = torch.randn(n, device="cuda"), torch.empty(m, n, device="cuda")
    ext = torch.tensor([m], device="cuda")
    calls = {}
    for bm, bn in TILES:
        for bk in K_STEPS:
            if bm > max(16, m):
                continue
            grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
            warps = 8 if bm * bn > 64 * 64 else 4

            def call(grid=grid, bm=bm, bn=bn, bk=bk, warps=warps):
                gemm[grid](ext, a, w, bias, c, n, k, bm, bn, bk, prec, num_warps=warps,
                           num_stages=3)
            try:
                call()                      # compile; too much shared memory raises here
            except Exception:  # noqa: BLE001 - a tile that does not fit is simply skipped
                continue
            calls[(bm, bn, bk)] = call
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls.values():
            for _ in range(CALLS):
                call()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "gemm" in e.name),
                    key=lambda e: e.time_range.start)
    return {key: sum(e.device_time_total for e in events[i * CALLS:(i + 1) * CALLS]) / CALLS
            for i, key in enumerate(calls)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write every timing as JSON")
    args = ap.parse_args(argv)
    gemm = _kernel()
    results = []
    for prec in PRECISIONS:
        for m in ROWS:
            for n, k in SHAPES:
                times = sweep_shape(gemm, prec, m, n, k)
                ranked = sorted((t, key) for key, t in times.items())
                results.append({"prec": prec, "M": m, "N": n, "K": k,
                                "all": {str(key): round(t, 1) for t, key in ranked}})
                print(prec, m, n, k, " ".join(f"{bm}x{bn}x{bk}:{t:.1f}"
                                              for t, (bm, bn, bk) in ranked[:6]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
