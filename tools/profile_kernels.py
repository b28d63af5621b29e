"""Per-kernel GPU time of a grace package run, from torch's CUDA profiler (CUPTI sees every
kernel in the process's context, ours included).

    python -m grace.tools.profile_kernels MODEL.grace [--iters 20] [--size seq=129 ...]

A package with size symbols runs at the given sizes (default: each at its maximum), so the graph of
that bucket is the one profiled.

Programmatic edges (PDL, the default for sm_90+) are built as full edges here (`load(pdl=False)`:
the same kernels): under PDL a kernel launches before its predecessor ends and its span includes
the wait at gdc_wait(), so per-kernel times overlap and their sum overcounts the call (a 1.08 ms
decode token summed to 1.6 ms). `--as-built` keeps the package's edges (the spans then overlap).
"""
from __future__ import annotations

import argparse
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
    inputs = {}
    for spec in pkg.manifest["inputs"]:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
        if spec["dtype"].startswith("int"):
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


if __name__ == "__main__":
    main()
