"""The `package` stage (the last of compiler.PIPELINE): everything the runtime needs, as one
manifest plus sections (formats/ writes the file).

One graph per bucket. A graph's node 0 is the table writer; kernel node j+1 is kernel j of its
schedule. A kernel argument is a byte range of a region (weights, arena, the table slot of an I/O
tensor, the extents words, or the error word of the index checks) so the loader can check every
range before anything is launched.
Kernels are shared between graphs where their sources are identical.

Format 3.4: the manifest also records what each kernel and graph was compiled for (`compiled`,
SPEC §3.4): per kernel its parameters, block, shared memory and every node it was generated for
(grid, and per parameter the buffer and the bytes it may touch); per graph its bucket and memory
plan. The reader checks every node against them (grace.formats.crosscheck). They add manifest data
only: kernel sources and binaries are the same with or without them.

Format 3.5: per-arch variants (SPEC §3.5). Each GraphBuild belongs to one compile target (the archs
compiled alike: the same pdl, the same SM count) and serves its archs. Graphs identical across
targets are stored once, serving the union of their archs; a graph that serves every arch has no
`archs` key and its plain name (so a single-target package is a 3.4 package), any other one
`archs` and a name with its archs (`seq=128@sm_80`). A kernel has a binary for exactly the archs of
the graphs that run it (the table writer and the generation step: every arch), and kernels of
identical source are stored once, as before.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from grace.formats import table

from .codegen import KernelSource
from .ir import Buffer, Program
from .memplan import MemoryPlan
from .extents import sym_expr, to_manifest

HIDDEN_PARAMS = 2   # Triton 3.6 appends global and profile scratch pointers to every entry point

# Which table-reading nodes get an edge from the table writer (node 0). False: only those not
# already after it by a path of edges (SPEC §5.3: a path of edges of either kind orders two nodes
# as a path of full edges would), i.e. the graph's roots. True: every node that reads the table,
# the form before the fourteenth session. In a decode graph that is every node (each reads the
# extents), and on the H200 the roots then started 17.6-18.1 µs after the table writer began
# though it runs 0.8 µs; with edges to the roots only, 2.0-4.3 µs, and the Llama-1B decode span
# fell 842 -> 827 µs (docs/performance.md, fourteenth session). A/B with
# `--variant fanout:manifest.TABLE_WRITER_FANOUT=True`.
TABLE_WRITER_FANOUT = False


def table_layout(program: Program, n_symbols: int = 0,
                 errors: bool = False) -> tuple[list[dict], dict, int, dict | None]:
    """A table slot for each input then each output, laid out by `formats.table.pack`: the
    slots, the extents (one i64 word per size symbol), then (`errors`: the package has index
    checks) the error word. Returns (slots, extents, table bytes, `table.errors` or None). The
    slot of an I/O buffer is its position in `slots` (`slot_of`); the buffers are not touched,
    since every bucket's program has its own and all share this one layout."""
    io = [("input", buf) for buf in program.inputs] + [("output", buf) for buf in program.outputs]
    layout = table.pack([len(buf.shape) for _, buf in io], n_symbols, errors)
    slots = [{"name": buf.name, "role": role, "offset": offset, "rank": len(buf.shape)}
             for (role, buf), offset in zip(io, layout.slot_offsets)]
    extents = {"offset": layout.extents_offset, "count": n_symbols}
    error_word = None if layout.errors_offset is None else {"offset": layout.errors_offset}
    return slots, extents, layout.nbytes, error_word


def slot_of(buf: Buffer, slots: list[dict]) -> int:
    """The table slot of an input or output buffer: the one of its name and role (names are unique
    among the package's inputs and outputs)."""
    for i, slot in enumerate(slots):
        if slot["name"] == buf.name and slot["role"] == buf.kind:
            return i
    raise AssertionError(f"internal: {buf.kind} {buf.name} has no table slot")


@dataclass
class GraphBuild:
    """One bucket's compiled graph: its program, kernels, memory plan and sources."""

    name: str
    bucket: dict                 # symbol name -> bound
    program: Program
    kernels: list
    plan: MemoryPlan
    deps: list
    sources: list
    stats: dict = field(default_factory=dict)
    # format 3.5: the compile target: its archs (None: every arch of the package), whether its
    # sources wait (pdl) and the SM count its tile plans assume (None: not recorded); `bucket_name`
    # is the name without the target (default: `name`)
    archs: tuple | None = None
    pdl: bool | None = None
    sm_count: int | None = None
    bucket_name: str | None = None


