"""Op-conformance sweep: every OpInfo of torch's op database through export → compile → run,
compared with torch.

    python -m grace.tools.op_sweep --fast --executor interpret          # the CI subset, on the CPU
    python -m grace.tools.op_sweep --executor gpu --out sweep.json      # every op, on the GPU
    python -m grace.tools.op_sweep --ops 'pow,floor_divide,div.*' --samples 4 --dtypes float32

For each selected OpInfo (torch.testing._internal.common_methods_invocations.op_db) and each
dtype it supports (default float32 and float16), up to --samples of its own sample inputs, plus
edge samples for elementwise unary/binary ops: 0-d, empty and size-1 tensors, ±0.5/±1.5/±2.5,
±0, tiny and huge values, negative bases, and int64 values past 2**24 (for ops that take int64).
Each sample becomes an nn.Module whose forward takes the sample's tensors as inputs (tensors in
lists are separate inputs; everything else is closed over), which is compiled with grace.aot and
run by the chosen executor. Outcomes per sample:

    pass                the outputs match torch (shapes, dtypes, values)
    not_lowered         grace refused it with its own error (LoweringError, ...): the message is
                        recorded; `names_op` says whether it names the ATen op and the user's line
    wrong               it ran, but a shape, dtype or value differs from torch
    crash               anything else: an exception inside the compiler, a Triton build error,
                        a runtime/interpreter failure, a timeout, a dying worker process
    export_refused      torch.export (or torch's decompositions) failed: not grace's fault
    unsupported_sample  torch itself raises on the sample, or the op returns non-tensors
    skipped             random or uninitialised-memory ops (bernoulli, rand*, dropout, empty*)

Values are compared against the op computed in float64 on float64 copies of the inputs (where the
op supports float64), rounded to the output dtype; an element passes when it is within tolerance
of that reference or of eager torch in the same dtype, or no further from the reference than twice
eager torch's own error. NaN and ±inf positions must match; integer and bool outputs must be exact.
Tolerances: TOLERANCES (rtol, and atol as a fraction of the reference's largest magnitude; for the
edge samples of elementwise ops atol is the dtype's smallest normal number, so tiny results must be
right relatively). The norm-wise relative error is checked too.

Executors: `interpret` compiles in this process and runs the packages' own kernels on the CPU with
Triton's interpreter in worker processes (TRITON_INTERPRET=1 must be set before triton is imported,
so they are separate processes; one worker runs many packages, a dying or hung worker costs only
the sample it was running). `gpu` runs them with grace.runtime in a worker process on CUDA device
--device. Compiles overlap with execution; --jobs sets the number of executor workers.

Needs the [aot,test] extras (torch, triton, expecttest). Writes --out JSON: per sample the op,
dtype, sample, outcome, first-line message, errors; plus the counts. Docs: docs/op-conformance.md.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

OUTCOMES = ("pass", "not_lowered", "wrong", "crash", "export_refused", "unsupported_sample",
            "skipped")

# The CI subset: elementwise unary/binary (with their edge samples), reductions, views, indexing,
# GEMMs, softmax/norms, where/clamp, cat/stack, and the ops with tricky edge semantics.
FAST_OPS = (
    # elementwise unary (each with 0-d, empty, size-1, edge-value and int64 samples)
    "abs", "exp", "log", "rsqrt", "sigmoid", "tanh", "sin", "erf", "expm1", "log1p", "floor",
    "round", "nn.functional.gelu", "nn.functional.softplus", "nn.functional.relu",
    # elementwise binary (0-d, broadcast 0-d, empty, size-1, an edge-value grid, int64)
    "add", "mul", "div.no_rounding_mode", "div.floor_rounding", "pow", "floor_divide",
    "remainder", "fmod", "maximum", "eq",
    # where / clamp
    "where", "clamp", "masked_fill",
    # reductions and scans
    "sum", "mean", "amax", "var", "argmax", "cumsum",
    # views
    "reshape", "transpose", "permute", "expand", "flip",
    # indexing
    "index_select", "gather", "__getitem__",
    # GEMMs
    "mm", "bmm", "addmm", "matmul", "nn.functional.linear",
    # softmax / normalisation
    "softmax", "log_softmax", "nn.functional.layer_norm",
    # joining
    "cat", "stack",
)

# Random or uninitialised-memory ops: their outputs cannot be compared with torch.
RANDOM_OPS = (
    "bernoulli", "multinomial", "normal*", "uniform", "cauchy", "exponential", "geometric",
    "log_normal", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "nn.functional.dropout*", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout*",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool*", "empty*", "new_empty*",
    "torch.ops.aten._flash_attention_forward", "torch.ops.aten._efficient_attention_forward",
    "svd_lowrank", "pca_lowrank",
)

# (rtol, atol as a fraction of the reference's largest finite magnitude) per output dtype
TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (2e-3, 1e-3),
    "bfloat16": (1.6e-2, 8e-3),
}

INT64_EDGES = [2**24 + 1, -(2**24 + 1), 2**31 + 5, -(2**31) - 7, 2**40 + 3, -(2**40) - 3,
               2**53 + 1, 0, 1, -1, 7, -7]
INT64_RHS = [1, 2, 3, -3, 5, -7, 2**24 + 3, -(2**24 + 3)]
INT64_RHS_SMALL = [0, 1, 2, 3, 5]          # exponents and shift counts
SMALL_RHS_OPS = ("pow", "float_power", "__rpow__", "bitwise_left_shift", "bitwise_right_shift",
                 "ldexp")


def _float_edges(dtype) -> list[float]:
    import torch

    fi = torch.finfo(dtype)
    tiny, huge = float(fi.tiny) * 4, float(fi.max) / 4
    return [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1.0, -1.0, 2.0, -3.0, 7.25,
            tiny, -tiny, huge, -huge, 100.0, -100.0]


# Conversions of a float to an integer type: a value outside the target's range is undefined
# behaviour in C++ and torch (CPU and CUDA give different answers), so edge samples keep only the
# values whose truncation fits. uint8 is the exception torch defines: through int64 (c10's
# static_cast_with_inter_type), so -1.5 -> 255 is checked.
INT_CASTS = {"byte": (-(2**63), 2**63 - 1), "char": (-128, 127), "short": (-(2**15), 2**15 - 1),
             "int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


def _float_rhs(dtype) -> list[float]:
    import torch

    fi = torch.finfo(dtype)
    return [0.5, -0.5, 1.5, -1.5, 2.0, -2.0, 3.0, 1.0, -1.0, 0.0, -0.0, float(fi.tiny) * 4,
            float(fi.max) / 4]


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One sample of one op at one dtype."""
    id: int
    op: str                 # the OpInfo's full name: name[.variant_test_name]
    dtype: str              # the dtype the sample was made for
    sample: str             # "opinfo[3]", "edge:values", ...
    elementwise: bool
    fn: Any = None
    sample_input: Any = None          # (input, args, kwargs)
    float64_ok: bool = False
    outcome: str | None = None        # set when no compile is needed (skipped, ...)
    message: str = ""


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def load_op_db():
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as exc:   # expecttest is imported by torch.testing._internal
        raise SystemExit(f"op_sweep: cannot import torch's op database ({exc}); "
                         "install the test extra: pip install -e '.[aot,test]'") from exc
    return op_db


