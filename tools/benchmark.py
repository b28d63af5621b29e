"""Benchmark harness: eager, torch.compile, torch.compile(mode="reduce-overhead") and grace, side by
side in one process on one GPU, batch 1.

    python -m grace.tools.benchmark --models vit_s,gpt2_6l --out results.json
    python -m grace.tools.benchmark --models bert_base_dyn --out bert-dyn.json

Static workloads (vit_s, gpt2_6l): every contender is timed the same way: warm-up calls, then
`iters` back-to-back calls between two CUDA events, repeated `repeats` times; the median of the
repeats is reported in ms per call. grace is called through its runtime with a device-resident
input (`sess.run(x)`), so its number includes the full host path of a call. The host overhead of
`run()` alone is reported separately: the mean wall time of `run()` over a short burst of calls,
which the GPU's launch queue absorbs.

Dynamic workload (bert_base_dyn: HF BERT-base, random init, fp32, batch 1, sequence 1..512): ONE
grace package compiled with a dynamic sequence dimension (shape buckets; `--buckets seq=...`
overrides the compiler's default) serves every length. Measured, per contender:
  - a mixed stream of `--stream-calls` random lengths in [1, 512] (fixed `--seed`; inputs made on
    the GPU before timing), timed twice with wall clock between two synchronizes: the first
    (cold) pass includes whatever the contender builds on first sight of a length (torch.compile
    recompiles, CUDA-graph recordings; grace's lazy graph instantiations); the second pass (warm)
    repeats the same stream. torch.compile contenders also report what they built (see
    `_TorchCounts`), grace the graphs it instantiated;
  - fixed lengths (`--dyn-lengths`, default 100, 129, 300) timed like the static workloads. The
    torch.compile figures come from the same compiled model after the stream, i.e. from the
    dynamic-shape graph that torch's automatic dynamic shapes settled on (what a server that sees
    varying lengths runs), not from a graph specialised to that one length;
  - grace's host time of run() at length 129, its output's error against eager at each fixed
    length, and its package: graph count, bucket, kernels and arena bytes per graph.
torch.compile contenders are isolated from each other with torch._dynamo.reset(); a contender that
fails is recorded under "errors" and the others still run.

`--backend-ab` adds the contender grace-backend: `torch.compile(model, backend="grace")`
(aot/backend.py), i.e. grace's pipeline behind Dynamo instead of an offline package: static
workloads time it like the others (its compile time, host µs per call with the per-call weight
check, error against eager, any graph that fell back to eager: `grace-backend_fallbacks`, and a
failure: `grace-backend_error`);
the dynamic workload runs it like the torch.compile contenders (automatic dynamic shapes: a
static graph first, then one with a dynamic sequence, bucketed; `--buckets seq=...` reaches it as
options={"buckets": {"input_ids.1": ...}}). Cold passes include torch.compile's
compile time, which inductor's on-disk caches shorten on a later run (and for reduce-overhead
after the default mode); TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 gives cache-free cold figures.
--out is rewritten after each workload and each dynamic contender, so a run cut short keeps
what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from grace.tools.variants import applied, nodes_changed, parse_variant

# the dynamic workload: HF BERT-base, batch 1, sequence length 1..MAX_SEQ
BERT_BASE = dict(layers=12, hidden=768, heads=12, vocab=30522, max_pos=512)
MIN_SEQ, MAX_SEQ = 1, 512
BERT_STATIC_SEQ = 256   # the static bert_base workload's length
EXPORT_SEQ = 129        # example length for torch.export (any length in range but 0/1 works)
HOST_SEQ = 129          # length at which grace's run() host time is measured
HOST_BURST = 20         # run() calls per host-time burst: few enough for the GPU queue to absorb
DYN_CONTENDERS = ("eager", "torch.compile", "reduce-overhead", "grace")


def _log(msg: str) -> None:
    """Progress on stderr: a dynamic run takes minutes and stdout ends with the table."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:2000]


