"""Stage `lower` (compiler.PIPELINE): core-ATen FX graph → kernel IR.

One handler per ATen op (see `lower_ops.py`). Pointwise ops and views produce lazy expressions
(`views.TV`); ops that need memory — reductions, GEMMs, attention, graph outputs, values read by
several consumers — emit a `Kernel` that writes an arena buffer. An op without a handler is a
compile error that names the op and the line of the user's model it came from.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from . import extents, families, linear_groups, views
from .families import Pointwise
from .ir import (Buffer, Const, Expr, Kernel, Load, Op, Program, SymValue,
                 contiguous_strides, expr_size, is_cheap, loads, numel, walk)
from .ops import COSTLY
from .extents import SymSize, sym_expr
from .views import TV

HANDLERS: dict[Any, Callable] = {}
CHECKS_PER_NODE = 64   # index checks per op (one per index tensor, at most the rank): see check_index
# see compiler.CompileOptions; sm_count: the multiprocessors the tile plans fill (H100/H200)
DEFAULT_OPTIONS = {"fp32_matmul": "tf32x3", "sm_count": 132}


class LoweringError(ValueError):
    pass


def handles(*ops):
    def register(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return register


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                    "uint8", "bool"):
        raise LoweringError(f"dtype {dtype} is not supported")
    return name


def source_line(node: torch.fx.Node) -> str:
    """The user's innermost source line for a node, from torch.export's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return "(no source location recorded)"
    i = frames[-1]
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return f"{lines[i]}: {code}".rstrip(": ")


def user_line(node: torch.fx.Node) -> str:
    """`file.py:LINE: code` of the innermost frame of a node's stack trace that is not inside torch
    (for nn.Embedding, the model's `self.emb(ids)`, not torch's F.embedding call), for messages a
    user reads at run time; "" when no location was recorded."""
    import os
    import re
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    found = innermost = ""
    for i, ln in enumerate(lines):
        m = re.match(r'File "(.*)", line (\d+)', ln)
        if not m:
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
        here = f"{os.path.basename(m.group(1))}:{m.group(2)}" + (f": {code}" if code else "")
        innermost = here
        if not m.group(1).startswith(torch_dir):
            found = here
    return found or innermost   # only torch frames: the innermost of them


