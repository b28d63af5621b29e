"""The package's CUDA graphs, built node by node from the manifest (no stream capture).

    plan_graph(view, i)              pure; run by load() for every graph: each node of graphs[i] as a
                                     NodePlan. The manifest passed grace.formats' checks (every
                                     argument inside its region, this graph's arena, the table words);
                                     what is left is what this runtime can run (no scratch memory).
                                     `view` is one variant's (format 3.5, formats.view.for_arch) and
                                     `i` the variant's graph index; kernel indices are the package's.
    param_values(plan, bases, words) pure; the 8-byte value of each kernel parameter of one node.
    ExecutableGraph(plans, ...)      driver; cuGraphCreate, cuGraphAddKernelNode per node,
                                     cuGraphInstantiate. Per call, launch(words): the table words go
                                     into the parameter cells of the nodes that take them (the table
                                     writer), one cuGraphExecKernelNodeSetParams each (none when
                                     they are the words set last on this graph), cuGraphLaunch.
    plan_node(...)                   one node as a NodePlan, shared by plan_graph and the generate
                                     step (runtime/generate.py).
    GenerationGraph(...)             driver; generate()'s token loop as one graph with a WHILE
                                     conditional node (docs/design-state.md).

Kernel parameters. Kernel ABI (docs/architecture.md): the kernel's declared parameters, then
`hidden_params` null pointers (Triton 3.6: global and profile scratch). Region arguments become
`base(region) + offset`; `{"word": i}` arguments become table word i.

How they reach the driver: CUDA_KERNEL_NODE_PARAMS.kernelParams is a `void**`, one pointer per
parameter to that parameter's value. cuda-bindings 13.3.1 accepts a plain int there and uses it as an
already built `void**` (cuda/bindings/_lib/utils.pxi, `_HelperKernelParams`: "user gave us an already
configured void** address"). So each node owns a ParamBlock: one 8-byte cell per parameter (pointers
and i64 words alike; an i32 parameter reads the low half, little-endian) and a `void*[]` pointing at
the cells. The driver copies the values when a node is added and on every SetParams, so the table
writer's cells are simply rewritten in place before a call (slice assignments, precomputed as
runs of consecutive words), with no Python objects rebuilt; and only when the words differ from
the ones set last on that graph (ExecutableGraph.set_words).
"""

from __future__ import annotations

import ctypes

from grace.formats import table
from grace.formats.view import as_view

from . import driver
from .driver import call, check
from .errors import InvalidPackageError, PackageMismatchError

_U64 = (1 << 64) - 1


class NodePlan:
    """One kernel node: which kernel, launch shape, and where each parameter comes from."""

    __slots__ = ("index", "where", "kernel", "grid", "block", "shared", "args", "deps",
                 "programmatic")

    def __init__(self, index, where, kernel, grid, block, shared, args, deps, programmatic=()):
        self.index = index      # position in the graph
        self.where = where      # "graph 'main' node 3 (addmm+relu)", for messages
        self.kernel = kernel    # index into manifest["kernels"]
        self.grid = grid        # (x, y, z) blocks
        self.block = block      # threads per block: 32 * num_warps
        self.shared = shared    # dynamic shared memory in bytes
        self.args = args        # per parameter: ("region", name, offset) | ("word", i) | ("zero",)
        self.deps = deps        # indices of earlier nodes
        self.programmatic = programmatic   # the deps whose edges may be programmatic (SPEC §5.3)

    def with_shared(self, shared: int) -> "NodePlan":
        """The same launch with `shared` bytes of dynamic shared memory (runtime/occupancy.py)."""
        return NodePlan(self.index, self.where, self.kernel, self.grid, self.block, shared, self.args,
                        self.deps, self.programmatic)


def table_word_count(manifest) -> int:
    """The table words of a validated manifest dict: the slots' words, then one per symbol."""
    return table.word_count((slot["rank"] for slot in manifest["table"]["slots"]), len(manifest["symbols"]))


