"""Session: the per-caller state of a loaded package, and run().

A session owns the arena (intermediates), the argument table, one buffer per output, staging buffers
for numpy inputs (allocated on first use), a stream, and its instantiated graph. Sessions of one
package share its kernels and weights. Calls on one session are ordered on its stream, so the table
and the arena are never rewritten while an earlier launch may still read them.

run(): check every argument (InputError before anything is enqueued) -> copy numpy inputs to staging
-> write the data pointers into the table writer's parameter cells -> cuGraphExecKernelNodeSetParams
+ cuGraphLaunch. Sizes and strides are static, so only the pointer words change per call; all else is
computed when the session is made. Returns DeviceArrays, stale after the next run().

Streams: by default the session makes a stream that is *blocking* with respect to the legacy default
stream, so work that torch or CuPy enqueue on their default stream is ordered with our launches in
both directions, with no host synchronisation. If you produce inputs on another stream, synchronise
it first, or pass that stream as session(stream=...).
"""

from __future__ import annotations

import numpy as np

from . import driver, dtypes
from .arrays import DeviceArray, as_record
from .driver import call
from .errors import GraceRuntimeError, InputError
from .graph import ExecutableGraph
from .validate import check_array, check_writable, pointer_word_indices, table_words


def _nbytes(spec) -> int:
    n = dtypes.itemsize(spec.dtype)
    for d in spec.shape:
        n *= d
    return n


