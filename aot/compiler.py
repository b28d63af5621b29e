"""The compiler driver: PIPELINE, the named list of stages, run in order into a package.

    export → symbols → per target, per bucket: lower → fuse → memplan → codegen → table →
    override → build → package

Each stage is a function from one state to the next: the program-level ones take and return the
CompileState, the per-bucket ones a BucketState (one per shape bucket and compile target, run one
after the other). A *target* (format 3.5, per-arch variants) is the archs compiled alike: the same
PDL setting (sm_90+ only) and the same SM count (formats.archs.SM_COUNTS, or --sm-count). Export,
decompositions and symbols are shared; each target lowers, fuses, plans and generates its own
graphs, so two targets take about twice as long as one. Kernels of identical source are built once
per arch and stored once; so are graphs identical across targets (aot/manifest.py).
Between stages, GRACE_DUMP=DIR writes each state (aot/dump.py), GRACE_VERIFY=1 checks the IR
after lower, fuse, memplan and codegen (aot/verify_ir.py), and the override stage applies
GRACE_OVERRIDE=DIR (kernel sources by name). docs/architecture.md, "Seeing between the stages".

Options are a frozen dataclass: hashable, validated once, recorded in the manifest.
"""
from __future__ import annotations

import re
import time
import warnings
from dataclasses import asdict, dataclass, field, replace as dc_replace
from pathlib import Path
from typing import Callable

import torch

from grace.formats import archs as arch_rules

from . import (build, codegen, dump, export, extents, fuse, fuse_append, fuse_combine, fuse_norm,
               fuse_rows, fuse_splitk, fuse_stats, fuse_sums, gemm_tiles, generation, lower,
               manifest, memplan, verify_ir, versions)
from .check import relocate

ARCH_RE = re.compile(r"^sm_(\d{2,3})$")   # the compile targets (formats.archs.COMPILE_ARCH_RE)
PDL_MIN_ARCH = 90                         # formats.archs.PDL_MIN_CAPABILITY, as sm_XY digits
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
    # programmatic dependent launch (docs/design-pdl.md) for the sm_90+ archs; the others get
    # graphs without it (format 3.5 variants). None (the default): on wherever the arch has it;
    # True: on, and an error when no arch has it; False: off. On the H200 it made every model
    # measured 3-18% faster (docs/performance.md, seventh session).
    pdl: bool | None = None
    # multiprocessor counts per arch for another part than formats.archs.SM_COUNTS's:
    # (("sm_90", 114),) for an H100 PCIe. The tile plans (split-K, attention splits) fill this many.
    sm_count: tuple = ()
    # GEMMs of >= 128 rows near a shape of the arch's measured table take its tile (aot/gemm_tiles.py).
    # On the H200 ViT-S ran 0.437 ms with it against 0.550 (docs/performance.md, ninth session);
    # shapes far from the table keep the heuristic. False: the heuristic everywhere (A/B runs).
    gemm_tiles: bool = True
    # one-row reductions (an RMSNorm's mean of squares) computed inside the GEMV that reads them
    # (aot/fuse_stats.py). Off by default: in the Llama-1B decode graph on the H200 its first
    # form (a pass over the row before the K loop) saved 33 kernels and cost 3.7-5% per token;
    # the form that accumulates inside the K loop, which RMSNorms take, measured 0.976 ms per
    # token against 0.980 without (docs/performance.md, eighth and ninth sessions): no gain.
    fold_row_stats: bool = False

    def __post_init__(self):
        if not self.archs:
            raise ValueError("at least one --arch is required")
        for arch in self.archs:
            arch_rules.check_compile_arch(arch)
        if len(set(self.archs)) != len(self.archs):
            raise ValueError(f"archs: {', '.join(self.archs)} lists an arch twice")
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
        # griddepcontrol does not exist before sm_90 (ptxas rejects it): pdl applies to the sm_90+
        # archs, and needs one
        if self.pdl is True and not any(arch_rules.supports_pdl(a) for a in self.archs):
            raise ValueError(f"pdl needs sm_90 or newer, but the archs are {', '.join(self.archs)}; "
                             "add one (--arch sm_90) or leave pdl off")
        counts = dict(self.sm_count)
        if len(counts) != len(self.sm_count):
            raise ValueError("sm_count: an arch is given twice")
        for arch, n in counts.items():
            if arch not in self.archs:
                raise ValueError(f"sm_count: {arch} is not one of the archs compiled for "
                                 f"({', '.join(self.archs)})")
            arch_rules.check_sm_count(n, f"sm_count for {arch}")
        for arch in self.archs:
            arch_rules.sm_count(arch, counts)   # ValueError: no count known for this arch

    def targets(self) -> list["Target"]:
        """The compile targets: archs with the same pdl and SM count share one (and one set of
        graphs), in the order of their first arch."""
        counts = dict(self.sm_count)
        groups: dict[tuple, list] = {}
        for arch in self.archs:
            key = (self.pdl is not False and arch_rules.supports_pdl(arch), arch_rules.sm_count(arch, counts),
                   gemm_tiles.table_arch(arch) if self.gemm_tiles else None)
            groups.setdefault(key, []).append(arch)
        return [Target(tuple(a), pdl, n, tiles) for (pdl, n, tiles), a in groups.items()]

    def recorded(self) -> dict:
        """The options the manifest records (informative, SPEC §3) and the lowering reads:
        archs, fp32_matmul, pdl (whether any target has it), and `targets`, what each group of
        archs was compiled for ([{archs, pdl, sm_count}], format 3.5)."""
        d = asdict(self)
        for key in ("progress", "jobs", "buckets", "generate", "sm_count", "gemm_tiles",
                    "fold_row_stats"):
            d.pop(key)
        d["archs"] = list(self.archs)
        d["targets"] = [t.recorded() for t in self.targets()]
        d["pdl"] = any(t["pdl"] for t in d["targets"])
        return d


