"""Registers, stack and shared memory of a package's kernels, read from its cubins (no GPU), and
how many programs of each graph node fit one multiprocessor, alone and beside the node before it.

    python -m grace.tools.kernel_resources MODEL.grace [--graph seq=1] [--arch sm_90] [--json F]

Why: under programmatic dependent launch a kernel's programs start while the kernel before still
runs, and load their weights (or a decode attention its KV blocks) before gdc_wait() — but only
the programs that fit a multiprocessor beside the ones already there. Registers decide that as
much as the grid: Llama-8B's decode attention with its KV blocks before the wait took 255
registers and a 144-byte stack at 128 keys x 128 columns, and ran slower than without early
loads; at 64 keys, 178 registers, it ran faster (docs/performance.md, twentieth session). The
runtime's one-wave cap (runtime/occupancy.py) adds dynamic shared memory to every node behind a
programmatic edge; the "beside" column counts with it, as the runtime launches them on this arch.

Columns per node: grid, warps, registers a thread, stack bytes a thread (ptxas' frame: spilled
registers live there), programs per multiprocessor by registers, threads, shared memory and the
block limit ("alone"), and with the programs of its last programmatic dependency (the node it
overlaps) resident at that node's density, ceil(grid / SMs) ("beside"; "-" without one), and
the waves its grid takes at the "alone" density (grid / (alone x SMs)): a GEMV of few waves
ramps up and drains a larger share of its time than one of many (Llama-1B, bf16: the LM head
27 waves, the gate+up 3.5, the down 1.7; docs/design-pdl.md, thirty-eighth session). Where
not even one fits beside, the last column names what it is short of (regs, threads, shared,
blocks) and the most a thread's registers and a program's shared memory could be for one program
to fit: Llama-1B's decode attention, 197 registers, is short of registers (176) and of shared
memory (32000 B; the cap pads it to 115840, and even uncapped it uses 34816) beside six QKV
programs. The "mma" column names the matrix instructions in the kernel's SASS: "wgmma"
(Hopper's warpgroup MMA, HGMMA), "mma" (the warp-level mma.sync, HMMA) or "-": on sm_90 Triton
takes the warpgroup form only for tiles of at least 64 rows, so a GEMM tile of 16 or 32 rows (a
batch-1 encoder's second projection) runs on the older instruction. cuobjdump comes with
Triton's NVIDIA backend (or from PATH).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Per multiprocessor: registers, threads, resident blocks, shared memory (bytes) and the shared
# memory the driver reserves per block. CUDA C Programming Guide, "Technical Specifications per
# Compute Capability"; the shared sizes are cudaDevAttrMaxSharedMemoryPerMultiprocessor.
SM_LIMITS = {
    "sm_80": dict(regs=65536, threads=2048, blocks=32, shared=167936, reserved=1024),
    "sm_86": dict(regs=65536, threads=1536, blocks=16, shared=102400, reserved=1024),
    "sm_89": dict(regs=65536, threads=1536, blocks=24, shared=102400, reserved=1024),
    "sm_90": dict(regs=65536, threads=2048, blocks=32, shared=233472, reserved=1024),
    "sm_100": dict(regs=65536, threads=2048, blocks=32, shared=233472, reserved=1024),
    "sm_120": dict(regs=65536, threads=1536, blocks=32, shared=102400, reserved=1024),
}
REG_UNIT = 256   # registers are granted to a warp in multiples of this
_USAGE = re.compile(r"Function ([^\s:]+):\s*\n\s*(REG:[^\n]*)")
_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)


class ResourceError(RuntimeError):
    pass


def find_cuobjdump() -> str:
    """Triton's bundled cuobjdump, else one on PATH (ResourceError when neither exists)."""
    try:
        import triton.backends.nvidia as nv
        bundled = Path(nv.__file__).parent / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        raise ResourceError("cuobjdump not found: install triton (it ships one with its NVIDIA "
                            "backend) or put the CUDA toolkit's bin/ on PATH")
    return found


