"""GEMM tiles timed on the kernels a whole model generates: the measured table for M >= 128
(issue 8, item 5), from the model's own GEMMs instead of a mirror of the template.

    python -m grace.tools.tile_sweep --model vit_s --fp32-matmul tf32 --out sweep.json \\
        --table tiles.json
    python -m grace.tools.tile_sweep --model vit_s --tiles 64x64x32w4s3,64x64x32w4s3k2 --out sweep.json

Why: the first table (tools/gemm_sweep.py) timed a mirror of the GEMM template on bare operands,
and lost on whole models (docs/performance.md, sixth session): the generated kernels load A
through the expression emitter (a LayerNorm's output, a convolution's im2col gather) and sit
between other kernels. Here each candidate is timed where it will run.

How: the model is compiled once with the heuristic's plans and once per candidate tile, with
every GEMM of >= 128 rows forced to that tile (`gemm_tiles.forced`), each compile recording which
kernel computes which GEMM (operand kind, M, N, K: a split-K GEMM's reduction kernel counts with
it). Each package runs on the GPU, in a process of its own, and CUPTI (the torch profiler) times
its kernels; its output must match the heuristic package's, and a GEMM whose kernels the profile
does not show is left out of that candidate, never counted as free. Packages are compiled as they
ship (PDL, with its weight prefetch) but loaded with full edges
(`load(pdl=False)`): under PDL a kernel's span includes its wait for the kernel before it, so
per-kernel times overlap and overcount (a decode token of 1.08 ms summed to 1.6 ms of kernels).

Output: `--out` every timing per GEMM and candidate (merged into the file when it exists, so a
long sweep can be split over runs with `--tiles`); `--table` the fastest candidate per GEMM in the
format of aot/gemm_tiles/<arch>.json (with `split`), merged into that file when it exists (an
entry of the same shape replaced), so `--table aot/gemm_tiles/sm_90.json` extends the table the
compiler reads by default with another model's GEMMs; `--from-out` writes the table from a sweep
cut short. The table is per GPU: run this on the GPU it is for. Times are per call, summed over
the model's instances of a GEMM shape (ViT-S runs each of its four shapes 12 times).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

# Candidates for 128..1024 rows: 32- and 64-row tiles with fewer programs than the heuristic's,
# narrower N tiles, deeper K steps and pipelines, and split-K for the deep-K projections whose
# output is too small to fill the chip (ViT-S's N = 384 GEMMs: 24 programs of 64 x 64). On ViT-S
# (H200, docs/performance.md, ninth session) split-K by 4 won four of five shapes and no 128-row
# tile or 64 x 128 won any (they ran 1.3-2.2x slower in all), so the list leans to split-K. A
# compile of ViT-S takes ~4 s on the GPU machine and its timing process ~8 s: minutes per sweep.
DEFAULT_TILES = ("32x32x64w4s3", "32x64x64w4s3", "32x64x64w4s4", "64x32x64w4s4", "64x64x32w4s3",
                 "64x64x64w4s4", "32x32x64w4s3k2", "32x64x64w4s3k2", "32x64x64w4s4k2",
                 "64x32x64w4s3k2", "64x64x32w4s3k2", "64x64x64w4s3k2", "32x64x64w4s4k4",
                 "64x32x64w4s4k4", "64x64x32w4s3k4", "64x64x64w4s4k4", "64x64x32w4s3k8",
                 "64x32x64w4s4k8")
ITERS = 20
# a candidate's output against the heuristic's (tf32 dots differ by ~1e-3 in the reduction order)
MAX_REL_ERROR = 2e-2
_TILE = re.compile(r"^(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:k(\d+))?$")


def _log(msg: str) -> None:
    print(f"[tile_sweep] {msg}", file=sys.stderr, flush=True)


def parse_tile(text: str):
    """'64x64x32w4s3' (bm x bn x bk, warps, stages) with an optional 'k2' (split-K) -> Tile."""
    from grace.aot.gemm_tiles import Tile

    m = _TILE.match(text.strip())
    if not m:
        raise ValueError(f"tile {text!r}: expected BMxBNxBKwWARPSsSTAGES[kSPLIT], "
                         "e.g. 64x64x32w4s3 or 64x64x32w4s3k2")
    bm, bn, bk, warps, stages = (int(g) for g in m.groups()[:5])
    split = int(m.group(6) or 1)
    for name, v in (("bm", bm), ("bn", bn), ("bk", bk), ("warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"tile {text!r}: {name} must be a power of two")
    if stages < 1 or split < 1:
        raise ValueError(f"tile {text!r}: stages and split are at least 1")
    return Tile(bm, bn, bk, warps, stages, split)


def tile_name(tile) -> str:
    if tile is None:
        return "heuristic"
    return (f"{tile.bm}x{tile.bn}x{tile.bk}w{tile.warps}s{tile.stages}"
            + (f"k{tile.split}" if tile.split > 1 else ""))


def gemm_key(spec) -> str | None:
    """'kind M N K' of a Matmul spec with >= MIN_ROWS rows (the GEMMs a table tiles), else None."""
    from grace.aot import codegen, gemm_tiles

    if spec.m < gemm_tiles.MIN_ROWS:
        return None
    dot = codegen._dot_dtype(spec.a, spec.b)
    kind = gemm_tiles.operand_kind(dot, spec.fp32_precision)
    return None if kind is None else f"{kind} {spec.m} {spec.n} {spec.k}"


@contextmanager
def recording_gemms(found: dict):
    """While compiling: found[kernel name] = the GEMM key it computes (a split-K GEMM's reduction
    kernel gets its GEMM's key), through the codegen stage's calls to codegen.generate."""
    from grace.aot import codegen
    from grace.aot.families import Matmul, Reduction

    original = codegen.generate
    partial_of: dict[int, str] = {}

    def generate(kernel, *args, **kwargs):
        source = original(kernel, *args, **kwargs)
        spec = kernel.spec
        if isinstance(spec, Matmul):
            key = gemm_key(spec)
            if key is not None:
                found[source.name] = key
                if spec.plan.split > 1:
                    partial_of[kernel.out.index] = key
        elif isinstance(spec, Reduction):
            owners = {partial_of[b.index] for b in kernel.reads() if b.index in partial_of}
            if len(owners) == 1:
                found[source.name] = owners.pop()
        return source

    codegen.generate = generate
    try:
        yield found
    finally:
        codegen.generate = original


def compile_with(model, example, path: Path, tile, fp32_matmul: str) -> dict:
    """Compile `model` with every GEMM of >= 128 rows on `tile` (None: the heuristic);
    {kernel name: GEMM key}."""
    import grace.aot
    from grace.aot import gemm_tiles

    found: dict = {}
    with recording_gemms(found), gemm_tiles.forced(tile):
        grace.aot.compile(model, (example,), output=path, progress=False, fp32_matmul=fp32_matmul)
    return found


def per_gemm_us(kernel_us: dict, kernels: dict) -> tuple[dict, set]:
    """({GEMM key: µs per call}, {GEMM keys left out}) from {kernel name: µs per call} and the
    compile's kernel map. A GEMM one of whose kernels the profile never saw is left out, not
    counted as free: a missing kernel is a measurement fault, never a fast tile."""
    out: dict = defaultdict(float)
    missing: set = set()
    for name, key in kernels.items():
        if name in kernel_us:
            out[key] += kernel_us[name]
        else:
            missing.add(key)
    return {k: v for k, v in out.items() if k not in missing}, missing


def time_kernels(path: Path, inputs: Path, iters: int = ITERS) -> tuple[dict, object]:
    """({kernel name: µs per call}, the first output) of one package on the GPU, by CUPTI, its
    edges built full (the kernels' spans do not overlap).

    Each package is timed in a process of its own: when every candidate was loaded, profiled and
    closed in one process, later packages' kernels were reported under names that were not
    theirs (most likely CUPTI's record of an earlier package's functions at reused addresses),
    and the first GPU run of this tool credited five GEMMs with 0 µs."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="tile_sweep-time-") as tmp:
        out = Path(tmp) / "result"
        proc = subprocess.run([sys.executable, "-m", "grace.tools.tile_sweep", "--time-package",
                               str(path), str(inputs), str(out), str(iters)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"timing {path.name} failed: {proc.stderr.strip()[-1500:]}")
        times = json.loads(out.with_suffix(".json").read_text())
        return times, np.load(out.with_suffix(".npy"))


def _time_package(path: str, inputs: str, out: str, iters: str) -> None:
    """The child of time_kernels: load, warm up, profile `iters` calls, write the result."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grace.runtime import load

    pkg = load(path, pdl=False)
    sess = pkg.session()
    x = torch.load(inputs).cuda()
    for _ in range(5):
        result = sess.run(x)
    sess.sync()
    np.save(out + ".npy", np.asarray(next(iter(result.values())).numpy(), np.float32))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(int(iters)):
            sess.run(x)
        sess.sync()
    per: dict = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name] += getattr(e, "device_time_total", None) or e.cuda_time_total
    Path(out + ".json").write_text(json.dumps({k: v / int(iters) for k, v in per.items()}))
    sess.close()
    pkg.close()


def rel_error(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64 (a candidate must compute what the heuristic does)."""
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def best_table(results: dict) -> list[dict]:
    """The fastest candidate per GEMM: `results` is {GEMM key: {tile name: µs}} (with
    "heuristic"); entries in the format of aot/gemm_tiles/<arch>.json. A GEMM no candidate beats
    keeps the heuristic, and gets no entry."""
    entries = []
    for key, times in sorted(results.items()):
        heur = times.get("heuristic")
        cands = {t: us for t, us in times.items() if t != "heuristic"}
        if not cands:
            continue
        name, us = min(cands.items(), key=lambda kv: kv[1])
        if heur is not None and heur <= us:
            continue
        tile = parse_tile(name)
        kind, m, n, k = key.split()
        entries.append({"kind": kind, "M": int(m), "N": int(n), "K": int(k), "bm": tile.bm,
                        "bn": tile.bn, "bk": tile.bk, "warps": tile.warps, "stages": tile.stages,
                        "split": tile.split, "us": round(us, 2),
                        "heuristic_us": None if heur is None else round(heur, 2)})
    return entries


def write_table(path: Path, entries: list[dict], model: str, gpu: str, command: str) -> dict:
    """Write `entries` (best_table's, measured on `model`) as a tile table at `path`, merged into
    the table already there: an entry of the same (kind, M, N, K) is replaced, the others kept,
    so one table grows over the models swept on a GPU. A table of another GPU is not merged
    into (its tiles were timed elsewhere): that is an error."""
    table = {"gpu": gpu, "entries": [], "sweeps": []}
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("gpu") != gpu:
            raise SystemExit(f"tile_sweep: {path} holds tiles timed on {old.get('gpu')!r}, not on "
                             f"this {gpu!r}; write the table to another file")
        table["entries"] = [e for e in old.get("entries", []) if "bm" in e]
        table["sweeps"] = old.get("sweeps") or (
            [{k: old[k] for k in ("model", "date", "command") if k in old}] if "command" in old
            else [])
    shape = lambda e: (e["kind"], e["M"], e["N"], e["K"])   # noqa: E731
    new = {shape(e): {**e, "model": model} for e in entries}
    table["entries"] = sorted([e for e in table["entries"] if shape(e) not in new]
                              + list(new.values()), key=shape)
    table["sweeps"].append({"model": model, "date": datetime.date.today().isoformat(),
                            "command": command})
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def summary(results: dict) -> list[str]:
    tiles = sorted({t for times in results.values() for t in times},
                   key=lambda t: (t != "heuristic", t))
    lines = [f"{'GEMM (kind M N K)':<24}" + "".join(f"{t:>16}" for t in tiles)]
    for key, times in sorted(results.items()):
        best = min(times.values())
        cells = []
        for t in tiles:
            us = times.get(t)
            cells.append(f"{'-':>16}" if us is None else f"{us:15.1f}{'*' if us == best else ' '}")
        lines.append(f"{key:<24}" + "".join(cells))
    totals = {t: sum(times.get(t, 0.0) for times in results.values()) for t in tiles
              if all(t in times for times in results.values())}
    lines.append(f"{'all GEMMs, µs/call':<24}" + "".join(
        f"{totals[t]:16.1f}" if t in totals else f"{'-':>16}" for t in tiles))
    best_sum = sum(min(times.values()) for times in results.values())
    lines.append(f"fastest per GEMM combined: {best_sum:.1f} µs/call "
                 "(* marks each GEMM's fastest; times summed over the model's instances)")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--time-package"]:   # the child process of time_kernels
        return _time_package(*argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="vit_s",
                    help="a model of grace.tools.benchmark (vit_s, gpt2_6l, mobilebert, resnet50, "
                         "..., a _bf16 suffix for bf16); default vit_s")
    ap.add_argument("--fp32-matmul", default="tf32", choices=("tf32", "tf32x3"),
                    help="fp32 dots (the table's operand kind); default tf32, as the benchmark")
    ap.add_argument("--tiles", help="comma-separated candidates BMxBNxBKwWARPSsSTAGES[kSPLIT] "
                                    f"(default: {','.join(DEFAULT_TILES)})")
    ap.add_argument("--iters", type=int, default=ITERS, help="profiled calls per package")
    ap.add_argument("--out", type=Path, help="every timing as JSON (merged into an existing file)")
    ap.add_argument("--table", type=Path,
                    help="the fastest candidate per GEMM, as a tile table (merged into the file when "
                         "it exists: aot/gemm_tiles/<arch>.json grows by this model's GEMMs)")
    ap.add_argument("--workdir", type=Path, help="where the packages go (default: a temp dir)")
    ap.add_argument("--from-out", action="store_true",
                    help="time nothing: write --table (and the summary) from the timings already in "
                         "--out, e.g. of a sweep that was cut short")
    args = ap.parse_args(argv)
    if args.from_out:
        if not (args.out and args.out.exists() and args.table):
            ap.error("--from-out needs an existing --out file and a --table to write")
        record = json.loads(args.out.read_text())
        write_table(args.table, best_table(record["results"]), record["model"], record["gpu"],
                    "python -m grace.tools.tile_sweep " + " ".join(argv))
        print("\n".join(summary(record["results"])))
        return
    try:
        tiles = [parse_tile(t) for t in (args.tiles.split(",") if args.tiles else DEFAULT_TILES)]
    except ValueError as e:
        ap.error(str(e))
    import torch

    from grace.tools.benchmark import _models

    models = _models()
    if args.model not in models:
        ap.error(f"unknown model {args.model!r}; known: {', '.join(sorted(models))}")
    if not torch.cuda.is_available():
        ap.error("needs a GPU (the kernels are timed there)")
    model, make_input = models[args.model]()
    example = make_input().cpu()
    model = model.cpu()

    results: dict = {}
    errors: dict = {}
    record = {"model": args.model, "fp32_matmul": args.fp32_matmul,
              "gpu": torch.cuda.get_device_name(), "results": results, "rel_error": errors}
    if args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        if (old.get("model"), old.get("fp32_matmul")) == (args.model, args.fp32_matmul):
            results.update(old.get("results", {}))
            errors.update(old.get("rel_error", {}))
    candidates = [None] + tiles   # the heuristic first: every candidate's output is checked on it
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tile_sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = work / "input.pt"
    torch.save(example, inputs)
    reference = None
    for i, tile in enumerate(candidates):
        name = tile_name(tile)
        t0 = time.perf_counter()
        path = work / f"{args.model}-{name}.grace"
        try:
            kernels = compile_with(model, example, path, tile, args.fp32_matmul)
            kernel_us, output = time_kernels(path, inputs, args.iters)
        except Exception as e:   # a tile that does not build (shared memory) is skipped
            _log(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            if tile is None:   # without the heuristic's package there is nothing to check against
                raise SystemExit(f"tile_sweep: the heuristic's package of {args.model} failed: {e}")
            continue
        finally:
            path.unlink(missing_ok=True)
        if reference is None:
            reference = output
        err = errors[name] = rel_error(output, reference)
        if err > MAX_REL_ERROR:
            _log(f"{name}: output differs from the heuristic's by {err:.2e} (> {MAX_REL_ERROR}): "
                 "left out")
            continue
        us, missing = per_gemm_us(kernel_us, kernels)
        if missing:
            unmatched = sorted((k for k in kernel_us if k not in kernels and "matmul" in k))
            _log(f"{name}: the profile lacks kernels of {sorted(missing)} (left out); "
                 f"matmul kernels it has that the compile did not record: {unmatched[:6]}")
        for key, v in us.items():
            results.setdefault(key, {})[name] = v
        _log(f"[{i + 1}/{len(candidates)}] {name}: {sum(us.values()):.1f} µs of GEMMs per call "
             f"over {len(us)} shapes, rel. error {err:.1e} ({time.perf_counter() - t0:.0f} s)")
        if args.out:
            args.out.write_text(json.dumps(record, indent=1))
    if args.table:
        write_table(args.table, best_table(results), args.model, record["gpu"],
                    "python -m grace.tools.tile_sweep " + " ".join(argv))
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
