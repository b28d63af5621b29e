"""Per-kernel GPU time of a grace package run, from torch's CUDA profiler (CUPTI sees every
kernel in the process's context, ours included).

    python -m grace.tools.profile_kernels MODEL.grace [--iters 20] [--size seq=129 ...]

A package with size symbols runs at the given sizes (default: each at its maximum), so the graph of
that bucket is the one profiled.

Programmatic edges (PDL, the default for sm_90+) are built as full edges here (`load(pdl=False)`:
the same kernels): under PDL a kernel launches before its predecessor ends and its span includes
the wait at gdc_wait(), so per-kernel times overlap and their sum overcounts the call (a 1.08 ms
decode token summed to 1.6 ms). `--as-built` keeps the package's edges (the spans then overlap).

`--timeline` answers where a call's time goes when kernels overlap: per graph node, in launch
order, the time by which it moved the call's finishing line (its end minus the latest end of the
kernels before it, never negative), averaged over the iterations. These "exposed" times add up to
the call's GPU span, so with `--as-built` they show what each kernel costs the call under PDL:
its own streaming, its boundary, and any wait it could not hide. Nodes are grouped by label
(`mm_3`, `mean_1`, `mm_74+add_3023` ... the FX node names, numbered suffixes dropped) with the
weight bytes each GEMM/GEMV streams, so its rate in the graph is bytes / exposed time.
`--json FILE` keeps every node's row.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--size", action="append", default=[], metavar="NAME=VALUE",
                    help="value of a size symbol (repeatable; default: its maximum)")
    ap.add_argument("--as-built", action="store_true",
                    help="keep programmatic edges (PDL): kernel spans then include their waits and "
                         "overlap, so the per-kernel sum overcounts")
    ap.add_argument("--timeline", action="store_true",
                    help="per node label: the time each kernel adds to the call's GPU span (see "
                         "the module docstring); pair with --as-built for PDL packages")
    ap.add_argument("--json", metavar="FILE", help="with --timeline: every node's row as JSON")
    ap.add_argument("--fill", action="append", default=[], metavar="NAME=VALUE",
                    help="an integer input filled with VALUE instead of random values (repeatable),"
                         " e.g. a decode position: --fill input_pos=1000")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grace.runtime import load
    from grace.tools.cli import CliError, _symbol_sizes
    pkg = load(args.package, pdl=args.as_built)
    sess = pkg.session()
    try:
        sizes = _symbol_sizes(pkg.manifest, args.size)
    except CliError as e:
        ap.error(str(e))
    fills = {}
    for item in args.fill:
        name, _, value = item.partition("=")
        try:
            fills[name] = int(value)
        except ValueError:
            ap.error(f"--fill {item!r}: expected NAME=INTEGER")
    unknown = set(fills) - {spec["name"] for spec in pkg.manifest["inputs"]}
    if unknown:
        ap.error(f"--fill: no input named {sorted(unknown)}")
    inputs = {}
    for spec in pkg.manifest["inputs"]:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
        if spec["name"] in fills:
            inputs[spec["name"]] = torch.full(shape, fills[spec["name"]], device="cuda",
                                              dtype=getattr(torch, spec["dtype"]))
        elif spec["dtype"].startswith("int"):
            inputs[spec["name"]] = torch.randint(0, 100, shape, device="cuda")
        else:
            inputs[spec["name"]] = torch.randn(shape, device="cuda").to(getattr(torch, spec["dtype"]))
    for _ in range(5):
        sess.run(**inputs)
    sess.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            sess.run(**inputs)
        sess.sync()
    if args.timeline:
        graph = next(g for g in pkg.manifest["graphs"] if g["name"] == sess.last_graph)
        result = timeline(graph, pkg.manifest["kernels"], _kernel_spans(prof), args.iters)
        print(format_timeline(result, args.top))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"package": args.package, "graph": graph["name"],
                           "as_built": args.as_built, "iters": args.iters, **result}, f, indent=1)
        return
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    total = sum(v[0] for v in per.values()) / args.iters
    if sizes:
        print(f"sizes {sizes}: graph {sess.last_graph}")
    print(f"GPU kernel time per call: {total:.1f} us over {sum(v[1] for v in per.values()) // args.iters} launches")
    for name, (us, count) in sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{us / args.iters:9.1f} us {count // args.iters:4d}x  {name}")
    del np


def _kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, end µs) of every GPU kernel the profiler saw, in start order."""
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy")
             and not e.name.startswith("Memset")]
    return sorted(spans, key=lambda s: s[1])


def _label_group(label: str) -> str:
    """`mm_12` -> `mm`, `mm_74+add_3023` -> `mm+add`: FX numbers repeated nodes, and a fused
    kernel's label joins its nodes' with `+`; one group per kind of kernel."""
    return "+".join(re.sub(r"_\d+$", "", part) for part in label.split("+"))


