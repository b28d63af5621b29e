"""The kernel IR: buffers, index expressions and kernels.

A tensor value during lowering is an *expression* evaluated at an N-d index: a tree of `Expr`
nodes whose leaves read buffers (`Load`), constants or the index itself. Views never move data —
they wrap or rewrite the index mapping — and pointwise ops stay lazy until a consumer needs memory
(a GEMM operand, a graph output, a value with several users). So a chain of pointwise ops costs no
kernel of its own: it is evaluated inside whichever kernel reads it (prologue fusion), and
`fuse.py` folds pointwise consumers into the store of the kernel that produced their input
(epilogue fusion).

Every `Kernel` writes one buffer, its `out` (a few specs write more, named by
`Spec.extra_writes`: a split-K matmul's own partial sums, the sum a LayerNorm keeps for later
readers; each whole, once). Most write `out` whole: their value at every index of
their index space, row-major (contiguous), which defines the buffer (an arena buffer is written
whole once). A family whose registry entry `scatters` (families.Scatter: index_put, scatter,
index_add, KV-cache updates) writes *part* of a buffer instead, at positions it computes on the
device, into session state or into an arena buffer an earlier kernel wrote whole (a copy of the
old value); the elements it skips keep theirs. A partial write defines nothing on its own: the
memory plan keeps the buffer live from its whole write (memplan.plan_memory), and the graph's
edges count it as a write of the whole buffer (memplan.dependencies), so its readers wait for it
and for the writes before it, and it waits for those writes and for every reader of the value it
changes (write-after-read). A kernel reads the buffer it writes only at the element it stores
(families.in_place_problem). The `writes_extents` families also store a size into a word of the
extents table, and are ordered against every kernel that reads the extents. The verifier checks
all of it (aot/verify_ir.py).

The IR's objects never change once made: `Buffer`, `Kernel`, its `Spec` and `Program` are frozen,
so a pass returns new ones (`dataclasses.replace`) and the state a stage handed on stays what it
was. Plans and maps key buffers by `Buffer.index`, never by `id()`. Sizes here are the bucket's
(static); which elements are real is described by extents (`extents.py`) that kernels evaluate on
the device.
"""
from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from .ops import COSTLY

# dtype names used everywhere (manifest, IR, runtime): the torch names without the "torch." prefix.
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOATS = ("float64", "float32", "float16", "bfloat16")


def numel(shape) -> int:
    return math.prod(shape)


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def is_contiguous(strides, shape) -> bool:
    """`strides` walk `shape` in row-major order (a size-1 dimension may have any stride)."""
    return all(s == c or size == 1
               for s, c, size in zip(strides, contiguous_strides(shape), shape))


def compute_dtype(dtype: str) -> str:
    """Half-precision values are computed in fp32 inside a kernel and rounded on store."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


# ----------------------------------------------------------------------------------------------
# Buffers
# ----------------------------------------------------------------------------------------------
@dataclass(eq=False, frozen=True)
class Buffer:
    """A piece of device memory. kind: weight | arena | state | input | output | extents | errors.
    `state` buffers belong to the session and outlive a call (KV caches); `errors` is the one
    table word that index checks report into (ERRORS). A weight's data is kept by the program
    (`Program.weight_data`), an input's or output's table slot by the table layout
    (manifest.slot_of): a buffer is what kernels address, frozen once made, since the kernels of
    every stage share it.

    `index` is the buffer's number in its program: unique there, assigned where the buffer is
    made (Lowering.new_buffer counts 1, 2, ... in creation order, so `buf7` is index 7; a pass that
    adds buffers numbers them from `Program.next_index`) and the same in any copy of the object.
    Plans and maps key buffers by it, never by `id()`, so they survive a pass that returns new
    objects. Indices of two lowerings (two buckets) are unrelated: a plan belongs to the program
    it was made for."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    index: int
    # input/output with a dynamic dimension: per dimension whether it is dynamic (empty when none
    # is). The caller's true sizes and strides are read from the table slot, so loads of such a
    # buffer never fold views into static strides (views.remap).
    dynamic: tuple = ()

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * ITEMSIZE[self.dtype]

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {self.kind}, {self.dtype}{list(self.shape)})"


