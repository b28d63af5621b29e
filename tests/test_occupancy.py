"""One wave per programmatic launch (runtime/occupancy.py, SPEC §5.3): the dynamic shared memory a
programmatic-edge target is launched with caps its blocks per multiprocessor at ceil(blocks / SMs),
never below what the kernel uses and never past the per-block limit; the loader applies it to the
nodes with programmatic deps only, and opts their kernels in to the larger amount."""
from __future__ import annotations

import numpy as np
import pytest

from grace.runtime.occupancy import SharedLimits, cap_programmatic, one_wave_shared

H200 = SharedLimits(sm_count=132, per_sm=233472, reserved=1024, per_block=232448)
A100 = SharedLimits(sm_count=108, per_sm=167936, reserved=1024, per_block=166912)


def _fit(shared: int, limits: SharedLimits) -> int:
    """Blocks of `shared` bytes one multiprocessor holds (by shared memory alone)."""
    return limits.per_sm // (shared + limits.reserved)


@pytest.mark.parametrize("limits", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("blocks", [1, 7, 107, 108, 132, 133, 144, 250, 264, 500, 1536, 4000])
@pytest.mark.parametrize("shared", [0, 4096, 40960, 90000])
def test_one_wave_exactly(limits, blocks, shared):
    """Against a brute-force search: the least multiple of 128 at which one multiprocessor holds
    exactly one wave's blocks; the kernel's own amount when that already caps it or none does."""
    wave = -(-blocks // limits.sm_count)
    if _fit(shared, limits) <= wave:
        want = shared
    else:
        want = next((x for x in range(128, limits.per_block + 1, 128) if _fit(x, limits) == wave),
                    shared)
    assert one_wave_shared(blocks, shared, limits) == want


def test_nothing_changes_without_limits_or_blocks():
    assert one_wave_shared(144, 4096, SharedLimits(0, 0, 0, 0)) == 4096   # a fake driver's zeros
    assert one_wave_shared(0, 4096, H200) == 4096


def test_only_programmatic_targets_are_capped():
    from grace.runtime.graph import NodePlan

    plans = [NodePlan(0, "writer", 0, (1, 1, 1), 32, 0, (), ()),
             NodePlan(1, "a", 1, (144, 1, 1), 128, 0, (), (0,)),
             NodePlan(2, "b", 1, (12, 12, 1), 128, 0, (), (0, 1), (1,))]
    capped = cap_programmatic(plans, H200)
    assert [p.shared for p in capped[:2]] == [0, 0] and capped[0] is plans[0]
    assert capped[2].shared == one_wave_shared(144, 0, H200) > 0 and _fit(capped[2].shared, H200) == 2
    assert (capped[2].grid, capped[2].deps, capped[2].programmatic) == ((12, 12, 1), (0, 1), (1,))


def test_the_cap_can_be_kept_to_small_grids(monkeypatch):
    """CAP_MAX_PER_SM (None: every grid): with 2, a programmatic grid of more than two programs
    per multiprocessor keeps the kernel's own shared memory; the rest are capped as before."""
    from grace.runtime import occupancy
    from grace.runtime.graph import NodePlan

    plans = [NodePlan(i, f"n{i}", i, grid, 128, 1024, (), (i - 1,), (i - 1,))
             for i, grid in enumerate([(264, 1, 1), (265, 1, 1), (768, 1, 1), (1, 32, 1)], 1)]
    every = [p.shared for p in cap_programmatic(plans, H200)]
    assert occupancy.CAP_MAX_PER_SM is None and all(s > 1024 for s in every)
    monkeypatch.setattr(occupancy, "CAP_MAX_PER_SM", 2)
    assert [p.shared for p in cap_programmatic(plans, H200)] == [every[0], 1024, 1024, every[3]]


def test_the_loader_launches_programmatic_targets_one_wave_wide(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("cuda.bindings.driver")
    import grace.runtime as rt
    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.runtime import driver
    from grace.tools.fuzz import FakeDriver

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    path = grace_compile(model.eval(), (torch.randn(300, 64),), output=tmp_path / "mlp.grace",
                         fp32_matmul="ieee")   # sm_90, PDL by default
    m = read_package(path).manifest
    nodes = m["graphs"][0]["nodes"]
    assert any(n.get("programmatic") for n in nodes)
    want = [one_wave_shared(int(np.prod(n["grid"])), m["kernels"][n["kernel"]]["shared"], H200)
            if n.get("programmatic") else m["kernels"][n["kernel"]]["shared"] for n in nodes]
    assert any(w != m["kernels"][n["kernel"]]["shared"] for w, n in zip(want, nodes))
    for pdl in (True, False):
        fake = FakeDriver()   # an H200: 132 SMs, 228 KiB per SM; refuses a node past its opt-in
        monkeypatch.setattr(driver, "_cu", fake)
        loaded = rt.load(path, instantiate="eager", pdl=pdl)
        loaded.session().close()
        loaded.close()
        expected = want if pdl else [m["kernels"][n["kernel"]]["shared"] for n in nodes]
        assert fake.node_shared == expected
