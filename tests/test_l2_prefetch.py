"""L2 prefetch side nodes (aot/l2_prefetch.py, `L2_PREFETCH`, off by default): where they go in a
decode graph, that nothing waits for them, that they read only a prefix of their GEMV's weights,
that the race proof and the source check accept them, and that they change no value (the CPU
reference executor skips them; the GPU runs them in tests/gpu/test_decode_knobs_gpu.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import l2_prefetch  # noqa: E402
from grace.formats import races, read_package  # noqa: E402
from grace.tools.interpret import InterpretSession  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from grace.tools.source_check import SourceRefused, check_kernel_source  # noqa: E402
from grace.tools.variants import applied, parse_variant  # noqa: E402

MAX_SEQ = 16
# thresholds scaled to a small model as the defaults are to Llama's: gate+up (512 x 64 fp32,
# 128 KiB) and down (64 KiB) are targets; the window before gate+up streams the o projection
# (16 KiB), and with the QKV projection (32 KiB) it reaches 40 KiB, so QKV is the anchor
SMALL = ("l2_prefetch.L2_PREFETCH=True,l2_prefetch.L2_PREFETCH_MIN_BYTES=65536,"
         "l2_prefetch.L2_PREFETCH_WINDOW_BYTES=40960,l2_prefetch.L2_PREFETCH_BYTES=98304")


def _compile(tmp_path, variant, name, archs=("sm_90",)):
    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden=256,
                        max_seq=MAX_SEQ).eval()
    t = Dim("seq", min=1, max=MAX_SEQ)
    with applied(parse_variant(variant) if variant else None):
        path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / f"{name}.grace", progress=False, archs=archs,
                             fp32_matmul="ieee", dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                             buckets={"seq": [1, MAX_SEQ]}, sm_count={a: 2 for a in archs})
    return model, path


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("l2pf")
    _, plain = _compile(tmp, None, "plain")
    model, fetched = _compile(tmp, f"pf:{SMALL}", "prefetch")
    return model, plain, fetched


def _prefetch_nodes(m, graph):
    return [(i, n) for i, n in enumerate(graph["nodes"])
            if m["kernels"][n["kernel"]]["family"] == l2_prefetch.FAMILY]


def test_off_by_default(packages):
    _, plain, _ = packages
    m = read_package(plain).manifest
    assert all(not _prefetch_nodes(m, g) for g in m["graphs"])


def test_prefetch_nodes_sit_beside_the_chain(packages):
    """In the decode graph: one node per target GEMV, after the QKV projection (the last kernel
    before the window of attention, its combine, the o projection and the norm), reading the first
    L2_PREFETCH_BYTES of the gate+up weights; none for the down projection (no kernel between it
    and gate+up) and none in the prefill graph (GEMMs). Nothing depends on a prefetch node."""
    _, _, fetched = packages
    pkg = read_package(fetched)
    m = pkg.manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    prefill = next(g for g in m["graphs"] if g["name"] != "seq=1")
    assert not _prefetch_nodes(m, prefill)
    side = _prefetch_nodes(m, decode)
    nodes = decode["nodes"]
    targets = {n["label"].split(" ", 1)[1] for _, n in side}
    assert len(side) == 3, [n["label"] for _, n in side]   # gate+up of each layer
    for i, node in side:
        assert node["deps"] == node["programmatic"] and len(node["deps"]) == 1
        a = node["deps"][0]
        assert m["kernels"][nodes[a]["kernel"]]["family"] == "matmul"       # QKV, then
        assert m["kernels"][nodes[a + 1]["kernel"]]["family"] == "scatter"  # the KV appends
        assert all(i not in n["deps"] for n in nodes), "a node waits for a prefetch"
        target = next(j for j, n in enumerate(nodes) if n["label"] == node["label"].split(" ", 1)[1])
        assert node["deps"][0] < target - 1   # a window of kernels lies between
        (arg,) = node["args"]   # the weight buffer, of which the kernel reads a prefix
        assert arg["region"] == "weights" and arg in nodes[target]["args"]
        src = bytes(pkg.section(m["kernels"][node["kernel"]]["source"])).decode()
        last = int(re.search(r"tl\.minimum\(line, (\d+)\)", src).group(1))
        assert (last + 1) * l2_prefetch.LINE == min(98304, arg["nbytes"])
        check_kernel_source(src)
        assert src.index("gdc_wait()") < src.index("inline_asm_elementwise")
    assert len(targets) == 3
    assert races.check_races(m) == [] and races.check_pre_wait(pkg) == []


def test_prefetch_changes_no_value(packages):
    """The interpreted logits of the package with prefetch nodes are those without, bit for bit,
    over a prompt and three decode steps."""
    _, plain, fetched = packages
    idx = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    outs = []
    for path in (plain, fetched):
        sess = InterpretSession(path)
        got = []
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
            got.append(sess.run({"idx": idx[:, lo:hi].numpy(), "input_pos": np.arange(lo, hi)})["out"])
        outs.append(got)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_sm80_prefetches_without_waiting(tmp_path):
    """sm_80 has no griddepcontrol: its prefetch nodes have full edges and no gdc calls."""
    _, path = _compile(tmp_path, f"pf:{SMALL}", "sm80", archs=("sm_80",))
    pkg = read_package(path)
    m = pkg.manifest
    decode = next(g for g in m["graphs"] if g["name"] == "seq=1")
    side = _prefetch_nodes(m, decode)
    assert side
    for _, node in side:
        assert "programmatic" not in node
        src = bytes(pkg.section(m["kernels"][node["kernel"]]["source"])).decode()
        assert "gdc_" not in src and "prefetch.global.L2" in src


def test_source_check_allows_only_the_prefetch_asm():
    ok = l2_prefetch.source(_weight(), 4096, pdl=True).source
    check_kernel_source(ok)
    bad = ok.replace("prefetch.global.L2::evict_last [$1];", "st.global.u32 [$1], 0;")
    with pytest.raises(SourceRefused, match="inline assembly"):
        check_kernel_source(bad)
    computed = ok.replace(repr(l2_prefetch.ASM), "'pre' + 'fetch'")
    with pytest.raises(SourceRefused, match="inline assembly"):
        check_kernel_source(computed)


def _weight():
    from grace.aot.ir import Buffer
    return Buffer("w", "weight", "bfloat16", (64, 64), 1)
