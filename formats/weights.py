"""The weights and state sections: standard safetensors blobs, encoded without torch, decoded zero-copy.

safetensors is the interchange format everyone can already read (`safetensors.safe_open` works on an
extracted section), and it carries bfloat16 as plain bytes. Its layout is tiny and documented (an
8-byte header length, a JSON header padded with spaces to 8 bytes, then the tensors back to back), so
we write it ourselves, in the library's own tensor order and header spelling (a test checks the bytes
against `safetensors.serialize`): a `TensorBlob` is only that header plus views of the caller's
tensors, streamed into the package by the container writer, so an 8B model's 16 GB of weights are
never copied in memory on the way to disk. We decode the header ourselves too: the library copies
tensor data into new `bytes`, while the runtime wants views straight into the mmapped package.
The `state` section (the initial values of session state with init "data", format 3.0) has the same
layout, so it has the same codec; `decode_state` only makes its errors name the state section.
"""

from __future__ import annotations

import functools
import json
import struct

from . import limits
from .dtypes import DTYPES, SAFETENSORS_TO_DTYPE, numel
from .errors import FormatError

_MAX_HEADER = limits.MAX_SAFETENSORS_HEADER


def _check_tensor(name, dtype, shape, data) -> tuple[tuple[int, ...], memoryview]:
    if not isinstance(name, str) or not name:
        raise FormatError(f"weight name must be a non-empty str, got {name!r}")
    if dtype not in DTYPES:
        raise FormatError(f"weight {name!r}: unknown dtype {dtype!r} (expected one of {sorted(DTYPES)})")
    shape = tuple(shape)
    if len(shape) > limits.MAX_RANK or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"weight {name!r}: shape must be at most {limits.MAX_RANK} non-negative "
                          f"ints, got {shape!r}")
    try:
        view = memoryview(data)
    except TypeError:
        raise FormatError(f"weight {name!r}: data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise FormatError(f"weight {name!r}: data must be C-contiguous")
    view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
    expected = numel(shape) * DTYPES[dtype][0]
    if view.nbytes != expected:
        raise FormatError(f"weight {name!r}: {view.nbytes} bytes of data for {dtype}{list(shape)} "
                          f"(expected {expected})")
    return shape, view


# safetensors writes tensors sorted by (dtype, descending, in its enum order; then name), which puts
# wide types first and so keeps every tensor aligned to its own itemsize within the data.
_ORDER = {code: i for i, code in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8",
                                            "U8", "BOOL"])}
assert set(_ORDER) == set(SAFETENSORS_TO_DTYPE)


class TensorBlob:
    """A safetensors blob that is never assembled: its JSON header plus views of the tensors' bytes.

    `nbytes` and `tensors` ({name: (dtype, shape)}) describe it; `chunks()` yields the header, then
    each tensor's view, in file order. The views alias the caller's buffers, which must stay alive
    and unchanged until the blob is written.
    """

    def __init__(self, tensors: dict):
        checked = []
        for name, (dtype, shape, data) in tensors.items():
            shape, view = _check_tensor(name, dtype, shape, data)
            checked.append((name, dtype, shape, view))
        checked.sort(key=lambda t: (_ORDER[DTYPES[t[1]][1]], t[0]))
        header, offset = {}, 0
        for name, dtype, shape, view in checked:
            header[name] = {"dtype": DTYPES[dtype][1], "shape": list(shape),
                            "data_offsets": [offset, offset + view.nbytes]}
            offset += view.nbytes
        if len(header) > limits.MAX_TENSORS:
            raise FormatError(f"{len(header)} tensors, above the limit of {limits.MAX_TENSORS}")
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        if len(text) > _MAX_HEADER:
            raise FormatError(f"safetensors header of {len(text)} bytes, above the limit of {_MAX_HEADER}")
        self._header = struct.pack("<Q", len(text)) + text
        self._views = [view for *_, view in checked]
        self.tensors = {name: (dtype, shape) for name, dtype, shape, _ in checked}
        self.nbytes = len(self._header) + offset

    def chunks(self):
        yield memoryview(self._header)
        yield from self._views

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks())


