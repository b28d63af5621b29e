"""Decode benchmark: ms per generated token of a gpt-fast-style Llama with a static KV cache, batch
1, side by side in one process on one GPU.

    python -m grace.tools.bench_decode --shape 1b --out decode-1b.json

Contenders, all from the same random bf16 weights, after a prefill of `--pos` tokens:
  eager            the model called once per token (argmax and the next position on the device)
  reduce-overhead  torch.compile(mode="reduce-overhead", fullgraph=True) of the decode step, the
                   way gpt-fast serves it (CUDA graphs, cache updated in place)
  grace run()      Session.run() per token on device tensors, argmax by torch
  grace generate() Session.generate(): prefill, then every decode step inside one CUDA graph
                   WHILE loop; per token = (time for 2N+1 tokens - time for N+1) / N, the
                   median of 5 pairs timed back to back (each call prefills again)
  ... no PDL       the same model compiled with pdl=False (grace's default has programmatic
                   edges, docs/design-pdl.md); "full edges" loads the default package with
                   load(pdl=False): the same kernels, every edge a full one
  ... fold         (--fold-ab) the same model compiled with fold_row_stats (aot/fuse_stats.py)
  ... NAME         (--variant NAME:codegen.GEMV_TILE=2048,...) the same model compiled with
                   grace.aot constants set for the compile (tools/variants.py), e.g. a GEMV tile;
                   a variant whose package has no graph node unlike grace's is logged as such
                   (its settings did not apply: `nodes_changed` 0 in the JSON)
  ... again        grace's own package timed once more after every other grace contender (when
                   there is one; --no-again skips it). On an H100 one process gave the same
                   package 0.981 ms/token of generate() first and 0.974 last, a variant between
                   them 0.977; two others matched to 0.0% (docs/performance.md, thirty-fifth
                   session). A generate() A/B smaller than the drift is not the variant's.
                   `drift` in the JSON: again / first - 1, for run() and generate()
`--timeline` adds, for grace's package and each variant, the decode graph's time node by node
(profile_kernels --timeline, as built), so an A/B shows where the time moved.
Each contender decodes `--steps` tokens per timed pass (best of `--repeats` passes; generate() as
above). The HBM fraction is the bytes a token must read (all weights but the embedding table,
plus the K/V of the positions up to the current one) / time / 4.3 TB/s (the copy rate measured
on the H200).
grace's package is compiled on the machine that runs the benchmark (--workdir).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from grace.tools.variants import applied, nodes_changed, parse_variant

GENERATE_PAIRS = 5   # generate() is timed as the median of this many pairs of loops (at least)
COPY_RATE = 4.3e12   # bytes/s, H200 device-to-device copy (design.md §4)
SHAPES = {
    # gpt-fast's configs (Llama-3.2-1B, Llama-3-8B), cache 2048
    "1b": dict(vocab=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden=8192,
               tie_embeddings=True),
    "8b": dict(vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336),
    "tiny": dict(vocab=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, hidden=688),
}


def _log(msg):
    print(f"[decode] {msg}", file=sys.stderr, flush=True)


def _model(shape, max_seq):
    import torch
    from torch import nn

    from grace.tools.models import CachedLlama

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    # Every 2-D weight is drawn below, so the layers' own init is skipped, and on a GPU machine
    # the draws run there: on the H200 machine's CPU the 1B model took 68 s to build and the 8B
    # one more than a call's budget (docs/performance.md, thirteenth and fourteenth sessions).
    linear, embedding = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        model = CachedLlama(max_seq=max_seq, rope_base=500000.0, **SHAPES[shape]).eval()
    finally:
        torch.set_default_dtype(torch.float32)
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = linear, embedding
    draw_on = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():   # small weights keep bf16 logits finite and argmax meaningful
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=draw_on).normal_(0, 0.02))
    model.rope_cos = model.rope_cos.to(torch.bfloat16)   # the rotary tables and caches in bf16 too
    model.rope_sin = model.rope_sin.to(torch.bfloat16)
    for layer in model.layers:
        kv = layer.attention.kv_cache
        kv.k_cache = kv.k_cache.to(torch.bfloat16)
        kv.v_cache = kv.v_cache.to(torch.bfloat16)
    return model


def bytes_per_token(model, pos: int) -> int:
    # every weight is read once per token but the embedding table (one row); a tied table is read
    # whole as the output projection
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if p is not model.tok_embeddings.weight or p is model.output.weight)
    attn = model.layers[0].attention
    kv = 2 * len(model.layers) * attn.n_kv * attn.head_dim * (pos + 1) * 2
    return weights + kv


class _Skipped(Exception):
    pass


def _drop(path: Path):
    """A measured A/B package goes once timed: an 8B package is 16 GB and the benchmark compiles
    one per variant (the GPU machine's disk holds four)."""
    path.unlink(missing_ok=True)


def generate_ms_per_token(timed, steps: int, pos: int, max_seq: int, pairs: int):
    """(ms per token, ms of the prefill, every pair's ms per token) of generate(), from
    `timed(n)`: the seconds of one generate() call of n new tokens after a `pos`-token prompt.
    Two loops that differ by `steps` tokens are timed back to back, and the median of `pairs`
    such pairs taken: every call prefills again, and on the H200 the prefill moved by up to 16 ms
    between calls (twentieth session), so the earlier method, the best of a one-token call
    subtracted from the best of a long one, could credit a slow prefill to the loop. The short
    loop takes `steps` + 1 tokens where the cache holds both loops, else 1."""
    short = steps + 1 if pos + 2 * steps <= max_seq else 1
    per_token, prefills = [], []
    for _ in range(pairs):
        a, b = timed(short), timed(short + steps)
        per_token.append((b - a) / steps)
        prefills.append(a - (short - 1) * per_token[-1])
    return (statistics.median(per_token) * 1e3, statistics.median(prefills) * 1e3,
            [t * 1e3 for t in per_token])


def _time_tokens(step, tok, pos, steps, repeats, sync):
    """Best of `repeats` passes of `steps` decode steps: ms per token."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        t, p = tok, pos
        for _ in range(steps):
            t, p = step(t, p)
        sync()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def _timeline(path: Path, pos: int, workdir: Path, name: str) -> dict:
    """profile_kernels --timeline of the decode graph of the package at `path`, at position
    `pos`, as built (PDL), in a process of its own (CUPTI names kernels of several packages in
    one process wrongly: docs/performance.md, ninth session): its printed table and its --json
    record (span, node rows, gap between calls)."""
    import subprocess

    jpath = workdir / f"timeline-{name}.json"
    cmd = [sys.executable, "-m", "grace.tools.profile_kernels", str(path), "--size", "seq=1",
           "--fill", f"input_pos={pos}", "--as-built", "--timeline", "--top", "15",
           "--json", str(jpath)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"profile_kernels exited {done.returncode}: {done.stderr[-1500:]}")
    result = json.loads(jpath.read_text())   # span_us, rows, gap_between_calls_us, ...
    jpath.unlink()
    return {"table": done.stdout, **result}


def run(shape="1b", pos=1000, max_seq=2048, steps=64, repeats=3, workdir=Path("/tmp"),
        out=None, pdl_ab=True, fold_ab=False, variants=(), reduce_overhead=True,
        timeline=False, again=True) -> dict:
    import torch
    from torch.export import Dim

    import grace.aot
    from grace.runtime import load

    res = {"shape": shape, "pos": pos, "max_seq": max_seq, "steps": steps, "config": SHAPES[shape],
           "ms_per_token": {}, "errors": {}}
    t0 = time.perf_counter()
    model = _model(shape, max_seq)
    # progress on stderr as it goes: a run cut by a timeout still says how far it got (on 8B the
    # random weights and the compile take minutes each)
    _log(f"built the {shape} model (random bf16 weights drawn on the GPU, held on the CPU) in {time.perf_counter() - t0:.1f} s")
    need = bytes_per_token(model, pos)
    res["bytes_per_token"] = need
    prompt = torch.randint(0, SHAPES[shape]["vocab"], (pos,), generator=torch.Generator().manual_seed(1))

    def compile_grace(suffix: str = "", **options) -> Path:
        """The decoder compiled from its CPU weights (the model goes back to the GPU after)."""
        on_gpu = next(model.parameters()).is_cuda
        t0 = time.perf_counter()
        _log(f"compiling grace{suffix} ...")
        path = workdir / f"decode-{shape}{suffix}.grace"
        t = Dim("seq", min=1, max=min(1024, max_seq))
        grace.aot.compile(model.cpu(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                          output=path, progress=False,
                          dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                          buckets={"seq": [1, min(1024, max_seq)]},
                          generate={"tokens": "idx", "positions": "input_pos"}, **options)
        if on_gpu:
            model.cuda()
        res[f"grace{suffix.replace('-', '_')}_compile_s"] = time.perf_counter() - t0
        return path

    # grace: compile (CPU weights), then load
    path = compile_grace()
    # the weights are streamed into the file: the peak stays near one copy of the model
    res["peak_rss_gb_after_compile"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res["package_gb"] = path.stat().st_size / 1e9
    _log(f"compiled in {res['grace_compile_s']:.1f} s, {res['package_gb']:.2f} GB, "
         f"peak RSS {res['peak_rss_gb_after_compile']:.1f} GiB")
    t0 = time.perf_counter()
    pkg = load(path, instantiate="eager")
    sess = pkg.session()
    sess.sync()
    res["grace_load_s"] = time.perf_counter() - t0
    sess.close()
    res["grace_load"] = dict(pkg.load_stats)
    _log(f"loaded in {res['grace_load_s']:.2f} s: {pkg.load_stats}")

    model = model.cuda()
    sync = torch.cuda.synchronize
    dev_prompt = prompt.cuda()

    ref_row = {}   # eager's prefill logits, last position, in float64

    def prefill_eager():
        model.reset_cache()
        with torch.no_grad():
            logits = model(dev_prompt[None], torch.arange(pos, device="cuda"))
        ref_row.setdefault("logits", logits[0, -1].double())
        return logits[0, -1].argmax().view(1, 1), torch.tensor([pos], device="cuda")

    # eager
    def eager_step(tok, p):
        with torch.no_grad():
            logits = model(tok, p)
        return logits[0, -1].argmax().view(1, 1), p + 1

    tok, p = prefill_eager()
    ref_tokens = [int(tok)]
    t_, p_ = tok, p
    for _ in range(steps - 1):
        t_, p_ = eager_step(t_, p_)
        ref_tokens.append(int(t_))
    res["ms_per_token"]["eager"] = _time_tokens(eager_step, tok, p, steps, repeats, sync)
    _log(f"eager {res['ms_per_token']['eager']:.3f} ms/token")

    # reduce-overhead, gpt-fast's way
    try:
        if not reduce_overhead:
            raise _Skipped("--no-reduce-overhead")
        compiled = torch.compile(eager_step, mode="reduce-overhead", fullgraph=True)
        tok, p = prefill_eager()
        for _ in range(3):
            compiled(tok, p)
        tok, p = prefill_eager()
        res["ms_per_token"]["reduce-overhead"] = _time_tokens(compiled, tok, p, steps, repeats, sync)
        _log(f"reduce-overhead {res['ms_per_token']['reduce-overhead']:.3f} ms/token")
    except _Skipped as e:
        res["skipped"] = [f"reduce-overhead: {e}"]
    except Exception as e:  # recorded, the others still run
        res["errors"]["reduce-overhead"] = f"{type(e).__name__}: {e}"[:2000]

    def measure_grace(pkg, suffix=""):
        sess = pkg.session()

        def grace_step(tok, p):   # grace run() per token
            logits = torch.from_dlpack(sess.run(idx=tok, input_pos=p)["out"])
            return logits[0, -1].argmax().view(1, 1), p + 1

        sess.reset_state()
        logits = torch.from_dlpack(sess.run(idx=dev_prompt[None],
                                            input_pos=torch.arange(pos, device="cuda"))["out"])
        tok, p = logits[0, -1].argmax().view(1, 1), torch.tensor([pos], device="cuda")
        # greedy tokens rarely agree over bf16 logits this flat (random weights), so the logits
        # themselves are compared: max |grace - eager| / max |eager|, the prefill's last row
        ref = ref_row["logits"]
        res[f"prefill_logits_rel_err{suffix}"] = float(
            (logits[0, -1].double() - ref).abs().max() / ref.abs().max())
        key = f"grace run(){suffix}"
        res["ms_per_token"][key] = _time_tokens(grace_step, tok, p, steps, repeats, sync)
        _log(f"{key} {res['ms_per_token'][key]:.3f} ms/token")

        # grace generate(): on-device loop
        host_prompt = prompt.numpy()
        got = sess.generate(host_prompt, steps)
        res[f"grace_tokens_equal_eager{suffix}"] = int(sum(a == b for a, b in zip(got.tolist(), ref_tokens)))

        def timed_generate(n):
            sync()
            t0 = time.perf_counter()
            sess.generate(host_prompt, n)
            return time.perf_counter() - t0

        per_token, prefill, pairs = generate_ms_per_token(timed_generate, steps, pos, max_seq,
                                                          max(repeats, GENERATE_PAIRS))
        res[f"grace_generate_prefill_ms{suffix}"] = prefill
        res[f"grace_generate_ms_per_token_pairs{suffix}"] = pairs
        key = f"grace generate(){suffix}"
        res["ms_per_token"][key] = per_token
        _log(f"{key} {res['ms_per_token'][key]:.3f} ms/token")
        sess.close()

    def profile(path: Path, name: str):
        if not timeline:
            return
        try:
            res.setdefault("timelines", {})[name] = _timeline(path, pos, workdir, name)
            _log(f"timeline {name}: " + res["timelines"][name]["table"].splitlines()[0])
        except Exception as e:  # recorded, the others still run
            res["errors"][f"timeline {name}"] = f"{type(e).__name__}: {e}"[:2000]

    measure_grace(pkg)
    pkg.close()
    profile(path, "grace")
    if pdl_ab:
        # the default package with its programmatic edges built as full ones (load(pdl=False)),
        # then the same model compiled without PDL (docs/design-pdl.md)
        full = load(path, instantiate="eager", pdl=False)
        measure_grace(full, " full edges")
        full.close()
        plain = load(plain_path := compile_grace("-no-pdl", pdl=False), instantiate="eager")
        measure_grace(plain, " no PDL")
        plain.close()
        _drop(plain_path)
    if fold_ab:
        # the same model compiled with fold_row_stats (aot/fuse_stats.py): RMSNorm statistics
        # reduced inside the GEMVs that read them
        fold = load(fold_path := compile_grace("-fold", fold_row_stats=True), instantiate="eager")
        measure_grace(fold, " fold")
        res["grace_graphs fold"] = [{"name": g["name"], "kernels": g["stats"]["kernels"]}
                                    for g in fold.manifest["graphs"]]
        fold.close()
        profile(fold_path, "fold")
        _drop(fold_path)
    for variant in variants:   # tools/variants.py: compiler constants set for one compile
        with applied(variant):
            vpath = compile_grace(f"-{variant.name}")
        vpkg = load(vpath, instantiate="eager")
        changed = nodes_changed(pkg.manifest, vpkg.manifest)
        if not changed:
            _log(f"variant {variant.name}: no graph node differs from grace's package, so its "
                 "settings did not apply to this model; its figures are grace's again")
        measure_grace(vpkg, f" {variant.name}")
        res.setdefault("variants", {})[variant.name] = {
            "settings": variant.describe(), "nodes_changed": changed,
            "graphs": [{"name": g["name"], "kernels": g["stats"]["kernels"]}
                       for g in vpkg.manifest["graphs"]]}
        vpkg.close()
        profile(vpath, variant.name)
        _drop(vpath)
    if again and (pdl_ab or fold_ab or variants):
        last = load(path, instantiate="eager")
        measure_grace(last, " again")
        last.close()
        ms = res["ms_per_token"]
        res["drift"] = {k: ms[f"grace {k} again"] / ms[f"grace {k}"] - 1
                        for k in ("run()", "generate()")
                        if f"grace {k}" in ms and f"grace {k} again" in ms}
    res["hbm_fraction"] = {k: need / (v * 1e-3) / COPY_RATE for k, v in res["ms_per_token"].items()}
    res["grace_graphs"] = [{"name": g["name"], "kernels": g["stats"]["kernels"]}
                           for g in pkg.manifest["graphs"]]
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
    return res


def format_table(res) -> str:
    ro = res["ms_per_token"].get("reduce-overhead")
    lines = [f"decode {res['shape']} bf16, batch 1, cache {res['max_seq']}, position {res['pos']}, "
             f"{res['bytes_per_token'] / 1e9:.2f} GB/token",
             f"{'contender':<18} {'ms/token':>9} {'HBM':>6} {'÷ r-o':>7}"]
    for k, v in res["ms_per_token"].items():
        ratio = f"{v / ro:7.2f}" if ro else "      -"
        lines.append(f"{k:<18} {v:9.3f} {res['hbm_fraction'][k]:6.1%} {ratio}")
    lines.append(f"grace tokens equal to eager: {res.get('grace_tokens_equal_eager')}/{res['steps']} "
                 f"(no PDL: {res.get('grace_tokens_equal_eager no PDL', '-')}); prefill logits "
                 f"rel. err {res.get('prefill_logits_rel_err', float('nan')):.2e}; "
                 f"compile {res.get('grace_compile_s', 0):.0f} s, load {res.get('grace_load_s', 0):.2f} s")
    if res.get("drift"):
        lines.append("grace's own package timed again last: " + ", ".join(
            f"{k} {d:+.1%}" for k, d in res["drift"].items())
            + " (a variant's gain within this is drift, not the variant)")
    for name, t in res.get("timelines", {}).items():
        lines.append(f"timeline {name} (as built; us each node adds to the GPU span):")
        lines += ["  " + line for line in t["table"].splitlines()[:14]]
    for k, e in res["errors"].items():
        lines.append(f"error {k}: {e[:200]}")
    lines += [f"skipped {s}" for s in res.get("skipped", [])]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--pos", type=int, default=1000, help="prefill length = decode position")
    ap.add_argument("--max-seq", type=int, default=2048, help="KV-cache slots")
    ap.add_argument("--steps", type=int, default=64, help="tokens per timed pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--no-pdl-ab", action="store_true",
                    help="skip the A/B runs: the package with full edges, and one compiled with pdl=False")
    ap.add_argument("--fold-ab", action="store_true",
                    help="also time the model compiled with fold_row_stats (RMSNorm statistics reduced "
                         "inside the GEMVs: aot/fuse_stats.py)")
    ap.add_argument("--no-reduce-overhead", action="store_true",
                    help="skip torch.compile's reduce-overhead contender (minutes of compile on 8B): "
                         "for A/B runs between grace variants, not for recorded comparisons")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:module.CONSTANT=VALUE,...",
                    help="also time the model compiled with these grace.aot constants (tools/variants.py), "
                         "e.g. gemv2x1024:codegen.GEMV_TILE=2048; repeatable")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile the decode graph of grace's package and of each variant "
                         "node by node (profile_kernels --timeline --as-built, in a subprocess): "
                         "where the time went, in the same run as the ms/token")
    ap.add_argument("--no-again", action="store_true",
                    help="do not time grace's own package once more after the variants (the "
                         "drift check, on whenever another grace contender runs)")
    a = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    if len({v.name for v in variants}) != len(variants):
        ap.error("two variants have the same name")
    res = run(a.shape, a.pos, a.max_seq, a.steps, a.repeats, a.workdir, a.out, not a.no_pdl_ab,
              a.fold_ab, variants, not a.no_reduce_overhead, a.timeline, not a.no_again)
    print(format_table(res))


if __name__ == "__main__":
    main()
