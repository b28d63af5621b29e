"""The IR verifier: invariants checked at the stage boundaries (after lowering, fusion, the
memory plan and the graph's dependency edges), so that a stage that breaks the IR fails there,
naming the kernel and the buffer, instead of as a wrong number on a GPU three stages later.

What it checks (each problem is one line of the `IRVerifyError` it raises):

  * **loads stay inside their buffers**: every `Load` is evaluated over an index space (the
    kernel family's: a pointwise epilogue over `out_shape`, a GEMM's `a` over (batch, m, k), ...)
    that `Reindex`, `Reshape` and `Cat` nodes remap on the way down. Interval arithmetic over that
    space gives each load's lowest and highest element, which must lie in [0, numel) of its
    buffer; a load with a different number of strides than its index space has dimensions is
    wrong too. An index computed from data (a gather) is bounded where its value range follows
    from the expression (`check_index` against a constant size, `head // rep`, a bounded
    `Reindex`) and not checked where it does not: the checks are sound, not complete.
  * **dtypes agree**: a load has its buffer's dtype, a reindex/reshape its child's, the parts of
    a concatenation the concatenation's, comparisons are `bool`, index expressions integers, and a
    kernel's value is stored into a buffer of a dtype it can be (a float value into an integer
    buffer is a lowering bug: codegen's store would silently convert it).
  * **extents match shapes**: `ext` has one entry per dimension of `out_shape` and each entry's
    bucket factors multiply to that dimension's size (likewise `src_ext` against `src_shape`);
    a kernel's buffer holds exactly its index space (GEMM, attention and split partials by their
    own rule), and the family's sizes agree with its shapes.
  * **each buffer written once**: no buffer is the full output of two kernels; a scatter (which
    writes part of a buffer) targets session state or an arena buffer an earlier kernel wrote,
    every arena buffer is written before it is read, and every graph output is written; a kernel
    reads the buffer it writes only at the element it stores (families.in_place_problem); one
    index names one buffer (plans key buffers by Buffer.index).
  * **the memory plan** (after memplan): every arena buffer a kernel touches has a placement that
    covers its bytes and its whole live range, 256-aligned and inside the arena; weights and state
    have aligned, non-overlapping offsets inside their regions; live buffers never share bytes.
  * **the order** (after codegen, which makes the graph's edges): every kernel waits, directly or
    through others, for each earlier kernel that wrote a buffer it reads, and a kernel that writes
    a buffer (whole or in part) for each earlier kernel that read or wrote it. A partial write
    counts as a write of the whole buffer and defines none of it (aot/ir.py).

It is pure Python over the IR (no torch, no sympy arithmetic beyond reading extents), linear in
the size of the expressions (the order: in the number of uses of each buffer, squared, with the
kernels' ancestors as bit sets), and on in the tests (tests/conftest.py sets GRACE_VERIFY=1) and in
CI; `grace compile` runs it when GRACE_VERIFY=1 is set.
"""
from __future__ import annotations

import os

from .families import FAMILIES, in_place_problem
from .ir import (FLOATS, Buffer, Cat, Const, Expr, Index, Kernel, Load, Op, Reindex,
                 Reshape, SymValue, numel)

ENV = "GRACE_VERIFY"
MAX_LISTED = 20          # problems named in one error (the count says how many more)
INTEGERS = ("int64", "int32", "int16", "int8", "uint8", "bool")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "isnan")   # always bool
INT_ARITH = ("add", "sub", "mul", "floordiv", "maximum", "minimum", "neg")
PARTIALLY_WRITTEN = ("arena", "state")   # the kinds of buffer a scatter may write part of
ORDERED = ("arena", "state", "output")   # the kinds kernels write, so whose uses must be ordered


class IRVerifyError(AssertionError):
    """The IR broke an invariant: a bug of the compiler stage named in the message (an internal
    error, never the user's model)."""


def enabled() -> bool:
    """GRACE_VERIFY=1 (tests/conftest.py sets it for the whole suite)."""
    return os.environ.get(ENV, "").strip() not in ("", "0", "false", "no")


