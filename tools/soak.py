"""Soak and concurrency test of the runtime on a GPU (issue 10, item 6).

    python -m grace.tools.soak --calls 1000000 --threads 4 --out soak.json

A server replays one package for days: nothing may grow, and a call must return exactly what the
same call returned the first time. This tool checks both on the real runtime, which unit tests
cannot (they have no GPU and no time):

  soak         one session replays the package `--calls` times, cycling through input sizes that
               select every bucket, most of them not bucket sizes (so the table words change on every
               call and every graph is relaunched in turn). Every `--check-every` calls the output is
               copied back and compared bit for bit with that size's first output. Device memory in
               use (cuMemGetInfo), the process's resident set and the number of live Python objects
               are sampled every `--sample-every` calls; growth after the warm-up is reported.
  concurrency  `--threads` sessions of the same loaded package (shared kernels and weights), each on
               its own thread and its own stream, run `--thread-calls` calls each with their own
               inputs and sizes, checking every output bit for bit against that thread's first
               output for that size. Cross-talk (one session's table or arena written by another)
               shows up as a mismatch.

The package is the README example's model (grace.tools.models.LlamaBlock, dynamic sequence
length 1..128, three buckets) compiled on this machine unless `--package` names one; inputs are
torch CUDA tensors (the zero-copy `__cuda_array_interface__` path). Exit status 1 if any output
differed or memory grew by more than `--max-growth-mb`.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
from pathlib import Path

SIZES = (1, 5, 16, 17, 40, 64, 65, 100, 127, 128)  # across the buckets 16, 64, 128


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _device_used_mb() -> float:
    from grace.runtime.driver import call, cuda
    free, total = call(cuda().cuMemGetInfo)
    return (total - free) / 2**20


def _compile(workdir: Path) -> Path:
    import torch
    from grace.aot import compile as grace_compile
    from grace.tools.models import LlamaBlock

    torch.manual_seed(0)
    model = LlamaBlock().eval()
    seq = torch.export.Dim("seq", min=1, max=128)
    program = torch.export.export(model, (torch.randn(1, 32, 64),), dynamic_shapes={"x": {1: seq}})
    out = workdir / "soak.grace"
    return grace_compile(program, output=out, buckets={"x.1": [16, 64, 128]})


def _inputs(seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(1, n, 64, generator=g).cuda() for n in SIZES}


def soak(package, calls: int, check_every: int, sample_every: int) -> dict:
    import torch

    session = package.session(poison=True)
    inputs = _inputs(0)
    first = {n: session.run(x=inputs[n])["out"].numpy().copy() for n in SIZES}
    mismatches, checks = [], 0
    samples = []
    t0 = time.perf_counter()
    for i in range(calls):
        n = SIZES[i % len(SIZES)]
        out = session.run(x=inputs[n])["out"]
        if i % check_every == check_every - 1:
            got = out.numpy()
            checks += 1
            if got.shape != first[n].shape or got.tobytes() != first[n].tobytes():
                mismatches.append({"call": i, "size": n})
        if i % sample_every == 0 or i == calls - 1:
            session.sync()
            samples.append({"call": i, "seconds": round(time.perf_counter() - t0, 2),
                            "device_used_mb": round(_device_used_mb(), 1), "rss_mb": round(_rss_mb(), 1),
                            "python_objects": len(gc.get_objects())})
            _log(f"{i:>9} calls  {samples[-1]}")
    session.sync()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    warm = samples[1] if len(samples) > 1 else samples[0]
    last = samples[-1]
    result = {
        "calls": calls, "seconds": round(seconds, 1), "us_per_call": round(seconds / calls * 1e6, 2),
        "sizes": list(SIZES), "graphs_instantiated": dict(session.instantiations),
        "checks": checks, "mismatches": mismatches,
        "growth_after_warmup": {k: round(last[k] - warm[k], 1)
                                for k in ("device_used_mb", "rss_mb", "python_objects")},
        "samples": samples,
    }
    session.close()
    return result


def concurrency(package, threads: int, calls: int) -> dict:
    sessions = [package.session(poison=True) for _ in range(threads)]
    inputs = [_inputs(100 + t) for t in range(threads)]
    report = [None] * threads
    barrier = threading.Barrier(threads)

    def worker(t: int) -> None:
        s, inp = sessions[t], inputs[t]
        sizes = SIZES[t % len(SIZES):] + SIZES[:t % len(SIZES)]  # threads hit different graphs at once
        first, bad = {}, []
        try:
            barrier.wait()
            for i in range(calls):
                n = sizes[i % len(sizes)]
                got = s.run(x=inp[n])["out"].numpy()
                ref = first.setdefault(n, got.copy())
                if got.tobytes() != ref.tobytes():
                    bad.append({"call": i, "size": n})
            report[t] = {"thread": t, "calls": calls, "mismatches": bad, "first": first}
        except Exception as e:  # reported, not swallowed: the run fails
            report[t] = {"thread": t, "error": f"{type(e).__name__}: {e}"}

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    seconds = time.perf_counter() - t0

    # each thread's first outputs against a fresh single-threaded session: no cross-talk even then
    solo = package.session()
    cross = []
    for t, r in enumerate(report):
        for n, ref in (r or {}).get("first", {}).items():
            want = solo.run(x=inputs[t][n])["out"].numpy()
            if want.tobytes() != ref.tobytes():
                cross.append({"thread": t, "size": n})
    solo.close()
    for s in sessions:
        s.close()
    for r in report:
        r.pop("first", None)
    return {"threads": threads, "calls_per_thread": calls, "seconds": round(seconds, 1),
            "threads_report": report, "first_outputs_vs_single_session": cross}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--package", type=Path, help="a .grace package with input x [1, seq, 64] "
                    "(default: compile the README example's model into --workdir)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--check-every", type=int, default=997, help="compare an output every N calls "
                    "(prime, so every size gets checked)")
    ap.add_argument("--sample-every", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--thread-calls", type=int, default=5_000)
    ap.add_argument("--max-growth-mb", type=float, default=8.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import torch
    import grace.runtime as runtime

    path = args.package or _compile(args.workdir)
    _log(f"package {path}")
    package = runtime.load(path)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
              "gpu": torch.cuda.get_device_name(), "package": str(path)}
    result["soak"] = soak(package, args.calls, args.check_every, args.sample_every)
    result["concurrency"] = concurrency(package, args.threads, args.thread_calls)
    package.close()
    args.out.write_text(json.dumps(result, indent=1))

    s, c = result["soak"], result["concurrency"]
    growth = s["growth_after_warmup"]
    errors = [r for r in c["threads_report"] if "error" in r]
    bad_threads = sum(len(r.get("mismatches", [])) for r in c["threads_report"])
    print(f"soak: {s['calls']} calls in {s['seconds']} s ({s['us_per_call']} us/call), "
          f"{s['checks']} outputs checked, {len(s['mismatches'])} differed; growth after warm-up: "
          f"device {growth['device_used_mb']} MB, RSS {growth['rss_mb']} MB, "
          f"{growth['python_objects']} Python objects; graphs {s['graphs_instantiated']}")
    print(f"concurrency: {c['threads']} threads x {c['calls_per_thread']} calls in {c['seconds']} s, "
          f"{bad_threads} outputs differed, {len(c['first_outputs_vs_single_session'])} first outputs "
          f"differ from a single session, {len(errors)} thread errors")
    ok = (not s["mismatches"] and not bad_threads and not errors and not c["first_outputs_vs_single_session"]
          and growth["device_used_mb"] <= args.max_growth_mb and growth["rss_mb"] <= args.max_growth_mb)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