def _arg(buf: Buffer, plan: MemoryPlan, slots: list[dict], extents: dict,
         errors: dict | None = None) -> dict:
    if buf.kind == "arena":
        p = plan.arena[buf.index]
        return {"region": "arena", "offset": p.offset, "nbytes": buf.nbytes, "dtype": buf.dtype}
    if buf.kind == "weight":
        return {"region": "weights", "offset": plan.weights[buf.index], "nbytes": buf.nbytes,
                "dtype": buf.dtype}
    if buf.kind == "state":
        return {"region": "state", "offset": plan.state[buf.index], "nbytes": buf.nbytes,
                "dtype": buf.dtype}
    if buf.kind == "extents":
        return {"region": "table", "offset": extents["offset"],
                "nbytes": table.WORD_NBYTES * extents["count"], "dtype": "int64"}
    if buf.kind == "errors":
        if errors is None:
            raise AssertionError("a kernel checks indices, but the table has no error word")
        return {"region": "table", "offset": errors["offset"], "nbytes": table.WORD_NBYTES,
                "dtype": "int64"}
    slot = slots[slot_of(buf, slots)]
    return {"region": "table", "offset": slot["offset"], "nbytes": table.slot_nbytes(slot["rank"]),
            "dtype": "int64"}


def _describe(buf: Buffer, slots: list[dict], extents: dict) -> list:
    """What a kernel parameter was generated for, as its record says it (format 3.4, SPEC §3.4):
    the buffer, by kind and name, and the bytes the kernel may touch through the parameter (the
    buffer's bytes: the generated indexing stays inside the buffer it was generated for). A table
    slot also names its I/O tensor with the dtype and the shape (at this graph's bucket) the kernel
    was specialised for."""
    if buf.kind == "arena":
        return ["arena", buf.nbytes, buf.name]
    if buf.kind == "weight":
        return ["weights", buf.nbytes, buf.name]
    if buf.kind == "state":
        return ["state", buf.nbytes, buf.name]
    if buf.kind == "extents":
        return ["extents", table.WORD_NBYTES * extents["count"]]
    if buf.kind == "errors":
        return ["errors", table.WORD_NBYTES]
    slot = slots[slot_of(buf, slots)]
    return ["slot", table.slot_nbytes(slot["rank"]), buf.name, buf.dtype, [int(d) for d in buf.shape]]


def _use(graph: int | None, node: int | None, grid, args: list) -> dict:
    """One entry of a kernel record's `uses`: a node the kernel was compiled for (graph None: the
    generate step), its grid and its parameters' descriptors (`_describe`; ["word", i] for an
    integer parameter that receives table word i)."""
    return {"graph": graph, "node": node, "grid": [int(x) for x in grid], "args": args}


def _graph_record(g: GraphBuild, symbols: list) -> dict:
    """`graphs[i].compiled` (3.4): the sizes this graph was lowered to serve, per symbol
    [smallest, bound], and its memory plan: every arena buffer with the bytes the plan reserves for
    it (256-aligned) and the nodes from its first writer to its last reader."""
    buffers = sorted(g.plan.arena.values(), key=lambda p: (p.first, p.offset, p.buffer.name))
    names = [p.buffer.name for p in buffers]
    if len(set(names)) != len(names):
        raise AssertionError(f"internal: graph {g.name} has two arena buffers of one name")
    record = {"bucket": {s.name: [int(s.lo), int(g.bucket[s.name])] for s in symbols},
              "buffers": [{"name": p.buffer.name, "dtype": p.buffer.dtype, "offset": p.offset,
                           "nbytes": p.nbytes, "first": p.first + 1, "last": p.last + 1}
                          for p in buffers]}
    if g.pdl is not None and g.sm_count is not None:   # 3.5: what the graph was planned for
        record["target"] = {"pdl": bool(g.pdl), "sm_count": int(g.sm_count)}
    return record