def _cuobjdump(cubin: bytes, tool: str, *args: str, timeout: int = 300) -> str:
    """cuobjdump's stdout for `cubin` with `args` (ResourceError when it fails)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool, *args, f.name], capture_output=True, text=True,
                              timeout=timeout)
    if done.returncode:
        raise ResourceError(f"cuobjdump failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def cubin_usage(cubin: bytes, tool: str) -> dict:
    """{function name: {"REG": n, "STACK": bytes, "SHARED": bytes, "LOCAL": bytes, ...}}."""
    out = _cuobjdump(cubin, tool, "--dump-resource-usage")
    return {name: {k: int(v) for k, v in re.findall(r"([A-Z_]+(?:\[\d+\])?):(\d+)", fields)}
            for name, fields in _USAGE.findall(out)}


def cubin_mma(cubin: bytes, tool: str) -> dict:
    """{function name: "wgmma" | "mma" | "-"}: the matrix instructions in its SASS (HGMMA, the
    warpgroup MMA of sm_90, counts first: a kernel holding both is a warpgroup kernel)."""
    parts = _SASS_FUNCTION.split(_cuobjdump(cubin, tool, "-sass"))   # [before, name, body, ...]
    return {name: mma_kind(body) for name, body in zip(parts[1::2], parts[2::2])}


def mma_kind(sass: str) -> str:
    """"wgmma", "mma" or "-" for one function's SASS text."""
    if re.search(r"\bHGMMA\.", sass):
        return "wgmma"
    return "mma" if re.search(r"\bHMMA\.", sass) else "-"


def block_registers(regs: int, warps: int) -> int:
    """Registers one program holds: a thread's count, granted per warp in REG_UNIT steps."""
    return math.ceil(max(regs, 1) * 32 / REG_UNIT) * REG_UNIT * warps


def programs_by_resource(regs: int, warps: int, shared: int, limits: dict, taken=None) -> dict:
    """Programs of a kernel that each resource (registers, threads, shared memory, the block
    limit) leaves room for on one multiprocessor; `taken` = (registers, threads, shared, blocks)
    already held there by other programs."""
    used_regs, used_threads, used_shared, used_blocks = taken or (0, 0, 0, 0)
    return {"regs": (limits["regs"] - used_regs) // block_registers(regs, warps),
            "threads": (limits["threads"] - used_threads) // (32 * warps),
            "shared": (limits["shared"] - used_shared) // (shared + limits["reserved"]),
            "blocks": limits["blocks"] - used_blocks}


def programs_per_sm(regs: int, warps: int, shared: int, limits: dict, taken=None) -> int:
    """Programs of a kernel that fit one multiprocessor (the scarcest resource decides)."""
    return max(0, min(programs_by_resource(regs, warps, shared, limits, taken).values()))


def binding_limits(regs: int, warps: int, shared: int, limits: dict, taken) -> list[str]:
    """Which resources leave no room for one more program beside `taken` (empty when one fits)."""
    room = programs_by_resource(regs, warps, shared, limits, taken)
    return [name for name, n in room.items() if n < 1]


