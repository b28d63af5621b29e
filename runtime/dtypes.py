"""Element types as the runtime's three interfaces spell them.

The manifest names a dtype ("float32"); `__cuda_array_interface__` uses a numpy typestr ("<f4");
DLPack uses (type code, bits). One table maps all three. The names are those of grace.formats.

bfloat16 has no numpy typestr. We export it as "<V2" (two raw bytes, the convention of CuPy/JAX/
ml_dtypes for an opaque 2-byte type) and accept "<V2" only where the package expects bfloat16.
Consumers that need a real bf16 type (torch) should use DLPack: `torch.from_dlpack(array)`.
"""

from __future__ import annotations

# DLPack type codes (dlpack.h: DLDataTypeCode)
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_BOOL = 0, 1, 2, 4, 6

# name -> (itemsize, typestr, (dlpack code, bits))
DTYPES: dict[str, tuple[int, str, tuple[int, int]]] = {
    "float64": (8, "<f8", (DL_FLOAT, 64)),
    "float32": (4, "<f4", (DL_FLOAT, 32)),
    "float16": (2, "<f2", (DL_FLOAT, 16)),
    "bfloat16": (2, "<V2", (DL_BFLOAT, 16)),
    "int64": (8, "<i8", (DL_INT, 64)),
    "int32": (4, "<i4", (DL_INT, 32)),
    "int16": (2, "<i2", (DL_INT, 16)),
    "int8": (1, "|i1", (DL_INT, 8)),
    "uint8": (1, "|u1", (DL_UINT, 8)),
    "bool": (1, "|b1", (DL_BOOL, 8)),
}

_FROM_DLPACK = {dl: name for name, (_, _, dl) in DTYPES.items()}
_FROM_TYPESTR = {ts[1:]: name for name, (_, ts, _) in DTYPES.items()}  # keyed without byte order


def itemsize(name: str) -> int:
    return DTYPES[name][0]


def typestr(name: str) -> str:
    return DTYPES[name][1]


def dlpack_code(name: str) -> tuple[int, int]:
    return DTYPES[name][2]


def from_typestr(ts: str):
    """'<f4' -> 'float32'; None for anything we do not know (including big-endian types)."""
    if not isinstance(ts, str) or len(ts) < 3:
        return None
    order, key = ts[0], ts[1:]
    name = _FROM_TYPESTR.get(key)
    if name is None:
        return None
    if order in "<=|" or (order == ">" and DTYPES[name][0] == 1):  # byte order is moot for 1 byte
        return name
    return None


def from_dlpack(code: int, bits: int, lanes: int = 1):
    """DLPack (code, bits, lanes) -> name; None if unknown or vectorised (lanes != 1)."""
    if lanes != 1:
        return None
    return _FROM_DLPACK.get((code, bits))


_FROM_TORCH = {}  # torch dtype -> name, each remembered on first sight (run() asks every call)


def from_torch(dtype) -> str:
    """torch.float32 -> 'float32' without importing torch (str(torch.float32) == 'torch.float32')."""
    name = _FROM_TORCH.get(dtype)
    if name is None:
        name = _FROM_TORCH[dtype] = str(dtype).rpartition(".")[2]
    return name
