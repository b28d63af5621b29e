"""Arrays in and out of the runtime.

In: `as_record(obj, what, stream)` turns whatever the caller passed into an ArrayRecord, zero-copy:
  1. a DeviceArray (ours);
  2. a numpy array -> host record; the session copies it into a staging buffer;
  3. a torch tensor, read through its own attributes (data_ptr, shape, is_contiguous, dtype, get_device)
     without importing torch: cheaper than either protocol, and it covers bfloat16, which torch
     cannot express through __cuda_array_interface__;
  4. `__cuda_array_interface__` (CuPy, Numba, ...), unless it is missing, raises, or has a type we
     cannot name;
  5. `__dlpack__` (JAX, CuPy, ...): the capsule is read, not consumed, and kept alive by the session.

Out: DeviceArray, a view of session memory exposing both protocols and `.numpy()`. Every run()
rewrites the session's output buffers, so an array from an earlier run() is *stale*: any use of it
raises StaleOutputError instead of returning the newer data. An output whose dim 0 is a data symbol
(computed on the device) gets its shape lazily: the first use of .shape, .numpy() or a protocol calls
the session back to read the symbol from the device table.
"""

from __future__ import annotations

import numpy as np

from . import dlpack, driver, dtypes
from .errors import InputError, StaleOutputError
from .validate import ArrayRecord, as_dims, contiguous_strides


def host_buffer(dtype: str, shape) -> np.ndarray:
    """An empty host array to copy `dtype` device data into (bfloat16: its raw 16-bit words)."""
    return np.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else np.dtype(dtype))


def host_array(dtype: str, raw: np.ndarray) -> np.ndarray:
    """What a reader gets from `raw` (filled through host_buffer): bfloat16 widened to float32 (exact:
    bfloat16 is the top half of a float32; numpy has no bfloat16), any other dtype as is."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


class DeviceArray:
    """A C-contiguous array in device memory: `.shape`, `.dtype` (a name such as "float32"),
    `.numpy()`, `__cuda_array_interface__` (v3) and `__dlpack__`.

    bfloat16: `.numpy()` returns float32 (numpy has no bfloat16; the upcast is exact), and
    `__cuda_array_interface__` reports typestr "<V2" (raw 2-byte items); use `torch.from_dlpack`
    to get a real bfloat16 tensor.

    A tensor imported through a protocol (torch.from_dlpack(out)) shares this memory: it keeps the
    session from being garbage-collected, but it is *not* checked for staleness (the next run()
    overwrites it) and it dangles once the session is close()d. Clone it to keep the values.

    An output whose dim 0 is data-dependent learns its shape on first use (.shape, .numpy(), a
    protocol): the session reads the size from the device, waiting for the run to finish.
    """

    __slots__ = ("_ptr", "_shape", "_shape_fn", "_dtype", "_device", "_owner", "_generation", "_name",
                 "__weakref__")

    def __init__(self, ptr: int, shape, dtype: str, device: int = 0, owner=None, name: str = "array",
                 shape_fn=None):
        """`shape` None with `shape_fn`: the shape is `shape_fn()`, called once, on first use (after
        the staleness check, so it still sees the run that produced this array)."""
        self._ptr = int(ptr)
        self._shape = None if shape is None else tuple(shape)
        self._shape_fn = shape_fn
        self._dtype = dtype
        self._device = device
        self._owner = owner  # a Session (or None): supplies _generation, _closed and stream hooks
        self._generation = owner._generation if owner is not None else 0
        self._name = name

    @classmethod
    def of_session(cls, owner, ptr: int, shape: tuple, dtype: str, device: int, name: str) -> "DeviceArray":
        """An output of `owner`'s current run: what __init__ makes of arguments that already are an
        int pointer and a tuple shape, without its conversions (run() makes one per output)."""
        array = cls.__new__(cls)
        array._ptr, array._shape, array._shape_fn, array._dtype = ptr, shape, None, dtype
        array._device, array._owner, array._generation, array._name = device, owner, owner._generation, name
        return array

    def _check(self) -> None:
        owner = self._owner
        if owner is not None and owner._generation != self._generation:
            if owner._closed:
                raise StaleOutputError(f"output '{self._name}' belongs to a session that was closed")
            raise StaleOutputError(
                f"output '{self._name}' was overwritten by a later run(); copy it (.numpy(), or "
                "clone the tensor) before the next run(), or use out=")

    # --- metadata
    @property
    def ptr(self) -> int:
        self._check()
        return self._ptr

    @property
    def shape(self) -> tuple:
        self._check()
        if self._shape is None:
            self._shape = tuple(self._shape_fn())
        return self._shape

    @property
    def dtype(self) -> str:
        self._check()
        return self._dtype

    @property
    def device(self) -> int:
        self._check()
        return self._device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * dtypes.itemsize(self._dtype)

    @property
    def strides(self) -> tuple:
        """In elements (always C-contiguous)."""
        return contiguous_strides(self.shape)

    def __repr__(self) -> str:
        stale = ""
        if self._owner is not None and self._owner._generation != self._generation:
            stale = ", stale"
        shape = "unread (data-dependent)" if self._shape is None else list(self._shape)
        return (f"DeviceArray({self._name!r}, shape={shape}, dtype={self._dtype}, cuda:{self._device}{stale})")

    # --- copies
    def numpy(self) -> np.ndarray:
        """Copy to a new host array (waits for the run that produced it). bfloat16 -> float32."""
        shape = self.shape  # checks staleness
        host = host_buffer(self._dtype, shape)
        if self._owner is not None:
            self._owner._to_host(host.ctypes.data, self._ptr, host.nbytes)
        else:
            driver.copy_dtoh(host.ctypes.data, self._ptr, host.nbytes)
        return host_array(self._dtype, host)

    # --- protocols
    @property
    def __cuda_array_interface__(self) -> dict:
        shape = self.shape  # checks staleness
        stream = self._owner._cai_stream if self._owner is not None else None
        return {"shape": shape, "typestr": dtypes.typestr(self._dtype), "data": (self._ptr, False),
                "strides": None, "version": 3, "stream": stream}

    def __dlpack_device__(self) -> tuple:
        return (dlpack.KDL_CUDA, self._device)

    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        """A legacy "dltensor" capsule (allowed for any max_version). `stream` is the consumer's
        stream (None or 1: legacy default, 2: per-thread default, -1: no synchronisation); the
        consumer's later work on it is ordered after the run that produced this array."""
        shape = self.shape  # checks staleness
        if copy:
            raise BufferError("DeviceArray.__dlpack__ cannot copy; use copy=None or copy=False")
        if dl_device is not None and tuple(dl_device) != (dlpack.KDL_CUDA, self._device):
            raise BufferError(f"DeviceArray lives on cuda:{self._device}, not DLPack device {tuple(dl_device)}")
        if self._owner is not None and stream != -1:
            self._owner._order_consumer(1 if stream is None else stream)
        return dlpack.export_capsule(self._ptr, shape, dtypes.itemsize(self._dtype),
                                     dtypes.dlpack_code(self._dtype), (dlpack.KDL_CUDA, self._device), self)


