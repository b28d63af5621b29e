"""grace.formats.races on synthetic manifests: the sweep finds exactly the pairs the definition
names (compared with a plain all-pairs check on random graphs), and a graph at the manifest's
node cap is checked in seconds, with a planted missing edge still caught.

The compiled-package tests of the checker are in test_pdl.py (programmatic edges, writes to
weights and inputs) and test_index_checks.py (the error word's commuting stores).
"""

from __future__ import annotations

import collections
import random
import time

import pytest

from grace.formats import limits
from grace.formats.races import MAX_PROBLEMS, check_races

SLOTS = [{"name": "x", "role": "input", "offset": 0, "rank": 1},
         {"name": "y", "role": "output", "offset": 32, "rank": 1}]
TABLE = {"nbytes": 80, "slots": SLOTS, "errors": {"offset": 64}}
WRITER = {"kernel": 0, "deps": [], "label": "table_writer",
          "args": [{"region": "table", "offset": 0, "nbytes": 80}]}


def reference_problems(manifest) -> list[str]:
    """The definition, pair by pair: every two accesses of one graph that overlap, by two nodes,
    one of them writing (two stores of exactly the error word by nodes other than 0 excepted),
    with no path of edges between the nodes. O(n²) pairs; for small graphs only."""
    from grace.formats.races import _accesses, _label

    errors = manifest["table"].get("errors")
    word = (errors["offset"], errors["offset"] + 8) if errors else None
    out = []
    for g, graph in enumerate(manifest["graphs"]):
        nodes = graph["nodes"]
        reach = [set() for _ in nodes]             # ancestors, by a search per node
        for j, node in enumerate(nodes):
            stack = list(node["deps"])
            while stack:
                d = stack.pop()
                if d not in reach[j]:
                    reach[j].add(d)
                    stack.extend(nodes[d]["deps"])
        name = graph.get("name", g)
        for resource, accs in _accesses(manifest, graph).items():
            slot = manifest["table"]["slots"][resource[1]] if isinstance(resource, tuple) else None
            if resource == "weights":
                out += [f"graph {name!r}: {_label(graph, a.node)} writes the weights" for a in accs if a.write]
                continue
            if slot is not None and slot["role"] == "input":
                out += [f"graph {name!r}: {_label(graph, a.node)} writes input {slot['name']!r}"
                        for a in accs if a.write]
            for i, a in enumerate(accs):
                for b in accs[i + 1:]:
                    if a.node == b.node or not (a.write or b.write):
                        continue
                    if a.start >= b.end or b.start >= a.end:
                        continue
                    codes = [x.write and x.node != 0 and (x.start, x.end) == word for x in (a, b)]
                    if resource == "table" and all(codes):
                        continue
                    first, second = sorted((a.node, b.node))
                    if first in reach[second]:
                        continue
                    what = resource if slot is None else f"tensor {slot['name']!r}"
                    span = "" if slot is not None else f" [{max(a.start, b.start)}, {min(a.end, b.end)})"
                    out.append(f"graph {name!r}: {_label(graph, first)} and {_label(graph, second)} "
                               f"touch {what}{span}, one of them writing, and no path of edges "
                               "orders them")
    return out


