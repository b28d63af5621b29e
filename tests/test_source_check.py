"""A package's kernel sources are data (tools/source_check.py): `--interpret` runs only sources in
the Triton subset grace's codegen emits, and `grace verify` refuses the rest. A payload added to a
source section, with every hash recomputed, is refused before any of it runs."""
from __future__ import annotations

import copy
import pathlib
import re
import subprocess
import sys

import msgpack
import pytest

from grace.tools.source_check import TL_NAMES, SourceRefused, check_kernel_source

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOOD = '''import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def k(p0, p1_slot, n):
    gdc_launch_dependents()
    gdc_wait()
    p1 = tl.load(p1_slot).to(tl.pointer_type(tl.float32))
    offs = tl.program_id(0) * 128 + tl.arange(0, 128)
    acc = tl.zeros([16, 32], tl.float32)
    for kk in range(0, 64, 16):
        acc += 1.0
    if offs[0] >= n:
        return
    x = tl.load(p0 + offs[:, None], mask=offs < n, other=0) * -float("inf")
    tl.store(p1 + offs, tl.where(x > 0, x, 0.0).to(tl.float32))
'''


def test_codegen_vocabulary_is_whitelisted():
    """Every tl.<name> the compiler can emit is accepted (keeps the whitelist and codegen in step)."""
    used = set()
    for path in (ROOT / "aot").glob("*.py"):
        used |= set(re.findall(r"\btl\.([A-Za-z_]\w*)", path.read_text()))
    assert used - TL_NAMES == set()


def test_a_kernel_like_ours_is_accepted():
    assert check_kernel_source(GOOD) == "k"


@pytest.mark.parametrize("edit, why", [
    (lambda s: "import os\n" + s, "module level"),
    (lambda s: s.replace("import triton\n", "import triton, os\n"), "module level"),
    (lambda s: s + "\nprint('hi')\n", "module level"),
    (lambda s: s.replace("@triton.jit", "@triton.jit\n@staticmethod"), "exactly @triton.jit"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    open('/tmp/x', 'w')\n"), "call of 'open'"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = tl.extra\n"), "attribute"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = p0.__class__\n"), "attribute"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = __import__\n"), "'_'"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = [i for i in range(3)]\n"), "ListComp"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = lambda: 0\n"), "Lambda"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    while True:\n        pass\n"), "While"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    p0.x = 1\n"), "plain names"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = getattr(p0, 'x')\n"), "call of 'getattr'"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = x_undefined\n"), "neither"),
    (lambda s: s.replace("    gdc_wait()\n", "    gdc_wait()\n    t = tl.load(p0).item()\n"), "call of"),
    (lambda s: s.replace("def k(p0, p1_slot, n):", "def k(p0, p1_slot, n=2):"), "positional"),
    (lambda s: s.replace("        return\n", "        return 1\n"), "returns nothing"),
    (lambda s: s.replace("for kk in range(0, 64, 16):", "for kk in tl.arange(0, 4):"), "range"),
    (lambda s: s + "\n@triton.jit\ndef k2(a):\n    pass\n", "module level"),
    (lambda s: "def (:", "does not parse"),
])
def test_anything_else_is_refused(edit, why):
    with pytest.raises(SourceRefused, match=re.escape(why)):
        check_kernel_source(edit(GOOD))


def _payload_package(tmp_path):
    """A real package whose first kernel source also writes a file when imported (hashes recomputed)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.formats.package import pack_package_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).eval()
    path = grace_compile(model, (torch.randn(2, 8),), output=tmp_path / "m.grace", progress=False)
    pkg = read_package(path)
    marker = tmp_path / "payload-ran"
    kernel = next(k for k in pkg.manifest["kernels"] if k["family"] != "table_writer")
    src = bytes(pkg.section(kernel["source"])).decode()
    evil = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n" + src
    sections = {n: bytes(pkg.section(n)) for n in pkg.section_names if not n.startswith("sha256/")}
    sections[kernel["source"]] = evil.encode()
    manifest = copy.deepcopy(pkg.manifest)
    bad = tmp_path / "payload.grace"
    bad.write_bytes(pack_package_bytes(msgpack.packb(manifest, use_bin_type=True), sections,
                                       version=tuple(manifest["format_version"])))
    return bad, marker, kernel["name"]


def test_payload_is_refused_by_interpret_and_verify(tmp_path):
    import numpy as np

    from grace.formats import read_package
    from grace.tools.interpret import InterpretError, run_package

    bad, marker, name = _payload_package(tmp_path)
    read_package(bad)   # the container is valid: hashes match
    with pytest.raises(InterpretError, match="kernel source refused, nothing from it was run"):
        run_package(bad, {"input": np.zeros((2, 8), np.float32)})
    assert not marker.exists()
    r = subprocess.run([sys.executable, "-m", "grace.tools.cli", "verify", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and f"kernel {name}: source refused" in r.stderr
    assert not marker.exists()