class Lowering:
    """Walks the graph once; holds the kernels emitted so far.

    `bucket` maps each input symbol (sympy) to its bound in the graph being lowered; the
    lowering is then that of a static program at those sizes, plus extents (extents.py) that tell
    every kernel which elements are real."""

    def __init__(self, program: ExportedProgram, name: str, options: dict | None = None,
                 bucket: dict | None = None, output_names: list[str] | None = None):
        self.program = program
        self.name = name
        # the package's output names, one per user output (compiler.program_output_names);
        # None: out, or out0, out1, ...
        self.output_names = output_names
        self.options = {**DEFAULT_OPTIONS, **(options or {})}
        self.bucket = dict(bucket or {})
        # sizes computed on the device (nonzero, .item()): every symbol that is not an input's
        self.data_symbols = set(program.range_constraints) - set(self.bucket)
        # input symbols with one possible value in this bucket (its bound is the range's minimum)
        self.pinned = {sym for sym, bound in self.bucket.items()
                       if sym in program.range_constraints
                       and int(program.range_constraints[sym].lower) >= bound}
        self.item_kernels: dict = {}     # data symbol -> where in `kernels` it is written (.item())
        self.dynamic = bool(program.range_constraints)
        self.kernels: list[Kernel] = []
        self.inputs: list[Buffer] = []
        self.outputs: list[Buffer] = []
        self.weights: list[Buffer] = []
        self.weight_data: dict[str, torch.Tensor] = {}
        self._weight_of: dict[tuple, Buffer] = {}   # storage view -> its weight (tied weights)
        # session state: the buffers the program mutates (KV caches, counters), by buffer name
        sig = program.graph_signature
        self.mutated = set(sig.buffers_to_mutate.values())
        self.state: list[Buffer] = []
        self.state_data: dict[str, torch.Tensor] = {}
        # (input name, size of the state dimension it indexes): how many positions a cache holds
        self.state_index_sizes: list[tuple[str, int]] = []
        # one entry per gather index (check_index): what an error code stored by a kernel means
        self.index_checks: list[dict] = []
        self._node_pos: dict | None = None   # FX node -> its position (check codes)
        self.env: dict[torch.fx.Node, Any] = {}
        # id(expr) -> (expr, node name): the FX node whose op computed each node's value (views
        # pass their input's on), so a kernel that realises a value is labelled by what it
        # computes, not by the consumer that needed it in memory (`label_of`)
        self._origin: dict[int, tuple] = {}
        self._count = 0   # the buffers made so far: the last one's Buffer.index
        self.node: torch.fx.Node | None = None
        self.folded: dict = {}
        self.sizes: dict = {}
        # nodes whose effect an earlier handler already applied (a batch norm folded into the
        # convolution before it): their handler passes the input through
        self.absorbed: set = set()
        # results a handler computed for later nodes (sibling linear layers fused into one GEMM)
        self.precomputed: dict = {}
        self._placeholders_of: dict | None = None   # weight buffer -> placeholders naming it

    # ---- sizes at this bucket -----------------------------------------------------------------
    def size_of(self, size) -> int:
        """A size from node metadata (int or SymInt) at this bucket's bounds."""
        expr = sym_expr(size)
        return int(size) if expr is None else extents.evaluate(expr, self.bucket)

    def entry_of(self, size):
        """The extent of one dimension from node metadata: None (static) or one factor."""
        expr = self.dynamic_expr(size)
        return None if expr is None else extents.simple(extents.evaluate(expr, self.bucket), expr)

    def dynamic_expr(self, size):
        """A size's symbolic expression, or None where it is static in this bucket: its symbols
        are all pinned (a bucket of 1 for a range from 1 holds one size, so it is lowered as a
        static program; with extents at bound 1 a size-1 dimension would look broadcastable)."""
        expr = sym_expr(size)
        return None if expr is None or expr.free_symbols <= self.pinned else expr

    def out_meta(self, node):
        """A node's result shape at this bucket, and its dtype."""
        val = node.meta["val"]
        return tuple(self.size_of(s) for s in val.shape), dtype_name(val.dtype)

    def out_ext(self, node):
        return tuple(self.entry_of(s) for s in node.meta["val"].shape)

    # ---- buffers and kernels ----------------------------------------------------------------
    def new_buffer(self, shape, dtype: str, kind: str = "arena", name: str | None = None,
                   dynamic: tuple = ()) -> Buffer:
        self._count += 1
        return Buffer(name or f"buf{self._count}", kind, dtype, tuple(int(s) for s in shape),
                      self._count, dynamic)

    def emit(self, kernel: Kernel, value: bool = True) -> TV:
        """Append the kernel; return its result as a value, unless it is none (a scatter writes
        part of an existing buffer; `value=False`: scratch whose layout only its reader knows)."""
        if not kernel.label and self.node is not None:
            kernel = dataclasses.replace(kernel, label=self.node.name)
        self.kernels.append(kernel)
        if families.of(kernel).scatters or not value:
            return None
        ext = kernel.ext
        if ext is not None and tuple(kernel.out.shape) != tuple(kernel.out_shape):
            ext = extents.regroup(kernel.out_shape, ext, kernel.out.shape)
        return views.contiguous_load(kernel.out, ext)

    def replace_kernel(self, at: int, kernel: Kernel) -> None:
        """Put `kernel` in place of the kernel emitted at position `at`, which writes the same
        buffer (a later node told more about it: a slice bounds an `.item()` size, so its clamp
        tightens). The emitted kernel itself is never changed: kernels are frozen."""
        old = self.kernels[at]
        if kernel.out is not old.out or kernel.family != old.family:
            raise AssertionError(f"internal: kernel #{at} ({old!r}) replaced by {kernel!r}")
        self.kernels[at] = kernel

    def realize(self, tv: TV, into: Buffer | None = None) -> TV:
        """Make `tv` live in memory (contiguous). A value that already is a whole buffer is free."""
        expr = tv.expr
        if (into is None and isinstance(expr, Load) and expr.offset == 0 and not expr.buf.dynamic
                and expr.strides == contiguous_strides(tv.shape) and expr.buf.shape == tv.shape):
            return tv
        out = into or self.new_buffer(tv.shape, tv.dtype)
        return self.emit(Kernel(Pointwise(), out, tv.shape, tv.expr, ext=tv.ext,
                                label=self.label_of(tv.expr)))

    def note_origin(self, node, value) -> None:
        """Record that `node` computed `value` (a view or copy passes on its input's origin)."""
        if not isinstance(value, TV) or id(value.expr) in self._origin:
            return
        name = node.name
        if _packet_name(node) in _VIEW_OPS:
            src = next((self._origin.get(id(v.expr)) for n in node.all_input_nodes
                        if isinstance(v := self.env.get(n), TV)), None)
            if src is not None and src[1]:
                name = src[1]
        self._origin[id(value.expr)] = (value.expr, name)

    def label_of(self, expr) -> str:
        """The kernel label of a realised value: the node that computed it, else the nodes whose
        values its expression reads (the outermost ones, first three in expression order), else the
        input of the node being lowered that it is a view of, else "" (emit then names the node
        being lowered)."""
        hit = self._origin.get(id(expr))
        if hit is not None and hit[0] is expr:
            return hit[1]
        names, seen, stack = [], set(), [expr]
        while stack and len(names) < 3:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            hit = self._origin.get(id(e))
            if hit is not None and hit[0] is e:
                if hit[1] not in names:
                    names.append(hit[1])
                continue
            stack.extend(reversed(e.children()))
        if names:
            return "+".join(names)
        # a view the handler rebuilt (its ops are new objects): the input of the node being
        # lowered whose value reads every buffer it reads
        if self.node is not None:
            bufs = {load.buf.index for load in loads(expr)}
            for n in self.node.all_input_nodes:
                v = self.env.get(n)
                hit = self._origin.get(id(v.expr)) if isinstance(v, TV) else None
                if (hit is not None and hit[0] is v.expr
                        and bufs <= {load.buf.index for load in loads(v.expr)}):
                    return hit[1]
        return ""

    def operand(self, tv: TV, row: bool = False) -> TV:
        """A GEMM/attention operand: recomputing it per tile must stay cheap, else realize it.
        `row`: a handful of rows (the single row of a GEMV, a decode step's queries), which
        every program recomputes for only those elements next to the weights or keys it
        streams, so a norm's rsqrt or a rotary embedding is cheap there and a kernel boundary
        is not (ir.is_cheap)."""
        return tv if is_cheap(tv.expr, row=row) else self.realize(tv)

    # ---- the walk ----------------------------------------------------------------------------
    def run(self) -> Program:
        sig = self.program.graph_signature
        if sig.user_inputs_to_mutate:
            raise LoweringError(
                "the program mutates its inputs "
                f"({', '.join(sorted(sig.user_inputs_to_mutate.values()))}); return the new value "
                "instead, or keep it in a registered buffer (session state)")
        state = dict(self.program.state_dict)
        state.update(self.program.constants)
        specs = {spec.arg.name: spec for spec in sig.input_specs}
        graph = self.program.graph_module.graph
        self.folded = fold_constants(graph, specs, state)
        folded = self.folded
        for node in graph.nodes:
            self.node = node
            if node in folded:
                self.env[node] = self.constant(node, folded[node])
            elif node.op == "placeholder":
                self.env[node] = self.placeholder(node, specs[node.name], state)
            elif node.op == "call_function" and _is_size_arithmetic(node):
                val = node.meta["val"]
                self.env[node] = (SymSize(self.size_of(val), val.node.expr)
                                  if isinstance(val, torch.SymInt) else None)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                self.output(node, sig)
        self._drop_unread_weights()
        return Program(self.kernels, self.inputs, self.outputs, self.weights, self.weight_data,
                       self.name, self.sizes, dict(self.bucket), self.state, self.state_data,
                       list(self.state_index_sizes), list(self.index_checks), self._count + 1)

    def data_symbol(self, node, bound: int):
        """Declare the unbacked symbol of `node`'s result (a size a kernel computes on the
        device), with its bound in this bucket."""
        val = node.meta["val"]
        sizes = [val] if isinstance(val, torch.SymInt) else list(val.shape)
        for size in sizes:
            expr = sym_expr(size)
            if expr is not None and expr.is_Symbol and expr in self.data_symbols:
                # torch reuses the symbol when it proves two sizes equal (the same mask used
                # twice): the second kernel writes the same value again
                self.bucket[expr] = min(self.bucket.get(expr, int(bound)), int(bound))
                return expr
        raise LoweringError("internal: no data-dependent size in this node's result")

    def placeholder(self, node, spec, state) -> TV:
        val = node.meta.get("val")
        if spec.kind == InputKind.USER_INPUT:
            if not isinstance(val, torch.Tensor):
                raise LoweringError(f"input '{node.name}' is not a tensor ({type(val).__name__}); "
                                    "only tensor inputs are supported")
            ext = tuple(self.entry_of(d) for d in val.shape)
            buf = self.new_buffer([self.size_of(d) for d in val.shape], dtype_name(val.dtype), "input",
                                  node.name, tuple(e is not None for e in ext) if any(ext) else ())
            self.sizes[buf.name] = tuple(val.shape)
            self.inputs.append(buf)
            return views.contiguous_load(buf, ext)
        if spec.kind == InputKind.BUFFER and spec.target in self.mutated:
            tensor = state[spec.target].detach()
            buf = self.new_buffer(tensor.shape, dtype_name(tensor.dtype), "state", spec.target)
            self.state.append(buf)
            self.state_data[buf.name] = tensor.contiguous().cpu()
            return views.contiguous_load(buf)
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            return self.weight(spec.target, state[spec.target].detach())
        raise LoweringError(f"input '{node.name}' of kind {spec.kind.name} is not supported")

    def weight(self, name: str, tensor: torch.Tensor) -> TV:
        """A parameter or buffer, stored once per storage. Tied weights (an LM head sharing the
        embedding table: one tensor under two names, or two parameters of one storage and view)
        get one buffer, so the package stores and uploads the bytes once. Different views of one
        storage (a parameter that is a slice or transpose of another) read one buffer, the span
        of the storage they cover, through their offset and strides (`_storage_hosts`)."""
        key = _weight_key(tensor)
        buf = self._weight_of.get(key) if key is not None else None
        if buf is not None:
            return views.contiguous_load(buf)
        host = self._storage_hosts().get(key[:3]) if key is not None else None
        if (host is not None and host["lo"] <= tensor.storage_offset()
                and _span_end(tensor) <= host["hi"]):
            return self._host_view(host, tensor)
        buf = self.new_buffer(tensor.shape, dtype_name(tensor.dtype), "weight", name)
        self.weights.append(buf)
        self.weight_data[buf.name] = tensor.contiguous().cpu()
        if key is not None:
            self._weight_of[key] = buf
        return views.contiguous_load(buf)

    def _storage_hosts(self) -> dict:
        """Storages that the program's weights view in more than one way: (device, storage,
        dtype) -> {lo, hi: the element span they cover; host: the name and tensor of the weight
        that is exactly that span, contiguous, or None (the span is stored as a 1-D weight);
        buf: its buffer, made on first use}. Computed once per lowering, from every weight
        placeholder that something reads."""
        hosts = getattr(self, "_hosts", None)
        if hosts is not None:
            return hosts
        sig = self.program.graph_signature
        state = {**self.program.state_dict, **self.program.constants}
        used = {n.name for n in self.program.graph_module.graph.nodes
                if n.op == "placeholder" and n.users and n not in self.folded}
        groups: dict = {}
        for spec in sig.input_specs:
            if (spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER)
                    or spec.target in self.mutated or spec.arg.name not in used):
                continue
            tensor = state[spec.target].detach()
            key = _weight_key(tensor)
            if key is not None:
                views_of = groups.setdefault(key[:3], {})
                views_of.setdefault(key, (spec.target, tensor))
        hosts = {}
        order = {name: i for i, name in enumerate(state)}   # the module's own order
        for skey, views_of in groups.items():
            if len(views_of) < 2:
                continue   # one view (however many names): the plain path shares its buffer
            members = sorted(views_of.values(), key=lambda m: order.get(m[0], len(order)))
            lo = min(t.storage_offset() for _, t in members)
            hi = max(_span_end(t) for _, t in members)
            host = next(((nm, t) for nm, t in members if t.is_contiguous()
                         and t.storage_offset() == lo and t.numel() == hi - lo), None)
            hosts[skey] = {"lo": lo, "hi": hi, "host": host, "first": members[0], "buf": None}
        self._hosts = hosts
        return hosts

    def _host_view(self, host: dict, tensor: torch.Tensor) -> TV:
        """`tensor` read from the buffer of its storage's span, at its offset and strides."""
        if host["buf"] is None:
            if host["host"] is not None:
                name, data = host["host"]
            else:
                first_name, first = host["first"]
                name = f"{first_name}.storage"
                taken = {b.name for b in self.weights}
                n = 2
                while name in taken:
                    name, n = f"{first_name}.storage{n}", n + 1
                data = torch.as_strided(first, (host["hi"] - host["lo"],), (1,), host["lo"])
            buf = self.new_buffer(data.shape, dtype_name(data.dtype), "weight", name)
            self.weights.append(buf)
            self.weight_data[buf.name] = data.contiguous().cpu()
            host["buf"] = buf
        buf = host["buf"]
        return TV(Load(buf, tensor.storage_offset() - host["lo"], tuple(tensor.stride())),
                  tensor.shape)

    def constant(self, node, value):
        """A value computed at compile time (masks, position ids): stored like a weight."""
        if not isinstance(value, torch.Tensor):
            return value
        if all(u in self.folded for u in node.users):
            return None   # only read by other folded nodes
        buf = self.new_buffer(value.shape, dtype_name(value.dtype), "weight", f"const.{node.name}")
        self.weights.append(buf)
        self.weight_data[buf.name] = value.detach().contiguous().cpu()
        return views.contiguous_load(buf)

    def derived_weight(self, name: str, tensor: torch.Tensor) -> TV:
        """A weight computed at compile time from other weights (batch norm folded into a
        convolution, its scale and shift)."""
        buf = self.new_buffer(tensor.shape, dtype_name(tensor.dtype), "weight", name)
        self.weights.append(buf)
        self.weight_data[buf.name] = tensor.detach().contiguous().cpu()
        return views.contiguous_load(buf)

    def is_weight_node(self, node) -> bool:
        """A placeholder that is a weight of its own: not tied to another placeholder's, and
        the whole of its buffer in order (not a view into a storage that others share)."""
        tv = self.env.get(node) if node.op == "placeholder" else None
        if not (isinstance(tv, TV) and isinstance(tv.expr, Load) and tv.expr.buf.kind == "weight"):
            return False
        ld = tv.expr
        if (ld.offset != 0 or tuple(ld.buf.shape) != tuple(tv.shape)
                or tuple(ld.strides) != tuple(contiguous_strides(tv.shape))):
            return False
        if self._placeholders_of is None:   # placeholders precede every call in the graph
            self._placeholders_of = {}
            for n, v in self.env.items():
                if n.op == "placeholder" and isinstance(v, TV) and isinstance(v.expr, Load):
                    key = v.expr.buf.index
                    self._placeholders_of[key] = self._placeholders_of.get(key, 0) + 1
        return self._placeholders_of.get(tv.expr.buf.index) == 1

    def weight_tensor(self, node) -> torch.Tensor:
        return self.weight_data[self.env[node].expr.buf.name]

    def _drop_unread_weights(self) -> None:
        """Weights no kernel reads (a convolution's weights once a batch norm is folded into a
        copy of them) are not stored in the package."""
        read = {buf.index for kernel in self.kernels for buf in kernel.reads()}
        unread = [b for b in self.weights if b.index not in read]
        for buf in unread:
            self.weights.remove(buf)
            self.weight_data.pop(buf.name, None)

    def call(self, node):
        handler = HANDLERS.get(node.target)
        if handler is None:
            raise LoweringError(
                f"cannot lower {node.target} (node '{node.name}'), used at {source_line(node)}")
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        try:
            value = handler(self, node, *args, **kwargs)
            if self.dynamic:
                value = self.with_extents(node, value)
        except (LoweringError, extents.ShapeError) as exc:
            if "used at" in str(exc):
                raise
            raise LoweringError(f"{exc} — in {node.target} (node '{node.name}'), used at "
                                f"{source_line(node)}") from exc
        self.note_origin(node, value)
        if (isinstance(value, TV) and len(node.users) > 1 and _worth_sharing(value)
                and not linear_groups.feeds_one_group(node, self.is_weight_node)):
            value = self.store(value)
        elif isinstance(value, TV) and expr_size(value.expr) > 160:
            value = self.store(value)
        self.note_origin(node, value)   # the stored copy too
        return value

    def store(self, tv: TV) -> TV:
        """Put an intermediate value in memory, in the layout it is computed in: a feature map
        computed channels-last (a convolution's GEMM writes [N·H·W, C]) is stored channels-last
        and read back through a permuted view, so neither the kernel that stores it nor the
        convolutions that read it walk memory across the grain."""
        perm = _channels_last_order(tv)
        if perm is None:
            return self.realize(tv)
        inverse = [perm.index(d) for d in range(len(perm))]
        return views.permute(self.realize(views.permute(tv, perm)), inverse)

    def with_extents(self, node, value):
        """Give a handler's result its extents. Views carry them along; a fresh value (pointwise
        op, gather, kernel result) takes each dynamic dimension from an input dimension of the
        same true size (keeping its factors, e.g. a merged [B*S]) or else as one factor."""
        val = node.meta.get("val")
        if isinstance(value, (tuple, list)):
            vals = val if isinstance(val, (tuple, list)) else [None] * len(value)
            return type(value)(self._one_extents(node, v, m) for v, m in zip(value, vals))
        return self._one_extents(node, value, val)

    def _one_extents(self, node, value, val):
        if not isinstance(value, TV) or not isinstance(val, torch.Tensor):
            return value
        metas = [self.dynamic_expr(d) for d in val.shape]
        if value.ext is None and all(m is None for m in metas):
            return value
        known, conflicts = {}, set()
        for arg in node.all_input_nodes:
            tv = self.env.get(arg)
            for t in (tv if isinstance(tv, (tuple, list)) else [tv]):
                if isinstance(t, TV):
                    for e in t.exts():
                        if e is not None:
                            size = extents.true_size(e, 0)
                            if known.setdefault(size, e) != e:
                                conflicts.add(size)
        if value.ext is None:
            if any(m in conflicts for m in metas):
                raise LoweringError(
                    "this op combines tensors whose dimensions of the same dynamic size are laid "
                    "out differently (one merges several dynamic dimensions by a reshape, the "
                    "other does not); reshape after the op instead")
            ext = [None if m is None else known.get(m) or extents.simple(self.size_of(d), m)
                   for m, d in zip(metas, val.shape)]
            return TV(value.expr, value.shape, ext)
        for d, (m, e) in enumerate(zip(metas, value.exts())):
            true = extents.true_size(e, value.shape[d]) if e is not None else None
            if (m is None) != (e is None) or (m is not None and sympy.expand(true - m) != 0):
                raise LoweringError(f"internal: extents of dim {d} are {e}, torch says {m}")
        return value

    def output(self, node, sig):
        """User outputs first, then the new values of mutated buffers: a user output may still
        read a buffer's old value, so the state is written last (after every such reader)."""
        values = node.args[0]
        user_outputs = [spec for spec in sig.output_specs if spec.kind == OutputKind.USER_OUTPUT]
        names = self.output_names or (["out"] if len(user_outputs) == 1 else
                                      [f"out{i}" for i in range(len(user_outputs))])
        if len(names) != len(user_outputs):
            raise AssertionError(f"internal: {len(names)} output names for {len(user_outputs)} "
                                 "outputs")
        mutations = []
        for i, (value, spec) in enumerate(zip(values, sig.output_specs)):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                mutations.append((value, spec))
                continue
            if spec.kind != OutputKind.USER_OUTPUT:
                continue
            tv = self.env.get(value) if isinstance(value, torch.fx.Node) else None
            if not isinstance(tv, TV):
                raise LoweringError(f"output {i} is not a tensor; only tensor outputs are supported")
            dynamic = tuple(e is not None for e in tv.ext) if tv.ext is not None else ()
            buf = self.new_buffer(tv.shape, tv.dtype, "output", names[len(self.outputs)], dynamic)
            if buf.dynamic and any(len(e) > 1 for e in tv.ext if e is not None):
                raise LoweringError(f"output {i} has a merged dynamic dimension; return it with "
                                    "each dynamic dimension separate")
            if any(e is not None and extents.true_size(e, 0).free_symbols & self.data_symbols
                   for e in tv.exts()[1:]):
                raise LoweringError(f"output {i} has a data-dependent size in a dimension other "
                                    "than the first; the host could not know its strides")
            self.sizes[buf.name] = tuple(value.meta["val"].shape)
            self.outputs.append(buf)
            self.node = value
            self.realize(tv, into=buf)
        self.write_states([(value, self.state_buffer(spec.target), self.env.get(value))
                           for value, spec in mutations])

    # ---- index checks (format 3.3) ------------------------------------------------------------
    def check_index(self, node, index: Expr, source: Expr, size: Expr, size_value) -> Expr:
        """`index` (already wrapped: torch's negative indices) clamped into [0, size): a gather
        never reads outside its table. The kernel that evaluates it stores this check's code into
        the table's error word when the index was out of range, and the runtime reports it, naming
        the user input the index values came from (`source`'s input Load; None when computed in the
        model), the op and the source line. `size_value`: int, or a sympy size expression.

        The code comes from the node's position in the graph (and the check's ordinal within the
        node: x[i, j] has two), not from a counter: every bucket is lowered from the same graph, so
        a check has the same code in every bucket even when a bucket lowers some op differently
        (kernels are shared between buckets, and one manifest lists the codes)."""
        if self._node_pos is None:
            self._node_pos = {n: i for i, n in enumerate(self.program.graph_module.graph.nodes)}
        base = self._node_pos[node] * CHECKS_PER_NODE
        ordinal = sum(1 for c in self.index_checks if base < c["code"] <= base + CHECKS_PER_NODE)
        if ordinal >= CHECKS_PER_NODE:
            raise LoweringError(f"more than {CHECKS_PER_NODE} index tensors in one op")
        code = base + ordinal + 1
        if not isinstance(size_value, int) and sympy.sympify(size_value).is_number:
            size_value = int(size_value)
        inputs = [ld.buf.name for ld in loads(source) if ld.buf.kind == "input"]
        op = getattr(node.target, "_overloadpacket", node.target)
        self.index_checks.append({"code": code, "input": inputs[0] if inputs else None,
                                  "op": str(op), "where": user_line(node), "size": size_value})
        return Op("check_index", [index, size], "int64", param=code)

    # ---- session state -----------------------------------------------------------------------
    def state_buffer(self, name: str) -> Buffer:
        for buf in self.state:
            if buf.name == name:
                return buf
        raise LoweringError(f"internal: no state buffer {name!r}")

    def write_states(self, updates) -> None:
        """Store the new values of the mutated buffers ((FX node, buffer, value) each), one after
        the other. A value that reads the old value of a buffer an earlier update overwrites (two
        states exchanging values) is put into the arena before the first update stores anything,
        so it reads what the program read."""
        values, overwritten = [], set()
        for node, buf, tv in updates:
            self.node = node
            if isinstance(tv, TV) and any(load.buf.index in overwritten for load in loads(tv.expr)):
                tv = self.realize(tv, into=self.new_buffer(tv.shape, tv.dtype))
            values.append(tv)
            if not _is_whole(tv, buf):   # stored (an in-place update stored nothing)
                overwritten.add(buf.index)
        for (node, buf, _), tv in zip(updates, values):
            self.node = node
            self.write_state(buf, tv)

    def write_state(self, buf: Buffer, tv) -> None:
        """The new value of a mutated buffer. An in-place update (a scatter into the buffer)
        already left it there; anything else is stored at the end of the program. A value that
        reads the buffer itself goes through the arena first (no kernel reads what it overwrites)."""
        if not isinstance(tv, TV):
            raise LoweringError(f"the new value of buffer {buf.name!r} is not a tensor")
        if tv.shape != buf.shape or tv.ext is not None:
            raise LoweringError(f"buffer {buf.name!r} {list(buf.shape)} is assigned a value of "
                                f"shape {list(tv.shape)}; session state has a static shape")
        expr = tv.expr
        if _is_whole(tv, buf):
            return   # updated in place
        if any(load.buf is buf for load in loads(expr)):
            tv = self.realize(tv, into=self.new_buffer(tv.shape, tv.dtype))
        if tv.dtype != buf.dtype:
            tv = TV(Op("cast", [tv.expr], buf.dtype), tv.shape)
        self.emit(Kernel(Pointwise(), buf, buf.shape, tv.expr, label=f"state {buf.name}"))

    def in_place_target(self, node, arg_index: int = 0) -> Buffer | None:
        """The state buffer that `node` may update in place: its argument is the buffer's
        placeholder itself and nothing else reads the old value."""
        arg = node.args[arg_index]
        if not isinstance(arg, torch.fx.Node) or arg.op != "placeholder" or len(arg.users) != 1:
            return None
        tv = self.env.get(arg)
        if isinstance(tv, TV) and isinstance(tv.expr, Load) and tv.expr.buf.kind == "state":
            return tv.expr.buf
        return None


