"""Host time of Session.run(): what one call costs the calling thread (not the GPU).

    python -m grace.tools.host_bench                     # CPU: the fake CUDA driver, a tiny BERT
    python -m grace.tools.host_bench --gpu               # a GPU: BERT-base, random weights, torch inputs
    python -m grace.tools.host_bench --gpu --package bert.grace --json host.json

Default mode (no GPU needed): a small BERT-like encoder (Hugging Face BERT, 2 layers, hidden 64,
random weights) is compiled with a dynamic sequence length (grace.aot.compile builds the cubins on
the CPU) and loaded through grace.tools.fuzz.FakeDriver, a stand-in for cuda.bindings.driver whose
"device memory" is host memory and whose graph calls return at once. The input looks
device-resident: by default a stand-in with a torch tensor's attributes (data_ptr(), shape,
is_contiguous(), dtype, get_device(), the path run() takes for a CUDA torch tensor), or `--input cai`
(__cuda_array_interface__), `dlpack` or `device` (a grace DeviceArray). Driver calls cost a Python
call here, not the real driver's time, so the figure is the Python part of run(); a relative
change in it is what this mode is for.

--gpu: Hugging Face BERT-base (12 layers, hidden 768, random weights, fp32) compiled on the spot
with a dynamic sequence length (or loaded from --package, written there on first use), a CUDA torch
tensor as input. It reports run() alone (no sync: bursts of --burst calls after a sync, which the
GPU's launch queue absorbs), the first run() after a sync alone (what a server that waits for
each request's result pays; how it compares with a call inside a burst depends on the host: on
H100 hosts 0.8 to 1.4 times the burst's median, docs/performance.md), run() followed by sync(),
and eager torch (with a sync) for reference.

Both modes time run() timeit-style (median over --repeats samples, each the mean of a loop of
calls) and then each stage of it alone, in the same way, through the session's own pieces:

    context    make the device's context current (cuCtxSetCurrent)
    checks     every input to an ArrayRecord and checked (dtype, device, layout, alignment)
    shapes     symbols resolved, graph selected, output shapes and table words (ShapePlan.prepare)
    words      this call's table words: the shape plan's, plus the data pointers
    setparams  the table writer's parameter cells and cuGraphExecKernelNodeSetParams (with the
               words the graph already has: the comparison that skips both)
    launch     cuGraphLaunch
    outputs    the DeviceArrays run() returns

run() is timed twice: with the same input every call (a serving loop that reuses its buffers: no
SetParams), and with two inputs taking turns (a new data pointer every call: SetParams each time).
The stages are timed apart from one another, so their sum is near run() but not equal to it
(each loop has its own overhead, caches are warmer); "sum" is printed next to run(). `--json PATH`
writes every figure (µs per call: median, min, the samples' count and size).

Noise: on a shared machine the median moves a lot between runs of the same code (on an H200 lease,
run() medians of 11.9 to 18.7 µs, minimums of 7.3 to 13.4, minutes apart). To compare two versions,
run them in turns several times and compare the minimums as well as the medians. The two run()
figures take their samples in turns (one of each per round): measured one after the other, the
first one paid for the lease's drift (eighth session: same buffer 18.9 µs, alternating 12.2, when
the same buffer skips work the alternating run does).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

SEQ = 129            # the input's sequence length (as tools/benchmark.py's host measurement)
TINY_BERT = dict(layers=2, hidden=64, heads=4, vocab=128, max_pos=256)
STAGES = ("context", "checks", "shapes", "words", "setparams", "launch", "outputs")


def _log(msg: str) -> None:
    print(f"[host_bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ timing

def _show(name: str, fig: dict) -> dict:
    """Log one figure as soon as it is measured (a run cut short keeps what it saw); returns it."""
    _log(f"{name}: {fig['median']:.2f} µs/call (min {fig['min']:.2f})")
    return fig


def per_call_us(fn, number: int, repeats: int, sync=None) -> dict:
    """µs per call of `fn`: `repeats` samples, each `number` calls between two perf_counter_ns
    reads (after `sync()` when given: a GPU's queue starts empty). Median and min of the samples."""
    return per_call_us_interleaved({"fn": fn}, number, repeats, sync)["fn"]


def per_call_us_interleaved(fns: dict, number: int, repeats: int, sync=None) -> dict:
    """per_call_us of several functions, their samples taken in turns (a sample of each, then the
    next round), so that a drift of the machine (GPU clocks ramping up, a neighbour on a shared
    lease) weighs on all of them alike: {name: figure}."""
    perf = time.perf_counter_ns
    samples: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if sync is not None:
                sync()
            t = perf()
            for _ in range(number):
                fn()
            samples[name].append((perf() - t) / number / 1e3)
    if sync is not None:
        sync()
    return {name: {"median": statistics.median(s), "min": min(s), "repeats": repeats,
                   "number": number} for name, s in samples.items()}


def _run_figures(run_same, run_alternating, number: int, repeats: int, sync=None) -> dict:
    """run() with the same input every call and with two inputs taking turns, sampled in turns."""
    figs = per_call_us_interleaved({"run_us": run_same, "run_alternating_us": run_alternating},
                                   number, repeats, sync)
    return {name: _show(name, fig) for name, fig in figs.items()}


def stage_functions(sess, args) -> dict:
    """One function per stage of run() (module docstring), each doing what run() does for the call
    `sess.run(*args)` and nothing else. Run that call once first (it instantiates the graph)."""
    from grace.runtime import driver

    cu = driver.cuda()
    records, shapes = sess._input_records(args, {})
    call = sess._shapes.prepare(shapes)
    graph = sess._graphs[call.graph]
    stream = sess._stream
    words = sess._table_words(call, records, None)

    return {
        "context": sess._device.make_current,
        "checks": lambda: sess._input_records(args, {}),
        "shapes": lambda: sess._shapes.prepare(shapes),
        "words": lambda: sess._table_words(call, records, None),
        "setparams": lambda: graph.set_words(words),
        "launch": lambda: cu.cuGraphLaunch(graph.exec, stream),
        "outputs": lambda: sess._results(call, None, None),
    }


def time_stages(sess, args, number: int, repeats: int, sync=None) -> dict:
    """{stage: per_call_us} for each stage, or {"error": why} when this runtime's Session does
    not have the pieces (an older run())."""
    try:
        fns = stage_functions(sess, args)
    except (AttributeError, TypeError, ValueError) as e:
        return {"error": f"no per-stage breakdown for this runtime: {type(e).__name__}: {e}"}
    out = {name: per_call_us(fns[name], number, repeats, sync) for name in STAGES}
    out["loop"] = per_call_us(lambda: None, number, repeats)  # the timing loop's own cost per call
    return out


# ---------------------------------------------------------------------------------- packages

def compile_bert(path: Path, dims: dict, max_seq: int, vocab: int, progress: bool = False) -> None:
    """Hugging Face BERT (random weights, fp32, batch 1) with a dynamic sequence length 1..max_seq."""
    import torch
    from torch.export import Dim

    import grace.aot
    from grace.tools import models

    torch.manual_seed(0)
    model = models.hf_bert(**dims).eval()
    seq = Dim("seq", min=1, max=max_seq)
    example = torch.randint(0, vocab, (1, SEQ))
    t = time.perf_counter()
    grace.aot.compile(model, (example,), output=path, dynamic_shapes={"input_ids": {1: seq}},
                      progress=progress)
    _log(f"compiled {path} in {time.perf_counter() - t:.1f} s")


def _package(args, dims: dict, max_seq: int, tmp: str) -> Path:
    """--package if it exists; else compile there (or into `tmp`)."""
    path = Path(args.package) if args.package else Path(tmp) / "bert.grace"
    if not path.exists():
        _log(f"compiling BERT {dims} with a dynamic sequence 1..{max_seq} (once; --package keeps it)")
        compile_bert(path, dims, max_seq, dims["vocab"])
    return path


# ------------------------------------------------------------------------- fake-driver inputs

class TorchLike:
    """What run() reads from a CUDA torch tensor (arrays._from_torch), without torch: the same
    attribute calls, answered by Python. Its class claims torch's module, as run() dispatches on it."""

    def __init__(self, ptr: int, shape: tuple, dtype: str):
        self._ptr, self.shape, self.dtype = ptr, tuple(shape), f"torch.{dtype}"
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        self._strides = tuple(reversed(strides))

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self) -> tuple:
        return self._strides

    def is_contiguous(self) -> bool:
        return True

    def get_device(self) -> int:
        return 0