def _matches(name: str, base: str, patterns) -> bool:
    """`name` (name.variant) matches a glob, or its base name does."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(base, p) for p in patterns)


def select_ops(op_db, patterns=None, exclude=()):
    """OpInfos whose full name (name.variant) or base name matches a glob (None: every op)."""
    ops = []
    for op in op_db:
        name = full_name(op)
        if patterns is not None and not _matches(name, op.name, patterns):
            continue
        if exclude and _matches(name, op.name, exclude):
            continue
        ops.append(op)
    return ops


def is_random(op) -> bool:
    return bool(getattr(op, "has_nondeterministic_output", False)) or \
        _matches(full_name(op), op.name, RANDOM_OPS)


def _kind(op) -> str:
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

    if isinstance(op, UnaryUfuncInfo):
        return "unary"
    if isinstance(op, BinaryUfuncInfo):
        return "binary"
    return "other"


def _sample_kwargs(op, dtype, t) -> dict:
    try:
        return dict(op.sample_kwargs("cpu", dtype, t)[0])
    except Exception:  # noqa: BLE001 - no extra kwargs then
        return {}


def edge_samples(op, dtype) -> list[tuple[str, tuple]]:
    """(name, (input, args, kwargs)) edge samples for an elementwise unary/binary op at `dtype`."""
    import torch

    kind = _kind(op)
    out = []
    if dtype.is_floating_point:
        vals = _float_edges(dtype)
        if op.name in INT_CASTS:
            lo, hi = INT_CASTS[op.name]
            vals = [v for v in vals if lo <= math.trunc(v) <= hi]
        vals = torch.tensor(vals, dtype=dtype)
        if kind == "unary":
            kw = _sample_kwargs(op, dtype, vals)
            out += [("edge:values", (vals, (), kw)),
                    ("edge:0-d", (torch.tensor(-1.5, dtype=dtype), (), kw)),
                    ("edge:empty", (torch.empty(0, 3, dtype=dtype), (), kw)),
                    ("edge:size-1", (torch.full((1, 1), 0.5, dtype=dtype), (), kw))]
        elif kind == "binary":
            rhs = torch.tensor(_float_rhs(dtype), dtype=dtype)
            a = vals.repeat_interleave(len(rhs))
            b = rhs.repeat(len(vals))
            kw = _sample_kwargs(op, dtype, a)
            out += [("edge:values", (a, (b,), kw)),
                    ("edge:0-d", (torch.tensor(-1.5, dtype=dtype), (torch.tensor(0.5, dtype=dtype),), kw)),
                    ("edge:0-d-rhs", (torch.linspace(-3, 3, 12, dtype=dtype).reshape(3, 4),
                                      (torch.tensor(1.5, dtype=dtype),), kw)),
                    ("edge:empty", (torch.empty(0, 3, dtype=dtype), (torch.ones(3, dtype=dtype),), kw)),
                    ("edge:size-1", (torch.full((1,), -2.5, dtype=dtype),
                                     (torch.full((1,), 1.5, dtype=dtype),), kw))]
    elif dtype == torch.int64:
        vals = torch.tensor(INT64_EDGES, dtype=torch.int64)
        if kind == "unary":
            out.append(("edge:int64", (vals, (), _sample_kwargs(op, dtype, vals))))
        elif kind == "binary":
            rhs = torch.tensor(INT64_RHS_SMALL if op.name in SMALL_RHS_OPS else INT64_RHS,
                               dtype=torch.int64)
            a = vals.repeat_interleave(len(rhs))
            b = rhs.repeat(len(vals))
            out.append(("edge:int64", (a, (b,), _sample_kwargs(op, dtype, a))))
    return out


def _dtype_names(names):
    import torch
    return [getattr(torch, n) for n in names]


def build_cases(ops, dtypes=("float32", "float16"), samples: int = 2, edges: bool = True,
                int64_edges: bool = True) -> list[Case]:
    """The cases of `ops` at each supported dtype: up to `samples` OpInfo samples, then edges."""
    import torch

    cases: list[Case] = []

    def add(**kw):
        cases.append(Case(id=len(cases), **kw))

    for op in ops:
        name = full_name(op)
        try:
            supported = op.supported_dtypes("cpu")
        except Exception:  # noqa: BLE001
            supported = set()
        elementwise = _kind(op) != "other"
        float64_ok = torch.float64 in supported
        for dt in _dtype_names(dtypes):
            dname = str(dt).replace("torch.", "")
            if dt not in supported:
                continue
            if is_random(op):
                add(op=name, dtype=dname, sample="*", elementwise=elementwise,
                    outcome="skipped", message="random or uninitialised output")
                continue
            torch.manual_seed(0)
            got = []
            try:
                for i, s in enumerate(op.sample_inputs("cpu", dt, requires_grad=False)):
                    if i >= samples:
                        break
                    got.append((f"opinfo[{i}]", (s.input, tuple(s.args), dict(s.kwargs))))
            except Exception as exc:  # noqa: BLE001
                add(op=name, dtype=dname, sample=f"opinfo[{len(got)}]", elementwise=elementwise,
                    outcome="unsupported_sample", message=f"sample_inputs raised: {first_line(exc)}")
            if edges and elementwise:
                got += edge_samples(op, dt)
            for sname, sample in got:
                add(op=name, dtype=dname, sample=sname, elementwise=elementwise, fn=op.op,
                    sample_input=sample, float64_ok=float64_ok)
        if int64_edges and edges and elementwise and torch.int64 in supported \
                and "int64" not in dtypes and not is_random(op):
            for sname, sample in edge_samples(op, torch.int64):
                add(op=name, dtype="int64", sample=sname, elementwise=elementwise, fn=op.op,
                    sample_input=sample, float64_ok=float64_ok)
    return cases


# ----------------------------------------------------------------------------------------------
# the module under test
# ----------------------------------------------------------------------------------------------


def first_line(exc_or_msg) -> str:
    if isinstance(exc_or_msg, BaseException):
        text = str(exc_or_msg).strip()
        name = type(exc_or_msg).__name__
        line = text.splitlines()[0] if text else ""
        return f"{name}: {line}" if line else name
    text = str(exc_or_msg).strip()
    return text.splitlines()[0] if text else ""


def _split(sample):
    """The sample's tensors (in pytree order) and a function rebuilding (input, args, kwargs)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(sample)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    frame = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def rebuild(ts):
        new = list(frame)
        for i, t in zip(positions, ts):
            new[i] = t
        return tree_unflatten(new, spec)

    return tensors, rebuild


