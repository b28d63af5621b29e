"""`grace inspect`: what is inside a `.grace` package.

`describe(package)` turns a package (from `grace.formats.read_package`) into a plain JSON-able dict;
the keys are documented in docs/inspect.md and are stable within a format major version.
`render(description, console)` prints that dict as rich tables for people.
`kernel_source(package, name)` is one kernel's source text (`grace inspect --source NAME`).

A package with dynamic dimensions holds one graph per shape bucket: the description lists the
symbols (dynamic dimensions), the buckets each symbol is split into, and one row per graph with its
bounds and what it costs (kernels, arena bytes, and whatever numeric `stats` the compiler
recorded), so the price of the bucket policy is visible without running.

Every per-graph figure is counted from that graph's own manifest entry (its nodes, its arena, its
memory plan `graphs[i].compiled.buffers`), never from another graph's or from the package-wide
lists: the manifest's top-level `arena_buffers` is one graph's plan (grace's compiler writes the
first graph's, the smallest bucket) while `regions.arena` is the largest graph's, so showing them
side by side compared two different graphs. Figures over all graphs are in `totals`, labelled as
such: kernels launched are summed over graphs, distinct kernels are a union (fewer than the sum:
graphs share kernels), the arena is the largest graph's (a session has one, sized for it).
`kernels`/`unique_kernels` of a graph count its kernel launches, the table writer (node 0 of every
graph, SPEC §5) not included, which is what grace's compiler records in `stats`; `nodes` includes it.

The manifest is read through grace.formats.view (validated, optional keys at their SPEC defaults).
Imports no torch and no numpy: only grace.formats (msgpack; it parses the safetensors layout of
the weights itself, and inspect never decodes them) and rich for `render`.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Mapping

from grace.formats.shapes import format_shape_expr

__all__ = ["describe", "render", "human_bytes", "kernel_source", "KernelSourceError"]

TOP_ARENA_BUFFERS = 10


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _version_str(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ".".join(str(x) for x in v)
    return str(v)


def _version_list(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [int(x) if isinstance(x, int) else x for x in v]
    return v


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x).hex()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def describe(package, path: str | os.PathLike | None = None, verified: bool = True) -> dict:
    """A JSON-able description of a package from `grace.formats.read_package` (see docs/inspect.md
    for the keys). It reads the manifest through its validated view (`package.view`). `verified`:
    the package was read with verify=True (its sections hashed), which a valid signature needs to
    cover every byte; with False the signature entry says so."""
    m = package.view
    path = path if path is not None else package.path

    # --- I/O and the argument table ---------------------------------------------------------------
    table_slots = [{"slot": s.index, "name": s.name, "role": s.role, "offset": s.offset, "rank": s.rank,
                    "first_word": s.first_word, "words": s.words} for s in m.table.slots]
    extents = {"offset": m.table.extents_offset, "count": len(m.symbols),
               "first_word": m.table.extents_first_word}

    def io(entries):
        return [{"name": e.name, "dtype": e.dtype, "shape": _jsonable(e.shape), "slot": e.slot} for e in entries]

    # --- memory plan -------------------------------------------------------------------------------
    # the arena region is sized for the largest graph: its plan is the one to show next to it
    widest = max(range(len(m.graphs)), key=lambda i: (m.graphs[i].arena, -i)) if m.graphs else None
    memory = {
        "regions": {k: int(v) for k, v in m.regions.items()},
        "weights": {"count": len(m.weights), "nbytes": sum(w.nbytes for w in m.weights)},
        "state": [{"name": e.name, "dtype": e.dtype, "shape": _jsonable(e.shape), "offset": e.offset,
                   "nbytes": e.nbytes, "init": e.init} for e in m.state],
        "arena_buffers": _package_plan(m, widest),
    }

    # --- kernels and graphs -------------------------------------------------------------------------
    uses: Counter = Counter()
    grids: dict[int, list] = {}
    for g in m.graphs:
        for node in g.nodes:
            uses[node.kernel] += 1
            seen = grids.setdefault(node.kernel, [])
            if list(node.grid) not in seen:
                seen.append(list(node.grid))

    kernel_list = [
        {"index": i, "name": k.name, "family": k.family, "grids": grids.get(i, []), "num_warps": k.num_warps,
         "num_stages": k.num_stages, "shared": k.shared, "archs": sorted(k.binaries),
         "source_sha256": k.source_sha256, "has_source": bool(k.source), "params": len(k.params),
         "nodes": uses.get(i, 0)}
        for i, k in enumerate(m.kernels)]

    graph_list = []
    for g in m.graphs:
        fam: Counter = Counter()
        for node in g.nodes:
            family = m.kernels[node.kernel].family
            fam["?" if family is None else family] += 1
        launches = g.nodes[1:]   # node 0 is the table writer (SPEC §5)
        graph_list.append(
            {
                "name": g.name,
                "bucket": _jsonable(g.bucket),
                "arena": g.arena,
                "kernels": len(launches),
                "nodes": len(g.nodes),
                "unique_kernels": len({n.kernel for n in launches}),
                "edges": sum(len(n.deps) for n in g.nodes),
                # by kind (format 3.2): programmatic edges let a kernel launch before the ones
                # it depends on finish (docs/design-pdl.md); the rest are full edges
                "edges_by_kind": _edge_kinds(g.nodes),
                "families": dict(sorted(fam.items(), key=lambda kv: (-kv[1], str(kv[0])))),
                "arena_buffers": _graph_plan(m, g),
                "stats": _jsonable(g.stats),
            }
        )
    symbols = _symbols(m)

    sections = [
        {"name": name, "offset": off, "nbytes": nbytes, "sha256": sha}
        for (name, off, nbytes, sha) in package.section_info
    ]
    return {
        "path": str(path) if path is not None else None,
        "file_nbytes": package.nbytes,
        "format_version": _version_list(package.format_version),
        "model": _jsonable(m.model),
        "producer": _jsonable(m.producer),
        "archs": list(m.archs),
        "options": _jsonable(m.options),
        "inputs": io(m.inputs),
        "outputs": io(m.outputs),
        "symbols": symbols,
        "buckets": _buckets(m, symbols, len(m.graphs)),
        "table": {"nbytes": m.table.nbytes, "words": m.table.words, "slots": table_slots, "extents": extents},
        "memory": memory,
        "generate": _generate(m),
        "index_checks": _index_checks(m),
        "kernels": kernel_list,
        "graphs": graph_list,
        "totals": _totals(m, graph_list, widest),
        "sections": sections,
        "signature": _signature(package, verified),
    }


def _plan_entry(buffers) -> dict:
    """{count, nbytes, largest} of a list of arena buffers (ArenaBuffer or PlanBuffer): how many
    intermediates, their bytes before reuse, and the TOP_ARENA_BUFFERS largest."""
    largest = sorted(buffers, key=lambda b: (-b.nbytes, b.offset))
    return {"count": len(buffers), "nbytes": sum(b.nbytes for b in buffers),
            "largest": [{"name": b.name, "offset": b.offset, "nbytes": b.nbytes, "first": b.first,
                         "last": b.last} for b in largest[:TOP_ARENA_BUFFERS]]}


def _graph_plan(m, g) -> dict | None:
    """Graph g's memory plan: its compiled record's buffers (format 3.4); without records, the
    manifest's `arena_buffers` only when g is the package's one graph (with several, which graph
    that list describes is not recorded: None)."""
    if g.compiled is not None:
        return _plan_entry(g.compiled.buffers)
    if len(m.graphs) == 1:
        return _plan_entry(m.arena_buffers)
    return None


def _package_plan(m, widest: int | None) -> dict:
    """`memory.arena_buffers`: the plan of the graph the arena region is sized for (the largest
    arena; `graph` names it), so that the buffers and `regions.arena` describe one graph. A package
    without records and several graphs has only the manifest's list, of a graph not named
    (`graph`: None)."""
    plan = _graph_plan(m, m.graphs[widest]) if widest is not None else None
    if plan is not None:
        return {**plan, "graph": m.graphs[widest].name}
    return {**_plan_entry(m.arena_buffers), "graph": None}


def _totals(m, graphs: list[dict], widest: int | None) -> dict:
    """Figures over all graphs, each as its name says: sums of the per-graph figures (nodes,
    kernel launches, edges), the distinct kernels the graphs launch (a union, table writer not
    counted: graphs share kernels, so it is below the sum of the graphs' `unique_kernels`), the
    largest graph's arena (one arena per session, sized for it), and the package's kernel entries
    (those, the table writer, the generation step, any no graph uses)."""
    launched = {n.kernel for g in m.graphs for n in g.nodes[1:]}
    writers = {g.nodes[0].kernel for g in m.graphs if g.nodes}
    step = m.generate.step.kernel if m.generate is not None else None
    kinds = {"full": sum(g["edges_by_kind"]["full"] for g in graphs),
             "programmatic": sum(g["edges_by_kind"]["programmatic"] for g in graphs)}
    return {
        "graphs": len(graphs),
        "nodes": sum(g["nodes"] for g in graphs),
        "kernels": sum(g["kernels"] for g in graphs),
        "unique_kernels": len(launched),
        "edges": sum(g["edges"] for g in graphs),
        "edges_by_kind": kinds,
        "largest_arena": (None if widest is None else
                          {"graph": m.graphs[widest].name, "nbytes": m.graphs[widest].arena}),
        "package_kernels": {"count": len(m.kernels), "launched": len(launched),
                            "table_writer": len(writers - launched),
                            "generate_step": int(step is not None and step not in launched | writers),
                            "unused": len(set(range(len(m.kernels))) - launched - writers
                                          - ({step} if step is not None else set()))},
    }


class KernelSourceError(LookupError):
    """`--source NAME`: the package has no kernel of that name, or that kernel has no source."""


# Control characters a terminal would act on (a package is input from anyone): everything below
# 0x20 but tab and newline, DEL and the C1 range. Generated sources are plain ASCII.
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (0x09, 0x0A)}


def kernel_source(package, name: str) -> str:
    """The source text of kernel `name` (`kernels[i].name`, as `grace inspect` lists them) from
    its `source` section, with terminal control characters escaped (`\\x1b`). KernelSourceError
    names the kernels there are when `name` is not one of them, or when it has no source (the
    format makes sources optional)."""
    kernels = package.view.kernels
    by_name = {k.name: k for k in kernels}
    k = by_name.get(name)
    if k is None:
        import difflib

        close = ([n for n in by_name if n.startswith(name)]
                 or difflib.get_close_matches(name, list(by_name), cutoff=0.5))[:3]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KernelSourceError(f"no kernel {name!r} in this package{hint}; its kernels are: "
                                f"{', '.join(by_name)}")
    if not k.source:
        raise KernelSourceError(f"kernel {name!r} has no source section in this package")
    text = bytes(package.section(k.source)).decode("utf-8", errors="replace")
    return text.translate(_CONTROL)


def _signature(package, verified: bool) -> dict | None:
    """SPEC §7: who signed the package (the key's fingerprint and base64) and whether the signature
    holds; None when unsigned. Checking it needs `cryptography` (else `valid` is None)."""
    from grace.formats.signing import signature_status

    return signature_status(package, verified=verified)


def _generate(m) -> dict | None:
    """What `--generate` recorded (None for a package that is not a causal LM)."""
    gen = m.generate
    if gen is None:
        return None
    return {"tokens": gen.tokens, "positions": gen.positions, "logits": gen.logits,
            "capacity": gen.capacity, "decode_graph": m.graphs[gen.decode_graph].name}


def _index_checks(m) -> dict:
    """Format 3.3: the gathers whose indices are checked on the device, and the error word."""
    checks = [{"code": c.code, "input": c.input, "op": c.op, "where": c.where, "size": _jsonable(c.size)}
              for c in m.index_checks]
    return {"count": len(checks), "error_word": m.table.errors_offset, "checks": checks}


def _symbols(m) -> list[dict]:
    """One entry per symbol: its range, the input dims it is read from, and the bounds of its
    buckets as they occur in the graphs (sorted, distinct)."""
    return [{"name": s.name, "kind": s.kind, "min": s.min, "max": s.max,
             "sources": [{"input": i, "name": m.inputs[i].name, "dim": dim} for i, dim in s.sources],
             "buckets": sorted({g.bucket[s.name] for g in m.graphs})}
            for s in m.symbols]


def _buckets(m, symbols: list[dict], n_graphs: int) -> dict:
    """How the graphs cover the input symbols: per-symbol bucket counts and a one-line summary,
    plus the compile options that chose them (`options.buckets`, `options.bucket_cost`; informative,
    so of any type)."""
    counts = {s["name"]: len(s["buckets"]) for s in symbols if s["kind"] == "input"}
    data = [s["name"] for s in symbols if s["kind"] == "data"]
    policy = m.options.get("buckets")
    cost = m.options.get("bucket_cost")
    return {
        "graphs": n_graphs,
        "counts": counts,
        "summary": _variant_summary(m, n_graphs, counts, data),
        "policy": _jsonable(policy) if isinstance(policy, Mapping) else None,
        "cost_model": cost if isinstance(cost, str) else None,
    }


def _variant_summary(m, n_graphs: int, counts: Mapping[str, int], data: list[str]) -> str:
    """_bucket_summary of one variant's graphs, and the variants (format 3.5, SPEC §3.5: every arch
    has the same buckets), e.g. "3 graphs = product of buckets: seq 3, per arch (2 variants: sm_80;
    sm_90; 6 graphs in all)"."""
    from grace.formats.view import variants

    found = variants(m)
    if len(found) < 2:
        return _bucket_summary(n_graphs, counts, data)
    return (_bucket_summary(len(found[0][1]), counts, data) + f", per arch ({len(found)} variants: "
            + "; ".join("+".join(a) for a, _ in found) + f"; {n_graphs} graphs in all)")