def _kernel_record(src: KernelSource, binaries: dict, archs: list[str], uses: list,
                   positions: list | None) -> dict:
    """`kernels[i].compiled` (3.4): what the kernel was built for, from the compiler's own
    knowledge. `nparams`: the entry point's parameters with Triton's hidden ones; `block`: the
    threads per block Triton generated the code for (32·num_warps of its metadata); `shared`: the
    dynamic shared memory the binaries need; `waits`: the code calls gdc_wait() before it touches
    anything another node writes (it may be the target of programmatic edges, SPEC §5.3);
    `writes`: the parameters its code stores through (what the race proof relies on); `source`:
    the section of its source (what the CPU executor runs);
    `table_words` (the table writer only): the int64 position of the table each word parameter is
    stored at; `uses`: every node it was compiled for."""
    warps = {binaries[(src.name, arch)].num_warps for arch in archs}
    if warps != {src.num_warps}:
        raise AssertionError(f"internal: {src.name} built with num_warps {sorted(warps)}, "
                             f"generated for {src.num_warps}")
    record = {"nparams": len(src.param_types) + HIDDEN_PARAMS, "block": 32 * src.num_warps,
              "shared": max(binaries[(src.name, arch)].shared for arch in archs),
              "waits": "gdc_wait()" in src.source, "writes": list(src.writes),
              "source": f"src/{src.name}.py", "uses": uses}
    if positions is not None:
        record["table_words"] = list(positions)
    return record


