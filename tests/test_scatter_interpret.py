"""Scatters through the interpreter against eager: torch.scatter (src and value), scatter_add,
scatter_reduce (sum/amax/amin, with and without the old values), index_add and
index_put(accumulate=True) — repeated destinations combine (atomics on the device)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_vision_interpret import check_all  # noqa: E402

pytestmark = pytest.mark.slow


class Scatters(torch.nn.Module):
    def forward(self, x, src, idx, rows):
        return (x.scatter(1, idx, src),                          # distinct destinations per row
                x.scatter(0, idx[:2].clamp(max=2), 2.5),
                x.scatter_add(1, idx.repeat(1, 2) % 3, src.repeat(1, 2)),   # repeats add
                x.scatter_reduce(1, idx % 2, src, "sum", include_self=False),
                x.scatter_reduce(1, idx % 2, src, "amax"),
                x.scatter_reduce(1, idx % 2, src, "amin", include_self=False),
                x.index_add(0, rows, src[:, :1].expand(-1, 6) * 2.0),
                x.index_put((rows,), src[:, :1].expand(-1, 6), accumulate=True))


def test_scatters(tmp_path):
    def make():
        g = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
        idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(4)])
        return (torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g), idx,
                torch.tensor([3, 0, 3, 1]))
    check_all(Scatters(), make, tmp_path)