TorchLike.__module__ = "torch"


class CaiLike:
    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "strides": None, "version": 3, "stream": None}


class DlpackLike:
    """A producer that speaks DLPack only (DeviceArray's exporter makes the capsules)."""

    def __init__(self, ptr: int, shape: tuple, dtype: str):
        from grace.runtime.arrays import DeviceArray
        self._array = DeviceArray(ptr, shape, dtype, 0)

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def fake_input(kind: str, spec, shape: tuple):
    """A device-resident input of `kind` for input `spec` at `shape`, in the fake driver's memory."""
    from grace.runtime import driver, dtypes
    from grace.runtime.arrays import DeviceArray

    numel = 1
    for d in shape:
        numel *= d
    ptr = driver.mem_alloc(numel * dtypes.itemsize(spec.dtype))
    if kind == "torch":
        return TorchLike(ptr, shape, spec.dtype)
    if kind == "cai":
        return CaiLike(ptr, shape, dtypes.typestr(spec.dtype))
    if kind == "dlpack":
        return DlpackLike(ptr, shape, spec.dtype)
    return DeviceArray(ptr, shape, spec.dtype, 0)


def _input_shape(spec, seq: int) -> tuple:
    return tuple(seq if isinstance(d, str) else d for d in spec.shape)


# ------------------------------------------------------------------------------------- modes

