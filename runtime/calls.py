"""The shapes of one call (docs/design-buckets.md, "Runtime rules"). Pure: no driver, no device.

A format-2.0 package names every dynamic dimension by a *symbol*. Input symbols are read from the
caller's input shapes; data symbols are computed by a kernel on the device. Per call:

    values = plan.resolve(input_shapes)     # one int per symbol (data symbols 0); InputError if bad
    g      = plan.select(values)            # the graph whose bucket serves these values
    shapes = plan.output_shapes(values, g)  # data-symbol dims at the graph's bound (the allocation)
    words  = table_words(ptrs, plan.slot_shapes(input_shapes, shapes), values)

or all of it at once, `plan.prepare(input_shapes)` -> Call(values, graph, output shapes, words with
the data pointers left 0), which is what run() uses.

`ShapePlan(view)` does the manifest walking once, at load: per input the (dim, symbol) pairs to read
and the static dims to compare, per graph its bounds in selection order, per output its dims compiled
to ints or closures over the values list. Everything `prepare` computes depends on the input shapes
alone (they are checked, and give the symbol values), so it caches the Call by the tuple of shapes:
a call whose shapes were seen before costs one dict lookup. run() has a host budget of a few
microseconds. The manifest has passed grace.formats' validation (symbols,
sources, buckets, expressions; formats.view); the arithmetic of shape expressions is
grace.formats.shapes' (Python ints: `//` floors), compiled here to list indexing instead of a
name -> value dict per call. The table words are laid out by grace.formats.table.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from grace.formats.shapes import expr_symbols, format_shape_expr
from grace.formats.table import slot_values
from grace.formats.view import as_view, for_arch, variants

from .errors import InputError, InvalidPackageError
from .validate import contiguous_strides

def _floordiv(a: int, b: int) -> int:
    """`//` of a shape expression: a divisor that is 0 at these symbol values is the package's
    fault (the validator refuses a constant 0, not a symbol that may be 0), reported as such."""
    if b == 0:
        raise InvalidPackageError(f"a shape expression of this package divides {a} by zero at these "
                                  "input sizes")
    return a // b


# The validator bounds every value at the sizes the graphs serve within int64 (formats.manifest
# _io_extents), so +, - and * need no check here.
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": _floordiv,
        "max": max, "min": min}


def compile_expr(expr, index):
    """A shape expression (int | symbol name | [op, a, b]) as an int when it is constant, else as a
    function values_list -> int; `index` maps symbol names to positions in values_list."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return operator.itemgetter(index[expr])
    op, a, b = _OPS[expr[0]], compile_expr(expr[1], index), compile_expr(expr[2], index)
    if isinstance(a, int) and isinstance(b, int):
        return op(a, b)
    fa = a if callable(a) else (lambda _values, c=a: c)
    fb = b if callable(b) else (lambda _values, c=b: c)
    return lambda values: op(fa(values), fb(values))


def _evaluate(dims, values) -> tuple:
    """A compiled shape (ints and functions) at `values`."""
    return tuple(d if d.__class__ is int else d(values) for d in dims)


def _show(shape) -> str:
    """A declared shape as text, [n, 8] or [s + 1, 8] (messages)."""
    return "[" + ", ".join(format_shape_expr(d) for d in shape) + "]"


def table_words(ptrs, slot_shapes, values=()) -> list:
    """All table words of a call (formats.table, SPEC §5): per slot the data pointer, the sizes and
    the C-contiguous strides in elements; then one word per symbol (`values`, data symbols 0: a
    kernel writes them on the device)."""
    words = []
    for ptr, shape in zip(ptrs, slot_shapes, strict=True):
        words += slot_values(ptr, shape, contiguous_strides(shape))
    words.extend(values)
    return words


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Call(NamedTuple):
    """The shape work of one call, shared by every call with the same symbol values (do not mutate)."""
    values: list         # per symbol; data symbols 0
    graph: int           # index of the selected graph
    output_shapes: list  # per output; data-symbol dims at the graph's bound
    words: list          # all table words, data pointers 0 (fill them at ShapePlan.pointer_words)