def _bucket_summary(n_graphs: int, counts: Mapping[str, int], data: list[str]) -> str:
    """E.g. "6 graphs = product of buckets: seq 3 × batch 2" or "1 graph (static shapes)"."""
    noun = "graph" if n_graphs == 1 else "graphs"
    if not counts and data:
        return f"{n_graphs} {noun} (no input symbols; data-dependent sizes: {', '.join(data)})"
    if not counts:
        return f"{n_graphs} {noun} (static shapes)"
    factors = " × ".join(f"{name} {n}" for name, n in counts.items())
    product = 1
    for n in counts.values():
        product *= n
    if product == n_graphs:
        return f"{n_graphs} {noun} = product of buckets: {factors}"
    return f"{n_graphs} {noun} (buckets: {factors}; not their full product {product})"


# ------------------------------------------------------------------------------------------------
# rendering
# ------------------------------------------------------------------------------------------------


def _t(v) -> str:
    """Text from a package for a rich table or message, escaped: a name such as `[/x]` would be
    taken for markup (and a malformed tag raises in rich)."""
    from rich.markup import escape

    return escape(str(v))


def _shape(s) -> str:
    """`[batch, seq + 1, 4]`, escaped: rich would take `[batch, ...]` for a markup tag."""
    return _t("[" + ", ".join(format_shape_expr(d) for d in (s or [])) + "]")