class Session:
    """Run a loaded package: `outputs = session.run(x=tensor)`; see the module docstring."""

    def __init__(self, package, poison: bool = False, stream=None):
        self._package = package
        self._device = package.device
        self._ordinal = package.device.ordinal
        self._closed = False
        self._generation = 0  # +1 per run(): DeviceArrays of older generations are stale
        self._keep = None     # the last run's arguments: alive while the GPU may still read them
        self._stream = self._event = self._graph = None
        self._own_stream = stream is None
        self._arena = self._table = None
        self._out_ptrs, self._staging = [], {}
        self._outputs_redirected = False  # did the last run point an output slot at an out= array?
        self._inputs, self._outputs = package.inputs, package.outputs
        self._input_names = [s.name for s in self._inputs]
        self._output_specs = {s.name: s for s in self._outputs}
        self._what = [f"input '{s.name}'" for s in self._inputs]  # for error messages, made once

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
            if poison:  # 0xFF bytes: NaN in every float format, -1 in every int format
                driver.memset_d8(self._arena, 0xFF, regions["arena"], self._stream)
                driver.memset_d8(self._table, 0xFF, regions["table"], self._stream)
            self._out_ptrs = [driver.mem_alloc(_nbytes(s)) for s in self._outputs]

            # Initial table words: inputs point nowhere yet (every run sets them), outputs at our buffers.
            shapes = package.slot_shapes
            ptrs = [0] * len(shapes)
            for spec, ptr in zip(self._outputs, self._out_ptrs):
                ptrs[spec.slot] = ptr
            words = table_words(shapes, ptrs)
            ptr_words = pointer_word_indices([len(s) for s in shapes])

            bases = {"weights": package.weights_ptr, "arena": self._arena, "table": self._table}
            self._graph = ExecutableGraph(package.plans, package.functions, bases, words)
            self._graph.upload(self._stream)
            # Where each slot's data-pointer word lives in the writer node's parameter cells.
            self._input_sinks = [self._graph.sinks(ptr_words[s.slot]) for s in self._inputs]
            self._output_sinks = [self._graph.sinks(ptr_words[s.slot]) for s in self._outputs]
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
        """Run the graph once. Inputs positionally (manifest order) and/or by name; `out` maps
        output names to device arrays to write instead of the session's buffers. Returns
        {output name: DeviceArray} (or your out= array). Asynchronous: use .numpy(), a protocol
        consumer or sync() to wait."""
        if self._closed:
            raise GraceRuntimeError("this session was closed")
        self._device.make_current()
        records = self._input_records(args, inputs)
        out_records = self._out_records(out) if out else None

        # Every argument is valid: from here on only device work is enqueued.
        for spec, rec, sinks in zip(self._inputs, records, self._input_sinks):
            ptr = rec.ptr
            if rec.host is not None:
                ptr = self._stage(spec, rec.host)
            elif rec.stream is not None:  # __cuda_array_interface__ v3: wait for the producer's stream
                driver.stream_wait(self._stream, driver.as_stream(rec.stream), self._event)
            for cells, pos in sinks:
                cells[pos] = ptr
        if out_records is not None or self._outputs_redirected:
            self._point_outputs(out_records or {})
        self._graph.launch(self._stream)

        self._generation += 1
        # Hold the caller's arrays (and DLPack capsules) until the next run, so a temporary passed to
        # run() is not freed and its memory reused while the graph may still read it.
        self._keep = (args, inputs, records, out)
        return {spec.name: out[spec.name] if out_records and spec.name in out_records else
                DeviceArray(ptr, spec.shape, spec.dtype, self._ordinal, self, spec.name)
                for spec, ptr in zip(self._outputs, self._out_ptrs)}

    def _point_outputs(self, out_records: dict) -> None:
        """Output slots point at the out= arrays given, and at our own buffers otherwise."""
        for spec, ptr, sinks in zip(self._outputs, self._out_ptrs, self._output_sinks):
            rec = out_records.get(spec.name)
            if rec is not None:
                if rec.stream is not None:
                    driver.stream_wait(self._stream, driver.as_stream(rec.stream), self._event)
                ptr = rec.ptr
            for cells, pos in sinks:
                cells[pos] = ptr
        self._outputs_redirected = bool(out_records)

    __call__ = run

    def _input_records(self, args, named) -> list:
        names = self._input_names
        if named or len(args) != len(names):
            if len(args) > len(names):
                raise InputError(f"run() got {len(args)} positional inputs, but the package has "
                                 f"{len(names)}: {names}")
            given = dict(zip(names, args))
            for name, value in named.items():
                if name not in self._input_names:
                    raise InputError(f"unknown input {name!r}; the package's inputs are {names}")
                if name in given:
                    raise InputError(f"input {name!r} was given both positionally and by name")
                given[name] = value
            missing = [n for n in names if n not in given]
            if missing:
                raise InputError(f"missing input(s) {missing}; the package's inputs are {names}")
            args = [given[n] for n in names]
        records = []
        for spec, what, obj in zip(self._inputs, self._what, args):
            rec = self._record(obj, what, spec)
            if rec.owner is self:
                raise InputError(f"{what}: is an output of this session, whose buffers this run "
                                 "rewrites; copy it first, or pass it to another session")
            records.append(rec)
        return records

    def _out_records(self, out) -> dict:
        if not isinstance(out, dict):
            raise InputError("out= must be a dict {output name: device array}")
        records = {}
        for name, obj in out.items():
            spec = self._output_specs.get(name)
            if spec is None:
                raise InputError(f"out= names unknown output {name!r}; the package's outputs are "
                                 f"{list(self._output_specs)}")
            what = f"output '{name}' (out=)"
            rec = self._record(obj, what, spec)
            check_writable(what, rec)
            records[name] = rec
        return records

    def _record(self, obj, what, spec):
        rec = as_record(obj, what, self._stream_int)
        if rec.device is None:  # __cuda_array_interface__ does not say which GPU: ask the driver
            rec.device = driver.pointer_device(rec.ptr)
        check_array(what, rec, spec.dtype, spec.shape, self._ordinal)
        return rec

    def _stage(self, spec, host: np.ndarray) -> int:
        """Copy a numpy input into this input's staging buffer (ordered on our stream)."""
        buf = self._staging.get(spec.name)
        if buf is None:
            buf = self._staging[spec.name] = driver.mem_alloc(_nbytes(spec))
        host = np.ascontiguousarray(host)
        driver.copy_htod(buf, host.ctypes.data, host.nbytes, self._stream)
        return buf

    # ------------------------------------------------------------------ hooks used by DeviceArray
    def _order_consumer(self, stream: int) -> None:
        """Make a consumer's stream (DLPack handle) wait for everything enqueued on ours."""
        if stream != self._stream_int:
            self._device.make_current()
            driver.stream_wait(driver.as_stream(stream), self._stream, self._event)

    def _to_host(self, dst_addr: int, src: int, nbytes: int) -> None:
        self._device.make_current()
        driver.copy_dtoh(dst_addr, src, nbytes, self._stream)

    # ------------------------------------------------------------------------------- lifecycle
    def sync(self) -> None:
        """Wait until every run enqueued so far has finished."""
        self._device.make_current()
        call(driver.cuda().cuStreamSynchronize, self._stream)

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
        if self._graph is not None:
            self._graph.destroy()
        for ptr in (self._arena, self._table, *self._out_ptrs, *self._staging.values()):
            if ptr is not None:
                driver.mem_free(ptr)
        self._arena = self._table = None
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
