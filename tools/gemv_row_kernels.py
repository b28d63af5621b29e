"""Kernels for `gemv_sweep --rows` (a module of their own: Triton resolves a jitted helper by its
global name). The GEMV as a decode graph runs it: its row an expression of data another kernel
wrote (an RMSNorm's x * rsqrt(mean(x^2) + eps) * g, or a SwiGLU's silu(gate) * up), recomputed
by every program. `gemv_row`: codegen's template (a program per `BN` weight rows, K in steps of
`BK`). `gemv_persistent`: a grid of a few programs per SM, each computing the row once for the
whole K (K <= 4096) and then streaming tiles of `BN` weight rows with it.
"""
import triton
import triton.language as tl


@triton.jit
def row_chunk(x_ptr, g_ptr, s_ptr, rk, K: tl.constexpr, KIND: tl.constexpr):
    if KIND == 0:     # plain
        r = tl.load(x_ptr + rk).to(tl.float32)
    elif KIND == 1:   # rms: x * rsqrt(sum/K + eps) * g
        rs = tl.rsqrt(tl.load(s_ptr) / K + 1e-5)
        r = (tl.load(x_ptr + rk).to(tl.float32) * rs).to(tl.bfloat16).to(tl.float32) \
            * tl.load(g_ptr + rk).to(tl.float32)
    else:             # swiglu: silu(gate) * up, gate and up halves of one buffer
        a = tl.load(x_ptr + rk).to(tl.float32)
        b = tl.load(x_ptr + K + rk).to(tl.float32)
        r = (a / (1 + tl.exp(-a))).to(tl.bfloat16).to(tl.float32) * b
    return r


@triton.jit
def gemv_row(w_ptr, x_ptr, g_ptr, s_ptr, y_ptr, K: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, KIND: tl.constexpr, AHEAD: tl.constexpr = 0):
    """`AHEAD` (0-2): K steps of weights loaded ahead of the step being summed, in registers
    (Triton's num_stages does not pipeline loads that feed no dot)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BK], tl.float32)
    if AHEAD == 0:
        for kk in range(0, K, BK):
            rk = kk + tl.arange(0, BK)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
            acc += w.to(tl.float32) * row_chunk(x_ptr, g_ptr, s_ptr, rk, K, KIND)[None, :]
    elif AHEAD == 1:
        rk = tl.arange(0, BK)
        nxt = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        for kk in range(0, K, BK):
            rk = kk + tl.arange(0, BK)
            w = nxt
            rk2 = rk + BK
            nxt = tl.load(w_ptr + rn[:, None] * K + rk2[None, :], mask=(rk2 < K)[None, :])
            acc += w.to(tl.float32) * row_chunk(x_ptr, g_ptr, s_ptr, rk, K, KIND)[None, :]
    else:
        rk = tl.arange(0, BK)
        nxt = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        rk1 = rk + BK
        nxt2 = tl.load(w_ptr + rn[:, None] * K + rk1[None, :], mask=(rk1 < K)[None, :])
        for kk in range(0, K, BK):
            rk = kk + tl.arange(0, BK)
            w = nxt
            nxt = nxt2
            rk2 = rk + 2 * BK
            nxt2 = tl.load(w_ptr + rn[:, None] * K + rk2[None, :], mask=(rk2 < K)[None, :])
            acc += w.to(tl.float32) * row_chunk(x_ptr, g_ptr, s_ptr, rk, K, KIND)[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def gemv_persistent(w_ptr, x_ptr, g_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr,
                    KIND: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    rk = tl.arange(0, K)
    row = row_chunk(x_ptr, g_ptr, s_ptr, rk, K, KIND)[None, :]
    tiles = N // BN
    if PREFETCH:   # the next tile's weights in flight while this one is summed
        rn = pid * BN + tl.arange(0, BN)
        nxt = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn < N)[:, None])
        for t in range(pid, tiles, grid):
            w = nxt
            rn2 = (t + grid) * BN + tl.arange(0, BN)
            nxt = tl.load(w_ptr + rn2[:, None] * K + rk[None, :], mask=(rn2 < N)[:, None])
            y = tl.sum(w.to(tl.float32) * row, axis=1)
            tl.store(y_ptr + t * BN + tl.arange(0, BN), y.to(y_ptr.dtype.element_ty))
    else:
        for t in range(pid, tiles, grid):
            rn = t * BN + tl.arange(0, BN)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
            y = tl.sum(w.to(tl.float32) * row, axis=1)
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))
