"""grace.runtime on a machine without a GPU.

Three layers:
  * import hygiene and the no-device error (what CI sees for real);
  * the pure parts: dtype tables, input validation, table words, arch choice, graph planning, DLPack
    (the shape-bucket logic, runtime/calls.py, is tested in test_runtime_buckets.py);
  * the whole load -> session -> run path against FakeDriver, a stand-in for cuda.bindings.driver
    whose "device memory" is host memory and whose graph calls are recorded. It checks what the
    runtime *asks* the driver (kernel parameters, copies, launches); whether the driver does the right
    thing with it is tests/gpu/test_runtime_handmade.py's job.
"""

from __future__ import annotations

import copy
import ctypes
import subprocess
import sys

import numpy as np
import pytest

import grace.runtime as rt
from grace.runtime import calls, dlpack, driver, dtypes, graph, validate
from grace.runtime.arrays import DeviceArray, as_record
from grace.formats import ManifestError
from grace.runtime.errors import (InputError, InvalidPackageError, NoDeviceError, PackageMismatchError,
                                  StaleOutputError)
from grace.runtime.loader import pick_arch
from grace.runtime.validate import ArrayCheck, ArrayRecord

# ---------------------------------------------------------------------------- a tiny package

ROWS, COLS = 4, 32
SLOT_OFFSETS = [0, 48]                       # x, out: rank 2 -> 5 words each, slots 16-aligned
N_WORDS = 10
W_BYTES = ROWS * COLS * 4


def manifest(**over) -> dict:
    """out = x * 2 + w through the table; kernel 0 is the table writer. Binaries are fake bytes.
    A static package: no symbols, one graph with an empty bucket."""
    writer_params = [{"name": "table", "type": "*i64"}] + [{"name": f"w{k}", "type": "i64"} for k in range(N_WORDS)]
    m = {
        "format_version": [3, 0],
        "producer": {"grace": "0.1.0"},
        "model": {"name": "scale_add"},
        "archs": ["sm_90"],
        "options": {},
        "symbols": [],
        "inputs": [{"name": "x", "dtype": "float32", "shape": [ROWS, COLS], "slot": 0}],
        "outputs": [{"name": "out", "dtype": "float32", "shape": [ROWS, COLS], "slot": 1}],
        "table": {"nbytes": 96, "slots": [{"name": "x", "role": "input", "offset": 0, "rank": 2},
                                          {"name": "out", "role": "output", "offset": 48, "rank": 2}],
                  "extents": {"offset": 88, "count": 0}},
        "regions": {"weights": W_BYTES, "arena": 256, "table": 96, "state": 0},
        "state": [],
        "weights": [{"name": "w", "dtype": "float32", "shape": [ROWS, COLS], "offset": 0, "nbytes": W_BYTES}],
        "arena_buffers": [],
        "kernels": [
            {"name": "table_writer", "family": "table_writer", "params": writer_params, "num_warps": 1,
             "num_stages": 1, "shared": 0, "hidden_params": 2, "global_scratch_size": 0,
             "profile_scratch_size": 0, "binaries": {"sm_90": "cubin/table_writer.sm_90"}},
            {"name": "k_scale_add", "family": "pointwise",
             "params": [{"name": "x_slot", "type": "*i64"}, {"name": "w", "type": "*fp32"},
                        {"name": "out_slot", "type": "*i64"}],
             "num_warps": 4, "num_stages": 1, "shared": 0, "hidden_params": 2, "global_scratch_size": 0,
             "profile_scratch_size": 0, "binaries": {"sm_90": "cubin/k_scale_add.sm_90"}},
        ],
        "graphs": [{"name": "main", "bucket": {}, "arena": 256, "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": 96}] + [{"word": k} for k in range(N_WORDS)]},
            {"kernel": 1, "grid": [1, 1, 1], "deps": [0], "label": "scale_add",
             "args": [{"region": "table", "offset": 0, "nbytes": 8},
                      {"region": "weights", "offset": 0, "nbytes": W_BYTES},
                      {"region": "table", "offset": 48, "nbytes": 8}]},
        ]}],
    }
    m.update(over)
    return m


WEIGHT = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 7


def write(path, m=None):
    from grace.formats import encode_weights, write_package

    sections = {"cubin/table_writer.sm_90": b"\x7fELF fake writer",
                "cubin/k_scale_add.sm_90": b"\x7fELF fake kernel",
                "weights": encode_weights({"w": ("float32", WEIGHT.shape, WEIGHT.tobytes())})}
    write_package(path, m or manifest(), sections)
    return path


# ---------------------------------------------------------------------------- import, no device

