"""The manifest checked against what its kernels were compiled for (format 3.4, SPEC.md §3.4).

`validate_manifest` proves a manifest consistent with itself: every range inside its region, every
reference resolvable. That leaves edits that stay consistent and still break the program: a grid
enlarged, an offset moved inside the arena, a table-writer word index changed, a bucket bound
raised, `hidden_params` lowered, an input's shape narrowed, a node pointed at another kernel of
the same parameter count. Nothing in a 3.3 manifest says what the kernels were built for, so
nothing could tell these from the truth.

Format 3.4 adds the compiler's records (written by grace.aot.manifest):

    kernels[i].compiled   nparams (the entry point's parameters, hidden ones included), block
                          (threads per block the code was generated for), shared (the dynamic
                          shared memory the binary needs), waits (the code waits, gdc_wait, before
                          touching what other nodes write), writes (the parameters its code stores
                          through, what the race proof relies on), source (its source section,
                          what the CPU executor runs), table_words (the table writer only:
                          where it stores each word) and uses: every node it was compiled for, with
                          its grid and, per parameter, the buffer it was generated for and the bytes
                          it may touch through it
    graphs[i].compiled    bucket (per symbol the sizes [smallest, bound] the graph was lowered to
                          serve) and buffers (its memory plan: each arena buffer's bytes and the
                          nodes from its first writer to its last reader)

and `check_records` checks every node against them: the kernel it runs, its grid, every argument's
region, start, bytes and element type against the buffer the kernel was generated for (a weights
or state entry, an arena buffer of the plan, an I/O slot, the extents, the error word, the whole
table), I/O dtypes and shapes against the shapes each graph was compiled for, bucket bounds and
symbol minimums, `hidden_params`, `num_warps` and `shared` against the kernel's record, the table
writer's word positions recomputed from the slot layout (formats.table) and its word arguments, and
the memory plan itself (no two buffers that are live at once share a byte).

Records are evidence of consistency, not of origin: whoever can rewrite the manifest can rewrite
them too (authenticity is the signature's job). They make every single edit of a launch-relevant
field contradict something else the compiler wrote, and the runtime checks the records' ABI facts
against the cubin itself at load (grace.runtime.abi).

A package has records for every kernel and graph or for none: deleting one record is refused, and
a package without records (3.3, or a handmade 3.4 one) is checked as before (SPEC §6).

Format 3.5 (per-arch variants, SPEC §3.5) adds two rules: a kernel whose record says it waits
(gdc_wait, griddepcontrol) has no binary for an arch before sm_90, which has no griddepcontrol (C9);
and a graph's optional `compiled.target` ({pdl, sm_count}: what the graph was planned for) is
well-formed, pdl only for sm_90+ archs, and a graph with programmatic deps was planned with pdl
(C10).
"""

from __future__ import annotations

import bisect
import heapq

from . import archs as arch_rules
from . import limits
from .dtypes import DTYPES, POINTER_TYPES
from .errors import ManifestError
from .shapes import eval_shape_expr, format_shape_expr
from .table import WORD_NBYTES, slot_nbytes, word_positions

TABLE_KINDS = ("slot", "extents", "errors", "table")     # descriptors of table ranges
NAMED_KINDS = ("weights", "state", "arena")              # descriptors naming a buffer
PLAN_ALIGN = 16   # pointer parameters are compiled assuming 16-byte alignment (tt.divisibility)
_WORD_TYPES = ("i64", "i32")


