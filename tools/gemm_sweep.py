"""GEMM tile sweep on the GPU, timed by CUPTI (the torch profiler): kernel time only, no launch
overhead. The kernel mirrors the generated fp32 GEMM (row mask with a runtime extent, early exit,
bias epilogue). Prints the six fastest tiles per shape and writes gemm_sweep.json to $OUT (or /tmp).

    python -m grace.tools.gemm_sweep
"""
import json, os, sys, torch, triton, triton.language as tl
from collections import defaultdict
from torch.profiler import ProfilerActivity, profile

@triton.jit
def gemm(ext, A, B, bias, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    sz0 = tl.load(ext)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if tl.program_id(0) * BM >= sz0:
        return
    acc = tl.zeros([BM, BN], tl.float32)
    for kk in range(0, K, BK):
        rk = kk + tl.arange(0, BK)
        mask_a = rm[:, None] < sz0
        x1 = tl.load(A + rm[:, None] * K + rk[None, :], mask=mask_a, other=0)
        x1 = tl.where(mask_a, x1, 0.0)
        x2 = tl.load(B + rk[:, None] + rn[None, :] * K)
        acc = tl.dot(x1, x2, acc, input_precision=PREC)
    x3 = tl.load(bias + rn[None, :] + rm[:, None] * 0, mask=rm[:, None] < sz0, other=0)
    tl.store(C + rm[:, None] * N + rn[None, :], acc + x3, mask=rm[:, None] < sz0)

TILES = [(16, 32), (16, 64), (32, 64), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128)]
BKS = [32, 64, 128]
results = []
for prec in ["tf32x3", "tf32"]:
    for M in [16, 64, 128, 256, 512]:
        for N, K in [(768, 768), (3072, 768), (768, 3072)]:
            A = torch.randn(M, K, device="cuda"); W = torch.randn(N, K, device="cuda"); b = torch.randn(N, device="cuda")
            C = torch.empty(M, N, device="cuda"); ext = torch.tensor([M], device="cuda")
            fns = {}
            for bm, bn in TILES:
                for bk in BKS:
                    if bm > max(16, M): continue
                    warps = 8 if bm * bn > 64 * 64 else 4
                    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
                    fns[(bm, bn, bk)] = (lambda g=grid, bm=bm, bn=bn, bk=bk, w=warps:
                        gemm[g](ext, A, W, b, C, M, N, K, bm, bn, bk, prec, num_warps=w, num_stages=3))
            for key in list(fns):
                try: fns[key]()
                except Exception as e: del fns[key]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for key, f in fns.items():
                    for _ in range(10): f()
                    torch.cuda.synchronize()
            ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "gemm" in e.name),
                        key=lambda e: e.time_range.start)
            per = [sum(x.device_time_total for x in ev[i*10:(i+1)*10]) / 10 for i in range(len(fns))]
            row = sorted(zip(per, fns.keys()))
            results.append({"prec": prec, "M": M, "N": N, "K": K, "best": [(round(t, 1), k) for t, k in row[:6]], "all": {str(k): round(t, 1) for t, k in row}})
            print(prec, M, N, K, " ".join(f"{k[0]}x{k[1]}x{k[2]}:{t:.1f}" for t, k in row[:6]), flush=True)
json.dump(results, open(os.environ.get("OUT", "/tmp") + "/gemm_sweep.json", "w"), indent=1)
