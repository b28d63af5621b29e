"""Proofs from a package alone that its graphs have no races (docs/design-pdl.md).

With programmatic dependent launch a missing edge is a silent race: the kernel after it may start
early and read memory still being written. Two checks, both on what a package declares, never by
running it:

  check_races(manifest)      every pair of nodes of a graph whose byte ranges overlap, one of them
                             writing, is ordered by a path of edges. Ranges: arena, state and weights
                             bytes; the table words (the table writer writes them all); the extents
                             words; and each I/O tensor as a whole, reached through its table slot.
                             What a node writes: the pointer parameters its kernel lists in `writes`
                             (SPEC §3, format 3.2). Packages whose kernels do not all declare it
                             (older compilers, handmade) cannot be checked: `unchecked_reason`.
                             One exemption: two stores into the error word of the index checks
                             (`table.errors`, format 3.3) need no order (`_codes_commute`).
  check_pre_wait(package)    every kernel that is the target of a programmatic edge calls
                             gdc_wait() at the top level of its body, and before that reads nothing
                             but weights: no store, no early return, no table or arena or state
                             pointer, checked on the syntax tree of its source (parsed, never run).

A path of edges orders two nodes even when its edges are programmatic: every kernel waits (at
gdc_wait) for the kernels before it to finish before it touches memory, and waits before it exits.
Both functions return a list of problems (empty: proven).
"""
from __future__ import annotations

import ast
from typing import NamedTuple


class Access(NamedTuple):
    start: int
    end: int
    node: int
    write: bool


def _ancestors(nodes) -> list[int]:
    """Per node, a bitset of the nodes a path of edges leads from."""
    anc = []
    for node in nodes:
        bits = 0
        for d in node.get("deps", ()):
            bits |= anc[d] | (1 << d)
        anc.append(bits)
    return anc


def _accesses(manifest, graph) -> dict:
    """{resource: [Access]} of one graph. Resources: "arena", "state", "weights", "table" (byte
    ranges) and ("io", slot) (one I/O tensor, as a whole)."""
    kernels = manifest["kernels"]
    slots = {s["offset"]: i for i, s in enumerate(manifest["table"]["slots"])}
    out: dict = {}

    def add(resource, start, end, node, write):
        if end > start:
            out.setdefault(resource, []).append(Access(start, end, node, write))

    for n, node in enumerate(graph["nodes"]):
        kernel = kernels[node["kernel"]]
        writes = set(kernel["writes"])
        for i, arg in enumerate(node["args"]):
            if "region" not in arg:
                continue
            region, off, nbytes = arg["region"], arg["offset"], arg.get("nbytes", 0)
            wrote = i in writes
            if region == "table" and off in slots and n != 0:
                add("table", off, off + nbytes, n, False)           # the slot's words
                add(("io", slots[off]), 0, 1, n, wrote)           # the tensor behind them
            else:
                add(region, off, off + nbytes, n, wrote)
    return out


def _codes_commute(a: Access, b: Access, error_word) -> bool:
    """Both accesses are stores of exactly the error word by kernel nodes (not the table writer).
    Kernels only ever store index-check codes into it and never read it; any nonzero code is a
    correct report (SPEC §5.4), so such stores commute and no edge has to order them. A read of
    the word, or the table writer's range over the whole table, is still checked as usual."""
    if error_word is None:
        return False
    return all(x.write and x.node != 0 and (x.start, x.end) == error_word for x in (a, b))


def _label(graph, n: int) -> str:
    return f"node {n} ({graph['nodes'][n].get('label', '?')})"


def unchecked_reason(manifest) -> str | None:
    """Why check_races cannot judge this package, or None when it can."""
    missing = [k["name"] for k in manifest["kernels"] if "writes" not in k]
    if missing:
        return (f"{len(missing)} kernel(s) do not declare `writes` (format 3.2), e.g. "
                f"{missing[0]!r}: recompile with this grace to check the graphs for races")
    return None