def fitting_registers(warps: int, limits: dict, taken) -> int:
    """The most registers a thread (at most 255) at which one program of `warps` warps fits the
    registers left beside `taken`; 0 when none does."""
    free_units = (limits["regs"] - taken[0]) // (REG_UNIT * warps)
    return min(255, free_units * REG_UNIT // 32)


def fitting_shared(limits: dict, taken) -> int:
    """The most shared memory (bytes, in the runtime's allocation unit) one program may use and
    still fit the shared memory left beside `taken`; 0 when none is left."""
    from grace.runtime.occupancy import ALLOCATION_UNIT

    free = limits["shared"] - taken[2] - limits["reserved"]
    return max(0, free // ALLOCATION_UNIT * ALLOCATION_UNIT)


def node_rows(package, arch: str, graph_names=None, sm_count=None, tool=None,
              uncapped=()) -> list[dict]:
    """One row per node of the chosen graphs of `package` (a formats Package) for `arch`;
    `uncapped`: kernel families launched without the one-wave cap (a what-if for a launch rule,
    tools/wave_cap_ab.py times it)."""
    from grace.formats import archs as arch_rules
    from grace.formats.view import for_arch
    from grace.runtime import occupancy

    if arch not in SM_LIMITS:
        raise ResourceError(f"no multiprocessor limits recorded for {arch} "
                            f"(known: {', '.join(SM_LIMITS)})")
    limits = SM_LIMITS[arch]
    sms = sm_count or arch_rules.sm_count(arch)
    view = for_arch(package.view, arch)
    tool = tool or find_cuobjdump()
    usage, mma = {}, {}
    for k, kernel in enumerate(view.kernels):
        section = kernel.binaries.get(arch)
        if section is not None:
            cubin = bytes(package.section(section))
            usage[k] = cubin_usage(cubin, tool).get(kernel.name, {})
            mma[k] = cubin_mma(cubin, tool).get(kernel.name, "-")
    shared_limits = occupancy.SharedLimits(sms, limits["shared"], limits["reserved"],
                                           limits["shared"] - limits["reserved"])
    pdl = arch_rules.supports_pdl(arch)
    rows = []
    for graph in view.graphs:
        if graph_names and graph.name not in graph_names:
            continue
        launched = []   # per node: (regs, warps, shared as launched, grid size)
        for j, node in enumerate(graph.nodes):
            kernel = view.kernels[node.kernel]
            use = usage.get(node.kernel, {})
            regs, blocks = use.get("REG", 0), math.prod(node.grid)
            shared = kernel.shared
            if pdl and node.programmatic and kernel.family not in uncapped:   # the one-wave cap
                shared = occupancy.one_wave_shared(blocks, shared, shared_limits)
            launched.append((regs, kernel.num_warps, shared, blocks))
            alone = programs_per_sm(regs, kernel.num_warps, shared, limits)
            beside, short, fit, fit_shared = None, [], None, None
            if node.programmatic:
                pr, pw, ps, pb = launched[max(node.programmatic)]
                n = min(math.ceil(pb / sms), programs_per_sm(pr, pw, ps, limits))
                taken = (n * block_registers(pr, pw), n * 32 * pw, n * (ps + limits["reserved"]), n)
                beside = programs_per_sm(regs, kernel.num_warps, shared, limits, taken)
                short = binding_limits(regs, kernel.num_warps, shared, limits, taken)
                fit = fitting_registers(kernel.num_warps, limits, taken)
                fit_shared = fitting_shared(limits, taken)
            rows.append({"graph": graph.name, "node": j, "label": node.label or "",
                         "kernel": kernel.name, "family": kernel.family, "grid": list(node.grid),
                         "warps": kernel.num_warps, "regs": regs, "stack": use.get("STACK", 0),
                         "local": use.get("LOCAL", 0), "shared": shared, "alone": alone,
                         "waves": blocks / (alone * sms) if alone else None,
                         "beside": beside, "short_of": short, "fit_regs": fit,
                         "fit_shared": fit_shared, "mma": mma.get(node.kernel, "-"),
                         "after": max(node.programmatic) if node.programmatic else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines, graph = [], None
    for r in rows:
        if r["graph"] != graph:
            graph = r["graph"]
            lines.append(f"graph {graph}")
            lines.append(f"  {'node':>4}  {'label':30} {'kernel':26} {'grid':>15} {'warps':>5} "
                         f"{'regs':>4} {'stack':>5} {'shared':>7} {'alone':>5} {'waves':>6} "
                         f"{'beside':>6} {'mma':>5}"
                         f"  {'short of (fits at regs / shared bytes)'}")
        grid = "x".join(str(g) for g in r["grid"])
        beside = "-" if r["beside"] is None else f"{r['beside']}"
        waves = "-" if r["waves"] is None else f"{r['waves']:.2f}"
        short = ""
        if r["short_of"]:   # what keeps even one program from starting beside the node before
            fits = ([f"{r['fit_regs']}"] if "regs" in r["short_of"] else []) + (
                [f"{r['fit_shared']} B"] if "shared" in r["short_of"] else [])
            short = "  " + ",".join(r["short_of"]) + (f" ({' / '.join(fits)})" if fits else "")
        flag = "  <- stack" if r["stack"] else ""
        lines.append(f"  {r['node']:>4}  {r['label'][:30]:30} {r['kernel'][:26]:26} {grid:>15} "
                     f"{r['warps']:>5} {r['regs']:>4} {r['stack']:>5} {r['shared']:>7} "
                     f"{r['alone']:>5} {waves:>6} {beside:>6} {r['mma']:>5}{short}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package", type=Path, help="a .grace file")
    ap.add_argument("--graph", action="append", metavar="NAME",
                    help="only this graph (repeatable; default: every graph), e.g. seq=1")
    ap.add_argument("--arch", help="which binaries (default: the package's first arch)")
    ap.add_argument("--sm-count", type=int, help="multiprocessors (default: the arch's part)")
    ap.add_argument("--uncapped", action="append", default=[], metavar="FAMILY",
                    help="count nodes of this kernel family without the one-wave cap (repeatable; "
                         "e.g. attention): what a launch rule that spares them would allow")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    from grace.formats import read_package
    try:
        package = read_package(a.package, verify=False)
        arch = a.arch or package.view.archs[0]
        rows = node_rows(package, arch, set(a.graph or ()), a.sm_count,
                         uncapped=tuple(a.uncapped))
    except (ResourceError, ValueError, OSError) as e:
        print(f"kernel_resources: {e}", file=sys.stderr)
        return 1
    if a.graph and not rows:
        print(f"kernel_resources: no graph named {', '.join(a.graph)} "
              f"(the package's: {', '.join(g.name for g in package.view.graphs)})", file=sys.stderr)
        return 1
    print(format_rows(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
