"""The CUDA driver, reached only through cuda-python (`cuda.bindings.driver`).

Every driver call goes through `call(fn, *args)` (or `check(result, what)` on a result tuple), which
turns a failing CUresult into a GraceRuntimeError naming the call and the error (cuGetErrorName).
The driver module is imported on first use, so `import grace.runtime` works on a machine without
CUDA; a missing cuda-python, a missing libcuda or a machine with no GPU all raise NoDeviceError.

cuda-python returns `(CUresult, *values)` from every function; `check` returns the values
(None, one value, or a tuple). Device pointers are passed and returned as plain ints.
"""

from __future__ import annotations

from .errors import GraceRuntimeError, NoDeviceError

_cu = None  # the cuda.bindings.driver module, once imported (tests may substitute a fake)


def cuda():
    """The `cuda.bindings.driver` module, imported on first use."""
    global _cu
    if _cu is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise NoDeviceError(f"cuda-python is not installed ({e}); `pip install cuda-bindings`") from None
        _cu = driver
    return _cu


def describe(err) -> str:
    """'CUDA_ERROR_OUT_OF_MEMORY (out of memory)' for a CUresult."""
    cu = cuda()
    try:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        return f"{_text(name)} ({_text(text)})"
    except Exception:  # the error lookup itself must never hide the original error
        return str(err)


def _text(value) -> str:
    """bytes from the driver (NUL-padded C strings) -> str."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


def check(result, what: str = "CUDA driver call"):
    """Raise GraceRuntimeError if `result` (a cuda-python return tuple) carries an error; else return
    its values: None, the single value, or a tuple of values."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err:  # CUresult is an int enum; CUDA_SUCCESS == 0
        raise GraceRuntimeError(f"{what} failed: {describe(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(fn, *args):
    """Call a driver function and check its result; errors name the function."""
    return check(fn(*args), fn.__name__)


# ---------------------------------------------------------------------------------------- devices

def arch_name(major: int, minor: int) -> str:
    """Compute capability -> the package's arch key: (9, 0) -> 'sm_90'."""
    return f"sm_{major}{minor}"


class Device:
    """One GPU with its primary context retained (released by `release`)."""

    def __init__(self, ordinal: int):
        cu = cuda()
        try:
            result = cu.cuInit(0)
        except (RuntimeError, OSError) as e:  # cuda-python raises when libcuda.so.1 cannot be dlopened
            raise NoDeviceError(f"no CUDA driver could be loaded ({e})") from None
        err = result[0] if isinstance(result, tuple) else result
        if err:
            raise NoDeviceError(f"the CUDA driver failed to initialise: {describe(err)}")
        count = call(cu.cuDeviceGetCount)
        if count == 0:
            raise NoDeviceError("the CUDA driver reports no GPU")
        if not 0 <= ordinal < count:
            raise NoDeviceError(f"device {ordinal} was requested but this machine has {count} GPU(s)")
        self.ordinal = ordinal
        self.handle = call(cu.cuDeviceGet, ordinal)
        attr = cu.CUdevice_attribute
        self.capability = (
            call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle),
            call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle))
        self.arch = arch_name(*self.capability)
        self.name = _text(call(cu.cuDeviceGetName, 256, self.handle))
        self.ctx = call(cu.cuDevicePrimaryCtxRetain, self.handle)
        self.make_current()

    def make_current(self) -> None:
        """Bind the primary context to the calling thread (every driver call needs one)."""
        result = cuda().cuCtxSetCurrent(self.ctx)
        if result[0]:
            check(result, "cuCtxSetCurrent")

    def release(self) -> None:
        if self.ctx is not None:
            call(cuda().cuDevicePrimaryCtxRelease, self.handle)
            self.ctx = None

    def __repr__(self) -> str:
        return f"Device({self.ordinal}, {self.name!r}, {self.arch})"


# ---------------------------------------------------------------------------------------- memory

def mem_alloc(nbytes: int) -> int:
    """cuMemAlloc (256-byte aligned); a zero-byte region still gets a valid (1-byte) allocation."""
    return int(call(cuda().cuMemAlloc, max(int(nbytes), 1)))


def mem_free(ptr: int) -> None:
    call(cuda().cuMemFree, ptr)


def copy_htod(dst: int, src_addr: int, nbytes: int, stream=None) -> None:
    """Host -> device. `src_addr` is an int host address (never an object: cuda-python would turn a
    one-element numpy array into its *value*). With a stream the copy is ordered on it; from
    pageable memory it returns once the source has been read, so the caller may reuse it."""
    cu = cuda()
    if nbytes == 0:
        return
    if stream is None:
        call(cu.cuMemcpyHtoD, dst, src_addr, nbytes)
    else:
        call(cu.cuMemcpyHtoDAsync, dst, src_addr, nbytes, stream)


def copy_dtoh(dst_addr: int, src: int, nbytes: int, stream=None) -> None:
    """Device -> host, complete when this returns (synchronises `stream` when one is given)."""
    cu = cuda()
    if nbytes == 0:
        return
    if stream is None:
        call(cu.cuMemcpyDtoH, dst_addr, src, nbytes)
    else:
        call(cu.cuMemcpyDtoHAsync, dst_addr, src, nbytes, stream)
        call(cu.cuStreamSynchronize, stream)


def memset_d8(ptr: int, value: int, nbytes: int, stream) -> None:
    if nbytes:
        call(cuda().cuMemsetD8Async, ptr, value, nbytes, stream)


def pointer_device(ptr: int):
    """The ordinal of the GPU that owns device pointer `ptr`, or None if it is not CUDA memory."""
    cu = cuda()
    err, ordinal = cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    return None if err else int(ordinal)


# ---------------------------------------------------------------------------------------- streams

def stream_create():
    """A stream that is *blocking* with respect to the legacy default stream: work that torch, CuPy
    etc. put on their default stream before run() finishes before the graph starts, and their later
    work waits for the graph; no host synchronisation is needed for either direction."""
    cu = cuda()
    return call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_DEFAULT)


def as_stream(handle):
    """A CUstream from a CUstream, an int handle (1 = legacy default, 2 = per-thread default) or an
    object with a `cuda_stream` int (torch.cuda.Stream)."""
    cu = cuda()
    if isinstance(handle, cu.CUstream):
        return handle
    return cu.CUstream(int(getattr(handle, "cuda_stream", handle)))


def event_create():
    cu = cuda()
    return call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)


def stream_wait(waiter, producer, event) -> None:
    """Make `waiter` wait (on the device) for everything enqueued so far on `producer`."""
    cu = cuda()
    call(cu.cuEventRecord, event, producer)
    call(cu.cuStreamWaitEvent, waiter, event, 0)