def check_races(manifest) -> list[str]:
    """Problems found; [] also when `unchecked_reason(manifest)` says the package cannot be judged."""
    if unchecked_reason(manifest):
        return []
    problems = []
    errors = (manifest.get("table") or {}).get("errors")
    error_word = (errors["offset"], errors["offset"] + 8) if errors is not None else None
    for g, graph in enumerate(manifest.get("graphs", [])):
        anc = _ancestors(graph["nodes"])
        name = graph.get("name", g)
        for resource, accesses in _accesses(manifest, graph).items():
            if resource == "weights":
                problems += [f"graph {name!r}: {_label(graph, a.node)} writes the weights"
                             for a in accesses if a.write]
                continue
            if isinstance(resource, tuple):
                role = manifest["table"]["slots"][resource[1]]["role"]
                if role == "input":
                    problems += [f"graph {name!r}: {_label(graph, a.node)} writes input "
                                 f"{manifest['table']['slots'][resource[1]]['name']!r}"
                                 for a in accesses if a.write]
            active: list[Access] = []
            for acc in sorted(accesses):
                active = [a for a in active if a.end > acc.start]
                for other in active:
                    if other.node == acc.node or not (other.write or acc.write):
                        continue
                    if resource == "table" and _codes_commute(other, acc, error_word):
                        continue
                    first, second = sorted((other.node, acc.node))
                    if not anc[second] >> first & 1:
                        what = resource if isinstance(resource, str) else \
                            f"tensor {manifest['table']['slots'][resource[1]]['name']!r}"
                        span = "" if isinstance(resource, tuple) else \
                            f" [{max(acc.start, other.start)}, {min(acc.end, other.end)})"
                        problems.append(f"graph {name!r}: {_label(graph, first)} and "
                                        f"{_label(graph, second)} touch {what}{span}, one of "
                                        "them writing, and no path of edges orders them")
                active.append(acc)
    return problems


# ---- what a kernel does before gdc_wait() -----------------------------------------------------

def _is_call(node, name: str) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == name)


def _pre_wait_problems(source: str, weight_params: set) -> tuple[bool, list[str]]:
    """(calls gdc_wait at the top level, problems before it) for one kernel source."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return False, [f"source does not parse: {e}"]
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(fns) != 1:
        return False, ["source must define exactly one kernel function"]
    fn = fns[0]
    params = [a.arg for a in fn.args.args]
    problems = []
    for stmt in fn.body:
        if _is_call(stmt, "gdc_wait"):
            return True, problems
        for sub in ast.walk(stmt):
            if isinstance(sub, (ast.Return, ast.If, ast.For, ast.While)):
                problems.append(f"line {sub.lineno}: control flow before gdc_wait() (a program "
                                "could leave without waiting)")
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                if sub.func.attr in ("store", "atomic_add", "atomic_cas", "atomic_xchg"):
                    problems.append(f"line {sub.lineno}: tl.{sub.func.attr} before gdc_wait()")
                elif sub.func.attr == "load" and sub.args:
                    for name in ast.walk(sub.args[0]):
                        if isinstance(name, ast.Name) and name.id in params and name.id not in weight_params:
                            problems.append(f"line {sub.lineno}: loads through {name.id}, which is "
                                            "not a weight, before gdc_wait()")
    return False, problems


def check_pre_wait(package) -> list[str]:
    """`package`: a grace.formats.Package. Kernels that no programmatic edge targets are not
    checked: they run after everything before them has finished."""
    manifest = package.manifest
    kernels = manifest["kernels"]
    targets: dict[int, list] = {}      # kernel index -> nodes that are programmatic targets
    for graph in manifest.get("graphs", []):
        for n, node in enumerate(graph["nodes"]):
            if node.get("programmatic"):
                targets.setdefault(node["kernel"], []).append((graph, n, node))
    problems = []
    for k, uses in sorted(targets.items()):
        kernel = kernels[k]
        if "source" not in kernel:
            problems.append(f"kernel {kernel['name']}: target of programmatic edges, but the "
                            "package has no source to check")
            continue
        # parameter i is a weight when every node using the kernel passes it a weights range
        weights = {i for i in range(len(kernel["params"]))
                   if all(node["args"][i].get("region") == "weights" for _, _, node in uses)}
        source = bytes(package.section(kernel["source"])).decode("utf-8", "replace")
        try:   # the source names parameter i itself (p0, p1_slot, ...)
            fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
            weight_params = {a.arg for i, a in enumerate(fn.args.args) if i in weights}
        except (SyntaxError, StopIteration):
            weight_params = set()   # _pre_wait_problems reports the source itself
        waits, found = _pre_wait_problems(source, weight_params)
        if not waits:
            graph, n, _ = uses[0]
            found.append(f"never calls gdc_wait() at the top level, yet {_label(graph, n)} of graph "
                         f"{graph.get('name')!r} has programmatic deps")
        problems += [f"kernel {kernel['name']}: {p}" for p in found]
    return problems
