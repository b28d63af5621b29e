"""`torch.compile(model, backend="grace")`: every Dynamo graph through grace's own pipeline, in process.

    compiled = torch.compile(model, backend="grace", options={"buckets": {"x.1": [64, 512]}})
    with torch.no_grad():
        y = compiled(x)     # CUDA tensors: grace's runtime (CUDA graphs); CPU tensors: the interpreter

Dynamo captures the model's Python into FX graphs (one per graph break; the code between graphs
runs eagerly, as with any backend) and hands each to `grace_backend(gm, example_inputs)`, which
makes one `.grace` package of it, the way `grace compile` would:

  inputs   Dynamo lifts the parameters and buffers of nn modules to graph inputs
           (inline_inbuilt_nn_modules); they become the package's *weights* (registered on a
           wrapper module, so torch.export lists them as parameters/buffers: the same tensors, no
           copy). Every other tensor is a per-call input, named after the argument Dynamo read it
           from (`x`, `input_ids`, `batch_ids` for batch["ids"]). A SymInt input is recomputed
           from the tensor whose size it is (Dynamo passes both).
  sizes    a dim that Dynamo made symbolic (torch._dynamo.mark_dynamic, dynamic=True, automatic
           dynamic after a recompile) becomes a torch.export Dim with Dynamo's own range; the
           package's symbol is `<input>.<dim>` and gets shape buckets: options["buckets"] when it
           names the symbol (by any input/dim that shares it), else grace's default powers of two
           up to the range's maximum — or up to options["max_size"] (default 1024, at least the
           example's size) when Dynamo left the dim unbounded.
  export   torch.export.export(wrapper, example inputs, dynamic_shapes, strict=False): the
           wrapper runs the graph through torch.fx.Interpreter with node metadata preserved, so
           the program's nodes keep the user's stack traces (a lowering error names the user's
           line, not Dynamo's generated code).
  compile  grace.aot.compile into options["cache_dir"] (default: a temporary directory removed at
           exit), archs = the GPU's own (sm_XY) for CUDA tensors.
  load     CUDA inputs: grace.runtime.load on their device, one session per (CUDA stream,
           thread), running on torch's current stream, so no synchronisation is needed either way.
           CPU inputs: the CPU reference executor (tools/interpret.py, Triton's interpreter): slow,
           but the same kernels, which is what makes the backend testable without a GPU.

Per call: the inputs go in zero-copy (a non-contiguous or misaligned one is copied first), the
outputs are torch tensors allocated by torch and written by the graph in place (`run(out=...)`),
so they stay valid after the next call. Sizes outside the package's buckets (or its range) run
that call eagerly, with one warning per graph.

Weights are a snapshot: the package holds a copy, uploaded when it loads. Every call checks that
the graph's parameters and buffers are still the tensors it compiled (Dynamo reuses one graph for
every instance of a module class), at the version counters (`tensor._version`: an in-place
update, load_state_dict) and data pointers (`param.data = ...`) it compiled. Other tensors get a
package of their own (up to MAX_WEIGHT_SETS per graph); a tensor changed in place is compiled
again (up to MAX_REFRESHES times, then the graph stays eager). options["check_weights"] = False
skips that check (one Python attribute read per weight per call) for weights that never change
after the first call.

Fallback: whatever grace cannot compile runs that graph eagerly (Dynamo's own FX graph, as the
"eager" backend would), with ONE GraceBackendWarning per graph naming the reason: autograd (a
tensor that requires grad while grad mode is on: grace compiles inference graphs), a graph that
mutates an input or a buffer (grace keeps no torch tensor in step with a package's state), an
output that aliases an input or another output, a non-tensor output or input, several devices,
an export or lowering error (every op that cannot be lowered, with the user's line), a package
that cannot load. Bad options are errors (ValueError), not fallbacks.
"""
from __future__ import annotations

import atexit
import dataclasses
import inspect
import itertools
import re
import shutil
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

BACKEND_NAME = "grace"
DEFAULT_MAX_SIZE = 1024     # bound of a dynamic dim Dynamo left unbounded (options["max_size"])
MAX_WEIGHT_SETS = 4         # packages per graph for distinct sets of weight tensors
MAX_REFRESHES = 2           # in-place weight changes compiled again before the graph stays eager
MAX_SESSIONS = 8            # CUDA streams served per package (one session each)

__all__ = ["grace_backend", "register", "BackendOptions", "GraceBackendWarning", "GraceGraph",
           "compiled_graphs"]


class GraceBackendWarning(UserWarning):
    """A Dynamo graph, or one call of it, runs eagerly instead of through grace; the message says
    which graph and why."""


class _Fallback(Exception):
    """Why a graph cannot go through grace: the reason its warning gives."""


class _NotServed(Exception):
    """This call's sizes are outside the package's buckets: the call runs eagerly."""


