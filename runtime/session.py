"""Session: the per-caller state of a loaded package, and run().

A session owns one arena (`regions.arena`, the largest any graph uses), one argument table, one
buffer per output sized for the largest graph, staging buffers for numpy inputs (allocated on first
use, sized for the largest bucket), a stream, and one instantiated CUDA graph per bucket. Graphs are
instantiated on the first call that selects them ("lazy", the default) or all when the session is
made ("eager", `load(..., instantiate="eager")`); `instantiations` counts them, so a test can check
that no graph is rebuilt while sizes vary inside a bucket. Sessions of one package share its kernels
and weights. Calls on one session are ordered on its stream, so the table and the arena are never
rewritten while an earlier launch may still read them, whichever graph it was.

run(): check every argument (dtype, device, layout: validate.ArrayCheck per input), resolve the
symbols from the input shapes and select the graph (calls.ShapePlan.prepare, remembered per input
shapes; InputError before anything is enqueued) -> copy numpy inputs to staging -> the table words
(true sizes, strides and symbol values from the shape plan; this call's data pointers) into the
chosen graph's table-writer parameter cells and cuGraphExecKernelNodeSetParams, both skipped when
the words are the ones that graph was launched with last -> cuGraphLaunch. Returns DeviceArrays
with the true shapes, stale after the next run(). The host time of all this, stage by stage:
`python -m grace.tools.host_bench` (CPU, fake driver) or `--gpu`.

Data-dependent sizes: an output whose dim 0 uses a data symbol is allocated at the graph's bound;
its true size is computed by a kernel into the table's extents words. Its DeviceArray reads that word
from the device (synchronising the session's stream) the first time its shape is needed (.shape,
.numpy(), a protocol). That read is the only host round trip of the runtime, and only such outputs
make it; run() itself never waits for the device.

State (format 3.0, docs/design-state.md): a session allocates `regions.state` bytes of its own and
initialises them when it is made (memset for `init: "zeros"`, a copy of the package's bytes for
`init: "data"`); graphs update it in place, so it persists across run() calls. reset_state()
initialises it again, ordered on the stream after the runs before it; read_state() copies it back.

generate() (packages compiled with --generate): checks, reset_state(), ctrl, the prefill through
run(), then one launch of the session's generation graph (graph.GenerationGraph, built on the first
generate() and reused), which loops over the decode graph on the device until the step kernel says
done. One sync at the end reads the count and the tokens.

Index checks (format 3.3, runtime/checks.py): the package's gathers clamp out-of-range indices on the
device and store a code into the table's error word. The session zeroes the word when it is made and,
if the package has checks, reads it at every synchronising point: sync(), DeviceArray.numpy() (every
device-to-host copy), the first read of a data-dependent shape, read_state() and the end of
generate(). A nonzero word is zeroed and raised as IndexOutOfRangeError, naming the input, the op and
the source line; the session stays usable.

Streams: by default the session makes a stream that is *blocking* with respect to the legacy default
stream, so work that torch or CuPy enqueue on their default stream is ordered with our launches in
both directions, with no host synchronisation. If you produce inputs on another stream, synchronise
it first, or pass that stream as session(stream=...).
"""

from __future__ import annotations

import functools

import numpy as np

from . import driver, dtypes
from .arrays import DeviceArray, as_record, host_array, host_buffer
from .driver import call
from .errors import GraceRuntimeError, InputError, InvalidPackageError
from .generate import COUNT, require
from .graph import ExecutableGraph, GenerationGraph, table_word_count
from .validate import ArrayCheck, check_shape, check_writable