def flat_outputs(value):
    """The op's result as a list of tensors, or a string saying why it is not one."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(value)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad:
        return f"the op returns a non-tensor ({bad[0]})"
    if not leaves:
        return "the op returns no tensors"
    return leaves


def input_name(i: int) -> str:
    """torch.export's name for the i-th tensor of SampleModule.forward(*xs)."""
    return f"xs_{i}"


def make_module(fn, rebuild):
    """nn.Module whose forward(*xs) calls fn on the sample rebuilt from the tensors xs; a flat
    tuple of tensors out. (The op's line in grace's messages is the forward's line here.)"""
    import torch
    from torch.utils._pytree import tree_flatten

    class SampleModule(torch.nn.Module):
        def forward(self, *xs):
            return self.call(*xs)

        def call(self, *tensors):
            inp, args, kwargs = rebuild(tensors)
            return tuple(tree_flatten(fn(inp, *args, **kwargs))[0])

    return SampleModule()


def _to64(t):
    import torch
    return t.to(torch.float64) if t.is_floating_point() else t


def references(case: Case):
    """(eager outputs in the sample's dtype, float64 outputs or None) — or a str: unsupported."""
    import torch

    tensors, rebuild = _split(case.sample_input)
    try:
        with torch.no_grad():
            inp, args, kwargs = rebuild([t.clone() for t in tensors])
            eager = flat_outputs(case.fn(inp, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001
        return f"torch raises on this sample: {first_line(exc)}"
    if isinstance(eager, str):
        return eager
    eager = [t.detach().clone() for t in eager]
    if any(t.is_complex() or t.is_quantized or t.layout != torch.strided for t in eager):
        return "the op returns complex, quantized or sparse tensors"
    if any(t.dtype == torch.bfloat16 for t in eager):   # no numpy dtype; the interpreter refuses
        return "the op returns bfloat16 tensors"
    ref = None
    if case.float64_ok and any(t.is_floating_point() for t in tensors):
        try:
            with torch.no_grad():
                inp, args, kwargs = rebuild([_to64(t.clone()) for t in tensors])
                ref = flat_outputs(case.fn(inp, *args, **kwargs))
            if isinstance(ref, str) or len(ref) != len(eager) or \
                    any(r.shape != e.shape for r, e in zip(ref, eager)):
                ref = None
            else:
                ref = [r.detach().to(e.dtype) if e.is_floating_point() and r.is_floating_point()
                       else e for r, e in zip(ref, eager)]
        except Exception:  # noqa: BLE001 - no float64 reference: eager alone
            ref = None
    return eager, ref


# ----------------------------------------------------------------------------------------------
# classification
# ----------------------------------------------------------------------------------------------


def _grace_dir() -> str:
    return str(Path(__file__).resolve().parent.parent)


def classify_compile_error(exc: BaseException) -> tuple[str, str]:
    """(outcome, first-line message) for an exception raised by grace.aot.compile."""
    msg = first_line(exc)
    mod = type(exc).__module__ or ""
    name = type(exc).__name__
    if name == "ExportError":
        return "export_refused", msg
    if name == "BuildError":
        return "crash", f"Triton build error: {msg}"
    if mod.startswith("grace.aot") and name.endswith("Error") and \
            not str(exc).startswith("internal"):     # LoweringError, ShapeError: the user's errors
        return "not_lowered", msg
    # torch's decompositions (run inside compile) failing: torch's problem, like an export failure
    # (frames by their real path: grace imported through a symlink names its files by the link)
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    ours = [f for f in frames if os.path.realpath(f.filename).startswith(_grace_dir())
            and not f.filename.endswith("op_sweep.py")]
    if ours and ours[-1].name == "to_core_aten":
        return "export_refused", f"decomposition failed: {msg}"
    where = f" (at {Path(ours[-1].filename).name}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    return "crash", msg + where


def names_op(message: str) -> bool:
    """Does a not_lowered message name the ATen op (aten.xxx)?"""
    return "aten." in message


def names_line(message: str) -> bool:
    """Does a not_lowered message name the user's source line (File "...", line N)?"""
    return "used at File " in message and ", line " in message


def _close(g, r, rtol, atol):
    with np.errstate(invalid="ignore", over="ignore"):
        both_nan = np.isnan(g) & np.isnan(r)
        same = g == r
        near = np.isfinite(g) & np.isfinite(r) & (np.abs(g - r) <= atol + rtol * np.abs(r))
    return both_nan | same | near


def _fmt(v) -> str:
    return repr(int(v)) if isinstance(v, (np.integer, int)) else \
        repr(bool(v)) if isinstance(v, (np.bool_, bool)) else f"{float(v):.9g}"


def compare_output(got: np.ndarray, eager: np.ndarray, ref: np.ndarray | None,
                   strict: bool = False) -> tuple[bool, str, float]:
    """(ok, why not, max error relative to the reference's magnitude) for one output.

    `eager`: torch in the sample's dtype; `ref`: torch in float64 rounded to the output dtype (or
    None). Shapes and dtypes must equal eager's; integers and bools exactly; floats per
    TOLERANCES, NaN/inf positions matching. `strict` (edge samples of elementwise ops): atol is
    the dtype's smallest normal number instead of a fraction of the largest |reference|, so
    expm1(1e-30) = 0 is wrong, where it would vanish next to a huge value."""
    got, eager = np.asarray(got), np.asarray(eager)
    if got.shape != eager.shape:
        return False, f"shape {list(got.shape)}, torch gives {list(eager.shape)}", float("inf")
    if got.dtype != eager.dtype:
        return False, f"dtype {got.dtype}, torch gives {eager.dtype}", float("inf")
    if got.size == 0:
        return True, "", 0.0
    if got.dtype.kind not in "fc":
        bad = got != eager
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            return False, (f"{int(bad.sum())}/{got.size} elements differ; first at {list(idx)}: "
                           f"got {_fmt(got[idx])}, torch {_fmt(eager[idx])}"), float("inf")
        return True, "", 0.0
    rtol, atol_frac = TOLERANCES.get(str(got.dtype), TOLERANCES["float32"])
    g = got.astype(np.float64)
    e = eager.astype(np.float64)
    r = e if ref is None else np.asarray(ref).astype(np.float64)
    finite_r = np.abs(r[np.isfinite(r)])
    scale = float(finite_r.max()) if finite_r.size else 0.0
    if strict:
        atol = float(np.finfo(got.dtype).tiny)
    else:
        atol = atol_frac * scale if scale > 0 else float(np.finfo(got.dtype).tiny)
    ok = _close(g, r, rtol, atol) | _close(g, e, rtol, atol)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - r)
        eager_err = np.abs(e - r)
        ok |= np.isfinite(err) & (err <= 2 * eager_err + atol)
        both = np.isfinite(g) & np.isfinite(r)
        max_err = float(err[both].max() / (scale if scale > 0 else 1.0)) if both.any() else 0.0
        ok_elems = bool(ok.all())
        nr = float(np.linalg.norm(r[both])) if both.any() else 0.0
        ng = float(np.linalg.norm((g - r)[both])) if both.any() else 0.0
        ne = float(np.linalg.norm((e - r)[both])) if both.any() else 0.0
    norm_ok = ng <= max(rtol * nr, 2 * ne + rtol * nr, atol * np.sqrt(max(int(both.sum()), 1)))
    if ok_elems and norm_ok:
        return True, "", max_err
    if not ok_elems:
        bad = ~ok
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        return False, (f"{int(bad.sum())}/{got.size} elements outside tolerance; first at "
                       f"{list(idx)}: got {_fmt(g[idx])}, torch {_fmt(r[idx])} (eager {_fmt(e[idx])}); "
                       f"max err {max_err:.2e} of max |ref|"), max_err
    return False, f"norm-wise relative error {ng / max(nr, 1e-300):.2e}", max_err


def compare_outputs(got: list, eager: list, ref: list | None, strict=False):
    """(outcome, message, max error) over all outputs."""
    if len(got) != len(eager):
        return "wrong", f"{len(got)} outputs, torch gives {len(eager)}", float("inf")
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, eager)):
        ok, why, err = compare_output(g, e, None if ref is None else ref[i], strict)
        worst = max(worst, err)
        if not ok:
            return "wrong", f"output {i}: {why}", err
    return "pass", "", worst


