"""The GEMV forms a decode MLP can take, and what each form's package must show in its source.

Shared by tests/gpu/test_decode_kernels_gpu.py (each form behind programmatic edges, on the GPU)
and tests/test_gemv_form_packages.py (the same packages compiled here, without a GPU). The CPU
test exists because the GPU test's preconditions went stale once: when fuse_rows.PAIR_PERSISTENT
became the default, the three other forms' packages were paired too and the GPU suite, not CI,
was the first to see it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FORMS = ("long-row", "persistent-split", "persistent-split-sums", "paired-persistent")


class MlpStep(torch.nn.Module):
    """A decode step's MLP at Llama-3-8B's width: RMSNorm, gate and up projections of K 4096
    (the persistent GEMV, codegen._gemv_persistent, which reduces the RMSNorm's mean itself:
    fuse_stats.FOLD_INTO_PERSISTENT), SwiGLU, a down projection of K 5000 (past
    GEMV_LONG_K: tiles with the next K step ahead, the last step ragged), the residual, then a
    projection of K 3000 (persistent, one masked tile of 4096 columns)."""

    def __init__(self):
        super().__init__()
        self.norm_w = torch.nn.Parameter(torch.rand(4096) + 0.5)
        self.gate = torch.nn.Linear(4096, 5000, bias=False)
        self.up = torch.nn.Linear(4096, 5000, bias=False)
        self.down = torch.nn.Linear(5000, 4096, bias=False)
        self.mid = torch.nn.Linear(4096, 3000, bias=False)
        self.out = torch.nn.Linear(3000, 1000, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.norm_w
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.out(self.mid(x))


def set_form(monkeypatch, form: str) -> None:
    """Turn on the knobs that give the down projection (K 5000) `form`; each is off by default
    but `paired-persistent`: the long-row form (the comment at codegen.GEMV_PERSISTENT_MIN_K);
    the persistent form over 2 K chunks of 2500 whose partial rows a reduction sums
    (codegen.GEMV_PERSISTENT_SPLIT_MIN_K); `-sums`: those partial rows and the residual added by
    the K-4096 GEMV after it where it loads its row (fuse_sums.INLINE_SPLIT_SUMS);
    `paired-persistent`: the persistent gate+up stores silu(gate) * up for the down projection
    (fuse_rows.PAIR_PERSISTENT). The pairing is turned off for the other forms, so each package
    holds the one form it is named for (none of them is paired by default: their knobs are off)."""
    from grace.aot import codegen, fuse_rows, fuse_sums
    assert form in FORMS, form
    monkeypatch.setattr(fuse_rows, "PAIR_PERSISTENT", form == "paired-persistent")
    if form == "long-row":
        monkeypatch.setattr(codegen, "GEMV_LONG_K", 4096)
    elif form != "paired-persistent":
        monkeypatch.setattr(codegen, "GEMV_PERSISTENT_SPLIT_MIN_K", 4097)
    monkeypatch.setattr(fuse_sums, "INLINE_SPLIT_SUMS", form.endswith("-sums"))


def check_form_sources(pkg, form: str) -> None:
    """Assert that the package `pkg` (formats.read_package) holds `form` and only it."""
    sources = "\n".join(bytes(pkg.section(k["source"])).decode()
                        for k in pkg.manifest["kernels"] if k["family"] == "matmul")
    assert "for turn in range(" in sources and "b = b_next" in sources
    assert "stat = tl.sum(" in sources   # the RMSNorm's mean inside gate+up (FOLD_INTO_PERSISTENT)
    assert ("b_next_hi" in sources) == (form == "paired-persistent")
    if form.startswith("persistent-split"):
        assert "rk = (tl.program_id(1) // 1) * 2500 + rc" in sources
        families = [k["family"] for k in pkg.manifest["kernels"]]
        assert ("reduction" in families) == (form == "persistent-split")
