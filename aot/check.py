"""`grace check`: every op of a program that the compiler cannot lower, all at once, in seconds.

The check runs the compiler's own stages — decomposition, shape symbols and buckets, lowering
(`lower.Lowering`, every handler of lower_ops / lower_vision / lower_scan with all of its own
refusals), epilogue fusion, the memory plan and Triton source generation — for every bucket, but
builds no kernel (no Triton compile, no cubin, no package). Where a node cannot be lowered it
records why and puts a *stand-in* in its place (a tensor of the node's shape and dtype, as torch
recorded them), so the walk goes on and the nodes after it are checked too: one run names every
unsupported op, each once, with how often it occurs and the user's source lines.

A program that the check passes lowers the same way in `grace compile`: without a problem the
walk is the compiler's own (a stand-in is only ever made where the compiler would have stopped).

    report = grace.aot.check(exported_program)     # or check(model, example_inputs)
    report.ok, report.problems, print(report.format()), report.to_dict()

`user_frame(node)` is the source location both this report and the compiler's "used at" use:
the innermost frame of the node's stack trace that is not inside torch (for an op inside an
`nn` module, the line of the user's model that called the module, not torch/nn/modules/*.py).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch

from . import extents, fuse, generation, lower, memplan, views
from .lower import LoweringError

_FRAME_RE = re.compile(r'File "(.*)", line (\d+)(?:, in (.*))?')
_INTERNAL = "internal error (a bug in grace, please report it)"


# ---- source locations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        """The compiler's "used at" form: `File "m.py", line 12, in forward: y = self.act(x)`."""
        where = f'File "{self.file}", line {self.line}' + (f", in {self.function}" if self.function else "")
        return f"{where}: {self.code}" if self.code else where

    def short(self) -> str:
        return f"{self.file}:{self.line}" + (f": {self.code}" if self.code else "")