def _fail(path: str, msg: str):
    raise ManifestError(f"{path}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v, path: str, lo: int = 0, hi: int = limits.I64_MAX) -> int:
    if not _is_int(v):
        _fail(path, f"expected an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        _fail(path, f"{v} is outside [{lo}, {hi}]")
    return v


def _list(v, path: str, most: int | None = None) -> list:
    if not isinstance(v, list):
        _fail(path, f"expected a list, got {type(v).__name__}")
    if most is not None and len(v) > most:
        _fail(path, f"{len(v)} entries, above the limit of {most}")
    return v


def _dict(v, path: str) -> dict:
    if not isinstance(v, dict):
        _fail(path, f"expected a map, got {type(v).__name__}")
    return v


def _get(d: dict, key: str, path: str):
    if key not in d:
        _fail(path, f"missing required key {key!r}")
    return d[key]


def has_records(m: dict) -> bool:
    """Whether the (schema-valid) manifest carries the compiler's records (format 3.4)."""
    return any("compiled" in k for k in m["kernels"]) or any("compiled" in g for g in m["graphs"])


def check_records(m: dict, symbols: dict) -> None:
    """Raise ManifestError (naming the field) unless every node of `m` agrees with the records.

    `m` passed the rest of validate_manifest; `symbols`: its formats.manifest.Symbol by name.
    A manifest without records is left alone (a 3.3 package: the checks here are skipped)."""
    kernels, graphs = m["kernels"], m["graphs"]
    if not has_records(m):
        return
    for key, entries in (("kernels", kernels), ("graphs", graphs)):
        for i, e in enumerate(entries):
            if "compiled" not in e:
                _fail(f"{key}[{i}]", "no `compiled` record, but other kernels or graphs have one: "
                                     "a package has records for every kernel and graph or for none")
    records = [_kernel_record(k, i) for i, k in enumerate(kernels)]
    seen: dict = {}
    for k, rec in enumerate(records):
        for u, use in enumerate(rec["uses"]):
            up = f"kernels[{k}].compiled.uses[{u}]"
            key = _use_key(use, up)
            if key in seen:
                _fail(up, f"names {_node_path(key)} again (also {seen[key][2]})")
            seen[key] = (k, use, up)
    # every node is one its kernel was compiled for (a node dropped, added, moved or pointed at
    # another kernel shows here), and every recorded node exists
    nodes = [((g, j), node, f"graphs[{g}].nodes[{j}]") for g, graph in enumerate(graphs)
             for j, node in enumerate(graph["nodes"])]
    if "generate" in m:
        nodes.append(((None, None), m["generate"]["step"], "generate.step"))
    uses = {}
    for key, node, p in nodes:
        uses[key] = _compiled_for(seen.pop(key, None), node, p, kernels)
    for key, (_, _, up) in seen.items():
        _fail(up, f"names {_node_path(key)}, which the package does not have")
    plans = [_graph_record(g, i, symbols, tuple(g.get("archs", m["archs"])))
             for i, g in enumerate(graphs)]
    ctx = _Context(m, symbols, plans)
    for key, node, p in nodes:
        _node(ctx, key, node, p, kernels, records, uses[key])
    _table_writer(m, records)


# --- records, on their own ------------------------------------------------------------------------

def _kernel_record(k: dict, i: int) -> dict:
    """`kernels[i].compiled`, with the kernel's own launch fields checked against it."""
    p = f"kernels[{i}]"
    rp = f"{p}.compiled"
    rec = _dict(k["compiled"], rp)
    params = k["params"]
    nparams = _int(_get(rec, "nparams", rp), f"{rp}.nparams", hi=limits.MAX_KERNEL_PARAMS)
    hidden = k.get("hidden_params", 0)
    if len(params) + hidden != nparams:
        _fail(f"{p}.hidden_params", f"{hidden} hidden parameters after {len(params)} listed ones, but "
                                    f"{k['name']} was compiled with {nparams} parameters in all "
                                    f"(so {nparams - len(params)} hidden ones)")
    block = _int(_get(rec, "block", rp), f"{rp}.block", lo=1, hi=1024)
    if 32 * k["num_warps"] != block:
        _fail(f"{p}.num_warps", f"{k['num_warps']} warps ({32 * k['num_warps']} threads), but "
                                f"{k['name']} was generated for blocks of {block} threads")
    shared = _int(_get(rec, "shared", rp), f"{rp}.shared", hi=limits.MAX_SHARED_NBYTES)
    if k["shared"] < shared:
        _fail(f"{p}.shared", f"{k['shared']} bytes of dynamic shared memory, but {k['name']}'s "
                             f"binary needs {shared}")
    waits = _get(rec, "waits", rp)
    if not isinstance(waits, bool):
        _fail(f"{rp}.waits", f"expected a bool, got {type(waits).__name__}")
    if waits:   # C9 (3.5): griddepcontrol exists from sm_90; ptxas rejects it before
        early = sorted(a for a in k["binaries"] if not arch_rules.supports_pdl(a))
        if early:
            _fail(f"{p}.binaries", f"a binary for {early[0]}, but {k['name']} waits for its upstream "
                                   "kernels (gdc_wait, griddepcontrol), which that arch does not have")
    if "writes" not in k:   # the race proof (SPEC §5.3) must not be switched off by a deletion
        _fail(f"{p}.writes", "missing: a kernel with a compiled record declares the pointer "
                             "parameters it stores through (the race check needs them)")
    writes = _list(_get(rec, "writes", rp), f"{rp}.writes", len(params))
    for w_i, w in enumerate(writes):
        _int(w, f"{rp}.writes[{w_i}]", hi=max(len(params) - 1, 0))
    if sorted(k["writes"]) != sorted(writes):
        _fail(f"{p}.writes", f"{list(k['writes'])}, but {k['name']}'s code stores through parameters "
                             f"{writes} (the race proof would judge other accesses)")
    if "source" in rec:   # the CPU executor runs the source: it must be this kernel's own
        if not isinstance(rec["source"], str):
            _fail(f"{rp}.source", f"expected a str, got {type(rec['source']).__name__}")
        if "source" in k and k["source"] != rec["source"]:
            _fail(f"{p}.source", f"{k['source']!r}, but {k['name']}'s source is {rec['source']!r}")
    if "table_words" in rec:
        words = _list(rec["table_words"], f"{rp}.table_words", len(params))
        for w_i, w in enumerate(words):
            _int(w, f"{rp}.table_words[{w_i}]")
    uses = _list(_get(rec, "uses", rp), f"{rp}.uses")
    for u, use in enumerate(uses):
        up = f"{rp}.uses[{u}]"
        _dict(use, up)
        grid = _list(_get(use, "grid", up), f"{up}.grid")
        if len(grid) != 3:
            _fail(f"{up}.grid", f"expected 3 dimensions, got {len(grid)}")
        for d, x in enumerate(grid):
            _int(x, f"{up}.grid[{d}]", lo=1, hi=limits.MAX_GRID[d])
        args = _list(_get(use, "args", up), f"{up}.args")
        if len(args) != len(params):
            _fail(f"{p}.params", f"{len(params)} parameters, but {k['name']} was compiled with "
                                 f"{len(args)} (record {up})")
        for a, (desc, prm) in enumerate(zip(args, params)):
            _descriptor(desc, prm, f"{up}.args[{a}]", f"{p}.params[{a}].type")
    return rec


def _descriptor(desc, prm: dict, path: str, type_path: str) -> None:
    """One parameter of a use: ["word", i] for an integer parameter, else [kind, bytes, ...]."""
    _list(desc, path, 5)
    if not desc or not isinstance(desc[0], str):
        _fail(path, "expected [kind, ...] with a kind string")
    kind, pointer = desc[0], prm["type"].startswith("*")
    if kind == "word":
        if len(desc) != 2:
            _fail(path, "expected ['word', index]")
        _int(desc[1], f"{path}[1]")
        if prm["type"] not in _WORD_TYPES:
            _fail(type_path, f"{prm['type']!r}, but the kernel was compiled with an integer "
                             f"parameter here ({'/'.join(_WORD_TYPES)})")
        return
    if kind not in NAMED_KINDS + TABLE_KINDS:
        _fail(f"{path}[0]", f"unknown kind {kind!r}")
    if not pointer:
        _fail(type_path, f"{prm['type']!r}, but the kernel was compiled with a pointer parameter "
                         f"here (to a {kind} buffer)")
    if len(desc) < 2:
        _fail(path, f"expected [{kind!r}, bytes, ...]")
    _int(desc[1], f"{path}[1]", hi=limits.MAX_REGION_NBYTES)
    if kind in NAMED_KINDS or kind == "slot":
        if len(desc) < 3 or not isinstance(desc[2], str):
            _fail(path, f"expected [{kind!r}, bytes, name, ...]")
    if kind == "slot" and len(desc) >= 4:
        if not isinstance(desc[3], str) or desc[3] not in DTYPES:
            _fail(f"{path}[3]", f"unknown dtype {desc[3]!r}")
        if len(desc) == 5:
            for d_i, d in enumerate(_list(desc[4], f"{path}[4]", limits.MAX_RANK)):
                _int(d, f"{path}[4][{d_i}]")


def _graph_record(g: dict, gi: int, symbols: dict, archs: tuple = ()) -> dict:
    """`graphs[gi].compiled`: its bucket against the graph's and the symbols' declared ranges, and
    its memory plan proven sound: buffers inside the graph's arena, 16-byte aligned, and no two of
    them that are live at the same node sharing a byte. Returns {"buffers": {name: buffer},
    "bucket": {symbol: bound}} for the node checks."""
    gp = f"graphs[{gi}]"
    rp = f"{gp}.compiled"
    rec = _dict(g["compiled"], rp)
    bucket = _dict(_get(rec, "bucket", rp), f"{rp}.bucket")
    if set(bucket) != set(symbols):
        _fail(f"{rp}.bucket", f"names {sorted(bucket)}, but the symbols are {sorted(symbols)}")
    for name, sym in symbols.items():
        bp = f"{rp}.bucket.{name}"
        pair = _list(bucket[name], bp)
        if len(pair) != 2:
            _fail(bp, "expected [smallest, bound]")
        lo, bound = _int(pair[0], f"{bp}[0]"), _int(pair[1], f"{bp}[1]")
        if g["bucket"][name] != bound:
            _fail(f"{gp}.bucket.{name}", f"{g['bucket'][name]}, but the graph was compiled for "
                                         f"{name} up to {bound}")
        if sym.min < lo:
            _fail(f"symbols[{sym.index}].min", f"{sym.min}, but {gp} was compiled for {name} "
                                               f"from {lo}")
    n_nodes = len(g["nodes"])
    buffers: dict[str, dict] = {}
    spans = []
    for b_i, b in enumerate(_list(_get(rec, "buffers", rp), f"{rp}.buffers", limits.MAX_TENSORS)):
        bp = f"{rp}.buffers[{b_i}]"
        _dict(b, bp)
        name = _get(b, "name", bp)
        if not isinstance(name, str):
            _fail(f"{bp}.name", f"expected a str, got {type(name).__name__}")
        if name in buffers:
            _fail(f"{bp}.name", f"duplicate arena buffer {name!r}")
        dtype = _get(b, "dtype", bp)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            _fail(f"{bp}.dtype", f"unknown dtype {dtype!r}")
        off = _int(_get(b, "offset", bp), f"{bp}.offset")
        if off % PLAN_ALIGN:
            _fail(f"{bp}.offset", f"{off} is not {PLAN_ALIGN}-aligned (kernels assume it)")
        nbytes = _int(_get(b, "nbytes", bp), f"{bp}.nbytes")
        if off + nbytes > g["arena"]:
            _fail(bp, f"arena range [{off}, {off + nbytes}) exceeds the graph's arena "
                      f"({g['arena']} bytes)")
        first = _int(_get(b, "first", bp), f"{bp}.first", hi=max(n_nodes - 1, 0))
        last = _int(_get(b, "last", bp), f"{bp}.last", lo=first, hi=max(n_nodes - 1, 0))
        buffers[name] = {"path": bp, "dtype": dtype, "start": off, "end": off + nbytes,
                         "first": first, "last": last}
        if nbytes:
            spans.append((first, off, off + nbytes, last, bp))
    _live_disjoint(spans)
    if "target" in rec:
        _target(rec["target"], g, gp, archs)
    return {"buffers": buffers, "bucket": {n: bucket[n][1] for n in symbols}}


def _target(target, g: dict, gp: str, archs: tuple) -> None:
    """`graphs[gi].compiled.target` (3.5, optional): what the graph was planned for, `pdl` (its
    sources wait and it may have programmatic edges) and `sm_count` (the multiprocessors its tile
    plans assume). C10: pdl only for archs with griddepcontrol; programmatic deps only with pdl."""
    tp = f"{gp}.compiled.target"
    _dict(target, tp)
    pdl = _get(target, "pdl", tp)
    if not isinstance(pdl, bool):
        _fail(f"{tp}.pdl", f"expected a bool, got {type(pdl).__name__}")
    _int(_get(target, "sm_count", tp), f"{tp}.sm_count", lo=1, hi=arch_rules.MAX_SM_COUNT)
    if pdl:
        early = [a for a in archs if not arch_rules.supports_pdl(a)]
        if early:
            _fail(f"{tp}.pdl", f"true, but the graph serves {early[0]}, which has no programmatic "
                               "dependent launch")
    else:
        for j, node in enumerate(g["nodes"]):
            if node.get("programmatic"):
                _fail(f"{gp}.nodes[{j}].programmatic", f"programmatic deps, but the graph was planned "
                                                       f"without pdl ({tp}.pdl)")


def _live_disjoint(spans: list) -> None:
    """No two buffers that are live at one node share a byte. Sweep over first nodes, keeping the
    live buffers sorted by offset: they are pairwise disjoint, so a new one only needs checking
    against its two neighbours. O(n log n) whatever the plan."""
    live: list = []      # (start, end, path) of the live buffers, sorted by start
    expiry: list = []    # heap of (last, start, end, path)
    for first, start, end, last, path in sorted(spans):
        while expiry and expiry[0][0] < first:
            _, s, e, pth = heapq.heappop(expiry)
            del live[bisect.bisect_left(live, (s, e, pth))]
        at = bisect.bisect_left(live, (start, end, path))
        for neighbour in live[max(at - 1, 0):at + 1]:
            if neighbour[0] < end and start < neighbour[1]:
                _fail(path, f"bytes [{start}, {end}) overlap {neighbour[2]} [{neighbour[0]}, "
                            f"{neighbour[1]}) while both are live")
        live.insert(at, (start, end, path))
        heapq.heappush(expiry, (last, start, end, path))


# --- nodes against their kernel's record ----------------------------------------------------------

class _Context:
    """What resolving descriptors needs, built once per manifest."""

    def __init__(self, m: dict, symbols: dict, plans: list):
        self.m, self.symbols, self.plans = m, symbols, plans
        self.entries = {key: {e["name"]: (i, e) for i, e in enumerate(m[key])} for key in ("weights", "state")}
        self.io = {e["name"]: (f"{key}[{i}]", e) for key in ("inputs", "outputs")
                   for i, e in enumerate(m[key])}
        self._shapes: dict = {}

    def io_shape(self, name: str, g: int) -> tuple:
        """The shape of I/O tensor `name` at graph g's bucket (every symbol at its bound)."""
        key = (name, g)
        if key not in self._shapes:
            path, e = self.io[name]
            values = self.plans[g]["bucket"]
            dims = []
            for d_i, d in enumerate(e["shape"]):
                try:
                    dims.append(eval_shape_expr(d, values))
                except ManifestError as err:
                    _fail(f"{path}.shape[{d_i}]", f"{format_shape_expr(d)!r} at graphs[{g}]'s bucket: {err}")
            self._shapes[key] = tuple(dims)
        return self._shapes[key]


def _use_key(use: dict, up: str) -> tuple:
    """(graph, node) a use names; (None, None) is the generate step."""
    g, n = _get(use, "graph", up), _get(use, "node", up)
    if g is None and n is None:
        return None, None
    return _int(g, f"{up}.graph"), _int(n, f"{up}.node")


def _node_path(key: tuple) -> str:
    return "generate.step" if key[0] is None else f"graphs[{key[0]}].nodes[{key[1]}]"


def _compiled_for(entry, node: dict, p: str, kernels: list) -> dict:
    """The use of the kernel `node` runs that names this node; ManifestError when no kernel was
    compiled for it or another one was."""
    k = node["kernel"]
    if entry is None:
        _fail(f"{p}.kernel", f"kernel {k} ({kernels[k]['name']}) was not compiled for this node "
                             "(no kernel's record lists it)")
    compiled_for, use, up = entry
    if compiled_for != k:
        _fail(f"{p}.kernel", f"{k} ({kernels[k]['name']}), but the node was compiled for kernel "
                             f"{compiled_for} ({kernels[compiled_for]['name']}, {up})")
    return use


def _node(ctx: _Context, key: tuple, node: dict, p: str, kernels: list, records: list,
          use: dict) -> None:
    k = node["kernel"]
    rec = records[k]
    if list(node["grid"]) != list(use["grid"]):
        _fail(f"{p}.grid", f"{list(node['grid'])}, but {kernels[k]['name']} was compiled for grid "
                           f"{list(use['grid'])} here")
    if node.get("programmatic") and not rec["waits"]:
        _fail(f"{p}.programmatic", f"programmatic deps {node['programmatic']}, but "
                                   f"{kernels[k]['name']} does not wait for its upstream kernels "
                                   "(compiled without gdc_wait)")
    g, j = key
    for a, (arg, desc, prm) in enumerate(zip(node["args"], use["args"], kernels[k]["params"])):
        _arg(ctx, arg, desc, prm, f"{p}.args[{a}]", g, j, f"kernels[{k}].params[{a}].type", a)


def _arg(ctx: _Context, arg: dict, desc: list, prm: dict, p: str, g, j, type_path: str,
         index: int) -> None:
    kind = desc[0]
    if kind == "word":
        if "word" not in arg:
            _fail(p, f"a {arg.get('region')} range, but the kernel was compiled to receive table "
                     f"word {desc[1]} here")
        if arg["word"] != desc[1]:
            _fail(f"{p}.word", f"{arg['word']}, but the kernel was compiled to receive table word "
                               f"{desc[1]} here")
        return
    region = "table" if kind in TABLE_KINDS else kind
    if arg.get("region") != region:
        got = "a table word" if "word" in arg else f"region {arg.get('region')!r}"
        _fail(f"{p}.region" if "region" in arg else p,
              f"{got}, but the kernel was compiled for {_what(desc)} here (region {region!r})")
    start, end, dtype, what = _resolve(ctx, desc, p, g, j)
    off, nbytes = arg["offset"], arg["nbytes"]
    if off != start:
        _fail(f"{p}.offset", f"{off}, but the kernel was compiled for {what}, which starts at {start}")
    if off + nbytes > end:
        _fail(f"{p}.nbytes", f"{nbytes} bytes reach past {what} [{start}, {end})")
    if nbytes < desc[1]:
        _fail(f"{p}.nbytes", f"{nbytes} bytes, but the kernel may touch {desc[1]} through parameter "
                             f"{index} ({what})")
    want = "*i64" if region == "table" else POINTER_TYPES[dtype]
    if prm["type"] != want:
        _fail(type_path, f"{prm['type']!r}, but the parameter points to {what} ({want})")


def _what(desc: list) -> str:
    kind = desc[0]
    if kind in NAMED_KINDS:
        return f"{kind} buffer {desc[2]!r}" if kind == "arena" else f"{kind} entry {desc[2]!r}"
    if kind == "slot":
        return f"the table slot of {desc[2]!r}"
    return {"extents": "the extents words", "errors": "the error word", "table": "the whole table"}[kind]


def _resolve(ctx: _Context, desc: list, p: str, g, j) -> tuple:
    """(start, end, dtype, description) of the buffer a descriptor names, checked against what the
    manifest declares for it (an I/O tensor's dtype and shape at this graph's bucket; an arena
    buffer live at this node)."""
    m, kind, what = ctx.m, desc[0], _what(desc)
    if kind in ("weights", "state"):
        hit = ctx.entries[kind].get(desc[2])
        if hit is None:
            _fail(p, f"the kernel was compiled for {what}, which the package does not declare")
        _, e = hit
        return e["offset"], e["offset"] + e["nbytes"], e["dtype"], what
    if kind == "arena":
        if g is None:
            _fail(p, f"the kernel was compiled for {what}, but generate.step has no arena")
        b = ctx.plans[g]["buffers"].get(desc[2])
        if b is None:
            _fail(p, f"the kernel was compiled for {what}, which graphs[{g}]'s memory plan does not hold")
        if not b["first"] <= j <= b["last"]:
            _fail(p, f"{what} is live from node {b['first']} to node {b['last']} ({b['path']}), "
                     f"not at node {j}")
        return b["start"], b["end"], b["dtype"], what
    table = m["table"]
    if kind == "slot":
        hit = ctx.io.get(desc[2])
        if hit is None:
            _fail(p, f"the kernel was compiled for {what}, which is not an input or output")
        io_path, e = hit
        if len(desc) >= 4 and e["dtype"] != desc[3]:
            _fail(f"{io_path}.dtype", f"{e['dtype']}, but the kernels were compiled for {desc[3]}")
        if len(desc) == 5 and g is not None:
            shape = ctx.io_shape(desc[2], g)
            if list(shape) != list(desc[4]):
                _fail(f"{io_path}.shape", f"{_shape_text(e['shape'])} is {list(shape)} at graphs[{g}]'s "
                                          f"bucket, but its kernels were compiled for {list(desc[4])}")
        slot = table["slots"][e["slot"]]
        return slot["offset"], slot["offset"] + slot_nbytes(slot["rank"]), "int64", what
    if kind == "extents":
        ext = table["extents"]
        return ext["offset"], ext["offset"] + WORD_NBYTES * ext["count"], "int64", what
    if kind == "errors":
        if "errors" not in table:
            _fail(p, "the kernel was compiled to report index checks, but the table has no error "
                     "word (table.errors)")
        if not m.get("index_checks"):   # the runtime reads the word only for listed checks
            _fail("index_checks", "none listed, but kernels were compiled to report index checks "
                                  f"into the error word ({p}): nothing would ever read it")
        return table["errors"]["offset"], table["errors"]["offset"] + WORD_NBYTES, "int64", what
    return 0, table["nbytes"], "int64", what


def _shape_text(shape) -> str:
    return "[" + ", ".join(format_shape_expr(d) for d in shape) + "]"


# --- the table writer -----------------------------------------------------------------------------

def _table_writer(m: dict, records: list) -> None:
    """Node 0 of every graph is the table writer, which stores word i at the position the slot
    layout gives it: the positions are recomputed here (formats.table) from table.slots and
    table.extents and compared with the ones the writer was compiled with."""
    table = m["table"]
    expected = word_positions([(s["offset"], s["rank"]) for s in table["slots"]],
                              table["extents"]["offset"], table["extents"]["count"])
    checked = set()
    for g, graph in enumerate(m["graphs"]):
        nodes = graph["nodes"]
        k = nodes[0]["kernel"] if nodes else None
        if k is None or "table_words" not in records[k]:
            _fail(f"graphs[{g}].nodes[0]", "is not the table writer (its kernel's record has no "
                                           "table_words): nothing would write the table words "
                                           "before the graph's kernels read them")
        if k in checked:
            continue
        checked.add(k)
        words = records[k]["table_words"]
        kp = f"kernels[{k}].compiled.table_words"
        if len(words) != len(expected) or len(m["kernels"][k]["params"]) != 1 + len(expected):
            _fail(kp, f"{len(words)} words, but the table layout has {len(expected)}")
        for u, use in enumerate(records[k]["uses"]):   # parameter 1 + i receives table word i
            args = use["args"]
            if args[0][0] != "table" or [list(d) for d in args[1:]] != [["word", i] for i in range(len(expected))]:
                _fail(f"kernels[{k}].compiled.uses[{u}].args", "the table writer takes the whole "
                      "table, then table words 0, 1, ... in order")
        slot_words = len(expected) - table["extents"]["count"]
        for i, (got, want) in enumerate(zip(words, expected)):
            if got != want:
                where = "table.slots" if i < slot_words else "table.extents"
                _fail(where, f"the layout puts table word {i} at int64 {want}, but the table writer "
                             f"(kernels[{k}]) was compiled to store it at {got} ({kp}[{i}])")