def _num(v) -> str:
    """A stats value for a table cell: ints as they are, floats to 4 significant digits."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bucket_text(bucket: Mapping) -> str:
    return " ".join(f"{k}={v}" for k, v in bucket.items()) or "-"


def render(d: Mapping, console=None) -> None:
    """Print a description from `describe` as rich tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def table(title, *cols, **kw):
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, **kw)
        for c in cols:
            justify = "right" if c.startswith(">") else "left"
            t.add_column(c.lstrip(">"), justify=justify)
        return t

    # header
    prod = d.get("producer", {}) or {}
    hdr = Table.grid(padding=(0, 2))
    hdr.add_column(style="bold cyan")
    hdr.add_column()
    hdr.add_row("model", _t((d.get("model") or {}).get("name", "?")))
    if d.get("path"):
        hdr.add_row("file", _t(d["path"]))
    hdr.add_row("format", _version_str(d.get("format_version")))
    overrides = prod.get("overrides") if isinstance(prod, Mapping) else None
    hdr.add_row("producer", _t("  ".join(f"{k} {v}" for k, v in prod.items() if k != "overrides")
                               or "?"))
    if overrides:   # GRACE_OVERRIDE (aot/dump.py): not a clean build
        hdr.add_row("[bold red]overrides[/]",
                    "[bold red]" + _t(f"NOT A CLEAN BUILD: the sources of {len(overrides)} "
                                      f"kernel(s) came from GRACE_OVERRIDE: "
                                      f"{', '.join(map(str, overrides))}") + "[/]")
    hdr.add_row("archs", _t(", ".join(d.get("archs", [])) or "-"))
    if d.get("file_nbytes") is not None:
        hdr.add_row("size", f"{human_bytes(d['file_nbytes'])} ({d['file_nbytes']} bytes)")
    if "signature" in d:   # a label no longer than "producer": the column keeps its width
        hdr.add_row("signed", _t(_signature_text(d["signature"])))
    buckets = d.get("buckets") or {}
    if buckets.get("summary"):
        hdr.add_row("graphs", _t(buckets["summary"]))
    console.print(hdr)
    console.print()

    # inputs / outputs
    t = table("inputs / outputs", "kind", "name", "dtype", "shape", ">slot")
    for kind in ("inputs", "outputs"):
        for e in d.get(kind, []):
            t.add_row(kind[:-1], _t(e["name"]), _t(e["dtype"]), _shape(e["shape"]), _t(e["slot"]))
    console.print(t)

    _render_symbols(console, d, table)

    # argument table
    tab = d.get("table", {})
    t = table(
        f"argument table ({tab.get('nbytes')} bytes, {tab.get('words')} words)",
        ">slot", "name", "role", ">offset", ">rank", "words",
    )
    for s in tab.get("slots", []):
        first, n = s["first_word"], s["words"]
        t.add_row(_t(s["slot"]), _t(s["name"]), _t(s["role"]), _t(s["offset"]), _t(s["rank"]),
                  f"{n} (w{first}..w{first + n - 1})")
    ext = tab.get("extents") or {}
    if ext.get("count"):
        first, n = ext["first_word"], ext["count"]
        t.add_row("-", "extents", "symbols", _t(ext["offset"]), "-", f"{n} (w{first}..w{first + n - 1})")
    checks = d.get("index_checks") or {}
    if checks.get("error_word") is not None:
        t.add_row("-", "errors", "index checks", _t(checks["error_word"]), "-", "1 (not a table word)")
    console.print(t)
    if checks.get("count"):
        inputs = sorted({str(c["input"]) for c in checks["checks"] if c.get("input") is not None})
        console.print(f"[bold]index checks[/]: {checks['count']} gather index(es) clamped and reported "
                      f"on the device" + (f" (inputs {_t(', '.join(inputs))})" if inputs else "") + "\n")

    # memory plan
    mem = d.get("memory", {})
    t = table("memory plan", "region", ">size", ">bytes", "contents")
    w, ab = mem.get("weights", {}), mem.get("arena_buffers", {})
    n_graphs = len(d.get("graphs", []))
    notes = {
        "weights": f"{w.get('count', 0)} tensors",
        "arena": _arena_note(ab, n_graphs),
        "table": f"{len(tab.get('slots', []))} slots",
        "state": f"{len(mem.get('state', []))} buffers per session (KV caches, generation)",
    }
    for name, nbytes in mem.get("regions", {}).items():
        t.add_row(_t(name), human_bytes(nbytes), _t(nbytes), _t(notes.get(name, "")))
    console.print(t)
    if mem.get("state"):
        t = table("session state", "name", "dtype", "shape", ">offset", ">size", "initial value")
        for e in mem["state"]:
            t.add_row(_t(e["name"]), _t(e["dtype"]), _shape(e["shape"]), _t(e["offset"]),
                      human_bytes(e["nbytes"] or 0),
                      "zeros (not stored)" if e["init"] == "zeros" else "the `state` section")
        console.print(t)
    gen = d.get("generate")
    if gen:
        console.print(f"[bold]generation[/]: tokens {_t(repr(gen['tokens']))}, positions "
                      f"{_t(repr(gen['positions']))}, logits {_t(repr(gen['logits']))}, cache of "
                      f"{gen['capacity']} positions, decode graph {_t(repr(gen['decode_graph']))}; greedy "
                      "steps run in a CUDA graph WHILE loop\n")
    if ab.get("largest"):
        of_graph = f" of graph {_t(repr(ab['graph']))}" if ab.get("graph") is not None and n_graphs > 1 else ""
        t = table(f"largest arena buffers{of_graph} (top {len(ab['largest'])} of {ab.get('count')})",
                  "name", ">offset", ">size", "live (nodes)")
        for b in ab["largest"]:
            t.add_row(_t(b["name"]), _t(b["offset"]), human_bytes(b["nbytes"] or 0), f"{b['first']}..{b['last']}")
        console.print(t)

    # kernels
    t = table(_kernels_title(d), ">#", "name", "family", "grids", ">warps", ">stages",
              ">shared", "archs", "source", ">nodes (all graphs)")
    for k in d.get("kernels", []):
        grids = k.get("grids", [])
        g = ", ".join("x".join(str(v) for v in gr) for gr in grids[:3]) + (f" (+{len(grids) - 3})" if len(grids) > 3 else "")
        sha = (k.get("source_sha256") or "")[:12]
        t.add_row(_t(k["index"]), _t(k["name"]), _t(k["family"]), _t(g or "-"), _t(k["num_warps"]),
                  _t(k["num_stages"]), human_bytes(k["shared"] or 0), _t(",".join(k["archs"])), _t(sha or "-"), _t(k["nodes"]))
    console.print(t)

    _render_graphs(console, d, table)


