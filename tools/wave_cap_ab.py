"""A/B of the runtime's one-wave cap (runtime/occupancy.py) on a Llama decode: the defaults'
package (and each --variant's), loaded once a mode in one process, generate() timed per token
(bench_decode's paired loops), twice round.

    python3 -m grace.tools.wave_cap_ab --shape 1b --out cap-ab-1b.json     (a GPU machine)

  cap        the runtime as it is: every programmatic-edge target launched one wave wide
  nocap      no cap: every node with the kernel's own shared memory
  cap>2/SM   the cap only on grids of more than two programs per multiprocessor
  cap-attn   the cap but on the attention and its combine (their programs may then start beside
             the capped GEMV before them)
  cap-attn1  the cap but on the attention (not its combine): where the attention's registers
             and shared memory fit one program beside the QKV GEMV's six capped ones, its chain
             before the wait (table slot, position, KV blocks) need not follow QKV's end. With
             64-key blocks (--variant e4k:codegen.ATTN_SPLIT_BLOCK_ELEMS=4096: 114 registers,
             18 KiB, 256 programs) it lost 1.1% on the 1B (H100, thirty-sixth session); with
             one program a multiprocessor's worth of splits as well (e4kp1: 128 programs
             walking two blocks each) the package was ~7% slower capped and 2.6% slower
             again uncapped (thirty-seventh session)
  cap-small  the cap but on grids of at most 32 programs (means, combines, split-K sums)
  cap-combine  the cap but on the attention's combine: its 32 programs (Llama-1B) then take 2 KiB
             of shared memory, not half a multiprocessor's, so all of the o projection's capped
             programs fit beside them and load their weights before the wait (the o's weights
             are all loaded there since the thirty-first session; kernel_resources: 2 of 4 fit
             beside a capped combine). Lost 3.1% on the 1B (H100, thirty-fourth session, where
             cap-small lost 3.7%); cap-attn and cap-small lost 0.5% when the o loaded only its
             first K step early (twenty-first session)
  cap<=2/SM  the cap only on grids of at most two programs per multiprocessor (persistent GEMVs,
             attention, combines, means): the template GEMVs' many programs uncapped. The
             twentieth session's H200 figures point here: nocap gained 0.8% on the 1B (whose
             GEMVs are all the template) where cap>2/SM lost 1.3%, and the 8B lost 6% uncapped
             (its persistent GEMVs bunch)
  cap<=4/SM  the same up to four programs per multiprocessor (the 1B's o projection, 512)

Why: the cap makes a node's programs big in shared memory so its grid spreads over the chip, and
that also decides which of them fit beside the programs of the node before (what programmatic
dependent launch overlaps). It was chosen on encoders and an early decode graph (seventh
session); this times it on today's decode graphs without recompiling. The package is compiled on
the machine that runs it, as bench_decode does.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from grace.tools.variants import parse_variant

MODES = ("cap", "nocap", "cap>2/SM", "cap-attn", "cap-small", "cap-combine", "cap<=2/SM",
         "cap<=4/SM", "cap-attn1")


def cap_rules(capped, families: list) -> dict:
    """{mode: a stand-in for occupancy.cap_programmatic(plans, limits)}: `capped` is the
    runtime's; `families` the package's kernel families by kernel index."""
    def cap_unless(uncapped):
        """The cap on every node but those `uncapped(plan, limits)` picks."""
        def cap(plans, limits):
            return [p if uncapped(p, limits) else c for c, p in zip(capped(plans, limits), plans)]
        return cap

    def blocks(plan):
        return plan.grid[0] * plan.grid[1] * plan.grid[2]

    return {"cap": capped, "nocap": lambda plans, limits: list(plans),
            "cap>2/SM": cap_unless(lambda p, lim: blocks(p) <= 2 * lim.sm_count),
            "cap-attn": cap_unless(lambda p, lim: families[p.kernel] in ("attention",
                                                                         "attn_combine")),
            "cap-attn1": cap_unless(lambda p, lim: families[p.kernel] == "attention"),
            "cap-small": cap_unless(lambda p, lim: blocks(p) <= 32),
            "cap-combine": cap_unless(lambda p, lim: families[p.kernel] == "attn_combine"),
            "cap<=2/SM": lambda plans, limits: capped(plans, limits, max_per_sm=2),
            "cap<=4/SM": lambda plans, limits: capped(plans, limits, max_per_sm=4)}


def _label(variant) -> str:
    """A package's name in file names and the figures: its variant's, or "default"."""
    return variant.name if variant else "default"


def packages(variants) -> list:
    """The packages a run compiles: the defaults' (None) first, then one per variant. The
    defaults' is there with a single variant too: without it in the same process a variant's
    figures have nothing to be compared with (the thirty-seventh session's first call timed
    `e4kp1` alone, because this list held the defaults' only beside two or more variants)."""
    return [None, *variants]


def run(shape: str, pos: int = 1000, steps: int = 64, pairs: int = 5, rounds: int = 2,
        workdir: Path = Path("/tmp"), modes=MODES, variants=()) -> dict:
    """`variants`: tools.variants.Variants to compile a package each with, beside the defaults'
    (`packages`; none: the defaults' package alone), and every round times
    each package in each mode, one after the other in this process: the A/B of a compile
    option and a launch rule that only pay together (smaller attention blocks that let it start
    beside its predecessor, and the cap that keeps it off), side by side."""
    import torch
    from torch.export import Dim

    import grace.aot
    from grace.formats import read_package
    from grace.runtime import load, occupancy
    from grace.tools import bench_decode as bench
    from grace.tools.variants import applied

    builds = packages(variants)
    max_seq = 2048
    model = bench._model(shape, max_seq)
    t = Dim("seq", min=1, max=1024)
    paths = {}
    for v in builds:
        paths[v] = workdir / f"wave-cap-{shape}-{_label(v)}.grace"
        with applied(v):
            grace.aot.compile(model.cpu(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                              output=paths[v], progress=False,
                              dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                              buckets={"seq": [1, 1024]},
                              generate={"tokens": "idx", "positions": "input_pos"})
    prompt = torch.randint(0, bench.SHAPES[shape]["vocab"], (pos,),
                           generator=torch.Generator().manual_seed(1)).numpy()
    capped = occupancy.cap_programmatic
    rules = {v: cap_rules(capped, [k.family for k in read_package(p, verify=False).view.kernels])
             for v, p in paths.items()}
    res = {"shape": shape, "pos": pos, "steps": steps, "modes": {},
           "variants": {v.name: v.describe() for v in builds if v}}
    try:
        for _ in range(rounds):
            for v, path in paths.items():
                for mode in modes:
                    name = mode if len(paths) == 1 else f"{_label(v)}/{mode}"
                    occupancy.cap_programmatic = rules[v][mode]
                    pkg = load(path, instantiate="eager")
                    sess = pkg.session()
                    sess.generate(prompt, 4)   # warm

                    def timed(n):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        sess.generate(prompt, n)
                        return time.perf_counter() - t0

                    ms, prefill, each = bench.generate_ms_per_token(timed, steps, pos, max_seq,
                                                                    pairs)
                    res["modes"].setdefault(name, []).append(
                        {"ms_per_token": ms, "prefill_ms": prefill, "pairs": each})
                    print(f"{name:11s} generate() {ms:.4f} ms/token  pairs "
                          f"{[round(p, 3) for p in each]}  prefill {prefill:.1f} ms", flush=True)
                    sess.close()
                    pkg.close()
    finally:
        occupancy.cap_programmatic = capped
        for path in paths.values():
            path.unlink(missing_ok=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("1b", "8b", "tiny"), default="1b")
    ap.add_argument("--pos", type=int, default=1000, help="prompt length (default 1000)")
    ap.add_argument("--rounds", type=int, default=2, help="times each mode is loaded and timed")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    ap.add_argument("--variant", metavar="NAME:module.CONSTANT=VALUE,...", action="append",
                    help="also compile a package with these grace.aot constants "
                         "(tools/variants.py), e.g. e4k:codegen.ATTN_SPLIT_BLOCK_ELEMS=4096; "
                         "repeatable: one package each, timed in every mode beside the "
                         "defaults' package")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    a = ap.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        ap.error(f"--modes: unknown {unknown or 'none given'}; choose from {', '.join(MODES)}")
    try:
        variants = [parse_variant(v) for v in a.variant or ()]
    except ValueError as e:
        ap.error(str(e))
    names = {v.name for v in variants}
    if len(names) < len(variants) or _label(None) in names:
        ap.error(f"--variant: each needs a name of its own, and not {_label(None)!r}")
    res = run(a.shape, pos=a.pos, rounds=a.rounds, workdir=a.workdir, modes=modes,
              variants=variants)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