# ---- the index spaces of a kernel's expressions, per family -------------------------------------
def _roots(k: Kernel, say) -> list[tuple[str, Expr, tuple]]:
    """(name, expression, index space) for every expression of `k`: the epilogue over out_shape,
    and each expression of its spec over the space its template evaluates it over (the spec's
    `index_spaces`, aot/families.py). An expression the spec gives no space is reported."""
    roots = [("epilogue", k.epilogue, tuple(k.out_shape))]
    if k.family not in FAMILIES:
        say(f"family {k.family!r} ({type(k.spec).__name__}) is not in the registry "
            "(aot/families.py FAMILIES), so its loads would go unchecked")
        return roots
    spaces = k.spec.index_spaces(tuple(k.out_shape))
    for name, expr in k.spec.exprs():
        field = name.partition("[")[0]
        if field not in spaces:
            say(f"spec field {name!r} is an expression without an index space "
                f"({type(k.spec).__name__}.index_spaces, aot/families.py)")
        elif spaces[field] is not None:   # None: addressed by the template (checked by its sizes)
            roots.append((name, expr, tuple(spaces[field])))
    return roots


# ---- interval arithmetic over index spaces -------------------------------------------------------
def _full(shape) -> tuple | None:
    """The whole index space of `shape` as (lo, hi) per dim; None when it holds no element."""
    if any(s <= 0 for s in shape):
        return None
    return tuple((0, int(s) - 1) for s in shape)


def _index_uses(expr: Expr, budget: int = 256) -> dict | None:
    """How often each index dim occurs in `expr` counted along every path (a shared node counts
    once per parent), or None past `budget` occurrences of anything."""
    counts: dict[int, int] = {}
    stack, seen = [expr], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > budget:
            return None
        if isinstance(node, Index):
            counts[node.dim] = counts.get(node.dim, 0) + 1
        stack.extend(node.children())
    return counts


def _same_index(a: Expr, b: Expr) -> bool:
    return a is b or (isinstance(a, Index) and isinstance(b, Index) and a.dim == b.dim)


def _modulo(expr: Expr):
    """`a - (a // c) * c` (how lowering writes `a mod c`, e.g. a transposed convolution's output
    channel within its group): (a, c), else None."""
    if not (isinstance(expr, Op) and expr.op == "sub"):
        return None
    a, m = expr.args
    if not (isinstance(m, Op) and m.op == "mul"):
        return None
    for q, c in (m.args, m.args[::-1]):
        if (isinstance(q, Op) and q.op == "floordiv" and isinstance(c, Const)
                and isinstance(q.args[1], Const) and q.args[1].value == c.value
                and isinstance(c.value, int) and c.value > 0 and _same_index(q.args[0], a)):
            return a, c.value
    return None


def gather_range(expr: Expr, dom: tuple):
    """(lo, hi) of an index expression (a gather's map) over `dom`, or None when it does not
    follow from the expression alone. Interval arithmetic is exact only when every index dim
    occurs once (independent operands); an expression that uses one dim twice is bounded only
    in the shapes recognised here (`a mod c`), else left unchecked rather than over-estimated
    (`i - (i // 3) * 3` would look like [-3, 5])."""
    mod = _modulo(expr)
    if mod is not None:
        a, c = mod
        r = _value_range(a, dom)
        return (0, min(c - 1, r[1])) if r is not None and r[0] >= 0 else None
    uses = _index_uses(expr)
    if uses is None or any(n > 1 for n in uses.values()):
        return None
    return _value_range(expr, dom)