def test_import_does_not_pull_torch_triton_or_the_driver():
    code = ("import sys, grace.runtime\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
            " or m.startswith('cuda.bindings.driver'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_runtime_imports_nothing_from_the_tools_or_the_compiler():
    """Read from the sources, lazy imports inside functions included: grace.runtime depends on
    grace.formats, numpy, msgpack and cuda-python only (the race proof it runs at load lives in
    grace.formats.races)."""
    import ast
    from pathlib import Path

    bad = []
    for path in sorted(Path(rt.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.name}: {n}" for n in names
                    if n.split(".")[0] in ("torch", "triton") or n.startswith(("grace.tools", "grace.aot"))]
    assert not bad, bad


def _has_gpu() -> bool:
    try:
        driver.Device(0).release()
        return True
    except NoDeviceError:
        return False


def test_load_without_gpu_raises_no_device_error(tmp_path):
    if _has_gpu():
        pytest.skip("this machine has a CUDA GPU")
    path = write(tmp_path / "m.grace")
    with pytest.raises(NoDeviceError, match="--interpret"):
        rt.load(path)


def test_no_device_error_mentions_interpret():
    assert "grace run --interpret" in str(NoDeviceError("no CUDA driver could be loaded"))


# ---------------------------------------------------------------------------- dtypes

def test_dtype_tables_agree_with_formats():
    from grace.formats.dtypes import DTYPES as FORMAT_DTYPES

    assert set(dtypes.DTYPES) == set(FORMAT_DTYPES)
    for name, (size, _, _) in dtypes.DTYPES.items():
        assert size == FORMAT_DTYPES[name][0]


@pytest.mark.parametrize("name", [n for n in dtypes.DTYPES if n != "bfloat16"])
def test_typestr_matches_numpy(name):
    assert dtypes.from_typestr(np.dtype(name).str) == name
    assert np.dtype(dtypes.typestr(name)) == np.dtype(name)


def test_typestr_and_dlpack_codes():
    assert dtypes.typestr("bfloat16") == "<V2" and dtypes.from_typestr("<V2") == "bfloat16"
    assert dtypes.from_typestr(">f4") is None      # big-endian is refused
    assert dtypes.from_typestr(">u1") == "uint8"   # ...except where byte order is moot
    assert dtypes.from_typestr("<c8") is None
    assert dtypes.dlpack_code("bfloat16") == (4, 16)
    assert dtypes.dlpack_code("bool") == (6, 8)
    assert dtypes.from_dlpack(2, 32) == "float32"
    assert dtypes.from_dlpack(2, 32, lanes=4) is None
    assert dtypes.from_torch("torch.bfloat16") == "bfloat16"
    assert dtypes.from_torch("torch.bfloat16") == "bfloat16"   # remembered
    assert dtypes.from_torch("torch.float16") == "float16"


# ---------------------------------------------------------------------------- validation

def rec(ptr=0x10000, shape=(ROWS, COLS), strides=None, dtype="float32", device=0):
    return ArrayRecord(ptr, shape, strides, dtype, device)


def check(r):
    validate.check_array("input 'x'", r, "float32", 0)


def test_valid_record_passes():
    check(rec())
    check(rec(strides=(COLS, 1)))
    check(rec(device="cpu", ptr=3, strides=(1, ROWS)))  # host copies: layout does not matter
    check(rec(shape=(7, 3, 2)))  # sizes are ShapePlan's business (inputs) or check_shape's (out=)


@pytest.mark.parametrize("bad, message", [
    (rec(dtype="float16"), r"input 'x': dtype is float16, expected float32"),
    (rec(strides=(1, ROWS)), r"input 'x': strides .* not C-contiguous.*contiguous\(\)"),
    (rec(ptr=0x10004), r"input 'x': data pointer 0x10004 is not 16-byte aligned"),
    (rec(device=1), r"input 'x': is on cuda:1, but the package is loaded on cuda:0"),
    (rec(device=None), r"input 'x': data pointer .* is not CUDA device memory"),
])
def test_invalid_records_name_the_input(bad, message):
    with pytest.raises(InputError, match=message):
        check(bad)


# every record the checks see: (record, the error's message or None when it passes)
RECORDS = [
    (rec(), None),
    (rec(strides=(COLS, 1)), None),                         # exactly the C-contiguous strides
    (rec(shape=(1, COLS), strides=(999, 1)), None),         # a size-1 dim: any stride
    (rec(shape=(ROWS, 1), strides=(1, 7)), None),
    (rec(shape=(0, COLS), ptr=0x10004), None),              # empty: any address
    (rec(shape=(7, 3, 2)), None),
    (rec(device="cpu", ptr=3, strides=(1, ROWS)), None),    # host copies: layout does not matter
    (rec(dtype="float16"), "input 'x': dtype is float16, expected float32"),
    (rec(dtype="float16", device="cpu"), "input 'x': dtype is float16, expected float32"),
    (rec(strides=(1, ROWS)), "input 'x': strides [1, 4] are not C-contiguous (expected [32, 1]); "
                             "pass a contiguous array, e.g. x.contiguous()"),
    (rec(strides=(COLS, 2)), "input 'x': strides [32, 2] are not C-contiguous (expected [32, 1]); "
                             "pass a contiguous array, e.g. x.contiguous()"),
    (rec(ptr=0x10004), "input 'x': data pointer 0x10004 is not 16-byte aligned (a view with an offset?); "
                       "pass a fresh contiguous copy, e.g. x.clone()"),
    (rec(device=1), "input 'x': is on cuda:1, but the package is loaded on cuda:0"),
    (rec(device=None), "input 'x': data pointer 0x10000 is not CUDA device memory"),
    (rec(device=1, dtype="int64", strides=(1, ROWS)), "input 'x': dtype is int64, expected float32"),
]


@pytest.mark.parametrize("record, message", RECORDS)
def test_array_check_is_check_array(record, message):
    """run()'s shortcut (validate.ArrayCheck) passes and refuses exactly what check_array does,
    with the same message, twice (the second time with the shape's strides remembered)."""
    fast = validate.ArrayCheck("input 'x'", "float32", 0)
    for _ in range(2):
        for checker in (check, fast.check):
            if message is None:
                checker(record)
            else:
                with pytest.raises(InputError) as e:
                    checker(record)
                assert str(e.value) == message


def test_size_one_dims_may_have_any_stride():
    assert validate.is_contiguous((1, 4), (999, 1))
    assert validate.is_contiguous((4, 1), (1, 7))
    assert not validate.is_contiguous((2, 4), (1, 2))


def test_out_arrays_must_be_writable_device_arrays():
    with pytest.raises(InputError, match="out= needs a device array"):
        validate.check_writable("output 'out' (out=)", rec(device="cpu"))
    r = rec()
    r.readonly = True
    with pytest.raises(InputError, match="read-only"):
        validate.check_writable("output 'out' (out=)", r)


def test_check_shape_for_out_arrays():
    validate.check_shape("output 'out' (out=)", (4, 32), (4, 32))
    with pytest.raises(InputError, match=r"output 'out' \(out=\): shape is \[4, 31\], expected \[4, 32\]"):
        validate.check_shape("output 'out' (out=)", (4, 31), (4, 32))


def test_table_words():
    assert validate.contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert calls.table_words([100, 200, 300], [(2, 3), (5,), ()]) == [100, 2, 3, 3, 1, 200, 5, 1, 300]
    assert calls.table_words([100], [(2, 3)], [7, 0]) == [100, 2, 3, 3, 1, 7, 0]  # symbol words last


# ---------------------------------------------------------------------------- arrays in

class CaiArray:
    def __init__(self, ptr, shape, typestr="<f4", strides=None, version=3):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": version}


def test_as_record_from_cai_converts_byte_strides():
    r = as_record(CaiArray(0x1000, (4, 32), strides=(128, 4)), "input 'x'", 1)
    assert (r.ptr, r.shape, r.strides, r.dtype, r.device) == (0x1000, (4, 32), (32, 1), "float32", None)


def test_as_record_from_numpy_is_a_host_record():
    a = np.zeros((4, 32), np.float32)
    r = as_record(a, "input 'x'", 1)
    assert r.device == "cpu" and r.host is a and r.dtype == "float32"


def test_as_record_rejects_unknown_objects_and_cpu_torch():
    with pytest.raises(InputError, match="input 'x': expected a CUDA array"):
        as_record([1, 2, 3], "input 'x'", 1)
    torch = pytest.importorskip("torch")
    with pytest.raises(InputError, match="CPU tensor"):
        as_record(torch.zeros(3), "input 'x'", 1)


def test_a_torch_tensor_keeps_its_size_and_shows_strides_only_when_not_contiguous():
    """run()'s hot path asks a tensor as little as it can (arrays._from_torch): the torch.Size is
    the record's shape (and works as the shape plan's cache key), the strides are read only when
    torch's contiguity says no, and those go through the same checks as any other array's."""
    torch = pytest.importorskip("torch")

    class OnDevice(torch.Tensor):   # a CPU tensor that says it is on cuda:0, taking torch's path
        def get_device(self):
            return 0
    OnDevice.__module__ = "torch"
    check = ArrayCheck("input 'x'", "float32", 0)
    x = torch.zeros(4, 32).as_subclass(OnDevice)
    rec = as_record(x, "input 'x'", 1)
    assert (rec.ptr, rec.shape, rec.strides, rec.dtype, rec.device) == (x.data_ptr(), (4, 32), None, "float32", 0)
    assert {(4, 32): "hit"}[rec.shape] == "hit" and hash(rec.shape) == hash((4, 32))
    check.check(rec)
    t = as_record(x.t(), "input 'x'", 1)
    assert t.shape == (32, 4) and t.strides == (1, 32)
    with pytest.raises(InputError, match=r"strides \[1, 32\] are not C-contiguous \(expected \[4, 1\]\)"):
        check.check(t)
    with pytest.raises(InputError, match="not C-contiguous"):
        check.check(as_record(x[:, :1], "input 'x'", 1))   # size 1 at the end, dim 0's stride is 32
    size_one = torch.zeros(3, 1, 5).as_subclass(OnDevice).transpose(0, 1)   # [1, 3, 5], strides (5, 5, 1)
    assert as_record(size_one, "input 'x'", 1).strides is None   # a size-1 dim may have any stride
    empty = torch.zeros(0, 3).as_subclass(OnDevice).t()   # torch: contiguous (nothing to read)
    assert as_record(empty, "input 'x'", 1).strides is None
    scalar = as_record(torch.zeros(()).as_subclass(OnDevice), "input 'x'", 1)   # 0-d
    assert scalar.shape == () and scalar.strides is None and {(): "hit"}[scalar.shape] == "hit"
    check.check(scalar)


def test_dlpack_export_round_trips_through_numpy_and_torch():
    host = np.arange(12, dtype=np.float32)
    cap = dlpack.export_capsule(host.ctypes.data, (3, 4), 4, (2, 32), (dlpack.KDL_CPU, 0), owner=host)
    t = dlpack.parse_capsule(cap)
    assert (t.ptr, t.device, t.code_bits_lanes, t.shape) == (host.ctypes.data, (1, 0), (2, 32, 1), (3, 4))
    torch = pytest.importorskip("torch")
    bits = (np.array([1.0, -2.5], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cap = dlpack.export_capsule(bits.ctypes.data, (2,), 2, (4, 16), (dlpack.KDL_CPU, 0), owner=bits)
    t = torch.from_dlpack(cap)  # consumes the capsule
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, -2.5]


def test_parse_capsule_reads_torch_views():
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[:, 1:]
    t = dlpack.parse_capsule(x.__dlpack__())
    assert (t.ptr, t.code_bits_lanes, t.shape, t.strides) == (x.data_ptr(), (4, 16, 1), (3, 3), (4, 1))


# ---------------------------------------------------------------------------- DeviceArray

class Owner:
    _generation, _closed, _cai_stream = 0, False, 1


def test_device_array_goes_stale_when_its_session_runs_again():
    owner = Owner()
    a = DeviceArray(0x2000, (2, 3), "float32", 0, owner, "out0")
    assert a.shape == (2, 3) and a.dtype == "float32"
    assert a.__cuda_array_interface__["typestr"] == "<f4"
    owner._generation += 1
    for use in (lambda: a.shape, lambda: a.numpy(), lambda: a.__cuda_array_interface__,
                lambda: a.__dlpack__(), lambda: a.ptr):
        with pytest.raises(StaleOutputError, match=r"output 'out0' was overwritten by a later run\(\)"):
            use()
    assert "stale" in repr(a)
    owner._closed = True
    with pytest.raises(StaleOutputError, match="closed"):
        a.shape


def test_a_session_array_is_what_the_constructor_makes():
    """run() makes its outputs with DeviceArray.of_session (no conversions): the same array."""
    owner = Owner()
    owner._generation = 7
    fast = DeviceArray.of_session(owner, 0x2000, (2, 3), "float32", 1, "out0")
    slow = DeviceArray(0x2000, (2, 3), "float32", 1, owner, "out0")
    assert all(getattr(fast, k) == getattr(slow, k) for k in DeviceArray.__slots__ if k != "__weakref__")
    owner._generation += 1
    with pytest.raises(StaleOutputError):
        fast.shape


def test_device_array_protocols():
    a = DeviceArray(0x2000, (2, 3), "bfloat16", 1)
    cai = a.__cuda_array_interface__
    assert cai["typestr"] == "<V2" and cai["version"] == 3 and cai["data"] == (0x2000, False)
    assert a.__dlpack_device__() == (2, 1)
    with pytest.raises(BufferError):
        a.__dlpack__(copy=True)


# ---------------------------------------------------------------------------- arch, graph plan

def test_pick_arch():
    assert pick_arch((9, 0), ["sm_80", "sm_90"]) == "sm_90"
    assert pick_arch((9, 0), ["sm_90a"]) == "sm_90a"
    assert pick_arch((8, 9), ["sm_80", "sm_86"]) == "sm_86"
    with pytest.raises(PackageMismatchError, match=r"sm_80, sm_100.*the GPU is sm_90"):
        pick_arch((9, 0), ["sm_80", "sm_100"])


def test_plan_graph_and_param_values():
    plans = graph.plan_graph(manifest())
    assert [p.block for p in plans] == [32, 128]
    writer, k = plans
    assert writer.args[0] == ("region", "table", 0) and writer.args[-2:] == (("zero",), ("zero",))
    words = list(range(100, 100 + N_WORDS))
    bases = {"weights": 0x10000, "arena": 0x20000, "table": 0x30000}
    values, word_pos = graph.param_values(writer, bases, words)
    assert values == [0x30000, *words, 0, 0]
    assert word_pos == [(1 + i, i) for i in range(N_WORDS)]
    values, word_pos = graph.param_values(k, bases, words)
    assert values == [0x30000, 0x10000, 0x30000 + 48, 0, 0] and word_pos == []


def _node_arg(m, node, arg, value):
    m["graphs"][0]["nodes"][node]["args"][arg] = value
    return m


def _param_type(m, kernel, param, ptype):
    m["kernels"][kernel]["params"][param]["type"] = ptype
    return m


def _graph_arena(m, arena):
    m["graphs"][0]["arena"] = arena
    return m


@pytest.mark.parametrize("m, message", [
    (_node_arg(manifest(), 1, 1, {"region": "weights", "offset": 256, "nbytes": W_BYTES}),
     r"args\[1\]: weights range \[256, 768\) exceeds the weights region"),
    (_node_arg(manifest(), 1, 1, {"region": "arena", "offset": 128, "nbytes": 256}),
     r"arena range \[128, 384\) exceeds the graph's arena \(256 bytes\)"),
    (_node_arg(_graph_arena(manifest(), 64), 1, 1, {"region": "arena", "offset": 0, "nbytes": 128}),
     r"exceeds the graph's arena \(64 bytes\)"),
    (_graph_arena(manifest(), 512), r"graphs\[0\].arena: 512 bytes exceed regions.arena \(256 bytes\)"),
    (_node_arg(manifest(), 0, 3, {"word": N_WORDS}), "table word 10 is out of range .the table has 10 words"),
    (_node_arg(manifest(), 1, 1, {"region": "state", "offset": 0, "nbytes": 8}),  # regions.state is 0
     r"state range \[0, 8\) exceeds the state region \(0 bytes\)"),
    (_node_arg(manifest(), 1, 1, {"region": "scratch", "offset": 0}), "got 'scratch'"),
    (_param_type(manifest(), 0, 1, "u64"), r"words need an integer scalar: i64/i32"),   # SPEC §3
])
def test_plan_graph_takes_the_format_checks(m, message):
    """The runtime checks a manifest once, with grace.formats' validator (a dict given to a
    planner is validated first; load() passes the view read_package validated)."""
    with pytest.raises(ManifestError, match=message):
        graph.plan_graph(m)


def test_plan_graph_refuses_scratch_memory():
    m = manifest()
    m["kernels"][1]["global_scratch_size"] = 1024
    with pytest.raises(PackageMismatchError, match="scratch"):
        graph.plan_graph(m)


# ---------------------------------------------------------------------------- FakeDriver

class FakeDriver:
    """cuda.bindings.driver with host memory for device memory and a recorder for graph calls.
    Structs, handles and enums are the real ones."""

    def __init__(self, n_params=None):
        from cuda.bindings import driver as real

        self._real = real
        self.ok = real.CUresult.CUDA_SUCCESS
        self.memory = {}          # address -> ctypes buffer
        self.functions = {}       # CUfunction int -> name
        self.nodes = []           # (function name, grid, block, shared, kernelParams address, deps, graph)
        self.n_params = {"table_writer": 1 + N_WORDS + 2, **(n_params or {})}  # by kernel name
        self.graphs = 0           # cuGraphCreate calls
        self.instantiated = []    # graph handle per cuGraphInstantiate
        self.set_params = []      # (node index, kernelParams address) per SetParams
        self.launches = []        # the writer's parameter values each launch used
        self.node_values = {}     # node index -> parameter values copied when it was added (writers)
        self.exec_values = {}     # exec handle -> {node index: the values that exec launches with}
        self.launched = []        # (exec handle, writer node index) per launch
        self.copies_htod = 0
        self.edges = []           # (from node, to node, type, from_port) per added dependency
        self.registered = []      # (address, nbytes, flags) per cuMemHostRegister
        self.unregistered = []
        self.refuse_register = False
        # what the "binary" of each kernel reports (cuFuncGetParamInfo, cuFuncGetAttribute), by
        # kernel name: the parameter sizes and the attributes; a kernel not listed answers like a
        # driver without cuFuncGetParamInfo (CUDA_ERROR_NOT_SUPPORTED) and with default attributes
        self.binaries = {}

    def __getattr__(self, name):
        return getattr(self._real, name)

    # device & context
    def cuInit(self, flags): return (self.ok,)
    def cuDeviceGetCount(self): return (self.ok, 1)
    def cuDeviceGet(self, i): return (self.ok, self._real.CUdevice(i))
    def cuDeviceGetName(self, n, dev): return (self.ok, b"Fake H200\0\0\0")
    def cuDevicePrimaryCtxRetain(self, dev): return (self.ok, self._real.CUcontext(0xC0))
    def cuDevicePrimaryCtxRelease(self, dev): return (self.ok,)
    def cuCtxSetCurrent(self, ctx): return (self.ok,)

    SHARED_OPTIN = 232448   # an H200's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

    def cuDeviceGetAttribute(self, attr, dev):
        a = self._real.CUdevice_attribute
        if attr == a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
            return (self.ok, self.SHARED_OPTIN)
        return (self.ok, 9 if attr == a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR else 0)

    # modules
    def cuModuleLoadData(self, image):
        assert bytes(image).startswith(b"\x7fELF")
        return (self.ok, self._real.CUmodule(0x100 + len(self.functions)))

    def cuModuleGetFunction(self, module, name):
        f = self._real.CUfunction(0x1000 + len(self.functions))
        self.functions[int(f)] = name.decode()
        return (self.ok, f)

    def cuFuncSetAttribute(self, *a): return (self.ok,)
    def cuModuleUnload(self, m): return (self.ok,)

    def cuFuncGetParamInfo(self, f, i):
        binary = self.binaries.get(self.functions[int(f)])
        if binary is None or "params" not in binary:
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED, 0, 0)
        sizes = binary["params"]
        if not 0 <= i < len(sizes):
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)
        return (self.ok, 8 * i, sizes[i])

    def cuFuncGetAttribute(self, attr, f):
        a = self._real.CUfunction_attribute
        binary = self.binaries.get(self.functions[int(f)], {})
        if attr == a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
            return (self.ok, binary.get("max_threads", 1024))
        if attr == a.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
            return (self.ok, binary.get("static_shared", 0))
        if attr == a.CU_FUNC_ATTRIBUTE_NUM_REGS:
            return (self.ok, binary.get("regs", 32))
        return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    # memory
    def cuMemAlloc(self, n):
        buf = ctypes.create_string_buffer(n + 256)
        addr = (ctypes.addressof(buf) + 255) // 256 * 256
        self.memory[addr] = (buf, n)
        return (self.ok, self._real.CUdeviceptr(addr))

    def cuMemFree(self, p):
        del self.memory[int(p)]
        return (self.ok,)

    def cuMemHostRegister(self, p, n, flags):
        if self.refuse_register:
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        self.registered.append((p, n, flags))
        return (self.ok,)

    def cuMemHostUnregister(self, p):
        assert self.registered and self.registered[-1][0] == p
        self.unregistered.append(p)
        return (self.ok,)

    def cuMemcpyHtoD(self, dst, src, n):
        self.copies_htod += 1
        ctypes.memmove(int(dst), src, n)
        return (self.ok,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream): return self.cuMemcpyHtoD(dst, src, n)

    def cuMemcpyDtoH(self, dst, src, n):
        ctypes.memmove(dst, int(src), n)
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream): return self.cuMemcpyDtoH(dst, src, n)

    def cuMemsetD8Async(self, p, value, n, stream):
        ctypes.memset(int(p), value, n)
        return (self.ok,)

    def cuPointerGetAttribute(self, attr, ptr):
        for addr, (_, n) in self.memory.items():
            if addr <= ptr < addr + n:
                return (self.ok, 0)
        return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE, None)

    # streams & events
    def cuStreamCreate(self, flags): return (self.ok, self._real.CUstream(0x5000))
    def cuStreamDestroy(self, s): return (self.ok,)
    def cuStreamSynchronize(self, s): return (self.ok,)
    def cuStreamWaitEvent(self, s, e, flags): return (self.ok,)
    def cuEventCreate(self, flags): return (self.ok, self._real.CUevent(0x6000))
    def cuEventRecord(self, e, s): return (self.ok,)
    def cuEventDestroy(self, e): return (self.ok,)

    # graphs: graph handles 0x7000 + k, their execs 0x8000 + k
    def cuGraphCreate(self, flags):
        self.graphs += 1
        return (self.ok, self._real.CUgraph(0x7000 + self.graphs))

    def cuGraphAddKernelNode(self, g, deps, n, p):
        assert n == len(deps)
        name = self.functions[int(p.func)]
        self.nodes.append((name, (p.gridDimX, p.gridDimY, p.gridDimZ),
                           (p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes, p.kernelParams,
                           [int(d) - 1 for d in deps], int(g)))
        if name in self.n_params:   # the driver copies the values now (and again at each SetParams)
            self.node_values[len(self.nodes) - 1] = read_params(p.kernelParams, self.n_params[name])
        return (self.ok, self._real.CUgraphNode(len(self.nodes)))

    def cuGraphAddDependencies(self, g, from_, to, edges, n):
        assert n == len(from_) == len(to) == len(edges)
        for a, b, e in zip(from_, to, edges):
            self.edges.append((int(a) - 1, int(b) - 1, int(e.type), int(e.from_port)))
        return (self.ok,)

    def cuGraphInstantiate(self, g, flags):
        self.instantiated.append(int(g))
        self.exec_values[int(g) + 0x1000] = {i: list(v) for i, v in self.node_values.items()
                                             if self.nodes[i][6] == int(g)}
        return (self.ok, self._real.CUgraphExec(int(g) + 0x1000))

    def cuGraphUpload(self, e, s): return (self.ok,)

    def cuGraphExecKernelNodeSetParams(self, e, node, p):
        i = int(node) - 1
        assert self.nodes[i][6] + 0x1000 == int(e), "SetParams on a node of another graph"
        self.set_params.append((i, p.kernelParams))
        self.exec_values[int(e)][i] = read_params(p.kernelParams, self.n_params[self.nodes[i][0]])
        return (self.ok,)

    def cuGraphLaunch(self, e, s):
        """Records the values the exec's table writer runs with: the node's as added, or as set
        last on this exec (the driver's copies; the runtime's cells may have changed since)."""
        ((node, values),) = self.exec_values[int(e)].items()
        self.launches.append(list(values))
        self.launched.append((int(e), node))
        return (self.ok,)

    def cuGraphExecDestroy(self, e): return (self.ok,)
    def cuGraphDestroy(self, g): return (self.ok,)


def read_params(address: int, n: int) -> list:
    """Dereference a kernelParams void*[] of n 8-byte parameters."""
    pointers = (ctypes.c_void_p * n).from_address(address)
    return [ctypes.c_uint64.from_address(p).value for p in pointers]


# what the binaries of manifest()'s two kernels report: every parameter 8 bytes, two hidden ones
BINARIES = {"table_writer": {"params": [8] * (1 + N_WORDS + 2), "max_threads": 32},
            "k_scale_add": {"params": [8] * (3 + 2), "max_threads": 128}}


@pytest.fixture
def fake(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")
    f = FakeDriver()
    f.binaries = copy.deepcopy(BINARIES)
    monkeypatch.setattr(driver, "_cu", f)
    return f


@pytest.fixture
def pkg(fake, tmp_path):
    p = rt.load(write(tmp_path / "m.grace"))
    yield p
    p.close()


def test_load_uploads_weights_and_plans_the_graph(fake, pkg):
    assert pkg.arch == "sm_90" and [s.name for s in pkg.inputs] == ["x"]
    uploaded = np.ctypeslib.as_array((ctypes.c_float * (ROWS * COLS)).from_address(pkg.weights_ptr))
    np.testing.assert_array_equal(uploaded.reshape(ROWS, COLS), WEIGHT)


def test_big_weights_are_copied_from_registered_pages(fake, tmp_path, monkeypatch):
    """Above REGISTER_MIN_NBYTES the weights section's pages are registered read-only (page-aligned,
    covering the section) for the copies and unregistered after (here the threshold is lowered so
    the small package qualifies)."""
    from grace.runtime import upload

    monkeypatch.setattr(upload, "REGISTER_MIN_NBYTES", 1)
    pkg = rt.load(write(tmp_path / "m.grace"))
    assert pkg.load_stats["upload"] == "registered"
    assert pkg.load_stats["weights_nbytes"] == WEIGHT.nbytes
    ((base, nbytes, flags),) = fake.registered
    assert base % 4096 == 0 and nbytes % 4096 == 0 and flags == 0x08
    assert fake.unregistered == [base]
    uploaded = np.ctypeslib.as_array((ctypes.c_float * (ROWS * COLS)).from_address(pkg.weights_ptr))
    np.testing.assert_array_equal(uploaded.reshape(ROWS, COLS), WEIGHT)
    pkg.close()


def test_refused_registration_falls_back_to_pageable_copies(fake, tmp_path, monkeypatch):
    from grace.runtime import upload

    monkeypatch.setattr(upload, "REGISTER_MIN_NBYTES", 1)
    fake.refuse_register = True
    pkg = rt.load(write(tmp_path / "m.grace"))
    assert pkg.load_stats["upload"] == "pageable" and fake.unregistered == []
    uploaded = np.ctypeslib.as_array((ctypes.c_float * (ROWS * COLS)).from_address(pkg.weights_ptr))
    np.testing.assert_array_equal(uploaded.reshape(ROWS, COLS), WEIGHT)
    pkg.close()


def test_small_weights_are_copied_without_registering(fake, pkg):
    assert pkg.load_stats["upload"] == "pageable" and fake.registered == []
    assert set(pkg.load_stats) >= {"read_s", "kernels_s", "weights_s", "total_s"}


def _pdl_manifest():
    """scale_add twice, the second after the first by a programmatic edge (format 3.2)."""
    m = manifest()
    second = copy.deepcopy(m["graphs"][0]["nodes"][1])
    second.update(deps=[0, 1], programmatic=[1], label="scale_add_again")
    m["graphs"][0]["nodes"].append(second)
    return m


@pytest.mark.parametrize("pdl", [True, False])
def test_programmatic_deps_become_programmatic_edges(fake, tmp_path, pdl):
    """`programmatic` deps are added with cuGraphAddDependencies and programmatic edge data;
    load(pdl=False) builds them as ordinary edges of cuGraphAddKernelNode."""
    cu = fake._real
    pkg = rt.load(write(tmp_path / "m.grace", _pdl_manifest()), pdl=pdl)
    pkg.session().run(np.ones((ROWS, COLS), np.float32))
    deps = [node[5] for node in fake.nodes]
    if pdl:
        assert deps == [[], [0], [0]]
        assert fake.edges == [(1, 2, int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC),
                               int(cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC))]
    else:
        assert deps == [[], [0], [0, 1]] and fake.edges == []
    pkg.close()


def test_programmatic_deps_must_be_deps(fake, tmp_path):
    from grace.formats import ManifestError
    m = _pdl_manifest()
    m["graphs"][0]["nodes"][2]["programmatic"] = [0]
    with pytest.raises(ManifestError, match="table writer"):
        write(tmp_path / "m.grace", m)
    m["graphs"][0]["nodes"][2].update(deps=[0], programmatic=[1])
    with pytest.raises(ManifestError, match="not one of the deps"):
        write(tmp_path / "m.grace", m)


def test_session_builds_the_graph_from_the_manifest(fake, tmp_path):
    pkg = rt.load(write(tmp_path / "m.grace"), instantiate="eager")
    sess = pkg.session(poison=True)
    assert sess.instantiations == {"main": 1} and sess.last_graph is None
    (w_name, w_grid, w_block, _, w_params, w_deps, _), (k_name, _, k_block, _, k_params, k_deps, _) = fake.nodes
    assert (w_name, w_grid, w_block, w_deps) == ("table_writer", (1, 1, 1), (32, 1, 1), [])
    assert (k_name, k_block, k_deps) == ("k_scale_add", (128, 1, 1), [0])
    assert read_params(k_params, 5) == [sess._table, pkg.weights_ptr, sess._table + 48, 0, 0]
    writer = read_params(w_params, 1 + N_WORDS + 2)
    assert writer == [sess._table] + [0] * N_WORDS + [0, 0]  # every launch writes all words
    arena = (ctypes.c_uint8 * 256).from_address(sess._arena)
    assert set(arena) == {0xFF}
    pkg.close()


def test_lazy_session_builds_the_graph_on_the_first_run(fake, pkg):
    sess = pkg.session()
    assert fake.nodes == [] and sess.instantiations == {}
    sess.run(np.ones((ROWS, COLS), np.float32))
    sess.run(np.ones((ROWS, COLS), np.float32))
    assert len(fake.nodes) == 2 and sess.instantiations == {"main": 1} and sess.last_graph == "main"


def test_load_rejects_an_unknown_instantiate_mode(tmp_path):
    with pytest.raises(ValueError, match=r"instantiate='sometimes': expected one of 'lazy', 'eager'"):
        rt.load(tmp_path / "does-not-matter.grace", instantiate="sometimes")


# ---------------------------------------------------------------------------- kernels vs their cubin

def test_load_checks_each_kernel_against_what_its_binary_reports(fake, pkg):
    """cuFuncGetParamInfo and cuFuncGetAttribute are asked about every kernel (grace.runtime.abi):
    here the fake's binaries match the manifest, so the load goes through and keeps the answers."""
    assert [info["params"] for info in pkg.kernel_info] == [BINARIES["table_writer"]["params"],
                                                            BINARIES["k_scale_add"]["params"]]
    assert [info["max_threads"] for info in pkg.kernel_info] == [32, 128]
    assert all(info["params_checked"] for info in pkg.kernel_info)


@pytest.mark.parametrize("binary, error, message", [
    ({"params": [8] * 6}, "KernelMismatchError",
     r"kernel k_scale_add: its binary takes at least 6 parameters, but the manifest describes 3 "
     r"\(kernels\[\].params\) \+ 2 hidden \(kernels\[\].hidden_params\) = 5"),
    ({"params": [8] * 4}, "KernelMismatchError", r"its binary takes 4 parameters, but .* = 5"),
    ({"params": [8, 4, 8, 8, 8]}, "KernelMismatchError",
     r"kernel k_scale_add: parameter 1 \(w: \*fp32\) is 4 bytes in its binary, but 8 in the manifest"),
    ({"params": [8] * 5, "max_threads": 64}, "KernelMismatchError",
     r"launched with 128 threads per block \(kernels\[\].num_warps = 4\), but its binary allows at most 64"),
    ({"params": [8] * 5, "static_shared": 232449}, "PackageMismatchError",
     r"kernel k_scale_add needs 232449 bytes of static and 0 of dynamic shared memory, 232449 in all, "
     r"but this GPU allows 232448 per block"),
])
def test_a_kernel_its_binary_contradicts_is_refused_before_any_graph(fake, tmp_path, binary, error, message):
    from grace.runtime import errors

    fake.binaries["k_scale_add"] = {"max_threads": 128, **binary}
    with pytest.raises(getattr(errors, error), match=message):
        rt.load(write(tmp_path / "m.grace"))
    assert fake.nodes == [] and fake.graphs == 0   # nothing was built


def test_a_driver_without_param_info_skips_that_check(fake, tmp_path):
    """Before CUDA 12.4 there is no cuFuncGetParamInfo: the attributes are still checked."""
    del fake.binaries["k_scale_add"]["params"]
    pkg = rt.load(write(tmp_path / "m.grace"))
    assert [info["params_checked"] for info in pkg.kernel_info] == [True, False]
    pkg.close()

def test_run_writes_pointers_into_the_table_writer(fake, pkg):
    sess = pkg.session()
    x = np.ones((ROWS, COLS), np.float32)
    out = sess.run(x)["out"]
    (launch,) = fake.launches
    staging = sess._staging["x"]
    assert launch == [sess._table, staging, ROWS, COLS, COLS, 1, sess._out_ptrs[0], ROWS, COLS, COLS, 1, 0, 0]
    np.testing.assert_array_equal(
        np.ctypeslib.as_array((ctypes.c_float * (ROWS * COLS)).from_address(staging)), x.ravel())

    # "Run" the kernel by hand, then read the output back.
    host = np.full((ROWS, COLS), 3.5, np.float32)
    ctypes.memmove(out.ptr, host.ctypes.data, host.nbytes)
    np.testing.assert_array_equal(out.numpy(), host)

    # A device input (here: fake device memory through __cuda_array_interface__) is used in place.
    dev = driver.mem_alloc(W_BYTES)
    out2 = sess.run(x=CaiArray(dev, (ROWS, COLS)))["out"]
    assert fake.launches[-1][1] == dev
    with pytest.raises(StaleOutputError):
        out.numpy()
    assert out2.shape == (ROWS, COLS)


def test_run_with_out_and_dlpack_inputs(fake, pkg):
    sess = pkg.session()
    a = driver.mem_alloc(W_BYTES)
    b = driver.mem_alloc(W_BYTES)

    class DlpackOnly:  # a producer that speaks DLPack only (reuses DeviceArray's exporter)
        def __init__(self, ptr):
            self.array = DeviceArray(ptr, (ROWS, COLS), "float32", 0)

        def __dlpack__(self, stream=None):
            return self.array.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    target = DlpackOnly(b)
    result = sess.run(x=DlpackOnly(a), out={"out": target})
    assert result["out"] is target
    assert fake.launches[-1][1] == a and fake.launches[-1][6] == b
    sess.run(x=DlpackOnly(a))  # without out= the table points back at the session's buffer
    assert fake.launches[-1][6] == sess._out_ptrs[0]


@pytest.mark.parametrize("call, message", [
    (lambda s: s.run(), r"missing input\(s\) \['x'\]"),
    (lambda s: s.run(y=1), "unknown input 'y'"),
    (lambda s: s.run(np.zeros((ROWS, COLS), np.float32), x=1), "both positionally and by name"),
    (lambda s: s.run(np.zeros((ROWS, COLS), np.float64)), "input 'x': dtype is float64"),
    (lambda s: s.run(np.zeros((ROWS, 2), np.float32)), r"input 'x': shape is \[4, 2\]"),
    (lambda s: s.run(CaiArray(0x1230, (ROWS, COLS))), "input 'x': data pointer 0x1230 is not CUDA"),
    (lambda s: s.run(np.zeros((ROWS, COLS), np.float32), out={"out": np.zeros((ROWS, COLS), np.float32)}),
     r"output 'out' \(out=\): out= needs a device array"),
    (lambda s: s.run(np.zeros((ROWS, COLS), np.float32), out={"nope": 1}), "unknown output 'nope'"),
])
def test_bad_arguments_fail_before_any_launch(fake, pkg, call, message):
    sess = pkg.session()
    with pytest.raises(InputError, match=message):
        call(sess)
    assert fake.launches == [] and sess._staging == {}


@pytest.mark.parametrize("make, message", [
    (lambda a: CaiArray(a, (ROWS, COLS), typestr="<f2"), r"^input 'x': dtype is float16, expected float32$"),
    (lambda a: CaiArray(a, (ROWS, COLS), strides=(4, 4 * ROWS)),
     r"^input 'x': strides \[1, 4\] are not C-contiguous \(expected \[32, 1\]\)"),
    (lambda a: CaiArray(a + 4, (ROWS, COLS)), r"^input 'x': data pointer 0x[0-9a-f]+ is not 16-byte aligned"),
    (lambda a: CaiArray(0x1230, (ROWS, COLS)), r"^input 'x': data pointer 0x1230 is not CUDA device memory$"),
    (lambda a: CaiArray(a, (ROWS, COLS + 1)), r"^input 'x': shape is \[4, 33\], expected \[4, 32\]"),
])
def test_a_bad_device_input_after_good_ones_fails_as_the_first_call_would(fake, pkg, make, message):
    """The shortcuts warmed by good calls (remembered strides, the shape plan, the writer's words)
    change nothing for a bad one: the same error, nothing launched."""
    a = driver.mem_alloc(2 * W_BYTES)
    for warm in (False, True):
        sess = pkg.session()
        if warm:
            for _ in range(2):
                sess.run(CaiArray(a, (ROWS, COLS)))
        launched = len(fake.launches)
        with pytest.raises(InputError, match=message):
            sess.run(make(a))
        assert len(fake.launches) == launched


def test_each_run_returns_new_arrays_and_stales_the_older_ones(fake, pkg):
    sess = pkg.session()
    x = CaiArray(driver.mem_alloc(W_BYTES), (ROWS, COLS))
    first, second = sess.run(x)["out"], sess.run(x)["out"]
    assert first is not second and second.shape == (ROWS, COLS) and second.ptr == sess._out_ptrs[0]
    with pytest.raises(StaleOutputError):
        first.ptr


def test_an_output_cannot_feed_its_own_session(fake, pkg):
    sess = pkg.session()
    out = sess.run(np.zeros((ROWS, COLS), np.float32))["out"]
    with pytest.raises(InputError, match="is an output of this session"):
        sess.run(out)


def test_close_frees_everything_and_stales_outputs(fake, pkg):
    before = set(fake.memory)
    sess = pkg.session()
    out = sess.run(np.zeros((ROWS, COLS), np.float32))["out"]
    pkg.close()  # closes its sessions too
    with pytest.raises(StaleOutputError, match="closed"):
        out.numpy()
    assert set(fake.memory) <= before and pkg.weights_ptr is None


def test_bfloat16_numpy_is_upcast(fake):
    ptr = driver.mem_alloc(4)
    bits = (np.array([1.5, -3.0], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ctypes.memmove(ptr, bits.ctypes.data, 4)
    host = DeviceArray(ptr, (2,), "bfloat16", 0).numpy()
    assert host.dtype == np.float32 and host.tolist() == [1.5, -3.0]


def test_shared_memory_beyond_the_gpu_is_refused_at_load(fake, tmp_path):
    """The format caps dynamic shared memory at the H200's 227 KiB; a GPU with less (an A100 has
    163 KiB) refuses the package before loading any module, naming the kernel."""
    m = manifest()
    m["kernels"][1]["shared"] = 200 * 1024
    path = write(tmp_path / "m.grace", m)
    rt.load(path).close()   # fits the H200
    fake.SHARED_OPTIN = 163 * 1024
    with pytest.raises(PackageMismatchError, match=r"kernel k_scale_add needs 204800 bytes of dynamic shared "
                                                   r"memory, but this GPU \(sm_90\) allows 166912 per block"):
        rt.load(path)