def plan_graph(manifest, graph_index: int = 0) -> list:
    """Graph `graph_index`'s NodePlans, in execution order. `manifest`: a formats.view.Manifest
    (load() passes its variant's view, formats.view.for_arch: `graph_index` counts that variant's
    graphs), or a manifest dict, validated first (ManifestError)."""
    m = as_view(manifest)
    graph = m.graphs[graph_index]
    return [plan_node(m.kernels, node, i, f"graph {graph.name!r} node {i} ({node.label or '?'})")
            for i, node in enumerate(graph.nodes)]


def plan_node(kernels, node, index: int, where: str) -> NodePlan:
    """One node (a graph's, or the generate step) of a validated manifest as a NodePlan: its
    arguments as ("region", name, offset) | ("word", i), then the kernel's hidden parameters as
    ("zero",). `kernels`: the view's kernels. PackageMismatchError for a kernel that needs Triton's
    scratch memory, which this runtime does not provide."""
    kernel = kernels[node.kernel]
    if kernel.global_scratch_size or kernel.profile_scratch_size:
        raise PackageMismatchError(
            f"{where}: kernel {kernel.name} needs Triton global/profile scratch memory "
            f"({kernel.global_scratch_size}/{kernel.profile_scratch_size} bytes), "
            "which this runtime does not provide yet")
    args = tuple(("word", a.word) if a.word is not None else ("region", a.region, a.offset)
                 for a in node.args)
    return NodePlan(index, where, node.kernel, node.grid, 32 * kernel.num_warps, kernel.shared,
                    args + (("zero",),) * kernel.hidden_params, node.deps, node.programmatic)


def param_values(plan: NodePlan, bases: dict, words) -> tuple:
    """(values, word_positions): the value of every parameter of `plan`, and (position, word index)
    for each parameter that is a table word. `bases` maps region name -> device address."""
    values, word_positions = [], []
    for pos, arg in enumerate(plan.args):
        if arg[0] == "region":
            values.append(bases[arg[1]] + arg[2])
        elif arg[0] == "word":
            values.append(words[arg[1]])
            word_positions.append((pos, arg[1]))
        else:
            values.append(0)
    return values, word_positions


def word_runs(word_positions) -> list:
    """[(position, first word, end word)]: `word_positions` ((position, word) pairs) grouped into runs
    where consecutive positions hold consecutive words, so each run is one slice copy. A table
    writer whose parameters are w0, w1, ... in order is a single run."""
    runs = []
    for pos, word in word_positions:
        if runs and runs[-1][0] + runs[-1][2] - runs[-1][1] == pos and runs[-1][2] == word:
            runs[-1][2] = word + 1
        else:
            runs.append([pos, word, word + 1])
    return [tuple(r) for r in runs]


class ParamBlock:
    """The memory behind one node's kernelParams: 8-byte cells and the void*[] that points at them."""

    def __init__(self, values):
        n = len(values)
        self.cells = (ctypes.c_uint64 * n)(*(v & _U64 for v in values))
        base = ctypes.addressof(self.cells)
        self.pointers = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
        self.address = ctypes.addressof(self.pointers)  # what kernelParams receives


def add_kernel_node(graph, function, grid, block, shared, values, deps, where, programmatic=()):
    """cuGraphAddKernelNode for one kernel launch with parameter `values` after `deps` (graph
    nodes) by full edges and after `programmatic` (graph nodes) by programmatic edges: this
    kernel may launch once every block of those has called gdc_launch_dependents(), and its
    gdc_wait() waits for them to finish. Returns (node, ParamBlock, CUDA_KERNEL_NODE_PARAMS);
    keep both for the graph's life."""
    cu = driver.cuda()
    if function is None:   # a kernel without a binary for the loaded arch (another variant's)
        raise InvalidPackageError(f"{where}: its kernel has no binary for this GPU's arch")
    block_cells = ParamBlock(values)
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = function
    p.gridDimX, p.gridDimY, p.gridDimZ = grid
    p.blockDimX, p.blockDimY, p.blockDimZ = block, 1, 1
    p.sharedMemBytes = shared
    p.kernelParams = block_cells.address
    node = check(cu.cuGraphAddKernelNode(graph, deps, len(deps), p), f"cuGraphAddKernelNode for {where}")
    if programmatic:
        edges = []
        for _ in programmatic:
            edge = cu.CUgraphEdgeData()
            edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
            edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
            edges.append(edge)
        check(cu.cuGraphAddDependencies(graph, list(programmatic), [node] * len(programmatic), edges,
                                        len(programmatic)),
              f"cuGraphAddDependencies (programmatic) for {where}")
    return node, block_cells, p


