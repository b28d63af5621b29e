"""Weights from the package file to device memory, at the bus's speed rather than the pager's.

A copy from pageable memory (the mmapped package) makes the driver stage it through its own small
pinned buffers, one synchronous chunk at a time. Measured on the H200 host with an 8B package
(16.07 GB, in the page cache; docs/performance.md): per-tensor copies from the map 2.2-2.4 s; our
own double-buffered pinned staging 2.6-2.8 s (the extra memcpy costs what the overlap saves);
registering the mapped weights with cuMemHostRegister (read-only) 0.40 s, then the same copies as
DMA from pinned pages 0.30 s, unregistering 0.11 s: 0.8 s in all, 3x faster. So:

  registered  the source's pages (page-aligned span of the weights section) are registered
              read-only for the duration of the copies;
  pageable    the fallback where registration is refused (a driver or OS that does not support
              it, a source that is not page-backed) and for sources under REGISTER_MIN_NBYTES,
              where registering costs more than it saves.
"""

from __future__ import annotations

import numpy as np

from . import driver
from .driver import call
from .errors import GraceRuntimeError

REGISTER_MIN_NBYTES = 64 << 20
_PAGE = 4096
_READ_ONLY = 0x08   # CU_MEMHOSTREGISTER_READ_ONLY: the mapping is PROT_READ


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


def upload(copies, source: memoryview | None = None) -> dict:
    """Copy every (device address, host memoryview) pair host -> device, synchronously; `source`
    is a buffer that contains every host view (the weights section), the span to register.
    Returns {"bytes", "method"} for load statistics."""
    copies = [(dst, src if src.format == "B" and src.ndim == 1 else src.cast("B"))
              for dst, src in copies]
    total = sum(src.nbytes for _, src in copies)
    method = "pageable"
    registered = None
    if source is not None and total >= REGISTER_MIN_NBYTES:
        registered = _register(source)
        if registered is not None:
            method = "registered"
    try:
        for dst, src in copies:
            driver.copy_htod(dst, _address(src), src.nbytes)
    finally:
        if registered is not None:
            call(driver.cuda().cuMemHostUnregister, registered)
    return {"bytes": total, "method": method}


def _register(source: memoryview):
    """Page-lock the pages under `source`; return the registered base address, or None (and the
    caller copies from pageable memory) when the driver refuses."""
    start = _address(source)
    base = start & ~(_PAGE - 1)
    nbytes = (start + source.nbytes - base + _PAGE - 1) & ~(_PAGE - 1)
    try:
        call(driver.cuda().cuMemHostRegister, base, nbytes, _READ_ONLY)
    except GraceRuntimeError:
        return None
    return base