def run_fake(args) -> dict:
    """The default mode: the tiny BERT through the fake driver, on the CPU."""
    from grace.runtime import driver, load
    from grace.tools.fuzz import FakeDriver

    with tempfile.TemporaryDirectory() as tmp:
        path = _package(args, TINY_BERT, TINY_BERT["max_pos"], tmp)
        previous, driver._cu = driver._cu, FakeDriver()
        try:
            pkg = load(path)
            try:
                return _measure_fake(pkg, args, path)
            finally:
                pkg.close()
        finally:
            driver._cu = previous


def _measure_fake(pkg, args, path) -> dict:
    sess = pkg.session()
    specs = pkg.inputs
    inputs = [[fake_input(args.input, s, _input_shape(s, args.seq)) for s in specs] for _ in range(2)]
    sess.run(*inputs[0])
    sess.run(*inputs[1])
    same = inputs[0]
    res = {"mode": "fake", "python": platform.python_version(), "package": str(path),
           "model": f"tiny BERT {TINY_BERT}", "input": args.input, "seq": args.seq,
           "graph": sess.last_graph}
    number, repeats = args.number, args.repeats
    flip = [0]

    def alternating():   # a new pointer every call: the table writer's words change
        flip[0] ^= 1
        sess.run(*inputs[flip[0]])
    res.update(_run_figures(lambda: sess.run(*same), alternating, number, repeats))
    sess.run(*same)
    res["stages_us"] = time_stages(sess, same, number, repeats)
    sess.close()
    return res


