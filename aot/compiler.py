"""The compiler driver: runs the stages in order and writes the package.

Options are a frozen dataclass: hashable, validated once, recorded in the manifest.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import build, codegen, export, fuse, lower, memplan, package

ARCH_RE = re.compile(r"^sm_(\d{2,3})$")
# Triton input_precision values for fp32 dots (GEMMs and attention), most accurate last. (Triton
# 3.6 also has bf16x3/bf16x6, but its interpreter rejects them, so --interpret could not run them.)
FP32_MATMUL_CHOICES = ("tf32", "tf32x3", "ieee")


@dataclass(frozen=True)
class CompileOptions:
    archs: tuple[str, ...] = ("sm_90",)
    # Triton's input_precision for fp32 dots: tf32x3 (three tf32 passes) stays near fp32 accuracy
    # at a fraction of ieee's cost; plain tf32 is fastest but gives ~1e-3 relative error on deep
    # models (docs/performance.md).
    fp32_matmul: str = lower.DEFAULT_OPTIONS["fp32_matmul"]
    jobs: int | None = None            # parallel kernel builds (default: CPU count, max 8)
    progress: bool = False

    def __post_init__(self):
        if not self.archs:
            raise ValueError("at least one --arch is required")
        for arch in self.archs:
            m = ARCH_RE.match(arch)
            if not m or int(m.group(1)) < 80:
                raise ValueError(f"unsupported arch {arch!r}: expected sm_80, sm_90, sm_100, ...")
        if self.fp32_matmul not in FP32_MATMUL_CHOICES:
            raise ValueError(f"fp32_matmul must be one of {', '.join(FP32_MATMUL_CHOICES)}, "
                             f"not {self.fp32_matmul!r}")

    def recorded(self) -> dict:
        d = asdict(self)
        d.pop("progress")
        d.pop("jobs")
        d["archs"] = list(self.archs)
        return d


@dataclass
class CompileReport:
    path: Path
    kernels: int
    unique_kernels: int
    seconds: dict = field(default_factory=dict)


def compile(program, example_inputs=None, *, output, archs=("sm_90",), name=None,  # noqa: A001
            progress=True, fp32_matmul=None, jobs=None, dynamic_shapes=None) -> Path:
    """Compile an nn.Module (with example inputs) or an ExportedProgram into a .grace file."""
    options = CompileOptions(tuple(archs), fp32_matmul or lower.DEFAULT_OPTIONS["fp32_matmul"],
                             jobs, progress)
    if isinstance(program, torch.nn.Module):
        if example_inputs is None:
            raise ValueError("example_inputs are required to export an nn.Module")
        name = name or type(program).__name__
        program = export.export_model(program, example_inputs, dynamic_shapes)
    elif not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"expected an nn.Module or torch.export.ExportedProgram, "
                        f"got {type(program).__name__}")
    return compile_program(program, Path(output), name or "model", options).path


def _say(options: CompileOptions, msg: str):
    if options.progress:
        from rich.console import Console
        Console(stderr=True).print(msg)


def compile_program(program, output: Path, name: str, options: CompileOptions) -> CompileReport:
    from grace.formats import write_package

    seconds = {}
    t = time.perf_counter()
    core = export.to_core_aten(program)
    seconds["decompose"] = time.perf_counter() - t

    t = time.perf_counter()
    lowered = lower.lower(core, name, options.recorded())
    kernels = fuse.fuse_epilogues(lowered.kernels)
    slots, table_nbytes = package.table_layout(lowered)
    plan = memplan.plan_memory(kernels, lowered.weights)
    memplan.check_plan(plan)
    deps = memplan.dependencies(kernels, plan)
    sources = [codegen.generate(k) for k in kernels]
    writer = codegen.table_writer_source(slots)
    seconds["lower"] = time.perf_counter() - t
    _say(options, f"[bold]grace[/]: {name}: {len(kernels)} kernels "
                  f"({len({s.name for s in sources})} unique), arena {plan.arena_nbytes} B, "
                  f"weights {plan.weights_nbytes} B")

    t = time.perf_counter()
    unique = {s.name: s for s in [writer] + sources}
    requests = [build.BuildRequest(s.name, s.source, tuple(s.param_types), s.num_warps,
                                   s.num_stages, arch)
                for s in unique.values() for arch in options.archs]
    binaries_list = _build_with_progress(requests, options)
    binaries = {(r.name, r.arch): b for r, b in zip(requests, binaries_list)}
    seconds["build"] = time.perf_counter() - t

    t = time.perf_counter()
    manifest, sections = package.build_manifest(lowered, kernels, plan, deps, sources, writer,
                                                binaries, list(options.archs),
                                                options.recorded(), slots, table_nbytes)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_package(output, manifest, sections)
    seconds["package"] = time.perf_counter() - t
    _say(options, f"[bold]grace[/]: wrote {output} "
                  f"({output.stat().st_size / 1e6:.1f} MB) in {sum(seconds.values()):.1f} s")
    return CompileReport(output, len(kernels), len(unique) - 1, seconds)


def _build_with_progress(requests, options: CompileOptions):
    if not options.progress:
        return build.compile_all(requests, options.jobs)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("compiling kernels", total=len(requests))

        def tick(done, total):
            bar.update(task, completed=done, total=total)

        result = build.compile_all(requests, options.jobs, tick)
        bar.update(task, completed=len(requests))
    return result