def _arena_note(ab: Mapping, n_graphs: int) -> str:
    """The memory plan's arena row: the plan of the graph the region is sized for, named."""
    plan = f"{ab.get('count', 0)} buffers ({human_bytes(ab.get('nbytes', 0))} before reuse)"
    if n_graphs <= 1:
        return plan
    if ab.get("graph") is None:   # no per-graph records: the manifest's list, of an unnamed graph
        return (f"sized for the largest of {n_graphs} graphs, one arena per session; the manifest's "
                f"arena_buffers, of a graph it does not name: {plan}")
    return (f"sized for the largest of {n_graphs} graphs, {ab['graph']!r}, one arena per session; "
            f"its plan: {plan}")


def _kernels_title(d: Mapping) -> str:
    """`kernels (9 in the package: 8 launched by the graphs, the table writer)`."""
    kernels = d.get("kernels", [])
    pk = (d.get("totals") or {}).get("package_kernels")
    if not pk:
        return f"kernels ({len(kernels)})"
    parts = [f"{pk['launched']} launched by the graphs"]
    if pk.get("table_writer"):
        parts.append("the table writer" if pk["table_writer"] == 1 else f"{pk['table_writer']} table writers")
    if pk.get("generate_step"):
        parts.append("the generation step")
    if pk.get("unused"):
        parts.append(f"{pk['unused']} no graph uses")
    return f"kernels ({pk['count']} in the package: {', '.join(parts)})"


