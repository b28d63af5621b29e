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
                             (`table.errors`, format 3.3) need no order (`_is_code_store`).
                             Not pair by pair (a graph at the 16,384-node cap has ~10⁸ overlapping
                             pairs, and an all-pairs check took ~20 min): ancestors and descendants
                             as bitsets, and a sweep per resource over its ranges sorted by start,
                             that checks each access against all open conflicting nodes at once
                             (`_unordered`). Seconds at the cap; tests/test_races.py compares it
                             with the all-pairs definition.
  check_pre_wait(package)    every kernel that is the target of a programmatic edge calls
                             gdc_wait() at the top level of its body, and before that stores
                             nothing, does not return early, and reads only weights or memory
                             whose writers have certainly finished when it launches (a path with
                             a full edge from each: the table words, behind the table writer's
                             full edges; a decode attention's KV caches once their appends run
                             after it), checked on the syntax tree of its source (parsed, never
                             run) against the graph's edges.

A path of edges orders two nodes even when its edges are programmatic: every kernel waits (at
gdc_wait) for the kernels before it to finish before it touches memory, and waits before it exits.
Both functions return a list of problems (empty: proven).
"""
from __future__ import annotations

import ast
import heapq
from typing import NamedTuple


class Access(NamedTuple):
    start: int
    end: int
    node: int
    write: bool


# A report stops listing pairs here: a package is input from anyone, and one whose 16,384 nodes
# all store into one buffer unordered has 134 million racing pairs. Any problem already refutes
# the proof; the first ones name the missing edges.
MAX_PROBLEMS = 10_000


def _orders(nodes) -> tuple[list[int], list[int]]:
    """(ancestors, descendants): per node, a bitset (a Python int, bit i = node i) of the nodes a
    path of edges leads from, and of those it leads to.

    Nodes are listed in an execution order (every dep is an earlier node, SPEC §3), so one pass
    forward builds the ancestors and one backward pass the descendants: one OR of two bitsets per
    edge, each ⌈n/64⌉ machine words, done in C. At the cap (16,384 nodes) a bitset is 2 KiB."""
    n = len(nodes)
    upto = [0] * n       # ancestors and the node itself
    children: list[list[int]] = [[] for _ in range(n)]
    for j, node in enumerate(nodes):
        bits = 1 << j
        for d in node.get("deps", ()):
            if 0 <= d < j:
                bits |= upto[d]
                children[d].append(j)
        upto[j] = bits
    down = [0] * n       # descendants and the node itself
    for j in range(n - 1, -1, -1):
        bits = 1 << j
        for c in children[j]:
            bits |= down[c]
        down[j] = bits
    return ([bits ^ (1 << j) for j, bits in enumerate(upto)],
            [bits ^ (1 << j) for j, bits in enumerate(down)])


def _accesses(manifest, graph) -> dict:
    """{resource: [Access]} of one graph. Resources: "arena", "state", "weights", "table" (byte
    ranges) and ("io", slot) (one I/O tensor, as a whole)."""
    kernels = manifest["kernels"]
    slots = _slots(manifest)
    out: dict = {}
    for n, node in enumerate(graph["nodes"]):
        writes = set(kernels[node["kernel"]]["writes"])
        for i, arg in enumerate(node["args"]):
            if "region" not in arg:
                continue
            for resource, start, end, writable in _ranges(slots, n, arg):
                if end > start:
                    out.setdefault(resource, []).append(
                        Access(start, end, n, writable and i in writes))
    return out


def _slots(manifest) -> dict:
    """{table offset of an I/O slot: slot index}."""
    return {s["offset"]: i for i, s in enumerate(manifest["table"]["slots"])}


def _ranges(slots: dict, n: int, arg) -> list:
    """(resource, start, end, writable) for what node `n`'s argument `arg` reaches. A kernel's
    pointer to an I/O slot reaches the slot's table words, which it only reads, and the tensor
    behind them as a whole, which it may write; the table writer (node 0) writes the words."""
    region, off, nbytes = arg["region"], arg["offset"], arg.get("nbytes", 0)
    if region == "table" and off in slots and n != 0:
        return [("table", off, off + nbytes, False), (("io", slots[off]), 0, 1, True)]
    return [(region, off, off + nbytes, True)]


def _is_code_store(a: Access, error_word) -> bool:
    """A store of exactly the error word by a kernel node (not the table writer). Kernels only
    ever store index-check codes into it and never read it; any nonzero code is a correct report
    (SPEC §5.4), so two such stores commute and no edge has to order them. A read of the word, or
    the table writer's range over the whole table, is still checked as usual."""
    return error_word is not None and a.write and a.node != 0 and (a.start, a.end) == error_word


