"""tools/kernel_resources.py: registers and programs per multiprocessor from a package's cubins
(cuobjdump of Triton's NVIDIA backend, no GPU), alone and beside the node a kernel overlaps."""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.formats.archs import sm_count  # noqa: E402
from grace.tools import kernel_resources as kr  # noqa: E402

H200 = kr.SM_LIMITS["sm_90"]


def test_programs_per_sm_counts_registers_by_the_warp():
    """The register story of the twentieth session, in numbers: two persistent-GEMV programs (66
    registers, 8 warps) leave no room for a 4-warp attention program at 255 registers, and room
    for one at 178."""
    assert kr.programs_per_sm(255, 4, 1024, H200) == 2
    gemv = 2 * kr.block_registers(66, 8)
    assert gemv == 2 * 72 * 32 * 8   # 66 registers a thread are granted as 72
    taken = (gemv, 2 * 256, 2 * (1024 + H200["reserved"]), 2)
    assert kr.programs_per_sm(255, 4, 1024, H200, taken) == 0
    assert kr.programs_per_sm(178, 4, 1024, H200, taken) == 1
    # threads, shared memory and the block limit bound it too
    assert kr.programs_per_sm(16, 32, 0, H200) == 2
    assert kr.programs_per_sm(16, 1, 115840, H200) == 1   # the runtime's one-program cap
    assert kr.programs_per_sm(16, 1, 76928, H200) == 2    # ... and its two-program one
    assert kr.programs_per_sm(16, 1, 0, H200) == 32


def test_what_keeps_a_program_from_starting_beside_the_node_before():
    """The Llama-1B decode attention (197 registers, 4 warps, the one-wave cap's 115840 bytes of
    shared memory) beside six QKV GEMV programs (56 registers, 4 warps, 32384 bytes): short of
    registers and shared memory; it would fit the registers at 176 a thread, not at 184, and the
    shared memory at 32000 bytes (not the 34816 it uses uncapped). With room to spare, nothing
    is short."""
    qkv = 6
    taken = (qkv * kr.block_registers(56, 4), qkv * 128, qkv * (32384 + H200["reserved"]), qkv)
    assert kr.binding_limits(197, 4, 115840, H200, taken) == ["regs", "shared"]
    assert kr.fitting_registers(4, H200, taken) == 176
    assert kr.programs_per_sm(176, 4, 1024, H200, taken) == 1
    assert kr.programs_per_sm(184, 4, 1024, H200, taken) == 0
    assert kr.binding_limits(176, 4, 1024, H200, taken) == []
    assert kr.fitting_registers(4, H200, (0, 0, 0, 0)) == 255
    assert kr.fitting_shared(H200, taken) == 32000
    assert kr.programs_per_sm(176, 4, 32000, H200, taken) == 1
    assert kr.binding_limits(176, 4, 34816, H200, taken) == ["shared"]
    assert kr.fitting_shared(H200, (0, 0, H200["shared"], 0)) == 0


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kr") / "mlp.grace"
    return grace_compile(MLP().eval(), (torch.randn(4, 64),), output=path, progress=False,
                         fp32_matmul="ieee")


def test_rows_read_every_node_from_the_cubins(package):
    pkg = read_package(package, verify=False)
    rows = kr.node_rows(pkg, "sm_90")
    graph = pkg.view.graphs[0]
    assert [r["node"] for r in rows] == list(range(len(graph.nodes)))
    for r, node in zip(rows, graph.nodes):
        kernel = pkg.view.kernels[node.kernel]
        assert r["kernel"] == kernel.name and r["regs"] > 0 and r["alone"] >= 1
        assert r["waves"] == pytest.approx(math.prod(node.grid) / (r["alone"] * sm_count("sm_90")))
        if node.programmatic:   # launched with the runtime's one-wave cap, beside its predecessor
            assert r["after"] == max(node.programmatic) and r["shared"] >= kernel.shared
            assert 0 <= r["beside"] <= r["alone"]
            assert bool(r["short_of"]) == (r["beside"] == 0) and 0 <= r["fit_regs"] <= 255
            assert 0 <= r["fit_shared"] <= H200["shared"]
        else:
            assert r["beside"] is None and r["shared"] == kernel.shared
            assert r["short_of"] == [] and r["fit_regs"] is None and r["fit_shared"] is None
    assert any(r["beside"] is not None for r in rows)   # sm_90: programmatic edges by default