def _torch_dir() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_frame(node) -> Frame | None:
    """The innermost frame of `node.meta["stack_trace"]` outside torch (the innermost frame of all
    when every frame is inside torch); None when torch.export recorded no location."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    lines = [ln for ln in lines if ln]
    torch_dir = _torch_dir()
    found = innermost = None
    for i, ln in enumerate(lines):
        m = _FRAME_RE.match(ln)
        if not m:
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not _FRAME_RE.match(lines[i + 1]) else ""
        frame = Frame(m.group(1), int(m.group(2)), m.group(3) or "", code)
        innermost = frame
        if not os.path.abspath(m.group(1)).startswith(torch_dir):
            found = frame
    return found or innermost


def user_location(node) -> str:
    frame = user_frame(node)
    return str(frame) if frame is not None else "(no source location recorded)"


_NODE_RE = re.compile(r"\(node '([^']+)'\), used at ")


def relocate(exc: BaseException, program) -> BaseException:
    """Point the "used at" of a compiler error at the user's line (`user_location`), in place.

    lower.py names the innermost frame of all, which for an op inside an nn module is torch's
    own torch/nn/modules/*.py; the node named in the message gives the user's frame instead."""
    msg = str(exc)
    m = _NODE_RE.search(msg)
    if m is None or not getattr(exc, "args", None):
        return exc
    node = next((n for n in program.graph_module.graph.nodes if n.name == m.group(1)), None)
    if node is None:
        return exc
    old, new = f"used at {lower.source_line(node)}", f"used at {user_location(node)}"
    if old in msg and old != new:
        exc.args = (msg.replace(old, new, 1),) + tuple(exc.args[1:])
    return exc


# ---- the report ------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One op (or, with op None, the program as a whole) that cannot be compiled."""
    op: str | None                  # "aten.cosh.default"; None: a program-level problem
    reasons: list[str]              # distinct reasons, in order of first occurrence
    count: int = 0                  # nodes of this op that cannot be lowered (in any bucket)
    nodes: list[str] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)   # distinct user lines (Frame form)
    internal: bool = False          # an exception that is not a compile error: a bug in grace

    def to_dict(self) -> dict:
        return {"op": self.op, "count": self.count, "reasons": list(self.reasons),
                "nodes": list(self.nodes), "locations": list(self.locations),
                "internal": self.internal}


@dataclass
class CheckReport:
    problems: list[Problem]
    ops: int                        # call nodes in the core-ATen program
    distinct_ops: int
    graphs: int                     # buckets lowered
    seconds: float
    name: str = "model"

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsupported(self) -> list[Problem]:
        return [p for p in self.problems if p.op is not None]

    def to_dict(self) -> dict:
        return {"model": self.name, "ok": self.ok, "ops": self.ops, "distinct_ops": self.distinct_ops,
                "graphs": self.graphs, "seconds": round(self.seconds, 3),
                "problems": [p.to_dict() for p in self.problems]}

    def format(self, max_locations: int = 3) -> str:
        head = (f"{self.name}: {_n(self.ops, 'op')} ({self.distinct_ops} distinct), "
                f"{_n(self.graphs, 'graph')} lowered in {self.seconds:.1f} s")
        if self.ok:
            return f"{head}: every op can be lowered"
        ops = self.unsupported
        program = len(self.problems) - len(ops)
        parts = [f"{_n(len(ops), 'op')} cannot be lowered"] if ops else []
        if program:
            parts.append(f"{_n(program, 'problem')} of the program as a whole")
        lines = [f"{head}: {', and '.join(parts)}"]
        for p in self.problems:
            title = p.op if p.op is not None else "(program)"
            count = f" ×{p.count}" if p.op is not None else ""
            lines.append(f"  {title}{count}: {'; '.join(p.reasons)}")
            for loc in p.locations[:max_locations]:
                lines.append(f"      at {loc}")
            if len(p.locations) > max_locations:
                lines.append(f"      ... and {_n(len(p.locations) - max_locations, 'more location')}")
        return "\n".join(lines)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


class _Collector:
    """Problems keyed by op (program-level ones by reason), merged over buckets."""

    def __init__(self):
        self.by_key: dict = {}

    def add(self, node, reason: str, internal: bool = False) -> None:
        op = str(node.target) if node is not None else None
        key = op if op is not None else reason
        p = self.by_key.get(key)
        if p is None:
            p = self.by_key[key] = Problem(op, [], internal=internal)
        p.internal = p.internal or internal
        if reason not in p.reasons:
            p.reasons.append(reason)
        if node is None:
            return
        if node.name not in p.nodes:
            p.nodes.append(node.name)
            p.count += 1
            loc = user_location(node)
            if loc not in p.locations:
                p.locations.append(loc)

    def problems(self) -> list[Problem]:
        """The program's own problems first, then the ops in graph order."""
        return sorted(self.by_key.values(), key=lambda p: p.op is not None)


def _reason(exc: BaseException, node) -> tuple[str, bool]:
    """(one-line reason, internal?) for an exception raised while lowering `node`."""
    if isinstance(exc, (LoweringError, extents.ShapeError)):
        msg = " ".join(str(exc).split())
        if msg.startswith(f"cannot lower {node.target} (node "):
            return "no lowering for this op", False
        internal = msg.startswith("internal")
        # the op, node and line are reported beside the reason
        msg = re.sub(r" — in \S+ \(node '[^']+'\), used at .*$", "", msg)
        return (f"{_INTERNAL}: {msg}" if internal else msg), internal
    return f"{_INTERNAL}: {type(exc).__name__}: {' '.join(str(exc).split())}", True


class _CollectingLowering(lower.Lowering):
    """The compiler's lowering, except that a node it refuses is recorded and replaced by a
    stand-in of the node's shape and dtype, so the walk checks every node after it too."""

    def __init__(self, *args, collector: _Collector, **kwargs):
        super().__init__(*args, **kwargs)
        self.collector = collector
        self.failed: set = set()    # nodes that have a stand-in (or none could be made)

    def call(self, node):
        try:
            return super().call(node)
        except Exception as exc:  # noqa: BLE001 - every refusal is reported, none is fatal here
            reason, internal = _reason(exc, node)
            downstream = any(n in self.failed for n in node.all_input_nodes)
            # a crash on a stand-in's reader may be the stand-in's fault: the refusal upstream is
            # reported already (and the check fails anyway)
            if not (internal and downstream):
                self.collector.add(node, reason, internal)
            self.failed.add(node)
            return self._stand_in(node)

    def _stand_in(self, node):
        def one(val):
            if isinstance(val, torch.Tensor):
                try:
                    dtype = lower.dtype_name(val.dtype)
                    shape = [self.size_of(d) for d in val.shape]
                except Exception:  # noqa: BLE001 - a dtype or size with no stand-in
                    return None
                # a weight: a region no kernel writes, so the memory plan accepts its readers
                return views.contiguous_load(self.new_buffer(shape, dtype, "weight",
                                                             f"stand_in.{node.name}"))
            if isinstance(val, torch.SymInt):
                try:
                    return extents.SymSize(self.size_of(val), val.node.expr)
                except Exception:  # noqa: BLE001
                    return None
            if isinstance(val, (int, float, bool)):
                return val
            return None

        val = node.meta.get("val")
        value = type(val)(one(v) for v in val) if isinstance(val, (tuple, list)) else one(val)
        if self.dynamic:
            try:
                value = self.with_extents(node, value)
            except Exception:  # noqa: BLE001 - no extents: readers see a static stand-in
                pass
        return value


# ---- the check -------------------------------------------------------------------------------------


def check(program, example_inputs=None, *, kwargs=None, dynamic_shapes=None, buckets=None,
          generate=None, name=None, codegen: bool = True) -> CheckReport:
    """Every op of `program` (an ExportedProgram, or an nn.Module with `example_inputs` and/or
    `kwargs`) that cannot be compiled, each op once, with its count and the user's source lines.
    Nothing is built. The example inputs are exported as `grace.aot.compile` exports them:
    `example_inputs` positionally, `kwargs` by keyword, a `None` argument is no input, so the
    check sees the program the compile would lower. `buckets` / `generate` as for
    `grace.aot.compile` (they change what gets lowered); `codegen=False` stops after the memory
    plan (Triton source generation is skipped)."""
    from .compiler import CompileOptions, decompose, exported

    t0 = time.perf_counter()
    # the compiler's own option checks (generate's keys); its lowering options (compile's defaults)
    options = CompileOptions(generate=tuple((generate or {}).items())).recorded()
    program, name, dim_names = exported(program, example_inputs, dynamic_shapes, kwargs, name)
    core = decompose(program)
    calls = [n for n in core.graph_module.graph.nodes if n.op == "call_function"]
    collector = _Collector()
    graphs = _check_buckets(core, name or "model", options, dim_names, buckets, generate, codegen,
                            collector)
    return CheckReport(collector.problems(), len(calls), len({str(n.target) for n in calls}), graphs,
                       time.perf_counter() - t0, name or "model")


def _check_buckets(core, name, options, dim_names, buckets, generate, codegen_too, collector) -> int:
    from . import codegen, lower_ops, lower_scan, lower_vision  # noqa: F401 (the handlers)

    try:
        symbols = extents.find_symbols(core, dim_names)
        lists = extents.bucket_lists(symbols, {k: [int(x) for x in v] for k, v in (buckets or {}).items()})
        symbols += extents.find_data_symbols(core, symbols)
        if generate:
            generation.add_decode_bucket(core, symbols, lists, dict(generate))
    except (LoweringError, extents.ShapeError) as exc:
        collector.add(None, " ".join(str(exc).split()))
        return 0
    sym_index = {s.expr: i for i, s in enumerate(symbols)}
    by_name = {n.name: n for n in core.graph_module.graph.nodes}
    graphs = 0
    for bounds in extents.combinations(symbols, lists):
        bucket = {s.expr: bounds[s.name] for s in symbols if s.kind == "input"}
        lowering = _CollectingLowering(core, name, options, bucket, collector=collector)
        graphs += 1
        try:
            lowered = lowering.run()
            if generate:
                lowered = generation.add_state(lowered, dict(generate))
        except Exception as exc:  # noqa: BLE001 - outside any one node: the program's inputs/outputs
            internal = not isinstance(exc, (LoweringError, extents.ShapeError))
            text = " ".join(str(exc).split())
            collector.add(None, f"{_INTERNAL}: {type(exc).__name__}: {text}" if internal else text,
                          internal)
            _unhandled_ops(core, lowering, collector)
            continue
        try:
            kernels = memplan.drop_empty(fuse.fuse_epilogues(lowered.kernels))
            plan = memplan.plan_memory(kernels, lowered.weights, lowered.state)
            memplan.check_plan(plan)
        except Exception as exc:  # noqa: BLE001
            if not lowering.failed:   # with stand-ins, a later stage may fail because of them
                collector.add(None, f"{_INTERNAL}: {type(exc).__name__}: {' '.join(str(exc).split())}",
                              True)
            continue
        if not codegen_too:
            continue
        for k in kernels:
            try:
                codegen.generate(k, sym_index, pdl=False)
            except Exception as exc:  # noqa: BLE001
                node = by_name.get((k.label or "").split("+")[0])
                if isinstance(exc, ValueError):   # the compiler's "cannot ... in a kernel" errors
                    collector.add(node, f"{' '.join(str(exc).split())} (in the kernel for "
                                        f"'{k.label}')")
                elif not lowering.failed:
                    collector.add(node, f"{_INTERNAL}: {type(exc).__name__}: "
                                        f"{' '.join(str(exc).split())}", True)
    return graphs


def _unhandled_ops(core, lowering, collector) -> None:
    """When the walk stopped before its end (the program mutates its inputs, an output is not a
    tensor), still name every op that has no lowering at all (the handler table alone)."""
    folded = lowering.folded or {}
    for node in core.graph_module.graph.nodes:
        if (node.op == "call_function" and node not in folded and node not in lowering.env
                and not lower._is_size_arithmetic(node) and node.target not in lower.HANDLERS):
            collector.add(node, "no lowering for this op")
