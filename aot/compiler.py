"""The compiler driver: runs the stages in order and writes the package.

Options are a frozen dataclass: hashable, validated once, recorded in the manifest.
"""
from __future__ import annotations

import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import build, codegen, export, fuse, generation, lower, memplan, package, shapes
from .check import relocate

ARCH_RE = re.compile(r"^sm_(\d{2,3})$")
PDL_MIN_ARCH = 90
# Triton input_precision values for fp32 dots (GEMMs and attention), most accurate last. (Triton
# 3.6 also has bf16x3/bf16x6, but its interpreter rejects them, so --interpret could not run them.)
FP32_MATMUL_CHOICES = ("tf32", "tf32x3", "ieee")
GENERATE_KEYS = ("tokens", "positions", "logits", "capacity")


@dataclass(frozen=True)
class CompileOptions:
    archs: tuple[str, ...] = ("sm_90",)
    # Triton's input_precision for fp32 dots: tf32x3 (three tf32 passes) stays near fp32 accuracy
    # at a fraction of ieee's cost; plain tf32 is fastest but gives ~1e-3 relative error on deep
    # models (docs/performance.md).
    fp32_matmul: str = lower.DEFAULT_OPTIONS["fp32_matmul"]
    jobs: int | None = None            # parallel kernel builds (default: CPU count, max 8)
    progress: bool = False             # stage summaries and a progress bar on stderr
    # bucket bounds per size symbol, overriding the default powers of two
    buckets: tuple = ()
    # a causal LM for generate(): (("tokens", NAME), ("positions", NAME), ("logits", NAME)?,
    # ("capacity", N)?) — docs/design-state.md
    generate: tuple = ()
    # programmatic dependent launch (docs/design-pdl.md). Off by default: as built today it made
    # the Llama-1B decode token 10% slower on the H200 (docs/performance.md). Needs sm_90+.
    pdl: bool = False

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
        spec = dict(self.generate)
        unknown = sorted(set(spec) - set(GENERATE_KEYS))
        if unknown:
            raise ValueError(f"generate: unknown key(s) {', '.join(unknown)}; expected "
                             f"{', '.join(GENERATE_KEYS)}")
        if spec and not {"tokens", "positions"} <= set(spec):
            raise ValueError("generate needs tokens=NAME and positions=NAME (the export's input "
                             "names)")
        # griddepcontrol does not exist before sm_90 (ptxas rejects it)
        without = [a for a in self.archs if int(ARCH_RE.match(a).group(1)) < PDL_MIN_ARCH]
        if self.pdl and without:
            raise ValueError(f"pdl needs sm_90 or newer, but the archs include {', '.join(without)}; "
                             "compile those separately or pass pdl=False (--no-pdl)")

    def recorded(self) -> dict:
        d = asdict(self)
        d.pop("progress")
        d.pop("jobs")
        d.pop("buckets")
        d.pop("generate")
        d["archs"] = list(self.archs)
        return d


@dataclass
class CompileReport:
    path: Path
    kernels: int
    unique_kernels: int
    seconds: dict = field(default_factory=dict)


def compile(program, example_inputs=None, *, output, kwargs=None, archs=("sm_90",),  # noqa: A001
            name=None, progress=False, fp32_matmul=None, jobs=None, dynamic_shapes=None,
            buckets=None, generate=None, pdl=False) -> Path:
    """Compile an nn.Module (with example inputs) or an ExportedProgram into a .grace file.

    `example_inputs` (positional) and `kwargs` (keyword example inputs) go to torch.export as its
    `args` and `kwargs`; a `None` argument is no input of the package (as in torch.export). The
    package's inputs are the tensor arguments, named after the forward's parameters; its outputs
    are named by the model's output keys (a ModelOutput, dict or namedtuple: `logits`,
    `last_hidden_state`, ...), plain tensors `out` / `out0, out1, ...`.
    `dynamic_shapes` goes to torch.export (`{"input_ids": {1: Dim("seq", min=1, max=512)}}`);
    each dynamic dimension becomes a size symbol named after its Dim (or `<input>.<dim>` for a
    program exported elsewhere). `buckets` overrides the default bucket bounds per symbol:
    `{"seq": [64, 128, 512]}`. `generate={"tokens": "idx", "positions": "input_pos"}` marks a
    causal LM for `Session.generate` (optional "logits": an output name, default the first;
    "capacity": cache positions, default the size of the state dimension `positions` indexes).
    `pdl=True`: programmatic edges between kernels (docs/design-pdl.md; sm_90+ only). Off by
    default: measured slower on the H200 so far (docs/performance.md).

    A library call prints nothing: `progress=True` reports each stage and a build progress bar on
    stderr (what `grace compile` shows). Errors are exceptions (LoweringError names the op and
    the user's source line; `grace.aot.check` lists every unsupported op at once)."""
    options = CompileOptions(tuple(archs), fp32_matmul or lower.DEFAULT_OPTIONS["fp32_matmul"],
                             jobs, progress,
                             tuple((k, tuple(int(x) for x in v)) for k, v in (buckets or {}).items()),
                             tuple((generate or {}).items()), bool(pdl))
    dim_names = None
    if isinstance(program, torch.nn.Module):
        if example_inputs is None and not kwargs:
            raise ValueError("example_inputs (or kwargs) are required to export an nn.Module")
        name = name or type(program).__name__
        dim_names = _dim_names(program, example_inputs, dynamic_shapes, kwargs)
        program = export.export_model(program, example_inputs, dynamic_shapes, kwargs)
    elif not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"expected an nn.Module or torch.export.ExportedProgram, "
                        f"got {type(program).__name__}")
    return compile_program(program, Path(output), name or "model", options, dim_names).path