def _models():
    """name -> factory returning (model, make_input); imported lazily (timm only on the GPU box)."""
    import torch

    def vit_s(dtype):
        def make():
            import timm
            torch.manual_seed(0)
            model = timm.create_model("vit_small_patch16_224", pretrained=False).eval().to(dtype)
            return model, lambda: torch.randn(1, 3, 224, 224, device="cuda", dtype=dtype)
        return make

    def gpt2_6l(dtype):
        def make():
            from grace.tools import models
            torch.manual_seed(0)
            model = models.hf_gpt2(n_layer=6, n_embd=768, n_head=12, vocab=50257,
                                   n_positions=1024).to(dtype)
            return model, lambda: torch.randint(0, 50257, (1, 32), device="cuda")
        return make

    def mobilebert(dtype):
        def make():   # google/mobilebert-uncased's configuration (24 layers), random weights
            from transformers import MobileBertConfig, MobileBertModel
            from grace.tools.models import _first_output
            torch.manual_seed(0)
            cfg = MobileBertConfig(attn_implementation="sdpa")
            model = _first_output(MobileBertModel(cfg, add_pooling_layer=False).eval()).to(dtype)
            return model, lambda: torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
        return make

    def bert_base(dtype):
        def make():   # bert_base_dyn's model at one length: its seq=256 bucket's shapes (a sweep)
            from grace.tools import models
            torch.manual_seed(0)
            model = models.hf_bert(**BERT_BASE).eval().to(dtype)
            return model, lambda: torch.randint(0, BERT_BASE["vocab"], (1, BERT_STATIC_SEQ),
                                                device="cuda")
        return make

    def cnn(name, dtype):
        def make():
            import timm
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).eval().to(dtype)
            return model, lambda: torch.randn(1, 3, 224, 224, device="cuda", dtype=dtype)
        return make

    found = {}
    for name, make in (("vit_s", vit_s), ("gpt2_6l", gpt2_6l), ("mobilebert", mobilebert),
                       ("bert_base", bert_base)):
        found[name] = make(torch.float32)
        found[f"{name}_bf16"] = make(torch.bfloat16)
    for name in CNNS:
        found[name] = cnn(name, torch.float32)
        found[f"{name}_bf16"] = cnn(name, torch.bfloat16)
    return found


# static transformers: timm ViT-S/16 (224x224), HF GPT-2 with 6 layers (32 tokens), HF MobileBERT
# (128 tokens), HF BERT-base (256 tokens: the shapes of bert_base_dyn's seq=256 bucket, for
# tile_sweep); random weights, batch 1; `<name>_bf16` runs the same model in bf16
TRANSFORMERS = ("vit_s", "gpt2_6l", "mobilebert", "bert_base")
# timm CNNs (random weights, batch 1, 224x224); `<name>_bf16` runs the same model in bf16
CNNS = ("resnet50", "mobilenetv3_small_100", "efficientnet_b0", "convnext_tiny", "regnety_002")


DYNAMIC_MODELS = ("bert_base_dyn",)


# ------------------------------------------------------------------------------------------------
# timing primitives
# ------------------------------------------------------------------------------------------------


def time_calls(fn, iters: int, repeats: int, warmup: int) -> list[float]:
    """ms per call of `fn`, one sample per repeat: `iters` calls between two CUDA events."""
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


def host_us(fn, sync, burst: int = HOST_BURST) -> float:
    """Mean host (wall) µs of `fn` over a short burst after a sync: the GPU queue absorbs the
    launches, so this is the caller's cost of a call, not the GPU time."""
    sync()
    t = time.perf_counter()
    for _ in range(burst):
        fn()
    dt = (time.perf_counter() - t) / burst * 1e6
    sync()
    return dt


def time_stream(fn, inputs) -> float:
    """Seconds of wall clock for one pass of `fn` over `inputs`, synchronized on both ends.

    Lengths differ call to call, so per-call CUDA events would add nothing: the total over the
    stream divided by its length is the figure reported.
    """
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def mixed_lengths(n: int, lo: int = MIN_SEQ, hi: int = MAX_SEQ, seed: int = 0) -> list[int]:
    """`n` sequence lengths drawn uniformly from [lo, hi] with a fixed seed: the same stream for
    every contender and every run (Python's own RNG, so no torch/numpy version changes it)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    if n < 1:
        raise ValueError(f"need at least one call in the stream, got {n}")
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def rel_err(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ in float32."""
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------------------
# static workloads
# ------------------------------------------------------------------------------------------------


def bench_model(name, make, iters, repeats, warmup, workdir: Path, precisions=("tf32x3",),
                pdl_ab: bool = False, backend_ab: bool = False, tiles_ab: bool = False,
                variants=()) -> dict:
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
    if pdl_ab:   # the same model and precision without programmatic dependent launch
        _bench_grace(result, "grace[no-pdl]", model, x, workdir / f"{name}-no-pdl.grace", precisions[0],
                     iters, repeats, warmup, pdl=False)
    if tiles_ab:   # the tile heuristic for every GEMM ('grace' takes aot/gemm_tiles/'s table)
        _bench_grace(result, "grace[no-gemm-tiles]", model, x, workdir / f"{name}-no-tiles.grace",
                     precisions[0], iters, repeats, warmup, gemm_tiles=False)
    for variant in variants:   # compiler constants set for one compile (tools/variants.py)
        with applied(variant):
            _bench_grace(result, f"grace[{variant.name}]", model, x,
                         workdir / f"{name}-{variant.name}.grace", precisions[0], iters, repeats,
                         warmup)
        result["notes"][f"grace[{variant.name}]_settings"] = variant.describe()
        result["notes"][f"grace[{variant.name}]_nodes_changed"] = _variant_changes(
            name, variant, workdir / f"{name}-{precisions[0]}.grace",
            workdir / f"{name}-{variant.name}.grace")
    if backend_ab:   # the same pipeline behind torch.compile (aot/backend.py)
        _bench_backend(result, model, x, precisions[0], iters, repeats, warmup)
    result["ratio_grace_over_reduce_overhead"] = result["ms"]["grace"] / result["ms"]["reduce-overhead"]
    return result


