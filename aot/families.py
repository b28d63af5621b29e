"""Kernel families: one typed spec per family, and the one registry of what each family is.

A `Kernel` (ir.py) says where its value goes: the buffer, the index space, the epilogue, the
extents. Its *spec* says what the family computes: exactly the operands and settings the family's
lowering sets and its template (aot/codegen.py) reads, as a frozen dataclass. The field names were
dictionary keys that lowering and codegen had to agree on; as fields, a missing or misspelt one
is a TypeError where lowering builds the kernel, and `ir.Spec` finds every expression in them
(`Kernel.reads`) without a list of names.

Tile plans are decided once, by lowering, and stored in the spec (`Matmul.plan`,
`Attention.plan`): lowering needs the split (split-K or split-KV emits a second kernel), codegen
the tiles, and one plan cannot disagree with itself. Lowering computes them for the target's
multiprocessor count (`options["sm_count"]`).

`FAMILIES` is the registry: per family its spec class, its template and the traits other stages
ask about, so no module tests a family by its name. Each spec's methods carry its rules for the IR
verifier (ir.Spec: the index space of each expression, its own sizes against the kernel's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy

from . import codegen
from .codegen import AttentionPlan, GemmPlan
from .ir import Buffer, Expr, Kernel, Spec, identity_load, loads, numel, only_ops_above


# ---- the specs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pointwise(Spec):
    """The epilogue evaluated at every index of out_shape: all there is to a pointwise kernel."""

    family = "pointwise"


@dataclass(frozen=True)
class Scatter(Spec):
    """out[coords(i)] = epilogue(i) for every index i of out_shape (the values' index space, not
    `out`'s): coords[d] computes destination index d; destinations outside `out` are skipped.
    `accumulate` ("add" | "max" | "min") combines repeated destinations atomically; None stores."""

    family = "scatter"
    coords: tuple[Expr, ...]
    accumulate: str | None = None

    def index_spaces(self, out_shape):
        return {"coords": tuple(out_shape)}


@dataclass(frozen=True)
class SourceSpec(Spec):
    """The families that walk a source of a shape of its own (`src` over `src_shape`, with its
    extents `src_ext`) and write one value per kept index (or, compact, per element)."""

    src: Expr
    src_shape: tuple[int, ...]
    src_ext: tuple | None

    def index_spaces(self, out_shape):
        return {"src": tuple(self.src_shape)}

    def extents(self):
        return [("src_ext", self.src_ext, tuple(self.src_shape))]


@dataclass(frozen=True)
class Reduction(SourceSpec):
    """`op` ("sum" | "max" | "min") of src over the dimensions `rdims`, accumulated in
    `acc_dtype`; the kept dimensions, in order, are out_shape."""

    family = "reduction"
    rdims: tuple[int, ...]
    op: str
    acc_dtype: str
    # as LayerNorm's: `kept` (over src_shape, whose reduced dimensions are its last ones) is
    # also stored into `keep`, contiguous (aot/fuse_norm.py: an RMSNorm's mean of squares that
    # adds the split-K sum of the residual stream it reads, and keeps that sum)
    keep: Buffer | None = None
    kept: Expr | None = None
    # A GEMV's row, stored once the value is known (aot/fuse_rows.py: an RMSNorm's normalised
    # row, which the GEMV's programs would otherwise recompute every K step): `row_value` over
    # `row_shape` (the GEMV's [batch, 1, K]) times `row_scale` (its `Acc`: the reduced value; None
    # when row_value itself reads it as `Acc`) into `row`, contiguous. One output element only.
    row: Buffer | None = None
    row_value: Expr | None = None
    row_scale: Expr | None = None
    row_shape: tuple[int, ...] = ()

    def index_spaces(self, out_shape):
        return {"src": tuple(self.src_shape), "kept": tuple(self.src_shape),
                "row_value": tuple(self.row_shape), "row_scale": tuple(self.row_shape)}

    def shape_problems(self, out_shape):
        problems = _keep_problems(self, self.src_shape)
        n = len(self.src_shape)
        if self.keep is not None and tuple(self.rdims) != tuple(range(n - len(self.rdims), n)):
            problems.append(f"keeps its source but reduces {list(self.rdims)} of "
                            f"{list(self.src_shape)}, not its last dimensions")
        if (self.row is None) != (self.row_value is None):
            problems.append("row and row_value go together (a buffer and the value stored in it)")
        if self.row is not None:
            if numel(out_shape) != 1 or self.keep is not None:
                problems.append("stores a row but reduces to more than one value, or keeps one")
            if numel(self.row.shape) != numel(self.row_shape) or not self.row_shape:
                problems.append(f"stores a row of {list(self.row_shape)} into "
                                f"{self.row.name} ({list(self.row.shape)})")
        return problems

    def extra_writes(self):
        return [b for b in (self.keep, self.row) if b is not None]


def _keep_problems(spec, shape) -> list[str]:
    """A spec that keeps a value (Reduction, LayerNorm: aot/fuse_norm.py) has both halves, and
    its buffer holds the elements of `shape` (where `kept` is evaluated)."""
    if (spec.keep is None) != (spec.kept is None):
        return ["keep and kept go together (a buffer and the value stored in it)"]
    if spec.keep is not None and numel(spec.keep.shape) != numel(shape):
        return [f"keeps its source in {spec.keep.name} ({list(spec.keep.shape)}), not "
                f"{numel(shape)} elements"]
    return []


@dataclass(frozen=True)
class Argreduce(SourceSpec):
    """The int64 index of the maximum (op "max") or minimum ("min") over the flattened `rdims`."""

    family = "argreduce"
    rdims: tuple[int, ...]
    op: str


@dataclass(frozen=True)
class Sort(SourceSpec):
    """The permutation that sorts each row (the last dimension) of src stably; the first
    out_shape[-1] columns of it (topk)."""

    family = "sort"
    descending: bool


@dataclass(frozen=True)
class Compact(SourceSpec):
    """The row-major indices of src's nonzero elements, [numel(src), rank(src)], and their count
    stored as the value of `symbol` in the extents."""

    family = "compact"
    symbol: sympy.Symbol

    def shape_problems(self, out_shape):
        want = (numel(self.src_shape), len(self.src_shape))
        if tuple(out_shape) != want:
            return [f"out_shape {list(out_shape)} is not [numel(src), rank(src)] for src "
                    f"{list(self.src_shape)}"]
        return []


@dataclass(frozen=True)
class Softmax(Spec):
    """(log-)softmax of src along the last dimension of out_shape."""

    family = "softmax"
    src: Expr
    log: bool

    def index_spaces(self, out_shape):
        return {"src": tuple(out_shape)}


@dataclass(frozen=True)
class Scan(Spec):
    """Inclusive cumulative `op` ("sum" | "prod") of src along the last dimension, in acc_dtype."""

    family = "scan"
    src: Expr
    op: str
    acc_dtype: str

    def index_spaces(self, out_shape):
        return {"src": tuple(out_shape)}


@dataclass(frozen=True)
class LayerNorm(Spec):
    """Each row of src ([rows, n] = out_shape) normalised with `eps`, times `weight`, plus
    `bias` (both optional, evaluated over the same index space). `keep`: the value `kept` (a
    part of src, over the same index space) is also stored there, contiguous, for the kernels
    after this one that read it (aot/fuse_norm.py: a residual branch whose split-K sum the
    LayerNorm adds)."""

    family = "layer_norm"
    src: Expr
    eps: float
    weight: Expr | None = None
    bias: Expr | None = None
    keep: Buffer | None = None
    kept: Expr | None = None

    def index_spaces(self, out_shape):
        return {key: tuple(out_shape) for key in ("src", "weight", "bias", "kept")}

    def shape_problems(self, out_shape):
        problems = [] if len(out_shape) == 2 else [f"out_shape {list(out_shape)} is not [rows, n]"]
        return problems + _keep_problems(self, out_shape)

    def extra_writes(self):
        return [self.keep] if self.keep is not None else []


@dataclass(frozen=True)
class Matmul(Spec):
    """a [batch, m, k] @ b [batch, k, n] by `plan` (codegen.gemm_plan). With plan.split > 1 it
    writes fp32 partial sums [split * batch, m, n] that a reduction kernel sums (split-K).
    `k_ext`: the extents of K (a dynamic K is masked)."""

    family = "matmul"
    a: Expr
    b: Expr
    m: int
    n: int
    k: int
    batch: int
    fp32_precision: str
    plan: GemmPlan
    k_ext: tuple | None
    # A GEMV's row statistic (fuse_stats.py): the single value of a one-row reduction that its
    # row operand `a` reads as `Acc` (an RMSNorm's mean of squares), reduced by every program
    # before its K loop: `stat_op` of `stat` over the dimensions `stat_rdims` of `stat_shape`.
    # With `stat_scale` the statistic is accumulated in the K loop instead, `a` does not read it,
    # and the dot product is multiplied by `stat_scale` (its `Acc`: the statistic) at the end.
    stat: Expr | None = None
    stat_shape: tuple[int, ...] = ()
    stat_rdims: tuple[int, ...] = ()
    stat_op: str = "sum"
    stat_scale: Expr | None = None
    # Split-K reduced inside the kernel (aot/fuse_splitk.py): each program stores its partial sums
    # into `partial` (float32 [split, batch, m, n]) and counts itself in `arrivals` (int32 session
    # state, one word per output tile, zero between kernels); the tile's last program sums the
    # splits and stores the epilogue into out ([batch, m, n]). None: out holds the partial sums.
    partial: Buffer | None = None
    arrivals: Buffer | None = None
    # A paired GEMV (fuse_rows.pair_gemv_rows): out is [batch, 1, pair], n = 2 * pair; each
    # program sums weight columns j and j + pair for its outputs j, and the epilogue reads the
    # first as `Acc`, the second as `Partner` (silu(gate) * up, the down projection's row). 0: not.
    pair: int = 0

    def index_spaces(self, out_shape):
        spaces = {"a": (self.batch, self.m, self.k), "b": (self.batch, self.k, self.n)}
        if self.stat is not None:
            spaces["stat"] = tuple(self.stat_shape)
        if self.stat_scale is not None:
            spaces["stat_scale"] = ()
        return spaces

    def shape_problems(self, out_shape):
        if self.pair:
            want = (self.batch, 1, self.pair)
            problems = [] if tuple(out_shape) == want else [
                f"out_shape {list(out_shape)} is not [batch, 1, pair] = {list(want)}"]
            if not (self.plan.gemv and self.m == 1 and self.n == 2 * self.pair
                    and self.plan.split == 1 and not self.plan.ahead and self.partial is None):
                problems.append("a paired matmul is an unsplit GEMV of n = 2 * pair that loads "
                                "no weights ahead")
            return problems
        if self.partial is not None:
            want = (self.batch, self.m, self.n)
            problems = [] if tuple(out_shape) == want else [
                f"out_shape {list(out_shape)} is not [batch, m, n] = {list(want)}"]
            if self.plan.split < 2 or self.arrivals is None:
                problems.append("a split-K matmul that reduces its own splits needs split > 1 "
                                "and its arrival counters")
            return problems
        want = (self.plan.split * self.batch, self.m, self.n)
        if tuple(out_shape) != want:
            return [f"out_shape {list(out_shape)} is not [split * batch, m, n] = {list(want)}"]
        return []

    def extra_writes(self):
        return [self.partial, self.arrivals] if self.partial is not None else []

    @property
    def writes_partials(self):
        return self.plan.split > 1 and self.partial is None


def _bhld_problems(spec, out_shape) -> list[str]:
    want = (spec.b, spec.h, spec.lq, spec.dv)
    if tuple(out_shape) != want:
        return [f"out_shape {list(out_shape)} is not [b, h, lq, dv] = {list(want)}"]
    return []


@dataclass(frozen=True)
class Attention(Spec):
    """softmax(q @ k^T * scale, causal and/or `mask`) @ v over [b, h, lq|lk, d|dv], by `plan`
    (codegen.attention_plan). With plan.split > 1 each key split leaves its output and
    log-sum-exp in a float32 buffer (split * b*h*lq*(dv + 1) elements) for attn_combine."""

    family = "attention"
    q: Expr
    k: Expr
    v: Expr
    b: int
    h: int
    lq: int
    lk: int
    d: int
    dv: int
    causal: bool
    scale: float
    fp32_precision: str
    lk_ext: tuple | None
    plan: AttentionPlan
    mask: Expr | None = None
    # A key and value appended at one position in this call (aot/fuse_append.py): at key index
    # `new_pos` the template takes `k_new` / `v_new` instead of what `k` / `v` read there, so the
    # kernels that write them into the cache can run after this one. Each is evaluated once per
    # program, at key index 0 (they do not depend on it).
    k_new: Expr | None = None
    v_new: Expr | None = None
    new_pos: Expr | None = None
    # The appends themselves (fuse_append.APPEND_IN_ATTENTION): the attention's first key split
    # stores this call's key and value into the caches, so they launch no kernels of their own.
    # The appends' values and positions over their own index spaces ([b, h_kv, 1, d|dv]: the
    # caches' shapes with one position), and the caches (state buffers [b, h_kv, slots, d|dv]).
    k_store: Expr | None = None
    k_store_pos: Expr | None = None
    v_store: Expr | None = None
    v_store_pos: Expr | None = None
    k_cache: Buffer | None = None
    v_cache: Buffer | None = None
    # The split-KV combine done by the attention itself (aot/fuse_combine.py): each split program
    # stores its partial output and log-sum-exp into `partial` (float32, split * b*h*lq*(dv + 1)
    # elements, as out would hold them otherwise) and counts itself in `arrivals` (int32 session
    # state, one word per program tile of its query rows, zero between kernels); the tile's last
    # program combines the splits and stores the epilogue into out ([b, h, lq, dv]). None: out
    # holds the partials for an attn_combine kernel.
    partial: Buffer | None = None
    arrivals: Buffer | None = None

    def index_spaces(self, out_shape):
        b, h, lq, lk = self.b, self.h, self.lq, self.lk
        spaces = {"q": (b, h, lq, self.d), "k": (b, h, lk, self.d), "v": (b, h, lk, self.dv),
                  "mask": (b, h, lq, lk), "k_new": (b, h, lk, self.d),
                  "v_new": (b, h, lk, self.dv), "new_pos": (b, h, lk, self.d)}
        for name, cache in (("k", self.k_cache), ("v", self.v_cache)):
            if cache is not None:
                spaces[f"{name}_store"] = spaces[f"{name}_store_pos"] = self.append_space(cache)
        return spaces

    @staticmethod
    def append_space(cache: Buffer) -> tuple:
        """The index space of an append into `cache`: one position of it."""
        b, h_kv, _, d = cache.shape
        return (b, h_kv, 1, d)

    def shape_problems(self, out_shape):
        given = [f for f in ("k_new", "v_new", "new_pos") if getattr(self, f) is not None]
        if given and len(given) != 3:
            return [f"an appended key and value needs k_new, v_new and new_pos, not only "
                    f"{', '.join(given)}"]
        stores = ("k_store", "k_store_pos", "v_store", "v_store_pos", "k_cache", "v_cache")
        given = [f for f in stores if getattr(self, f) is not None]
        if given and (len(given) != len(stores) or self.new_pos is None):
            return ["storing the appends needs k_new/v_new/new_pos and all of "
                    f"{', '.join(stores)}, not only {', '.join(given)}"]
        for cache, d in ((self.k_cache, self.d), (self.v_cache, self.dv)):
            if cache is not None and (cache.kind != "state" or len(cache.shape) != 4
                                      or cache.shape[0] != self.b or cache.shape[3] != d):
                return [f"appends into {cache.name} ({cache.kind}, {list(cache.shape)}), not a "
                        f"[{self.b}, h_kv, slots, {d}] state buffer"]
        if self.partial is not None:
            need = self.plan.split * self.b * self.h * self.lq * (self.dv + 1)
            if self.plan.split < 2 or self.arrivals is None:
                return ["an attention that combines its own key splits needs split > 1 and its "
                        "arrival counters"]
            if numel(self.partial.shape) < need or self.partial.dtype != "float32":
                return [f"its partials need {need} float32 elements; {self.partial.name} is "
                        f"{self.partial.dtype} {list(self.partial.shape)}"]
        return _bhld_problems(self, out_shape)

    def extra_writes(self):
        extra = [c for c in (self.k_cache, self.v_cache) if c is not None]
        return extra + ([self.partial, self.arrivals] if self.partial is not None else [])

    def reads_own_writes(self):
        # k and v read the caches it stores the appends into, and at the appended position
        # (the only one it stores) take k_new / v_new instead of what was loaded there
        return ("k", "v") if self.k_cache is not None else ()

    def out_elements(self, out_shape):
        if self.writes_partials:
            return self.plan.split * self.b * self.h * self.lq * (self.dv + 1)
        return numel(out_shape)

    @property
    def writes_partials(self):
        return self.plan.split > 1 and self.partial is None


@dataclass(frozen=True)
class AttnCombine(Spec):
    """The `parts` key splits of one attention combined (weighted by their log-sum-exps), then
    the epilogue. `partial` is the attention's float32 buffer, read by address."""

    family = "attn_combine"
    partial: Expr
    parts: int
    b: int
    h: int
    lq: int
    dv: int

    def index_spaces(self, out_shape):
        return {"partial": None}

    def shape_problems(self, out_shape):
        problems = _bhld_problems(self, out_shape)
        have = numel(self.partial.buf.shape)
        need = self.parts * self.b * self.h * self.lq * (self.dv + 1)
        if have < need:
            problems.append(f"reads {need} partial elements from {self.partial.buf.name}, which "
                            f"holds {have}")
        return problems


@dataclass(frozen=True)
class ToExtent(Spec):
    """A tensor's value (`n.item()`) clamped to [lo, hi], stored as the value of `symbol` in the
    extents (the kernel's `out` is ir.EXTENTS)."""

    family = "to_extent"
    src: Expr
    symbol: sympy.Symbol
    lo: int
    hi: int

    def index_spaces(self, out_shape):
        return {"src": ()}


# ---- the registry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """What the stages need to know about a family besides its spec's fields."""

    spec: type[Spec]
    template: Callable        # codegen: (kernel, Writer) -> (grid, num_warps, num_stages)
    # fuse.py: a pointwise reader of its result may be folded into its store (fusable_producer),
    # and it may be such a reader itself (fusable_consumer)
    fusable_producer: bool = False
    fusable_consumer: bool = False
    # it writes part of a buffer: session state, or an arena buffer an earlier kernel wrote whole
    # (a value of its own it has not); the IR contract of partial writes is in aot/ir.py
    scatters: bool = False
    # it stores a size symbol's word of the extents table (data-dependent sizes): it always runs,
    # and the kernels that read the extents after it depend on it
    writes_extents: bool = False

    @property
    def name(self) -> str:
        return self.spec.family


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(Pointwise, codegen.pointwise, fusable_producer=True, fusable_consumer=True),
    Family(Reduction, codegen.reduction, fusable_producer=True),
    Family(Softmax, codegen.softmax, fusable_producer=True),
    Family(LayerNorm, codegen.layer_norm, fusable_producer=True),
    Family(Matmul, codegen.matmul, fusable_producer=True),
    Family(Attention, codegen.attention, fusable_producer=True),
    Family(AttnCombine, codegen.attn_combine, fusable_producer=True),
    Family(Scatter, codegen.scatter, scatters=True),
    Family(Compact, codegen.compact, writes_extents=True),
    Family(ToExtent, codegen.to_extent, writes_extents=True),
    Family(Argreduce, codegen.argreduce),
    Family(Scan, codegen.scan),
    Family(Sort, codegen.sort),
)}


