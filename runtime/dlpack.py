"""DLPack through ctypes: the structs of dlpack.h, read and patched in place.

Import (`parse_capsule`): read the DLTensor of a "dltensor" or "dltensor_versioned" capsule without
consuming it. The caller keeps the capsule alive for as long as it uses the memory; when the capsule
is garbage-collected, the producer's destructor releases the tensor (the DLPack rule for unconsumed
capsules).

Export (`export_capsule`): we borrow numpy's exporter. A numpy view is laid over the device memory
(numpy never reads it), numpy's `__dlpack__` builds the capsule, and we patch the
device (kDLCUDA, ordinal) and the dtype code (bfloat16) in its DLTensor. Why not build the
DLManagedTensor ourselves: its deleter and the capsule destructor would then be Python callbacks
(ctypes), and a Python callback that runs while an exception is propagating (a consumer tensor freed
during unwinding) swallows that exception or raises SystemError. numpy's deleter and destructor are C
code; the deleter drops the numpy view, whose base holds `owner`, so the device memory stays alive
for as long as the consumer's tensor does.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np

# DLDeviceType values we meet
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
FLAG_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY (versioned capsules only)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),  # in elements; NULL means C-contiguous
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_GetPointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))


def export_capsule(ptr: int, shape, itemsize: int, code_bits, device: tuple[int, int], owner):
    """A legacy "dltensor" capsule for the C-contiguous array at `ptr` on `device` (type, id).
    `owner` stays alive until the consumer releases the tensor."""
    numel = 1
    for d in shape:
        numel *= d
    raw = (c_uint8 * max(numel * itemsize, itemsize)).from_address(ptr)  # no byte is read
    raw.owner = owner
    view = np.frombuffer(raw, dtype=np.dtype(f"<u{itemsize}"), count=numel).reshape(shape)
    capsule = view.__dlpack__()
    t = DLManagedTensor.from_address(_GetPointer(capsule, b"dltensor")).dl_tensor
    t.data = ptr
    t.byte_offset = 0
    t.device = DLDevice(*device)
    t.dtype = DLDataType(code_bits[0], code_bits[1], 1)
    return capsule


class Tensor:
    """What parse_capsule reads from a DLTensor (strides in elements, None when contiguous)."""

    __slots__ = ("ptr", "device", "code_bits_lanes", "shape", "strides", "readonly")

    def __init__(self, ptr, device, code_bits_lanes, shape, strides, readonly):
        self.ptr, self.device, self.code_bits_lanes = ptr, device, code_bits_lanes
        self.shape, self.strides, self.readonly = shape, strides, readonly


def parse_capsule(capsule) -> Tensor:
    """Read a DLPack capsule (legacy or versioned) without consuming it."""
    if _IsValid(capsule, b"dltensor"):
        managed = DLManagedTensor.from_address(_GetPointer(capsule, b"dltensor"))
        t, readonly = managed.dl_tensor, False
    elif _IsValid(capsule, b"dltensor_versioned"):
        managed = DLManagedTensorVersioned.from_address(_GetPointer(capsule, b"dltensor_versioned"))
        t, readonly = managed.dl_tensor, bool(managed.flags & FLAG_READ_ONLY)
    else:
        raise ValueError("not a DLPack capsule (expected a PyCapsule named 'dltensor')")
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else None
    return Tensor(
        ptr=(t.data or 0) + t.byte_offset,
        device=(t.device.device_type, t.device.device_id),
        code_bits_lanes=(t.dtype.code, t.dtype.bits, t.dtype.lanes),
        shape=shape, strides=strides, readonly=readonly)