def _is_whole(tv, buf: Buffer) -> bool:
    """`tv` is `buf` itself, as it is in memory (a state updated in place is its own new value)."""
    expr = tv.expr if isinstance(tv, TV) else None
    return (isinstance(expr, Load) and expr.buf is buf and expr.offset == 0
            and expr.strides == contiguous_strides(buf.shape))


def _weight_key(tensor: torch.Tensor):
    """(device, storage, dtype, offset, shape, strides) of a weight: equal keys are one tensor's
    bytes under two names. None for a tensor without real storage to compare (empty, meta)."""
    if tensor.numel() == 0 or tensor.device.type == "meta" or tensor.layout != torch.strided:
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (tensor.device.type, ptr, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()))


def _span_end(tensor: torch.Tensor) -> int:
    """One past the last storage element a (non-empty) tensor view reads."""
    extent = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
    return tensor.storage_offset() + extent + 1


# ops that compute nothing: their value's origin is their input's (`Lowering.note_origin`)
_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
                       "expand_as", "slice", "select", "unsqueeze", "squeeze", "alias", "clone",
                       "contiguous", "detach", "view_as", "as_strided", "unflatten", "flatten"})


def _packet_name(node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else ""


def _is_size_arithmetic(node) -> bool:
    """Arithmetic on sizes (sym_size, s0 * 64, u0 >= 0): evaluated from node metadata, not lowered.
    `.item()` is the exception: it turns a tensor value into a size, on the device."""
    val = node.meta.get("val")
    return (isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat))
            and node.target is not torch.ops.aten._local_scalar_dense.default)