# ---- options -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """`torch.compile(..., backend="grace", options={...})`, checked once.

    buckets        {"x.1": [64, 256, 1024]}: bucket bounds of a dynamic dim, named `<input>.<dim>`
                   after any input/dim that has that size (the same as `grace compile --buckets`)
    fp32_matmul    "tf32x3" (default) | "tf32" | "ieee": grace.aot.compile's fp32_matmul
    pdl            programmatic dependent launch (sm_90+), as grace.aot.compile(pdl=): default
                   on wherever the arch has it, False turns it off
    archs          ["sm_90", ...]; default: the GPU's own arch (CUDA inputs), sm_90 otherwise
    max_size       bound of a dynamic dim that Dynamo left unbounded (default 1024)
    cache_dir      where the packages are written (kept); default: a temporary directory
    progress       grace's stage summaries and build progress bar on stderr
    jobs           parallel kernel builds
    check_weights  per call, check that the weights are the tensors and versions compiled
    check_indices  GPU: synchronise after every call to report an out-of-range gather index
                   (IndexOutOfRangeError) instead of at the session's next synchronisation
    """
    buckets: tuple = ()
    fp32_matmul: str | None = None
    pdl: bool | None = None
    archs: tuple | None = None
    max_size: int = DEFAULT_MAX_SIZE
    cache_dir: str | None = None
    progress: bool = False
    jobs: int | None = None
    check_weights: bool = True
    check_indices: bool = False

    @classmethod
    def parse(cls, options) -> "BackendOptions":
        """ValueError (naming the option) for an unknown key or a bad value: a typo must not pass
        as a fallback."""
        from .compiler import FP32_MATMUL_CHOICES, CompileOptions

        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"torch.compile(backend='grace'): unknown option(s) {', '.join(unknown)}; "
                             f"the options are: {', '.join(known)}")
        kw = {}
        if "buckets" in options:
            kw["buckets"] = _parse_buckets(options["buckets"])
        if options.get("fp32_matmul") is not None:
            if options["fp32_matmul"] not in FP32_MATMUL_CHOICES:
                raise ValueError(f"torch.compile(backend='grace'): fp32_matmul must be one of "
                                 f"{', '.join(FP32_MATMUL_CHOICES)}, not {options['fp32_matmul']!r}")
            kw["fp32_matmul"] = options["fp32_matmul"]
        if options.get("archs") is not None:
            archs = options["archs"]
            archs = (archs,) if isinstance(archs, str) else tuple(archs)
            CompileOptions(archs=archs)   # the compiler's own check (sm_80 or newer)
            kw["archs"] = archs
        for key in ("pdl", "progress", "check_weights", "check_indices"):
            if key in options:
                if not isinstance(options[key], bool):
                    raise ValueError(f"torch.compile(backend='grace'): {key} must be True or False, "
                                     f"not {options[key]!r}")
                kw[key] = options[key]
        for key in ("max_size", "jobs"):
            if options.get(key) is not None:
                value = options[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"torch.compile(backend='grace'): {key} must be a positive "
                                     f"int, not {value!r}")
                kw[key] = value
        if options.get("cache_dir") is not None:
            kw["cache_dir"] = str(options["cache_dir"])
        return cls(**kw)


def _parse_buckets(buckets) -> tuple:
    if not isinstance(buckets, dict):
        raise ValueError("torch.compile(backend='grace'): buckets must be a dict "
                         "{'<input>.<dim>': [bound, ...]}")
    out = []
    for key, bounds in buckets.items():
        try:
            values = [int(b) for b in bounds]
        except (TypeError, ValueError):
            values = []
        if not isinstance(key, str) or not values or min(values) < 1:
            raise ValueError(f"torch.compile(backend='grace'): buckets[{key!r}] must be a list of "
                             f"positive ints, not {bounds!r}")
        out.append((key, tuple(sorted(set(values)))))
    return tuple(out)


# ---- registration ---------------------------------------------------------------------------------


def grace_backend(gm, example_inputs, *, mode=None, options=None):
    """The Dynamo backend: a callable that runs `gm` through a grace package (or eagerly, after one
    GraceBackendWarning, when grace cannot compile it). `mode` is accepted and ignored: grace always
    serves from CUDA graphs. `options`: BackendOptions."""
    opts = BackendOptions.parse(options)
    try:
        graph = GraceGraph(gm, list(example_inputs), opts)
    except _Fallback as reason:
        _warn(f"{_graph_label(gm)} runs eagerly: {reason}")
        return gm.forward
    except Exception as exc:  # noqa: BLE001 - anything grace cannot do falls back, never crashes
        _warn(f"{_graph_label(gm)} runs eagerly: {_describe(exc)}")
        return gm.forward
    _LIVE.add(graph)
    return graph


def register() -> None:
    """Make `backend="grace"` known to torch._dynamo (idempotent; `import grace.aot` calls it).

    pyproject.toml also declares the backend as a `torch_dynamo_backends` entry point, so
    torch.compile finds it without importing grace first. torch's lookup_backend then imports this
    module and registers the entry point's function itself, and register_backend refuses a name
    twice: so nothing is registered here while that entry point is known and not loaded yet."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(BACKEND_NAME) is not None:   # an entry point lookup_backend will load
        return
    registry.register_backend(grace_backend, name=BACKEND_NAME)


_LIVE: "weakref.WeakSet[GraceGraph]" = weakref.WeakSet()


