"""Benchmark harness: eager, torch.compile, torch.compile(mode="reduce-overhead") and grace, side by
side in one process on one GPU, batch 1.

    python -m grace.tools.benchmark --models vit_s,gpt2_6l --out results.json

Every contender is timed the same way: warm-up calls, then `iters` back-to-back calls between two
CUDA events, repeated `repeats` times; the median of the repeats is reported in ms per call. grace
is called through its runtime with a device-resident input (`sess.run(x)`), so its number includes
the full host path of a call. The host overhead of `run()` alone is reported separately: the mean
wall time of `run()` over a short burst of calls, which the GPU's launch queue absorbs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _models():
    """name -> factory returning (model, make_input); imported lazily (timm only on the GPU box)."""
    import torch

    def vit_s():
        import timm
        return (timm.create_model("vit_small_patch16_224", pretrained=False).eval(),
                lambda: torch.randn(1, 3, 224, 224, device="cuda"))

    def gpt2_6l():
        from grace.tools import models
        return (models.hf_gpt2(n_layer=6, n_embd=768, n_head=12, vocab=50257, n_positions=1024),
                lambda: torch.randint(0, 50257, (1, 32), device="cuda"))

    return {"vit_s": vit_s, "gpt2_6l": gpt2_6l}


def time_calls(fn, iters: int, repeats: int, warmup: int) -> list[float]:
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return samples


def bench_model(name, make, iters, repeats, warmup, workdir: Path, precisions=("tf32x3",)) -> dict:
    import torch

    model, make_input = make()
    model = model.cuda().eval()
    x = make_input()
    result = {"model": name, "ms": {}, "notes": {}}
    with torch.no_grad():
        eager = lambda: model(x)  # noqa: E731
        result["ms"]["eager"] = statistics.median(time_calls(eager, iters, repeats, warmup))
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            t = time.perf_counter()
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            compiled(x)
            compiled(x)
            result["notes"][f"compile_{mode}_s"] = time.perf_counter() - t
            fn = lambda: compiled(x)  # noqa: E731
            key = "torch.compile" if mode == "default" else "reduce-overhead"
            result["ms"][key] = statistics.median(time_calls(fn, iters, repeats, warmup))
        torch._dynamo.reset()

    for prec in precisions:
        key = "grace" if prec == precisions[0] else f"grace[{prec}]"
        _bench_grace(result, key, model, x, workdir / f"{name}-{prec}.grace", prec,
                     iters, repeats, warmup)
    result["ratio_grace_over_reduce_overhead"] = result["ms"]["grace"] / result["ms"]["reduce-overhead"]
    return result


def _bench_grace(result, key, model, x, path, prec, iters, repeats, warmup):
    import torch

    from grace.aot import compile as grace_compile
    from grace.runtime import load

    t = time.perf_counter()
    grace_compile(model.cpu(), (x.cpu(),), output=path, progress=False, fp32_matmul=prec)
    notes = result["notes"]
    notes[f"{key}_compile_s"] = time.perf_counter() - t
    model.cuda()
    t = time.perf_counter()
    pkg = load(path)
    sess = pkg.session()
    sess.run(x)
    sess.sync()
    notes[f"{key}_load_s"] = time.perf_counter() - t
    notes["grace_kernels"] = pkg.manifest["graphs"][0]["stats"]["kernels"]
    result["ms"][key] = statistics.median(time_calls(lambda: sess.run(x), iters, repeats, warmup))
    # host cost of run(): a short burst, so the GPU queue absorbs it
    sess.sync()
    burst = 20
    t = time.perf_counter()
    for _ in range(burst):
        sess.run(x)
    notes[f"{key}_run_host_us"] = (time.perf_counter() - t) / burst * 1e6
    sess.sync()
    with torch.no_grad():
        ref = model(x).float()
    got = torch.from_numpy(next(iter(sess.run(x).values())).numpy()).cuda()
    notes[f"{key}_rel_err_vs_eager_tf32"] = float((got - ref).norm() / ref.norm())
    pkg.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit_s,gpt2_6l")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write the raw results as JSON")
    ap.add_argument("--fp32-matmul", default="tf32x3",
                    help="comma-separated grace precisions to time (the first is 'grace')")
    args = ap.parse_args(argv)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    available = _models()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results.append(bench_model(name, available[name], args.iters, args.repeats,
                                       args.warmup, Path(tmp),
                                       tuple(args.fp32_matmul.split(","))))
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "tf32": True}
    if args.out:
        args.out.write_text(json.dumps({"env": env, "results": results}, indent=2))
    print(f"\n{env}")
    extra = [k for r in results for k in r["ms"] if k.startswith("grace[")]
    extra = list(dict.fromkeys(extra))
    print(f"{'model':10s} {'eager':>8s} {'compile':>8s} {'red-ovh':>8s} {'grace':>8s} "
          + "".join(f"{k:>14s}" for k in extra)
          + f" {'g/ro':>6s} {'kernels':>7s} {'host us':>8s} {'rel err':>8s}")
    for r in results:
        ms, notes = r["ms"], r["notes"]
        print(f"{r['model']:10s} {ms['eager']:8.3f} {ms['torch.compile']:8.3f} "
              f"{ms['reduce-overhead']:8.3f} {ms['grace']:8.3f} "
              + "".join(f"{ms.get(k, float('nan')):14.3f}" for k in extra)
              + f" {r['ratio_grace_over_reduce_overhead']:6.2f} {notes['grace_kernels']:7d} "
              f"{notes['grace_run_host_us']:8.1f} {notes['grace_rel_err_vs_eager_tf32']:8.1e}")


if __name__ == "__main__":
    main()
