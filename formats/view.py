"""A typed view of a validated manifest, with SPEC.md's defaults filled in (SPEC.md §3).

`validate_manifest` (formats/manifest.py) is the one checker of a manifest; this module is the one
reader of what it accepted. The runtime, the CPU reference executor and `grace inspect` read the
manifest through a `Manifest` instead of walking the msgpack maps, so

  * an optional key gets its default here and nowhere else (`hidden_params` absent: 0, `writes`
    absent: None = unknown, a node's `programmatic` absent: no programmatic edge, ...);
  * nothing downstream repeats a check: every field of a `Manifest` already satisfies the schema,
    including the cross-references (a node's kernel exists, a word argument is in range, ...);
  * the table's words are located once, by formats.table (`Slot.first_word`, `Table.words`);
  * the compiler's records (format 3.4: `Kernel.compiled`, `Graph.compiled`) are None for a package
    without them; formats.crosscheck has checked every node against them when they are there;
  * per-arch variants (format 3.5): every `Graph.archs` is filled in (absent: all of `archs`), and
    `for_arch(view, arch)` is the view of one variant: the graphs that serve `arch`, renumbered
    from 0 (`graph_index` maps them back), with `generate.decode_graph` that variant's decode graph.
    The runtime and the CPU executor plan and select graphs on such a view only.

The records are NamedTuples (immutable, cheap to build for every node of every graph); the maps
they hold (`bucket`, `regions`, `stats`, `options`, ...) are copies the caller must not modify.

    Package.view           the view of a package read by read_package (built on first use)
    as_view(manifest)      a Manifest as it is; a manifest dict validated first (ManifestError)
    build_view(manifest)   the view of a dict that already passed validate_manifest
    variants(view)         the package's variants: (archs, graph indices) per distinct graph set
    for_arch(view, arch)   the view of the variant that serves `arch` (default: the first arch)
"""

from __future__ import annotations

from typing import NamedTuple

from . import table
from .manifest import REGIONS, Symbol, validate_manifest


class Slot(NamedTuple):
    """`table.slots[index]` and where its words are among the table words."""
    index: int
    name: str
    role: str          # "input" | "output"
    offset: int        # bytes into the table, 16-aligned
    rank: int
    first_word: int    # index of its data-pointer word among the table words

    @property
    def words(self) -> int:
        return table.slot_words(self.rank)

    @property
    def nbytes(self) -> int:
        return table.slot_nbytes(self.rank)


class Table(NamedTuple):
    """The argument table: the slots, the extents (one int64 word per symbol, symbol k at
    `extents_offset + 8k`, table word `extents_first_word + k`) and the optional error word."""
    nbytes: int
    slots: tuple               # Slot, in slot order
    extents_offset: int
    extents_first_word: int    # = the number of slot words
    words: int                 # table words in all: slot words, then one per symbol
    errors_offset: int | None  # the index checks' error word (3.3); None: the table has none


class TensorSpec(NamedTuple):
    """An input or output. `shape` is the declared shape: per dim a size, a symbol name, or
    (outputs) a shape expression such as ["+", "n", 1]."""
    name: str
    dtype: str
    shape: tuple
    slot: int


class TensorEntry(NamedTuple):
    """A `weights` or `state` entry; `init` is "zeros" | "data" for state, None for weights."""
    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    init: str | None = None


class ArenaBuffer(NamedTuple):
    """An `arena_buffers` entry (informative: the memory plan); `first`/`last` may be None."""
    name: str
    offset: int
    nbytes: int
    first: int | None
    last: int | None


class Param(NamedTuple):
    name: str
    type: str          # a Triton type: "*fp32", "i64", ...


class Use(NamedTuple):
    """A node a kernel was compiled for (format 3.4, `kernels[i].compiled.uses[u]`): graph and node
    index (both None: the generate step), its grid, and per parameter what it was generated for:
    ("word", i) or (kind, bytes, ...) with kind weights | state | arena | slot | extents | errors |
    table (formats.crosscheck)."""
    graph: int | None
    node: int | None
    grid: tuple
    args: tuple