def test_cli_prints_a_table_and_writes_json(package, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert kr.main([str(package), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert table.startswith("graph ") and all(r["kernel"][:26] in table for r in rows)
    assert " waves " in table and all(f"{r['waves']:.2f}" in table for r in rows)
    assert kr.main([str(package), "--graph", "no-such-graph"]) == 1
    assert "no graph named no-such-graph" in capsys.readouterr().err
    assert kr.main([str(package), "--arch", "sm_75"]) == 1
    assert "sm_75" in capsys.readouterr().err


def test_missing_cuobjdump_says_where_to_get_it(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia", None)
    monkeypatch.setattr(kr.shutil, "which", lambda name: None)
    with pytest.raises(kr.ResourceError, match="install triton"):
        kr.find_cuobjdump()


def test_uncapped_families_keep_their_own_shared_memory(package):
    """--uncapped FAMILY: those nodes counted as launched without the one-wave cap."""
    pkg = read_package(package, verify=False)
    capped = kr.node_rows(pkg, "sm_90")
    spared = kr.node_rows(pkg, "sm_90", uncapped=("matmul",))
    kernels = pkg.view.kernels
    for c, s in zip(capped, spared):
        if c["family"] == "matmul" and c["after"] is not None:
            assert s["shared"] == kernels[pkg.view.graphs[0].nodes[s["node"]].kernel].shared
            assert s["alone"] >= c["alone"] and s["beside"] >= c["beside"]
        else:   # other nodes keep the cap (their "beside" may change with the node before)
            assert s["shared"] == c["shared"] and s["alone"] == c["alone"]
    assert any(c["family"] == "matmul" and c["after"] is not None for c in capped)


def test_mma_kind_reads_the_matrix_instruction_from_sass():
    both = "  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;\n  HMMA.16816.F32 R1 ;"
    assert kr.mma_kind(both) == "wgmma"
    assert kr.mma_kind("        HMMA.16816.F32.BF16 R16, R16, R4, RZ ;") == "mma"
    assert kr.mma_kind("        FFMA R1, R2, R3, R4 ;\n   LDG.E.128 R4, [R2.64] ;") == "-"


def test_mma_column_tells_warpgroup_tiles_from_warp_tiles(tmp_path, capsys):
    """bf16 GEMMs of 2048 rows: the 512-column one gets 64-row tiles, which Triton gives Hopper's
    warpgroup MMA (HGMMA); the 64-column one gets 16-row tiles (more row tiles to fill the chip),
    which run the warp-level mma.sync (HMMA); the table writer has neither."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 64)).to(torch.bfloat16).eval()
    path = grace_compile(model, (torch.randn(2048, 256, dtype=torch.bfloat16),),
                         output=tmp_path / "bf16.grace", progress=False, archs=("sm_90",))
    rows = kr.node_rows(read_package(path, verify=False), "sm_90")
    kinds = {r["family"]: set() for r in rows}
    for r in rows:
        kinds[r["family"]].add(r["mma"])
    assert kinds["table_writer"] == {"-"} and kinds["matmul"] == {"wgmma", "mma"}
    assert kr.main([str(path)]) == 0
    table = capsys.readouterr().out
    assert " mma " in table and " wgmma" in table


def test_fp32_ieee_matmuls_use_no_tensor_cores(package):
    """fp32_matmul="ieee" multiplies in fp32 FMAs: no matrix instruction in any kernel."""
    rows = kr.node_rows(read_package(package, verify=False), "sm_90")
    assert {r["mma"] for r in rows} == {"-"}