def _signature_text(sig: Mapping | None) -> str:
    """The header's `signed` row: "no", or who signed and whether the signature holds."""
    if sig is None:
        return "no"
    if sig.get("fingerprint") is None:
        return f"malformed signature: {sig.get('error')}"
    state = {True: "valid", False: "INVALID", None: "not checked"}[sig.get("valid")]
    note = f" ({sig['error']})" if sig.get("error") else ""
    return f"by {sig['fingerprint']}: {state}{note}"


def _render_symbols(console, d: Mapping, table) -> None:
    """The symbols (dynamic dimensions) and the bucket policy; nothing for a static package."""
    from rich.markup import escape

    symbols = d.get("symbols") or []
    if not symbols:
        return
    t = table(f"symbols ({len(symbols)})", "name", "kind", "range", "sources", "buckets (graph bounds)")
    for s in symbols:
        sources = escape(", ".join(f"{src['name'] if src['name'] is not None else src['input']}[{src['dim']}]"
                                   for src in s.get("sources", []))) or "(computed on the device)"
        bounds = ", ".join(str(b) for b in s.get("buckets", []))
        t.add_row(_t(s["name"]), _t(s["kind"]), f"{s['min']}..{s['max']}", sources, _t(bounds or "-"))
    console.print(t)
    buckets = d.get("buckets") or {}
    if buckets.get("policy"):
        policy = "; ".join(f"{name}: {', '.join(str(b) for b in bounds) if isinstance(bounds, list) else bounds}"
                           for name, bounds in buckets["policy"].items())
        console.print(f"[bold]bucket policy[/bold] (options.buckets): {_t(policy)}", highlight=False)
    if buckets.get("cost_model"):
        console.print(f"[bold]bucket cost model[/bold] (options.bucket_cost): {_t(buckets['cost_model'])}",
                      highlight=False)
    if buckets.get("policy") or buckets.get("cost_model"):
        console.print()


