"""CPU reference executor: run a package's own kernels with Triton's interpreter.

`run_package` executes exactly what the GPU runtime would, on the CPU: the same choice of graph
(grace.runtime.calls: symbols resolved from the input shapes, the smallest bucket that fits), the
same memory plan (one byte tensor per region; the arena sized by the graph's own `arena`), the same
argument table (written by the package's own table-writer kernel, node 0), and every node of that
graph in order with its recorded grid and arguments. Region arguments become typed views into the
region tensors; `{"word": i}` arguments are the table words (per slot: data pointer, true sizes,
strides in elements; then one word per symbol). User inputs and outputs live in host buffers of
their true size (a data-dependent output dim: the graph's bound), reached only through the table,
as on the device.

With `poison=True` (the default) the arena, the table and the output buffers are filled with 0xFF
bytes before the first node: NaN in every float format, -1 in every integer format. A kernel that
reads memory nobody wrote shows up as NaN in the outputs instead of passing by luck. The table's
extents words are set to -1 in any case before the table writer runs; a data symbol outside [0, its
bound] after the run (-1: never written) is reported as an error.

Index checks (format 3.3): the table's error word is zeroed when the session is made and read after
every call, as the GPU runtime reads it at its synchronising points; a gather that met an
out-of-range index raises grace.runtime's IndexOutOfRangeError (naming the input, the op and the
source line) and the word is zeroed again, so the next call starts clean.

Outputs come back with their true shapes: an output whose dim 0 is a data symbol is cut to the value
a kernel wrote into the extents words. The result is a dict that also says which graph ran
(`InterpretResult.graph`) and the symbol values (`.symbols`).

Progress (`progress=True`, or a text stream): the interpreter runs a kernel in seconds to minutes
(ViT-S: 12.7 minutes for one call), so it can say which node it is in, n of N, with the node's
label, kernel family and kernel name. On a terminal that is a rich progress bar (rich is already a
dependency: `grace.aot.compile(progress=True)` and the op sweep use it), redrawn at every node and
gone when the call returns; on anything else (a log, a pipe, a test) one line per node, so a log
shows where a long run is. Nothing is printed unless asked: `grace run --interpret` asks when
stderr is a terminal.

Floating-point warnings: the GPU computes IEEE results silently (0/0 is NaN, exp of a large value
is inf), but Triton's interpreter computes with numpy, which warns about every such operation:
"RuntimeWarning: invalid value encountered in subtract" for a softmax row of padding (-inf - -inf),
in lanes the kernel masks and never stores. Those four numpy floating-point conditions (invalid,
divide, overflow, underflow) are ignored while a kernel runs, as on the GPU; outside the kernels and
every other warning are left as they are.

Limits: Triton 3.6's interpreter computes wrong results for bfloat16 (see docs/architecture.md), so
packages touching bf16 are refused.

Signed packages (SPEC §7): `trusted_keys=` (or GRACE_TRUSTED_KEYS) refuses, as grace.runtime.load
does, a package that no trusted key signed, before any of its kernels is imported.

This module imports torch and triton; `grace.runtime` never imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Mapping

import numpy as np

__all__ = ["InterpretError", "InterpretResult", "run_package", "table_words"]


class InterpretError(ValueError):
    """The package or the inputs cannot be executed by the CPU reference executor."""


class InterpretResult(dict):
    """{output name: numpy array} of one run, plus what ran: `graph` (its name) and `symbols`
    ({symbol name: value}, data symbols as computed by the kernels)."""

    def __init__(self, outputs, graph: str, symbols: dict):
        super().__init__(outputs)
        self.graph = graph
        self.symbols = symbols


# manifest dtype name -> (numpy dtype, torch dtype name)
_DTYPES: dict[str, tuple[Any, str]] = {
    "float64": (np.float64, "float64"),
    "float32": (np.float32, "float32"),
    "float16": (np.float16, "float16"),
    "bfloat16": (None, "bfloat16"),
    "int64": (np.int64, "int64"),
    "int32": (np.int32, "int32"),
    "int16": (np.int16, "int16"),
    "int8": (np.int8, "int8"),
    "uint8": (np.uint8, "uint8"),
    "bool": (np.bool_, "bool"),
}

# Triton pointer type in kernels[k]["params"] -> manifest dtype name
_PARAM_TYPES: dict[str, str] = {
    "*fp64": "float64",
    "*fp32": "float32",
    "*fp16": "float16",
    "*bf16": "bfloat16",
    "*i64": "int64",
    "*u64": "int64",
    "*i32": "int32",
    "*i16": "int16",
    "*i8": "int8",
    "*u8": "uint8",
    "*i1": "bool",
}

_BF16_REASON = (
    "Triton 3.6's interpreter computes wrong bfloat16 results; "
    "compile an fp32/fp16 variant for CPU checks, or run bf16 packages on a GPU"
)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name][1])


# ----------------------------------------------------------------------------------------------
# kernel modules
# ----------------------------------------------------------------------------------------------

_module_cache: dict[str, Any] = {}
_module_lock = threading.Lock()
_module_dir: str | None = None


_STDLIB_MODULES = ("triton.language", "triton.language.standard", "triton.language.random", "triton.language.math")
_interpreted_stdlib: dict[int, Any] = {}


def _as_interpreted(jit_fn):
    from triton.runtime.interpreter import InterpretedFunction

    fn = _interpreted_stdlib.get(id(jit_fn))
    if fn is None:
        fn = _interpreted_stdlib[id(jit_fn)] = (jit_fn, InterpretedFunction(jit_fn.fn))
    return fn[1]


def _member(fn):
    def method(*args, **kwargs):  # a plain function, so `x.sum()` binds x like the original
        return fn(*args, **kwargs)

    method.__name__ = getattr(fn, "__name__", "method")
    return method


_MISSING = object()


def _griddepcontrol_noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def _interpret_mode():
    """Triton's interpreter in effect for this block, then everything restored.

    Triton 3.6 decides interpreter-or-compiler when `@triton.jit` decorates a function, reading
    `triton.knobs.runtime.interpret` (the TRITON_INTERPRET environment variable unless a value was
    assigned to the knob in Python). Two consequences when triton was imported earlier in the process
    without TRITON_INTERPRET=1:
      * kernel modules must be imported inside this block (their @jit then yields InterpretedFunction);
      * triton.language's own @jit helpers (tl.zeros, tl.sum, tl.max, tl.cdiv, tl.softmax, tl.rand...)
        were already built as compiler JITFunctions, which raise "Cannot call @triton.jit'd outside
        of the scope of a kernel" under the interpreter. For the duration of the block they are
        swapped for InterpretedFunction twins (module attributes and `tl.tensor` member functions).
    `knobs.runtime.scope()` restores the knob overrides and the environment on exit, so later
    (non-interpreted) compiles in the same process are unaffected. Not thread-safe: it patches
    module globals.
    """
    import triton.language as tl
    from triton import knobs
    from triton.runtime.jit import JITFunction

    # triton.language.extra loads its backends as module objects of its own, distinct from the
    # sys.modules entries that `from ... import` reads: patch both.
    import triton.language.extra.cuda  # noqa: F401  (the sys.modules entry)
    from triton.language import extra
    gdc_modules = list({id(m): m for m in (extra.cuda, sys.modules["triton.language.extra.cuda"])}.values())

    # Triton 3.6's interpreter patches triton.language for every call of an interpreted device
    # function (InterpretedFunction.__call__ -> _patch_lang) and never restores those patches: a
    # later compile in this process (or in build workers forked from it) then fails inside
    # triton.language ("'ir.value' object has no attribute 'data'"). Everything _patch_lang can
    # touch is snapshotted here and put back on exit.
    touched = [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]
    snapshots = [(obj, dict(vars(obj))) for obj in touched]

    patches: list[tuple[Any, str, Any]] = []
    with knobs.runtime.scope():
        knobs.runtime.interpret = True  # sets the override and os.environ["TRITON_INTERPRET"]
        try:
            for name in _STDLIB_MODULES:
                mod = sys.modules.get(name)
                if mod is None:
                    continue
                for attr, value in list(vars(mod).items()):
                    if isinstance(value, JITFunction):
                        patches.append((mod, attr, value))
                        setattr(mod, attr, _as_interpreted(value))
            for attr, value in list(vars(tl.core.tensor).items()):
                if isinstance(value, JITFunction):
                    patches.append((tl.core.tensor, attr, value))
                    setattr(tl.core.tensor, attr, _member(_as_interpreted(value)))
            # griddepcontrol (PDL) is inline PTX, which the interpreter cannot run; one kernel at a
            # time on the CPU, every wait is already satisfied, so they do nothing here
            for mod in gdc_modules:
                for attr in ("gdc_wait", "gdc_launch_dependents"):
                    patches.append((mod, attr, getattr(mod, attr)))
                    setattr(mod, attr, _griddepcontrol_noop)
            yield
        finally:
            for obj, attr, value in reversed(patches):
                setattr(obj, attr, value)
            for obj, saved in snapshots:
                for attr in set(vars(obj)) - set(saved):
                    delattr(obj, attr)
                for attr, value in saved.items():
                    if vars(obj).get(attr, _MISSING) is not value:
                        setattr(obj, attr, value)


def _remove_module_dir(path: str, owner: int) -> None:
    """The kernel sources written for the interpreter (a grace-interpret-* folder), at exit."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _load_kernel_module(source: str, sha: str):
    """Import kernel source as a module with Triton's interpreter; one module per source sha256.
    Package sources reach it only through _kernel_function, which checks them first."""
    global _module_dir
    with _module_lock:
        mod = _module_cache.get(sha)
        if mod is not None:
            return mod
        if _module_dir is None:
            _module_dir = tempfile.mkdtemp(prefix="grace-interpret-")
            # removed when this process exits (not when a forked child does: it shares the folder)
            atexit.register(_remove_module_dir, _module_dir, os.getpid())
        # @triton.jit reads the function's source with inspect, so it needs a real file.
        path = os.path.join(_module_dir, f"k_{sha[:16]}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        mod_name = f"_grace_interpret_{sha[:24]}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod  # dataclasses/typing in generated code look the module up
        try:
            spec.loader.exec_module(mod)  # the caller holds _interpret_mode()
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise InterpretError(f"kernel source {path} failed to import: {type(e).__name__}: {e}") from e
        _module_cache[sha] = mod
        return mod


def _kernel_function(kernel, package) -> Any:
    """The kernel's function from its source section (a formats.view.Kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    name = kernel.name
    section = kernel.source
    if not section:
        raise InterpretError(f"kernel {name!r} has no source section; the interpreter needs kernel sources")
    try:
        raw = bytes(package.section(section))
    except Exception as e:
        raise InterpretError(f"kernel {name!r}: cannot read source section {section!r}: {e}") from e
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InterpretError(f"kernel {name!r}: source section {section!r} is not UTF-8 text ({e})") from None
    # a package's Python runs here only if it is in the Triton subset grace's codegen emits
    from .source_check import SourceRefused, check_kernel_source
    try:
        check_kernel_source(source)
    except SourceRefused as e:
        raise InterpretError(f"kernel {name!r}: kernel source refused, nothing from it was run: {e}") from None
    sha = hashlib.sha256(raw).hexdigest()
    if kernel.source_sha256 is not None and sha != kernel.source_sha256:
        # the section index can point a kernel at another kernel's (valid) source: refuse to run
        # code that is not the one this kernel was compiled from
        raise InterpretError(f"kernel {name!r}: source section {section!r} is not this kernel's source "
                             f"(sha256 {sha[:12]}..., the manifest says {kernel.source_sha256[:12]}...)")
    mod = _load_kernel_module(source, sha)
    fn = getattr(mod, name, None)
    if fn is None:
        jitted = [k for k, v in vars(mod).items() if isinstance(v, InterpretedFunction)]
        if len(jitted) == 1:
            fn = getattr(mod, jitted[0])
        else:
            raise InterpretError(
                f"kernel {name!r}: source section {section!r} defines no function of that name "
                f"(jit functions: {', '.join(jitted) or 'none'})"
            )
    if not isinstance(fn, InterpretedFunction):
        raise InterpretError(
            f"kernel {name!r} was not decorated in interpreter mode (got {type(fn).__name__}); "
            "is TRITON_INTERPRET overridden?"
        )
    return fn


# ----------------------------------------------------------------------------------------------
# package checks
# ----------------------------------------------------------------------------------------------


def _check_no_bf16(m) -> None:
    def uses_bf16():
        for group, entries in (("input", m.inputs), ("output", m.outputs), ("weight", m.weights)):
            for t in entries:
                if t.dtype == "bfloat16":
                    yield f"{group} {t.name!r}"
        for k in m.kernels:
            for p in k.params:
                if "bf16" in p.type:
                    yield f"kernel {k.name!r} parameter {p.name!r}"
        for g in m.graphs:
            for node in g.nodes:
                if any(a.dtype == "bfloat16" for a in node.args):
                    yield f"a node of kernel {node.kernel} in graph {g.name!r}"

    first = next(uses_bf16(), None)
    if first is not None:
        raise InterpretError(f"package uses bfloat16 ({first}): {_BF16_REASON}")


def _shape_text(shape) -> str:
    from grace.formats.shapes import format_shape_expr

    return ", ".join(format_shape_expr(d) for d in shape)


def _check_inputs(m, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Names and dtypes; the shapes are checked by the runtime's ShapePlan (see `_resolve`)."""
    specs = m.inputs
    expected = ", ".join(f"{s.name} ({s.dtype}[{_shape_text(s.shape)}])" for s in specs) or "none"
    names = {s.name for s in specs}
    unknown = [n for n in inputs if n not in names]
    if unknown:
        raise InterpretError(f"unknown input {unknown[0]!r}; the package expects: {expected}")
    missing = [s.name for s in specs if s.name not in inputs]
    if missing:
        raise InterpretError(f"missing input {missing[0]!r}; the package expects: {expected}")
    out = {}
    for s in specs:
        name, dtype = s.name, s.dtype
        value = inputs[name]
        if isinstance(value, np.ma.MaskedArray):   # np.asarray would drop the mask
            raise InterpretError(f"input {name!r}: numpy masked arrays are not supported (the kernels "
                                 "would read the masked values); pass arr.filled(value) or arr.data")
        if type(value).__module__.startswith("torch"):
            if str(value.dtype) == "torch.bfloat16":
                raise InterpretError(f"input {name!r} is bfloat16: {_BF16_REASON}")
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        if dtype == "bfloat16":
            raise InterpretError(f"input {name!r} is bfloat16: {_BF16_REASON}")
        want = np.dtype(_DTYPES[dtype][0])
        if arr.dtype != want:
            raise InterpretError(f"input {name!r}: dtype {arr.dtype} does not match the package's {dtype}")
        out[name] = arr
    return out


@contextlib.contextmanager
def _as_interpret_errors():
    """The runtime's checks (bad sizes: InputError; a bad package: InvalidPackageError) surface as
    this module's InterpretError."""
    from grace.runtime.errors import InputError, InvalidPackageError

    try:
        yield
    except (InputError, InvalidPackageError) as e:
        raise InterpretError(str(e)) from None


def _resolve(plan, m, arrays: Mapping[str, np.ndarray], graph: str | None) -> tuple[list, int]:
    """(symbol values, graph index) by the runtime's rules; `graph` names a graph to use instead of
    the selected one (it must still cover the values)."""
    with _as_interpret_errors():
        values = plan.resolve([arrays[s.name].shape for s in m.inputs])
        chosen = plan.select(values)
    if graph is None:
        return values, chosen
    if graph not in plan.graph_names:
        raise InterpretError(f"no graph named {graph!r}; graphs: {', '.join(plan.graph_names)}")
    g = plan.graph_names.index(graph)
    bounds = plan.bounds(g)
    if any(values[k] > bounds[k] for k in plan.input_symbols):
        raise InterpretError(f"graph {graph!r} cannot serve {plan.describe(values)} (its bucket: "
                             f"{m.graphs[g].bucket})")
    return values, g


def table_words(manifest, buffers: Mapping[str, Any], values=None) -> list[int]:
    """The table words for one call, laid out by the runtime's own code (same table, same words).

    `manifest`: a grace.formats.view.Manifest, or a manifest dict (validated first). `buffers` maps
    a slot's name to the contiguous torch tensor the slot points at (its shape is the slot's
    sizes); `values` are the symbol words (default: all 0).
    """
    from grace.formats.view import as_view
    from grace.runtime.calls import table_words as words_of

    m = as_view(manifest)
    tensors = [buffers[slot.name] for slot in m.table.slots]
    if values is None:
        values = [0] * len(m.symbols)
    return words_of([t.data_ptr() for t in tensors], [tuple(t.shape) for t in tensors], values)


# ----------------------------------------------------------------------------------------------
# execution
# ----------------------------------------------------------------------------------------------


def _open(package_or_path, trusted_keys=None):
    """The Package to run. With `trusted_keys` (or GRACE_TRUSTED_KEYS; None: that policy) it must be
    signed by one of them, as grace.runtime.load requires (SPEC §7): a path is checked before its
    manifest is decoded, a Package already read is hashed again and checked."""
    from grace.formats import signing

    if isinstance(package_or_path, (str, os.PathLike)):
        return signing.read_trusted_package(package_or_path, trusted_keys)
    signing.check_package(package_or_path, trusted_keys)
    return package_or_path


def _fill_weights(package, weights_region) -> None:
    """Copy each weight to its offset. The reader has already checked that every manifest entry
    matches its tensor in the safetensors section (dtype, shape, size)."""
    import torch

    from grace.formats import decode_weights

    entries = package.view.weights
    if not entries:
        return
    tensors = decode_weights(package.section("weights"))
    for w in entries:
        data = tensors[w.name][2]
        if len(data):
            off = w.offset
            weights_region[off:off + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _region_view(regions: Mapping[str, Any], arg, param, where: str):
    """A region argument (formats.view.Arg; validated: inside its region, or this graph's arena) as
    a typed view of the region tensor, typed by its `dtype` or else by the parameter's type."""
    import torch

    dtype = arg.dtype or _PARAM_TYPES.get(param.type)
    if dtype is None:
        raise InterpretError(f"{where}: cannot tell the element type (no 'dtype', parameter type {param.type!r})")
    tdt = _torch_dtype(dtype)
    size = torch.empty((), dtype=tdt).element_size()
    off, nbytes = arg.offset, arg.nbytes
    if off % size or nbytes % size:
        raise InterpretError(f"{where}: range offset {off} / nbytes {nbytes} not a multiple of {dtype}'s {size} bytes")
    return regions[arg.region][off : off + nbytes].view(tdt)


# ---- progress -----------------------------------------------------------------------------------

# what a package names (labels, graph names) may hold terminal control characters: shown escaped
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def _clean(text) -> str:
    return str(text).translate(_CONTROL)


def _node_text(kernels, node) -> str:
    """A node for the progress output: its label (the model op it came from), family, kernel."""
    kernel = kernels[node.kernel]
    family = kernel.family or "?"
    label = node.label or family
    return _clean(f"{label} ({family}, {kernel.name})")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):   # no isatty, or a closed file
        return False


class _NoProgress:
    """Progress nobody asked for: nothing printed."""

    def graph(self, title: str, total: int) -> None:
        pass

    def node(self, i: int, text: str) -> None:
        pass

    def done(self) -> None:
        pass

    def close(self) -> None:
        pass


_NO_PROGRESS = _NoProgress()


class _NodeProgress(_NoProgress):
    """Which node runs, n of N, on `stream`: a rich progress bar when the stream is a terminal
    (redrawn before every node, so the slow node is the one shown; transient: gone when the call
    returns), else one line per node, written before the node runs and flushed (a log of a run
    that takes minutes shows where it is, and where it stopped)."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = _isatty(stream)
        self.title, self.total = "", 0
        self._bar = self._task = None

    def graph(self, title: str, total: int) -> None:
        self.title, self.total = _clean(title), total
        if not self.tty:
            return
        from rich.markup import escape

        if self._bar is None:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            console = Console(file=self.stream, force_terminal=True, force_interactive=True)
            self._bar = Progress(TextColumn("[bold]interpret[/] {task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[node]}"), console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(escape(self.title), total=total, node="")
        else:
            self._bar.reset(self._task, total=total, description=escape(self.title), node="")

    def node(self, i: int, text: str) -> None:
        if self._bar is not None:
            from rich.markup import escape

            self._bar.update(self._task, completed=i, node=escape(text), refresh=True)
        else:
            print(f"interpret {self.title}: node {i + 1}/{self.total} {text}", file=self.stream,
                  flush=True)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def run_package(
    package_or_path,
    inputs: Mapping[str, Any],
    *,
    poison: bool = True,
    graph: str | None = None,
    trusted_keys=None,
    progress=False,
) -> InterpretResult:
    """Run a `.grace` package on the CPU with Triton's interpreter; return its outputs (numpy copies
    with their true shapes) as an InterpretResult, which also names the graph that ran.

    `package_or_path` is a path or a `grace.formats.Package`. `inputs` maps every input name to a
    numpy array (or CPU torch tensor) of the package's dtype, of any size its symbols allow. The
    graph is selected as the GPU runtime selects it; `graph=` names another one that covers the sizes.
    A package with session state runs from its initial state; use `InterpretSession` to keep it.
    `trusted_keys`: as for grace.runtime.load (a signature by one of them is required).
    `progress`: False (default: print nothing), True (stderr) or a text stream: which node runs,
    n of N (module docstring).
    """
    return InterpretSession(package_or_path, poison=poison, trusted_keys=trusted_keys,
                            progress=progress).run(inputs, graph=graph)


def generate_package(package_or_path, prompt_ids, max_new_tokens: int, eos_token_id=None, *,
                     poison: bool = True, trusted_keys=None, progress=False) -> np.ndarray:
    """Greedy generation on the CPU, the same sequence of kernels as the GPU runtime's generate().
    `progress` as for run_package (the prefill's nodes, then each decode step's)."""
    return InterpretSession(package_or_path, poison=poison, trusted_keys=trusted_keys,
                            progress=progress).generate(prompt_ids, max_new_tokens, eos_token_id)


class InterpretSession:
    """The CPU twin of a runtime Session: the package's regions as byte tensors, with the session
    state (KV caches) kept across run() calls until reset_state(). `progress`: as for run_package,
    for every call of this session."""

    def __init__(self, package_or_path, poison: bool = True, max_host_nbytes: int | None = None,
                 trusted_keys=None, arch: str | None = None, progress=False):
        import torch
        from grace.runtime.calls import ShapePlan

        self.package = _open(package_or_path, trusted_keys)
        self.manifest = self.package.manifest
        self.view = view = _variant_view(self.package.view, arch)   # read_package validated it
        _check_no_bf16(view)
        with _as_interpret_errors():
            self.plan = ShapePlan(view)
            _check_host_memory(view, self.plan, max_host_nbytes)
        self.poison = poison
        self._progress_stream = (sys.stderr if progress is True else progress) or None
        self._progress = None   # the _NodeProgress of the call (or generation) that is running
        sizes = view.regions
        self.regions = {
            "weights": torch.zeros(sizes["weights"], dtype=torch.uint8),
            "table": torch.full((sizes["table"],), 0xFF if poison else 0, dtype=torch.uint8),
            "state": torch.zeros(sizes["state"], dtype=torch.uint8),
        }
        _fill_weights(self.package, self.regions["weights"])
        from grace.runtime.checks import plan_index_checks
        from grace.runtime.state import plan_state

        self.checks = plan_index_checks(view)   # None: no error word
        if self.checks is not None:   # poisoned with the rest of the table: no error yet
            self._error_word().zero_()
        self.state_entries = plan_state(self.package)
        self.reset_state()

    # -- index checks --------------------------------------------------------------------------
    def _error_word(self):
        import torch

        off = self.checks.offset
        return self.regions["table"][off:off + 8].view(torch.int64)

    def _check_indices(self, values: dict) -> None:
        """Raise IndexOutOfRangeError if a kernel of the last call stored a check's code (SPEC §5.4)."""
        if self.checks is None:
            return
        word = self._error_word()
        code = int(word[0])
        if code:
            word.zero_()
            raise self.checks.error(code, values)

    # -- state ---------------------------------------------------------------------------------
    def _state_view(self, name: str):
        for e in self.state_entries:
            if e.name == name:
                raw = self.regions["state"][e.offset:e.offset + e.nbytes]
                return raw.view(_torch_dtype(e.dtype)).view(e.shape)
        raise InterpretError(f"the package has no state entry {name!r}")

    def reset_state(self) -> None:
        """Every state entry back to its initial value (zeros, or the package's `state` section)."""
        import torch

        self.regions["state"].zero_()
        for e in self.state_entries:
            if e.init == "data":
                self.regions["state"][e.offset:e.offset + e.nbytes].copy_(torch.from_numpy(e.data))

    def read_state(self) -> dict[str, np.ndarray]:
        return {e.name: self._state_view(e.name).numpy().copy() for e in self.state_entries}

    # -- one call ------------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, Any], graph: str | None = None) -> InterpretResult:
        return self._run(inputs, graph)

    def _run(self, inputs: Mapping[str, Any], graph: str | None = None,
             title: str | None = None) -> InterpretResult:
        """run(); `title` names the call in the progress output (the prefill of a generation)."""
        view, plan = self.view, self.plan
        arrays = _check_inputs(view, inputs)
        values, gi = _resolve(plan, view, arrays, graph)
        import torch

        tensors = {s.name: torch.from_numpy(np.array(arrays[s.name], order="C", copy=True))
                   for s in view.inputs}   # 0-d stays 0-d
        if title is not None:
            title = f"{title} graph {view.graphs[gi].name!r}"
        return self._execute(gi, values, tensors, title)

    @contextlib.contextmanager
    def _reporting(self):
        """The progress of the running call: a generation keeps one bar over all its graphs
        (nested calls reuse it), a single call has its own; closed when the outermost ends."""
        if self._progress is not None:
            yield self._progress
            return
        report = _NodeProgress(self._progress_stream) if self._progress_stream else _NO_PROGRESS
        self._progress = report
        try:
            yield report
        finally:
            self._progress = None
            report.close()

    def _execute(self, gi: int, values: list, inputs: dict, title: str | None = None) -> InterpretResult:
        """Run graph `gi` with the symbol `values` on the input tensors `inputs` (the slots point
        at them: copies of the caller's arrays, or state entries during generation). `title`
        names the call in the progress output (default: the graph)."""
        import torch

        view, plan = self.view, self.plan
        g = view.graphs[gi]
        self.regions["arena"] = torch.full((g.arena,), 0xFF if self.poison else 0, dtype=torch.uint8)
        extents = _extents(view, self.regions["table"])
        extents.fill_(-1)  # until the table writer sets them: a symbol word it misses shows as -1
        with _as_interpret_errors():
            out_shapes = plan.output_shapes(values, gi)
        buffers = {**inputs, **_output_buffers(view, out_shapes, self.poison)}
        words = table_words(view, buffers, values)
        self._buffers = buffers  # the table points at them until the next call
        with _interpret_mode(), self._reporting() as report:
            report.graph(title or f"graph {g.name!r}", len(g.nodes))
            for i, node in enumerate(g.nodes):
                report.node(i, _node_text(view.kernels, node))
                _run_node(self.package, view.kernels, g.name, i, node, self.regions, words)
            report.done()
        values = _data_symbols(plan, gi, values, extents)
        self._check_indices(dict(zip(plan.symbols, values)))
        outputs = {s.name: _cut(buffers[s.name], plan.output_shape(o, values))
                   for o, s in enumerate(view.outputs)}
        return InterpretResult(outputs, g.name, dict(zip(plan.symbols, values)))

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id=None) -> np.ndarray:
        """prefill -> step -> while not done: decode graph -> step (docs/design-state.md), the
        loop condition read on the host where the GPU runs a WHILE node."""
        from grace.runtime.generate import GeneratePlan

        gen = self.view.generate
        if gen is None:
            raise InterpretError("this package was not compiled for generation (grace compile "
                                 "--generate tokens=NAME,positions=NAME)")
        with _as_interpret_errors():
            plan = GeneratePlan(self.view, self.state_entries)
            prompt, ctrl_words = plan.check(prompt_ids, max_new_tokens, eos_token_id)
        self.reset_state()
        ctrl = self._state_view(gen.ctrl)
        ctrl.copy_(torch_from(ctrl_words))
        with self._reporting():   # one progress display for the prefill and every decode step
            self._run(plan.prefill_inputs(prompt), title="prefill")
            self._step(gen)
            with _as_interpret_errors():
                values = self.plan.resolve(plan.input_shapes(1))
            feed = {gen.tokens: self._state_view(gen.next_token),
                    gen.positions: self._state_view(gen.next_position)}
            name = self.view.graphs[gen.decode_graph].name
            step = 0
            while int(ctrl[3]) == 0:
                step += 1
                self._execute(gen.decode_graph, values, feed,
                              title=f"decode {step}/{max_new_tokens - 1} graph {name!r}")
                self._step(gen)
        return self._state_view(gen.out_tokens)[:int(ctrl[0])].numpy().copy()

    def _step(self, gen) -> None:
        with _interpret_mode():
            _run_node(self.package, self.view.kernels, "generate", 0, gen.step, self.regions, [])


