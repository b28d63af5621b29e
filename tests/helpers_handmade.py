"""A tiny `.grace` package built by hand (no grace.aot), for tools/ and runtime tests.

    out = x * 2 + w + b          x: [4, 8] input, w: [4, 8] weight, b: [8] weight

as three kernels, exactly as docs/architecture.md lays them out:

    node 0  table_writer(table, w0..w9)      writes the argument table (2 slots of rank 2)
    node 1  k_scale(x_slot, t)               t = x * 2        t lives in the arena
    node 2  k_add(t, w, b, out_slot)         out = t + w + b  out reached through its table slot

The cubins are compiled for sm_90 with Triton on the CPU (no GPU needed), so the same package runs
on the GPU runtime and on the CPU reference executor.

`bug="partial_t"` builds a broken variant whose k_scale writes only the first 3 rows of t: the last
row of `out` then reads arena memory nobody wrote (NaN when the arena is poisoned).
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
    kernels, sections = [], {}
    for kname, family, src, sig, nw in specs:
        compiled = {a: _compile(src, kname, sig, nw, a) for a in archs}
        kernels.append(_kernel_entry(kname, family, src, sig, compiled[archs[0]], archs))
        sections[f"src/{kname}.py"] = src.encode()
        for a in archs:
            sections[f"cubin/{kname}.{a}"] = bytes(compiled[a].asm["cubin"])

    # --- weights -----------------------------------------------------------------------------------
    def raw(a):
        return _bf16_bytes(a) if dtype == "bfloat16" else a.tobytes()

    sections["weights"] = encode_weights(
        {n: (dtype, tuple(a.shape), raw(a)) for n, a in weights.items()}
    )

    slot = lambda off, nb=8: {"region": "table", "offset": off, "nbytes": nb, "dtype": "int64"}  # noqa: E731
    t_arg = {"region": "arena", "offset": 0, "nbytes": nbytes_xo, "dtype": dtype}
    manifest = {
        "format_version": [1, 0],
        "producer": {"grace": "0.1.0", "torch": torch.__version__.split("+")[0], "triton": triton.__version__},
        "model": {"name": name},
        "archs": list(archs),
        "options": {"handmade": True},
        "inputs": [{"name": "x", "dtype": dtype, "shape": [ROWS, COLS], "slot": 0}],
        "outputs": [{"name": "out", "dtype": dtype, "shape": [ROWS, COLS], "slot": 1}],
        "table": {
            "nbytes": table_nbytes,
            "slots": [
                {"name": "x", "role": "input", "offset": slot_offsets[0], "rank": ranks[0]},
                {"name": "out", "role": "output", "offset": slot_offsets[1], "rank": ranks[1]},
            ],
        },
        "regions": {"weights": weights_nbytes, "arena": 256, "table": table_nbytes},
        "weights": [
            {"name": "w", "dtype": dtype, "shape": [ROWS, COLS], "offset": w_off, "nbytes": nbytes_xo},
            {"name": "b", "dtype": dtype, "shape": [COLS], "offset": b_off, "nbytes": nbytes_b},
        ],
        "arena_buffers": [{"name": "t", "offset": 0, "nbytes": nbytes_xo, "first": 1, "last": 2}],
        "kernels": kernels,
        "graphs": [
            {
                "name": "main",
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


if __name__ == "__main__":  # python tests/helpers_handmade.py out.grace [dtype]
    out = build_handmade_package(sys.argv[1], dtype=sys.argv[2] if len(sys.argv) > 2 else "float32")
    print(out)
