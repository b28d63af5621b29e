"""GEMV tile sweep on the GPU (M = 1, bf16 weights [N, K] row-major, fp32 accumulate): the
decode-step shapes of Llama-3.2-1B and Llama-3-8B. Each configuration is timed as a chain of
launches inside a CUDA graph, every launch reading a different copy of the weights (the copies
together are several times the L2), so a figure is what one such kernel costs in a decode graph:
its run plus its boundary. cuBLAS (torch.mv) is timed the same way beside it.

    python -m grace.tools.gemv_sweep [--out sweep.json]

Prints the best configurations per shape and TB/s (weight bytes / time); `--out` gets every
timing (docs/performance.md, the sweep behind codegen's GEMV plan).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

SHAPES = {  # name: (N, K)
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate": (8192, 2048),
    "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192), "1b.head": (128256, 2048),
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate": (14336, 4096),
    "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336), "8b.head": (128256, 4096),
}
TILES = [(bn, bk) for bn, bk in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024))
         if 1024 <= bn * bk <= 8192]
WARPS = (2, 4, 8)
STAGES = (1, 2, 3)
ROTATE_BYTES = 256 << 20   # weight copies per shape: at least this much (L2 is 60 MB)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(w_ptr, x_ptr, y_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros([BN, BK], tl.float32)
        for kk in range(0, K, BK):
            rk = kk + tl.arange(0, BK)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
            x = tl.load(x_ptr + rk)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))

    return gemv


def _time_chain(launch, copies, replays=20):
    """µs per launch of `launch(i)` for i over the copies, captured as one CUDA graph."""
    import torch
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(copies):   # warm-up: compiles and loads outside the capture
            launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            launch(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * copies))
    return sorted(times)[len(times) // 2]


def run(shapes=SHAPES, out=None) -> dict:
    import torch
    gemv = _kernel()
    results = {"configs": {}, "cublas": {}, "check": {}}
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, min(64, -(-ROTATE_BYTES // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        ref = (ws[0].double() @ x.double())
        results["cublas"][name] = _time_chain(lambda i: torch.mv(ws[i], x, out=y), copies)
        per = {}
        for (bn, bk), warps, stages in itertools.product(TILES, WARPS, STAGES):
            if n % bn or k % bk:
                continue
            key = f"{bn}x{bk}/w{warps}/s{stages}"

            def launch(i, bn=bn, bk=bk, warps=warps, stages=stages):
                gemv[(n // bn,)](ws[i], x, y, k, bn, bk, num_warps=warps, num_stages=stages)

            y.fill_(float("nan"))
            launch(0)
            torch.cuda.synchronize()
            err = float((y.double() - ref).norm() / ref.norm())
            if not err < 1e-2:
                results["check"][f"{name}/{key}"] = err
                continue
            per[key] = _time_chain(launch, copies)
        results["configs"][name] = per
        del ws
        torch.cuda.empty_cache()
        best = sorted(per.items(), key=lambda kv: kv[1])[:4]
        cb = results["cublas"][name]
        print(f"{name:12s} N={n:6d} K={k:5d}  cuBLAS {cb:7.2f} us {nbytes / cb / 1e6:5.2f} TB/s | "
              + "  ".join(f"{c} {t:.2f} us {nbytes / t / 1e6:.2f}" for c, t in best), flush=True)
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return results


ROW_KIND = {  # the row operand each decode GEMV reads in a Llama graph
    "1b.qkv": "rms", "1b.o": "plain", "1b.gate_up": "rms", "1b.down": "swiglu", "1b.head": "rms",
    "8b.qkv": "rms", "8b.o": "plain", "8b.gate_up": "rms", "8b.down": "swiglu", "8b.head": "rms",
}
ROW_TILES = [(bn, bk, ahead) for bn, bk in ((2, 1024), (4, 1024)) for ahead in (0, 1, 2)] + \
    [(bn, bk, ahead) for bn, bk in ((4, 512), (8, 512), (16, 256)) for ahead in (1, 2)]
PERSISTENT = [(2, g, warps, "prefetch") for g in (4, 8, 16) for warps in (4, 8)]


def run_rows(shapes, out=None) -> dict:
    """Codegen's GEMV template against a persistent GEMV, both with the row a decode graph gives
    them (ROW_KIND), each configuration timed as a chain in a CUDA graph over rotating copies."""
    import torch
    from grace.tools.gemv_row_kernels import gemv_persistent, gemv_row
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kinds = {"plain": 0, "rms": 1, "swiglu": 2}
    results = {"rows": {}, "check": {}}
    for name, (n, k) in shapes.items():
        kind = ROW_KIND[name]
        nbytes = n * k * 2
        copies = max(2, min(64, -(-ROTATE_BYTES // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(2 * k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        s = (x[:k].float() ** 2).sum().view(1)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        xd = x.double()
        if kind == "plain":
            r = xd[:k]
        elif kind == "rms":
            r = xd[:k] * torch.rsqrt(s.double() / k + 1e-5) * g.double()
        else:
            r = torch.nn.functional.silu(xd[:k]) * xd[k:]
        ref = ws[0].double() @ r
        per = {}

        def check_and_time(key, launch):
            y.fill_(float("nan"))
            launch(0)
            torch.cuda.synchronize()
            err = float((y.double() - ref).norm() / ref.norm())
            if not err < 2e-2:
                results["check"][f"{name}/{key}"] = err
                return
            per[key] = _time_chain(launch, copies)

        for bn, bk, ahead in ROW_TILES:
            if n % bn or k % bk:
                continue

            def launch(i, bn=bn, bk=bk, ahead=ahead):
                gemv_row[(n // bn,)](ws[i], x, g, s, y, k, bn, bk, kinds[kind], ahead,
                                     num_warps=4, num_stages=1)
            check_and_time(f"{bn}x{bk}/w4/s1" + (f" ahead {ahead}" if ahead else ""), launch)
        if k <= 4096:
            for bn, occ, warps, mode in PERSISTENT:
                grid = min(n // bn, occ * sms)

                def launch(i, bn=bn, grid=grid, warps=warps, mode=mode):
                    gemv_persistent[(grid,)](ws[i], x, g, s, y, n, k, bn, kinds[kind],
                                             mode == "prefetch", num_warps=warps,
                                             num_stages=3 if mode == "s3" else 1)
                check_and_time(f"persistent {bn}x{k} grid {occ}/SM w{warps} {mode}", launch)
        results["rows"][name] = per
        del ws
        torch.cuda.empty_cache()
        best = sorted(per.items(), key=lambda kv: kv[1])[:3]
        cur = per.get("4x1024/w4/s1")
        print(f"{name:12s} {kind:6s} N={n:6d} K={k:5d} now(4x1024) "
              f"{(f'{cur:6.2f} us {nbytes / cur / 1e6:4.2f}' if cur else '   -')} | "
              + "  ".join(f"{c} {t:.2f} us {nbytes / t / 1e6:.2f}" for c, t in best), flush=True)
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return results


MMA_TILES = [(bn, bk, stages) for bn in (64, 128) for bk in (128, 256) for stages in (3, 4, 6)]
MMA_FORMS = ("x16", "swap")


def _splits(n, k, bn, bk, sms):
    """Split-K factors worth timing: at least two K steps a program, at most 8 programs per SM."""
    return [s for s in (1, 2, 4, 8)
            if k % (s * bk) == 0 and k // s >= 2 * bk and 16 <= (n // bn) * s <= 8 * sms]


def run_mma(shapes, out=None) -> dict:
    """Codegen's GEMV template (FMA, no MMA, with its split-K) against two MMA forms, each with
    the decode graph's row (ROW_KIND), weight tiles pipelined by num_stages through shared
    memory: `x16` (the row as row 0 of a 16-row A tile: codegen's matmul template at M = 1) and
    `swap` (the weight tile as A, the row as column 0 of B). A split form's figure includes the
    reduction kernel that sums its partial rows."""
    import torch
    from grace.tools.gemv_row_kernels import (gemv_mma_swap, gemv_mma_x16, gemv_split,
                                              sum_splits)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kinds = {"plain": 0, "rms": 1, "swiglu": 2}
    forms = {"x16": gemv_mma_x16, "swap": gemv_mma_swap}
    results = {"mma": {}, "check": {}, "errors": {}}
    for name, (n, k) in shapes.items():
        kind = kinds[ROW_KIND[name]]
        nbytes = n * k * 2
        copies = max(2, min(64, -(-ROTATE_BYTES // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(2 * k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        s = (x[:k].float() ** 2).sum().view(1)
        p = torch.empty(8 * n, device="cuda", dtype=torch.float32)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        xd = x.double()
        r = (xd[:k] if kind == 0 else
             xd[:k] * torch.rsqrt(s.double() / k + 1e-5) * g.double() if kind == 1 else
             torch.nn.functional.silu(xd[:k]) * xd[k:])
        ref = ws[0].double() @ r
        per = {}
        cands = [("fma", 4, 1024, 1, 4)] + [(f, bn, bk, st, 4) for f in MMA_FORMS
                                             for bn, bk, st in MMA_TILES]
        for form, bn, bk, stages, warps in cands:
            if n % bn or k % bk:
                continue
            kern = gemv_split if form == "fma" else forms[form]
            for split in _splits(n, k, bn, bk, sms) if form != "fma" else \
                    [s_ for s_ in (1, 2, 4) if k // s_ >= 1024 and k % (s_ * 1024) == 0]:
                key = f"{form} {bn}x{bk} s{stages} k{split}"

                def launch(i, kern=kern, bn=bn, bk=bk, stages=stages, warps=warps, split=split):
                    kern[(n // bn, split)](ws[i], x, g, s, p if split > 1 else y, n, k, k // split,
                                           bn, bk, kind, num_warps=warps, num_stages=stages)
                    if split > 1:
                        sum_splits[(-(-n // 1024),)](p, y, n, split, 1024, num_warps=4)

                try:
                    y.fill_(float("nan"))
                    launch(0)
                    torch.cuda.synchronize()
                except Exception as e:   # shared memory over the limit, for one
                    results["errors"][f"{name}/{key}"] = str(e).splitlines()[0][:200]
                    continue
                err = float((y.double() - ref).norm() / ref.norm())
                if not err < 2e-2:
                    results["check"][f"{name}/{key}"] = err
                    continue
                per[key] = _time_chain(launch, copies)
        results["mma"][name] = per
        del ws
        torch.cuda.empty_cache()
        fma = min((t, c) for c, t in per.items() if c.startswith("fma"))
        best = sorted(per.items(), key=lambda kv: kv[1])[:3]
        print(f"{name:12s} N={n:6d} K={k:5d} fma best {fma[1]} {fma[0]:6.2f} us "
              f"{nbytes / fma[0] / 1e6:4.2f} | "
              + "  ".join(f"{c} {t:.2f} us {nbytes / t / 1e6:.2f}" for c, t in best), flush=True)
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write every timing to this JSON file")
    ap.add_argument("--shapes", help="comma-separated subset of: " + ",".join(SHAPES))
    ap.add_argument("--rows", action="store_true",
                    help="time codegen's GEMV template and a persistent GEMV with the row a decode "
                         "graph gives each shape (an RMSNorm or SwiGLU expression, ROW_KIND)")
    ap.add_argument("--mma", action="store_true",
                    help="time codegen's GEMV template against MMA forms of it (weights pipelined "
                         "through shared memory), split-K included, with the decode graph's row")
    args = ap.parse_args(argv)
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")} if args.shapes else SHAPES
    if args.mma:
        run_mma({s: v for s, v in shapes.items() if s in ROW_KIND and "head" not in s}, args.out)
    elif args.rows:
        run_rows({s: v for s, v in shapes.items() if s in ROW_KIND}, args.out)
    else:
        run(shapes, args.out)


if __name__ == "__main__":
    main()