def _bench_grace(result, key, model, x, path, prec, iters, repeats, warmup, pdl=None,
                 **options):
    import torch

    from grace.aot import compile as grace_compile
    from grace.runtime import load

    t = time.perf_counter()
    grace_compile(model.cpu(), (x.cpu(),), output=path, progress=False, fp32_matmul=prec, pdl=pdl,
                  **options)
    notes = result["notes"]
    notes[f"{key}_compile_s"] = time.perf_counter() - t
    model.cuda()
    t = time.perf_counter()
    pkg = load(path)
    sess = pkg.session()
    sess.run(x)
    sess.sync()
    notes[f"{key}_load_s"] = time.perf_counter() - t
    # per contender: an A/B package (no PDL, no tile table) has kernels of its own, and the
    # table's "kernels" column is the 'grace' contender's
    kernels_key = "grace_kernels" if key == "grace" else f"{key}_kernels"
    notes[kernels_key] = pkg.manifest["graphs"][0]["stats"]["kernels"]
    result["ms"][key] = statistics.median(time_calls(lambda: sess.run(x), iters, repeats, warmup))
    notes[f"{key}_run_host_us"] = host_us(lambda: sess.run(x), sess.sync)
    with torch.no_grad():
        ref = model(x).float()
    got = torch.from_numpy(next(iter(sess.run(x).values())).numpy()).cuda()
    notes[f"{key}_rel_err_vs_eager_tf32"] = rel_err(got, ref)
    pkg.close()


BACKEND = "grace-backend"   # torch.compile(model, backend="grace") (--backend-ab)


def backend_options(precision: str, buckets: dict | None = None) -> dict:
    """torch.compile(..., backend="grace", options=...) of the grace-backend contender: the grace
    contender's precision; the dynamic workload's `--buckets seq=...` named as Dynamo names the
    dim (the model's argument `input_ids`, dim 1)."""
    options = {"fp32_matmul": precision}
    if buckets and buckets.get("seq"):
        options["buckets"] = {"input_ids.1": list(buckets["seq"])}
    return options


def _backend_fallbacks(caught) -> list[str]:
    """The GraceBackendWarnings among `caught` (a graph, or calls, that ran eagerly), logged too:
    a grace-backend figure with a fallback is partly eager's."""
    from grace.aot.backend import GraceBackendWarning

    found = [str(w.message) for w in caught if issubclass(w.category, GraceBackendWarning)]
    for msg in found:
        _log(f"{BACKEND}: {msg[:300]}")
    return found


def _bench_backend(result, model, x, prec, iters, repeats, warmup):
    """The grace-backend contender on a static workload: compiled by Dynamo's first calls (the
    compile time includes Dynamo's capture, grace's compile and the package's load), then timed
    like the others."""
    import warnings

    import torch

    from grace.aot.backend import compiled_graphs   # (importing grace.aot registers "grace")

    notes = result["notes"]
    torch._dynamo.reset()
    before = {id(g) for g in compiled_graphs()}   # an earlier workload's, not yet collected
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = time.perf_counter()
            compiled = torch.compile(model, backend="grace", options=backend_options(prec))
            compiled(x)
            compiled(x)
            torch.cuda.synchronize()
            notes[f"{BACKEND}_compile_s"] = time.perf_counter() - t
        notes[f"{BACKEND}_fallbacks"] = _backend_fallbacks(caught)
        with torch.no_grad():
            fn = lambda: compiled(x)  # noqa: E731
            result["ms"][BACKEND] = statistics.median(time_calls(fn, iters, repeats, warmup))
            notes[f"{BACKEND}_call_host_us"] = host_us(fn, torch.cuda.synchronize)
            notes[f"{BACKEND}_rel_err_vs_eager_tf32"] = rel_err(compiled(x), model(x))
        notes[f"{BACKEND}_graphs"] = [{"label": g.label, "calls": dict(g.calls),
                                       "eager_reason": g.eager_reason}
                                      for g in compiled_graphs() if id(g) not in before]
    except Exception as e:  # noqa: BLE001 - the other contenders' figures still count
        notes[f"{BACKEND}_error"] = _error(e)
        _log(f"{result['model']}: {BACKEND} failed: {notes[f'{BACKEND}_error'][:300]}")
    finally:
        torch._dynamo.reset()


