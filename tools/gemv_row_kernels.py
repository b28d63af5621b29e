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


# ---- `gemv_sweep --mma`: the same row, K and its split at run time, partial sums in fp32 ----------
@triton.jit
def row_any(x_ptr, g_ptr, s_ptr, rk, K, KIND: tl.constexpr):
    """`row_chunk` with K at run time (one compile serves every shape and split)."""
    if KIND == 0:
        r = tl.load(x_ptr + rk).to(tl.float32)
    elif KIND == 1:
        rs = tl.rsqrt(tl.load(s_ptr) / K + 1e-5)
        r = (tl.load(x_ptr + rk).to(tl.float32) * rs).to(tl.bfloat16).to(tl.float32) \
            * tl.load(g_ptr + rk).to(tl.float32)
    else:
        a = tl.load(x_ptr + rk).to(tl.float32)
        b = tl.load(x_ptr + K + rk).to(tl.float32)
        r = (a / (1 + tl.exp(-a))).to(tl.bfloat16).to(tl.float32) * b
    return r


@triton.jit
def gemv_split(w_ptr, x_ptr, g_ptr, s_ptr, p_ptr, N, K, CHUNK, BN: tl.constexpr,
               BK: tl.constexpr, KIND: tl.constexpr):
    """Codegen's GEMV template (FMA into a [BN, BK] accumulator), program (i, z) summing K range
    z * CHUNK into partial row z."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(1) * CHUNK
    acc = tl.zeros([BN, BK], tl.float32)
    for kk in range(0, CHUNK, BK):
        rk = k_lo + kk + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc += w.to(tl.float32) * row_any(x_ptr, g_ptr, s_ptr, rk, K, KIND)[None, :]
    tl.store(p_ptr + tl.program_id(1) * N + rn, tl.sum(acc, axis=1))


@triton.jit
def gemv_mma_x16(w_ptr, x_ptr, g_ptr, s_ptr, p_ptr, N, K, CHUNK, BN: tl.constexpr,
                 BK: tl.constexpr, KIND: tl.constexpr):
    """The row as row 0 of a 16-row A tile, the weights' [BK, BN] transpose as B: codegen's
    matmul template at M = 1. The weight tiles feed a dot, so num_stages pipelines them through
    shared memory."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(1) * CHUNK
    rm = tl.arange(0, 16)
    acc = tl.zeros([16, BN], tl.float32)
    for kk in range(0, CHUNK, BK):
        rk = k_lo + kk + tl.arange(0, BK)
        r = row_any(x_ptr, g_ptr, s_ptr, rk, K, KIND).to(tl.bfloat16)
        a = tl.where(rm[:, None] == 0, r[None, :], 0.0).to(tl.bfloat16)
        b = tl.load(w_ptr + rn[None, :] * K + rk[:, None])
        acc = tl.dot(a, b, acc)
    y = tl.sum(tl.where(rm[:, None] == 0, acc, 0.0), axis=0)
    tl.store(p_ptr + tl.program_id(1) * N + rn, y)


@triton.jit
def gemv_mma_swap(w_ptr, x_ptr, g_ptr, s_ptr, p_ptr, N, K, CHUNK, BN: tl.constexpr,
                  BK: tl.constexpr, KIND: tl.constexpr):
    """Operands swapped: the [BN, BK] weight tile is A (its N fills the MMA's M), the row is
    column 0 of a 16-column B tile."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(1) * CHUNK
    rc = tl.arange(0, 16)
    acc = tl.zeros([BN, 16], tl.float32)
    for kk in range(0, CHUNK, BK):
        rk = k_lo + kk + tl.arange(0, BK)
        r = row_any(x_ptr, g_ptr, s_ptr, rk, K, KIND).to(tl.bfloat16)
        xb = tl.where(rc[None, :] == 0, r[:, None], 0.0).to(tl.bfloat16)
        a = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc = tl.dot(a, xb, acc)
    y = tl.sum(tl.where(rc[None, :] == 0, acc, 0.0), axis=1)
    tl.store(p_ptr + tl.program_id(1) * N + rn, y)


@triton.jit
def sum_splits(p_ptr, y_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """The split-K reduction lowering emits after a split GEMV."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros([BLOCK], tl.float32)
    for z in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + z * N + rn, mask=mask, other=0.0)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=mask)