SHOWN_STATS = ("kernels", "unique_kernels", "arena_nbytes")   # counted from the graph: own columns


def _render_graphs(console, d: Mapping, table) -> None:
    """One row per graph (bucket) with its costs, then the kernel families.

    The numeric `stats` keys are shown whichever are present: the compiler adds estimates over
    time (`est_*`, `padding`, ...), and inspect should not need a release for each of them.
    """
    graphs = d.get("graphs", [])
    stat_keys: list[str] = []
    for g in graphs:
        for k, v in (g.get("stats") or {}).items():
            if k not in SHOWN_STATS and _is_number(v) and k not in stat_keys:
                stat_keys.append(k)
    title = f"graphs, one per bucket ({len(graphs)})" if len(graphs) > 1 else "graphs (1)"
    t = table(title, "graph", "bucket", ">nodes", ">kernels", ">unique kernels", ">edges (programmatic)",
              ">arena", ">arena buffers", ">before reuse", *(">" + _t(k) for k in stat_keys))
    for g in graphs:
        stats = g.get("stats") or {}
        arena = g.get("arena")
        kinds = g.get("edges_by_kind") or {}
        plan = g.get("arena_buffers")
        t.add_row(_t(g["name"]), _t(_bucket_text(g.get("bucket") or {})), _t(g["nodes"]),
                  _t(g["kernels"]), _t(g["unique_kernels"]),
                  f"{g['edges']} ({kinds.get('programmatic', 0)})",
                  human_bytes(arena) if _is_number(arena) else "-",
                  _t(plan["count"]) if plan else "-", human_bytes(plan["nbytes"]) if plan else "-",
                  *(_num(stats[k]) if _is_number(stats.get(k)) else "-" for k in stat_keys))
    console.print(t)
    totals = d.get("totals")
    if totals and len(graphs) > 1:
        console.print(_totals_text(totals), highlight=False)
        console.print()
    if len(graphs) == 1:
        _render_graph_detail(console, graphs[0], table)
    elif graphs:
        _render_families(console, graphs, table)