def of(kernel: Kernel) -> Family:
    """The registry entry of a kernel's family."""
    try:
        return FAMILIES[kernel.family]
    except KeyError:
        raise KeyError(f"kernel family {kernel.family!r} ({type(kernel.spec).__name__}) is not in "
                       "the registry (aot/families.py FAMILIES)") from None


def in_place_problem(kernel: Kernel) -> str | None:
    """How `kernel` reads the buffer it writes where another of its programs may already have
    overwritten it, or None. A kernel may read its `out` only in its epilogue, at the element it
    is about to store (each program reads what it then overwrites, nothing another program
    writes): a pointwise update of session state in place, `n = n + x`. Never through its spec's
    operands (read across rows and tiles), nor when it scatters (it stores elsewhere than it
    computes). A buffer it writes besides `out` (Spec.extra_writes) it reads only through the
    fields its spec names (Spec.reads_own_writes)."""
    out = kernel.out
    for name, expr in kernel.spec.exprs():
        if any(load.buf is out for load in loads(expr)):
            return f"reads {out.name}, which it writes, through {name}"
    extra = {b.index: b for b in kernel.spec.extra_writes()}
    allowed = set(kernel.spec.reads_own_writes())
    for name, expr in [("epilogue", kernel.epilogue)] + kernel.spec.exprs():
        read = [ld.buf for ld in loads(expr) if ld.buf.index in extra]
        if read and name not in allowed:
            return f"reads {read[0].name}, which it also writes, through {name}"
    if not any(load.buf is out for load in loads(kernel.epilogue)):
        return None
    if of(kernel).scatters:
        return f"reads {out.name}, which it scatters into"
    epilogue = kernel.epilogue
    if identity_load(epilogue, kernel.out_shape, out) and only_ops_above(epilogue, out):
        return None
    return f"reads {out.name}, which it writes, at other elements than the ones it stores"