class Session:
    """Run a loaded package: `outputs = session.run(x=tensor)`; see the module docstring.

    `instantiations`: {graph name: times instantiated} for the graphs built so far (each stays 1).
    `last_graph`: the name of the graph the last run() launched (None before the first).
    `last_generate`: {"prompt", "new_tokens", "graph"} of the last generate() (None before the first).
    """

    def __init__(self, package, poison: bool = False, stream=None):
        self._package = package
        self._device = package.device
        self._ordinal = package.device.ordinal
        self._closed = False
        self._generation = 0  # +1 per run(): DeviceArrays of older generations are stale
        self._keep = None     # the last run's arguments: alive while the GPU may still read them
        self._stream = self._event = None
        self._own_stream = stream is None
        self._arena = self._table = self._state = None
        self._generation_graph = None  # GenerationGraph, built by the first generate()
        self.last_generate = None
        self._out_ptrs, self._staging = [], {}
        self._graphs = [None] * len(package.plans)  # ExecutableGraph per graph, once instantiated
        self.instantiations = {}
        self.last_graph = None
        self._inputs, self._outputs = package.inputs, package.outputs
        self._shapes = package.shapes
        self._input_names = [s.name for s in self._inputs]
        self._output_index = {s.name: o for o, s in enumerate(self._outputs)}
        # per input: what its arrays must be (dtype, this device, layout), and its name for messages
        self._input_checks = [ArrayCheck(f"input '{s.name}'", s.dtype, self._ordinal) for s in self._inputs]
        self._pointer_words = package.shapes.pointer_words  # per slot: index of its data-pointer word
        self._input_words = [self._pointer_words[s.slot] for s in self._inputs]    # the pointer's word
        self._output_words = [self._pointer_words[s.slot] for s in self._outputs]  # of each input, output
        self._graph_names = package.graph_names
        self._data_outputs = {o for o in range(len(self._outputs)) if self._shapes.data_symbols_of(o)}
        self._last = None  # (graph, symbol values, values with data symbols read) of the last run
        self._checks = package.index_checks  # checks.IndexChecks, or None: no error word to read
        self._error_word = np.zeros(1, np.int64)  # host side of the error word's reads

        self._device.make_current()
        try:
            self._stream = driver.stream_create() if stream is None else driver.as_stream(stream)
            # The stream as DLPack / __cuda_array_interface__ spell it: 1 is the legacy default (0 is illegal).
            self._stream_int = int(self._stream) or 1
            self._cai_stream = self._stream_int
            self._event = driver.event_create()
            regions = package.manifest["regions"]
            self._arena = driver.mem_alloc(regions["arena"])
            self._table = driver.mem_alloc(regions["table"])
            out_nbytes = [self._shapes.output_capacity(o) * dtypes.itemsize(s.dtype)
                          for o, s in enumerate(self._outputs)]
            self._out_ptrs = [driver.mem_alloc(n) for n in out_nbytes]
            self._output_buffers = [(s.name, ptr, s.dtype) for s, ptr in zip(self._outputs, self._out_ptrs)]
            if poison:  # 0xFF bytes: NaN in every float format, -1 in every int format
                for ptr, n in ((self._arena, regions["arena"]), (self._table, regions["table"]),
                               *zip(self._out_ptrs, out_nbytes)):
                    driver.memset_d8(ptr, 0xFF, n, self._stream)
            state_nbytes = regions.get("state", 0)
            if state_nbytes:
                self._state = driver.mem_alloc(state_nbytes)
            self._bases = {"weights": package.weights_ptr, "arena": self._arena, "table": self._table,
                           "state": self._state or 0}
            if self._checks is not None:  # (after the poison) no index was out of range yet
                driver.memset_d8(self._table + self._checks.offset, 0, 8, self._stream)
            self.reset_state()
            if package.instantiate == "eager":
                for g in range(len(self._graphs)):
                    self._instantiate(g)
        except BaseException:
            self.close()
            raise

    @property
    def inputs(self):
        return self._inputs

    @property
    def outputs(self):
        return self._outputs

    # ------------------------------------------------------------------------------------- run
    def run(self, *args, out=None, **inputs) -> dict:
        """Run once. Inputs positionally (manifest order) and/or by name, of any size the package's
        symbols allow; `out` maps output names to device arrays of this call's true output shape,
        written instead of the session's buffers. Returns {output name: DeviceArray} (or your out=
        array). Asynchronous: use .numpy(), a protocol consumer or sync() to wait."""
        if self._closed:
            raise GraceRuntimeError("this session was closed")
        self._device.make_current()
        records, shapes = self._input_records(args, inputs)
        call = self._shapes.prepare(shapes)  # sizes, graph, words (cached)
        out_records = self._out_records(out, call.output_shapes) if out else None
        graph = self._graphs[call.graph] or self._instantiate(call.graph)

        # Every argument is valid: from here on only device work is enqueued.
        graph.launch(self._table_words(call, records, out_records), self._stream)

        self._generation += 1
        self._last = (call.graph, call.values, None)
        self.last_graph = self._graph_names[call.graph]
        # Hold the caller's arrays (and DLPack capsules) until the next run, so a temporary passed to
        # run() is not freed and its memory reused while the graph may still read it.
        self._keep = (args, inputs, records, out)
        return self._results(call, out, out_records)

    __call__ = run

    def _table_words(self, call, records, out_records) -> list:
        """This call's table words: the shape plan's, with the data pointers of the inputs (numpy
        ones copied to staging first) and of the outputs (the session's buffers, or out= arrays)."""
        words = call.words.copy()
        for i, (at, rec) in enumerate(zip(self._input_words, records)):
            ptr = rec.ptr
            if rec.host is not None:
                ptr = self._stage(i, self._inputs[i], rec.host)
            elif rec.stream is not None:  # __cuda_array_interface__ v3: wait for the producer's stream
                driver.stream_wait(self._stream, driver.as_stream(rec.stream), self._event)
            words[at] = ptr
        for at, ptr in zip(self._output_words, self._out_ptrs):
            words[at] = ptr
        if out_records:
            for at, spec in zip(self._output_words, self._outputs):
                rec = out_records.get(spec.name)
                if rec is not None:
                    if rec.stream is not None:
                        driver.stream_wait(self._stream, driver.as_stream(rec.stream), self._event)
                    words[at] = rec.ptr
        return words

    def _results(self, call, out, out_records) -> dict:
        """What run() returns: {output name: DeviceArray of this run, or the caller's out= array}.
        The common case (no out=, every shape known at launch) goes straight to of_session."""
        results = {}
        if out_records or self._data_outputs:
            for o, (spec, shape) in enumerate(zip(self._outputs, call.output_shapes)):
                name = spec.name
                results[name] = out[name] if out_records and name in out_records else self._output_array(o, shape)
            return results
        new, ordinal = DeviceArray.of_session, self._ordinal  # (a loop: cheaper than a comprehension)
        for (name, ptr, dtype), shape in zip(self._output_buffers, call.output_shapes):
            results[name] = new(self, ptr, shape, dtype, ordinal, name)
        return results

    # ----------------------------------------------------------------------------------- state
    def reset_state(self) -> None:
        """Give the state its initial values again (zeros, or the package's data), ordered on the
        session's stream: after every run enqueued before, before every run enqueued after."""
        self._check_open()
        self._device.make_current()
        for entry in self._package.state:
            ptr = self._state + entry.offset
            if entry.data is None:
                driver.memset_d8(ptr, 0, entry.nbytes, self._stream)
            else:
                driver.copy_htod(ptr, entry.data.ctypes.data, entry.nbytes, self._stream)

    def read_state(self, name: str | None = None):
        """The state after every run enqueued so far (waits for them): {name: numpy array} in
        manifest order, or the one array `name`. Each array has its entry's dtype and shape
        (bfloat16 as float32, like DeviceArray.numpy())."""
        self._check_open()
        entries = self._package.state
        if name is not None:
            chosen = [e for e in entries if e.name == name]
            if not chosen:
                raise InputError(f"unknown state {name!r}; the package's state is {[e.name for e in entries]}")
            entries = chosen
        self.sync()
        arrays = {e.name: self._read_entry(e) for e in entries}
        return arrays[name] if name is not None else arrays

    def _read_entry(self, entry, count: int | None = None) -> np.ndarray:
        """Copy a state entry (or its first `count` elements, flattened) to the host."""
        shape = entry.shape if count is None else (count,)
        raw = host_buffer(entry.dtype, shape)
        self._to_host(raw.ctypes.data, self._state + entry.offset, raw.nbytes)
        return host_array(entry.dtype, raw)

    # -------------------------------------------------------------------------------- generate
    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None) -> np.ndarray:
        """Greedy decoding on the device: the new token ids (numpy int64, at most max_new_tokens; the
        eos token is included when it ends the sequence). `prompt_ids`: 1-D or [1, P] ints.
        Every argument is checked before anything runs; the state is reset first, so a generate()
        never continues an earlier one."""
        self._check_open()
        plan = require(self._package.generate)
        prompt, ctrl = plan.check(prompt_ids, max_new_tokens, eos_token_id)
        prefill = plan.prefill_inputs(prompt)
        self._shapes.prepare(plan.input_shapes(len(prompt)))  # the prefill's sizes select a graph (or InputError)
        loop = self._generation_graph or self._build_generation_graph(plan)

        self.reset_state()
        self._device.make_current()
        driver.copy_htod(self._state + plan.ctrl.offset, ctrl.ctypes.data, ctrl.nbytes, self._stream)
        self.run(**prefill)
        loop.launch(self._stream)
        self._generation += 1  # the loop rewrote the output buffers

        done = self._read_entry(plan.ctrl)  # waits for the loop
        count = int(done[COUNT])
        if not 0 <= count <= ctrl[1]:
            raise InvalidPackageError(f"generate: the step kernel counted {count} tokens, outside "
                                      f"[0, {int(ctrl[1])}]: a kernel of the package is wrong")
        tokens = self._read_entry(plan.out_tokens, count)
        self.last_generate = {"prompt": len(prompt), "new_tokens": count, "graph": self.last_graph}
        return tokens

    def _build_generation_graph(self, plan) -> GenerationGraph:
        """The token loop for this session: the decode graph's nodes with table words for one token
        (tokens / positions slots at next_token / next_position, outputs at the session's buffers),
        fixed for the session's life."""
        package = self._package
        one = self._shapes.prepare(plan.input_shapes(1))
        if one.graph != plan.decode_graph:
            raise InvalidPackageError(
                f"generate: decode_graph is {self._graph_names[plan.decode_graph]!r}, but one token selects "
                f"graph {self._graph_names[one.graph]!r}")
        words = one.words.copy()
        at, slots = self._pointer_words, [s.slot for s in self._inputs]
        words[at[slots[plan.tokens]]] = self._state + plan.next_token.offset
        words[at[slots[plan.positions]]] = self._state + plan.next_position.offset
        for spec, ptr in zip(self._outputs, self._out_ptrs):
            words[at[spec.slot]] = ptr
        decode = package.plans[plan.decode_graph]
        self._device.make_current()
        loop = GenerationGraph(decode[0], decode[1:], plan.step, package.set_condition_function(),
                               self._state + plan.ctrl.offset, package.functions, self._bases, words,
                               self._device.ctx, package.pdl)
        self._generation_graph = loop
        self.instantiations["generate"] = self.instantiations.get("generate", 0) + 1
        loop.upload(self._stream)
        return loop

    def _check_open(self) -> None:
        if self._closed:
            raise GraceRuntimeError("this session was closed")

    def _output_array(self, o: int, shape) -> DeviceArray:
        spec = self._outputs[o]
        if o in self._data_outputs:  # dim 0 is known on the device only: read it on first use
            return DeviceArray(self._out_ptrs[o], None, spec.dtype, self._ordinal, self, spec.name,
                               shape_fn=functools.partial(self._true_shape, o))
        return DeviceArray.of_session(self, self._out_ptrs[o], shape, spec.dtype, self._ordinal, spec.name)

    def _instantiate(self, g: int) -> ExecutableGraph:
        """Build, instantiate and upload graph g (its parameter cells start at zero: every launch
        writes all table words)."""
        package = self._package
        words = [0] * table_word_count(package.manifest)
        graph = ExecutableGraph(package.plans[g], package.functions, self._bases, words, package.pdl)
        self._graphs[g] = graph
        name = package.graph_names[g]
        self.instantiations[name] = self.instantiations.get(name, 0) + 1
        graph.upload(self._stream)
        return graph

    def _input_records(self, args, named) -> tuple:
        """(records, shapes) of the inputs, each checked (InputError)."""
        if named or len(args) != len(self._input_names):
            args = self._in_manifest_order(args, named)
        records, shapes = [], []
        for check, obj in zip(self._input_checks, args):
            rec = self._record(obj, check)
            if rec.owner is self:
                raise InputError(f"{check.what}: is an output of this session, whose buffers this run "
                                 "rewrites; copy it first, or pass it to another session")
            records.append(rec)
            shapes.append(rec.shape)
        return records, shapes

    def _in_manifest_order(self, args, named) -> list:
        """Positional and named inputs as one list in manifest order (InputError: too many, unknown,
        given twice, missing)."""
        names = self._input_names
        if len(args) > len(names):
            raise InputError(f"run() got {len(args)} positional inputs, but the package has "
                             f"{len(names)}: {names}")
        given = dict(zip(names, args))
        for name, value in named.items():
            if name not in names:
                raise InputError(f"unknown input {name!r}; the package's inputs are {names}")
            if name in given:
                raise InputError(f"input {name!r} was given both positionally and by name")
            given[name] = value
        missing = [n for n in names if n not in given]
        if missing:
            raise InputError(f"missing input(s) {missing}; the package's inputs are {names}")
        return [given[n] for n in names]

    def _out_records(self, out, out_shapes) -> dict:
        if not isinstance(out, dict):
            raise InputError("out= must be a dict {output name: device array}")
        records = {}
        for name, obj in out.items():
            o = self._output_index.get(name)
            if o is None:
                raise InputError(f"out= names unknown output {name!r}; the package's outputs are "
                                 f"{list(self._output_index)}")
            what = f"output '{name}' (out=)"
            if o in self._data_outputs:
                raise InputError(f"{what}: its dim 0 is data-dependent (known only after the run), so it "
                                 "cannot be written to an out= array; use the returned DeviceArray")
            rec = self._record(obj, ArrayCheck(what, self._outputs[o].dtype, self._ordinal))
            check_shape(what, rec.shape, out_shapes[o])
            check_writable(what, rec)
            records[name] = rec
        return records

    def _record(self, obj, check: ArrayCheck):
        """`obj` as an ArrayRecord, checked against its slot (InputError); inputs and out= arrays
        alike, so the rule lives once."""
        rec = as_record(obj, check.what, self._stream_int)
        if rec.device is None:  # __cuda_array_interface__ does not say which GPU: ask the driver
            rec.device = driver.pointer_device(rec.ptr)
        check.check(rec)
        return rec

    def _stage(self, i: int, spec, host: np.ndarray) -> int:
        """Copy a numpy input into its staging buffer (sized for the largest bucket, ordered on our
        stream)."""
        buf = self._staging.get(spec.name)
        if buf is None:
            nbytes = self._shapes.input_capacity(i) * dtypes.itemsize(spec.dtype)
            buf = self._staging[spec.name] = driver.mem_alloc(nbytes)
        host = np.ascontiguousarray(host)
        driver.copy_htod(buf, host.ctypes.data, host.nbytes, self._stream)
        return buf

    # ------------------------------------------------------------------ hooks used by DeviceArray
    def _true_shape(self, o: int) -> tuple:
        """Output o's shape after the last run, its data symbols read from the table's extents words
        (one device-to-host copy per run, shared by all such outputs). DeviceArray calls this only
        while it is current, so the last run is the one that produced it."""
        g, values, filled = self._last
        if filled is None:
            filled = self._read_data_symbols(g, values)
            self._last = (g, values, filled)
        return self._shapes.output_shape(o, filled)

    def _read_data_symbols(self, g: int, values) -> list:
        plan = self._shapes
        words = np.empty(len(plan.symbols), np.int64)
        self._device.make_current()
        driver.copy_dtoh(words.ctypes.data, self._table + self._package.extents_offset, words.nbytes, self._stream)
        self._check_indices()
        filled, bounds = list(values), plan.bounds(g)
        for k in plan.data_symbols:
            v = int(words[k])
            if not 0 <= v <= bounds[k]:
                raise InvalidPackageError(
                    f"data symbol {plan.symbols[k]!r} is {v} after graph {plan.graph_names[g]!r} ran, outside "
                    f"[0, {bounds[k]}] (its bound in this graph): a kernel did not compute it correctly")
            filled[k] = v
        return filled

    def _order_consumer(self, stream: int) -> None:
        """Make a consumer's stream (DLPack handle) wait for everything enqueued on ours."""
        if stream != self._stream_int:
            self._device.make_current()
            driver.stream_wait(driver.as_stream(stream), self._stream, self._event)

    def _to_host(self, dst_addr: int, src: int, nbytes: int) -> None:
        """Every copy to the host (.numpy(), read_state(), generate()'s tokens) waits for the runs
        before it, so it is a synchronising point: index errors are reported here."""
        self._device.make_current()
        driver.copy_dtoh(dst_addr, src, nbytes, self._stream)
        self._check_indices()

    def _check_indices(self) -> None:
        """Read the error word (8 bytes, ordered after every run enqueued so far); if a gather met an
        out-of-range index, zero the word and raise IndexOutOfRangeError (SPEC §5.4)."""
        checks = self._checks
        if checks is None:
            return
        word = self._error_word
        driver.copy_dtoh(word.ctypes.data, self._table + checks.offset, 8, self._stream)
        code = int(word[0])
        if code:
            word[0] = 0
            driver.memset_d8(self._table + checks.offset, 0, 8, self._stream)
            raise checks.error(code)

    # ------------------------------------------------------------------------------- lifecycle
    def sync(self) -> None:
        """Wait until every run enqueued so far has finished; raises IndexOutOfRangeError if one of
        them met an out-of-range gather index (see the module docstring)."""
        self._device.make_current()
        call(driver.cuda().cuStreamSynchronize, self._stream)
        self._check_indices()

    def close(self) -> None:
        """Free everything the session owns. Its DeviceArrays become stale."""
        if self._closed:
            return
        self._closed = True
        self._generation += 1
        if self._device.ctx is None:  # the package was closed under us
            return
        self._device.make_current()
        cu = driver.cuda()
        if self._stream is not None:
            call(cu.cuStreamSynchronize, self._stream)
        for graph in (*self._graphs, self._generation_graph):
            if graph is not None:
                graph.destroy()
        self._graphs = [None] * len(self._graphs)
        self._generation_graph = None
        for ptr in (self._arena, self._table, self._state, *self._out_ptrs, *self._staging.values()):
            if ptr is not None:
                driver.mem_free(ptr)
        self._arena = self._table = self._state = None
        self._out_ptrs, self._staging, self._keep = [], {}, None
        if self._event is not None:
            call(cu.cuEventDestroy, self._event)
        if self._stream is not None and self._own_stream:
            call(cu.cuStreamDestroy, self._stream)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: the driver may already be gone

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._generation} runs"
        return f"Session({[s.name for s in self._inputs]} -> {[s.name for s in self._outputs]}, {state})"
