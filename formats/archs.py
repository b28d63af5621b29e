"""GPU architecture names and what grace knows about each target: the one module for arch rules.

Everything that parses an `sm_XY` name, compares architectures, decides whether one has
programmatic dependent launch, knows its multiprocessor count or picks the binary (and, format
3.5, the graphs) for a GPU lives here, so the compiler, the format's validator, the runtime and the
tools cannot disagree. Standard library (and formats.limits) only: the torch-free runtime imports it.

    ARCH_RE                 what a manifest may name (SPEC §3): sm_<digits>[letter], e.g. sm_90a
    COMPILE_ARCH_RE         what the compiler targets: sm_80 and newer, no letter (sm_80, sm_100)
    capability("sm_90a")    (9, 0): major = every digit but the last, minor = the last
    supports_pdl(arch)      griddepcontrol (programmatic dependent launch) exists: sm_90 and newer
    SM_COUNTS, sm_count()   multiprocessors of the part grace plans tiles for, per arch
    pick_arch(cap, archs)   the package arch a GPU of compute capability `cap` runs (SPEC §5.1)

The SM counts are those of one part per arch (a default: `--sm-count ARCH=N` overrides it for
another part of the same arch). Sources: NVIDIA's architecture whitepapers and product pages, as
`cudaDeviceProp.multiProcessorCount` reports them:

    sm_80   108  A100 (SXM4 and PCIe; the full GA100 die has 128)
    sm_86    84  A40, RTX A6000, RTX 3090 Ti (full GA102; RTX 3090: 82, A10: 72)
    sm_89   128  RTX 4090 (AD102 has 144; L40S: 142, L4: 58 — pass --sm-count for those)
    sm_90   132  H100 SXM5, H200, GH200 (H100 PCIe: 114)
    sm_100  148  B200 (two dies of 74 enabled SMs each)
    sm_120  170  RTX 5090

An arch without an entry (sm_87 Jetson Orin, sm_103, ...) needs an explicit `--sm-count`.
"""

from __future__ import annotations

import re

from .limits import MAX_SM_COUNT   # the largest SM count an option or a record may name

ARCH_RE = re.compile(r"sm_([0-9]+)([a-z]?)")      # a manifest's `archs` (SPEC §3)
COMPILE_ARCH_RE = re.compile(r"sm_([0-9]{2,3})")  # the compiler's targets (Triton: sm_80 and newer)
MIN_COMPILE_CAPABILITY = (8, 0)
PDL_MIN_CAPABILITY = (9, 0)   # griddepcontrol.wait / launch_dependents (ptxas rejects them before)

SM_COUNTS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_100": 148, "sm_120": 170}


def capability(arch: str) -> tuple[int, int]:
    """(major, minor) of an arch name: "sm_90" -> (9, 0), "sm_100" -> (10, 0), "sm_90a" -> (9, 0).
    A one-digit name ("sm_8", which the format's pattern admits) is (0, 8). ValueError for a name
    that is not sm_<digits>[letter]."""
    m = ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        raise ValueError(f"{arch!r} is not an arch name like 'sm_90'")
    digits = m.group(1)
    return int(digits[:-1] or 0), int(digits[-1])


def is_arch(arch) -> bool:
    """`arch` is a name a manifest may list (sm_<digits>[letter])."""
    return isinstance(arch, str) and ARCH_RE.fullmatch(arch) is not None


def supports_pdl(arch_or_capability) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists on this arch or compute capability:
    sm_90 and newer."""
    cap = capability(arch_or_capability) if isinstance(arch_or_capability, str) else \
        tuple(arch_or_capability)
    return cap >= PDL_MIN_CAPABILITY


def check_compile_arch(arch: str) -> str:
    """`arch` as a compile target (sm_80 and newer, no letter); ValueError naming it otherwise."""
    m = COMPILE_ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None or capability(arch) < MIN_COMPILE_CAPABILITY:
        raise ValueError(f"unsupported arch {arch!r}: expected sm_80, sm_90, sm_100, ...")
    return arch


def sm_count(arch: str, overrides=None) -> int:
    """The multiprocessor count grace plans `arch` for: `overrides` ({arch: n}) first, then
    SM_COUNTS. ValueError for an arch with neither (say which option sets it)."""
    overrides = dict(overrides or {})
    if arch in overrides:
        return int(overrides[arch])
    if arch not in SM_COUNTS:
        raise ValueError(f"grace knows no multiprocessor count for {arch}; give it with "
                         f"--sm-count {arch}=N (grace.aot.compile(sm_count={{{arch!r}: N}}))")
    return SM_COUNTS[arch]


def check_sm_count(n, what: str = "sm_count") -> int:
    """An SM count: an int in [1, MAX_SM_COUNT] (not a bool); ValueError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SM_COUNT:
        raise ValueError(f"{what}: {n!r} is not a multiprocessor count (an int in 1..{MAX_SM_COUNT})")
    return n


def pick_arch(cap, archs) -> str | None:
    """The arch of `archs` whose binaries (and, format 3.5, whose graphs) a GPU of compute
    capability `cap` (major, minor) runs, by SPEC §5.1: the exact `sm_XY`, else `sm_XYa`, else the
    newest `sm_XZ` with Z <= Y (cubins run on later minors of the same major); None when no arch
    fits (another major: the package must be compiled for this GPU)."""
    major, minor = cap
    exact = f"sm_{major}{minor}"
    for candidate in (exact, exact + "a"):
        if candidate in archs:
            return candidate
    same_major = []
    for arch in archs:
        m = ARCH_RE.fullmatch(arch)
        if m is None or m.group(2) or len(m.group(1)) < 2:   # letters: only the exact match above
            continue
        a_major, a_minor = capability(arch)
        if a_major == major and a_minor <= minor:
            same_major.append((a_minor, arch))
    return max(same_major)[1] if same_major else None


__all__ = ["ARCH_RE", "COMPILE_ARCH_RE", "MIN_COMPILE_CAPABILITY", "PDL_MIN_CAPABILITY", "MAX_SM_COUNT",
           "SM_COUNTS", "capability", "is_arch", "supports_pdl", "check_compile_arch", "sm_count",
           "check_sm_count", "pick_arch"]