def compiled_graphs() -> list:
    """The GraceGraphs that Dynamo still holds (tests and the benchmark read their `calls`)."""
    return list(_LIVE)


def _warn(message: str) -> None:
    warnings.warn(f"torch.compile(backend='grace'): {message}", GraceBackendWarning, stacklevel=3)


def _describe(exc: BaseException) -> str:
    """One line for a warning: the exception's type and first line (torch's messages are long)."""
    text = " ".join(str(exc).strip().splitlines()[0].split()) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _graph_label(gm) -> str:
    """'Dynamo graph 0/1 (model.py:17, in forward)': Dynamo's compile id and the user's first line."""
    cid = gm.meta.get("dynamo_compile_id") if hasattr(gm, "meta") else None
    where = ""
    try:
        from .check import user_frame

        for node in gm.graph.nodes:
            if node.meta.get("stack_trace"):
                frame = user_frame(node)
                if frame is not None:
                    name = Path(frame.file).name
                    where = f" ({name}:{frame.line}" + (f", in {frame.function})" if frame.function else ")")
                    break
    except Exception:  # noqa: BLE001 - a label must never fail
        pass
    return f"Dynamo graph {cid if cid is not None else '?'}{where}"


# ---- the packages' directory ----------------------------------------------------------------------

_TMP = {"dir": None}
_TMP_LOCK = threading.Lock()
_COUNTER = itertools.count()


def _package_dir(options: BackendOptions) -> Path:
    if options.cache_dir is not None:
        path = Path(options.cache_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    with _TMP_LOCK:
        if _TMP["dir"] is None:
            _TMP["dir"] = Path(tempfile.mkdtemp(prefix="grace-backend-"))
            atexit.register(shutil.rmtree, _TMP["dir"], True)
        return _TMP["dir"]


# ---- reading Dynamo's graph ----------------------------------------------------------------------


@dataclasses.dataclass
class _Symbol:
    """A dynamic size: the package symbol `name` (its first use), every `<input>.<dim>` that has it,
    Dynamo's range and the example's value."""
    name: str
    aliases: list
    lo: int
    hi: int | None       # None: Dynamo left it unbounded
    example: int
    dim: object = None   # the torch.export Dim


@dataclasses.dataclass
class _Plan:
    """What each of Dynamo's graph inputs is. `kinds[i]`: ("input", k) a per-call tensor,
    ("weight", j) a parameter/buffer, ("size", (k, d)) a SymInt that is input k's dim d."""
    kinds: list
    inputs: list          # graph input positions of the per-call tensors
    names: list           # their package input names
    weights: list         # graph input positions of the parameters/buffers
    weight_names: list
    owned: list           # tensors the graph module itself holds (get_attr): version-checked too
    symbols: dict         # sympy expr -> _Symbol
    dims: list            # per input: {dim: sympy expr}
    device: object        # torch.device of the tensors
    outputs: list         # (dtype, rank) of the graph's outputs


def _source_name(node) -> str | None:
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)   # a method before torch 2.12, then a property


def _friendly(node, drop=()) -> str:
    """`L['x']` -> x, `L['batch']['ids']` -> batch_ids, `L['self']._modules['fc']._parameters
    ['weight']` -> fc_weight; Dynamo's placeholder name (l_x_ -> x) when there is no source."""
    text = _source_name(node)
    parts = re.findall(r"[A-Za-z0-9_]+", text) if text else []
    if parts and parts[0] in ("L", "G"):
        parts = parts[1:]
    parts = [p for p in parts if p not in drop]
    name = "_".join(parts) or re.sub(r"^[lLgG]_", "", node.name).rstrip("_") or node.name
    name = re.sub(r"\W", "_", name)
    return name if name[0].isalpha() or name[0] == "_" else f"in_{name}"


def _unique(name: str, taken: set) -> str:
    out, n = name, 2
    while out in taken:
        out, n = f"{name}_{n}", n + 1
    taken.add(out)
    return out


def _is_weight(node, example) -> bool:
    """A parameter or buffer of an nn module that Dynamo lifted to a graph input."""
    import torch

    if isinstance(example, torch.nn.Parameter):
        return True
    source = getattr(node, "_dynamo_source", None)
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source
    except ImportError:   # (another torch): judge by the source's text
        text = _source_name(node) or ""
        return "._buffers[" in text or "._parameters[" in text
    return source is not None and is_from_unspecialized_param_buffer_source(source)


def _expr(size):
    """The sympy expression of a symbolic size (Dynamo's replacements applied), None for an int."""
    import torch

    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return None if expr.is_number else expr
    return None


def _range(size) -> tuple[int, int | None]:
    """Dynamo's [lo, hi] for a symbolic size; hi None when unbounded."""
    node = size.node
    rng = node.shape_env.var_to_range.get(node.expr)
    if rng is None:
        rng = node.shape_env.bound_sympy(node.expr)
    from .extents import range_bound

    lo = range_bound(rng.lower)
    return (0 if lo is None else max(lo, 0)), range_bound(rng.upper)