def weight_view(tensor: torch.Tensor):
    """The tensor's bytes as a numpy view (no copy; it keeps the tensor alive) for a TensorBlob."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:   # torch calls a stride-0 [1] contiguous
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def kernel_archs(writer: KernelSource, graphs: list[GraphBuild], archs: list[str],
                 extra=()) -> dict[str, tuple]:
    """Kernel name -> the archs it needs a binary for (format 3.5), in `archs` order: those of the
    graphs that run it; the table writer and `extra` (the generation step) run in every variant."""
    need: dict[str, set] = {writer.name: set(archs)}
    for src in extra:
        need.setdefault(src.name, set()).update(archs)
    for g in graphs:
        served = archs if g.archs is None else g.archs
        for src in g.sources:
            need.setdefault(src.name, set()).update(served)
    return {name: tuple(a for a in archs if a in wanted) for name, wanted in need.items()}


def _kernel_entries(writer: KernelSource, graphs: list[GraphBuild], binaries: dict,
                    archs: list[str], sections: dict,
                    extra=()) -> tuple[list[dict], dict[str, int], list, dict]:
    """The `kernels` entries (one per unique source), the index of each by name, their sources in
    that order (for the records, `_kernel_record`) and the archs of each (kernel_archs)."""
    unique: dict[str, int] = {}
    entries, sources = [], []
    per_kernel = kernel_archs(writer, graphs, archs, extra)
    for src in [writer] + [s for g in graphs for s in g.sources] + list(extra):
        if src.name in unique:
            continue
        unique[src.name] = len(entries)
        sources.append(src)
        sha = hashlib.sha256(src.source.encode()).hexdigest()
        sections[f"src/{src.name}.py"] = src.source.encode()
        entry_bins, shared, gscratch, pscratch = {}, 0, 0, 0
        for arch in per_kernel[src.name]:
            binary = binaries[(src.name, arch)]
            section = f"cubin/{src.name}.{arch}"
            sections[section] = binary.cubin
            entry_bins[arch] = section
            shared = max(shared, binary.shared)
            gscratch = max(gscratch, binary.global_scratch_size)
            pscratch = max(pscratch, binary.profile_scratch_size)
        params = [{"name": f"p{i}", "type": t} for i, t in enumerate(src.param_types)]
        entries.append({
            "name": src.name, "family": src.family, "params": params,
            "num_warps": src.num_warps, "num_stages": src.num_stages, "shared": shared,
            "hidden_params": HIDDEN_PARAMS, "writes": list(src.writes), "global_scratch_size": gscratch,
            "profile_scratch_size": pscratch, "source_sha256": sha,
            "binaries": entry_bins, "source": f"src/{src.name}.py"})
    return entries, unique, sources, per_kernel


def _graph_entry(g: GraphBuild, writer: KernelSource, unique: dict, slots, extents,
                 table_nbytes: int, pdl: bool = False, errors: dict | None = None,
                 index: int = 0, uses: dict | None = None) -> dict:
    """Graph `index` of the manifest; `uses` (kernel index -> list) collects the nodes each kernel
    runs in, for the kernel records."""
    uses = {} if uses is None else uses
    words = table.word_count((s["rank"] for s in slots), extents["count"])
    nodes = [{"kernel": unique[writer.name], "grid": [1, 1, 1],
              "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes, "dtype": "int64"}]
              + [{"word": i} for i in range(words)],
              "deps": [], "label": "table_writer"}]
    uses.setdefault(unique[writer.name], []).append(
        _use(index, 0, writer.grid, [["table", table_nbytes]] + [["word", i] for i in range(words)]))
    after_writer = [True]   # per node: ordered after the table writer by a path of edges
    for j, (kernel, src) in enumerate(zip(g.kernels, g.sources)):
        # the error word is part of the table, which the table writer's range covers whole: a
        # kernel that stores into it is ordered after node 0 as well
        reads_table = any(b.kind in ("input", "output", "extents", "errors") for b in src.buffers)
        node_deps = [i + 1 for i in g.deps[j]]
        ordered = any(after_writer[d] for d in node_deps)
        if reads_table and (TABLE_WRITER_FANOUT or not ordered):
            node_deps = [0] + node_deps
        after_writer.append(reads_table or ordered)
        node = {"kernel": unique[src.name], "grid": list(src.grid),
                "args": [_arg(b, g.plan, slots, extents, errors) for b in src.buffers],
                "deps": node_deps, "label": kernel.label}
        # With PDL every kernel -> kernel edge is programmatic: each kernel launches while the one
        # before it finishes, and the runtime caps its blocks per multiprocessor at one wave of
        # its grid so that early blocks do not pile up on the few multiprocessors free at that
        # moment (runtime/occupancy.py; docs/design-pdl.md has the measurements). The table
        # writer's edges (node 0) stay full (SPEC §5.3).
        programmatic = [d for d in node_deps if d != 0] if pdl else []
        if programmatic:
            node["programmatic"] = programmatic
        uses.setdefault(node["kernel"], []).append(
            _use(index, len(nodes), src.grid, [_describe(b, slots, extents) for b in src.buffers]))
        nodes.append(node)
    families: dict[str, int] = {}
    for src in g.sources:
        families[src.family] = families.get(src.family, 0) + 1
    stats = {"kernels": len(g.kernels), "unique_kernels": len({s.name for s in g.sources}),
             "families": families, "weights_nbytes": g.plan.weights_nbytes,
             "arena_nbytes": g.plan.arena_nbytes, **g.stats}
    return {"name": g.name, "bucket": dict(g.bucket), "arena": max(g.plan.arena_nbytes, 256),
            "nodes": nodes, "stats": stats}


def _shape(sizes, names: dict) -> list:
    return [int(d) if sym_expr(d) is None else to_manifest(sym_expr(d), names) for d in sizes]


def _state_entries(program: Program, plan: MemoryPlan, sections: dict) -> list[dict]:
    """Session state: zero-filled buffers are described, not stored (a cache of zeros costs no
    bytes in the file); any other initial value goes into the `state` section."""
    from grace.formats import TensorBlob

    entries, data = [], {}
    for b in program.state:
        tensor = program.state_data[b.name]
        zeros = not bool(torch.count_nonzero(tensor))
        entries.append({"name": b.name, "dtype": b.dtype, "shape": list(b.shape),
                        "offset": plan.state[b.index], "nbytes": b.nbytes,
                        "init": "zeros" if zeros else "data"})
        if not zeros:
            data[b.name] = (b.dtype, tuple(b.shape), weight_view(tensor))
    if data:
        sections["state"] = TensorBlob(data)
    return entries


def _generate_entry(step, g: GraphBuild, slots, extents) -> dict:
    from .generation import CTRL, NEXT_POSITION, NEXT_TOKEN, OUT_TOKENS
    return {"tokens": step.tokens, "positions": step.positions, "logits": step.logits,
            "capacity": step.capacity, "decode_graph": step.decode_graph,
            "ctrl": CTRL, "out_tokens": OUT_TOKENS, "next_token": NEXT_TOKEN,
            "next_position": NEXT_POSITION,
            "step": {"kernel": None, "grid": list(step.source.grid), "deps": [],
                     "label": "generate_step",
                     "args": [_arg(b, g.plan, slots, extents) for b in step.source.buffers]}}


def index_checks(graphs: list[GraphBuild], symbols: list) -> list[dict]:
    """The manifest's `index_checks`: the checks some kernel of some graph evaluates (a check
    whose gather no kernel computes reports nothing), by code. A code names one index of one FX
    node (Lowering.check_index), so every bucket describes it the same way; a dynamic table size
    is a shape expression."""
    from .ir import Expr, Op, walk

    def exprs(value):   # every expression a kernel holds, however its family nests them
        if isinstance(value, Expr):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from exprs(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from exprs(v)

    names = {s.expr: s.name for s in symbols}
    found: dict[int, dict] = {}
    for g in graphs:
        used = {n.param for k in g.kernels for e in exprs(k.exprs()) for n in walk(e)
                if isinstance(n, Op) and n.op == "check_index"}
        for check in g.program.index_checks:
            if check["code"] not in used:
                continue
            size = check["size"]
            entry = {**check, "size": size if isinstance(size, int) else to_manifest(size, names)}
            if found.setdefault(entry["code"], entry) != entry:
                raise AssertionError(f"internal: index check {entry['code']} differs between "
                                     f"buckets: {found[entry['code']]} / {entry}")
    return [found[c] for c in sorted(found)]


def build_manifest(graphs: list[GraphBuild], symbols: list, writer: KernelSource,
                   binaries: dict, archs: list[str], options: dict, slots: list[dict],
                   extents: dict, table_nbytes: int, step=None, errors: dict | None = None,
                   checks: list | None = None) -> tuple[dict, dict[str, bytes]]:
    import triton

    from grace.formats import TensorBlob

    sections: dict = {}
    kernel_entries, unique, kernel_sources, per_kernel = _kernel_entries(
        writer, graphs, binaries, archs, sections, [step.source] if step else ())
    uses: dict[int, list] = {}
    kept, of_graph = _variant_graphs(graphs, writer, unique, slots, extents, table_nbytes,
                                     bool(options.get("pdl")), errors, symbols, archs)
    first = graphs[0]
    program, plan = first.program, first.plan
    names = {s.expr: s.name for s in symbols}
    manifest = {
        "producer": {"grace": _grace_version(), "torch": torch.__version__.split("+")[0],
                     "triton": triton.__version__},
        "model": {"name": program.name},
        "archs": list(archs),
        "options": dict(options),
        "symbols": [{"name": s.name, "kind": s.kind, "min": s.lo,
                     "max": s.hi if s.hi is not None else max(g.bucket[s.name] for g in graphs),
                     "sources": [list(src) for src in s.sources]} for s in symbols],
        "inputs": [{"name": b.name, "dtype": b.dtype,
                    "shape": _shape(program.sizes.get(b.name, b.shape), names),
                    "slot": slot_of(b, slots)}
                   for b in program.inputs],
        "outputs": [{"name": b.name, "dtype": b.dtype,
                     "shape": _shape(program.sizes.get(b.name, b.shape), names),
                     "slot": slot_of(b, slots)}
                    for b in program.outputs],
        "table": {"nbytes": table_nbytes, "slots": slots, "extents": dict(extents),
                  **({"errors": dict(errors)} if errors is not None else {})},
        "regions": {"weights": max(plan.weights_nbytes, 256),
                    "arena": max(max(g.plan.arena_nbytes for g in graphs), 256),
                    "table": table_nbytes, "state": plan.state_nbytes},
        "state": _state_entries(program, plan, sections),
        "weights": [{"name": b.name, "dtype": b.dtype, "shape": list(b.shape),
                     "offset": plan.weights[b.index], "nbytes": b.nbytes}
                    for b in program.weights],
        "arena_buffers": [{"name": p.buffer.name, "offset": p.offset, "nbytes": p.nbytes,
                           "first": p.first + 1, "last": p.last + 1}
                          for p in sorted(plan.arena.values(), key=lambda p: p.first)],
        "kernels": kernel_entries,
        "graphs": [],
    }
    for i, (g, served, one_target) in enumerate(kept):   # one entry per distinct graph (3.5)
        entry = _graph_entry(g, writer, unique, slots, extents, table_nbytes,
                             _pdl_of(g, options), errors, i, uses)
        entry["compiled"] = _graph_record(g, symbols)   # format 3.4: what it was lowered for
        if not one_target:   # the same graph for targets planned differently: no single target
            entry["compiled"].pop("target", None)
        if served != tuple(archs):
            entry["name"] = f"{g.bucket_name or g.name}@{'+'.join(served)}"
            entry["archs"] = list(served)
        else:
            entry["name"] = g.bucket_name or g.name
        manifest["graphs"].append(entry)
    if checks:   # format 3.3: what each code a kernel stores into table.errors means
        manifest["index_checks"] = [dict(c) for c in checks]
    if step is not None:
        manifest["generate"] = _generate_entry(step, first, slots, extents)
        manifest["generate"]["decode_graph"] = of_graph[step.decode_graph]
        manifest["generate"]["step"]["kernel"] = unique[step.source.name]
        # the step serves every graph's logits: its slots are described without a bucket's shape
        uses.setdefault(unique[step.source.name], []).append(_use(
            None, None, step.source.grid, [_describe(b, slots, extents)[:4] for b in step.source.buffers]))
    positions = table.word_positions([(s["offset"], s["rank"]) for s in slots],
                                     extents["offset"], extents["count"])
    for k, (entry, src) in enumerate(zip(kernel_entries, kernel_sources)):   # format 3.4
        entry["compiled"] = _kernel_record(src, binaries, per_kernel[src.name], uses.get(k, []),
                                           positions if src is writer else None)
    # streamed from the weight tensors into the file: an 8B model's weights are not copied in RAM
    sections["weights"] = TensorBlob({
        b.name: (b.dtype, tuple(b.shape), weight_view(program.weight_data[b.name]))
        for b in program.weights})
    return manifest, sections


def _pdl_of(g: GraphBuild, options: dict) -> bool:
    """Whether graph g's kernel edges may be programmatic: its target's pdl (format 3.5), else the
    compile option."""
    return bool(options.get("pdl")) if g.pdl is None else bool(g.pdl)


def _variant_graphs(graphs: list[GraphBuild], writer, unique, slots, extents, table_nbytes: int,
                    pdl: bool, errors, symbols, archs: list[str]) -> tuple[list, list]:
    """The graphs the manifest stores (format 3.5): one per distinct graph, with the archs it serves
    (the union of the targets whose graph it is, in `archs` order). Two targets' graphs of one
    bucket are the same graph when everything the manifest says about them is (nodes, arena,
    memory plan, what their kernels were compiled for there). Returns ([(GraphBuild, archs, whether
    its targets share one pdl and SM count)], the manifest index of each of `graphs`)."""
    keys: dict[str, int] = {}
    kept: list = []
    served: list[set] = []
    settings: list[set] = []   # the (pdl, sm_count) of the targets whose graph each one is
    of_graph = []
    for g in graphs:
        probe: dict = {}   # the records of this graph's nodes alone, graph index 0
        entry = _graph_entry(g, writer, unique, slots, extents, table_nbytes,
                             _pdl_of(g, {"pdl": pdl}), errors, 0, probe)
        entry.pop("name")
        entry["compiled"] = _graph_record(g, symbols)
        entry["compiled"].pop("target", None)   # equal graphs serve targets that differ elsewhere
        key = json.dumps([entry, sorted(probe.items())], sort_keys=True, default=repr)
        at = keys.get(key)
        if at is None:
            at = keys[key] = len(kept)
            kept.append(g)
            served.append(set())
            settings.append(set())
        served[at].update(archs if g.archs is None else g.archs)
        settings[at].add((g.pdl, g.sm_count))
        of_graph.append(at)
    kept = [(g, tuple(a for a in archs if a in s), len(t) == 1)
            for g, s, t in zip(kept, served, settings)]
    return kept, of_graph


def _grace_version() -> str:
    try:
        from importlib.metadata import version
        return version("grace")
    except Exception:
        return "0.0.0"