# ----------------------------------------------------------------------------------------------
# compile (this process)
# ----------------------------------------------------------------------------------------------


class _CompileTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _CompileTimeout()


def prepare(case: Case, workdir: Path, options: dict) -> dict:
    """Reference + compile one case. Returns a result record; `status` "ready" means a package
    and its inputs are on disk for an executor."""
    import torch

    rec = {"id": case.id, "op": case.op, "dtype": case.dtype, "sample": case.sample}
    if case.outcome:
        return {**rec, "outcome": case.outcome, "message": case.message}
    refs = references(case)
    if isinstance(refs, str):
        return {**rec, "outcome": "unsupported_sample", "message": refs}
    eager, ref = refs
    tensors, rebuild = _split(case.sample_input)
    rec["shapes"] = [list(t.shape) for t in tensors]
    if any(t.is_complex() or t.dtype == torch.bfloat16 or t.layout != torch.strided
           for t in tensors):
        return {**rec, "outcome": "unsupported_sample", "message": "complex, bf16 or sparse input"}
    module = make_module(case.fn, rebuild)
    path = workdir / f"c{case.id}.grace"
    from grace.aot import compile as grace_compile

    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm) if options.get("compile_timeout") else None
    if old is not None:
        signal.alarm(int(options["compile_timeout"]))
    try:
        grace_compile(module, tuple(t.clone() for t in tensors), output=path, progress=False,
                      jobs=1, archs=options.get("archs", ("sm_90",)),
                      fp32_matmul=options.get("fp32_matmul"))
    except _CompileTimeout:
        return {**rec, "outcome": "crash",
                "message": f"compile timed out after {options['compile_timeout']} s"}
    except Exception as exc:  # noqa: BLE001 - classified
        outcome, message = classify_compile_error(exc)
        rec.update(outcome=outcome, message=message)
        if outcome == "not_lowered":
            rec["names_op"] = names_op(message)
            rec["names_line"] = names_line(message)
        return rec
    finally:
        if old is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    rec["compile_s"] = round(time.perf_counter() - t0, 3)
    from grace.formats import read_package

    manifest = read_package(path, verify=False).manifest
    names = [s["name"] for s in manifest["inputs"]]
    index = {input_name(i): i for i in range(len(tensors))}
    if not set(names) <= set(index):   # not torch.export's usual names: by position
        index = {n: i for i, n in enumerate(names)}
    inputs = {n: tensors[index[n]].detach().contiguous().numpy() for n in names}
    np.savez(workdir / f"c{case.id}.in.npz", **inputs)
    rec.update(status="ready", package=str(path), inputs=str(workdir / f"c{case.id}.in.npz"),
               outputs=str(workdir / f"c{case.id}.out.npz"),
               _eager=[t.numpy() for t in eager],
               _ref=None if ref is None else [t.numpy() for t in ref],
               _strict=case.elementwise and case.sample.startswith("edge:"))
    dim = tie_dim(case.op, case.sample_input)
    if dim is not None:
        rec["_tie"] = (tensors[0].detach().numpy(), dim)
    return rec


