"""Tiny `.grace` packages built by hand (no grace.aot), for tools/ and runtime tests.

1. `build_handmade_package`: a static package (no symbols, one graph).

    out = x * 2 + w + b          x: [4, 8] input, w: [4, 8] weight, b: [8] weight

as three kernels, exactly as docs/architecture.md lays them out:

    node 0  table_writer(table, w0..w9)      writes the argument table (2 slots of rank 2)
    node 1  k_scale(x_slot, t)               t = x * 2        t lives in the arena
    node 2  k_add(t, w, b, out_slot)         out = t + w + b  out reached through its table slot

The cubins are compiled for sm_90 with Triton on the CPU (no GPU needed), so the same package runs
on the GPU runtime and on the CPU reference executor.

`bug="partial_t"` builds a broken variant whose k_scale writes only the first 3 rows of t: the last
row of `out` then reads arena memory nobody wrote (NaN when the arena is poisoned).

2. `build_bucket_package`: shape buckets (docs/design-buckets.md), one input symbol
`n` in [1, 64] served by three graphs (buckets n=16, 32, 64):

    out[n, 8] = x[n, 8] * 2 + b[8]            x: input, b: [8] weight
    head[k, 8] = out[:k]                      with data_output=True: k = #{r < n : x[r, 0] > 0},
                                              a data symbol computed on the device

    node 0  table_writer(table, w0..)         slot words, then the symbol words (extents)
    node 1  kb_scale(x_slot, t)               t = x * 2 for rows < n (n and strides from x's slot);
                                              t is an arena buffer [bucket bound, 8]
   (node 2  kb_count(x_slot, ext)             k into the extents word of symbol k)
    node 2|3 kb_add(t, b, ext, out_slot[, head_slot])   rows < n (n from the extents words)

The kernels are the same in every graph (16-row tiles); a graph differs in its grid (bound / 16
programs) and its arena. Padded rows of t are never written and never read: with a NaN-poisoned
arena a kernel that ignored the true n would show NaN in the outputs.

3. `build_counter_package`: session state (format 3.0, docs/design-state.md). A static package whose
kernel updates two state entries in place on every run: `calls` (int64 [1], init "data", starts at
10) += 1 and `acc` (float32 [4, 8], init "zeros") += x; out = acc + calls (`counter_reference`).

4. `build_lm_package`: a `generate` map (SPEC.md §5.2). A "language model" whose next token is
(token + position + 1) % 8, with a state `hist` the kernel scatters tokens into at their positions,
the four generate.* state entries and a handmade step kernel (argmax + advance); `lm_reference`
says what generate() returns.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile

import numpy as np

ROWS, COLS = 4, 8
SHAPE = (ROWS, COLS)
ARCH = "sm_90"

_TL = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}
_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def table_writer_source(n_words: int, word_offsets: list[int] | None = None) -> str:
    """A table writer storing word k at `table + word_offsets[k]` (in 8-byte elements)."""
    offs = word_offsets if word_offsets is not None else list(range(n_words))
    ws = ", ".join(f"w{k}" for k in range(n_words))
    body = "\n".join(f"    tl.store(table + {offs[k]}, w{k})" for k in range(n_words))
    return f"import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef table_writer(table, {ws}):\n{body}\n"


def _scale_source(dtype: str, rows_written: int) -> str:
    t = _TL[dtype]
    return f'''import triton
import triton.language as tl


@triton.jit
def k_scale(x_slot, t):
    # x: [{ROWS}, {COLS}] user input, reached through its table slot; t: [{ROWS}, {COLS}] arena
    x_ptr = tl.load(x_slot).to(tl.pointer_type({t}))
    offs = tl.arange(0, {ROWS * COLS})
    mask = offs < {rows_written * COLS}
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(t + offs, x * 2, mask=mask)
'''


def _add_source(dtype: str) -> str:
    t = _TL[dtype]
    return f'''import triton
import triton.language as tl


@triton.jit
def k_add(t, w, b, out_slot):
    # out[r, c] = t[r, c] + w[r, c] + b[c]; one program per row
    row = tl.program_id(0)
    cols = tl.arange(0, {COLS})
    out_ptr = tl.load(out_slot).to(tl.pointer_type({t}))
    v = tl.load(t + row * {COLS} + cols) + tl.load(w + row * {COLS} + cols) + tl.load(b + cols)
    tl.store(out_ptr + row * {COLS} + cols, v)
'''


def _compile(source: str, fn_name: str, signature: dict[str, str], num_warps: int, arch: str = ARCH):
    """Compile kernel source to a cubin for `arch` on this (GPU-less) machine."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    d = tempfile.mkdtemp(prefix="grace-handmade-")
    sha = hashlib.sha256(source.encode()).hexdigest()
    path = os.path.join(d, f"{fn_name}_{sha[:12]}.py")
    with open(path, "w") as f:
        f.write(source)
    mod_name = f"_grace_handmade_{fn_name}_{sha[:12]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    with knobs.runtime.scope():
        knobs.runtime.interpret = False  # real JITFunctions even if TRITON_INTERPRET=1 is set
        spec.loader.exec_module(mod)
    fn = getattr(mod, fn_name)
    cc = int(arch.split("_")[1])
    compiled = triton.compile(
        ASTSource(fn, signature, {}, {}),
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": num_warps},
    )
    return compiled