# ------------------------------------------------------------------------------------ input side

def as_record(obj, what: str, dlpack_stream: int) -> ArrayRecord:
    """Describe `obj` (see the module docstring for the order of preference). `what` names the
    argument in errors ("input 'x'"); `dlpack_stream` is the stream the data will be read on."""
    module = type(obj).__module__   # asked first: torch tensors are the common case (and none of
    if module == "torch" or module.startswith("torch."):   # them is a DeviceArray or numpy array)
        return _from_torch(obj, what)
    if isinstance(obj, DeviceArray):
        return ArrayRecord(obj.ptr, obj.shape, None, obj._dtype, obj._device, owner=obj._owner)
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):   # the mask would be silently dropped
            raise InputError(f"{what}: numpy masked arrays are not supported (the kernels would read "
                             "the masked values); pass arr.filled(value) or arr.data")
        return _from_numpy(obj, what)
    try:
        cai = obj.__cuda_array_interface__
    except Exception:  # missing, or refused (torch raises for bf16 and for requires_grad)
        cai = None
    if cai is not None:
        rec = _from_cai(cai, what, has_dlpack=hasattr(obj, "__dlpack__"))
        if rec is not None:
            return rec
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, what, dlpack_stream)
    raise InputError(f"{what}: expected a CUDA array (an object with __cuda_array_interface__ or "
                     f"__dlpack__: torch, CuPy, JAX, ...) or a numpy array, got {type(obj).__name__}")


def _from_numpy(arr: np.ndarray, what: str) -> ArrayRecord:
    dtype = dtypes.from_typestr(arr.dtype.str)
    if dtype is None:
        raise InputError(f"{what}: {_numpy_dtype_problem(arr.dtype)}")
    return ArrayRecord(arr.ctypes.data, arr.shape, None, dtype, "cpu", host=arr)