# The kinds of access, and which kinds conflict (need a path of edges between their nodes):
# any pair with a plain write, a read with a code store, never two reads or two code stores.
_READ, _WRITE, _CODE = 0, 1, 2
_CONFLICTS = {_READ: (_WRITE, _CODE), _WRITE: (_READ, _WRITE, _CODE), _CODE: (_READ, _WRITE)}


def _unordered(accesses: list, anc: list, desc: list, error_word=None):
    """Yield (a, b), a first in sweep order, for every pair of overlapping accesses by two nodes
    that conflict and that no path of edges orders; each pair once.

    A sweep over the accesses sorted by start: the accesses still open at a start (end > start)
    are exactly those that began earlier and overlap it (the later ones find it in turn). Per kind
    of access, the nodes with an open access are a bitset, so one access is checked against all of
    them at once: the conflicting open nodes below it must all be its ancestors, those above it
    all its descendants. That is a handful of bitset operations per access instead of one test
    per overlapping pair; only the pairs found unordered (none, in a sound package) are listed
    one by one. `error_word`: the (start, end) of the table's error word, whose code stores
    commute (_is_code_store), for the "table" resource; None elsewhere."""
    open_bits = [0, 0, 0]                 # per kind: nodes with an open access of that kind
    count: dict = {}                      # (kind, node) -> its open accesses of that kind
    by_node: dict = {}                    # node -> its open accesses (for the report only)
    ends: list = []                       # heap of (end, seq, kind, access)
    for seq, acc in enumerate(sorted(accesses)):
        while ends and ends[0][0] <= acc.start:
            _, _, kind, old = heapq.heappop(ends)
            key = (kind, old.node)
            count[key] -= 1
            if not count[key]:
                del count[key]
                open_bits[kind] ^= 1 << old.node
            mine = by_node[old.node]
            mine.remove(old)
            if not mine:
                del by_node[old.node]
        kind = _CODE if _is_code_store(acc, error_word) else _WRITE if acc.write else _READ
        node = acc.node
        others = 0
        for k in _CONFLICTS[kind]:
            others |= open_bits[k]
        others &= ~(1 << node)
        if others:
            below = others & ((1 << node) - 1)
            bad = (below & ~anc[node]) | ((others ^ below) & ~desc[node])
            while bad:
                low = bad & -bad
                other = low.bit_length() - 1
                bad ^= low
                for prev in by_node[other]:
                    prev_kind = _CODE if _is_code_store(prev, error_word) else \
                        _WRITE if prev.write else _READ
                    if prev_kind in _CONFLICTS[kind]:
                        yield prev, acc
        key = (kind, node)
        if key not in count:
            count[key] = 0
            open_bits[kind] |= 1 << node
        count[key] += 1
        by_node.setdefault(node, []).append(acc)
        heapq.heappush(ends, (acc.end, seq, kind, acc))


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
    """Problems found; [] also when `unchecked_reason(manifest)` says the package cannot be judged.

    Time: per graph O(E·n/64) word operations for the orders (E edges, n nodes) and
    O(A·(log A + n/64)) for the sweep (A accesses), so a graph at the node cap (16,384) takes
    seconds; the list stops after MAX_PROBLEMS problems with a last line that says so."""
    if unchecked_reason(manifest):
        return []
    problems: list[str] = []
    errors = (manifest.get("table") or {}).get("errors")
    error_word = (errors["offset"], errors["offset"] + 8) if errors is not None else None
    slots = manifest["table"]["slots"]

    def add(problem: str) -> bool:
        """Record a problem; False once the report is full."""
        if len(problems) >= MAX_PROBLEMS:
            problems.append(f"... more problems not listed (the report stops after {MAX_PROBLEMS})")
            return False
        problems.append(problem)
        return True

    for g, graph in enumerate(manifest.get("graphs", [])):
        anc, desc = _orders(graph["nodes"])
        name = graph.get("name", g)
        for resource, accesses in _accesses(manifest, graph).items():
            if resource == "weights":
                for a in accesses:
                    if a.write and not add(f"graph {name!r}: {_label(graph, a.node)} writes the weights"):
                        return problems
                continue
            if isinstance(resource, tuple) and slots[resource[1]]["role"] == "input":
                for a in accesses:
                    if a.write and not add(f"graph {name!r}: {_label(graph, a.node)} writes input "
                                           f"{slots[resource[1]]['name']!r}"):
                        return problems
            what = resource if isinstance(resource, str) else f"tensor {slots[resource[1]]['name']!r}"
            word = error_word if resource == "table" else None
            for other, acc in _unordered(accesses, anc, desc, word):
                first, second = sorted((other.node, acc.node))
                span = "" if isinstance(resource, tuple) else \
                    f" [{max(acc.start, other.start)}, {min(acc.end, other.end)})"
                if not add(f"graph {name!r}: {_label(graph, first)} and {_label(graph, second)} "
                           f"touch {what}{span}, one of them writing, and no path of edges orders "
                           "them"):
                    return problems
    return problems