def timeline(graph: dict, kernels: list, spans, iters: int) -> dict:
    """{"span_us": the mean GPU span of a call, "rows": per node of `graph` (launch order, table
    writer included) its mean exposed time} over the `iters` calls in `spans`, the kernels of one
    call each (spans of kernels no node launches are left out).

    A call's kernels are matched to nodes by name and occurrence: the k-th launch of kernel X in
    a call is the k-th node that launches X, in node order. Nodes that may run side by side can
    swap starts; matching by name keeps each span with a node of its own kernel, and the exposed
    time is computed in start order, so a swap moves time between siblings only."""
    nodes = graph["nodes"]
    per_call = len(nodes)
    names = {kernels[node["kernel"]]["name"] for node in nodes}
    others = sorted({s[0] for s in spans if s[0] not in names})
    spans = [s for s in spans if s[0] in names]
    if len(spans) != per_call * iters:
        raise SystemExit(f"profile saw {len(spans)} kernels of graph {graph['name']!r} for {iters} "
                         f"calls of {per_call} nodes (other GPU work ran in this process, or a node "
                         f"is not a kernel); kernels of no node: {others[:5] or 'none'}")
    by_kernel = defaultdict(list)
    for i, node in enumerate(nodes):
        by_kernel[kernels[node["kernel"]]["name"]].append(i)
    exposed = [0.0] * per_call
    starts = [0.0] * per_call
    durations = [0.0] * per_call
    span_us = 0.0
    gaps = []            # first kernel of a call minus the last end of the call before it
    previous_end = None
    for c in range(iters):
        call = spans[c * per_call:(c + 1) * per_call]
        if previous_end is not None:
            gaps.append(call[0][1] - previous_end)
        seen = defaultdict(int)
        frontier = call[0][1]
        for name, start, end in call:
            slots = by_kernel[name]
            if seen[name] >= len(slots):
                raise SystemExit(f"kernel {name} ran more often in one call than graph "
                                 f"{graph['name']!r} launches it")
            i = slots[seen[name]]
            seen[name] += 1
            starts[i] += start - call[0][1]
            durations[i] += end - start
            exposed[i] += max(0.0, end - frontier)
            frontier = max(frontier, end)
        span_us += frontier - call[0][1]
        previous_end = frontier
    rows = []
    for i, node in enumerate(nodes):
        weights = sum(a["nbytes"] for a in node["args"]
                      if isinstance(a, dict) and a.get("region") == "weights")
        rows.append({"node": i, "label": node.get("label", "?"),
                     "kernel": kernels[node["kernel"]]["name"], "grid": node.get("grid"),
                     "family": kernels[node["kernel"]].get("family"),
                     "weights_nbytes": weights, "exposed_us": exposed[i] / iters,
                     "start_us": starts[i] / iters, "duration_us": durations[i] / iters,
                     "programmatic": bool(node.get("programmatic"))})
    return {"span_us": span_us / iters, "rows": rows,
            "gap_between_calls_us": sum(gaps) / len(gaps) if gaps else None}


def format_timeline(result: dict, top: int) -> str:
    span, rows = result["span_us"], result["rows"]
    groups = defaultdict(lambda: [0, 0.0, 0])
    for r in rows:
        g = groups[_label_group(r["label"])]
        g[0] += 1
        g[1] += r["exposed_us"]
        # a rate only where the weights are streamed whole (a gather reads rows of its table)
        g[2] += r["weights_nbytes"] if r.get("family") == "matmul" else 0
    gap = result.get("gap_between_calls_us")
    lines = [f"GPU span per call {span:.1f} us over {len(rows)} nodes "
             f"(sum of exposed times {sum(r['exposed_us'] for r in rows):.1f} us)"
             + ("" if gap is None else f"; from one call's last end to the next one's first "
                                       f"start {gap:.1f} us (negative: they overlap)"),
             f"{'group':<32}{'nodes':>6}{'exposed us':>12}{'share':>8}{'us/node':>9}{'matmul MB':>12}"
             f"{'TB/s':>7}"]
    for name, (count, us, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        rate = f"{nbytes / us / 1e6:.2f}" if nbytes and us else "-"
        lines.append(f"{name:<32}{count:>6}{us:>12.1f}{us / span:>8.1%}{us / count:>9.2f}"
                     f"{nbytes / 1e6:>12.1f}{rate:>7}")
    lines.append(f"the {top} nodes that cost the call most (start: after the call's first "
                 f"kernel began; ran: its own span, waits included):")
    for r in sorted(rows, key=lambda r: -r["exposed_us"])[:top]:
        lines.append(f"  node {r['node']:>4}  {r['label']:<28}{r['exposed_us']:>8.2f} us  "
                     f"start {r['start_us']:>7.1f}  ran {r['duration_us']:>6.1f}  "
                     f"grid {r['grid']}  {r['weights_nbytes'] / 1e6:.1f} MB  {r['kernel']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