class _Input:
    """What a call checks on one input's shape."""
    __slots__ = ("name", "decl", "rank", "static", "fixed", "reads")

    def __init__(self, spec, index):
        self.name, self.decl = spec.name, spec.shape
        self.rank = len(self.decl)
        self.fixed = tuple((d, s) for d, s in enumerate(self.decl) if isinstance(s, int))       # (dim, size)
        self.reads = tuple((d, index[s]) for d, s in enumerate(self.decl) if isinstance(s, str))  # (dim, symbol)
        self.static = None if self.reads else self.decl  # fully static: one tuple comparison


class _Output:
    """An output's compiled dims; `capacity` (elements) is checked per call only when a dim is an
    [op, a, b] expression: such a value at the bucket bound need not be the largest (`64 - n`)."""
    __slots__ = ("name", "decl", "dims", "data_symbols", "capacity")

    def __init__(self, spec, index, data_names):
        self.name, self.decl = spec.name, spec.shape
        self.dims = tuple(compile_expr(d, index) for d in self.decl)
        # Data symbols appear in dim 0 only (format rule): the host knows the strides without them.
        self.data_symbols = tuple(sorted(index[s] for s in expr_symbols(self.decl[0]) if s in data_names)
                                  if self.decl else ())
        self.capacity = None