class KernelRecord(NamedTuple):
    """`kernels[i].compiled` (3.4): what the compiler built the kernel for. `table_words`: the
    table writer's int64 store positions, None for every other kernel."""
    nparams: int               # entry-point parameters, hidden ones included
    block: int                 # threads per block the code was generated for
    shared: int                # dynamic shared memory the binary needs, bytes
    waits: bool                # calls gdc_wait() before touching what other nodes write
    writes: tuple              # the parameters its code stores through
    table_words: tuple | None
    source: str | None         # the section of its source (None: not recorded)
    uses: tuple                # Use


class PlanBuffer(NamedTuple):
    """An arena buffer of a graph's memory plan (3.4, `graphs[i].compiled.buffers`): the bytes the
    plan reserves and the nodes from its first writer to its last reader."""
    name: str
    dtype: str
    offset: int
    nbytes: int
    first: int
    last: int


class Target(NamedTuple):
    """`graphs[i].compiled.target` (3.5): what a graph was planned for."""
    pdl: bool                  # its sources wait (gdc_wait) and it may have programmatic edges
    sm_count: int              # the multiprocessors its tile plans assume


class GraphRecord(NamedTuple):
    """`graphs[i].compiled` (3.4): per symbol the sizes (smallest, bound) the graph was lowered to
    serve, and its memory plan; (3.5) its target, None when not recorded."""
    bucket: dict               # symbol name -> (smallest, bound)
    buffers: tuple             # PlanBuffer
    target: Target | None = None


class Kernel(NamedTuple):
    """`kernels[i]` with its optional keys filled in."""
    name: str
    family: str | None
    params: tuple              # Param
    num_warps: int
    shared: int                # dynamic shared memory, bytes
    num_stages: int | None     # informative (the cubin is already built); None: not recorded
    hidden_params: int         # pointer parameters Triton appends after `params`; absent: 0
    global_scratch_size: int   # absent: 0
    profile_scratch_size: int  # absent: 0
    writes: tuple | None       # pointer parameters it stores through; None: unknown (3.2)
    binaries: dict             # arch -> section name
    source: str | None         # section name of the source
    source_sha256: str | None
    compiled: KernelRecord | None = None   # what it was compiled for (3.4); None: not recorded


class Arg(NamedTuple):
    """A node argument: a table word (`word` set, the rest unused) or a region range."""
    region: str | None
    offset: int = 0
    nbytes: int = 0
    dtype: str | None = None
    word: int | None = None


class Node(NamedTuple):
    kernel: int
    grid: tuple                # (x, y, z)
    deps: tuple
    programmatic: tuple        # the deps whose edges may be programmatic (3.2); absent: none
    label: str | None
    args: tuple                # Arg, one per kernel parameter


class Graph(NamedTuple):
    name: str
    bucket: dict               # symbol name -> bound
    arena: int                 # arena bytes this graph uses
    nodes: tuple               # Node, in execution order
    stats: dict                # informative; absent: {}
    compiled: GraphRecord | None = None    # what it was lowered for (3.4); None: not recorded
    archs: tuple = ()          # the archs whose variant it belongs to (3.5); absent key: all archs


class IndexCheck(NamedTuple):
    """An `index_checks` entry (3.3): `size` is a shape expression, `input` None for an index
    computed inside the model."""
    code: int
    input: str | None
    op: str
    where: str
    size: object


class Generate(NamedTuple):
    """The `generate` map; the state entries are named, `step` is a node without a graph."""
    tokens: str
    positions: str
    logits: str
    capacity: int
    decode_graph: int
    ctrl: str
    out_tokens: str
    next_token: str
    next_position: str
    step: Node


class Manifest(NamedTuple):
    format_version: tuple | None   # None only before write_package sets it
    archs: tuple
    producer: dict
    model: dict
    options: dict
    regions: dict                  # "weights", "arena", "table", "state" -> bytes
    symbols: tuple                 # formats.manifest.Symbol, in manifest order
    inputs: tuple                  # TensorSpec
    outputs: tuple                 # TensorSpec
    table: Table
    weights: tuple                 # TensorEntry
    state: tuple                   # TensorEntry
    arena_buffers: tuple           # ArenaBuffer
    kernels: tuple                 # Kernel
    graphs: tuple                  # Graph
    index_checks: tuple            # IndexCheck; empty: the package has none
    generate: Generate | None
    # 3.5: None for the whole package; for a variant's view (for_arch) the arch it was made for and,
    # per graph of the view, its index among the package's graphs
    arch: str | None = None
    graph_index: tuple | None = None


