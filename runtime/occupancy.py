"""One wave per programmatic launch: the dynamic shared memory a programmatic-edge target gets.

A kernel behind a programmatic edge launches while the kernel before it still runs (SPEC §5.3).
Its blocks land on whichever multiprocessors have room at that moment — few, near the end of the
kernel before — and each of those takes as many blocks as its resources allow. When the wait
releases them, a handful of multiprocessors hold most of the grid while the rest of the chip
waits for the next launch. Measured on the H200 (docs/performance.md, seventh session): ViT-S with
programmatic edges into its 144–250-block GEMMs ran 0.680 ms against 0.585 ms with full edges;
with at most two blocks per multiprocessor, 0.554 ms.

So the runtime caps a programmatic target's blocks per multiprocessor at what one wave of its
grid needs, ceil(blocks / multiprocessors), by launching it with more dynamic shared memory than
the kernel uses: the smallest amount at which one block more no longer fits. A cap of one block
for a grid of more blocks than multiprocessors would cost a second wave, which is why the cap
follows the grid. It is a launch setting of this GPU (its multiprocessor count and shared memory
per multiprocessor), not part of the package; kernels never read the extra memory.
"""
from __future__ import annotations

from typing import NamedTuple

ALLOCATION_UNIT = 128   # bytes: shared memory is granted to a block in multiples of this (sm_80+)


class SharedLimits(NamedTuple):
    """What one GPU grants: multiprocessors, shared memory per multiprocessor, the shared memory
    the driver reserves per block, and the most one block may opt in to (bytes)."""

    sm_count: int
    per_sm: int
    reserved: int
    per_block: int


def device_limits(cu, device) -> SharedLimits:
    attr = cu.CUdevice_attribute

    def get(name):
        result = cu.cuDeviceGetAttribute(getattr(attr, name), device)
        return int(result[1]) if not result[0] else 0

    return SharedLimits(get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
                        get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
                        get("CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK"),
                        get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"))


def one_wave_shared(blocks: int, shared: int, limits: SharedLimits) -> int:
    """The dynamic shared memory to launch `blocks` blocks of a kernel that uses `shared` bytes
    with, so that at most ceil(blocks / multiprocessors) blocks fit on one multiprocessor; `shared`
    itself when that already holds, or when no amount within the per-block limit gives exactly
    that cap (a GPU that reports no limits: a fake driver)."""
    if min(limits) <= 0 or blocks <= 0:
        return shared
    per_sm_blocks = -(-blocks // limits.sm_count)
    need = limits.per_sm // (per_sm_blocks + 1) - limits.reserved + 1
    need = -(-need // ALLOCATION_UNIT) * ALLOCATION_UNIT
    if need <= shared or need > limits.per_block:
        return shared
    if per_sm_blocks * (need + limits.reserved) > limits.per_sm:
        return shared   # the cap would not leave room for one wave: leave the kernel as it is
    return need


# The cap only on grids of at most this many programs per multiprocessor (None: on every grid).
# A larger grid's blocks spread over every multiprocessor whatever lands first, and its cap (a
# share of shared memory a block) only keeps the next kernel's programs from starting beside it.
# H100, one process a shape, generate() ms/token (tools/wave_cap_ab.py, docs/performance.md,
# thirtieth session): Llama-1B 1.0119 / 1.0089 with the cap on every programmatic node, 1.0070 /
# 1.0064 with it up to 2 programs per multiprocessor; Llama-8B 5.347 -> 5.327 (no cap: 1.012 and
# 5.358; up to 4: 1.016 / 1.013 and 5.332). On the H200 (thirty-first session) up to 2 tied the
# cap on every node: 1B 0.7950 / 0.7967 against 0.7993 / 0.7967, 8B 4.007 / 4.012 against
# 4.036 / 4.006 (each pass's pairs spread 3.88-4.09). None.
CAP_MAX_PER_SM = None


def cap_programmatic(plans: list, limits: SharedLimits, max_per_sm: int | None = None) -> list:
    """One graph's NodePlans with every node that has a programmatic dependency (and a grid of at
    most `max_per_sm` programs per multiprocessor, CAP_MAX_PER_SM when not given, where either is
    set) launched with one_wave_shared; the other nodes as they are."""
    limit = CAP_MAX_PER_SM if max_per_sm is None else max_per_sm
    capped = []
    for plan in plans:
        gx, gy, gz = plan.grid
        if plan.programmatic and (limit is None or gx * gy * gz <= limit * limits.sm_count):
            shared = one_wave_shared(gx * gy * gz, plan.shared, limits)
            if shared != plan.shared:
                plan = plan.with_shared(shared)
        capped.append(plan)
    return capped