def _variant_view(view, arch):
    """The graphs of the variant to run (format 3.5, grace.formats.view.for_arch): `arch`'s, by
    default the package's first arch's (the kernels' gdc calls are no-ops here, so every variant
    computes the same)."""
    from grace.formats.view import for_arch

    try:
        return for_arch(view, arch)
    except ValueError as e:
        raise InterpretError(str(e)) from None


DEFAULT_MAX_HOST_NBYTES = 16 << 30   # GRACE_INTERPRET_MAX_BYTES overrides


def _check_host_memory(m, plan, limit: int | None) -> None:
    """Refuse, before allocating, a package whose regions and outputs need more host memory than
    `limit` bytes (default GRACE_INTERPRET_MAX_BYTES or 16 GiB): the formats cap each region at
    1 TiB, which a GPU refuses with an error but a CPU process would try to page in."""
    from grace.formats.dtypes import itemsize

    if limit is None:
        limit = int(os.environ.get("GRACE_INTERPRET_MAX_BYTES", DEFAULT_MAX_HOST_NBYTES))
    r = m.regions
    parts = {"weights": r["weights"], "table": r["table"], "state": r["state"],
             "arena": max(g.arena for g in m.graphs),
             "outputs": sum(plan.output_capacity(o) * itemsize(s.dtype) for o, s in enumerate(m.outputs))}
    need = sum(parts.values())
    if need > limit:
        detail = ", ".join(f"{k} {v}" for k, v in parts.items())
        raise InterpretError(f"the package needs {need} bytes of host memory ({detail}), above the "
                             f"interpreter's limit of {limit} (GRACE_INTERPRET_MAX_BYTES)")