def _dim_names(model, example_inputs, dynamic_shapes, kwargs=None) -> dict:
    """(input name, dim) -> the user's Dim name, so symbols are called what the user called them."""
    import inspect
    if not dynamic_shapes:
        return {}
    params = list(inspect.signature(model.forward).parameters)
    if not isinstance(dynamic_shapes, dict):   # a tuple: the arguments given, in forward's order
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else \
            (() if example_inputs is None else (example_inputs,))
        try:
            params = list(inspect.signature(model.forward).bind(*args, **(kwargs or {})).arguments)
        except TypeError:
            pass   # torch.export reports the mismatch
    specs = dynamic_shapes.items() if isinstance(dynamic_shapes, dict) else \
        zip(params, dynamic_shapes)
    out = {}
    for arg, spec in specs:
        items = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for d, dim in items:
            if getattr(dim, "__name__", None):
                out[(arg, int(d))] = dim.__name__
    return out


def _say(options: CompileOptions, msg: str):
    if options.progress:
        from rich.console import Console
        Console(stderr=True).print(msg)


def _lower_bucket(core, name, options, symbols, sym_index, bounds: dict,
                  output_names=None) -> package.GraphBuild:
    """One graph: the program lowered with every input symbol at its bucket bound."""
    bucket = {s.expr: bounds[s.name] for s in symbols if s.kind == "input"}
    try:
        lowered = lower.lower(core, name, options.recorded(), bucket)
    except (lower.LoweringError, shapes.ShapeError) as exc:
        relocate(exc, core)   # "used at" the user's line, not torch/nn/modules/*.py
        raise
    if output_names is not None:   # the model's own names (logits, last_hidden_state, ...)
        package.name_outputs(lowered, output_names)
    if options.generate:
        generation.add_state(lowered, dict(options.generate))
    kernels = memplan.drop_empty(fuse.fuse_epilogues(lowered.kernels))
    plan = memplan.plan_memory(kernels, lowered.weights, lowered.state)
    memplan.check_plan(plan)
    sources = []
    for k in kernels:
        try:
            sources.append(codegen.generate(k, sym_index, pdl=options.pdl))
        except ValueError as exc:   # a size expression a kernel cannot evaluate
            raise lower.LoweringError(f"{exc} — in the kernel for node '{k.label}'") from exc
    readers = [any(b.kind == "extents" for b in src.buffers) for src in sources]
    deps = memplan.dependencies(kernels, plan, readers)
    graph_name = ",".join(f"{k}={v}" for k, v in bounds.items()) or "main"
    all_bounds = {s.name: int(lowered.bounds.get(s.expr, s.hi or 0)) for s in symbols}
    return package.GraphBuild(graph_name, all_bounds, lowered, kernels, plan, deps, sources)


