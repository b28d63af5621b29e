"""The main job on an embedded example: export → grace compile → grace inspect → grace run.

    python -m grace.tools.example [--workdir DIR] [--interpret]

It exports a small Llama-style decoder block (grace.tools.models.LlamaBlock) with torch.export and
a dynamic sequence length (1..128), then drives the `grace` CLI exactly as a user would, printing
each command: the package holds two shape buckets (one CUDA graph each), and `grace run` feeds it a
length that is not a bucket size. `grace run` uses the GPU when one is present and otherwise the
CPU reference executor (`--interpret`); the result is compared with torch eager on the same input.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path


def sh(args: list[str]) -> None:
    print(f"\n$ {' '.join(shlex.quote(a) for a in args)}", flush=True)
    subprocess.run(args, check=True)


def has_gpu() -> bool:
    try:
        from grace.runtime import driver
        driver.Device(0)
        return True
    except Exception:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to write the files "
                    "(default: a temporary folder)")
    ap.add_argument("--interpret", action="store_true", help="use the CPU reference executor "
                    "even if a GPU is present")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from grace.tools.models import LlamaBlock

    work = args.workdir or Path(tempfile.mkdtemp(prefix="grace-example-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaBlock().eval()
    x = torch.randn(1, 32, 64)
    seq = torch.export.Dim("seq", min=1, max=128)
    exported = torch.export.export(model, (x,), dynamic_shapes={"x": {1: seq}})
    torch.export.save(exported, work / "block.pt2")
    print(f"exported LlamaBlock to {work / 'block.pt2'}")

    grace = [sys.executable, "-m", "grace.tools.cli"]
    # the dynamic dimension is named after its input and position: x.1
    sh(grace + ["compile", str(work / "block.pt2"), "-o", str(work / "block.grace"),
                "--name", "llama_block", "--buckets", "x.1=32,128"])
    sh(grace + ["inspect", str(work / "block.grace")])

    fresh = torch.randn(1, 77, 64)   # served by the 128 bucket, results of the exact length
    np.save(work / "x.npy", fresh.numpy())
    run = grace + ["run", str(work / "block.grace"), "--input", f"x={work / 'x.npy'}",
                   "--output", str(work / "out.npz")]
    if args.interpret or not has_gpu():
        run.append("--interpret")
    sh(run)

    got = next(iter(np.load(work / "out.npz").values())).astype(np.float64)
    with torch.no_grad():
        ref = model.double()(fresh.double()).numpy()
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    verdict = "OK" if err < 1e-3 else "MISMATCH"
    print(f"\nrelative error vs torch eager (fp64): {err:.2e}  {verdict}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