# ----------------------------------------------------------------------------------------------
# executor workers (child processes)
# ----------------------------------------------------------------------------------------------


def worker_main(executor: str, device: int = 0) -> int:
    """Read {"package", "inputs", "outputs"} JSON lines on stdin; run each; write the outputs
    (o0, o1, ... in manifest order) and answer one JSON line per job on stdout."""
    if executor == "interpret":
        os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton
    out = sys.stdout
    sys.stdout = sys.stderr                    # stray prints must not corrupt the protocol
    session_of = None
    if executor == "gpu":
        import grace.runtime as rt

        def session_of(path):
            loaded = rt.load(path, device=device)
            return loaded, loaded.session(poison=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        reply = {"id": job["id"]}
        try:
            with np.load(job["inputs"]) as data:
                inputs = {k: data[k] for k in data.files}
            if executor == "interpret":
                from grace.formats import read_package
                from grace.tools.interpret import run_package

                pkg = read_package(job["package"])
                result = run_package(pkg, inputs, poison=True)
                names = [s["name"] for s in pkg.manifest["outputs"]]
                arrays = [np.asarray(result[n]) for n in names]
            else:
                loaded, sess = session_of(job["package"])
                try:
                    dev = sess.run(**inputs)
                    sess.sync()
                    names = [s.name for s in sess.outputs]
                    arrays = [np.array(dev[n].numpy()) for n in names]
                finally:
                    loaded.close()
            np.savez(job["outputs"], **{f"o{i}": a for i, a in enumerate(arrays)})
            reply.update(ok=True, n=len(arrays))
        except Exception as exc:  # noqa: BLE001 - reported, the parent classifies
            reply.update(ok=False, error=first_line(exc))
            traceback.print_exc(file=sys.stderr)
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


class Worker:
    """One executor child process, restarted when it dies or hangs."""

    def __init__(self, executor: str, device: int, log_path: Path):
        self.executor, self.device, self.log_path = executor, device, log_path
        self.proc = None
        self.lines: queue.Queue = queue.Queue()

    def _start(self):
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if _HIDDEN_GPUS:   # the driver hid the GPUs from itself, not from us
            original = _HIDDEN_GPUS[0]
            if original is None:
                env.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                env["CUDA_VISIBLE_DEVICES"] = original
        cmd = [sys.executable, "-m", "grace.tools.op_sweep", "--worker", self.executor,
               "--device", str(self.device)]
        self.log = open(self.log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=env)
        self.lines = queue.Queue()
        proc, lines = self.proc, self.lines

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def stop(self):
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
            self.proc = None

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            self.proc = None

    def run(self, job: dict, timeout: float) -> dict:
        if self.proc is not None and self.proc.poll() is not None:   # died between jobs
            self.log.close()
            self.proc = None
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self._kill()
            return {"ok": False, "crash": f"timed out after {timeout:.0f} s (worker killed)"}
        if line is None:
            code = self.proc.wait()
            tail = _tail(self.log_path)
            self.log.close()
            self.proc = None
            return {"ok": False, "crash": f"worker process died (exit {code})" +
                    (f": {tail}" if tail else "")}
        return json.loads(line)


def _tail(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def tie_dim(op: str, sample) -> int | None:
    """The dimension along which `op` returns indices whose order among equal values torch leaves
    unspecified (topk: "no guarantee" which of equal elements), or None."""
    if op != "topk":
        return None
    _, args, kwargs = sample
    return int(args[1]) if len(args) > 1 else int(kwargs.get("dim", -1))


def same_picks(x: np.ndarray, got: np.ndarray, want: np.ndarray, dim: int) -> bool:
    """Indices `got` pick the same values of `x` along `dim` as `want`, each index at most once
    per row: equal up to the order of ties."""
    if got.shape != want.shape or got.dtype != want.dtype or got.size == 0:
        return False
    if x.ndim == 0:
        return bool((got == want).all())
    n = x.shape[dim]
    if ((got < 0) | (got >= n)).any():
        return False
    a, b = np.take_along_axis(x, got, dim), np.take_along_axis(x, want, dim)
    if not ((a == b) | (np.isnan(a) & np.isnan(b))).all():
        return False
    srt = np.sort(got, axis=dim)
    return not (np.diff(srt, axis=dim) == 0).any()


def finish(rec: dict, reply: dict) -> dict:
    """The record of a ready case, given the worker's reply."""
    eager, ref, strict = rec.pop("_eager"), rec.pop("_ref"), rec.pop("_strict")
    tie = rec.pop("_tie", None)
    if "crash" in reply:
        rec.update(outcome="crash", message=reply["crash"])
    elif not reply.get("ok"):
        rec.update(outcome="crash", message=f"run failed: {reply.get('error', '?')}")
    else:
        with np.load(rec["outputs"]) as data:
            got = [data[f"o{i}"] for i in range(int(reply["n"]))]
        if tie is not None and len(got) == 2 and same_picks(tie[0], got[1], eager[1], tie[1]):
            got[1] = eager[1]   # the same elements, ties in another order: as good as torch's
        outcome, message, err = compare_outputs(got, eager, ref, strict)
        rec.update(outcome=outcome, message=message)
        if np.isfinite(err):
            rec["max_err"] = float(f"{err:.3g}")
    return rec


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def _safe_prepare(case: Case, workdir: Path, options: dict) -> dict:
    try:
        return prepare(case, workdir, options)
    except Exception as exc:  # noqa: BLE001 - the sweep's own failure on one case
        return {"id": case.id, "op": case.op, "dtype": case.dtype, "sample": case.sample,
                "outcome": "crash", "message": f"sweep: {first_line(exc)}"}


_FORKED: tuple = ()


def _prepare_forked(i: int) -> dict:
    import warnings

    cases, workdir, options = _FORKED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _safe_prepare(cases[i], workdir, options)


def _prepared(cases, workdir, options, compile_jobs: int):
    """Prepared records, compiled here or (compile_jobs > 1) in forked compile processes."""
    import warnings

    if compile_jobs <= 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for case in cases:
                yield _safe_prepare(case, workdir, options)
        return
    import multiprocessing

    global _FORKED
    _FORKED = (cases, workdir, options)
    seen = set()
    pool = multiprocessing.get_context("fork").Pool(compile_jobs, maxtasksperchild=100)
    try:
        it = pool.imap_unordered(_prepare_forked, range(len(cases)), chunksize=1)
        while len(seen) < len(cases):
            try:
                rec = it.next(timeout=float(options.get("compile_timeout") or 600) + 120)
            except StopIteration:
                break
            except multiprocessing.TimeoutError:
                break
            seen.add(rec["id"])
            yield rec
    finally:
        pool.terminate()
        pool.join()
    for case in cases:      # a compile process died (the pool loses its task) or hung
        if case.id not in seen:
            yield {"id": case.id, "op": case.op, "dtype": case.dtype, "sample": case.sample,
                   "outcome": "crash", "message": "compile process died or hung"}


def sweep(cases: list[Case], executor: str = "interpret", jobs: int = 1, timeout: float = 300,
          compile_timeout: float = 600, archs=("sm_90",), fp32_matmul=None, device: int = 0,
          keep: Path | None = None, progress: bool = True, on_result=None,
          compile_jobs: int = 1) -> list[dict]:
    """Compile every case (here, or in `compile_jobs` forked processes) and run the compiled ones
    in `jobs` executor workers, overlapped with the compiles; the result records in case order.
    `on_result(record)` is called as each finishes."""
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="grace-op-sweep-"))
    workdir.mkdir(parents=True, exist_ok=True)
    options = {"compile_timeout": compile_timeout, "archs": tuple(archs), "fp32_matmul": fp32_matmul}
    results: dict[int, dict] = {}
    lock = threading.Lock()
    todo: queue.Queue = queue.Queue(maxsize=max(2, 2 * jobs))

    bar = task = None
    if progress:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        bar = Progress(TextColumn("[bold]op sweep[/]"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(),
                       TextColumn("{task.fields[now]}"), transient=False)
        task = bar.add_task("sweep", total=len(cases), now="")
        bar.start()

    def done(rec):
        for f in ("package", "inputs", "outputs"):
            p = rec.get(f)
            if p and not keep:
                Path(p).unlink(missing_ok=True)
        for f in ("status", "package", "inputs", "outputs"):
            if not keep:
                rec.pop(f, None)
        with lock:
            results[rec["id"]] = rec
            if bar is not None:
                bar.update(task, advance=1, now=f"{rec['op']} {rec['dtype']} {rec['sample']}")
            if on_result:
                on_result(rec)

    def serve(k):
        w = Worker(executor, device, workdir / f"worker{k}.log")
        try:
            while True:
                rec = todo.get()
                if rec is None:
                    return
                job = {"id": rec["id"], "package": rec["package"], "inputs": rec["inputs"],
                       "outputs": rec["outputs"]}
                try:
                    reply = w.run(job, timeout)
                    done(finish(rec, reply))
                except Exception as exc:  # noqa: BLE001 - one sample, not the sweep
                    for key in ("_eager", "_ref", "_strict", "_tie"):
                        rec.pop(key, None)
                    done({**rec, "outcome": "crash", "message": f"sweep: {first_line(exc)}"})
        finally:
            w.stop()

    threads = [threading.Thread(target=serve, args=(k,), daemon=True) for k in range(jobs)]
    for t in threads:
        t.start()
    try:
        for rec in _prepared(cases, workdir, options, compile_jobs):
            if rec.get("status") == "ready":
                todo.put(rec)
            else:
                done(rec)
    finally:
        for _ in threads:
            todo.put(None)
        for t in threads:
            t.join()
        if bar is not None:
            bar.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return [results[c.id] for c in cases if c.id in results]


def counts(results: list[dict]) -> dict:
    out = {k: 0 for k in OUTCOMES}
    for r in results:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return out


def op_outcomes(results: list[dict]) -> dict:
    """Per op (and dtype): the worst outcome of its samples."""
    rank = {k: i for i, k in enumerate(("crash", "wrong", "not_lowered", "export_refused",
                                        "unsupported_sample", "pass", "skipped"))}
    ops: dict = {}
    for r in results:
        key = r["op"]
        cur = ops.get(key)
        if cur is None or rank[r["outcome"]] < rank[cur]:
            ops[key] = r["outcome"]
    return ops


def summarize(results: list[dict], console=None, limit: int = 200) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    dtypes = sorted({r["dtype"] for r in results})
    table = Table(title="op sweep: samples per outcome")
    table.add_column("outcome")
    for d in dtypes:
        table.add_column(d, justify="right")
    table.add_column("all", justify="right")
    for k in OUTCOMES:
        row = [sum(1 for r in results if r["outcome"] == k and r["dtype"] == d) for d in dtypes]
        table.add_row(k, *map(str, row), str(sum(row)))
    console.print(table)
    per_op = op_outcomes(results)
    op_counts = {k: sum(1 for v in per_op.values() if v == k) for k in OUTCOMES}
    console.print("ops by worst outcome: " + ", ".join(f"{k} {v}" for k, v in op_counts.items() if v))
    nl = [r for r in results if r["outcome"] == "not_lowered"]
    if nl:
        named = sum(1 for r in nl if r.get("names_op"))
        lined = sum(1 for r in nl if r.get("names_line"))
        console.print(f"not_lowered messages naming the ATen op: {named}/{len(nl)}, "
                      f"the source line: {lined}/{len(nl)}")
    for kind in ("crash", "wrong"):
        bad = [r for r in results if r["outcome"] == kind]
        if not bad:
            continue
        console.print(f"\n[bold red]{kind}[/] ({len(bad)} samples, "
                      f"{len({r['op'] for r in bad})} ops):")
        for r in bad[:limit]:
            console.print(f"  {r['op']} {r['dtype']} {r['sample']}: {r['message']}",
                          markup=False, highlight=False)
        if len(bad) > limit:
            console.print(f"  ... {len(bad) - limit} more in the --out file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grace.tools.op_sweep",
        description=__doc__,
        epilog="examples:\n"
        "  python -m grace.tools.op_sweep --fast                       # CI subset, CPU interpreter\n"
        "  python -m grace.tools.op_sweep --ops 'pow,div.*' --samples 8 --dtypes float32\n"
        "  python -m grace.tools.op_sweep --samples 1 --out sweep.json # every op, interpreted\n"
        "  python -m grace.tools.op_sweep --executor gpu --jobs 4 --out sweep-gpu.json\n"
        "  python -m grace.tools.op_sweep --list --fast                # the selected ops\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", metavar="GLOB[,GLOB...]",
                   help="OpInfo names to sweep (fnmatch globs against name and name.variant; "
                        "a name without a variant selects all its variants). Default: all")
    p.add_argument("--exclude", metavar="GLOB[,GLOB...]", help="OpInfo names to leave out")
    p.add_argument("--fast", action="store_true",
                   help=f"the CI subset ({len(FAST_OPS)} ops, FAST_OPS in this module)")
    p.add_argument("--dtypes", default="float32,float16",
                   help="dtypes to sweep, where the op supports them (default float32,float16)")
    p.add_argument("--samples", type=int, default=2, metavar="N",
                   help="OpInfo sample inputs per op and dtype (default 2)")
    p.add_argument("--no-edges", action="store_true",
                   help="no edge samples (0-d, empty, size-1, edge values, int64 past 2**24)")
    p.add_argument("--no-int64-edges", action="store_true",
                   help="no int64 edge samples for ops that take int64")
    p.add_argument("--executor", choices=("interpret", "gpu"), default="interpret",
                   help="interpret: Triton's interpreter on the CPU (default); gpu: grace.runtime")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="executor worker processes (default 1)")
    p.add_argument("--compile-jobs", type=int, default=1, metavar="N",
                   help="compile processes (forked; default 1: compile in this process). "
                        "Compiling dominates on the CPU: ~1 s a sample")
    p.add_argument("--timeout", type=float, default=300, metavar="S",
                   help="seconds per sample in the executor before it counts as a crash (300)")
    p.add_argument("--compile-timeout", type=float, default=600, metavar="S",
                   help="seconds per compile before it counts as a crash (600)")
    p.add_argument("--arch", default="sm_90", help="arch to compile for (default sm_90)")
    p.add_argument("--fp32-matmul", choices=("tf32x3", "tf32", "ieee"), default=None,
                   help="precision of fp32 GEMMs (default: the compiler's default)")
    p.add_argument("--device", type=int, default=0, help="CUDA device for --executor gpu")
    p.add_argument("--out", metavar="RESULTS.json",
                   help="write every result to this JSON file (and, as they come, one line each "
                        "to RESULTS.json.jsonl, which survives an interrupted run)")
    p.add_argument("--keep", metavar="DIR", help="keep packages, inputs and outputs in DIR")
    p.add_argument("--list", action="store_true", help="list the selected ops and cases, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--worker", choices=("interpret", "gpu"), help=argparse.SUPPRESS)
    return p


