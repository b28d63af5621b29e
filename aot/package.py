"""Stage 7: everything the runtime needs, as one manifest plus sections (formats/ writes the file).

The graph's node 0 is the table writer; kernel node j+1 is kernel j of the schedule. A kernel
argument is a byte range of a region (weights, arena, or the table slot of an I/O tensor) so the
loader can check every range before anything is launched.
"""
from __future__ import annotations

import hashlib

import torch

from .codegen import KernelSource
from .ir import Buffer, Program
from .memplan import MemoryPlan


def table_layout(program: Program) -> tuple[list[dict], int]:
    """Assign a table slot to each input then each output: u64 pointer, sizes, strides."""
    slots, offset = [], 0
    for role, bufs in (("input", program.inputs), ("output", program.outputs)):
        for buf in bufs:
            buf.slot = len(slots)
            rank = len(buf.shape)
            slots.append({"name": buf.name, "role": role, "offset": offset, "rank": rank})
            offset += (1 + 2 * rank) * 8
            offset = (offset + 15) // 16 * 16
    return slots, max(offset, 16)


def _arg(buf: Buffer, plan: MemoryPlan, slots: list[dict]) -> dict:
    if buf.kind == "arena":
        p = plan.arena[id(buf)]
        return {"region": "arena", "offset": p.offset, "nbytes": buf.nbytes, "dtype": buf.dtype}
    if buf.kind == "weight":
        return {"region": "weights", "offset": plan.weights[id(buf)], "nbytes": buf.nbytes,
                "dtype": buf.dtype}
    return {"region": "table", "offset": slots[buf.slot]["offset"], "nbytes": 8, "dtype": "int64"}


def weight_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def build_manifest(program: Program, kernels, plan: MemoryPlan, deps, sources: list[KernelSource],
                   writer: KernelSource, binaries: dict, archs: list[str], options: dict,
                   slots: list[dict], table_nbytes: int) -> tuple[dict, dict[str, bytes]]:
    import triton

    from grace.formats import encode_weights

    sections: dict[str, bytes] = {}
    unique: dict[str, int] = {}
    kernel_entries = []
    for src in [writer] + sources:
        if src.name in unique:
            continue
        unique[src.name] = len(kernel_entries)
        sha = hashlib.sha256(src.source.encode()).hexdigest()
        sections[f"src/{src.name}.py"] = src.source.encode()
        entry_bins, shared, gscratch, pscratch = {}, 0, 0, 0
        for arch in archs:
            binary = binaries[(src.name, arch)]
            section = f"cubin/{src.name}.{arch}"
            sections[section] = binary.cubin
            entry_bins[arch] = section
            shared = max(shared, binary.shared)
            gscratch = max(gscratch, binary.global_scratch_size)
            pscratch = max(pscratch, binary.profile_scratch_size)
        params = [{"name": f"p{i}", "type": t} for i, t in enumerate(src.param_types)]
        kernel_entries.append({
            "name": src.name, "family": src.family, "params": params,
            "num_warps": src.num_warps, "num_stages": src.num_stages, "shared": shared,
            "hidden_params": 2, "global_scratch_size": gscratch,
            "profile_scratch_size": pscratch, "source_sha256": sha,
            "binaries": entry_bins, "source": f"src/{src.name}.py"})

    words = sum(1 + 2 * s["rank"] for s in slots)
    nodes = [{"kernel": unique[writer.name], "grid": [1, 1, 1],
              "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes, "dtype": "int64"}]
              + [{"word": i} for i in range(words)],
              "deps": [], "label": "table_writer"}]
    for j, (kernel, src) in enumerate(zip(kernels, sources)):
        touches_io = any(b.kind in ("input", "output") for b in src.buffers)
        node_deps = [i + 1 for i in deps[j]]
        if touches_io:
            node_deps = [0] + node_deps
        nodes.append({"kernel": unique[src.name], "grid": list(src.grid),
                      "args": [_arg(b, plan, slots) for b in src.buffers],
                      "deps": node_deps, "label": kernel.label})

    families: dict[str, int] = {}
    for src in sources:
        families[src.family] = families.get(src.family, 0) + 1
    manifest = {
        "producer": {"grace": _grace_version(), "torch": torch.__version__.split("+")[0],
                     "triton": triton.__version__},
        "model": {"name": program.name},
        "archs": list(archs),
        "options": dict(options),
        "inputs": [{"name": b.name, "dtype": b.dtype, "shape": list(b.shape), "slot": b.slot}
                   for b in program.inputs],
        "outputs": [{"name": b.name, "dtype": b.dtype, "shape": list(b.shape), "slot": b.slot}
                    for b in program.outputs],
        "table": {"nbytes": table_nbytes, "slots": slots},
        "regions": {"weights": max(plan.weights_nbytes, 256), "arena": max(plan.arena_nbytes, 256),
                    "table": table_nbytes},
        "weights": [{"name": b.name, "dtype": b.dtype, "shape": list(b.shape),
                     "offset": plan.weights[id(b)], "nbytes": b.nbytes}
                    for b in program.weights],
        "arena_buffers": [{"name": p.buffer.name, "offset": p.offset, "nbytes": p.nbytes,
                           "first": p.first + 1, "last": p.last + 1}
                          for p in sorted(plan.arena.values(), key=lambda p: p.first)],
        "kernels": kernel_entries,
        "graphs": [{"name": "main", "nodes": nodes,
                    "stats": {"kernels": len(kernels), "unique_kernels": len(kernel_entries) - 1,
                              "families": families,
                              "weights_nbytes": plan.weights_nbytes,
                              "arena_nbytes": plan.arena_nbytes}}],
    }
    sections["weights"] = encode_weights({
        b.name: (b.dtype, tuple(b.shape), weight_bytes(program.weight_data[b.name]))
        for b in program.weights})
    return manifest, sections


def _grace_version() -> str:
    try:
        from importlib.metadata import version
        return version("grace")
    except Exception:
        return "0.0.0"
