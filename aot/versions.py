"""The producer versions grace's compiler is pinned to, and the warning when others run it.

A package records the torch and triton that wrote it (manifest `producer`, aot/manifest.py). The
lowering reads torch.export's graphs, whose op set and metadata change between torch releases, and
the cubins carry Triton's kernel ABI (hidden arguments, metadata), which changes between Triton
releases: the compiler is tested with exactly the versions below (pyproject.toml's `aot` extra pins
the same ones; tests/test_versions.py keeps the two in step). Any other version may work — the GPU
machine compiles with torch 2.11 — so a difference is a warning, never an error.

    PINNED                  {"torch": "2.13.0", "triton": "3.6.0"}
    running()               the versions in this process (torch without its local tag: 2.13.0+cpu -> 2.13.0)
    mismatches()            [(name, running, pinned), ...] for each that differs
    producer_warning()      the message for them, or None
    warn_if_unpinned()      warnings.warn(message, ProducerVersionWarning); returns the message
"""
from __future__ import annotations

import warnings

PINNED = {"torch": "2.13.0", "triton": "3.6.0"}

# torch's CPU build: the PyPI wheel for Linux is the multi-GB CUDA one
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL_PINNED = (f"pip install torch=={PINNED['torch']} --index-url {CPU_INDEX} && "
                  f"pip install triton=={PINNED['triton']}")


class ProducerVersionWarning(UserWarning):
    """grace.aot runs with a torch or triton other than the pinned ones (aot/versions.py)."""


def _release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (the local build tag says which wheel, not which release)."""
    return str(version).split("+")[0]


def running() -> dict:
    """{"torch": ..., "triton": ...} of this process, as the package's `producer` records them."""
    import torch
    import triton

    return {"torch": _release(torch.__version__), "triton": _release(triton.__version__)}


def mismatches(versions: dict | None = None) -> list[tuple[str, str, str]]:
    """(name, running, pinned) for every producer whose release differs from the pinned one."""
    versions = running() if versions is None else versions
    return [(name, _release(versions.get(name, "unknown")), pinned)
            for name, pinned in PINNED.items() if _release(versions.get(name, "unknown")) != pinned]


def producer_warning(versions: dict | None = None) -> str | None:
    """What is running, what is pinned and what to do; None when the versions are the pinned ones."""
    diff = mismatches(versions)
    if not diff:
        return None
    what = ", ".join(f"{name} {have} (pinned: {pinned})" for name, have, pinned in diff)
    return (f"grace.aot is running with {what}. The compiler is tested with torch "
            f"{PINNED['torch']} and triton {PINNED['triton']}; other versions may lower ops "
            f"differently or build kernels with another Triton ABI, and the package records the "
            f"versions that wrote it (manifest 'producer'). To compile with the pinned versions: "
            f"{INSTALL_PINNED} (or bash tools/setup.sh).")


def warn_if_unpinned(versions: dict | None = None, stacklevel: int = 3) -> str | None:
    """Warn (ProducerVersionWarning) when the running versions are not the pinned ones; returns the
    message (None when they are). Python shows a given warning once per call site."""
    message = producer_warning(versions)
    if message is not None:
        warnings.warn(message, ProducerVersionWarning, stacklevel=stacklevel)
    return message