def as_view(manifest) -> Manifest:
    """`manifest` as a Manifest: a Manifest as it is, a dict after validate_manifest (without the
    section checks, which need the package: read_package runs those)."""
    if isinstance(manifest, Manifest):
        return manifest
    validate_manifest(manifest)
    return build_view(manifest)


def build_view(m: dict) -> Manifest:
    """The view of a manifest that passed validate_manifest. Nothing is checked here."""
    fv = m.get("format_version")
    return Manifest(
        format_version=tuple(fv) if fv is not None else None,
        archs=tuple(m["archs"]),
        producer=dict(m.get("producer", {})),
        model=dict(m.get("model", {})),
        options=dict(m.get("options", {})),
        regions={r: m["regions"][r] for r in REGIONS},   # unknown keys are ignored (SPEC §3)
        symbols=tuple(Symbol(i, s["name"], s["kind"], s["min"], s["max"], tuple(map(tuple, s["sources"])))
                      for i, s in enumerate(m["symbols"])),
        inputs=tuple(_io(e) for e in m["inputs"]),
        outputs=tuple(_io(e) for e in m["outputs"]),
        table=_table(m["table"], len(m["symbols"])),
        weights=tuple(_tensor(e) for e in m["weights"]),
        state=tuple(_tensor(e) for e in m["state"]),
        arena_buffers=tuple(ArenaBuffer(b["name"], b["offset"], b["nbytes"], b.get("first"), b.get("last"))
                            for b in m.get("arena_buffers", ())),
        kernels=tuple(_kernel(k) for k in m["kernels"]),
        graphs=tuple(Graph(g["name"], dict(g["bucket"]), g["arena"], tuple(_node(n) for n in g["nodes"]),
                           dict(g.get("stats", {})), _graph_record(g.get("compiled")),
                           tuple(g.get("archs", m["archs"])))
                     for g in m["graphs"]),
        index_checks=tuple(IndexCheck(c["code"], c["input"], c["op"], c["where"], c["size"])
                           for c in m.get("index_checks", ())),
        generate=_generate(m["generate"]) if "generate" in m else None,
    )


def _table(t: dict, n_symbols: int) -> Table:
    ranks = [s["rank"] for s in t["slots"]]
    slots = tuple(Slot(i, s["name"], s["role"], s["offset"], s["rank"], first)
                  for i, (s, first) in enumerate(zip(t["slots"], table.first_words(ranks))))
    errors = t.get("errors")
    return Table(t["nbytes"], slots, t["extents"]["offset"], table.word_count(ranks),
                 table.word_count(ranks, n_symbols), None if errors is None else errors["offset"])


def _io(e: dict) -> TensorSpec:
    return TensorSpec(e["name"], e["dtype"], tuple(e["shape"]), e["slot"])