def _totals_text(tot: Mapping) -> str:
    """The line under the graphs table: what is summed, what is a union, what is a maximum."""
    kinds = tot.get("edges_by_kind") or {}
    widest = tot.get("largest_arena") or {}
    text = (f"[bold]totals over {tot['graphs']} graphs[/bold]: {tot['nodes']} nodes, {tot['kernels']} kernel "
            f"launches (summed), {tot['unique_kernels']} distinct kernels launched (the union: graphs "
            f"share kernels), {tot['edges']} dependency edges ({kinds.get('programmatic', 0)} programmatic)")
    if widest:
        text += (f"; arena: the largest graph's, {_t(repr(widest['graph']))} "
                 f"{human_bytes(widest['nbytes'])} (one per session)")
    return text


def _edge_kinds(nodes) -> dict:
    total = sum(len(n.deps) for n in nodes)
    prog = sum(len(n.programmatic) for n in nodes)
    return {"full": total - prog, "programmatic": prog}


def _edge_text(g: Mapping) -> str:
    kinds = g.get("edges_by_kind") or {}
    if kinds.get("programmatic"):
        return f"{g['edges']} dependency edges ({kinds['programmatic']} programmatic)"
    return f"{g['edges']} dependency edges"


def _render_graph_detail(console, g: Mapping, table) -> None:
    """A single graph (static package): its families and its whole `stats` map."""
    from rich.table import Table

    console.print(f"[bold]graph {_t(repr(g['name']))}[/bold]: {g['nodes']} nodes (the table writer and "
                  f"{g['kernels']} kernel launches), {g['unique_kernels']} unique kernels, "
                  f"{_edge_text(g)}", highlight=False)
    t = table(None, "family", ">nodes")
    for fam, n in g.get("families", {}).items():
        t.add_row(_t(fam), _t(n))
    console.print(t)
    if g.get("stats"):
        st = Table.grid(padding=(0, 2))
        st.add_column(style="cyan")
        st.add_column()
        for k, v in g["stats"].items():
            st.add_row(_t(f"  {k}"), _t(v))
        console.print(st)
        console.print()


def _render_families(console, graphs: list, table) -> None:
    """Nodes per kernel family over all graphs, as a range when the buckets differ."""
    families: dict[str, list[int]] = {}
    for g in graphs:
        for fam in g.get("families", {}):
            families.setdefault(fam, [])
    for fam, counts in families.items():
        counts.extend(g.get("families", {}).get(fam, 0) for g in graphs)
    t = table("kernel families", "family", ">nodes per graph")
    for fam, counts in sorted(families.items(), key=lambda kv: (-max(kv[1]), str(kv[0]))):
        lo, hi = min(counts), max(counts)
        t.add_row(_t(fam), _t(lo) if lo == hi else f"{lo}..{hi}")
    console.print(t)
