"""Session state (format 3.0, docs/design-state.md): device memory that a session owns, initialised
from the package, kept across run() calls and updated in place by the graphs (KV caches, counters).

    StateEntry          one `state[i]` of the manifest: name, dtype, shape, offset, nbytes, init
    plan_state(m, pkg)  pure apart from reading the `state` section; run by load(). Checks every
                        entry against `regions.state` and, for `init: "data"`, against its tensor
                        in the `state` section, whose bytes it keeps (decoded once per load; each
                        session copies them to its own state region).

Zero-filled entries (a cache) have no bytes in the file and cost one memset per session reset.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import dtypes
from .errors import InvalidPackageError


class StateEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    init: str            # "zeros" | "data"
    data: object = None  # init "data": the initial bytes (uint8 numpy array, host memory)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_state(manifest, package) -> list:
    """The manifest's state entries, checked (inside `regions.state`, sizes consistent, data present),
    with the initial bytes of `init: "data"` entries. `package` provides `section(name)`; it is
    only read when some entry has data. Missing `state` / `regions.state` mean a stateless package."""
    entries = manifest.get("state") or []
    size = manifest["regions"].get("state", 0)
    tensors = _state_tensors(package) if any(e.get("init") == "data" for e in entries) else {}
    planned = []
    for e in entries:
        name, dtype, shape = e["name"], e["dtype"], tuple(e["shape"])
        offset, nbytes, init = e["offset"], e["nbytes"], e.get("init", "zeros")
        if dtype not in dtypes.DTYPES or nbytes != _numel(shape) * dtypes.itemsize(dtype):
            raise InvalidPackageError(f"state {name!r}: {nbytes} bytes for {dtype}{list(shape)}")
        if offset < 0 or offset + nbytes > size:
            raise InvalidPackageError(f"state {name!r} at [{offset}, {offset + nbytes}) lies outside the "
                                      f"state region ({size} bytes)")
        data = None
        if init == "data":
            data = _initial_bytes(e, tensors)
        elif init != "zeros":
            raise InvalidPackageError(f"state {name!r}: unknown init {init!r} (expected 'zeros' or 'data')")
        planned.append(StateEntry(name, dtype, shape, offset, nbytes, init, data))
    return planned


def _state_tensors(package) -> dict:
    """{name: (dtype, shape, bytes)} of the `state` section (safetensors, like `weights`)."""
    try:
        from grace.formats import decode_state
    except ImportError:  # the same decoder under its weights name (formats before 3.0)
        from grace.formats import decode_weights as decode_state
    try:
        blob = package.section("state")
    except Exception as e:  # KeyError or the reader's own error: say which section is missing
        raise InvalidPackageError(f"the manifest has state with init 'data' but the package has no "
                                  f"'state' section ({e})") from None
    return decode_state(blob)


def _initial_bytes(entry, tensors) -> np.ndarray:
    name = entry["name"]
    if name not in tensors:
        raise InvalidPackageError(f"state {name!r} has init 'data' but no tensor in the state section")
    dtype, shape, data = tensors[name]
    if dtype != entry["dtype"] or tuple(shape) != tuple(entry["shape"]) or len(data) != entry["nbytes"]:
        raise InvalidPackageError(f"state {name!r}: the state section has {dtype}{list(shape)}, the "
                                  f"manifest {entry['dtype']}{list(entry['shape'])} ({entry['nbytes']} bytes)")
    # A copy, not a view of the file's mapping: the package keeps it for every session's resets.
    return np.frombuffer(data, dtype=np.uint8).copy()