@dataclass(frozen=True)
class Target:
    """One compile target (a variant of format 3.5): the archs compiled alike."""
    archs: tuple
    pdl: bool          # kernels wait (gdc) and kernel -> kernel edges are programmatic
    sm_count: int      # the multiprocessors the tile plans fill
    gemm_tiles: str | None = None   # the arch whose measured GEMM tiles it uses (gemm_tiles.py)

    def recorded(self) -> dict:
        return {"archs": list(self.archs), "pdl": self.pdl, "sm_count": self.sm_count,
                "gemm_tiles": self.gemm_tiles}

    def lowering_options(self, options: CompileOptions) -> dict:
        """What lower.lower is given for this target: the recorded options with this target's
        pdl and `sm_count` (an int: the lowering's tile plans read it)."""
        d = options.recorded()
        d.pop("targets")
        return {**d, "pdl": self.pdl, "sm_count": self.sm_count, "tile_table": self.gemm_tiles}


@dataclass
class CompileReport:
    path: Path
    kernels: int
    unique_kernels: int
    seconds: dict = field(default_factory=dict)


def compile(program, example_inputs=None, *, output, kwargs=None, archs=("sm_90",),  # noqa: A001
            name=None, progress=False, fp32_matmul=None, jobs=None, dynamic_shapes=None,
            buckets=None, generate=None, pdl=None, sm_count=None, gemm_tiles=True,
            fold_row_stats=False) -> Path:
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
    `pdl`: programmatic edges between kernels (docs/design-pdl.md) in the graphs for the sm_90+
    archs, which archs before sm_90 get without. None (default): wherever the arch has them
    (3-18% faster on every model measured on the H200, docs/performance.md); True: the same, but
    an error when no arch has them; False: off (`grace.runtime.load(path, pdl=False)` also runs a
    PDL package with full edges, for A/B runs).
    `archs` with different settings (pdl on sm_90 but not sm_80, or different SM counts) make one
    package with per-arch variants (format 3.5): each target is lowered and generated on its own
    (compile time grows with the number of targets), the runtime runs the variant of its GPU.
    `sm_count={"sm_90": 114}`: the multiprocessor count to plan an arch's tiles for, for a part
    other than formats.archs.SM_COUNTS's (the H100 PCIe has 114, the table's H100/H200 132).
    `gemm_tiles` (on): GEMMs of >= 128 rows near a shape of the arch's measured table take its
    tile, split-K included (aot/gemm_tiles.py); False: the tile heuristic everywhere.
    `fold_row_stats=True`: a one-row reduction that only a GEMV's row reads (an RMSNorm's mean
    of squares in a decode step) is reduced inside that GEMV (aot/fuse_stats.py): fewer kernels;
    off by default: in the Llama-1B decode graph it measured the same per token (0.976 against
    0.980 ms, docs/performance.md, ninth session; on an H100 in the thirty-fourth, with today's
    stored rows and paired gate+up, 0.991 against 0.988). Into persistent GEMVs (K 2049-4096, the
    Llama-3-8B's) it happens without the option (fuse_stats.FOLD_INTO_PERSISTENT).

    A library call prints nothing: `progress=True` reports each stage and a build progress bar on
    stderr (what `grace compile` shows). Errors are exceptions (LoweringError names the op and
    the user's source line; `grace.aot.check` lists every unsupported op at once)."""
    options = CompileOptions(tuple(archs), fp32_matmul or lower.DEFAULT_OPTIONS["fp32_matmul"],
                             jobs, progress,
                             tuple((k, tuple(int(x) for x in v)) for k, v in (buckets or {}).items()),
                             tuple((generate or {}).items()), pdl if pdl is None else bool(pdl),
                             tuple((str(k), v) for k, v in (sm_count or {}).items()),
                             bool(gemm_tiles), bool(fold_row_stats))
    program, name, dim_names = exported(program, example_inputs, dynamic_shapes, kwargs, name)
    return compile_program(program, Path(output), name or "model", options, dim_names).path


def exported(program, example_inputs, dynamic_shapes, kwargs, name):
    """(ExportedProgram, name, dim_names) of what `compile` and `check` were given: an
    nn.Module goes through torch.export (its class names the package unless `name` does, and
    its Dims name the size symbols); an ExportedProgram is taken as it is."""
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
    return program, name, dim_names


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


# ----------------------------------------------------------------------------------------------
# The pipeline: named stages, each a function from one state to the next
# ----------------------------------------------------------------------------------------------
# Stages with `per_bucket` run once per shape bucket (one graph each), bucket by bucket in the
# order of extents.combinations, on that bucket's BucketState; the others run once on the
# CompileState. GRACE_DUMP=DIR writes the state after every stage (aot/dump.py), GRACE_VERIFY=1
# checks the IR after lower, fuse, memplan and codegen (aot/verify_ir.py), GRACE_OVERRIDE=DIR
# swaps kernel sources by name before the build (the `override` stage).


@dataclass
class BucketState:
    """One bucket on its way through the per-bucket stages."""

    bounds: dict                  # symbol name -> bound (the input symbols of this bucket)
    name: str                     # "seq=128,batch=2", "main" when static; "...@sm_80" per target
    target: object = None         # the compile Target (None: the options' only one)
    bucket_name: str = ""         # the name without the target
    program: object = None        # lower: the lowered ir.Program
    kernels: list | None = None   # fuse: the kernels after epilogue fusion (empty ones dropped)
    plan: object = None           # memplan: the memplan.MemoryPlan
    sources: list | None = None   # codegen: one codegen.KernelSource per kernel
    graph: object = None          # codegen: the manifest.GraphBuild (with the dependency edges)


@dataclass
class CompileState:
    """The whole compile: what was asked, then what each stage adds (None until it ran)."""

    program: object               # the ExportedProgram given
    output: Path
    name: str
    options: CompileOptions
    dim_names: dict | None = None
    core: object = None           # export: core ATen, constant inputs dropped
    symbols: list = field(default_factory=list)   # symbols: extents.Symbol, input then data
    lists: dict = field(default_factory=dict)     # symbols: bucket bounds per input symbol
    sym_index: dict = field(default_factory=dict)  # symbols: sympy symbol -> extents word
    output_names: list = field(default_factory=list)
    targets: list = field(default_factory=list)   # symbols: the compile Targets (format 3.5)
    buckets: list = field(default_factory=list)   # symbols: one BucketState per graph, per target
    graphs: list = field(default_factory=list)    # table: the buckets' GraphBuilds
    checks: list = field(default_factory=list)    # table: the manifest's index_checks
    layout: tuple = ()            # table: (slots, extents, table bytes, error word)
    writer: object = None         # table: the table writer's KernelSource
    step: object = None           # table: generation.GenerationPlan (--generate) or None
    recorded: dict = field(default_factory=dict)  # table: the options the manifest records
    unique: dict = field(default_factory=dict)    # table: kernel name -> KernelSource
    overrides: list = field(default_factory=list)  # override: kernel names whose source was swapped
    requests: list = field(default_factory=list)  # build: build.BuildRequest per kernel per arch
    cached: list = field(default_factory=list)    # build: whether each request was in the cache
    binaries: dict = field(default_factory=dict)  # build: (name, arch) -> build.Binary
    manifest: dict | None = None  # package
    sections: dict | None = None  # package
    seconds: dict = field(default_factory=dict)   # stage name -> seconds (summed over buckets)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable
    per_bucket: bool = False
    # GRACE_VERIFY: the IR check after this stage, (bucket, state) -> None (raises IRVerifyError)
    verify: Callable | None = None


def _export(st: CompileState) -> CompileState:
    """export: the program in core ATen (decompose), without constant inputs."""
    st.core = decompose(st.program)
    return st


def _symbols(st: CompileState) -> CompileState:
    """symbols: the size symbols (input dims, then data-dependent sizes), their bucket lists, the
    decode bucket of --generate, and one BucketState per combination of buckets."""
    try:
        st.symbols = extents.find_symbols(st.core, st.dim_names)
        st.lists = extents.bucket_lists(st.symbols, dict(st.options.buckets))
        st.symbols += extents.find_data_symbols(st.core, st.symbols)
    except extents.ShapeError as exc:
        raise lower.LoweringError(str(exc)) from exc
    if st.options.generate:   # decode (one token) is a bucket of its own
        generation.add_decode_bucket(st.core, st.symbols, st.lists, dict(st.options.generate))
    st.sym_index = {s.expr: i for i, s in enumerate(st.symbols)}
    st.output_names = program_output_names(st.core)
    st.targets = st.options.targets()
    combos = extents.combinations(st.symbols, st.lists)
    st.buckets = []
    for target in st.targets:   # target by target, each in bucket order
        for b in combos:
            name = ",".join(f"{k}={v}" for k, v in b.items()) or "main"
            full = name if len(st.targets) == 1 else f"{name}@{'+'.join(target.archs)}"
            st.buckets.append(BucketState(dict(b), full, target, name))
    return st


def _lower(b: BucketState, st: CompileState) -> BucketState:
    """lower: the program lowered with every input symbol at its bucket bound (ir.Program),
    outputs named after the model's (logits, ...), session state added for --generate."""
    bucket = {s.expr: b.bounds[s.name] for s in st.symbols if s.kind == "input"}
    try:
        b.program = lower.lower(st.core, st.name, _target(b, st).lowering_options(st.options),
                                bucket, st.output_names)
    except (lower.LoweringError, extents.ShapeError) as exc:
        relocate(exc, st.core)   # "used at" the user's line, not torch/nn/modules/*.py
        raise
    if st.options.generate:
        b.program = generation.add_state(b.program, dict(st.options.generate))
    if fuse_splitk.SPLIT_K_IN_KERNEL or fuse_combine.COMBINE_IN_ATTENTION:
        # the arrival words, in every graph at one offset
        b.program = fuse_splitk.add_state(b.program)
    return b


def _fuse(b: BucketState, st: CompileState) -> BucketState:
    """fuse: epilogue fusion, split-K sums added by the LayerNorm that reads them (fuse_norm);
    one-row statistics into the persistent GEMVs (with fold_row_stats or
    fuse_stats.FOLD_INTO_TEMPLATE, any GEMV) that read them (fuse_stats); with
    fuse_sums.INLINE_SPLIT_SUMS, split-K sums read only by GEMVs added
    by them; with fuse_rows.STORE_GEMV_ROWS, a template GEMV's normalised row stored by the
    mean's kernel; with fuse_append.APPEND_AFTER_ATTENTION, KV-cache appends after the attention;
    with fuse_splitk.SPLIT_K_IN_KERNEL, split-K matmuls summing their own splits; with
    fuse_combine.COMBINE_IN_ATTENTION, split-KV attentions combining their own splits), then the
    kernels with nothing to do dropped."""
    kernels = fuse.fuse_epilogues(b.program.kernels)
    if fuse_norm.FOLD_SPLIT_K_INTO_NORM:
        kernels = fuse_norm.fold_into_norms(kernels)
    if st.options.fold_row_stats or fuse_stats.FOLD_INTO_TEMPLATE:
        kernels = fuse_stats.fold_row_stats(kernels)
    elif fuse_stats.FOLD_INTO_PERSISTENT:
        kernels = fuse_stats.fold_row_stats(kernels, template=False)
    if fuse_sums.INLINE_SPLIT_SUMS:
        kernels = fuse_sums.inline_split_sums(kernels)
    if fuse_rows.STORE_GEMV_ROWS:
        kernels, index = fuse_rows.store_gemv_rows(kernels, b.program.next_index)
        b.program = dc_replace(b.program, next_index=index)
    if fuse_rows.PAIR_GATE_UP:
        kernels, index = fuse_rows.pair_gemv_rows(kernels, b.program.next_index)
        b.program = dc_replace(b.program, next_index=index)
    if fuse_rows.PLAIN_ROW_TILE or fuse_rows.EXPR_ROW_TILE:
        kernels = fuse_rows.row_tiles(kernels, _target(b, st).sm_count)
    if fuse_append.APPEND_AFTER_ATTENTION:   # with ATTN_KV_BEFORE_WAIT: 1B -2.5%, 8B -1.1% a token
        kernels = fuse_append.append_after_attention(kernels)
    kernels = memplan.drop_empty(kernels)
    if fuse_splitk.SPLIT_K_IN_KERNEL:   # off: correct on the H200, and slower (ViT-S +19%)
        kernels = fuse_splitk.reduce_in_kernel(kernels, b.program)
    if fuse_combine.COMBINE_IN_ATTENTION:   # off: correct on the GPU, slower (1B +4.7% span)
        kernels = fuse_combine.combine_in_attention(kernels, b.program)
    b.kernels = kernels
    return b


def _memplan(b: BucketState, st: CompileState) -> BucketState:
    """memplan: arena offsets by liveness, weights and state packed (checked for overlaps)."""
    b.plan = memplan.plan_memory(b.kernels, b.program.weights, b.program.state)
    memplan.check_plan(b.plan)
    return b


def _codegen(b: BucketState, st: CompileState) -> BucketState:
    """codegen: one Triton source per kernel, then the graph's dependency edges (which need to
    know the kernels that read the extents) and the bucket's GraphBuild."""
    b.sources = []
    target = _target(b, st)   # its SM count is in the kernels' tile plans (the lowering's)
    for k in b.kernels:
        try:
            b.sources.append(codegen.generate(k, st.sym_index, pdl=target.pdl))
        except ValueError as exc:   # a size expression a kernel cannot evaluate
            raise lower.LoweringError(f"{exc} — in the kernel for node '{k.label}'") from exc
    readers = [any(buf.kind == "extents" for buf in src.buffers) for src in b.sources]
    deps = memplan.dependencies(b.kernels, b.plan, readers)
    all_bounds = {s.name: int(b.program.bounds.get(s.expr, s.hi or 0)) for s in st.symbols}
    archs = None if len(st.targets) == 1 else target.archs
    b.graph = manifest.GraphBuild(b.name, all_bounds, b.program, b.kernels, b.plan, deps, b.sources,
                                 archs=archs, pdl=target.pdl, sm_count=target.sm_count,
                                 bucket_name=b.bucket_name or b.name)
    return b


def _target(b: BucketState, st: CompileState) -> Target:
    """The bucket's compile target (a BucketState made without one: the options' first)."""
    return b.target if b.target is not None else st.options.targets()[0]


def _table(st: CompileState) -> CompileState:
    """table: every bucket has the same interface; the index checks, the argument-table layout
    (one for all graphs), the table writer, the generation step, the recorded options and the
    unique kernels."""
    st.graphs = [b.graph for b in st.buckets]
    _check_same_interface(st.graphs)
    st.checks = manifest.index_checks(st.graphs, st.symbols)   # gathers' bounds checks (3.3)
    layouts = [manifest.table_layout(g.program, len(st.symbols), bool(st.checks))
               for g in st.graphs]
    if any(layout != layouts[0] for layout in layouts[1:]):
        raise lower.LoweringError("internal: buckets lowered to different argument tables")
    st.layout = layouts[0]
    slots, extents, _, _ = st.layout
    st.writer = codegen.table_writer_source(slots, extents)
    if st.options.generate:
        # one step for every target (it reads the logits and writes the state, the same in each);
        # decode_graph indexes st.graphs, whose first graphs are the first target's
        steps = [generation.plan(graphs, st.symbols, dict(st.options.generate))
                 for graphs in _graphs_by_target(st)]
        if len({s.source.name for s in steps}) != 1:
            raise lower.LoweringError("internal: the generation step differs between compile "
                                      "targets")
        st.step = steps[0]
    st.recorded = st.options.recorded()
    if st.lists:
        st.recorded["buckets"] = st.lists
        st.recorded["bucket_cost"] = _cost_note(st.symbols, st.lists)
    st.unique = {s.name: s for s in [st.writer] + [src for g in st.graphs for src in g.sources]
                 + ([st.step.source] if st.step else [])}
    _check_same_builds([st.writer] + [src for g in st.graphs for src in g.sources])
    targets = "" if len(st.targets) == 1 else \
        f" for {len(st.targets)} targets ({'; '.join(_target_text(t) for t in st.targets)})"
    _say(st.options, f"[bold]grace[/]: {st.name}: {len(st.graphs)} graph(s){targets}, "
                     f"{sum(len(g.kernels) for g in st.graphs)} kernels ({len(st.unique) - 1} "
                     f"unique), arena ≤ {max(g.plan.arena_nbytes for g in st.graphs)} B, "
                     f"weights {st.graphs[0].plan.weights_nbytes} B")
    return st


def _graphs_by_target(st: CompileState) -> list[list]:
    """st.graphs split by compile target, in target order (each in bucket order)."""
    out: dict = {}
    for b in st.buckets:
        out.setdefault(_target(b, st), []).append(b.graph)
    return list(out.values())


def _target_text(t: Target) -> str:
    return f"{'+'.join(t.archs)}: {t.sm_count} SMs{', pdl' if t.pdl else ''}"


def _check_same_builds(sources) -> None:
    """Kernels are shared by name (the hash of their source): one name must mean one build (the
    same parameter types, warps and stages), in every bucket and every target."""
    seen: dict[str, tuple] = {}
    for src in sources:
        build_of = (tuple(src.param_types), src.num_warps, src.num_stages)
        if seen.setdefault(src.name, build_of) != build_of:
            raise AssertionError(f"internal: kernel {src.name} generated twice with different "
                                 f"builds: {seen[src.name]} / {build_of}")


def _override(st: CompileState) -> CompileState:
    """override: with GRACE_OVERRIDE=DIR, every DIR/<kernel name>.py replaces that kernel's
    source (a debugging aid: edit a dumped kernel, rebuild the package). Warned about loudly and
    recorded in the manifest (`producer.overrides`), so such a package is never taken for a
    clean build."""
    replaced = dump.load_overrides(st.unique)
    if not replaced:
        return st
    st.overrides = sorted(replaced)
    st.unique = {name: replaced.get(name, src) for name, src in st.unique.items()}
    for g in st.graphs:
        g.sources[:] = [replaced.get(s.name, s) for s in g.sources]
    st.writer = replaced.get(st.writer.name, st.writer)
    if st.step is not None:
        st.step.source = replaced.get(st.step.source.name, st.step.source)
    dump.warn_overrides(st.overrides)
    return st


def _build(st: CompileState) -> CompileState:
    """build: every unique kernel compiled to a cubin for each arch that runs it (every arch of
    the targets whose graphs use it; cached, in parallel)."""
    archs = manifest.kernel_archs(st.writer, st.graphs, list(st.options.archs),
                                 [st.step.source] if st.step else ())
    st.requests = [build.BuildRequest(s.name, s.source, tuple(s.param_types), s.num_warps,
                                      s.num_stages, arch)
                   for s in st.unique.values() for arch in archs[s.name]]
    st.cached = [build.is_cached(r) for r in st.requests]
    binaries = _build_with_progress(st.requests, st.options)
    st.binaries = {(r.name, r.arch): b for r, b in zip(st.requests, binaries)}
    return st


def _package(st: CompileState) -> CompileState:
    """package: the manifest and sections (manifest.build_manifest), written atomically."""
    from grace.formats import write_package

    slots, extents, table_nbytes, errors = st.layout
    st.manifest, st.sections = manifest.build_manifest(
        st.graphs, st.symbols, st.writer, st.binaries, list(st.options.archs), st.recorded, slots,
        extents, table_nbytes, st.step, errors, st.checks)
    if st.overrides:   # an optional producer key: this package is not a clean build
        st.manifest["producer"]["overrides"] = list(st.overrides)
    st.output.parent.mkdir(parents=True, exist_ok=True)
    write_package(st.output, st.manifest, st.sections)
    return st


def _verify_lowered(b: BucketState, st: CompileState) -> None:
    verify_ir.check_kernels(b.program.kernels, b.program, "lower", b.name)


def _verify_fused(b: BucketState, st: CompileState) -> None:
    verify_ir.check_kernels(b.kernels, b.program, "fuse", b.name)


def _verify_plan(b: BucketState, st: CompileState) -> None:
    verify_ir.check_plan(b.plan, b.kernels, b.program, "memplan", b.name)


def _verify_order(b: BucketState, st: CompileState) -> None:
    verify_ir.check_order(b.kernels, b.graph.deps, "codegen", b.name)


PIPELINE: tuple[Stage, ...] = (
    Stage("export", _export),
    Stage("symbols", _symbols),
    Stage("lower", _lower, per_bucket=True, verify=_verify_lowered),
    Stage("fuse", _fuse, per_bucket=True, verify=_verify_fused),
    Stage("memplan", _memplan, per_bucket=True, verify=_verify_plan),
    Stage("codegen", _codegen, per_bucket=True, verify=_verify_order),
    Stage("table", _table),
    Stage("override", _override),
    Stage("build", _build),
    Stage("package", _package),
)


def run_pipeline(st: CompileState, stages=PIPELINE, dumper=None, verify: bool | None = None):
    """Run `stages` in order on `st`: a run of consecutive per-bucket stages goes bucket by
    bucket (each bucket through all of them, then the next), the others once. `dumper`
    (dump.Dump) writes every stage's state; `verify` (default: GRACE_VERIFY) runs the IR checks
    of the stages that have one. Returns the final state. A failing stage is recorded in the
    dump (ERROR.txt) before its exception propagates."""
    verify = verify_ir.enabled() if verify is None else verify
    i = 0
    while i < len(stages):
        if not stages[i].per_bucket:
            st = _run_stage(stages[i], st, None, dumper, verify)
            i += 1
            continue
        group = []
        while i < len(stages) and stages[i].per_bucket:
            group.append(stages[i])
            i += 1
        for n, bucket in enumerate(st.buckets):
            for stage in group:
                bucket = _run_stage(stage, st, bucket, dumper, verify)
            st.buckets[n] = bucket
    return st


def _run_stage(stage: Stage, st: CompileState, bucket, dumper, verify):
    t = time.perf_counter()
    try:
        out = stage.run(st) if bucket is None else stage.run(bucket, st)
        if verify and stage.verify is not None:
            stage.verify(out, st)
    except BaseException as exc:
        if dumper is not None:
            dumper.error(stage, bucket, exc)
        raise
    finally:
        st.seconds[stage.name] = st.seconds.get(stage.name, 0.0) + time.perf_counter() - t
    if dumper is not None:
        dumper.stage(stage, out, st if bucket is not None else out)
    return out


def compile_program(program, output: Path, name: str, options: CompileOptions,
                    dim_names: dict | None = None) -> CompileReport:
    """Run PIPELINE on an ExportedProgram and write the package to `output`."""
    # another torch/triton than the pinned ones: a warning (the GPU machine compiles with torch 2.11)
    unpinned = versions.warn_if_unpinned(stacklevel=2)
    if unpinned:
        _say(options, f"[bold yellow]grace: warning[/]: {unpinned}")
    st = run_pipeline(CompileState(program, Path(output), name, options, dim_names),
                      dumper=dump.Dump.from_env(name))
    output = st.output
    _say(options, f"[bold]grace[/]: wrote {output} "
                  f"({output.stat().st_size / 1e6:.1f} MB) in {sum(st.seconds.values()):.1f} s")
    return CompileReport(output, sum(len(g.kernels) for g in st.graphs), len(st.unique) - 1,
                         st.seconds)


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
    parts = [f"{s.name}: {extents.padding_cost(s, lists[s.name]):.0%} padded work"
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