# ----------------------------------------------------------------------------------------------
# Expressions (identity semantics: a node reused in two places is one value, CSE'd by codegen)
# ----------------------------------------------------------------------------------------------
class Expr:
    __slots__ = ("dtype",)
    dtype: str

    def children(self) -> tuple["Expr", ...]:
        return ()

    # Printing only (format_expr below): `str(e)` is the whole tree, `repr(e)` the same text cut
    # at REPR_CHARS, so a debugger, a failed assertion or a log line shows what the value is
    # instead of `<grace.aot.ir.Op object at 0x...>`.
    def __str__(self) -> str:
        return format_expr(self)

    def __repr__(self) -> str:
        return _clip(format_expr(self, limit=REPR_CHARS))


class Load(Expr):
    """buf[offset + sum(idx[d] * strides[d])] — strides may be 0 (broadcast)."""

    __slots__ = ("buf", "offset", "strides")

    def __init__(self, buf: Buffer, offset: int, strides: tuple[int, ...]):
        self.buf, self.offset, self.strides, self.dtype = buf, offset, tuple(strides), buf.dtype


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value, dtype: str):
        self.value, self.dtype = value, dtype


class Index(Expr):
    """The index along one dimension, as an int64 value (arange, iota, masks)."""

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        self.dim, self.dtype = dim, "int64"


class SymValue(Expr):
    """The runtime value of a size expression (sympy, over the extents table): a mean's divisor,
    a size used as data."""

    __slots__ = ("expr",)

    def __init__(self, expr, dtype: str = "int64"):
        self.expr, self.dtype = expr, dtype


class Acc(Expr):
    """In an epilogue: the value the kernel computed at the current output index (fp32 or int)."""

    __slots__ = ()

    def __init__(self, dtype: str = "float32"):
        self.dtype = dtype


class Partner(Expr):
    """In a paired GEMV's epilogue (`Matmul.pair`): the sum at the output index's partner
    column, `pair` further on (a SwiGLU's up beside its gate), where `Acc` is the index's own."""

    __slots__ = ()

    def __init__(self, dtype: str = "float32"):
        self.dtype = dtype


class Op(Expr):
    """A pointwise operation on children evaluated at the same index. `param` carries e.g. a cast
    target or a scalar exponent."""

    __slots__ = ("op", "args", "param")

    def __init__(self, op: str, args, dtype: str, param: Any = None):
        self.op, self.args, self.dtype, self.param = op, tuple(args), dtype, param

    def children(self):
        return self.args


@dataclass(frozen=True)
class DimMap:
    """How one index of the child is computed from the parent index.
    kind "dim": parent[src] * step + start; "const": start; "expr": value of `expr` (a gather)."""

    kind: str
    src: int = 0
    step: int = 1
    start: int = 0
    expr: Expr | None = None


class Reindex(Expr):
    """child evaluated at a remapped index. If `bounds` is given, child indices outside
    [0, bounds[d]) yield `fill` (padding) instead of being read."""

    __slots__ = ("child", "maps", "bounds", "fill")

    def __init__(self, child: Expr, maps, bounds=None, fill=None):
        self.child, self.maps, self.dtype = child, tuple(maps), child.dtype
        self.bounds, self.fill = (tuple(bounds) if bounds is not None else None), fill

    def children(self):
        return (self.child,) + tuple(m.expr for m in self.maps if m.kind == "expr")


class Reshape(Expr):
    """child (of shape `child_shape`) read through a reshape to the parent's shape: the parent
    index is raveled in `parent_shape` and unraveled in `child_shape`."""

    __slots__ = ("child", "child_shape", "parent_shape")

    def __init__(self, child: Expr, child_shape, parent_shape):
        self.child, self.dtype = child, child.dtype
        self.child_shape, self.parent_shape = tuple(child_shape), tuple(parent_shape)

    def children(self):
        return (self.child,)


class Cat(Expr):
    """Concatenation along `dim`: part k covers [starts[k], starts[k] + sizes[k])."""

    __slots__ = ("parts", "dim", "starts", "sizes")

    def __init__(self, parts, dim: int, starts, sizes, dtype: str):
        self.parts, self.dim, self.dtype = tuple(parts), dim, dtype
        self.starts, self.sizes = tuple(starts), tuple(sizes)

    def children(self):
        return self.parts


def walk(expr: Expr):
    """Every node once (DAG order not guaranteed)."""
    seen, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(node.children())


def loads(expr: Expr) -> list[Load]:
    return [n for n in walk(expr) if isinstance(n, Load)]