# ---- what a kernel does before gdc_wait() -----------------------------------------------------

def _is_call(node, name: str) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == name)


def _pre_wait_problems(source: str, weight_params: set) -> tuple[bool, list[str], dict]:
    """(calls gdc_wait at the top level, problems before it, {parameter: line} of the loads
    through parameters that are not weights before it) for one kernel source. Whether those
    loads are safe depends on the graph (`check_pre_wait`)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return False, [f"source does not parse: {e}"], {}
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(fns) != 1:
        return False, ["source must define exactly one kernel function"], {}
    fn = fns[0]
    params = [a.arg for a in fn.args.args]
    problems, early = [], {}
    for stmt in fn.body:
        if _is_call(stmt, "gdc_wait"):
            return True, problems, early
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
                            early.setdefault(name.id, sub.lineno)
    return False, problems, early


def _finished_before(nodes, anc) -> list[int]:
    """Per node, a bitset of the nodes certain to have finished when it launches: those with a
    path of edges to it that has at least one full edge. A full edge d -> j launches j after d
    finished, and d finishes only after all its ancestors did (every kernel waits before it
    exits); a programmatic edge launches j once d launched, so j inherits only d's set."""
    done = [0] * len(nodes)
    for j, node in enumerate(nodes):
        prog = set(node.get("programmatic", ()))
        bits = 0
        for d in node.get("deps", ()):
            if 0 <= d < j:
                bits |= done[d] if d in prog else anc[d] | (1 << d)
        done[j] = bits
    return done


def check_pre_wait(package) -> list[str]:
    """`package`: a grace.formats.Package. Kernels that no programmatic edge targets are not
    checked: they run after everything before them has finished.

    A load before the wait through a pointer that is not a weight (format 3.6) is allowed when,
    in every graph node running the kernel, no node that writes the memory it reaches may still
    be running: each such writer that a path of edges leads from has a path with a full edge to
    the node (`_finished_before`). A writer that no path orders before the node is a race
    check_races reports; one after it cannot store before this node finished."""
    manifest = package.manifest
    kernels = manifest["kernels"]
    targets: dict[int, list] = {}      # kernel index -> nodes that are programmatic targets
    for g, graph in enumerate(manifest.get("graphs", [])):
        for n, node in enumerate(graph["nodes"]):
            if node.get("programmatic"):
                targets.setdefault(node["kernel"], []).append((g, n, node))
    orders: dict = {}
    slots = _slots(manifest)

    def graph_orders(g):
        if g not in orders:
            graph = manifest["graphs"][g]
            anc, _ = _orders(graph["nodes"])
            orders[g] = (anc, _finished_before(graph["nodes"], anc),
                         _accesses(manifest, graph))
        return orders[g]

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
            names = [a.arg for a in fn.args.args]
        except (SyntaxError, StopIteration):
            names = []   # _pre_wait_problems reports the source itself
        weight_params = {a for i, a in enumerate(names) if i in weights}
        waits, found, early = _pre_wait_problems(source, weight_params)
        if not waits:
            g, n, _ = uses[0]
            found.append(f"never calls gdc_wait() at the top level, yet "
                         f"{_label(manifest['graphs'][g], n)} of graph "
                         f"{manifest['graphs'][g].get('name')!r} has programmatic deps")
        for name, line in early.items():
            i = names.index(name)
            for g, n, node in uses:
                graph = manifest["graphs"][g]
                arg = node["args"][i] if i < len(node["args"]) else {}
                if "region" not in arg:
                    found.append(f"line {line}: loads through {name}, which is not a weight, "
                                 f"before gdc_wait()")
                    break
                anc, done, accesses = graph_orders(g)
                running = [a.node for res, start, end, _ in _ranges(slots, n, arg)
                           for a in accesses.get(res, ()) if a.write and a.node != n
                           and a.start < end and start < a.end
                           and anc[n] >> a.node & 1 and not done[n] >> a.node & 1]
                if running:
                    found.append(f"line {line}: loads through {name} before gdc_wait(), which "
                                 f"{_label(graph, running[0])} writes and may still be running "
                                 f"when {_label(graph, n)} of graph {graph.get('name')!r} "
                                 "launches (no path from it with a full edge)")
                    break
        problems += [f"kernel {kernel['name']}: {p}" for p in found]
    return problems