def run_gpu(args) -> dict:
    """--gpu: BERT-base on this machine's GPU, CUDA torch tensors as inputs."""
    import torch

    from grace.runtime import load
    from grace.tools.benchmark import BERT_BASE, MAX_SEQ

    if not torch.cuda.is_available():
        raise SystemExit("--gpu: torch sees no CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        path = _package(args, BERT_BASE, MAX_SEQ, tmp)
        t = time.perf_counter()
        pkg = load(path)
        _log(f"loaded in {time.perf_counter() - t:.2f} s")
        try:
            return _measure_gpu(pkg, args, path, BERT_BASE)
        finally:
            pkg.close()


def _measure_gpu(pkg, args, path, dims) -> dict:
    import torch

    from grace.tools import models

    sess = pkg.session()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, dims["vocab"], (1, args.seq), device="cuda", generator=gen)
    other = torch.randint(0, dims["vocab"], (1, args.seq), device="cuda", generator=gen)
    for _ in range(args.warmup):
        sess.run(ids)
        sess.run(other)
    sess.sync()
    res = {"mode": "gpu", "python": platform.python_version(), "package": str(path),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": f"BERT {dims}", "input": "torch", "seq": args.seq, "graph": sess.last_graph}
    burst, repeats = args.burst, args.repeats
    flip, pair = [0], (ids, other)

    def alternating():
        flip[0] ^= 1
        sess.run(pair[flip[0]])
    res.update(_run_figures(lambda: sess.run(ids), alternating, burst, repeats, sess.sync))

    def run_sync():
        sess.run(ids)
        sess.sync()
    res["run_sync_us"] = _show("run_sync_us", per_call_us(run_sync, 1, repeats))
    res["run_first_us"] = _show("run_first_us", per_call_us(lambda: sess.run(ids), 1, repeats, sess.sync))
    sess.run(ids)
    res["stages_us"] = time_stages(sess, (ids,), burst, repeats, sess.sync)
    _log(f"stages: {json.dumps(res['stages_us'])}")
    sess.close()

    torch.manual_seed(0)
    model = models.hf_bert(**dims).eval().cuda()
    with torch.no_grad():
        for _ in range(args.warmup):
            model(ids)
        torch.cuda.synchronize()

        def eager_sync():
            model(ids)
            torch.cuda.synchronize()
        res["eager_sync_us"] = _show("eager_sync_us", per_call_us(eager_sync, 1, repeats))
        res["eager_host_us"] = _show("eager_host_us",
                                     per_call_us(lambda: model(ids), 1, repeats, torch.cuda.synchronize))
    return res


# ------------------------------------------------------------------------------------ report

def report(res: dict) -> str:
    def fig(x) -> str:
        return (f"{x['median']:8.2f} µs/call  (min {x['min']:.2f}; median of {x['repeats']} x "
                f"{x['number']} calls)")

    head = ("fake CUDA driver (CPU; driver calls are Python, the figure is run()'s Python)"
            if res["mode"] == "fake" else res["device"])
    lines = [f"host path of Session.run() -- {head}",
             f"  {res['model']}, input {res['input']} [1, {res['seq']}], graph {res['graph']}",
             f"  run(), same input buffer       {fig(res['run_us'])}",
             f"  run(), two buffers alternating {fig(res['run_alternating_us'])}"]
    for key, label in (("run_first_us", "run(), the first after a sync"),
                       ("run_sync_us", "run() + sync()"), ("eager_sync_us", "eager torch + sync"),
                       ("eager_host_us", "eager torch, host only")):
        if key in res:
            lines.append(f"  {label:<30s} {fig(res[key])}")
    stages = res["stages_us"]
    if "error" in stages:
        lines.append(f"  stages: {stages['error']}")
    else:
        lines.append("  stages, each timed alone (median µs/call):")
        for name in STAGES:
            lines.append(f"    {name:<10s} {stages[name]['median']:6.2f}")
        total = sum(stages[name]["median"] for name in STAGES)
        lines.append(f"    {'sum':<10s} {total:6.2f}   (run(): {res['run_us']['median']:.2f}; "
                     f"the timing loop itself: {stages['loop']['median']:.2f} per call, in each figure)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m grace.tools.host_bench", description=__doc__.split("\n\n")[0],
        epilog="Without --gpu nothing needs a GPU: the package is compiled on the CPU and run on "
               "the fake driver. --gpu needs torch with CUDA, transformers, cuda-bindings and a GPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true",
                    help="BERT-base on the GPU with CUDA torch inputs (default: tiny BERT, fake driver)")
    ap.add_argument("--package", metavar="PATH",
                    help="use this .grace package (compiled there first if it does not exist); "
                         "it must be the mode's model (default: compiled into a temporary directory)")
    ap.add_argument("--seq", type=int, default=SEQ, help=f"sequence length of the input (default {SEQ})")
    ap.add_argument("--input", choices=("torch", "cai", "dlpack", "device"), default="torch",
                    help="fake mode: what the input looks like (default torch: a stand-in with a "
                         "CUDA torch tensor's attributes); --gpu always passes real torch tensors")
    ap.add_argument("--repeats", type=int, default=None,
                    help="samples per figure; the median is reported (default 50 fake, 100 --gpu)")
    ap.add_argument("--number", type=int, default=2000,
                    help="fake mode: calls per sample (default 2000)")
    ap.add_argument("--burst", type=int, default=20,
                    help="--gpu: calls per sample, after a sync (default 20: the launch queue "
                         "absorbs them, so the host's time is what is measured)")
    ap.add_argument("--warmup", type=int, default=20, help="--gpu: warm-up calls (default 20)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 100 if args.gpu else 50
    if args.seq < 1:
        ap.error("--seq must be >= 1")

    res = run_gpu(args) if args.gpu else run_fake(args)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
