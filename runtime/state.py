"""Session state (format 3.0, docs/design-state.md): device memory that a session owns, initialised
from the package, kept across run() calls and updated in place by the graphs (KV caches, counters).

    StateEntry          one `state[i]` of the manifest: name, dtype, shape, offset, nbytes, init,
                        and for `init: "data"` its initial bytes
    plan_state(pkg)     run by load(): the package's state entries (formats.view; grace.formats has
                        checked them against `regions.state` and, for `init: "data"`, against their
                        tensors in the `state` section), with the initial bytes decoded once per
                        load (each session copies them to its own state region).

Zero-filled entries (a cache) have no bytes in the file and cost one memset per session reset.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StateEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    init: str            # "zeros" | "data"
    data: object = None  # init "data": the initial bytes (uint8 numpy array, host memory)


def plan_state(package) -> list:
    """The state entries of `package` (a grace.formats Package) with the initial bytes of the
    `init: "data"` ones; the `state` section is only decoded when some entry has data."""
    entries = package.view.state
    tensors = {}
    if any(e.init == "data" for e in entries):
        from grace.formats import decode_state

        tensors = decode_state(package.section("state"))
    return [StateEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, e.init,
                       _copy(tensors[e.name][2]) if e.init == "data" else None) for e in entries]


def _copy(data) -> np.ndarray:
    """A copy, not a view of the file's mapping: the package keeps it for every session's resets."""
    return np.frombuffer(data, dtype=np.uint8).copy()