def _kernel_entry(name, family, source, signature, compiled, archs):
    md = compiled.metadata
    assert md.name == name, (md.name, name)
    return {
        "name": name,
        "family": family,
        "params": [{"name": k, "type": v} for k, v in signature.items()],
        "num_warps": int(md.num_warps),
        "num_stages": int(md.num_stages),
        "shared": int(md.shared),
        "hidden_params": 2,
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
        "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "binaries": {a: f"cubin/{name}.{a}" for a in archs},
        "source": f"src/{name}.py",
    }


def _kernels_and_sections(specs, archs) -> tuple[list, dict[str, bytes]]:
    """Compile (name, family, source, signature, num_warps) specs for every arch: the manifest's
    kernel entries and the cubin/ and src/ sections."""
    kernels, sections = [], {}
    for kname, family, src, sig, nw in specs:
        compiled = {a: _compile(src, kname, sig, nw, a) for a in archs}
        kernels.append(_kernel_entry(kname, family, src, sig, compiled[archs[0]], archs))
        sections[f"src/{kname}.py"] = src.encode()
        for a in archs:
            sections[f"cubin/{kname}.{a}"] = bytes(compiled[a].asm["cubin"])
    return kernels, sections


def make_weights(dtype: str = "float32", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype in ("float32", "bfloat16") else np.float16
    return {
        "w": rng.standard_normal(SHAPE).astype(np_dtype),
        "b": rng.standard_normal((COLS,)).astype(np_dtype),
    }


def reference(x: np.ndarray, weights: dict[str, np.ndarray]) -> np.ndarray:
    """What the package computes, in numpy (same dtype as x)."""
    return x * x.dtype.type(2) + weights["w"] + weights["b"]


def _bf16_bytes(a: np.ndarray) -> bytes:
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x8000) >> 16).astype(np.uint16).tobytes()  # round half up; fine for tests


def build_handmade_package(path, **kw) -> pathlib.Path:
    """Write the hand-made package to `path`; return the path. Keywords: see `handmade_contents`."""
    from grace.formats import write_package

    path = pathlib.Path(path)
    manifest, sections = handmade_contents(**kw)
    write_package(path, manifest, sections)
    return path