def encode_weights(tensors: dict) -> bytes:
    """Serialize {name: (dtype, shape, data)} into a safetensors blob; `data` is raw little-endian
    bytes. This copies every tensor once: the compiler streams a `TensorBlob` instead."""
    return bytes(TensorBlob(tensors))


def _no_duplicate_keys(section, pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"{section}: safetensors header repeats the key {k!r}")
        out[k] = v
    return out


def decode_weights(blob, *, section: str = "weights"
                   ) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """Parse a safetensors blob into {name: (dtype, shape, view)}; views alias `blob` (no copies).

    Applies the safetensors rules strictly: a bounded JSON header, known dtypes, sizes that match
    shapes, and tensor data that covers the buffer exactly without overlap. `section` only names
    the blob in error messages.
    """
    try:
        buf = memoryview(blob)
    except TypeError:
        raise FormatError(f"{section}: expected bytes-like data, got {type(blob).__name__}") from None
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    if buf.nbytes < 8:
        raise FormatError(f"{section}: safetensors blob is {buf.nbytes} bytes, shorter than its 8-byte header length")
    (header_len,) = struct.unpack_from("<Q", buf, 0)
    if 8 + header_len > buf.nbytes:
        raise FormatError(f"{section}: safetensors header length {header_len} exceeds the blob ({buf.nbytes} bytes)")
    if header_len > _MAX_HEADER:
        raise FormatError(f"{section}: safetensors header length {header_len} is above the limit of {_MAX_HEADER}")
    text = bytes(buf[8:8 + header_len])
    # A bound on the maps and lists json would build, counted at C speed before it builds any
    # ("[]," is 3 bytes of JSON and a 56-byte list); brackets inside names only lower the bound.
    containers = text.count(b"[") + text.count(b"{")
    if containers > limits.MAX_SAFETENSORS_CONTAINERS:
        raise FormatError(f"{section}: safetensors header has {containers} brackets, more than "
                          f"{limits.MAX_SAFETENSORS_CONTAINERS} (3 per tensor for {limits.MAX_TENSORS} tensors)")
    try:
        header = json.loads(text.decode("utf-8"),
                            object_pairs_hook=functools.partial(_no_duplicate_keys, section))
    except FormatError:
        raise
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{section}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{section}: safetensors header must be a JSON object")

    data = buf[8 + header_len:]
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise FormatError(f"{section}: __metadata__ must map strings to strings")
            continue
        out[name] = _decode_entry(section, name, info, data)
        spans.append((info["data_offsets"][0], info["data_offsets"][1], name))

    spans.sort()
    cur = 0
    for begin, end, name in spans:
        if begin != cur:
            raise FormatError(f"{section}: tensor {name!r} starts at {begin}, expected {cur} "
                              "(tensor data must be contiguous and non-overlapping)")
        cur = end
    if cur != data.nbytes:
        raise FormatError(f"{section}: tensors cover {cur} of {data.nbytes} data bytes")
    return out


def _decode_entry(section: str, name: str, info, data: memoryview):
    if not isinstance(info, dict):
        raise FormatError(f"{section}: entry {name!r} must be an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in SAFETENSORS_TO_DTYPE:
        raise FormatError(f"{section}: tensor {name!r} has unsupported dtype {code!r}")
    if not isinstance(shape, list) or len(shape) > limits.MAX_RANK or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"{section}: tensor {name!r} has a bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data.nbytes):
        raise FormatError(f"{section}: tensor {name!r} has bad data_offsets {offsets!r} "
                          f"(data is {data.nbytes} bytes)")
    dtype = SAFETENSORS_TO_DTYPE[code]
    expected = numel(shape) * DTYPES[dtype][0]
    if offsets[1] - offsets[0] != expected:
        raise FormatError(f"{section}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, "
                          f"but {dtype}{shape} needs {expected}")
    return dtype, tuple(shape), data[offsets[0]:offsets[1]]


def decode_state(blob) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """The `state` section: `decode_weights` with errors that name the state section."""
    return decode_weights(blob, section="state")


encode_state = encode_weights  # the state section is a safetensors blob like the weights section