def compile_program(program, output: Path, name: str, options: CompileOptions,
                    dim_names: dict | None = None) -> CompileReport:
    from grace.formats import write_package

    seconds = {}
    t = time.perf_counter()
    core = decompose(program)
    seconds["decompose"] = time.perf_counter() - t

    t = time.perf_counter()
    try:
        symbols = shapes.find_symbols(core, dim_names)
        lists = shapes.bucket_lists(symbols, dict(options.buckets))
        symbols += shapes.find_data_symbols(core, symbols)
    except shapes.ShapeError as exc:
        raise lower.LoweringError(str(exc)) from exc
    if options.generate:   # decode (one token) is a bucket of its own
        generation.add_decode_bucket(core, symbols, lists, dict(options.generate))
    sym_index = {s.expr: i for i, s in enumerate(symbols)}
    out_names = program_output_names(core)
    graphs = []
    for bounds in shapes.combinations(symbols, lists):
        graphs.append(_lower_bucket(core, name, options, symbols, sym_index, bounds, out_names))
    _check_same_interface(graphs)
    checks = package.index_checks(graphs, symbols)   # gathers' bounds checks (format 3.3)
    layouts = [package.table_layout(g.program, len(symbols), bool(checks))
               for g in graphs]  # sets buf.slot
    if any(layout != layouts[0] for layout in layouts[1:]):
        raise lower.LoweringError("internal: buckets lowered to different argument tables")
    slots, extents, table_nbytes, errors = layouts[0]
    writer = codegen.table_writer_source(slots, extents)
    step = None
    if options.generate:
        step = generation.plan(graphs, symbols, dict(options.generate))
    recorded = options.recorded()
    if lists:
        recorded["buckets"] = lists
        recorded["bucket_cost"] = _cost_note(symbols, lists)
    seconds["lower"] = time.perf_counter() - t
    unique = {s.name: s for s in [writer] + [src for g in graphs for src in g.sources]
              + ([step.source] if step else [])}
    _say(options, f"[bold]grace[/]: {name}: {len(graphs)} graph(s), "
                  f"{sum(len(g.kernels) for g in graphs)} kernels ({len(unique) - 1} unique), "
                  f"arena ≤ {max(g.plan.arena_nbytes for g in graphs)} B, "
                  f"weights {graphs[0].plan.weights_nbytes} B")

    t = time.perf_counter()
    requests = [build.BuildRequest(s.name, s.source, tuple(s.param_types), s.num_warps,
                                   s.num_stages, arch)
                for s in unique.values() for arch in options.archs]
    binaries_list = _build_with_progress(requests, options)
    binaries = {(r.name, r.arch): b for r, b in zip(requests, binaries_list)}
    seconds["build"] = time.perf_counter() - t

    t = time.perf_counter()
    manifest, sections = package.build_manifest(graphs, symbols, writer, binaries,
                                                list(options.archs), recorded, slots, extents,
                                                table_nbytes, step, errors, checks)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_package(output, manifest, sections)
    seconds["package"] = time.perf_counter() - t
    _say(options, f"[bold]grace[/]: wrote {output} "
                  f"({output.stat().st_size / 1e6:.1f} MB) in {sum(seconds.values()):.1f} s")
    return CompileReport(output, sum(len(g.kernels) for g in graphs), len(unique) - 1, seconds)


def decompose(program):
    """export.to_core_aten, without the FutureWarnings torch's own code raises inside it (its
    deprecated pytree classes): torch-internal noise, nothing the user could act on. Inputs that
    torch.export recorded as constants (a `None` argument) are dropped: no input of the package."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return export.drop_constant_inputs(export.to_core_aten(program))


def program_output_names(core) -> list[str]:
    """The package's output names: the model's output keys (export.output_names), unique and
    distinct from the input names."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = core.graph_signature
    count = sum(1 for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT)
    inputs = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch's deprecated pytree accessors
        return export.output_names(core, count, inputs)


def _check_same_interface(graphs) -> None:
    """Every bucket must lower to the same inputs, outputs and weights (only sizes differ)."""
    def key(p):
        return ([(b.name, b.dtype, len(b.shape)) for b in p.inputs + p.outputs],
                [(b.name, b.dtype, b.shape) for b in p.weights + p.state])
    first = key(graphs[0].program)
    for g in graphs[1:]:
        if key(g.program) != first:
            raise lower.LoweringError(f"bucket {g.name} lowers to a different interface")


def _cost_note(symbols, lists) -> str:
    parts = [f"{s.name}: {shapes.padding_cost(s, lists[s.name]):.0%} padded work"
             for s in symbols if s.kind == "input"]
    return ("expected padding over sizes uniform in each exported range (work ∝ size): "
            + "; ".join(parts))


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