def _numpy_dtype_problem(dt: np.dtype) -> str:
    """Why a numpy dtype cannot fill a slot, and what to pass instead."""
    if dt.hasobject:
        return f"numpy dtype {dt} (Python objects) is not supported; pass an array of numbers"
    native = dtypes.from_typestr("<" + dt.str[1:])
    if dt.str.startswith(">") and native is not None:
        return (f"numpy dtype {dt.str} is big-endian; the GPU reads little-endian {native}: pass "
                f"arr.astype('<{dt.str[1:]}')")
    supported = ", ".join(n for n in dtypes.DTYPES if n != "bfloat16")
    return f"numpy dtype {dt} is not supported (supported: {supported}; bfloat16 as a device array)"


def _from_torch(t, what: str) -> ArrayRecord:
    """The hot path of run(), so it asks a tensor as little as it can: the shape stays a torch.Size
    (a tuple subclass that hashes and compares as the tuple), and the strides are read only when
    torch says the tensor is not contiguous. Its rule is ours (a size-1 dim may have any stride),
    except that torch calls every empty tensor contiguous: fine, no kernel reads one."""
    device = t.get_device()  # -1 for CPU tensors
    if device < 0:
        raise InputError(f"{what}: is a CPU tensor; pass x.cuda() (zero-copy) or x.numpy() (host copy)")
    strides = None if t.is_contiguous() else tuple(t.stride())
    return ArrayRecord(t.data_ptr(), t.shape, strides, dtypes.from_torch(t.dtype), device)


def _from_cai(cai, what: str, has_dlpack: bool):
    """A record from `__cuda_array_interface__`. Every field is checked for its type first: the
    dict comes from any object, and only ints may reach the shape checks and the table."""
    if not isinstance(cai, dict):
        raise InputError(f"{what}: __cuda_array_interface__ is a {type(cai).__name__}, not a dict")
    dtype = dtypes.from_typestr(cai.get("typestr"))
    if dtype is None:
        if has_dlpack:
            return None  # let DLPack describe the type
        raise InputError(f"{what}: __cuda_array_interface__ typestr {cai.get('typestr')!r} is not supported")
    if cai.get("mask") is not None:
        raise InputError(f"{what}: masked arrays are not supported")
    data = cai.get("data")
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise InputError(f"{what}: __cuda_array_interface__ data must be (pointer, read_only), got {data!r}")
    (ptr,) = as_dims(what, data[:1], "__cuda_array_interface__ data pointer")
    shape = as_dims(what, cai.get("shape"), "__cuda_array_interface__ shape")
    strides = cai.get("strides")
    if strides is not None:
        strides = as_dims(what, strides, "__cuda_array_interface__ strides", lo=None)
        if len(strides) != len(shape):
            raise InputError(f"{what}: __cuda_array_interface__ strides {list(strides)} do not match "
                             f"the shape {list(shape)}")
        size = dtypes.itemsize(dtype)
        if any(s % size for s in strides):
            raise InputError(f"{what}: byte strides {list(strides)} are not multiples of the item size {size}")
        strides = tuple(s // size for s in strides)
    version = cai.get("version", 0)
    stream = cai.get("stream") if isinstance(version, int) and version >= 3 else None
    if stream is not None:
        (stream,) = as_dims(what, [stream], "__cuda_array_interface__ stream", lo=1)
    return ArrayRecord(ptr, shape, strides, dtype, None, readonly=bool(data[1]), stream=stream)


def _from_dlpack(obj, what: str, stream: int) -> ArrayRecord:
    device_fn = getattr(obj, "__dlpack_device__", None)
    if device_fn is not None:
        kind, _ = device_fn()
        if kind not in (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED):
            raise InputError(f"{what}: lives on DLPack device type {kind}, not CUDA; move it to the GPU "
                             "or pass a numpy array")
    try:
        capsule = obj.__dlpack__(stream=stream)
    except TypeError:  # producers older than the `stream` keyword
        capsule = obj.__dlpack__()
    t = dlpack.parse_capsule(capsule)
    if t.device[0] not in (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED):
        raise InputError(f"{what}: lives on DLPack device type {t.device[0]}, not CUDA")
    dtype = dtypes.from_dlpack(*t.code_bits_lanes)
    if dtype is None:
        raise InputError(f"{what}: DLPack dtype (code, bits, lanes) = {t.code_bits_lanes} is not supported")
    return ArrayRecord(t.ptr, t.shape, t.strides, dtype, t.device[1], readonly=t.readonly, keep=capsule)
