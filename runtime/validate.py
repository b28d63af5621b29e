"""Pure checks of one array: can it fill a table slot (dtype, device, layout, alignment)? No driver,
no device: everything here is testable on any machine. Sizes are checked against the package by
calls.ShapePlan (inputs: symbols, ranges, static dims) and `check_shape` (out= arrays).

An array arrives as an ArrayRecord (see arrays.as_record): pointer, shape, strides in elements
(None = C-contiguous), dtype name and device ("cpu" for numpy arrays that will be copied in).

run() checks each input through its ArrayCheck (made once per session and input): the common case,
an array that fits, passes in a few comparisons; anything else goes to check_array, which raises
the error (the same one, whichever way the array came in) or passes what the shortcut does not
cover (a size-1 dim with any stride, an empty array at any address).
"""

from __future__ import annotations

import functools
import operator

from .errors import InputError

ALIGNMENT = 16  # bytes; kernels may assume 16-byte aligned data (vectorised loads)


class ArrayRecord:
    """What the runtime needs to know about one user array."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "readonly", "host", "keep", "stream",
                 "owner")

    def __init__(self, ptr, shape, strides, dtype, device, *, readonly=False, host=None, keep=None,
                 stream=None, owner=None):
        self.ptr = ptr            # int address (device, or host for numpy)
        self.shape = shape        # tuple of ints
        self.strides = strides    # tuple of ints in elements, or None for C-contiguous
        self.dtype = dtype        # manifest dtype name
        self.device = device      # CUDA ordinal, "cpu" (numpy: host copy), or None (not known yet)
        self.readonly = readonly
        self.host = host          # the numpy array, for host inputs
        self.keep = keep          # anything that must stay alive while the GPU may read (a capsule)
        self.stream = stream      # __cuda_array_interface__ v3 stream to wait on, if any
        self.owner = owner        # the Session, for DeviceArrays made by one


def as_dims(what: str, values, kind: str, lo: int | None = 0) -> tuple:
    """`values` (a shape or strides from a protocol such as `__cuda_array_interface__`) as a tuple
    of Python ints, each >= `lo` when given; InputError for anything else (a str, a float, None, a
    bool), so that only ints reach the shape checks and the table words."""
    if not isinstance(values, (tuple, list)):
        raise InputError(f"{what}: {kind} must be a tuple of ints, got {type(values).__name__}")
    dims = []
    for v in values:
        if isinstance(v, bool):
            raise InputError(f"{what}: {kind} {list(values)!r} holds a bool; expected ints")
        try:
            v = operator.index(v)   # ints, numpy integers; not floats or strs
        except TypeError:
            raise InputError(f"{what}: {kind} {list(values)!r} holds {type(v).__name__} {v!r}; "
                             "expected ints") from None
        if lo is not None and v < lo:
            raise InputError(f"{what}: {kind} {list(values)!r} holds {v}, below {lo}")
        dims.append(v)
    return tuple(dims)


def contiguous_strides(shape) -> tuple:
    """C-contiguous strides in elements: (2, 3, 4) -> (12, 4, 1)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


# the C-contiguous strides of the shapes seen lately (the shortcut's comparison)
_contiguous = functools.lru_cache(maxsize=256)(contiguous_strides)


def is_contiguous(shape, strides) -> bool:
    """C-contiguous in elements; dimensions of size 1 may carry any stride (torch does that)."""
    if strides is None:
        return True
    step = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != step:
            return False
        step *= d
    return True


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_array(what: str, rec: ArrayRecord, dtype: str, device: int) -> None:
    """Raise InputError (naming `what`, e.g. "input 'x'") unless `rec` can fill a slot of this dtype
    on CUDA device `device`: C-contiguous, 16-byte aligned. Host (numpy) records only need the dtype.
    The shape is not looked at here."""
    if rec.dtype != dtype:
        raise InputError(f"{what}: dtype is {rec.dtype}, expected {dtype}")
    if rec.device == "cpu":
        return  # copied into a staging buffer: layout and alignment do not matter
    if rec.device is None:
        raise InputError(f"{what}: data pointer {rec.ptr:#x} is not CUDA device memory")
    if rec.device != device:
        raise InputError(f"{what}: is on cuda:{rec.device}, but the package is loaded on cuda:{device}")
    if not is_contiguous(rec.shape, rec.strides):
        raise InputError(f"{what}: strides {list(rec.strides)} are not C-contiguous (expected "
                         f"{list(contiguous_strides(rec.shape))}); pass a contiguous array, e.g. x.contiguous()")
    numel = 1
    for d in rec.shape:
        numel *= d
    if numel and rec.ptr % ALIGNMENT:
        raise InputError(f"{what}: data pointer {rec.ptr:#x} is not {ALIGNMENT}-byte aligned (a view "
                         "with an offset?); pass a fresh contiguous copy, e.g. x.clone()")


class ArrayCheck:
    """check_array for one slot, its arguments fixed: `check(rec)` is check_array(what, rec, dtype,
    device), with a shortcut for the array that fits (the dtype, on the device, aligned, strides
    None or exactly the C-contiguous ones of its shape)."""

    __slots__ = ("what", "dtype", "device")

    def __init__(self, what: str, dtype: str, device: int):
        self.what, self.dtype, self.device = what, dtype, device

    def check(self, rec: ArrayRecord) -> None:
        if rec.dtype == self.dtype and rec.device == self.device and not rec.ptr % ALIGNMENT:
            strides = rec.strides
            if strides is None or strides == _contiguous(rec.shape):
                return
        check_array(self.what, rec, self.dtype, self.device)


def check_shape(what: str, shape, expected) -> None:
    """`shape` must be exactly `expected` (an out= array against this call's output shape)."""
    if tuple(shape) != tuple(expected):
        raise InputError(f"{what}: shape is {_dims(shape)}, expected {_dims(expected)} (this call's shape)")


def check_writable(what: str, rec: ArrayRecord) -> None:
    if rec.device == "cpu":
        raise InputError(f"{what}: out= needs a device array; numpy arrays cannot be written by the "
                         "GPU (call .numpy() on the returned output instead)")
    if rec.readonly:
        raise InputError(f"{what}: the array is read-only")