NOT_FOLDABLE = {torch.ops.aten.rand.default, torch.ops.aten.randn.default,
                torch.ops.aten.bernoulli.default, torch.ops.aten.native_dropout.default}


def fold_constants(graph, specs, state) -> dict:
    """Evaluate, with torch at compile time, every node that depends on no user input and no
    parameter: attention masks built from shapes, position ids, constant tables. Parameters stay
    out so that views of large weights are not duplicated. A node torch cannot run eagerly (a
    RuntimeError or TypeError from the op) is left unfolded; nothing else is swallowed."""
    values: dict = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.CONSTANT_TENSOR:
                values[node] = state[spec.target]
            continue
        if node.op != "call_function" or node.target in NOT_FOLDABLE:
            continue
        inputs = node.all_input_nodes
        if not all(n in values for n in inputs):
            continue
        if not inputs and not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: values[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n])
        try:
            with torch.no_grad():
                values[node] = node.target(*args, **kwargs)
        except (RuntimeError, TypeError):
            # what torch refuses to run eagerly here (NotImplementedError is a RuntimeError: no
            # CPU kernel for the op or dtype; a TypeError: an argument eager torch does not take)
            # is lowered like any node instead; any other exception is a bug and propagates
            continue
    return values


def _channels_last_order(tv: TV):
    """[0, 2, ..., 1] when tv (rank 4 or 5) reads a buffer of its own size channels-last at its
    own index, else None."""
    nd = len(tv.shape)
    if nd not in (4, 5) or tv.shape[1] == 1 or math.prod(tv.shape[2:]) == 1:
        return None
    perm = [0] + list(range(2, nd)) + [1]
    stored = contiguous_strides([tv.shape[d] for d in perm])
    want = [0] * nd
    for pos, d in enumerate(perm):
        want[d] = stored[pos]
    stack, seen = [tv.expr], set()
    while stack:   # loads at tv's own index: through pointwise ops, not through index maps
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Load):
            if (node.offset == 0 and math.prod(node.buf.shape) == math.prod(tv.shape)
                    and all(s == w or size == 1
                            for s, w, size in zip(node.strides, want, tv.shape))):
                return perm
        elif isinstance(node, Op):
            stack.extend(node.args)
    return None