def format_static_table(results: list[dict]) -> str:
    """The static workloads' summary: ms per call per contender, grace ÷ reduce-overhead, kernels,
    host µs of run() and grace's error against eager."""
    extra = list(dict.fromkeys(k for r in results for k in r["ms"]
                               if k.startswith("grace[") or k == BACKEND))
    lines = [f"{'model':10s} {'eager':>8s} {'compile':>8s} {'red-ovh':>8s} {'grace':>8s} "
             + "".join(f"{k:>14s}" for k in extra)
             + f" {'g/ro':>6s} {'kernels':>7s} {'host us':>8s} {'rel err':>8s}"]
    for r in results:
        ms, notes = r["ms"], r["notes"]
        lines.append(
            f"{r['model']:10s} {ms['eager']:8.3f} {ms['torch.compile']:8.3f} "
            f"{ms['reduce-overhead']:8.3f} {ms['grace']:8.3f} "
            + "".join(f"{ms.get(k, float('nan')):14.3f}" for k in extra)
            + f" {r['ratio_grace_over_reduce_overhead']:6.2f} {notes['grace_kernels']:7d} "
            f"{notes['grace_run_host_us']:8.1f} {notes['grace_rel_err_vs_eager_tf32']:8.1e}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# dynamic workload: one package, every sequence length
# ------------------------------------------------------------------------------------------------


class _TorchCounts:
    """What torch.compile built during a block: dynamo graphs and CUDA-graph recordings.

    - `dynamo_graphs`: delta of torch._dynamo.utils.counters["stats"]["unique_graphs"], the FX
      graphs dynamo captured and handed to inductor. The first compile is 1; every recompile
      (a new length breaking a guard, the switch to a dynamic-shape graph, the 0/1
      specialisation of length 1) adds 1 (graph breaks would add more per compile).
    - `frames_compiled`: delta of counters["frames"]["ok"] (frames dynamo converted).
    - `cudagraph_warmups` / `cudagraph_recordings`: calls of inductor's CUDAGraphTreeManager
      `run_eager` on a function not yet warmed up, and `record_function`. reduce-overhead keeps
      one CUDA graph per distinct set of symbolic-int values (here: per sequence length): a new
      length first runs one warm-up, and its graph is recorded on its next call. These two
      methods are private inductor API, patched for the duration of the block; when they are
      missing (another torch version) the counts are None.
    - `inductor`: the delta of every counters["inductor"] entry, raw, for anything else.
    """

    def __init__(self):
        self.result: dict = {}
        self._patched: list = []
        self._warmups = self._recordings = 0

    def __enter__(self):
        from torch._dynamo.utils import counters
        self._before = {k: dict(v) for k, v in counters.items()}
        self._patch_cudagraph_trees()
        return self

    def _patch_cudagraph_trees(self) -> None:
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as M
            record, run_eager = M.record_function, M.run_eager
        except (ImportError, AttributeError):
            return
        counts = self

        def record_function(mgr, *args, **kwargs):
            counts._recordings += 1
            return record(mgr, *args, **kwargs)

        def run_eager_(mgr, *args, **kwargs):
            function_id = args[1] if len(args) > 1 else kwargs.get("function_id")
            if function_id not in getattr(mgr, "warmed_up_functions", ()):
                counts._warmups += 1
            return run_eager(mgr, *args, **kwargs)

        self._patched = [(M, "record_function", record), (M, "run_eager", run_eager)]
        M.record_function, M.run_eager = record_function, run_eager_

    def __exit__(self, *exc):
        from torch._dynamo.utils import counters
        for cls, attr, orig in self._patched:
            setattr(cls, attr, orig)

        def delta(group, key):
            return counters[group].get(key, 0) - self._before.get(group, {}).get(key, 0)

        patched = bool(self._patched)
        self.result = {
            "dynamo_graphs": delta("stats", "unique_graphs"),
            "frames_compiled": delta("frames", "ok"),
            "cudagraph_warmups": self._warmups if patched else None,
            "cudagraph_recordings": self._recordings if patched else None,
            "inductor": {k: delta("inductor", k) for k in counters["inductor"]
                         if delta("inductor", k)},
        }
        return False


def _grace_graphs(manifest: dict) -> list[dict]:
    """Per graph of a package: name, bucket, kernel count and arena bytes (manifest 2.0 keys;
    missing ones read as None so a 1.x package still reports its one graph)."""
    return [{"name": g.get("name"), "bucket": g.get("bucket", {}),
             "kernels": (g.get("stats") or {}).get("kernels"), "arena": g.get("arena")}
            for g in manifest.get("graphs", [])]


def _make_ids(lengths, vocab: int, seed: int):
    """One [1, L] int64 token tensor per length, made on the GPU up front (never inside timing)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, vocab, (1, n), device="cuda", generator=gen) for n in lengths]


class _Inputs(NamedTuple):
    """Token ids made on the GPU before any timing: per fixed length, the mixed stream, and the
    input of the host-overhead measurement."""
    fixed: dict   # length -> [1, length] ids
    stream: list  # [1, L] ids, L from mixed_lengths()
    host: object  # [1, HOST_SEQ] ids


def _make_inputs(cfg) -> _Inputs:
    vocab = BERT_BASE["vocab"]
    lengths = mixed_lengths(cfg.stream_calls, MIN_SEQ, MAX_SEQ, cfg.seed)
    return _Inputs(dict(zip(cfg.lengths, _make_ids(cfg.lengths, vocab, cfg.seed))),
                   _make_ids(lengths, vocab, cfg.seed + 1),
                   _make_ids([HOST_SEQ], vocab, cfg.seed + 2)[0])


def _stream_passes(fn, stream, counts=None) -> dict:
    """A cold then a warm pass over the same stream: totals in s, per call in ms; with `counts`
    (_TorchCounts) also what torch.compile built during each pass (built_cold, built_warm)."""
    out = {"calls": len(stream)}
    for phase in ("cold", "warm"):
        with counts() if counts else contextlib.nullcontext() as c:
            out[f"{phase}_s"] = time_stream(fn, stream)
        out[f"{phase}_ms_per_call"] = out[f"{phase}_s"] / len(stream) * 1e3
        if counts:
            out[f"built_{phase}"] = c.result
    return out


def _time_lengths(res, contender, fn, fixed, cfg) -> None:
    """ms per call of `fn(ids)` at each fixed length, into res["ms"][length][contender]."""
    for n, ids in fixed.items():
        samples = time_calls(lambda: fn(ids), cfg.iters, cfg.repeats, cfg.warmup)
        res["ms"][str(n)][contender] = statistics.median(samples)


def _compile_grace_dyn(model, cfg, path: Path, precision=None) -> dict:
    """Compile the one dynamic-shape package (on the CPU, like `grace compile`)."""
    import torch

    from grace.aot import compile as grace_compile

    seq = torch.export.Dim("seq", min=MIN_SEQ, max=MAX_SEQ)
    extra = {"buckets": cfg.buckets} if cfg.buckets else {}
    example = torch.randint(0, BERT_BASE["vocab"], (1, EXPORT_SEQ))
    t = time.perf_counter()
    grace_compile(model, (example,), output=path, progress=False,
                  fp32_matmul=precision or cfg.precision,
                  dynamic_shapes={"input_ids": {1: seq}}, **extra)
    return {"compile_s": time.perf_counter() - t, "package_bytes": path.stat().st_size}


def _run_eager(res, model, inputs: _Inputs, cfg) -> None:
    res["stream"]["eager"] = _stream_passes(model, inputs.stream)
    _time_lengths(res, "eager", model, inputs.fixed, cfg)


def _run_torch_compile(res, key, model, inputs: _Inputs, cfg) -> None:
    """One torch.compile contender, from a clean dynamo state: the stream first (so its cold pass
    sees every compile and recording), then the fixed lengths on the same compiled model."""
    import warnings

    import torch

    torch._dynamo.reset()
    record = warnings.catch_warnings(record=True) if key == BACKEND else contextlib.nullcontext([])
    with record as caught:
        if key == BACKEND:
            import grace.aot  # noqa: F401  (registers backend="grace" without the entry point)

            warnings.simplefilter("always", Warning)   # the fallbacks, recorded below
            compiled = torch.compile(model, backend="grace",
                                     options=backend_options(cfg.precision, cfg.buckets))
        else:
            compiled = torch.compile(model, mode=None if key == "torch.compile" else key)
        res["stream"][key] = _stream_passes(compiled, inputs.stream, _TorchCounts)
        with _TorchCounts() as fixed_counts:
            _time_lengths(res, key, compiled, inputs.fixed, cfg)
    res["stream"][key]["built_fixed_lengths"] = fixed_counts.result
    if key == BACKEND:
        res["stream"][key]["fallbacks"] = _backend_fallbacks(caught)


def _run_grace(res, path: Path, model, inputs: _Inputs, cfg, key: str = "grace") -> None:
    """Load the package, time the stream (cold pass = lazy instantiations), the fixed lengths,
    the host cost of run() at HOST_SEQ, and the error against eager at each fixed length.
    `key`: the contender's name ("grace", or "grace[tf32]" for another precision)."""
    import torch

    from grace.runtime import load

    detail = res.setdefault(key, {})
    t = time.perf_counter()
    pkg = load(path)
    sess = pkg.session()
    detail["load_s"] = time.perf_counter() - t
    try:
        fn = lambda ids: sess.run(ids)  # noqa: E731
        res["stream"][key] = _stream_passes(fn, inputs.stream)
        res["stream"][key]["instantiations"] = dict(getattr(sess, "instantiations", {}) or {})
        _time_lengths(res, key, fn, inputs.fixed, cfg)
        detail[f"run_host_us_{HOST_SEQ}"] = host_us(lambda: sess.run(inputs.host), sess.sync)
        detail["rel_err_vs_eager_tf32"] = {}
        for n, ids in inputs.fixed.items():
            got = torch.from_numpy(next(iter(sess.run(ids).values())).numpy()).cuda()
            detail["rel_err_vs_eager_tf32"][str(n)] = rel_err(got, model(ids))
        detail["instantiations"] = dict(getattr(sess, "instantiations", {}) or {})
        detail["last_graph"] = getattr(sess, "last_graph", None)
    finally:
        sess.close()
        pkg.close()


def _run_grace_at(res, key: str, precision: str, model, inputs: _Inputs, cfg, path: Path):
    """Another grace contender: the same dynamic package compiled at another fp32 precision."""
    res.setdefault(key, {}).update(_compile_grace_dyn(model.cpu(), cfg, path, precision))
    model.cuda()
    _run_grace(res, path, model, inputs, cfg, key)


def _variant_changes(name: str, variant, default: Path, path: Path) -> int:
    """Graph nodes of the variant's package (`path`) unlike grace's (`default`); logs a variant
    that changed none (its settings do not apply to this model)."""
    from grace.formats import read_package

    changed = nodes_changed(read_package(default).manifest, read_package(path).manifest)
    if not changed:
        _log(f"{name}: variant {variant.name} changed no graph node of grace's package (its "
             "settings do not apply to this model): its figures are grace's again")
    return changed


def _run_grace_variant(res, key: str, variant, model, inputs: _Inputs, cfg, path: Path,
                       default: Path):
    """Another grace contender: the same dynamic package compiled with a variant's grace.aot
    constants (tools/variants.py); `default`: grace's own package, to count what changed."""
    with applied(variant):
        res.setdefault(key, {}).update(_compile_grace_dyn(model.cpu(), cfg, path))
    res[key]["settings"] = variant.describe()
    res[key]["nodes_changed"] = _variant_changes(res["model"], variant, default, path)
    model.cuda()
    _run_grace(res, path, model, inputs, cfg, key)


def _guarded(res, contender: str, fn, *args) -> None:
    """Run one contender; a failure is recorded under res["errors"] and the benchmark goes on."""
    import torch

    _log(f"{res['model']}: {contender}")
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - one contender's failure must not lose the others
        res["errors"][contender] = _error(e)
        _log(f"{res['model']}: {contender} failed: {res['errors'][contender][:300]}")
    finally:
        torch._dynamo.reset()


def bench_dynamic(name: str, cfg, workdir: Path, checkpoint=lambda res: None) -> dict:
    """The dynamic-shape workload (module docstring): one grace package for lengths 1..512.

    `checkpoint(res)` is called after each contender, so a run cut short (a time limit) still
    leaves the figures measured so far.
    """
    import torch

    from grace.formats import read_package
    from grace.tools import models

    torch.manual_seed(0)
    model = models.hf_bert(**BERT_BASE).eval()
    lengths = mixed_lengths(cfg.stream_calls, MIN_SEQ, MAX_SEQ, cfg.seed)
    res = {"model": name, "kind": "dynamic", "errors": {},
           "config": {"model": dict(BERT_BASE), "batch": 1, "dtype": "float32",
                      "range": [MIN_SEQ, MAX_SEQ], "fixed_lengths": list(cfg.lengths),
                      "stream_calls": cfg.stream_calls, "seed": cfg.seed,
                      "stream_distinct_lengths": len(set(lengths)), "stream_lengths": lengths,
                      "buckets": cfg.buckets or "compiler default", "fp32_matmul": cfg.precision},
           "ms": {str(n): {} for n in cfg.lengths}, "stream": {}, "grace": {}}

    _log(f"{name}: grace compile")
    path = workdir / f"{name}.grace"
    try:
        res["grace"].update(_compile_grace_dyn(model, cfg, path))
        res["grace"]["graphs"] = _grace_graphs(read_package(path).manifest)
        res["grace"]["graph_count"] = len(res["grace"]["graphs"])
    except Exception as e:  # noqa: BLE001 - still time the torch contenders
        res["errors"]["grace"] = _error(e)
        _log(f"{name}: grace compile failed: {res['errors']['grace'][:300]}")
    checkpoint(res)

    model = model.cuda()
    inputs = _make_inputs(cfg)
    with torch.no_grad():
        _guarded(res, "eager", _run_eager, res, model, inputs, cfg)
        checkpoint(res)
        if "grace" not in res["errors"]:
            _guarded(res, "grace", _run_grace, res, path, model, inputs, cfg)
            checkpoint(res)
        for prec in cfg.fp32_matmul.split(",")[1:]:   # the same package at other precisions
            key = f"grace[{prec}]"
            extra = workdir / f"{name}-{prec}.grace"
            _guarded(res, key, _run_grace_at, res, key, prec, model, inputs, cfg, extra)
            checkpoint(res)
        for variant in getattr(cfg, "variants", ()) if "grace" not in res["errors"] else ():
            key = f"grace[{variant.name}]"
            _guarded(res, key, _run_grace_variant, res, key, variant, model, inputs, cfg,
                     workdir / f"{name}-{variant.name}.grace", path)
            checkpoint(res)
        backend = (BACKEND,) if getattr(cfg, "backend_ab", False) else ()
        for key in ("torch.compile", "reduce-overhead") + backend:
            _guarded(res, key, _run_torch_compile, res, key, model, inputs, cfg)
            checkpoint(res)
    return res


def _fmt(x, spec: str = "8.3f") -> str:
    """`x` formatted with `spec`, or '-' at the same width when the figure is missing."""
    if isinstance(x, (int, float)):
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 0)