def random_manifest(rng: random.Random, n: int) -> dict:
    kernels = [{"name": "table_writer", "writes": [0]}] + [
        {"name": f"k{i}", "writes": sorted(rng.sample(range(3), rng.randint(0, 2)))} for i in range(4)]
    nodes = [WRITER]
    for j in range(1, n):
        deps = sorted(rng.sample(range(j), min(j, rng.randint(0, 3))))
        args = []
        for _ in range(3):
            r = rng.random()
            if r < 0.15:    # a whole slot: the tensor behind it
                args.append({"region": "table", "offset": rng.choice([0, 32]), "nbytes": 24})
            elif r < 0.3:   # the error word
                args.append({"region": "table", "offset": 64, "nbytes": 8, "dtype": "int64"})
            elif r < 0.4:
                args.append({"region": "table", "offset": rng.randrange(0, 80, 8), "nbytes": 8})
            elif r < 0.5:
                args.append({"word": 1})
            else:
                args.append({"region": rng.choice(["arena", "state", "weights"]),
                             "offset": rng.randrange(64), "nbytes": rng.randrange(16)})
        nodes.append({"kernel": rng.randrange(1, 5), "deps": deps, "label": f"n{j}", "args": args})
    return {"kernels": kernels, "table": TABLE,
            "graphs": [{"name": "g", "nodes": nodes}, {"name": "h", "nodes": nodes[:n // 2 + 1]}]}


def test_the_sweep_finds_exactly_the_unordered_pairs():
    """Same problems, as a multiset, as the all-pairs definition on 1,500 random graphs (reads,
    writes, error-word stores, slots, overlapping and empty ranges, sparse and dense edges)."""
    rng = random.Random(0)
    seen = 0
    for _ in range(1500):
        m = random_manifest(rng, rng.randint(1, 14))
        expected = reference_problems(m)
        assert collections.Counter(check_races(m)) == collections.Counter(expected)
        seen += len(expected)
    assert seen > 5000   # the graphs do have races to find


def big_manifest(n: int, shape: str) -> dict:
    """n nodes. "fan": every node depends only on the table writer, reads slot x and its own
    weights and writes its own arena buffer (n unordered nodes, all overlapping on x).
    "chain": every node updates one arena buffer in place, after the node before it (n writers of
    one range: n² conflicting pairs, all ordered through the chain)."""
    kernels = [{"name": "table_writer", "writes": [0]}, {"name": "k", "writes": [2]}]
    nodes = [WRITER]
    for j in range(1, n):
        if shape == "fan":
            deps = [0]
            args = [{"region": "table", "offset": 0, "nbytes": 24},
                    {"region": "weights", "offset": 0, "nbytes": 1024},
                    {"region": "arena", "offset": 256 * j, "nbytes": 256}]
        else:
            deps = [0, j - 1] if j > 1 else [0]
            args = [{"region": "arena", "offset": 0, "nbytes": 4096},
                    {"region": "table", "offset": 0, "nbytes": 24},
                    {"region": "arena", "offset": 0, "nbytes": 4096}]
        nodes.append({"kernel": 1, "deps": deps, "label": f"n{j}", "args": args})
    return {"kernels": kernels, "table": TABLE, "graphs": [{"name": "big", "nodes": nodes}]}


@pytest.mark.parametrize("shape", ["fan", "chain"])
def test_a_graph_at_the_node_cap_is_checked_in_seconds(shape):
    """At limits.MAX_NODES (16,384) the all-pairs checker took ~20 min for the chain and ~1 min
    for the fan; the sweep takes about half a second on one core (the bound here is for a loaded
    2-core CI machine). A planted missing edge in the middle is still caught, and only it."""
    n = limits.MAX_NODES
    m = big_manifest(n, shape)
    t0 = time.perf_counter()
    assert check_races(m) == []
    assert time.perf_counter() - t0 < 30

    j = n // 2
    node = m["graphs"][0]["nodes"][j]
    if shape == "chain":   # node j waits for j - 2 but no longer for j - 1: they race on the buffer
        node["deps"] = [0, j - 2]
        m["graphs"][0]["nodes"][j + 1]["deps"] = [0, j - 1, j]   # (and only they)
    else:                  # node j writes slot y's tensor, and so does a node it is not ordered with
        node["args"][2] = {"region": "table", "offset": 32, "nbytes": 24}
        m["kernels"].append({"name": "k_out", "writes": [2]})
        node["kernel"] = 2
        m["graphs"][0]["nodes"][j + 1]["args"][2] = {"region": "table", "offset": 32, "nbytes": 24}
        m["graphs"][0]["nodes"][j + 1]["kernel"] = 2
    t0 = time.perf_counter()
    problems = check_races(m)
    assert time.perf_counter() - t0 < 30
    first, second = (j - 1, j) if shape == "chain" else (j, j + 1)
    assert problems and all(f"node {first} (n{first}) and node {second} (n{second})" in p
                            for p in problems), problems[:3]


def test_a_report_of_a_hostile_graph_stays_bounded():
    """16,384 nodes that all write one buffer with no edges: 134 million racing pairs. The report
    lists MAX_PROBLEMS of them and says it stopped, in bounded time and memory."""
    n = limits.MAX_NODES
    m = big_manifest(n, "chain")
    for node in m["graphs"][0]["nodes"][1:]:
        node["deps"] = []
    t0 = time.perf_counter()
    problems = check_races(m)
    assert time.perf_counter() - t0 < 30
    assert len(problems) == MAX_PROBLEMS + 1 and "more problems not listed" in problems[-1]