def _globs(text):
    return [g.strip() for g in (text or "").split(",") if g.strip()]


# (CUDA_VISIBLE_DEVICES as the driver found it, None if unset), when it hid the GPUs from itself
_HIDDEN_GPUS: tuple = ()


def main(argv=None) -> int:
    global _HIDDEN_GPUS
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.device)
    if args.executor == "gpu" and args.compile_jobs > 1 and "torch" not in sys.modules:
        # The driver compiles and computes references on the CPU. Were it to initialise CUDA
        # (some OpInfo sample generators and Triton's driver query the device), every compile
        # process forked afterwards would fail ("Cannot re-initialize CUDA in forked
        # subprocess"); only the executor workers see the GPUs.
        _HIDDEN_GPUS = (os.environ.get("CUDA_VISIBLE_DEVICES"),)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.set_num_threads(1)
    op_db = load_op_db()
    patterns = _globs(args.ops)
    ops = select_ops(op_db, patterns or None, _globs(args.exclude)) \
        if patterns or not args.fast else []
    if args.fast:   # exact full names
        ops += [op for op in select_ops(op_db, None, _globs(args.exclude))
                if full_name(op) in FAST_OPS and op not in ops]
    if not ops:
        print("op_sweep: no OpInfo matches --ops", file=sys.stderr)
        return 1
    dtypes = tuple(_globs(args.dtypes))
    cases = build_cases(ops, dtypes, args.samples, not args.no_edges, not args.no_int64_edges)
    if args.list:
        for op in ops:
            n = sum(1 for c in cases if c.op == full_name(op))
            print(f"{full_name(op)}  ({n} cases)")
        print(f"{len(ops)} ops, {len(cases)} cases")
        return 0
    t0 = time.time()
    stream = open(args.out + ".jsonl", "w", encoding="utf-8") if args.out else None

    def on_result(rec):
        if stream is not None:
            stream.write(json.dumps(rec) + "\n")
            stream.flush()

    try:
        results = sweep(cases, args.executor, args.jobs, args.timeout, args.compile_timeout,
                        (args.arch,), args.fp32_matmul, args.device,
                        Path(args.keep) if args.keep else None,
                        progress=not args.no_progress and sys.stderr.isatty(),
                        on_result=on_result, compile_jobs=args.compile_jobs)
    finally:
        if stream is not None:
            stream.close()
    seconds = time.time() - t0
    summarize(results)
    print(f"{len(ops)} ops, {len(results)} samples in {seconds:.0f} s ({args.executor})")
    if args.out:
        import triton

        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                "executor": args.executor, "torch": torch.__version__,
                "triton": triton.__version__, "seconds": round(seconds), "ops": len(ops),
                "counts": counts(results), "op_counts": {
                    k: sum(1 for v in op_outcomes(results).values() if v == k) for k in OUTCOMES}}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.out}")
    bad = sum(1 for r in results if r["outcome"] in ("wrong", "crash"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