def torch_from(array: np.ndarray):
    import torch
    return torch.from_numpy(np.ascontiguousarray(array))


def _output_buffers(m, out_shapes, poison: bool) -> dict[str, Any]:
    """Host buffers for the outputs at this call's shape (data-symbol dims at the graph's bound),
    poisoned on request so an element the graph never writes shows as NaN."""
    import torch

    buffers: dict[str, Any] = {}
    for s, shape in zip(m.outputs, out_shapes):
        nbytes = _numel(shape) * _itemsize(s.dtype)
        raw = torch.full((nbytes,), 0xFF if poison else 0, dtype=torch.uint8)
        buffers[s.name] = raw.view(_torch_dtype(s.dtype)).view(shape)
    return buffers


def _extents(m, table):
    """The symbol words of the table region, as an int64 tensor view (symbol k at index k)."""
    import torch

    off = m.table.extents_offset
    return table[off:off + 8 * len(m.symbols)].view(torch.int64)


def _data_symbols(plan, g: int, values: list, extents) -> list:
    """`values` with every data symbol read from the extents words after the run; each must lie in
    [0, its bound in graph g] (-1: no kernel wrote it)."""
    values = list(values)
    bounds = plan.bounds(g)
    for k in plan.data_symbols:
        v = int(extents[k])
        if not 0 <= v <= bounds[k]:
            raise InterpretError(f"data symbol {plan.symbols[k]!r} is {v} after graph {plan.graph_names[g]!r} ran, "
                                 f"outside [0, {bounds[k]}] (its bound in this graph)"
                                 + ("; no kernel wrote it" if v == -1 else ""))
        values[k] = v
    return values


