"""A template GEMV's normalised row stored by the RMSNorm's mean kernel (aot/fuse_rows.py,
STORE_GEMV_ROWS): the GEMV then reads a plain vector, and results through the CPU reference
executor still match torch in fp64 (a product row and one that is not, a masked block, edge
values); a decode graph keeps its kernel count and decodes as eager."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grace.aot import fuse_rows  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.formats.races import check_pre_wait, check_races  # noqa: E402

from test_fuse_append import _decode, _eager  # noqa: E402
from test_fuse_stats import CenterProj, NormProj, NormTwice  # noqa: E402
from test_gemv_interpret import _check, _kernels  # noqa: E402

pytestmark = pytest.mark.slow


def _sources(path, family):
    pkg = read_package(path)
    return [bytes(pkg.section(k["source"])).decode() for k in pkg.manifest["kernels"]
            if k["family"] == family]


@pytest.fixture
def rows_on(monkeypatch):
    monkeypatch.setattr(fuse_rows, "STORE_GEMV_ROWS", True)


@pytest.mark.parametrize("k", [300, 2048])
def test_the_mean_kernel_stores_the_rms_norm_row(tmp_path, rows_on, k):
    torch.manual_seed(0)
    path = _check(NormProj(k, 37), {"x": torch.randn(1, k) * 3}, tmp_path, tol=1e-5)
    assert _kernels(path) == ["table_writer", "reduction", "matmul"]
    red, = _sources(path, "reduction")
    gemv, = _sources(path, "matmul")
    assert "stat = red[:, None]" in red and red.count("tl.store(") == 2
    assert "rsqrt" not in gemv and "rsqrt" in red   # the GEMV streams a plain row
    # the norm's weight loads before gdc_wait(), the value (x) after it; nothing else is early
    before, after = red.split("gdc_wait()")
    assert before.count("tl.load(") == 1 and "x1" in before and "x1" in after
    assert check_pre_wait(read_package(path)) == []


def test_a_row_that_is_no_product_reads_the_value(tmp_path, rows_on):
    torch.manual_seed(4)
    path = _check(CenterProj(1500, 12), {"x": torch.randn(1, 1500) + 2}, tmp_path, tol=1e-5)
    red, = _sources(path, "reduction")
    assert "stat = red[:, None]" in red


@pytest.mark.parametrize("k, scale", [(1, 1.0), (64, 1e-20), (64, 1e18), (33, 0.5)])
def test_edge_rows(tmp_path, rows_on, k, scale):
    torch.manual_seed(6)
    x = torch.randn(1, k) * scale if scale != 0.5 else torch.where(torch.rand(1, k) < 0.5, -0.5, 0.5)
    _check(NormProj(k, 9), {"x": x}, tmp_path, tol=1e-5)


def test_on_by_default_off_when_asked_or_with_another_reader(tmp_path, monkeypatch):
    from grace.aot import compile as grace_compile
    torch.manual_seed(2)
    path = grace_compile(NormTwice(64, 16).eval(), (torch.randn(1, 64),),
                         output=tmp_path / "t.grace", progress=False)
    assert all("stat = red" not in s for s in _sources(path, "reduction"))
    path = grace_compile(NormProj(256, 16).eval(), (torch.randn(1, 256),),
                         output=tmp_path / "d.grace", progress=False)
    assert any("stat = red" in s for s in _sources(path, "reduction"))   # the default
    monkeypatch.setattr(fuse_rows, "STORE_GEMV_ROWS", False)
    path = _check(NormProj(256, 16), {"x": torch.randn(1, 256)}, tmp_path)
    assert all("stat = red" not in s for s in _sources(path, "reduction"))


def test_a_cached_decoder_decodes_as_eager(tmp_path, rows_on):
    """The Llama decode step in fp32: its template GEMVs behind RMSNorms read stored rows, and
    prefill plus decode steps through the CPU reference executor match eager."""
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from grace.tools.models import CachedLlama

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96,
                        max_seq=32).eval()
    t = Dim("seq", min=1, max=32)
    path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=tmp_path / "lm.grace", progress=False, fp32_matmul="ieee",
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         buckets={"seq": [1, 32]})
    m = read_package(path).manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    pkg = read_package(path)
    reds = [bytes(pkg.section(m["kernels"][n["kernel"]]["source"])).decode()
            for n in decode["nodes"] if m["kernels"][n["kernel"]]["family"] == "reduction"]
    assert sum("stat = red[:, None]" in s for s in reds) == 5   # 2 norms a layer, and the head's
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    got, ref = _decode(path, idx), _eager(model, idx)
    for g, r in zip(got, ref):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < 1e-5, err


@pytest.mark.parametrize("tile, most, expr, sms, retiled", [
    (128, None, 0, 132, [64, 32, 96, 2] * 2 + [48]),
    # one program a multiprocessor on a 2-SM part: only the o projection (1 program) is retiled
    (128, 1, 0, 2, [2, 32, 3, 2] * 2 + [2]),
    # 64 rows of 128 columns for the down projection alone: one program
    (0, None, 8192, 132, [2, 1, 3, 1] * 2 + [2])],
    ids=["every-plain-row", "small-grids", "expression-rows"])
def test_row_tiles_retile_and_change_no_value(tmp_path, monkeypatch, tile, most, expr, sms,
                                              retiled):
    """PLAIN_ROW_TILE (off by default): the template GEMVs whose row is a plain vector (the stored
    rows, the attention's output into the o projection) take 2 rows a program, those whose row is
    an expression (the down projection's SwiGLU) keep theirs, and with PLAIN_ROW_MAX_PER_SM only
    those whose grid is under that many programs per multiprocessor. EXPR_ROW_TILE (off) retiles
    the expression rows alone. The decode gives the very logits of the package without them (each
    program sums its own rows in the same order), race-free."""
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from grace.tools.models import CachedLlama

    from test_fuse_append import _same_decodes

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96,
                        max_seq=32).eval()
    t = Dim("seq", min=1, max=32)

    monkeypatch.setattr(fuse_rows, "PLAIN_ROW_MAX_PER_SM", most)
    monkeypatch.setattr(fuse_rows, "PAIR_GATE_UP", False)   # keep the down projection's SwiGLU row

    def build(name, tile, expr):
        monkeypatch.setattr(fuse_rows, "PLAIN_ROW_TILE", tile)
        monkeypatch.setattr(fuse_rows, "EXPR_ROW_TILE", expr)
        return grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / name, progress=False, fp32_matmul="ieee",
                             dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, 32]}, sm_count={"sm_90": sms})

    def gemv_grids(path):
        m = read_package(path).manifest
        decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
        return [n["grid"][0] for n in decode["nodes"]
                if m["kernels"][n["kernel"]]["family"] == "matmul"]

    off, on = build("off.grace", 0, 0), build("on.grace", tile, expr)
    # a layer's qkv (128 columns), o (64), gate+up (192) and down (64, K 96: a SwiGLU row), then
    # the head (96). K 64 is one step of 64 columns: 4096 elements are 64 rows a program, 128 are
    # 2; the down projection keeps its 32 rows of 128 columns
    assert gemv_grids(off) == [2, 1, 3, 2] * 2 + [2]
    assert gemv_grids(on) == retiled
    assert check_races(read_package(on).manifest) == [] and check_pre_wait(read_package(on)) == []
    idx = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    _same_decodes(on, off, idx, prompts=(5, 9), model=model)


@pytest.mark.parametrize("k, n, scale, programs", [(1, 1, 1.0, 1), (300, 3, 0.5, 1),
                                                   (300, 37, 1e-20, 10), (2048, 5, 1e17, 3)])
def test_row_tiles_at_edge_sizes(tmp_path, rows_on, monkeypatch, k, n, scale, programs):
    """PLAIN_ROW_TILE on a stored RMSNorm row into a GEMV of one, a few and a ragged number of
    columns (masked rows in a program), K of one element to two steps, ±0.5 and tiny and huge
    values: fp64 torch's result. 2048 elements a K step: K 300 takes steps of 512 columns, so 4
    rows a program (37 columns: 10 programs, against 5 at the default 8), K 2048 2 rows (5
    columns: 3 programs)."""
    monkeypatch.setattr(fuse_rows, "PLAIN_ROW_TILE", 2048)
    torch.manual_seed(7)
    x = torch.randn(1, k) * scale if scale != 0.5 else torch.where(torch.rand(1, k) < 0.5, -0.5, 0.5)
    path = _check(NormProj(k, n), {"x": x}, tmp_path, tol=1e-5)
    m = read_package(path).manifest
    grids = [n_["grid"] for g in m["graphs"] for n_ in g["nodes"]
             if m["kernels"][n_["kernel"]]["family"] == "matmul"]
    assert grids == [[programs, 1, 1]]


class SwiGLU(torch.nn.Module):
    """Llama's MLP on one row: the down projection's row is silu(gate) * up, an expression."""

    def __init__(self, d: int, hidden: int, n: int):
        super().__init__()
        self.gate = torch.nn.Linear(d, hidden, bias=False)
        self.up = torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, n, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("hidden, n, scale, split", [(96, 1, 1.0, 1), (300, 37, 0.5, 1),
                                                     (8192, 5, 1e-20, 8), (8192, 37, 1e3, 8)])
def test_expression_row_tiles_at_edge_sizes(tmp_path, monkeypatch, hidden, n, scale, split):
    """EXPR_ROW_TILE on the down projection of a SwiGLU (its row an expression), with one, a
    ragged number of columns, and K long enough for split-K (8 K ranges, each summed into its
    own partial row): 8 rows a program at 1024 columns a step, the split kept, fp64 torch's
    result. ±0.5 rows, tiny and huge values."""
    monkeypatch.setattr(fuse_rows, "EXPR_ROW_TILE", 8192)
    monkeypatch.setattr(fuse_rows, "PAIR_GATE_UP", False)   # the row stays an expression
    torch.manual_seed(11)
    x = torch.randn(1, 16) * scale if scale != 0.5 else torch.where(torch.rand(1, 16) < 0.5, -0.5, 0.5)
    path = _check(SwiGLU(16, hidden, n), {"x": x}, tmp_path, tol=1e-5)
    m = read_package(path).manifest
    down = [nd for g in m["graphs"] for nd in g["nodes"]
            if m["kernels"][nd["kernel"]]["family"] == "matmul"][-1]
    bk = min(1024, 1 << (hidden - 1).bit_length())
    rows = min(max(2, 8192 // bk), max(2, 1 << (n - 1).bit_length()))
    assert down["grid"] == [-(-n // rows), split, 1]


def _paired_sources(pkg) -> dict[int, str]:
    """Kernel index -> source, for the package's paired GEMVs (the template sums a partner row
    into acc_hi, the persistent one loads b_next_hi)."""
    sources = {i: bytes(pkg.section(k["source"])).decode()
               for i, k in enumerate(pkg.manifest["kernels"]) if k["family"] == "matmul"}
    return {i: src for i, src in sources.items() if "acc_hi" in src or "b_next_hi" in src}


def _paired(path) -> list[list[int]]:
    """The grids of the package's paired GEMVs."""
    pkg = read_package(path)
    paired = _paired_sources(pkg)
    return [n["grid"] for g in pkg.manifest["graphs"] for n in g["nodes"] if n["kernel"] in paired]


@pytest.mark.parametrize("hidden, n, scale", [(1, 1, 1.0), (300, 37, 0.5), (8192, 5, 1e-20),
                                              (8192, 37, 1e3)])
def test_paired_gate_up_at_edge_sizes(tmp_path, monkeypatch, hidden, n, scale):
    """PAIR_GATE_UP on a SwiGLU MLP of one row: the gate+up GEMV stores silu(gate) * up, paired
    column by column (a hidden size of 1: one pair and a masked row; 300: a ragged last program;
    8192: the down projection split 8 ways over K, reading the stored row), ±0.5 rows, tiny and
    huge values: fp64 torch's result."""
    monkeypatch.setattr(fuse_rows, "PAIR_GATE_UP", True)
    torch.manual_seed(13)
    x = torch.randn(1, 16) * scale if scale != 0.5 else torch.where(torch.rand(1, 16) < 0.5, -0.5, 0.5)
    path = _check(SwiGLU(16, hidden, n), {"x": x}, tmp_path, tol=1e-5)
    grids = _paired(path)
    assert len(grids) == 1 and grids[0][1:] == [1, 1], grids
    assert check_races(read_package(path).manifest) == [] and check_pre_wait(read_package(path)) == []


@pytest.mark.parametrize("hidden", [96, 100])
def test_paired_gate_up_leaves_the_decode_unchanged(tmp_path, monkeypatch, hidden):
    """PAIR_GATE_UP (on by default) in a Llama decode step: each layer's gate+up GEMV is paired
    (half the rows a program, each with its partner: the same grid), the down projection reads
    the stored row, and the logits are the unpaired package's bit for bit in float32 (the same
    sums in the same order), race-free; prefill's GEMMs are not paired. 100 hidden columns: a
    ragged last program."""
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from grace.tools.models import CachedLlama

    from test_fuse_append import _same_decodes

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=hidden,
                        max_seq=32).eval()
    t = Dim("seq", min=1, max=32)

    def build(name, on):
        monkeypatch.setattr(fuse_rows, "PAIR_GATE_UP", on)
        return grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / name, progress=False, fp32_matmul="ieee",
                             dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, 32]})

    off, on = build("off.grace", False), build("on.grace", True)
    assert _paired(off) == []
    assert _paired(on) == [[-(-hidden // 32), 1, 1]] * 2   # both layers, decode graph only
    assert check_races(read_package(on).manifest) == [] and check_pre_wait(read_package(on)) == []
    idx = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    _same_decodes(on, off, idx, prompts=(5, 9), model=model)


class NormSwiGLU(torch.nn.Module):
    """An RMSNorm, then Llama's MLP on one row: at K 2049-4096 (the 8B's 4096) the gate+up GEMV
    is the persistent one, the norm's mean folded into it (fuse_stats.FOLD_INTO_PERSISTENT)."""

    def __init__(self, d: int, hidden: int, n: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-5)
        self.mlp = SwiGLU(d, hidden, n)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.mlp(self.norm(x))


@pytest.mark.parametrize("model, k, fold", [("swiglu", 3000, False), ("norm", 2560, True),
                                            ("norm", 2560, False)])
def test_paired_persistent_gemv(tmp_path, monkeypatch, model, k, fold):
    """PAIR_PERSISTENT (on by default): the gate+up GEMV paired when it is the
    persistent one (K 3000: a masked last column block), with the RMSNorm's statistic folded
    into it or reduced by a kernel of its own: fp64 torch's result, race-free, and the
    persistent source walks both halves."""
    from grace.aot import fuse_stats

    monkeypatch.setattr(fuse_stats, "FOLD_INTO_PERSISTENT", fold)
    monkeypatch.setattr(fuse_rows, "PAIR_PERSISTENT", True)
    torch.manual_seed(17)
    net = SwiGLU(k, 300, 37) if model == "swiglu" else NormSwiGLU(k, 300, 37)
    path = _check(net, {"x": torch.randn(1, k)}, tmp_path, tol=1e-5)
    pkg = read_package(path)
    paired = list(_paired_sources(pkg).values())
    assert len(_paired(path)) == 1 and len(paired) == 1
    assert "b_next_hi" in paired[0] and "for turn in range" in paired[0]   # persistent
    if fold:
        assert "stat" in paired[0] and "reduction" not in _kernels(path)
    assert check_races(pkg.manifest) == [] and check_pre_wait(pkg) == []


def test_both_gemv_forms_are_paired_by_default(tmp_path, monkeypatch):
    """PAIR_GATE_UP and PAIR_PERSISTENT are on: a K-3000 gate+up (persistent) and a K-16 one (the
    template) are both paired and match fp64 torch; with PAIR_PERSISTENT off the wide one is not."""
    assert fuse_rows.PAIR_GATE_UP is True and fuse_rows.PAIR_PERSISTENT is True
    torch.manual_seed(19)
    wide = _check(SwiGLU(3000, 300, 37), {"x": torch.randn(1, 3000)}, tmp_path / "w", tol=1e-5)
    narrow = _check(SwiGLU(16, 300, 37), {"x": torch.randn(1, 16)}, tmp_path / "n", tol=1e-5)
    assert len(_paired(wide)) == 1 and len(_paired(narrow)) == 1
    monkeypatch.setattr(fuse_rows, "PAIR_PERSISTENT", False)
    unpaired = _check(SwiGLU(3000, 300, 37), {"x": torch.randn(1, 3000)}, tmp_path / "u", tol=1e-5)
    assert _paired(unpaired) == []


def test_a_paired_matmul_states_its_shape_rules():
    """Matmul.pair's rules, as the IR verifier reads them: out is [batch, 1, pair], and only an
    unsplit GEMV of n = 2 * pair that loads no weights ahead may pair."""
    from dataclasses import replace

    from grace.aot.codegen import GemmPlan
    from grace.aot.families import Matmul
    from grace.aot.ir import Buffer, Load

    a = Load(Buffer("row", "arena", "float32", (1, 1, 64), 1), 0, (64, 64, 1))
    b = Load(Buffer("w", "weight", "float32", (192, 64), 2), 0, (0, 1, 64))
    spec = Matmul(a=a, b=b, m=1, n=192, k=64, batch=1, fp32_precision="ieee",
                  plan=GemmPlan(1, 32, 64, 1, gemv=True), k_ext=None, pair=96)
    assert spec.shape_problems((1, 1, 96)) == []
    assert "is not [batch, 1, pair]" in spec.shape_problems((1, 1, 192))[0]
    for bad in (replace(spec, n=190), replace(spec, plan=replace(spec.plan, split=2)),
                replace(spec, plan=replace(spec.plan, ahead=1)),
                replace(spec, plan=replace(spec.plan, gemv=False))):
        assert bad.shape_problems((1, 1, 96)) == [
            "a paired matmul is an unsplit GEMV of n = 2 * pair that loads no weights ahead"]


@pytest.mark.parametrize("k", [300, 2048])
def test_paired_template_gemv_with_its_norm_folded(tmp_path, k):
    """With the `fold_row_stats` option the gate+up template GEMV reduces its RMSNorm's mean
    itself (in its K loop, the sums scaled at the end: K 2048 is two steps; K 300 one ragged
    step) and is paired: the partner sums take the same scale. fp64 torch's result, race-free."""
    torch.manual_seed(23)
    path = _check(NormSwiGLU(k, 300, 37), {"x": torch.randn(1, k)}, tmp_path, tol=1e-5,
                  fold_row_stats=True)
    pkg = read_package(path)
    paired = list(_paired_sources(pkg).values())
    assert len(paired) == 1 and "acc_hi" in paired[0] and "s_acc" in paired[0]
    assert "acc_p = acc_p * " in paired[0]   # the partner sums scaled as the own ones
    assert "reduction" not in _kernels(path)   # the mean went into the GEMV
    assert check_races(pkg.manifest) == [] and check_pre_wait(pkg) == []