def identity_load(expr: Expr, shape, buf: Buffer) -> bool:
    """`expr` (evaluated over `shape`) loads `buf`, and every load of it reads element i at flat
    index i."""
    found = False
    for load in loads(expr):
        if load.buf is not buf:
            continue
        found = True
        if load.offset != 0 or not is_contiguous(load.strides, shape):
            return False
    return found


def only_ops_above(expr: Expr, buf: Buffer) -> bool:
    """The loads of `buf` in `expr` hang directly under pointwise ops (no reindexing in between),
    so they are evaluated at the index `expr` is: with `identity_load`, they read `buf` at the very
    element being computed (what epilogue fusion replaces by the producer's value, and all a kernel
    may read of the buffer it writes)."""
    for node in walk(expr):
        if isinstance(node, Op) or isinstance(node, Load):
            continue
        if any(isinstance(n, Load) and n.buf is buf for n in walk(node)):
            return False
    return True


def expr_size(expr: Expr) -> int:
    return sum(1 for _ in walk(expr))


def is_cheap(expr: Expr, limit: int = 24, row: bool = False) -> bool:
    """Cheap enough to recompute in every tile that reads it (GEMM/attention operands): index
    arithmetic and plain arithmetic are fine; transcendentals, gathers and concatenations are
    computed once into memory instead. `row`: the operand is a handful of rows (a GEMV's row,
    a decode step's queries), so each program recomputes only those few elements and anything
    within a larger node budget is cheaper than a kernel boundary (a norm, a rotary embedding)."""
    count = 0
    for node in walk(expr):
        count += 1
        if count > (ROW_OPERAND_NODES if row else limit):
            return False
        if row:
            continue
        if isinstance(node, Cat):
            return False
        if isinstance(node, Reindex) and any(m.kind == "expr" and loads(m.expr)
                                             for m in node.maps):
            return False   # a gather; index arithmetic alone (GQA's head // rep) is cheap
        if isinstance(node, Op) and node.op in COSTLY:
            return False
    return True


ROW_OPERAND_NODES = 64