def format_dynamic_table(res: dict) -> str:
    """The dynamic workload's summary: ms per call per length and for the mixed stream (cold and
    warm), what each contender built, and grace's package. Missing figures print as '-'."""
    contenders = DYN_CONTENDERS + tuple(k for k in res["stream"]
                                        if k.startswith("grace[") or k == BACKEND)
    head = f"{'':16s}" + "".join(f"{c:>16s}" for c in contenders)
    lines = [f"{res['model']}: ms per call (batch 1, fp32)", head]
    for n, row in res["ms"].items():
        lines.append(f"{'seq ' + n:16s}" + "".join(f"{_fmt(row.get(c), '16.3f')}"
                                                   for c in contenders))
    stream = res["stream"]
    calls = res["config"]["stream_calls"]
    for phase in ("cold", "warm"):
        lines.append(f"{f'stream {phase}':16s}" + "".join(
            f"{_fmt(stream.get(c, {}).get(f'{phase}_ms_per_call'), '16.3f')}" for c in contenders))
    lines.append(f"(stream: {calls} calls, {res['config']['stream_distinct_lengths']} distinct "
                 f"lengths in [{res['config']['range'][0]}, {res['config']['range'][1]}])")
    for key in ("torch.compile", "reduce-overhead", BACKEND):
        cold = stream.get(key, {}).get("built_cold")
        if cold:
            warm = stream[key]["built_warm"]
            lines.append(f"{key}: built by the cold pass: {_fmt(cold['dynamo_graphs'], 'd')} dynamo "
                         f"graphs, {_fmt(cold['cudagraph_recordings'], 'd')} CUDA-graph recordings; "
                         f"by the warm pass: {_fmt(warm['dynamo_graphs'], 'd')} / "
                         f"{_fmt(warm['cudagraph_recordings'], 'd')}")
    lines.extend(_grace_lines(res))
    lines.extend(f"error {c}: {msg[:200]}" for c, msg in res["errors"].items())
    return "\n".join(lines)