def handmade_contents(
    *,
    dtype: str = "float32",
    name: str = "handmade",
    bug: str | None = None,
    archs: tuple[str, ...] = (ARCH,),
    seed: int = 0,
) -> tuple[dict, dict[str, bytes]]:
    """(manifest, sections) of the hand-made package. `dtype`: float32 | float16 | bfloat16."""
    import torch
    import triton

    from grace.formats import encode_weights

    item = _ITEMSIZE[dtype]
    ptr = _PTR[dtype]
    nbytes_xo = ROWS * COLS * item  # x, t, w and out
    nbytes_b = COLS * item

    # Argument table: slot 0 = x, slot 1 = out, each rank 2 -> 5 words (40 bytes), slots 16-aligned.
    slot_offsets = [0, 48]
    ranks = [2, 2]
    word_offsets = [so // 8 + j for so, r in zip(slot_offsets, ranks) for j in range(1 + 2 * r)]
    n_words = len(word_offsets)
    table_nbytes = 96

    weights = make_weights(dtype, seed)
    w_off, b_off = 0, 256
    weights_nbytes = b_off + nbytes_b

    # --- kernels ---------------------------------------------------------------------------------
    tw_src = table_writer_source(n_words, word_offsets)
    tw_sig = {"table": "*i64", **{f"w{k}": "i64" for k in range(n_words)}}
    sc_src = _scale_source(dtype, rows_written=ROWS - 1 if bug == "partial_t" else ROWS)
    sc_sig = {"x_slot": "*i64", "t": ptr}
    add_src = _add_source(dtype)
    add_sig = {"t": ptr, "w": ptr, "b": ptr, "out_slot": "*i64"}

    specs = [
        ("table_writer", "table_writer", tw_src, tw_sig, 1),
        ("k_scale", "pointwise", sc_src, sc_sig, 4),
        ("k_add", "pointwise", add_src, add_sig, 4),
    ]
    kernels, sections = _kernels_and_sections(specs, archs)

    # --- weights -----------------------------------------------------------------------------------
    def raw(a):
        return _bf16_bytes(a) if dtype == "bfloat16" else a.tobytes()

    sections["weights"] = encode_weights(
        {n: (dtype, tuple(a.shape), raw(a)) for n, a in weights.items()}
    )

    slot = lambda off, nb=8: {"region": "table", "offset": off, "nbytes": nb, "dtype": "int64"}  # noqa: E731
    t_arg = {"region": "arena", "offset": 0, "nbytes": nbytes_xo, "dtype": dtype}
    manifest = {
        "format_version": [3, 0],
        "producer": {"grace": "0.1.0", "torch": torch.__version__.split("+")[0], "triton": triton.__version__},
        "model": {"name": name},
        "archs": list(archs),
        "options": {"handmade": True},
        "symbols": [],
        "inputs": [{"name": "x", "dtype": dtype, "shape": [ROWS, COLS], "slot": 0}],
        "outputs": [{"name": "out", "dtype": dtype, "shape": [ROWS, COLS], "slot": 1}],
        "table": {
            "nbytes": table_nbytes,
            "slots": [
                {"name": "x", "role": "input", "offset": slot_offsets[0], "rank": ranks[0]},
                {"name": "out", "role": "output", "offset": slot_offsets[1], "rank": ranks[1]},
            ],
            "extents": {"offset": table_nbytes, "count": 0},
        },
        "regions": {"weights": weights_nbytes, "arena": 256, "table": table_nbytes, "state": 0},
        "state": [],
        "weights": [
            {"name": "w", "dtype": dtype, "shape": [ROWS, COLS], "offset": w_off, "nbytes": nbytes_xo},
            {"name": "b", "dtype": dtype, "shape": [COLS], "offset": b_off, "nbytes": nbytes_b},
        ],
        "arena_buffers": [{"name": "t", "offset": 0, "nbytes": nbytes_xo, "first": 1, "last": 2}],
        "kernels": kernels,
        "graphs": [
            {
                "name": "main",
                "bucket": {},
                "arena": 256,
                "nodes": [
                    {
                        "kernel": 0,
                        "grid": [1, 1, 1],
                        "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes}]
                        + [{"word": k} for k in range(n_words)],
                        "deps": [],
                        "label": "table_writer",
                    },
                    {
                        "kernel": 1,
                        "grid": [1, 1, 1],
                        "args": [slot(slot_offsets[0]), t_arg],
                        "deps": [0],
                        "label": "mul",
                    },
                    {
                        "kernel": 2,
                        "grid": [ROWS, 1, 1],
                        "args": [
                            t_arg,
                            {"region": "weights", "offset": w_off, "nbytes": nbytes_xo, "dtype": dtype},
                            {"region": "weights", "offset": b_off, "nbytes": nbytes_b, "dtype": dtype},
                            slot(slot_offsets[1]),
                        ],
                        "deps": [0, 1],
                        "label": "add+add",
                    },
                ],
                "stats": {"kernels": 3, "est_gpu_us": 1.7},
            }
        ],
    }
    return manifest, sections


# ------------------------------------------------------------------------------ bucket package

B_COLS = 8                  # out[n, B_COLS]
N_MIN, N_MAX = 1, 64        # range of the input symbol n
BUCKETS = (16, 32, 64)      # one graph per bound
TILE = 16                   # rows per program; every bucket bound is a multiple


def _bucket_scale_source() -> str:
    return f'''import triton
import triton.language as tl


@triton.jit
def kb_scale(x_slot, t):
    # t[r, c] = 2 * x[r, c] for the true rows r < n. x's slot holds [ptr, n, {B_COLS}, stride0, stride1];
    # t is an arena buffer [bucket bound, {B_COLS}] whose padded rows stay unwritten.
    x_ptr = tl.load(x_slot).to(tl.pointer_type(tl.float32))
    n = tl.load(x_slot + 1)
    s0 = tl.load(x_slot + 3)
    s1 = tl.load(x_slot + 4)
    rows = tl.program_id(0) * {TILE} + tl.arange(0, {TILE})
    cols = tl.arange(0, {B_COLS})
    mask = (rows[:, None] < n) & (cols[None, :] < {B_COLS})
    x = tl.load(x_ptr + rows[:, None] * s0 + cols[None, :] * s1, mask=mask)
    tl.store(t + rows[:, None] * {B_COLS} + cols[None, :], x * 2, mask=mask)
'''


def _bucket_count_source() -> str:
    return f'''import triton
import triton.language as tl


@triton.jit
def kb_count(x_slot, ext):
    # k = #{{r < n : x[r, 0] > 0}} into the extents word of the data symbol k (symbol 1). The loop
    # bound is static (the range maximum): the interpreter cannot loop to a runtime bound.
    x_ptr = tl.load(x_slot).to(tl.pointer_type(tl.float32))
    n = tl.load(x_slot + 1)
    s0 = tl.load(x_slot + 3)
    total = tl.zeros([{TILE}], tl.int64)
    for r0 in range(0, {N_MAX}, {TILE}):
        rows = r0 + tl.arange(0, {TILE})
        v = tl.load(x_ptr + rows * s0, mask=rows < n, other=0.0)
        total += (v > 0).to(tl.int64)
    tl.store(ext + 1, tl.sum(total, axis=0))
'''


def _bucket_add_source(data_output: bool) -> str:
    head_param = ", head_slot" if data_output else ""
    head = f'''
    # head = out[:k], k (symbol 1) computed by kb_count
    k = tl.load(ext + 1)
    head_ptr = tl.load(head_slot).to(tl.pointer_type(tl.float32))
    h0 = tl.load(head_slot + 3)
    h1 = tl.load(head_slot + 4)
    hmask = (rows[:, None] < k) & (cols[None, :] < {B_COLS})
    tl.store(head_ptr + rows[:, None] * h0 + cols[None, :] * h1, v, mask=hmask)
''' if data_output else ""
    return f'''import triton
import triton.language as tl


@triton.jit
def kb_add(t, b, ext, out_slot{head_param}):
    # out[r, c] = t[r, c] + b[c] for r < n, n read from the extents words (symbol 0)
    n = tl.load(ext)
    out_ptr = tl.load(out_slot).to(tl.pointer_type(tl.float32))
    o0 = tl.load(out_slot + 3)
    o1 = tl.load(out_slot + 4)
    rows = tl.program_id(0) * {TILE} + tl.arange(0, {TILE})
    cols = tl.arange(0, {B_COLS})
    mask = (rows[:, None] < n) & (cols[None, :] < {B_COLS})
    v = tl.load(t + rows[:, None] * {B_COLS} + cols[None, :], mask=mask) + tl.load(b + cols)[None, :]
    tl.store(out_ptr + rows[:, None] * o0 + cols[None, :] * o1, v, mask=mask)
{head}'''


def bucket_weights(seed: int = 0) -> dict[str, np.ndarray]:
    return {"b": np.random.default_rng(seed).standard_normal((B_COLS,)).astype(np.float32)}


def bucket_reference(x: np.ndarray, weights: dict[str, np.ndarray], data_output: bool = False) -> dict:
    """What the bucket package computes, in numpy."""
    out = x * np.float32(2) + weights["b"]
    if not data_output:
        return {"out": out}
    return {"out": out, "head": out[: int((x[:, 0] > 0).sum())]}


def build_bucket_package(path, **kw) -> pathlib.Path:
    """Write the bucket package to `path`; return the path. Keywords: see `bucket_contents`."""
    from grace.formats import write_package

    path = pathlib.Path(path)
    manifest, sections = bucket_contents(**kw)
    write_package(path, manifest, sections)
    return path


def bucket_contents(*, data_output: bool = False, archs: tuple[str, ...] = (ARCH,),
                    seed: int = 0) -> tuple[dict, dict[str, bytes]]:
    """(manifest, sections) of the bucket package (format 3.0, stateless), float32."""
    import torch
    import triton

    from grace.formats import encode_weights

    names = ["x", "out"] + (["head"] if data_output else [])
    slot_offsets = [48 * i for i in range(len(names))]        # rank 2: 5 words (40 bytes), 16-aligned
    n_slot_words = 5 * len(names)
    n_symbols = 2 if data_output else 1
    ext_offset = slot_offsets[-1] + 40
    table_nbytes = (ext_offset + 8 * n_symbols + 15) // 16 * 16
    word_offsets = ([so // 8 + j for so in slot_offsets for j in range(5)]
                    + [ext_offset // 8 + k for k in range(n_symbols)])

    specs = [("table_writer", "table_writer", table_writer_source(len(word_offsets), word_offsets),
              {"table": "*i64", **{f"w{k}": "i64" for k in range(len(word_offsets))}}, 1),
             ("kb_scale", "pointwise", _bucket_scale_source(), {"x_slot": "*i64", "t": "*fp32"}, 4)]
    if data_output:
        specs.append(("kb_count", "reduction", _bucket_count_source(), {"x_slot": "*i64", "ext": "*i64"}, 1))
    add_sig = {"t": "*fp32", "b": "*fp32", "ext": "*i64", "out_slot": "*i64"}
    if data_output:
        add_sig["head_slot"] = "*i64"
    specs.append(("kb_add", "pointwise", _bucket_add_source(data_output), add_sig, 4))
    kernels, sections = _kernels_and_sections(specs, archs)
    weights = bucket_weights(seed)
    sections["weights"] = encode_weights({n: ("float32", a.shape, a.tobytes()) for n, a in weights.items()})

    symbols = [{"name": "n", "kind": "input", "min": N_MIN, "max": N_MAX, "sources": [[0, 0]]}]
    if data_output:
        symbols.append({"name": "k", "kind": "data", "min": 0, "max": N_MAX, "sources": []})
    outputs = [{"name": "out", "dtype": "float32", "shape": ["n", B_COLS], "slot": 1}]
    if data_output:
        outputs.append({"name": "head", "dtype": "float32", "shape": ["k", B_COLS], "slot": 2})
    manifest = {
        "format_version": [3, 0],
        "producer": {"grace": "0.1.0", "torch": torch.__version__.split("+")[0], "triton": triton.__version__},
        "model": {"name": "handmade_buckets"},
        "archs": list(archs),
        "options": {"handmade": True},
        "symbols": symbols,
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["n", B_COLS], "slot": 0}],
        "outputs": outputs,
        "table": {"nbytes": table_nbytes,
                  "slots": [{"name": nm, "role": "input" if i == 0 else "output", "offset": off, "rank": 2}
                            for i, (nm, off) in enumerate(zip(names, slot_offsets))],
                  "extents": {"offset": ext_offset, "count": n_symbols}},
        "regions": {"weights": 4 * B_COLS, "arena": _t_nbytes(max(BUCKETS)), "table": table_nbytes, "state": 0},
        "state": [],
        "weights": [{"name": "b", "dtype": "float32", "shape": [B_COLS], "offset": 0, "nbytes": 4 * B_COLS}],
        "arena_buffers": [{"name": "t", "offset": 0, "nbytes": _t_nbytes(max(BUCKETS)), "first": 1, "last": 2}],
        "kernels": kernels,
        "graphs": [_bucket_graph(bound, data_output, slot_offsets, ext_offset, n_symbols, table_nbytes,
                                 len(word_offsets)) for bound in BUCKETS],
    }
    assert n_slot_words + n_symbols == len(word_offsets)
    return manifest, sections


def _t_nbytes(bound: int) -> int:
    return bound * B_COLS * 4


def _bucket_graph(bound, data_output, slot_offsets, ext_offset, n_symbols, table_nbytes, n_words) -> dict:
    """The graph of one bucket: same kernels, grid and arena scaled to the bound."""
    def table(off, nbytes):
        return {"region": "table", "offset": off, "nbytes": nbytes, "dtype": "int64"}

    slot = [table(off, 40) for off in slot_offsets]
    ext = table(ext_offset, 8 * n_symbols)
    t = {"region": "arena", "offset": 0, "nbytes": _t_nbytes(bound), "dtype": "float32"}
    b = {"region": "weights", "offset": 0, "nbytes": 4 * B_COLS, "dtype": "float32"}
    grid = [bound // TILE, 1, 1]
    writer = {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
              "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes}]
              + [{"word": w} for w in range(n_words)]}
    nodes = [writer, {"kernel": 1, "grid": grid, "deps": [0], "label": "mul", "args": [slot[0], t]}]
    if data_output:
        nodes.append({"kernel": 2, "grid": [1, 1, 1], "deps": [0], "label": "count", "args": [slot[0], ext]})
    add_kernel = 3 if data_output else 2  # kernels: table_writer, kb_scale, (kb_count,) kb_add
    nodes.append({"kernel": add_kernel, "grid": grid, "deps": list(range(len(nodes))), "label": "add",
                  "args": [t, b, ext, *slot[1:]]})
    bucket = {"n": bound, **({"k": bound} if data_output else {})}
    return {"name": f"n={bound}", "bucket": bucket, "arena": _t_nbytes(bound), "nodes": nodes,
            "stats": {"kernels": len(nodes)}}


# ------------------------------------------------------------------------------ state package

C_ELEMS = ROWS * COLS        # x, out, acc: [4, 8] float32
CALLS_START = 10             # initial value of the `calls` state entry (init "data")


def _counter_source() -> str:
    return f'''import triton
import triton.language as tl


@triton.jit
def k_count(x_slot, out_slot, calls, acc):
    # state: calls += 1 (int64, starts at {CALLS_START}), acc += x (float32 [{ROWS}, {COLS}], starts at 0);
    # out = acc + calls. One program, one warp: the scalar load of calls precedes its store.
    x_ptr = tl.load(x_slot).to(tl.pointer_type(tl.float32))
    out_ptr = tl.load(out_slot).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, {C_ELEMS})
    c = tl.load(calls) + 1
    a = tl.load(acc + offs) + tl.load(x_ptr + offs)
    tl.store(acc + offs, a)
    tl.store(out_ptr + offs, a + c.to(tl.float32))
    tl.store(calls, c)
'''


def counter_reference(xs) -> tuple[np.ndarray, dict]:
    """(out of the last run, state after the runs) for runs over the arrays `xs`, from a fresh state."""
    acc = np.zeros(SHAPE, np.float32)
    calls = CALLS_START
    out = None
    for x in xs:
        acc = acc + x
        calls += 1
        out = acc + np.float32(calls)
    return out, {"calls": np.array([calls], np.int64), "acc": acc}


def build_counter_package(path, **kw) -> pathlib.Path:
    """Write the state package to `path`; return the path. Keywords: see `counter_contents`."""
    from grace.formats import write_package

    path = pathlib.Path(path)
    manifest, sections = counter_contents(**kw)
    write_package(path, manifest, sections)
    return path


def counter_contents(*, archs: tuple[str, ...] = (ARCH,)) -> tuple[dict, dict[str, bytes]]:
    """(manifest, sections) of a static package with session state (format 3.0):

        node 0  table_writer(table, w0..w9)
        node 1  k_count(x_slot, out_slot, calls, acc)    calls += 1; acc += x; out = acc + calls

    `calls` (int64 [1], init "data": CALLS_START from the `state` section) and `acc` (float32 [4, 8],
    init "zeros") persist across run() calls of one session; reset_state() restores them."""
    from grace.formats import encode_weights

    slot_offsets, table_nbytes = [0, 48], 96
    word_offsets = [so // 8 + j for so in slot_offsets for j in range(5)]
    specs = [("table_writer", "table_writer", table_writer_source(len(word_offsets), word_offsets),
              {"table": "*i64", **{f"w{k}": "i64" for k in range(len(word_offsets))}}, 1),
             ("k_count", "pointwise", _counter_source(),
              {"x_slot": "*i64", "out_slot": "*i64", "calls": "*i64", "acc": "*fp32"}, 1)]
    kernels, sections = _kernels_and_sections(specs, archs)
    start = np.array([CALLS_START], np.int64)
    sections["state"] = encode_weights({"calls": ("int64", (1,), start.tobytes())})
    calls = {"region": "state", "offset": 0, "nbytes": 8, "dtype": "int64"}
    acc = {"region": "state", "offset": 256, "nbytes": 4 * C_ELEMS, "dtype": "float32"}
    slot = lambda off: {"region": "table", "offset": off, "nbytes": 40, "dtype": "int64"}  # noqa: E731
    manifest = {
        "format_version": [3, 0], "producer": {"grace": "0.1.0"}, "model": {"name": "handmade_counter"},
        "archs": list(archs), "options": {"handmade": True}, "symbols": [],
        "inputs": [{"name": "x", "dtype": "float32", "shape": [ROWS, COLS], "slot": 0}],
        "outputs": [{"name": "out", "dtype": "float32", "shape": [ROWS, COLS], "slot": 1}],
        "table": {"nbytes": table_nbytes, "extents": {"offset": table_nbytes, "count": 0},
                  "slots": [{"name": "x", "role": "input", "offset": 0, "rank": 2},
                            {"name": "out", "role": "output", "offset": 48, "rank": 2}]},
        "regions": {"weights": 0, "arena": 0, "table": table_nbytes, "state": 256 + 4 * C_ELEMS},
        "weights": [],
        "state": [{"name": "calls", "dtype": "int64", "shape": [1], "offset": 0, "nbytes": 8, "init": "data"},
                  {"name": "acc", "dtype": "float32", "shape": [ROWS, COLS], "offset": 256,
                   "nbytes": 4 * C_ELEMS, "init": "zeros"}],
        "kernels": kernels,
        "graphs": [{"name": "main", "bucket": {}, "arena": 0, "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes}]
             + [{"word": w} for w in range(len(word_offsets))]},
            {"kernel": 1, "grid": [1, 1, 1], "deps": [0], "label": "count",
             "args": [slot(0), slot(48), calls, acc]}]}],
    }
    return manifest, sections


# ------------------------------------------------------------------------------ generate package

LM_V, LM_SEQ = 8, 16          # vocabulary; tokens [1, seq], seq in [1, 16]; capacity 16 positions


def _lm_source() -> str:
    return f'''import triton
import triton.language as tl


@triton.jit
def k_lm(tokens_slot, positions_slot, logits_slot, hist):
    # A "language model" whose next token is (token + position + 1) % {LM_V}: logits[0, t, v] =
    # -(v - target)^2. It also scatters each token into the state `hist` at its position (a KV
    # cache in miniature: written at positions that exist only on the device).
    tp = tl.load(tokens_slot).to(tl.pointer_type(tl.int64))
    n = tl.load(tokens_slot + 2)
    ts = tl.load(tokens_slot + 4)
    pp = tl.load(positions_slot).to(tl.pointer_type(tl.int64))
    ps = tl.load(positions_slot + 2)
    lp = tl.load(logits_slot).to(tl.pointer_type(tl.float32))
    l1 = tl.load(logits_slot + 5)
    l2 = tl.load(logits_slot + 6)
    t = tl.arange(0, {LM_SEQ})
    m = t < n
    tok = tl.load(tp + t * ts, mask=m, other=0)
    pos = tl.load(pp + t * ps, mask=m, other=0)
    tl.store(hist + pos, tok, mask=m & (pos >= 0) & (pos < {LM_SEQ}))
    target = (tok + pos + 1) % {LM_V}
    v = tl.arange(0, {LM_V})
    d = (v[None, :] - target[:, None]).to(tl.float32)
    tl.store(lp + t[:, None] * l1 + v[None, :] * l2, -(d * d), mask=m[:, None])
'''


def _step_source() -> str:
    return f'''import triton
import triton.language as tl


@triton.jit
def k_step(logits_slot, positions_slot, ctrl, out_tokens, next_token, next_position):
    # SPEC.md 5.2: token = argmax(logits[-1]) -> out_tokens[count], next_token; positions[-1] + 1 ->
    # next_position; count + 1 and done = (token == eos) | (count >= limit) -> ctrl. One warp.
    lp = tl.load(logits_slot).to(tl.pointer_type(tl.float32))
    n = tl.load(logits_slot + 2)
    l1 = tl.load(logits_slot + 5)
    l2 = tl.load(logits_slot + 6)
    pp = tl.load(positions_slot).to(tl.pointer_type(tl.int64))
    pn = tl.load(positions_slot + 1)
    ps = tl.load(positions_slot + 2)
    v = tl.arange(0, {LM_V})
    row = tl.load(lp + (n - 1) * l1 + v * l2)
    tok = tl.argmax(row, axis=0).to(tl.int64)
    pos = tl.load(pp + (pn - 1) * ps)
    count = tl.load(ctrl)
    limit = tl.load(ctrl + 1)
    eos = tl.load(ctrl + 2)
    tl.store(out_tokens + count, tok)
    tl.store(next_token, tok)
    tl.store(next_position, pos + 1)
    count = count + 1
    done = (tok == eos) | (count >= limit)
    tl.store(ctrl, count)
    tl.store(ctrl + 3, done.to(tl.int64))
'''


def lm_reference(prompt, max_new_tokens: int, eos_token_id=None) -> np.ndarray:
    """What generate() returns for the handmade LM (greedy, next = (token + position + 1) % V)."""
    tok, pos = int(prompt[-1]), len(prompt) - 1
    out = []
    while len(out) < max_new_tokens:
        tok, pos = (tok + pos + 1) % LM_V, pos + 1
        out.append(tok)
        if tok == eos_token_id:
            break
    return np.array(out, np.int64)


def build_lm_package(path, **kw) -> pathlib.Path:
    """Write the generate package to `path`; return the path. Keywords: see `lm_contents`."""
    from grace.formats import write_package

    path = pathlib.Path(path)
    manifest, sections = lm_contents(**kw)
    write_package(path, manifest, sections)
    return path


def lm_contents(*, archs: tuple[str, ...] = (ARCH,)) -> tuple[dict, dict[str, bytes]]:
    """(manifest, sections) of a package with a `generate` map (format 3.0): idx [1, seq] and
    input_pos [seq] (int64) -> logits [1, seq, 8]; one graph (bucket seq=16) that is also the decode
    graph; state `hist` (int64 [16], zeros) plus the four generate.* entries; the step kernel k_step."""
    slots = [("idx", "input", 0, 2), ("input_pos", "input", 48, 1), ("logits", "output", 80, 3)]
    ext_offset, table_nbytes = 136, 144
    word_offsets = [off // 8 + j for _, _, off, r in slots for j in range(1 + 2 * r)] + [ext_offset // 8]
    n_words = len(word_offsets)
    specs = [("table_writer", "table_writer", table_writer_source(n_words, word_offsets),
              {"table": "*i64", **{f"w{k}": "i64" for k in range(n_words)}}, 1),
             ("k_lm", "pointwise", _lm_source(),
              {"tokens_slot": "*i64", "positions_slot": "*i64", "logits_slot": "*i64", "hist": "*i64"}, 1),
             ("k_step", "reduction", _step_source(),
              {"logits_slot": "*i64", "positions_slot": "*i64", "ctrl": "*i64", "out_tokens": "*i64",
               "next_token": "*i64", "next_position": "*i64"}, 1)]
    kernels, sections = _kernels_and_sections(specs, archs)
    state = [("hist", [LM_SEQ], 0), ("generate.ctrl", [4], 256), ("generate.out_tokens", [LM_SEQ], 512),
             ("generate.next_token", [1, 1], 768), ("generate.next_position", [1], 1024)]
    entries = [{"name": n, "dtype": "int64", "shape": s, "offset": o, "nbytes": 8 * int(np.prod(s)),
                "init": "zeros"} for n, s, o in state]
    arg = {e["name"]: {"region": "state", "offset": e["offset"], "nbytes": e["nbytes"], "dtype": "int64"}
           for e in entries}
    slot_arg = {name: {"region": "table", "offset": off, "nbytes": 8 * (1 + 2 * r), "dtype": "int64"}
                for name, _, off, r in slots}
    step = {"kernel": 2, "grid": [1, 1, 1], "deps": [], "label": "generate_step",
            "args": [slot_arg["logits"], slot_arg["input_pos"], arg["generate.ctrl"], arg["generate.out_tokens"],
                     arg["generate.next_token"], arg["generate.next_position"]]}
    manifest = {
        "format_version": [3, 0], "producer": {"grace": "0.1.0"}, "model": {"name": "handmade_lm"},
        "archs": list(archs), "options": {"handmade": True},
        "symbols": [{"name": "seq", "kind": "input", "min": 1, "max": LM_SEQ, "sources": [[0, 1], [1, 0]]}],
        "inputs": [{"name": "idx", "dtype": "int64", "shape": [1, "seq"], "slot": 0},
                   {"name": "input_pos", "dtype": "int64", "shape": ["seq"], "slot": 1}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [1, "seq", LM_V], "slot": 2}],
        "table": {"nbytes": table_nbytes, "extents": {"offset": ext_offset, "count": 1},
                  "slots": [{"name": n, "role": role, "offset": off, "rank": r} for n, role, off, r in slots]},
        "regions": {"weights": 0, "arena": 0, "table": table_nbytes, "state": 1280},
        "weights": [], "state": entries, "kernels": kernels,
        "graphs": [{"name": f"seq={LM_SEQ}", "bucket": {"seq": LM_SEQ}, "arena": 0, "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes}]
             + [{"word": w} for w in range(n_words)]},
            {"kernel": 1, "grid": [1, 1, 1], "deps": [0], "label": "lm",
             "args": [slot_arg["idx"], slot_arg["input_pos"], slot_arg["logits"], arg["hist"]]}]}],
        "generate": {"tokens": "idx", "positions": "input_pos", "logits": "logits", "capacity": LM_SEQ,
                     "decode_graph": 0, "ctrl": "generate.ctrl", "out_tokens": "generate.out_tokens",
                     "next_token": "generate.next_token", "next_position": "generate.next_position",
                     "step": step},
    }
    return manifest, sections


if __name__ == "__main__":  # python tests/helpers_handmade.py out.grace [dtype]
    out = build_handmade_package(sys.argv[1], dtype=sys.argv[2] if len(sys.argv) > 2 else "float32")
    print(out)