# The table's words, one buffer each in every program; negative indices, so that they never meet
# a lowering's (which count from 1).
EXTENTS = Buffer("extents", "extents", "int64", (0,), -1)   # the extents table (symbol values)
# the error word of the table (format 3.3): a gather whose index is out of range stores the code
# of its check here (Op "check_index"); kernels only ever store into it, and the runtime reads it
ERRORS = Buffer("errors", "errors", "int64", (1,), -2)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """What a kernel family computes: its operands and settings (aot/families.py has one frozen
    dataclass per family, and the registry). The fields are the contract between the family's
    lowering and its template, so a missing or unknown one is a TypeError where the kernel is
    built; a field annotated as an expression must hold one (`Expr`, `Expr | None` or
    `tuple[Expr, ...]`), since the IR finds the buffers a kernel reads (the memory plan, the
    graph's dependencies) only through its expressions (`exprs`)."""

    family: ClassVar[str] = ""

    def __post_init__(self):
        for name, kind in _expr_fields(type(self)).items():
            value = getattr(self, name)
            ok = {"expr": isinstance(value, Expr),
                  "optional": value is None or isinstance(value, Expr),
                  "tuple": isinstance(value, tuple) and all(isinstance(v, Expr) for v in value)}
            if not ok[kind]:
                raise TypeError(f"{type(self).__name__}.{name} must be an Expr"
                                f"{' or None' if kind == 'optional' else ''}"
                                f"{' tuple' if kind == 'tuple' else ''}, "
                                f"not {type(value).__name__}")

    def exprs(self) -> list[tuple[str, Expr]]:
        """(field name, expression) for every expression the spec holds, in field order; the
        elements of a tuple field are named `field[i]`."""
        found = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Expr):
                found.append((f.name, value))
            elif isinstance(value, tuple):
                found += [(f"{f.name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, Expr)]
        return found

    def extra_writes(self) -> list:
        """Buffers the kernel writes besides `out`: the partial sums and arrival counters of a
        split-K matmul that reduces its own splits (aot/fuse_splitk.py), which only it reads back;
        the source a LayerNorm keeps for later readers (aot/fuse_norm.py). The memory plan keeps
        each live from this kernel to its last reader; the graph's edges order it as a write."""
        return []

    def reads_own_writes(self) -> tuple[str, ...]:
        """The expression fields through which the kernel may read a buffer of `extra_writes`
        (families.in_place_problem): none, unless the family shows that no value it computes
        depends on what its own programs store there."""
        return ()

    # The family's rules, which the IR verifier (aot/verify_ir.py) checks; the families override
    # them (aot/families.py).
    def index_spaces(self, out_shape) -> dict:
        """Field name -> the index space its template evaluates that expression over (every
        element of a tuple field over the same one); None: read by address, not through an
        index. An expression field missing here is reported by the verifier."""
        return {}

    def extents(self) -> list[tuple[str, Any, tuple]]:
        """(name, extents, shape) for the extents the spec carries beside the kernel's own."""
        return []

    def shape_problems(self, out_shape) -> list[str]:
        """How the family's own sizes disagree with the kernel's index space (empty: they agree)."""
        return []

    def out_elements(self, out_shape) -> int:
        """The elements the kernel writes into its buffer (the index space, unless it writes
        partial results laid out its own way)."""
        return numel(out_shape)

    @property
    def writes_partials(self) -> bool:
        """It leaves partial results (split-K sums, split-KV outputs) that a second kernel
        combines and applies the epilogue to, so nothing can be fused into its store."""
        return False


@functools.cache
def _expr_fields(cls) -> dict[str, str]:
    """Field name -> "expr" | "optional" | "tuple" for the fields of a spec class annotated as
    expressions (resolved once per class)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if hint is Expr:
            kinds[f.name] = "expr"
        elif args and Expr in args and type(None) in args:
            kinds[f.name] = "optional"
        elif typing.get_origin(hint) is tuple and args and args[0] is Expr:
            kinds[f.name] = "tuple"
    return kinds


@dataclass(eq=False, frozen=True)
class Kernel:
    """One kernel launch. It computes a value per index of `out_shape` (what, is its family's
    `spec`: a pointwise expression, a reduction, a GEMM tile, attention) and stores `epilogue` —
    an expression in which `Acc` is that value — into `out`: whole and contiguous, or, for a
    family that scatters, at the positions its spec computes (the module docstring).

    Frozen, like its spec and its buffer: a pass that changes a kernel returns a new one
    (`dataclasses.replace`), so the kernels a stage handed on stay what that stage made."""

    spec: Spec
    out: Buffer
    out_shape: tuple[int, ...]
    epilogue: Expr
    label: str = ""
    # extents (extents.py) of out_shape, per dimension; None = all static
    ext: tuple | None = None
    # Runs beside the critical path (a decode step's KV-cache append moved after the attention,
    # aot/fuse_append.py): the memory plan keeps its arena inputs live to the end of the graph,
    # so that no later kernel reuses their bytes and has to wait for it (a write-after-read edge).
    off_path: bool = False

    def __post_init__(self):
        if not isinstance(self.spec, Spec):
            raise TypeError(f"a kernel's spec is an ir.Spec (aot/families.py), not "
                            f"{type(self.spec).__name__}")

    @property
    def family(self) -> str:
        return self.spec.family

    def exprs(self) -> list[Expr]:
        return [self.epilogue] + [e for _, e in self.spec.exprs()]

    def reads(self) -> list[Buffer]:
        seen: dict[int, Buffer] = {}
        for expr in self.exprs():
            for load in loads(expr):
                seen.setdefault(load.buf.index, load.buf)
        return list(seen.values())

    def writes(self) -> list[Buffer]:
        """`out`, then the spec's other outputs (Spec.extra_writes)."""
        return [self.out] + self.spec.extra_writes()

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"Kernel({self.family}{label} -> {_buf_text(self.out)}, over {list(self.out_shape)})"

    def __str__(self) -> str:
        return format_kernel(self)


@dataclass(frozen=True)
class Program:
    """The lowered model: kernels in execution order plus the buffers they touch. Frozen: a pass
    that adds to it (generation.add_state) returns a new Program."""

    kernels: list[Kernel]
    inputs: list[Buffer]
    outputs: list[Buffer]
    weights: list[Buffer]
    weight_data: dict[str, Any]          # weight buffer name -> contiguous CPU torch tensor
    name: str = "model"
    # I/O buffer name -> its sizes as torch reports them (ints / SymInts), for the manifest
    sizes: dict = field(default_factory=dict)
    # size symbol -> its bound in this bucket (input symbols and the data-dependent ones)
    bounds: dict = field(default_factory=dict)
    state: list[Buffer] = field(default_factory=list)     # session state (mutated buffers)
    state_data: dict[str, Any] = field(default_factory=dict)   # its initial values
    # (input name, size of the state dimension that input indexes), e.g. ("input_pos", 2048)
    state_index_sizes: list = field(default_factory=list)
    # the gathers' index checks: {"code", "input", "op", "where", "size"} (Lowering.check_index)
    index_checks: list = field(default_factory=list)
    # the index the next buffer made for this program takes (Buffer.index)
    next_index: int = 1

    def __repr__(self) -> str:
        return (f"Program({self.name!r}: {len(self.kernels)} kernels, {len(self.inputs)} inputs, "
                f"{len(self.outputs)} outputs, {len(self.weights)} weights, {len(self.state)} state)")

    def __str__(self) -> str:
        return format_ir(self)


def with_zero_state(program: Program, entries) -> Program:
    """`program` with state buffers of zeros after its own, numbered from its next index:
    `entries` are (name, dtype, shape). A pass that adds them to every bucket's program gives
    them the same offsets in every graph (the memory plan packs state in list order)."""
    import torch   # the compiler's dependency: the initial values are tensors, as the model's

    added = [Buffer(name, "state", dtype, tuple(shape), program.next_index + i)
             for i, (name, dtype, shape) in enumerate(entries)]
    return replace(program, state=program.state + added,
                   state_data={**program.state_data,
                               **{b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype))
                                  for b in added}},
                   next_index=program.next_index + len(added))