class ShapePlan:
    """Everything about shapes that does not depend on a call. `symbols`: names in manifest order
    (symbol k is table word W + k); `input_symbols` / `data_symbols`: their indices by kind;
    `graph_names`: one per graph. `manifest`: a formats.view.Manifest, or a manifest dict
    (validated first).

    Graphs are those of one variant (format 3.5, SPEC §5.1): a variant's view (formats.view.for_arch)
    as it is, or the package's with `arch` naming the GPU's package arch; graph indices are the
    variant's. A package with several variants and no `arch` is refused (InvalidPackageError): its
    graphs for different GPUs would compete for the same calls."""

    def __init__(self, manifest, arch: str | None = None):
        m = as_view(manifest)
        if arch is not None:
            m = for_arch(m, arch)
        elif m.arch is None and len(found := variants(m)) > 1:
            raise InvalidPackageError(
                "this package holds graphs for several GPU variants ("
                + "; ".join(", ".join(a) for a, _ in found) + "): plan the graphs of one of them "
                "(ShapePlan(view, arch=...), grace.formats.view.for_arch)")
        symbols = m.symbols
        self.symbols = [s.name for s in symbols]
        index = {name: k for k, name in enumerate(self.symbols)}
        self.input_symbols = [k for k, s in enumerate(symbols) if s.kind == "input"]
        self.data_symbols = [k for k, s in enumerate(symbols) if s.kind == "data"]
        self._lo = [s.min for s in symbols]
        self._hi = [s.max for s in symbols]
        self._unset = [-1 if s.kind == "input" else 0 for s in symbols]  # -1: not read yet
        self._inputs = [_Input(t, index) for t in m.inputs]
        data_names = {self.symbols[k] for k in self.data_symbols}
        self._outputs = [_Output(t, index, data_names) for t in m.outputs]
        self._slot_of_input = [t.slot for t in m.inputs]
        self._slot_of_output = [t.slot for t in m.outputs]
        self._n_slots = len(m.table.slots)
        self.pointer_words = [slot.first_word for slot in m.table.slots]  # per slot: its data pointer's word
        self._calls = {}  # input shapes (a tuple of tuples) -> Call: prepare()'s cache

        graphs = m.graphs
        self.graph_names = [g.name for g in graphs]
        self._bounds = [[g.bucket[name] for name in self.symbols] for g in graphs]
        # Selection order: smallest product of input-symbol bounds first; sort is stable, so the
        # first graph in the manifest wins ties.
        cost = [_numel([b[k] for k in self.input_symbols]) for b in self._bounds]
        order = sorted(range(len(graphs)), key=cost.__getitem__)
        self._order = [(tuple((k, self._bounds[g][k]) for k in self.input_symbols), g) for g in order]
        for o, out in enumerate(self._outputs):
            if any(isinstance(d, (list, tuple)) for d in out.decl):
                out.capacity = self.output_capacity(o)

    # ---------------------------------------------------------------------------- per call
    CACHE_SIZE = 256  # distinct input-shape combinations remembered; a workload cycles through a few

    def prepare(self, shapes) -> Call:
        """resolve + select + output shapes + table words (pointers 0) for these input shapes
        (tuples of ints, one per input in manifest order). All of it depends on the shapes alone,
        so the Call is remembered by the shapes: a call whose shapes were seen before costs one
        dict lookup. Bad shapes raise every time (a failure is never remembered). When full, the
        oldest entry goes: a hit does no bookkeeping."""
        key = tuple(shapes)
        try:
            call = self._calls.get(key)
        except TypeError:  # a shape given as a list
            key = tuple(tuple(shape) for shape in shapes)
            call = self._calls.get(key)
        if call is None:
            call = self._prepare(key)
            if len(self._calls) >= self.CACHE_SIZE:
                self._forget_oldest()
            self._calls[key] = call
        return call

    def _forget_oldest(self) -> None:
        """Drop the cache's oldest entry. Sessions on other threads share this plan: one of them may
        change the dict between iter() and next(), or drop the same entry first; the cache is then
        one entry over its size for a moment, which is harmless."""
        try:
            del self._calls[next(iter(self._calls))]
        except (RuntimeError, KeyError, StopIteration):
            pass

    def _prepare(self, shapes) -> Call:
        values = self.resolve(shapes)
        g = self.select(values)
        out_shapes = self.output_shapes(values, g)
        words = table_words([0] * self._n_slots, self.slot_shapes(shapes, out_shapes), values)
        return Call(values, g, out_shapes, words)

    def resolve(self, shapes) -> list:
        """Symbol values from the input shapes (manifest order), data symbols 0. InputError for a
        wrong rank, a static dim that differs, a value out of range, or sources that disagree."""
        values = self._unset.copy()
        for i, (inp, shape) in enumerate(zip(self._inputs, shapes)):
            if inp.static is not None:
                if shape != inp.static:
                    self._shape_error(inp, shape)
                continue
            if len(shape) != inp.rank:
                self._shape_error(inp, shape)
            for d, size in inp.fixed:
                if shape[d] != size:
                    self._shape_error(inp, shape)
            for d, k in inp.reads:
                v, have = shape[d], values[k]
                if have < 0:
                    if not self._lo[k] <= v <= self._hi[k]:
                        self._range_error(inp, shape, d, k)
                    values[k] = v
                elif have != v:
                    self._disagree(shapes, i, d, k)
        return values

    def select(self, values) -> int:
        """The graph serving `values`: the smallest product of input-symbol bounds among the graphs
        whose bounds cover every input symbol (first on ties). InputError when none does."""
        for bounds, g in self._order:
            for k, bound in bounds:
                if values[k] > bound:
                    break
            else:
                return g
        raise InputError(f"no graph of this package serves {self.describe(values)} (its graphs: "
                         f"{', '.join(self.graph_names)})")

    def output_shapes(self, values, g: int) -> list:
        """Every output's shape at `values`, data symbols at graph g's bound: the true shape of
        outputs without data symbols, the allocated shape of the others."""
        if self.data_symbols:
            values = values.copy()
            for k in self.data_symbols:
                values[k] = self._bounds[g][k]
        shapes = []
        for out in self._outputs:
            shape = _evaluate(out.dims, values)
            if out.capacity is not None:
                self._check_capacity(out, shape, values)
            shapes.append(shape)
        return shapes

    def output_shape(self, o: int, values) -> tuple:
        """Output o's true shape, once every symbol (data symbols included) is known."""
        return _evaluate(self._outputs[o].dims, values)

    def slot_shapes(self, input_shapes, output_shapes) -> list:
        """The shape of every table slot, in slot order."""
        shapes = [()] * self._n_slots
        for slot, shape in zip(self._slot_of_input, input_shapes):
            shapes[slot] = shape
        for slot, shape in zip(self._slot_of_output, output_shapes):
            shapes[slot] = shape
        return shapes

    # ----------------------------------------------------------------------------- load time
    def bounds(self, g: int) -> list:
        """Graph g's bound per symbol (manifest order)."""
        return list(self._bounds[g])

    def data_symbols_of(self, o: int) -> tuple:
        """Indices of the data symbols output o's dim 0 uses (empty: its shape is known at launch)."""
        return self._outputs[o].data_symbols

    def output_capacity(self, o: int) -> int:
        """Elements to allocate for output o: the most any graph writes."""
        return max(_numel(_evaluate(self._outputs[o].dims, bounds)) for bounds in self._bounds)

    def input_capacity(self, i: int) -> int:
        """Elements of input i at the largest sizes a graph serves (numpy staging buffers): a
        symbol value above every graph's bound selects no graph, whatever its `max` says."""
        inp = self._inputs[i]
        dims = list(inp.decl)
        for d, k in inp.reads:
            dims[d] = min(self._hi[k], max(bounds[k] for bounds in self._bounds))
        return _numel(dims)

    def describe(self, values) -> str:
        """'n=17, m=3': the input symbols' values (messages, reports)."""
        return ", ".join(f"{self.symbols[k]}={values[k]}" for k in self.input_symbols) or "static shapes"

    # ------------------------------------------------------------------ errors (slow path)
    def _shape_error(self, inp: _Input, shape):
        if len(shape) != inp.rank:
            raise InputError(f"input {inp.name!r}: rank is {len(shape)} (shape {list(shape)}), expected "
                             f"rank {inp.rank} (shape {_show(inp.decl)})")
        bad = ", ".join(f"dim {d} must be {size}" for d, size in inp.fixed if shape[d] != size)
        raise InputError(f"input {inp.name!r}: shape is {list(shape)}, expected {_show(inp.decl)} ({bad})")

    def _range_error(self, inp: _Input, shape, d: int, k: int):
        raise InputError(f"input {inp.name!r}: dim {d} is {shape[d]}, but symbol {self.symbols[k]!r} must "
                         f"be in [{self._lo[k]}, {self._hi[k]}] (shape {list(shape)}, expected "
                         f"{_show(inp.decl)})")

    def _disagree(self, shapes, i: int, d: int, k: int):
        """Name the input dim that set symbol k first (the earliest source) and the one that differs."""
        first = next((j, dj) for j, inp in enumerate(self._inputs) for dj, kj in inp.reads if kj == k)
        j, dj = first
        raise InputError(f"input {self._inputs[i].name!r} dim {d} is {shapes[i][d]}, but input "
                         f"{self._inputs[j].name!r} dim {dj} is {shapes[j][dj]}: both are symbol "
                         f"{self.symbols[k]!r} and must be equal")

    def _check_capacity(self, out: _Output, shape, values) -> None:
        if min(shape, default=0) < 0:
            raise InputError(f"output {out.name!r} would have shape {list(shape)} ({_show(out.decl)} at "
                             f"{self.describe(values)}): these input sizes are not supported")
        if _numel(shape) > out.capacity:
            raise InvalidPackageError(f"output {out.name!r} has shape {list(shape)} at {self.describe(values)}, "
                                      f"more than the {out.capacity} elements any graph bounds it at")