def _grace_lines(res: dict) -> list[str]:
    g = res["grace"]
    if not g.get("graphs"):
        return []
    inst = res["stream"].get("grace", {}).get("instantiations")
    per = ", ".join(f"{_bucket_label(x['bucket'])}:{x['kernels']}k/{_mib(x['arena'])}"
                    for x in g["graphs"])
    host = g.get(f"run_host_us_{HOST_SEQ}")
    errs = g.get("rel_err_vs_eager_tf32") or {}
    return [f"grace: {g['graph_count']} graphs, {len(inst) if inst is not None else '-'} "
            f"instantiated by the stream, run() host {_fmt(host, '.1f')} us at seq {HOST_SEQ}, "
            f"compile {_fmt(g.get('compile_s'), '.1f')} s, rel err "
            + (", ".join(f"{n}:{e:.1e}" for n, e in errs.items()) or "-"),
            f"grace graphs (bucket:kernels/arena): {per}"]


def _bucket_label(bucket) -> str:
    return ",".join(f"{k}={v}" for k, v in (bucket or {}).items()) or "static"


def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:.1f}MiB" if isinstance(nbytes, (int, float)) else "-"


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(not MIN_SEQ <= v <= MAX_SEQ for v in values):
        raise argparse.ArgumentTypeError(f"lengths must lie in [{MIN_SEQ}, {MAX_SEQ}], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m grace.tools.benchmark",
                                 description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit_s,gpt2_6l",
                    help="comma-separated workloads: the transformers "
                         f"{', '.join(TRANSFORMERS)} and the timm CNNs {', '.join(CNNS)} (each "
                         "also as <name>_bf16) (static), "
                         "bert_base_dyn (dynamic sequence length); default vit_s,gpt2_6l")
    ap.add_argument("--iters", type=int, default=100, help="calls per timed sample (default 100)")
    ap.add_argument("--repeats", type=int, default=5, help="samples; the median is reported (default 5)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    ap.add_argument("--out", type=Path, default=None, help="write the raw results as JSON")
    ap.add_argument("--fp32-matmul", default="tf32x3",
                    help="comma-separated grace precisions to time (the first is 'grace'; the "
                         "dynamic workload uses the first only)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="static workloads: also time grace[no-pdl], the same model compiled "
                         "without programmatic dependent launch (pdl=False; 'grace' has it)")
    ap.add_argument("--tiles-ab", action="store_true",
                    help="static workloads: also time grace[no-gemm-tiles], the same model compiled with "
                         "gemm_tiles=False (the tile heuristic for every GEMM; 'grace' takes the tiles of "
                         "aot/gemm_tiles/<arch>.json near its shapes, e.g. a table written by python -m "
                         "grace.tools.tile_sweep)")
    ap.add_argument("--backend-ab", action="store_true",
                    help=f"also time {BACKEND}: torch.compile(model, backend=\"grace\"), grace's "
                         "pipeline behind Dynamo (static and dynamic workloads)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:module.CONSTANT=VALUE,...",
                    help="also time grace[NAME], the model compiled with these grace.aot constants "
                         "(tools/variants.py), e.g. attn8:codegen.ATTN_SPLIT_PROGRAMS_PER_SM=8; static "
                         "and dynamic workloads; repeatable")
    dyn = ap.add_argument_group("dynamic workload (bert_base_dyn)")
    dyn.add_argument("--buckets", action="append", default=[], metavar="seq=B1,B2,...",
                     help="grace's bucket bounds for the sequence symbol 'seq' (as `grace compile "
                          "--buckets`); default: the compiler's (16,32,...,256,512)")
    dyn.add_argument("--dyn-lengths", type=_int_list, default=(100, 129, 300), metavar="L1,L2,...",
                     help="fixed sequence lengths timed like the static workloads (default 100,129,300)")
    dyn.add_argument("--stream-calls", type=int, default=200,
                     help="calls in the mixed-length stream (default 200)")
    dyn.add_argument("--seed", type=int, default=0, help="seed of the stream's lengths and tokens")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the arguments; adds `static`, `dynamic` (workload names), `buckets`
    ({symbol: [bounds]}) and `precision` (the dynamic workload's fp32 matmul precision)."""
    from grace.tools.cli import CliError, parse_buckets

    ap = build_parser()
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    static = TRANSFORMERS + CNNS
    known = static + tuple(f"{n}_bf16" for n in static) + DYNAMIC_MODELS
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(f"--models: unknown workload {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(known)}")
    args.static = [n for n in names if n not in DYNAMIC_MODELS]
    args.dynamic = [n for n in names if n in DYNAMIC_MODELS]
    try:
        args.buckets = parse_buckets(args.buckets)
    except CliError as e:
        ap.error(str(e))
    if args.stream_calls < 1:
        ap.error("--stream-calls must be >= 1")
    try:
        args.variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        ap.error(str(e))
    if len({v.name for v in args.variants}) != len(args.variants):
        ap.error("--variant: two variants have the same name")
    args.lengths = args.dyn_lengths
    args.precision = args.fp32_matmul.split(",")[0]
    return args


def _env() -> dict:
    import torch
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "tf32": True}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - versions are informative only
            pass
    return env


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    available = _models()
    env = _env()
    results, dynamic = [], []

    def save(partial=None):
        """Write --out now: after every workload, and within the dynamic one after each contender."""
        if args.out:
            done = results + dynamic + ([partial] if partial is not None else [])
            args.out.write_text(json.dumps({"env": env, "results": done}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.static:
            _log(name)
            results.append(bench_model(name, available[name], args.iters, args.repeats,
                                       args.warmup, Path(tmp),
                                       tuple(args.fp32_matmul.split(",")), args.pdl_ab,
                                       args.backend_ab, args.tiles_ab, args.variants))
            save()
        for name in args.dynamic:
            dynamic.append(bench_dynamic(name, args, Path(tmp), checkpoint=save))
            save()
    print(f"\n{env}")
    if results:
        print(format_static_table(results))
    for res in dynamic:
        print()
        print(format_dynamic_table(res))


if __name__ == "__main__":
    main()