# ----------------------------------------------------------------------------------------------
# Printing: the IR as a small listing (GRACE_DUMP, aot/dump.py; repr/str of the nodes above)
# ----------------------------------------------------------------------------------------------
# A value is a DAG (a node reused in two places is one value), so the printer names every
# non-leaf node that has several parents once (`%1 = ...`) and refers to it by name after that:
# the text grows with the number of nodes, never with the number of paths through them.
REPR_CHARS = 400   # repr() of an expression stops here (str() and format_expr print it whole)


def _clip(text: str, limit: int = REPR_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _buf_text(buf: Buffer) -> str:
    """`buf3 arena float32[4, 128]`; a dynamic I/O buffer marks its dynamic dims with `*`."""
    dims = [f"{d}*" if buf.dynamic and buf.dynamic[i] else str(d) for i, d in enumerate(buf.shape)]
    return f"{buf.name} {buf.kind} {buf.dtype}[{', '.join(dims)}]"


def _short_dtype(dtype: str) -> str:
    return {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16",
            "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
            "bool": "b1"}.get(dtype, dtype)


def _map_text(m: DimMap, name) -> str:
    if m.kind == "dim":
        text = f"i{m.src}" if m.step == 1 else f"i{m.src}*{m.step}"
        return text + (f"{m.start:+d}" if m.start else "")
    if m.kind == "const":
        return str(m.start)
    return name(m.expr)


def format_expr(expr: Expr, limit: int | None = None, names: dict | None = None) -> str:
    """One expression as text, e.g. `gelu:f32(add:f32(buf3[0; 128, 1], fc1.bias[0; 0, 1]))`.

    Leaves: `BUF[offset; strides]` (a Load: element offset + sum of index * stride), `1.0:f32`
    (a constant), `i0` (the index along dim 0), `sym(s0)` (a size symbol's runtime value),
    `acc:f32` (the kernel's computed value, in an epilogue). Nodes: `op:dtype(args)` (with
    `[param]` when the op has one), `reindex(child @ [maps], bounds=..., fill=...)` where a map is
    `i<d>*step+start`, a constant or an index expression, `reshape(child, [from] -> [to])` and
    `cat@dim(part [start:end], ...)`. A node with several parents is printed once as `%k = ...`
    before the expression and referred to as `%k`. `limit`: stop after about that many
    characters (repr); `names`: a dict to share the `%k` numbering between several
    expressions (format_kernel)."""
    parents: dict[int, int] = {}
    for node in walk(expr):
        for child in node.children():
            parents[id(child)] = parents.get(id(child), 0) + 1
    shared = names if names is not None else {}
    lets: list[str] = []
    budget = [limit if limit is not None else -1]

    def name(node: Expr) -> str:
        if id(node) in shared:
            return shared[id(node)]
        text = render(node)
        if parents.get(id(node), 0) > 1 and node.children():
            key = f"%{len(shared) + 1}"
            shared[id(node)] = key
            lets.append(f"{key} = {text}")
            return key
        return text

    def render(node: Expr) -> str:
        if budget[0] == 0:
            return "..."
        if isinstance(node, Load):
            strides = ", ".join(str(s) for s in node.strides)
            text = f"{node.buf.name}[{node.offset}; {strides}]"
        elif isinstance(node, Const):
            text = f"{node.value!r}:{_short_dtype(node.dtype)}"
        elif isinstance(node, Index):
            text = f"i{node.dim}"
        elif isinstance(node, SymValue):
            text = f"sym({node.expr})"
        elif isinstance(node, Acc):
            text = f"acc:{_short_dtype(node.dtype)}"
        elif isinstance(node, Partner):
            text = f"partner:{_short_dtype(node.dtype)}"
        elif isinstance(node, Op):
            param = f"[{node.param!r}]" if node.param is not None else ""
            text = f"{node.op}{param}:{_short_dtype(node.dtype)}({', '.join(name(a) for a in node.args)})"
        elif isinstance(node, Reindex):
            maps = ", ".join(_map_text(m, name) for m in node.maps)
            extra = ""
            if node.bounds is not None:
                extra = f", bounds={list(node.bounds)}, fill={node.fill!r}"
            text = f"reindex({name(node.child)} @ [{maps}]{extra})"
        elif isinstance(node, Reshape):
            text = (f"reshape({name(node.child)}, {list(node.child_shape)} -> "
                    f"{list(node.parent_shape)})")
        elif isinstance(node, Cat):
            parts = ", ".join(f"{name(p)} [{a}:{a + n}]"
                              for p, a, n in zip(node.parts, node.starts, node.sizes))
            text = f"cat@{node.dim}:{_short_dtype(node.dtype)}({parts})"
        else:
            text = f"<{type(node).__name__}>"
        if budget[0] > 0:
            budget[0] = max(0, budget[0] - len(text))
        return text

    body = name(expr)
    return "\n".join(lets + [body]) if lets else body


def _input_text(value, names: dict) -> str:
    """A field of a kernel's spec: expressions through format_expr, the rest as Python."""
    if isinstance(value, Expr):
        return format_expr(value, names=names).replace("\n", "\n      ")
    if isinstance(value, tuple) and any(isinstance(v, Expr) for v in value):
        return "(" + ", ".join(_input_text(v, names) for v in value) + ")"
    return repr(value)


def format_kernel(kernel: Kernel, index: int | None = None) -> str:
    """A kernel as a few lines: `#index family 'label'`, what it writes (buffer, over which index
    space, with which extents), every field of its spec, and the epilogue it stores."""
    head = f"#{index} " if index is not None else ""
    label = f" {kernel.label!r}" if kernel.label else ""
    lines = [f"{head}{kernel.family}{label}",
             f"    out      {_buf_text(kernel.out)}  over {list(kernel.out_shape)}"
             + (f"  ext {list(kernel.ext)}" if kernel.ext is not None else "")]
    reads = ", ".join(b.name for b in kernel.reads())
    lines.append(f"    reads    {reads or '-'}")
    names: dict = {}
    for f in fields(kernel.spec):
        lines.append(f"    {f.name:<8} {_input_text(getattr(kernel.spec, f.name), names)}")
    lines.append(f"    epilogue {_input_text(kernel.epilogue, names)}")
    return "\n".join(lines)


def format_ir(program: "Program | None" = None, kernels: list[Kernel] | None = None,
              title: str | None = None) -> str:
    """A lowering as a small listing: the buffers (inputs, outputs, weights, state, then every
    intermediate the kernels write or read: name, kind, dtype and shape) and the kernels in
    execution order (format_kernel). `kernels` replaces the program's own (after fusion, the
    fused list); `title` heads the listing (the bucket)."""
    kernels = list(kernels if kernels is not None else (program.kernels if program else []))
    lines = [title] if title else []
    seen: set[int] = set()
    groups = []
    if program is not None:
        groups = [("inputs", program.inputs), ("outputs", program.outputs),
                  ("weights", program.weights), ("state", program.state)]
    inner: list[Buffer] = []
    for k in kernels:
        for b in [k.out] + k.reads():
            if b.kind in ("arena", "extents", "errors") and b.index not in seen:
                seen.add(b.index)
                inner.append(b)
    groups.append(("intermediates", inner))
    lines.append("buffers:")
    for what, bufs in groups:
        if bufs:
            lines.append(f"  {what}:")
            lines += [f"    {_buf_text(b)}" for b in bufs]
    lines.append(f"kernels ({len(kernels)}):")
    for i, k in enumerate(kernels):
        lines += ["  " + ln for ln in format_kernel(k, i).splitlines()]
    return "\n".join(lines) + "\n"
