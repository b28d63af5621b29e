"""The kernel IR: buffers, index expressions and kernels.

A tensor value during lowering is an *expression* evaluated at an N-d index: a tree of `Expr`
nodes whose leaves read buffers (`Load`), constants or the index itself. Views never move data —
they wrap or rewrite the index mapping — and pointwise ops stay lazy until a consumer needs memory
(a GEMM operand, a graph output, a value with several users). So a chain of pointwise ops costs no
kernel of its own: it is evaluated inside whichever kernel reads it (prologue fusion), and
`fuse.py` folds pointwise consumers into the store of the kernel that produced their input
(epilogue fusion).

Every `Kernel` writes exactly one contiguous buffer. Sizes here are the bucket's (static); which
elements are real is described by extents (`shapes.py`) that kernels evaluate on the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
@dataclass(eq=False)
class Buffer:
    """A piece of device memory. kind: weight | arena | state | input | output | extents | errors.
    `state` buffers belong to the session and outlive a call (KV caches); `errors` is the one
    table word that index checks report into (ERRORS)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    # weight: the tensor's data (numpy-compatible bytes) is kept by the lowering context.
    # input/output: index of the argument-table slot.
    slot: int | None = None
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


EXTENTS = Buffer("extents", "extents", "int64", (0,))   # the extents table (symbol values)
# the error word of the table (format 3.3): a gather whose index is out of range stores the code
# of its check here (Op "check_index"); kernels only ever store into it, and the runtime reads it
ERRORS = Buffer("errors", "errors", "int64", (1,))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Kernel:
    """One kernel launch. It computes a value per index of `out_shape` (family-specific: a
    pointwise expression, a reduction, a GEMM tile, attention) and stores `epilogue` — an
    expression in which `Acc` is that value — into `out` (contiguous)."""

    family: str                     # pointwise | reduction | softmax | layer_norm | matmul | attention
    out: Buffer
    out_shape: tuple[int, ...]
    epilogue: Expr
    inputs: dict[str, Any] = field(default_factory=dict)   # family-specific operands and settings
    label: str = ""
    # extents (shapes.py) of out_shape, per dimension; None = all static
    ext: tuple | None = None

    def exprs(self) -> list[Expr]:
        found = [self.epilogue]
        for value in self.inputs.values():
            if isinstance(value, Expr):
                found.append(value)
            elif isinstance(value, tuple):
                found += [v for v in value if isinstance(v, Expr)]
        return found

    def reads(self) -> list[Buffer]:
        seen: dict[int, Buffer] = {}
        for expr in self.exprs():
            for load in loads(expr):
                seen.setdefault(id(load.buf), load.buf)
        return list(seen.values())


@dataclass
class Program:
    """The lowered model: kernels in execution order plus the buffers they touch."""

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