def split_edges(plan: NodePlan, nodes: list, pdl: bool, offset: int = 0):
    """(full, programmatic) graph nodes `plan` depends on; with pdl off every edge is full. `offset`
    maps a dep index to `nodes` (the WHILE body has no table writer: offset -1)."""
    prog = set(plan.programmatic) if pdl else set()
    deps = [d for d in plan.deps if d + offset >= 0]
    return ([nodes[d + offset] for d in deps if d not in prog],
            [nodes[d + offset] for d in deps if d in prog])


class ExecutableGraph:
    """An instantiated graph: `launch(words, stream)` puts the table words into the nodes that take
    them and launches."""

    def __init__(self, plans, functions, bases: dict, words, pdl: bool = True):
        cu = driver.cuda()
        self._cu = cu
        self.graph = call(cu.cuGraphCreate, 0)
        self.exec = None
        self._keep = []      # every node's ParamBlock and CUDA_KERNEL_NODE_PARAMS, for the graph's life
        self._dynamic = []   # (node, CUDA_KERNEL_NODE_PARAMS) of nodes that take table words
        self._runs = []      # (cells, first position, first word, end word): one slice copy each
        self._words = None   # the table words last set on the instantiated graph (None: not yet)
        try:
            nodes = []
            for plan in plans:
                values, word_positions = param_values(plan, bases, words)
                full, prog = split_edges(plan, nodes, pdl)
                node, block, p = add_kernel_node(self.graph, functions[plan.kernel], plan.grid, plan.block,
                                                 plan.shared, values, full, plan.where, prog)
                nodes.append(node)
                self._keep.append((block, p))
                if word_positions:
                    self._dynamic.append((node, p))
                    self._runs += [(block.cells, *run) for run in word_runs(word_positions)]
            self.exec = call(cu.cuGraphInstantiate, self.graph, 0)
        except BaseException:
            self.destroy()
            raise

    def upload(self, stream) -> None:
        """Move the graph to the device now, so the first launch does not pay for it."""
        call(self._cu.cuGraphUpload, self.exec, stream)

    def launch(self, words, stream) -> None:
        """Write this call's table words into the graph, then launch it. The hot path."""
        self.set_words(words)
        result = self._cu.cuGraphLaunch(self.exec, stream)
        if result[0]:
            check(result, "cuGraphLaunch")

    def set_words(self, words) -> None:
        """Write the table words into the parameter cells, SetParams on each node that takes them
        (the table writer). Skipped when `words` equal the last words set on this graph: the
        instantiated graph keeps its nodes' parameters from one launch to the next, and its table
        writer runs at every launch, rewriting the session's table (which other graphs of the
        session rewrite with theirs) from them. A serving loop that passes the same buffers at the
        same sizes pays no SetParams."""
        if words == self._words:
            return
        for cells, pos, first, end in self._runs:
            cells[pos:pos + end - first] = words[first:end]
        cu, exe = self._cu, self.exec
        for node, params in self._dynamic:
            result = cu.cuGraphExecKernelNodeSetParams(exe, node, params)
            if result[0]:
                check(result, "cuGraphExecKernelNodeSetParams")
        self._words = list(words)

    def destroy(self) -> None:
        cu = self._cu
        if self.exec is not None:
            call(cu.cuGraphExecDestroy, self.exec)
            self.exec = None
        if self.graph is not None:
            call(cu.cuGraphDestroy, self.graph)
            self.graph = None