def _worth_sharing(tv: TV) -> bool:
    """A value with several readers is stored once if recomputing it would cost real work:
    transcendentals, more than a handful of ops, or (SHARE_MIN_READS) reading that many
    activations, which each reader would read again."""
    size = 0
    for node in walk(tv.expr):
        size += 1
        if isinstance(node, Op) and node.op in COSTLY:
            return True
    if (SHARE_MIN_READS and numel(tv.shape[:-1]) <= SHARE_MAX_ROWS
            and len({ld.buf.index for ld in loads(tv.expr)
                     if ld.buf.kind in ("arena", "state", "input")}) >= SHARE_MIN_READS):
        return True
    return size > 6


# Store a value of several readers once its expression reads this many activations (0: off). A
# decode step's residual stream, x + attention(x) + mlp(...), is an add of two loads, under the
# size rule above until the chain of adds outgrows it: in the Llama-1B decode graph it was stored
# every third layer, so the norms and GEMVs in between read two or three vectors per element, and
# a GEMV's 4096 programs each read them again: its gate+up GEMVs took 16.0 us (one vector),
# 18.3 (two) and 18.9 (three) on the H200 (profile_kernels --timeline, docs/performance.md,
# 2026-12-03). Stored, the add becomes the epilogue of the GEMV that produced its last term (no
# extra kernel). Only values of at most SHARE_MAX_ROWS rows (a decode step's, a batch-1
# vector's): the evidence is from decode, and encoders keep their fusion. Timed in that graph
# (bench_decode --variant, 2026-12-03): 0.972 -> 0.927 ms/token alone, and with split-K GEMVs and
# packed GQA heads 0.869. 0 turns it off (--variant noshare:lower.SHARE_MIN_READS=0).
SHARE_MIN_READS = 2
SHARE_MAX_ROWS = 16


def lower(program: ExportedProgram, name: str = "model", options: dict | None = None,
          bucket: dict | None = None, output_names: list[str] | None = None) -> Program:
    from . import lower_ops, lower_scan, lower_vision  # noqa: F401  (register the handlers)
    return Lowering(program, name, options, bucket, output_names).run()


# ---- helpers shared by the op handlers -------------------------------------------------------


def as_operand(x, shape, dtype: str):
    """Broadcast a TV (or a Python scalar) to `shape`, in `dtype`."""
    if isinstance(x, TV):
        tv = views.expand(x, shape) if x.shape != tuple(shape) else x
        expr = tv.expr if tv.dtype == dtype else Op("cast", [tv.expr], dtype)
        return expr
    if isinstance(x, SymSize) and sym_expr(x) is not None:
        value = SymValue(x.expr)
        return value if dtype == "int64" else Op("cast", [value], dtype)
    if isinstance(x, (bool, int, float)):
        return Const(_py_value(x, dtype), dtype)
    raise LoweringError(f"unsupported operand {x!r}")


def _py_value(x, dtype):
    if dtype == "bool":
        return bool(x)
    if dtype.startswith("int") or dtype == "uint8":
        return int(x)
    return float(x)