def _cut(buffer, shape) -> np.ndarray:
    """A numpy copy of an output buffer at its true shape (only dim 0 can be smaller: a data symbol)."""
    arr = buffer.numpy()
    if tuple(arr.shape) != tuple(shape):
        arr = arr[: shape[0]]
    return arr.copy()


def _run_node(package, kernels, graph: str, i: int, node, regions, words: list[int]) -> None:
    """Node i of graph `graph` (a formats.view.Node, validated: its kernel exists, one argument
    per parameter, every word and range in bounds) with its recorded grid and arguments."""
    kernel = kernels[node.kernel]
    where = f"graph {graph!r} node {i} ({node.label or kernel.name})"
    args = [words[a.word] if a.word is not None else _region_view(regions, a, p, f"{where} parameter {p.name!r}")
            for a, p in zip(node.args, kernel.params)]
    fn = _kernel_function(kernel, package)
    try:
        # as on the GPU, IEEE results without a word: numpy (which Triton's interpreter computes
        # with) warns for 0/0, inf - inf, exp overflow, mostly in lanes the kernel masks and never
        # stores (a softmax row of padding); only these conditions, only while the kernel runs
        with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
            fn[node.grid](*args, num_warps=kernel.num_warps)
    except Exception as e:
        raise InterpretError(f"{where}: kernel {kernel.name!r} failed: {type(e).__name__}: {e}") from e


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: str) -> int:
    return np.dtype(_DTYPES[dtype][0]).itemsize