class GenerationGraph(ExecutableGraph):
    """The token loop of generate() as one graph (docs/design-state.md, "Runtime"):

        step -> set_condition -> decode table writer -> WHILE { decode kernels -> step -> set_condition }

    `step` (the package's argmax-and-advance node) reads the logits of the run before it, appends
    the token to out_tokens, feeds it back through next_token / next_position and sets ctrl's done
    word; `set_condition` (the runtime's PTX kernel) sets the WHILE node's condition to done == 0.
    The first step consumes the prefill's logits, so it runs before the decode table writer rewrites
    the table. The decode writer's words (tokens and positions slots pointing at next_token /
    next_position in the state region, outputs at the session's buffers) are fixed per session, so
    launch() is a bare cuGraphLaunch: no SetParams and no host round trip per token.

    `writer`, `body`: the decode graph's NodePlans (node 0, nodes 1..); `step`: the step's NodePlan;
    `condition`: the set_condition CUfunction; `ctrl`: the device address of ctrl (int64[4]).
    """

    def __init__(self, writer, body, step, condition, ctrl: int, functions, bases: dict, words, ctx,
                 pdl: bool = True):
        cu = driver.cuda()
        self._cu = cu
        self.graph = call(cu.cuGraphCreate, 0)
        self.exec = None
        self._keep, self._dynamic, self._runs, self._words = [], [], [], None
        try:
            handle = call(cu.cuGraphConditionalHandleCreate, self.graph, ctx, 0, 0)
            self._keep.append(handle)
            self._condition = (condition, [int(handle), ctrl])

            def add_plan(graph, plan, deps, programmatic=()):
                values, _ = param_values(plan, bases, words)
                return self._add(graph, functions[plan.kernel], plan.grid, plan.block, plan.shared, values,
                                 deps, plan.where, programmatic)

            first = add_plan(self.graph, step, [])
            cond = self._add_condition(self.graph, [first])
            table = add_plan(self.graph, writer, [cond])
            loop = self._add_while(self.graph, handle, ctx, [table])
            nodes = []  # the body's copy of the decode kernels; deps on the writer (node 0) are dropped
            for plan in body:
                nodes.append(add_plan(loop, plan, *split_edges(plan, nodes, pdl, offset=-1)))
            needed = {d - 1 for plan in body for d in plan.deps if d > 0}
            sinks = [n for i, n in enumerate(nodes) if i not in needed]
            again = add_plan(loop, step, sinks)
            self._add_condition(loop, [again])
            self.exec = call(cu.cuGraphInstantiate, self.graph, 0)
        except BaseException:
            self.destroy()
            raise

    def _add(self, graph, function, grid, block, shared, values, deps, where, programmatic=()):
        node, cells, p = add_kernel_node(graph, function, grid, block, shared, values, deps, where,
                                         programmatic)
        self._keep.append((cells, p))
        return node

    def _add_condition(self, graph, deps):
        function, values = self._condition
        return self._add(graph, function, (1, 1, 1), 1, 0, values, deps, "generate set_condition")

    def _add_while(self, graph, handle, ctx, deps):
        """A WHILE conditional node after `deps`; returns its body graph (owned by the node)."""
        cu = self._cu
        p = cu.CUgraphNodeParams()
        p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        c = p.conditional
        c.handle = handle
        c.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        c.size = 1
        c.ctx = ctx
        check(cu.cuGraphAddNode(graph, deps, None, len(deps), p), "cuGraphAddNode (the generate WHILE node)")
        self._keep.append(p)
        return p.conditional.phGraph_out[0]

    def launch(self, stream) -> None:
        """One launch runs every new token."""
        call(self._cu.cuGraphLaunch, self.exec, stream)