def _value_range(expr: Expr, dom: tuple):
    """(lo, hi) of an integer index expression over `dom` by interval arithmetic (a superset of
    the values; see gather_range for when it is exact), or None when it does not follow from the
    expression alone (a value read from memory)."""
    if isinstance(expr, Index):
        return dom[expr.dim] if expr.dim < len(dom) else None
    if isinstance(expr, Const):
        return (expr.value, expr.value) if isinstance(expr.value, int) else None
    if not isinstance(expr, Op):
        return None
    if expr.op == "check_index":   # clamped into [0, size) (a symbolic size: unknown here)
        size = expr.args[1]
        return (0, size.value - 1) if isinstance(size, Const) and isinstance(size.value, int) \
            and size.value > 0 else None
    if expr.op == "cast" and expr.dtype in INTEGERS and expr.args[0].dtype in INTEGERS:
        return _value_range(expr.args[0], dom)
    if expr.op == "where":
        a, b = _value_range(expr.args[1], dom), _value_range(expr.args[2], dom)
        return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
    if expr.op not in INT_ARITH:
        return None
    rs = [_value_range(a, dom) for a in expr.args]
    if any(r is None for r in rs):
        return None
    if expr.op == "neg":
        return (-rs[0][1], -rs[0][0])
    (a0, a1), (b0, b1) = rs
    if expr.op == "add":
        return (a0 + b0, a1 + b1)
    if expr.op == "sub":
        return (a0 - b1, a1 - b0)
    if expr.op == "mul":
        c = (a0 * b0, a0 * b1, a1 * b0, a1 * b1)
        return (min(c), max(c))
    if expr.op == "maximum":
        return (max(a0, b0), max(a1, b1))
    if expr.op == "minimum":
        return (min(a0, b0), min(a1, b1))
    if expr.op == "floordiv" and b0 == b1 and b0 > 0:
        return (a0 // b0, a1 // b0)
    return None


def _child_dom(node: Reindex, dom: tuple):
    """The child's index ranges under a Reindex (None per dim where they are not known); None
    for the whole when no child index is ever read (an empty padded range)."""
    out = []
    for d, m in enumerate(node.maps):
        if m.kind == "dim":
            r = dom[m.src] if m.src < len(dom) else None
            if r is not None:
                a, b = r[0] * m.step + m.start, r[1] * m.step + m.start
                r = (min(a, b), max(a, b))
        elif m.kind == "const":
            r = (m.start, m.start)
        else:
            r = gather_range(m.expr, dom)
        if node.bounds is not None:   # indices outside [0, bound) read the fill, not the child
            lo, hi = (0, node.bounds[d] - 1) if r is None else (max(r[0], 0), min(r[1], node.bounds[d] - 1))
            if lo > hi:
                return None
            r = (lo, hi)
        out.append(r)
    return tuple(out)


class _Checker:
    def __init__(self, problems: list, where: str):
        self.problems, self.where, self.seen = problems, where, set()

    def say(self, text: str) -> None:
        self.problems.append(f"{self.where}: {text}")

    def expr(self, node: Expr, dom: tuple | None, what: str) -> None:
        """Check `node` evaluated over `dom` ((lo, hi) | None per dim; None: nothing evaluated)."""
        if dom is None:
            return
        key = (id(node), dom)
        if key in self.seen:
            return
        self.seen.add(key)
        self.dtypes(node, what)
        if isinstance(node, Load):
            self.load(node, dom, what)
        elif isinstance(node, Reindex):
            if len(node.maps) and any(m.kind == "dim" and m.src >= len(dom) for m in node.maps):
                self.say(f"{what}: a reindex maps from index dim {max(m.src for m in node.maps)}, "
                         f"but it is evaluated over {len(dom)} dims")
                return
            for m in node.maps:
                if m.kind == "expr":
                    self.expr(m.expr, dom, what)
            self.expr(node.child, _child_dom(node, dom), what)
        elif isinstance(node, Reshape):
            if numel(node.child_shape) != numel(node.parent_shape):
                self.say(f"{what}: reshape {list(node.child_shape)} -> {list(node.parent_shape)} "
                         "changes the number of elements")
            elif len(dom) != len(node.parent_shape) or any(
                    r is not None and (r[0] < 0 or r[1] >= s) for r, s in zip(dom, node.parent_shape)):
                self.say(f"{what}: a reshape to {list(node.parent_shape)} is evaluated over "
                         f"{_dom_text(dom)}")
            else:
                self.expr(node.child, _full(node.child_shape), what)
        elif isinstance(node, Cat):
            r = dom[node.dim] if node.dim < len(dom) else None
            for part, start, size in zip(node.parts, node.starts, node.sizes):
                if r is None:
                    sub = (None,)
                else:
                    lo, hi = max(r[0], start), min(r[1], start + size - 1)
                    if lo > hi:
                        continue
                    sub = ((lo - start, hi - start),)
                self.expr(part, dom[:node.dim] + sub + dom[node.dim + 1:], what)
        else:
            for child in node.children():
                self.expr(child, dom, what)

    def load(self, node: Load, dom: tuple, what: str) -> None:
        buf = node.buf
        if len(node.strides) != len(dom):
            self.say(f"{what}: the load of {buf.name} has {len(node.strides)} strides but is "
                     f"evaluated over {len(dom)} index dims")
            return
        if buf.kind in ("extents", "errors") or any(r is None for r in dom) or not numel(buf.shape):
            return
        lo = hi = node.offset
        for (a, b), s in zip(dom, node.strides):
            lo += min(a * s, b * s)
            hi += max(a * s, b * s)
        size = numel(buf.shape)
        if lo < 0 or hi >= size:
            self.say(f"{what}: the load of {buf.name} ({buf.dtype}{list(buf.shape)}, {size} "
                     f"elements) reads elements [{lo}, {hi}] over {_dom_text(dom)} "
                     f"(offset {node.offset}, strides {list(node.strides)})")

    def dtypes(self, node: Expr, what: str) -> None:
        if isinstance(node, Load) and node.dtype != node.buf.dtype:
            self.say(f"{what}: a load of {node.buf.name} is {node.dtype}, but the buffer holds "
                     f"{node.buf.dtype}")
        elif isinstance(node, (Reindex, Reshape)) and node.dtype != node.child.dtype:
            self.say(f"{what}: a {type(node).__name__.lower()} is {node.dtype} over a "
                     f"{node.child.dtype} value")
        elif isinstance(node, Cat) and any(p.dtype != node.dtype for p in node.parts):
            self.say(f"{what}: a {node.dtype} concatenation of parts of dtypes "
                     f"{sorted({p.dtype for p in node.parts})}")
        elif isinstance(node, Op):
            if node.op in COMPARISONS and node.dtype != "bool":
                self.say(f"{what}: comparison {node.op} is {node.dtype}, not bool")
            if node.op == "check_index" and node.dtype != "int64":
                self.say(f"{what}: check_index is {node.dtype}, not int64")
        if isinstance(node, Reindex):
            for m in node.maps:
                if m.kind == "expr" and m.expr.dtype not in INTEGERS:
                    self.say(f"{what}: a gather index is {m.expr.dtype}")
        elif isinstance(node, (Index, SymValue)) and node.dtype not in INTEGERS + FLOATS:
            self.say(f"{what}: {type(node).__name__} of dtype {node.dtype}")


def _dom_text(dom: tuple) -> str:
    return "[" + ", ".join("?" if r is None else f"{r[0]}..{r[1]}" for r in dom) + "]"


def _ext_problem(ext, shape, what: str) -> str | None:
    """`ext` (extents.py) must have one entry per dim, and each entry's bucket factors
    must multiply to the dim's size."""
    if ext is None:
        return None
    if len(ext) != len(shape):
        return f"{what} has {len(ext)} entries for {len(shape)} dims {list(shape)}"
    for d, (entry, size) in enumerate(zip(ext, shape)):
        if entry is None:
            continue
        product = 1
        for bucket, _ in entry:
            product *= int(bucket)
        if product != size:
            return (f"{what}[{d}] has bucket factors {[int(b) for b, _ in entry]} (product "
                    f"{product}) for a dim of size {size}")
    return None


def _check_sizes(k: Kernel, say) -> None:
    """The family's own sizes against its shapes (the spec's rules, aot/families.py); the buffer
    against the index space."""
    spec, shape = k.spec, tuple(k.out_shape)
    for what, ext, over in [("ext", k.ext, shape)] + spec.extents():
        problem = _ext_problem(ext, over, what)
        if problem:
            say(problem)
    for problem in spec.shape_problems(shape):
        say(problem)
    if _scatters(k) or k.out.kind == "extents":
        return   # a scatter writes part of its target; to_extent writes a symbol's word
    want = spec.out_elements(shape)
    if numel(k.out.shape) != want:
        say(f"writes {want} elements over {list(shape)} into {k.out.name} "
            f"({k.out.dtype}{list(k.out.shape)}, {numel(k.out.shape)} elements)")


def _scatters(k: Kernel) -> bool:
    """It writes part of a buffer an earlier kernel wrote (an unregistered family does not:
    _roots reports it)."""
    family = FAMILIES.get(k.family)
    return family is not None and family.scatters


def _check_store_dtype(k: Kernel, say) -> None:
    """A kernel stores its value (the epilogue) converted to its buffer's dtype: a float value
    into an integer buffer, or a bool buffer from anything but a bool/integer value, would be a
    silent conversion codegen cannot flag."""
    value, out = k.epilogue.dtype, k.out.dtype
    if k.out.kind == "extents":
        return
    if out in INTEGERS and out != "bool" and value in FLOATS:
        say(f"stores a {value} value into {k.out.name}, a buffer of {out}")
    elif out == "bool" and value in FLOATS:
        say(f"stores a {value} value into {k.out.name}, a buffer of bool")


def check_kernels(kernels: list[Kernel], program=None, stage: str = "", bucket: str = "") -> None:
    """Check the kernels of one bucket (after lowering: `program.kernels`; after fusion: the fused
    list) against every invariant above but the memory plan's. `program` adds the graph-level
    checks (every output written). Raises IRVerifyError listing every problem found."""
    problems: list[str] = []
    full_writer: dict[int, int] = {}
    written: set[int] = set()
    for i, k in enumerate(kernels):
        where = f"kernel #{i} ({k.family} {k.label!r})"
        checker = _Checker(problems, where)
        if not isinstance(k.out, Buffer):
            checker.say(f"out is {type(k.out).__name__}, not a Buffer")
            continue
        if k.out.kind in ("input", "weight"):
            checker.say(f"writes {k.out.name}, a {k.out.kind} buffer")
        for b in k.reads():
            if b.kind == "arena" and b.index not in written and b.nbytes:
                checker.say(f"reads {b.name} before any kernel writes it")
        for name, expr, space in _roots(k, checker.say):
            checker.expr(expr, _full(space), name)
        _check_sizes(k, checker.say)
        _check_store_dtype(k, checker.say)
        in_place = in_place_problem(k) if k.family in FAMILIES else None
        if in_place:
            checker.say(f"{in_place} (another of its programs may have stored there already)")
        if _scatters(k):
            if k.out.kind not in PARTIALLY_WRITTEN:
                checker.say(f"scatters into the {k.out.kind} buffer {k.out.name} (a partial "
                            "write goes into session state or an arena buffer written whole "
                            "before)")
            elif k.out.kind == "arena" and k.out.index not in written:
                checker.say(f"scatters into {k.out.name}, which no earlier kernel wrote (the "
                            "elements it skips would be garbage)")
        # Spec.extra_writes: a kept sum (fuse_norm), a split-K matmul's own partial sums
        whole = [b for b in k.writes()[1:] if b.kind == "arena"]
        if not _scatters(k) and k.out.kind != "extents":
            whole.insert(0, k.out)
        for b in whole:
            first = full_writer.setdefault(b.index, i)
            if first != i:
                checker.say(f"writes {b.name}, which kernel #{first} already wrote whole (a "
                            "buffer has one writer, then scatters)")
        written.update(b.index for b in k.writes())
    if program is not None:
        for out in program.outputs:
            if out.index not in written and out.nbytes:
                problems.append(f"output {out.name} is written by no kernel")
    _check_indices(kernels, program, problems)
    _raise(problems, stage, bucket)


def _check_indices(kernels: list[Kernel], program, problems: list) -> None:
    """One index, one buffer: the memory plan and the manifest key buffers by Buffer.index, so
    two buffers of one program with the same index would be placed (and passed) as one."""
    bufs = [b for k in kernels if isinstance(k.out, Buffer) for b in k.writes() + k.reads()]
    if program is not None:
        bufs += program.inputs + program.outputs + program.weights + program.state
    by_index: dict[int, list[Buffer]] = {}
    for b in bufs:
        group = by_index.setdefault(b.index, [])
        if not any(other is b for other in group):
            group.append(b)
    for index, group in by_index.items():
        if len(group) > 1:
            problems.append(f"buffers {', '.join(b.name for b in group)} have the same index "
                            f"{index}")


def check_order(kernels: list[Kernel], deps: list[list[int]], stage: str = "codegen",
                bucket: str = "") -> None:
    """The graph's dependency edges (memplan.dependencies: deps[j], the kernels j waits for,
    transitively implied ones left out) against the order of the kernels' uses of each buffer:
    a kernel that reads a buffer runs after every earlier kernel that writes it, and a kernel
    that writes one after every earlier kernel that reads or writes it. A scatter counts as a
    write of its whole target, and defines none of it: its readers wait for it and for the whole
    write before it, and it waits for the readers of the value it changes. (That arena buffers
    reusing each other's bytes are ordered too is the edges' other job, not checked here.)"""
    problems: list[str] = []
    before: list[int] = []   # per kernel, bit i: kernel i is ordered before it
    for j, waits in enumerate(deps):
        mask = 0
        for i in waits:
            mask |= before[i] | (1 << i)
        before.append(mask)
    uses: dict[int, list[tuple[int, bool]]] = {}   # Buffer.index -> (kernel, writes), in order
    for j, k in enumerate(kernels):
        mine = [(b, False) for b in k.reads()] + [(b, True) for b in k.writes()]
        mine = [(b, w) for b, w in mine if b.kind in ORDERED and b.nbytes]   # empty: no hazard
        missing = {}
        for b, writes in mine:
            for i, wrote in uses.get(b.index, ()):
                if (writes or wrote) and not before[j] >> i & 1:
                    missing.setdefault((i, b.name), (writes, wrote))
        for (i, name), (writes, wrote) in missing.items():
            problems.append(f"kernel #{j} ({k.family} {k.label!r}) "
                            f"{'writes' if writes else 'reads'} {name} but does not wait for "
                            f"kernel #{i} ({kernels[i].family} {kernels[i].label!r}), which "
                            f"{'wrote' if wrote else 'read'} it before")
        for b, writes in mine:
            uses.setdefault(b.index, []).append((j, writes))
    _raise(problems, stage, bucket)


def check_plan(plan, kernels: list[Kernel], program=None, stage: str = "memplan",
               bucket: str = "") -> None:
    """The memory plan of one bucket (memplan.MemoryPlan) against its kernels: placements cover
    every arena buffer's bytes and live range, aligned, inside the arena, and disjoint while
    live; weights and state offsets aligned, in their regions and disjoint."""
    from .memplan import ALIGN

    problems: list[str] = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    bufs: dict[int, Buffer] = {}
    weights_read: dict[int, Buffer] = {}
    state_used: dict[int, Buffer] = {}
    for i, k in enumerate(kernels):
        for b in k.writes() + k.reads():
            if b.kind == "arena":
                bufs[b.index] = b
                first.setdefault(b.index, i)
                last[b.index] = i
            elif b.kind == "weight":
                weights_read[b.index] = b
            elif b.kind == "state":
                state_used[b.index] = b
    for key, b in bufs.items():
        p = plan.arena.get(key)
        if p is None:
            problems.append(f"arena buffer {b.name} has no placement")
            continue
        if p.buffer is not b:
            problems.append(f"the placement of {b.name} is for {p.buffer.name}")
        if p.nbytes < b.nbytes:
            problems.append(f"{b.name} needs {b.nbytes} bytes, its placement has {p.nbytes}")
        if p.nbytes and p.offset % ALIGN:
            problems.append(f"{b.name} is placed at {p.offset}, not a multiple of {ALIGN}")
        if p.offset + p.nbytes > plan.arena_nbytes:
            problems.append(f"{b.name} at [{p.offset}, {p.offset + p.nbytes}) exceeds the arena "
                            f"({plan.arena_nbytes} bytes)")
        if p.first > first[key] or p.last < last[key]:
            problems.append(f"{b.name} is used by kernels #{first[key]}..#{last[key]}, but placed "
                            f"live only for #{p.first}..#{p.last}")
    items = list(plan.arena.values())
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            lives = not (a.last < b.first or b.last < a.first)
            if lives and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                problems.append(f"{a.buffer.name} and {b.buffer.name} share bytes while both live")
    if program is not None:
        _check_region(problems, "weights", program.weights, plan.weights, plan.weights_nbytes, ALIGN)
        _check_region(problems, "state", program.state, plan.state or {}, plan.state_nbytes, ALIGN)
    for what, used, offsets in (("weight", weights_read, plan.weights),
                                ("state", state_used, plan.state or {})):
        for key, b in used.items():
            if key not in offsets:
                problems.append(f"{what} buffer {b.name} is read but has no offset")
    _raise(problems, stage, bucket)


def _check_region(problems, region, buffers, offsets, nbytes, align) -> None:
    spans = []
    for b in buffers:
        off = offsets.get(b.index)
        if off is None:
            problems.append(f"{region} buffer {b.name} has no offset")
            continue
        if off % align:
            problems.append(f"{region} buffer {b.name} is at {off}, not a multiple of {align}")
        if off + b.nbytes > nbytes:
            problems.append(f"{region} buffer {b.name} at [{off}, {off + b.nbytes}) exceeds the "
                            f"{region} region ({nbytes} bytes)")
        spans.append((off, off + b.nbytes, b.name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1 and a0 < a1 and b0 < b1:
            problems.append(f"{region} buffers {an} and {bn} overlap")


def _raise(problems: list, stage: str, bucket: str) -> None:
    if not problems:
        return
    where = " ".join(x for x in (f"after {stage}" if stage else "", f"in bucket {bucket}"
                                 if bucket else "") if x)
    shown = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    # "internal: ..." — the CLI shows a compiler bug with its traceback, not as a user error
    raise IRVerifyError(f"internal: IR verifier{' ' + where if where else ''}: {len(problems)} "
                        "problem(s) (a compiler bug, not the model's):\n  " + "\n  ".join(shown)
                        + more)