def _analyse(gm, example_inputs) -> _Plan:
    """Sort Dynamo's graph inputs into per-call tensors, weights and sizes, and find what grace
    refuses up front (the reasons are _Fallback)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        raise _Fallback(f"the graph has {len(placeholders)} inputs but Dynamo gave "
                        f"{len(example_inputs)} examples")
    kinds, inputs, names, weights, weight_names, dims = [], [], [], [], [], []
    taken, wtaken = set(), set()
    fakes = {}
    sizes = []
    for pos, (node, ex) in enumerate(zip(placeholders, example_inputs)):
        fake = node.meta.get("example_value")
        if isinstance(ex, torch.Tensor):
            if type(ex) not in (torch.Tensor, torch.nn.Parameter):
                raise _Fallback(f"graph input {node.name} is a {type(ex).__name__} (a tensor subclass)")
            if ex.layout != torch.strided or ex.is_complex() or ex.is_quantized:
                raise _Fallback(f"graph input {node.name} is a {ex.layout} {ex.dtype} tensor")
            if torch.is_grad_enabled() and ex.requires_grad:
                raise _Fallback(
                    f"autograd: graph input {_friendly(node)} requires grad while grad mode is on "
                    "(grace compiles inference graphs: call the model under torch.no_grad() or "
                    "torch.inference_mode(), or requires_grad_(False) its parameters)")
            fake = fake if isinstance(fake, torch.Tensor) else ex
            fakes[pos] = fake
            if _is_weight(node, ex):
                if any(_expr(s) is not None for s in fake.shape):
                    raise _Fallback(f"parameter/buffer {_friendly(node)} has a dynamic shape "
                                    f"{list(fake.shape)}")
                kinds.append(("weight", len(weights)))
                weights.append(pos)
                weight_names.append(_unique(_friendly(node, drop=("self", "_modules", "_parameters",
                                                                   "_buffers")), wtaken))
            else:
                kinds.append(("input", len(inputs)))
                inputs.append(pos)
                names.append(_unique(_friendly(node), taken))
                dims.append({d: e for d, s in enumerate(fake.shape) if (e := _expr(s)) is not None})
        elif isinstance(ex, (int, torch.SymInt)) and not isinstance(ex, bool) and \
                isinstance(fake if fake is not None else ex, torch.SymInt):
            fake = fake if fake is not None else ex
            kinds.append(None)   # resolved below, once every tensor's sizes are known
            sizes.append((len(kinds) - 1, node, fake))
        else:
            kind = type(fake if fake is not None else ex).__name__
            raise _Fallback(f"graph input {_friendly(node)} is a {kind}, not a tensor (a Python "
                            "number that Dynamo made dynamic: grace takes sizes only as tensor dims)")

    symbols = {}
    for k, spec in enumerate(dims):
        fake = fakes[inputs[k]]
        for d, expr in spec.items():
            alias = f"{names[k]}.{d}"
            if not expr.is_Symbol:
                raise _Fallback(f"input {names[k]} dim {d} has the derived size {expr} (grace needs "
                                "each dynamic input dim to be a size of its own)")
            if expr in symbols:
                symbols[expr].aliases.append(alias)
                continue
            lo, hi = _range(fake.shape[d])
            symbols[expr] = _Symbol(alias, [alias], lo, hi, int(example_inputs[inputs[k]].shape[d]))
    for i, node, fake in sizes:
        expr = _expr(fake)
        where = next(((k, d) for k, spec in enumerate(dims) for d, e in spec.items() if e == expr),
                     None)
        if where is None:
            raise _Fallback(f"graph input {_friendly(node)} is a dynamic Python int ({expr}) that is "
                            "no tensor's size (grace takes sizes only as tensor dims)")
        kinds[i] = ("size", where)

    tensors = [example_inputs[p] for p in inputs + weights]
    owned = [t for t in itertools.chain(gm.parameters(), gm.buffers())]
    devices = {t.device for t in tensors + owned}
    if len(devices) > 1:
        raise _Fallback(f"the graph's tensors are on several devices ({', '.join(sorted(map(str, devices)))})")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise _Fallback(f"the graph's tensors are on {device} (grace runs CUDA and, through the "
                        "interpreter, CPU tensors)")

    outputs = _outputs(gm, placeholders, fakes, StorageWeakRef)
    dtypes = [t.dtype for t in tensors + owned] + [dtype for dtype, _ in outputs]
    if device.type == "cpu" and torch.bfloat16 in dtypes:
        raise _Fallback("bfloat16 on the CPU: grace's CPU interpreter (Triton's) computes wrong "
                        "bfloat16 results; bfloat16 graphs need CUDA tensors")
    return _Plan(kinds, inputs, names, weights, weight_names, owned, symbols, dims, device, outputs)


def _outputs(gm, placeholders, fakes, StorageWeakRef) -> list:
    """(dtype, rank) per graph output; _Fallback for a non-tensor output or one that aliases an
    input or another output (eager returns views that share memory; a package returns new tensors,
    so a later in-place write would not reach the other tensor)."""
    import torch

    (out,) = gm.graph.find_nodes(op="output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    storages = {}
    for pos, node in enumerate(placeholders):
        if pos in fakes:
            storages.setdefault(StorageWeakRef(fakes[pos].untyped_storage()), f"input {_friendly(node)}")
    result = []
    for i, value in enumerate(values):
        fake = value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value
        if not isinstance(fake, torch.Tensor):
            raise _Fallback(f"output {i} is a {type(fake).__name__}, not a tensor")
        ref = StorageWeakRef(fake.untyped_storage())
        if ref in storages:
            raise _Fallback(f"output {i} aliases {storages[ref]} (a view or the tensor itself; "
                            "grace returns new tensors)")
        storages[ref] = f"output {i}"
        result.append((fake.dtype, fake.dim()))
    return result


# ---- export -----------------------------------------------------------------------------------------


def _bounds(sym: _Symbol, options: BackendOptions) -> tuple[int, list | None]:
    """(the package's maximum for `sym`, its bucket bounds or None for grace's default)."""
    want = next((b for key, b in options.buckets if key in sym.aliases), None)
    inf = sym.hi is None
    if want is not None:
        hi = max(want) if inf else min(sym.hi, max(want))
    else:
        hi = max(options.max_size, sym.example) if inf else sym.hi
    hi = max(hi, sym.example, sym.lo)
    if want is None:
        return hi, None
    return hi, [b for b in want if b < hi] + [hi]


class _GraphProgram:
    """Namespace for the wrapper module's class (made per graph: its forward's signature names the
    package's inputs)."""

    @staticmethod
    def make(gm, plan: _Plan, weights: list):
        import torch
        import torch.fx.traceback as fx_traceback

        class DynamoGraph(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.graph_module = gm   # its own parameters/buffers (get_attr) become weights too
                self._names = []
                for name, t in zip(plan.weight_names, weights):
                    name = name if not hasattr(self, name) else f"w_{name}"
                    if isinstance(t, torch.nn.Parameter):
                        self.register_parameter(name, t)
                    else:
                        self.register_buffer(name, t)
                    self._names.append(name)

            def forward(self, *inputs):
                args = []
                for kind, v in plan.kinds:
                    if kind == "input":
                        args.append(inputs[v])
                    elif kind == "weight":
                        args.append(getattr(self, self._names[v]))
                    else:
                        k, d = v
                        args.append(inputs[k].shape[d])
                with fx_traceback.preserve_node_meta():   # the user's stack traces on every node
                    return torch.fx.Interpreter(self.graph_module).run(*args)

        P = inspect.Parameter
        DynamoGraph.forward.__signature__ = inspect.Signature(
            [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(n, P.POSITIONAL_OR_KEYWORD) for n in plan.names])
        return DynamoGraph()


def _export(gm, plan: _Plan, weights: list, inputs: list, options: BackendOptions):
    """The ExportedProgram of one graph with these weights, and its {symbol: buckets}."""
    import torch
    from torch.export import Dim

    buckets = {}
    for sym in plan.symbols.values():
        hi, bounds = _bounds(sym, options)
        sym.dim = Dim(re.sub(r"\W", "_", sym.name), min=sym.lo, max=hi)
        if bounds is not None:
            buckets[sym.name] = bounds
    specs = [({d: plan.symbols[e].dim for d, e in spec.items()} or None) for spec in plan.dims]
    module = _GraphProgram.make(gm, plan, weights)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch-internal deprecation noise
        try:
            ep = torch.export.export(module, tuple(inputs),
                                     dynamic_shapes=tuple(specs) if any(specs) else None, strict=False)
        except Exception as exc:  # noqa: BLE001
            if not any(specs) or "Constraints violated" not in str(exc):
                raise _Fallback(f"torch.export of the graph failed: {_describe(exc)}") from exc
            # torch 2.11's export refuses some ranges Dynamo reports (seen on the H200 for a
            # LlamaBlock's sequence): let export infer each dynamic dim's range (Dim.AUTO) and
            # keep the buckets inside the range it found
            auto = tuple(({d: Dim.AUTO for d in spec} if spec else None) for spec in specs)
            try:
                ep = torch.export.export(module, tuple(inputs), dynamic_shapes=auto, strict=False)
            except Exception as exc2:  # noqa: BLE001
                raise _Fallback(f"torch.export of the graph failed: {_describe(exc)}") from exc2
            buckets = _buckets_within(ep, plan, buckets)
    _check_program(ep, plan)
    return ep, buckets


def _buckets_within(ep, plan: _Plan, buckets: dict) -> dict:
    """`buckets` cut to the ranges torch.export inferred (Dim.AUTO); a dim it made static has none."""
    users = set(ep.graph_signature.user_inputs)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
    out = {}
    for k, spec in enumerate(plan.dims):
        for d, e in (spec or {}).items():
            name = plan.symbols[e].name
            if name not in buckets or name in out or k >= len(placeholders):
                continue
            size = placeholders[k].meta["val"].shape[d]
            if isinstance(size, int):
                continue
            rng = ep.range_constraints.get(size.node.expr)
            try:
                upper = int(rng.upper)
            except (AttributeError, TypeError, ValueError, OverflowError):  # unbounded
                out[name] = list(buckets[name])
                continue
            out[name] = [b for b in buckets[name] if b < upper] + [upper]
    return out


def _check_program(ep, plan: _Plan) -> None:
    """What the exported program says about mutation: grace would keep a mutated buffer or input
    as package state, out of step with the torch tensor eager updates."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    mutated = [f"{s.kind.name.lower().replace('_', ' ')} {s.target or s.arg.name}"
               for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if mutated:
        raise _Fallback(f"the graph mutates tensors in place ({', '.join(mutated)}); grace would "
                        "keep them as package state, out of step with the torch tensors")
    odd = [f"{s.kind.name} {s.arg}" for s in sig.input_specs
           if s.kind not in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER,
                             InputKind.CONSTANT_TENSOR)]
    if odd:
        raise _Fallback(f"the exported graph has inputs grace does not take: {', '.join(odd)}")
    user = [s for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if len(user) != len(plan.outputs):
        raise _Fallback(f"the exported graph has {len(user)} outputs, Dynamo's {len(plan.outputs)}")


# ---- running a package -----------------------------------------------------------------------------


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


class _CudaRunner:
    """A package on the inputs' GPU. Outputs are torch tensors written in place by the graph."""

    def __init__(self, path: Path, device, check_indices: bool, names: list):
        import torch

        from grace.runtime import load

        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.pkg = load(path, device=self.device.index)
        self.shapes = self.pkg.shapes
        self.check_indices = check_indices
        self.order = [names.index(s.name) for s in self.pkg.inputs]   # package input i <- ours
        self.outs = [(s.name, _torch_dtype(s.dtype), bool(self.shapes.data_symbols_of(o)))
                     for o, s in enumerate(self.pkg.outputs)]
        self.sessions = {}   # (CUDA stream handle, thread) -> (torch stream, Session)
        self.last_graph = None

    def _session(self, stream, key):
        """A session on torch's current stream: our launches are ordered with torch's work on it
        both ways, with no synchronisation and no event."""
        if len(self.sessions) >= MAX_SESSIONS:   # the oldest (stream, thread)'s session goes
            oldest = next(iter(self.sessions))
            self.sessions.pop(oldest)[1].close()
        sess = self.pkg.session(stream=stream)
        self.sessions[key] = (stream, sess)   # the torch stream object stays alive with it
        return sess

    def __call__(self, inputs: list) -> tuple:
        import torch

        from grace.runtime.errors import InputError

        args = []
        for i in self.order:
            x = inputs[i]
            if not x.is_contiguous():
                x = x.contiguous()
            elif x.data_ptr() % 16:   # the kernels assume 16-byte aligned data
                x = x.clone()
            args.append(x)
        try:
            call = self.shapes.prepare([tuple(x.shape) for x in args])
        except InputError as exc:
            raise _NotServed(str(exc)) from None
        stream = torch.cuda.current_stream(self.device)
        key = (stream.cuda_stream, threading.get_ident())   # a Session serves one caller at a time
        entry = self.sessions.get(key)
        sess = entry[1] if entry is not None else self._session(stream, key)
        out = {name: torch.empty(shape, dtype=dtype, device=self.device)
               for (name, dtype, data), shape in zip(self.outs, call.output_shapes) if not data}
        got = sess.run(*args, out=out or None)
        self.last_graph = sess.last_graph
        if self.check_indices:
            sess.sync()
        return tuple(out[name] if not data else torch.from_dlpack(got[name]).clone()
                     for name, _, data in self.outs)

    def close(self) -> None:
        self.pkg.close()


class _InterpretRunner:
    """A package through the CPU reference executor (Triton's interpreter)."""

    def __init__(self, path: Path, names: list):
        from grace.tools.interpret import InterpretSession

        self.sess = InterpretSession(path)
        self.order = [names.index(s.name) for s in self.sess.view.inputs]
        self.in_names = [s.name for s in self.sess.view.inputs]
        self.out_names = [s.name for s in self.sess.view.outputs]
        self.last_graph = None

    def __call__(self, inputs: list) -> tuple:
        import torch

        from grace.runtime.errors import InputError

        args = [inputs[i] for i in self.order]
        try:
            self.sess.plan.prepare([tuple(x.shape) for x in args])
        except InputError as exc:
            raise _NotServed(str(exc)) from None
        got = self.sess.run(dict(zip(self.in_names, args)))
        self.last_graph = got.graph
        return tuple(torch.from_numpy(got[name]) for name in self.out_names)

    def close(self) -> None:
        pass


def _versions(tensors) -> list:
    out = []
    for t in tensors:
        try:
            out.append(t._version)
        except RuntimeError:   # an inference tensor: no version counter (no in-place update outside
            out.append(None)   # inference mode either); its identity and data pointer still count
    return out


def _pointer_check():
    """torch's C++ check of many data pointers at once (CUDA builds; what reduce-overhead's CUDA
    graph trees call per launch), after a self-test of its calling convention; else None."""
    import torch

    fn = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fn is None:
        return None
    try:
        a, b = torch.zeros(2), torch.zeros(2)
        if fn([3, a], [None, a.data_ptr()], [1]) is True and fn([3, a], [None, b.data_ptr()], [1]) is False:
            return fn
    except Exception:  # noqa: BLE001 - another signature: check in Python
        pass
    return None


_POINTERS = {}


class _Variant:
    """One package of a graph, and the weights it was built from: for each, the graph input
    position, a weak reference (a dead tensor never matches, even if a new one takes its memory),
    its version counter (in-place updates) and data pointer (`.data = ...` swaps)."""

    def __init__(self, runner, positions: list, weights: list, owned: list, path: Path):
        self.runner, self.path = runner, path
        self.positions = list(positions)
        self.refs = [weakref.ref(t) for t in weights]
        self.versions = _versions(weights)
        self.checks = list(zip(self.positions, self.refs, self.versions))
        self.ptrs = [t.data_ptr() for t in weights]
        self.owned = owned
        self.owned_state = (_versions(owned), [t.data_ptr() for t in owned])
        if "fn" not in _POINTERS:
            _POINTERS["fn"] = _pointer_check()
        self._ptrs_equal = _POINTERS["fn"]
        self._all_ptrs = None   # per graph input: the weight's data pointer, None elsewhere

    def same_tensors(self, args) -> bool:
        """The weights in Dynamo's `args` are the tensors this package was built from."""
        return all(r() is args[i] for i, r in zip(self.positions, self.refs))

    def serves(self, args) -> bool:
        """Same tensors, same versions, same data pointers: the package's snapshot is current. The
        per-call check (options['check_weights']); one Python attribute read per weight."""
        for i, ref, version in self.checks:
            t = args[i]
            if ref() is not t or (version is not None and t._version != version):
                return False
        if self._ptrs_equal is not None:
            if self._all_ptrs is None:
                self._all_ptrs = [None] * len(args)
                for i, ptr in zip(self.positions, self.ptrs):
                    self._all_ptrs[i] = ptr
            if not self._ptrs_equal(list(args), self._all_ptrs, self.positions):
                return False
        elif any(args[i].data_ptr() != ptr for i, ptr in zip(self.positions, self.ptrs)):
            return False
        if self.owned:
            return (_versions(self.owned), [t.data_ptr() for t in self.owned]) == self.owned_state
        return True


class GraceGraph:
    """What Dynamo calls for one graph: its grace package when that can serve the call, else the
    graph eagerly. `calls`: {"grace": n, "eager": n}; `paths`: the packages built; `eager_reason`:
    why the graph now always runs eagerly (None while grace serves it)."""

    @property
    def last_graph(self) -> str | None:
        """The package graph (bucket) that served the last grace call: 'x.0=16'."""
        return self._current.runner.last_graph if self._current is not None else None

    def __init__(self, gm, example_inputs: list, options: BackendOptions):
        import torch

        self.gm, self.options = gm, options
        self.label = _graph_label(gm)
        self.plan = _analyse(gm, example_inputs)
        self.name = f"dynamo_graph_{next(_COUNTER)}"
        self.calls = {"grace": 0, "eager": 0}
        self.paths: list[Path] = []
        self.eager_reason = None
        self._warned: set = set()
        self._variants: list[_Variant] = []
        self._refreshes = 0
        self._lock = threading.Lock()
        if self.plan.device.type == "cpu" and torch.cuda.is_available():
            self._warn_once("cpu", "its tensors are on the CPU, so it runs through grace's CPU "
                                   "interpreter (slow: a reference executor); move the model and "
                                   "inputs to CUDA for CUDA graphs", eager=False)
        self._current = self._build(example_inputs)

    # -- per call -----------------------------------------------------------------------------------
    def __call__(self, *args):
        if self.eager_reason is None:
            variant = self._current
            plan = self.plan
            if self.options.check_weights and (variant is None or not variant.serves(args)):
                variant = self._select(args)
            if variant is not None:
                try:
                    out = variant.runner([args[i] for i in plan.inputs])
                except _NotServed as why:
                    self._warn_once("range", f"a call outside its buckets runs eagerly ({why}); "
                                             "options={'buckets': ...} or "
                                             "torch._dynamo.mark_dynamic(x, d, max=...) widen them",
                                    eager=False)
                except Exception as exc:  # noqa: BLE001
                    from grace.runtime.errors import IndexOutOfRangeError

                    if isinstance(exc, IndexOutOfRangeError):   # eager raises for it too
                        raise
                    self._go_eager(f"running its package failed: {_describe(exc)}")
                else:
                    self.calls["grace"] += 1
                    return out
        self.calls["eager"] += 1
        return self.gm(*args)

    # -- weights --------------------------------------------------------------------------------------
    def _select(self, args) -> _Variant | None:
        """The package for the weights in `args`: an earlier one, or a new one (compiled now)."""
        with self._lock:
            for v in self._variants:
                if not v.same_tensors(args):
                    continue
                if v.serves(args):
                    self._current = v
                    return v
                self._variants.remove(v)   # changed in place (or swapped with .data) since compiled
                v.runner.close()
                self._refreshes += 1
                if self._refreshes > MAX_REFRESHES:
                    self._go_eager(f"its parameters/buffers changed in place more than "
                                   f"{MAX_REFRESHES} times (grace compiles a snapshot of them)")
                    return None
                self._warn_once(f"refresh{self._refreshes}",
                                "its parameters/buffers changed in place since grace compiled it: "
                                "compiling it again with the new values", eager=False)
                break
            else:
                if len(self._variants) >= MAX_WEIGHT_SETS:
                    self._warn_once("sets", f"it is called with more than {MAX_WEIGHT_SETS} sets "
                                            "of parameter tensors (module instances): calls with "
                                            "the others run eagerly", eager=False)
                    return None
            try:
                self._current = self._build(args)
            except Exception as exc:  # noqa: BLE001
                self._go_eager(str(exc) if isinstance(exc, _Fallback) else _describe(exc))
                return None
            return self._current

    def _build(self, args) -> _Variant:
        """Export, compile and load a package for the weights in `args` (Dynamo's inputs), outside
        Dynamo's tracing context: inside it torch.export would trace with Dynamo's own fake mode,
        and the export's Dims would become guards in Dynamo's shape environment (a size above a
        bucket would recompile the frame instead of running eagerly)."""
        from torch._guards import compile_context, tracing

        with tracing(None), compile_context(None):
            return self._build_here(args)

    def _build_here(self, args) -> _Variant:
        import grace.aot

        plan, options = self.plan, self.options
        weights = [args[i] for i in plan.weights]
        inputs = [args[i] for i in plan.inputs]
        ep, buckets = _export(self.gm, plan, weights, inputs, options)
        unknown = [k for k, _ in options.buckets
                   if not any(k in s.aliases for s in plan.symbols.values())]
        if unknown and plan.symbols:
            self._warn_once("buckets", f"options['buckets'] names {', '.join(unknown)}, which is no "
                                       "dynamic dim of this graph (its dims: "
                                       f"{', '.join(a for s in plan.symbols.values() for a in s.aliases)})",
                            eager=False)
        path = _package_dir(options) / f"{self.name}-{len(self.paths)}.grace"
        archs = options.archs or (_gpu_arch(plan.device),)
        try:
            grace.aot.compile(ep, output=path, name=self.name, archs=archs,
                              fp32_matmul=options.fp32_matmul, buckets=buckets or None,
                              pdl=options.pdl, progress=options.progress, jobs=options.jobs)
        except ValueError as exc:   # LoweringError, ShapeError, ExportError: what grace refuses
            raise _Fallback(_lowering_reason(exc, ep, buckets)) from exc
        self.paths.append(path)
        runner = (_CudaRunner(path, plan.device, options.check_indices, plan.names)
                  if plan.device.type == "cuda" else _InterpretRunner(path, plan.names))
        self._check_outputs(runner)
        variant = _Variant(runner, plan.weights, weights, plan.owned, path)
        self._variants.append(variant)
        return variant

    def _check_outputs(self, runner) -> None:
        """The package's outputs must be Dynamo's: their count, dtypes and ranks."""
        specs = (runner.pkg.outputs if isinstance(runner, _CudaRunner) else runner.sess.view.outputs)
        got = [(_torch_dtype(s.dtype), len(s.shape)) for s in specs]
        want = [(dtype, rank) for dtype, rank in self.plan.outputs]
        if got != want:
            runner.close()
            raise _Fallback(f"the package's outputs {got} differ from the graph's {want}"
                            .replace("torch.", ""))

    # -- fallback ------------------------------------------------------------------------------------
    def _go_eager(self, reason: str) -> None:
        self.eager_reason = reason
        self._warn_once("eager", reason)

    def _warn_once(self, key: str, reason: str, eager: bool = True) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        _warn(f"{self.label} runs eagerly: {reason}" if eager else f"{self.label}: {reason}")


def _gpu_arch(device) -> str:
    """sm_XY of the tensors' GPU; sm_90 for CPU tensors (the interpreter needs no cubin)."""
    import torch

    if device.type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _lowering_reason(exc: BaseException, ep, buckets: dict) -> str:
    """The compiler's refusal; for ops it cannot lower, every such op at once (grace.aot.check)
    with the user's lines, not only the first."""
    first = _describe(exc)
    try:
        from .check import check

        report = check(ep, buckets=buckets or None, codegen=False)
    except Exception:  # noqa: BLE001 - the compile's own error is enough
        return first
    ops = report.unsupported
    if not ops:
        return first
    parts = []
    for p in ops:
        where = f" at {p.locations[0]}" if p.locations else ""
        parts.append(f"{p.op} ({'; '.join(p.reasons)}){where}")
    hints = sorted({_HINTS[p.op] for p in ops if p.op in _HINTS})
    return f"grace cannot lower {len(ops)} op(s): " + " | ".join(parts) + "".join(f"; {h}" for h in hints)


# Ops that Dynamo's graphs hold where torch.export's would not, and how to avoid them.
_FASTPATH = ("nn.TransformerEncoderLayer / nn.MultiheadAttention took their fused inference fast "
             "path (taken under Dynamo, not under torch.export): "
             "torch.backends.mha.set_fastpath_enabled(False) before compiling keeps their plain ops")
_HINTS = {
    "aten._transformer_encoder_layer_fwd.default": _FASTPATH,
    "aten._native_multi_head_attention.default": _FASTPATH,
}