def _tensor(e: dict) -> TensorEntry:
    return TensorEntry(e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"], e.get("init"))


def _kernel(k: dict) -> Kernel:
    writes = k.get("writes")
    return Kernel(
        name=k["name"], family=k.get("family"),
        params=tuple(Param(p["name"], p["type"]) for p in k["params"]),
        num_warps=k["num_warps"], shared=k["shared"], num_stages=k.get("num_stages"),
        hidden_params=k.get("hidden_params", 0),
        global_scratch_size=k.get("global_scratch_size", 0),
        profile_scratch_size=k.get("profile_scratch_size", 0),
        writes=None if writes is None else tuple(writes),
        binaries=dict(k["binaries"]), source=k.get("source"), source_sha256=k.get("source_sha256"),
        compiled=_kernel_record(k.get("compiled")))


def _kernel_record(r: dict | None) -> KernelRecord | None:
    if r is None:
        return None
    words = r.get("table_words")
    return KernelRecord(r["nparams"], r["block"], r["shared"], r["waits"], tuple(r["writes"]),
                        None if words is None else tuple(words), r.get("source"),
                        tuple(Use(u["graph"], u["node"], tuple(u["grid"]),
                                  tuple(tuple(tuple(x) if isinstance(x, list) else x for x in d)
                                        for d in u["args"])) for u in r["uses"]))


def _graph_record(r: dict | None) -> GraphRecord | None:
    if r is None:
        return None
    target = r.get("target")
    return GraphRecord({name: tuple(pair) for name, pair in r["bucket"].items()},
                       tuple(PlanBuffer(b["name"], b["dtype"], b["offset"], b["nbytes"], b["first"],
                                        b["last"]) for b in r["buffers"]),
                       None if target is None else Target(target["pdl"], target["sm_count"]))


def _arg(a: dict) -> Arg:
    if "word" in a:
        return Arg(None, word=a["word"])
    return Arg(a["region"], a["offset"], a["nbytes"], a.get("dtype"))


def _node(n: dict) -> Node:
    return Node(n["kernel"], tuple(n["grid"]), tuple(n["deps"]), tuple(n.get("programmatic", ())),
                n.get("label"), tuple(_arg(a) for a in n["args"]))


def _generate(g: dict) -> Generate:
    return Generate(g["tokens"], g["positions"], g["logits"], g["capacity"], g["decode_graph"],
                    g["ctrl"], g["out_tokens"], g["next_token"], g["next_position"], _node(g["step"]))


def _input_key(m: Manifest, g: Graph) -> tuple:
    """A graph's bounds of the input symbols: what selection compares (SPEC §5.1 rule 2)."""
    return tuple(g.bucket[s.name] for s in m.symbols if s.kind == "input")


def variants(manifest) -> list[tuple[tuple, tuple]]:
    """The package's variants (3.5): per distinct set of graphs, (the archs it serves, in `archs`
    order; the indices of its graphs), in the order of their first arch. A package without
    `graphs[i].archs` has one variant, every arch and every graph."""
    m = as_view(manifest)
    found: dict[tuple, list] = {}
    for arch in m.archs:
        graphs = tuple(i for i, g in enumerate(m.graphs) if arch in g.archs)
        found.setdefault(graphs, []).append(arch)
    return [(tuple(archs), graphs) for graphs, archs in found.items()]


def for_arch(manifest, arch: str | None = None) -> Manifest:
    """The view of the variant that serves `arch` (one of `archs`; None: the first): its graphs
    only, renumbered from 0 in manifest order (`graph_index[i]` is graph i's index in the package),
    and `generate.decode_graph` the variant's graph of the decode bucket (the bucket of the
    package's `decode_graph`; every arch serves the same buckets, SPEC §3.5). The kernels, their
    indices and every other field are the package's. Choosing a graph (formats.shapes.select_graph,
    runtime.calls.ShapePlan) on this view is SPEC §5.1 rule 2 for a GPU of that arch. A view that
    is already a variant's is returned as it is for its own arch; ValueError for an arch the
    package does not list."""
    m = as_view(manifest)
    if m.arch is not None:
        if arch not in (None, m.arch):
            raise ValueError(f"this view is the {m.arch} variant already; take for_arch of the "
                             f"package's view for {arch}")
        return m
    arch = m.archs[0] if arch is None else arch
    if arch not in m.archs:
        raise ValueError(f"the package has no variant for {arch} (its archs: {', '.join(m.archs)})")
    index = tuple(i for i, g in enumerate(m.graphs) if arch in g.archs)
    gen = m.generate
    if gen is not None:
        want = _input_key(m, m.graphs[gen.decode_graph])
        local = next(j for j, i in enumerate(index) if _input_key(m, m.graphs[i]) == want)
        gen = gen._replace(decode_graph=local)
    return m._replace(graphs=tuple(m.graphs[i] for i in index), generate=gen, arch=arch,
                      graph_index=index)


__all__ = ["Manifest", "Table", "Slot", "TensorSpec", "TensorEntry", "ArenaBuffer", "Param", "Kernel",
           "KernelRecord", "Use", "Arg", "Node", "Graph", "GraphRecord", "Target", "PlanBuffer",
           "IndexCheck", "Generate", "Symbol", "as_view", "build_view", "variants", "for_arch"]
