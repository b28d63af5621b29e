"""Programmatic dependent launch (format 3.2, docs/design-pdl.md) on the CPU: an sm_90 package
compiled with pdl=True has
programmatic kernel->kernel edges and kernels that wait before touching anything but weights; the
sm_80 build of the same model has neither; both are proven race-free from the manifest by
`grace.formats.races` (which also catches a planted missing edge and a planted early read); and the
interpreter gives bit-identical results for both builds."""
from __future__ import annotations

import ast
import copy
import pathlib
import subprocess
import sys

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.formats.package import pack_package_bytes  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from grace.formats.races import check_pre_wait, check_races  # noqa: E402

pytestmark = pytest.mark.slow
MAX_SEQ = 32


def _model():
    torch.manual_seed(0)
    return CachedLlama(vocab=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64,
                       max_seq=MAX_SEQ).eval()


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pdl")
    t = Dim("seq", min=1, max=MAX_SEQ)
    out = {}
    for arch in ("sm_90", "sm_80"):
        out[arch] = grace_compile(
            _model(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
            output=tmp / f"lm-{arch}.grace", progress=False, fp32_matmul="ieee", archs=(arch,),
            pdl=arch == "sm_90",
            dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}}, buckets={"seq": [8, MAX_SEQ]},
            generate={"tokens": "idx", "positions": "input_pos"})
    return out


def _edges(manifest):
    full = prog = 0
    for g in manifest["graphs"]:
        for node in g["nodes"]:
            p = len(node.get("programmatic", []))
            prog += p
            full += len(node["deps"]) - p
    return full, prog


def test_sm90_has_programmatic_edges_and_sm80_none(builds):
    m90 = read_package(builds["sm_90"]).manifest
    m80 = read_package(builds["sm_80"]).manifest
    assert m90["options"]["pdl"] is True and m80["options"]["pdl"] is False
    full90, prog90 = _edges(m90)
    full80, prog80 = _edges(m80)
    assert prog90 > 0 and prog80 == 0
    assert full90 + prog90 == full80 + prog80   # the same dependencies, only their kind differs
    for g in m90["graphs"]:
        for node in g["nodes"]:
            # every kernel -> kernel edge is programmatic (docs/design-pdl.md); the table
            # writer's (node 0) stay full
            assert set(node.get("programmatic", [])) == set(node["deps"]) - {0}


def test_sources_wait_in_pdl_builds_only(builds):
    for arch, waits in (("sm_90", True), ("sm_80", False)):
        pkg = read_package(builds[arch])
        for k in pkg.manifest["kernels"]:
            if k["family"] in ("table_writer", "generate_step"):
                continue
            src = bytes(pkg.section(k["source"])).decode()
            assert ("gdc_wait()" in src) == waits, (arch, k["name"])


def test_matmuls_load_their_weight_tile_before_the_wait(builds):
    """The point of PDL: a linear layer starts streaming its weights while the kernel before it
    finishes. At least the projections (weights only on one side) do so."""
    pkg = read_package(builds["sm_90"])
    early = 0
    for k in pkg.manifest["kernels"]:
        if k["family"] != "matmul":
            continue
        src = bytes(pkg.section(k["source"])).decode()
        before = src.split("gdc_wait()")[0]
        early += "_early" in before and "tl.load(" in before
    assert early >= 4


def test_both_builds_are_race_free(builds):
    for arch in builds:
        pkg = read_package(builds[arch])
        assert check_races(pkg.manifest) == [], arch
        assert check_pre_wait(pkg) == [], arch


def _reaches(nodes) -> list[set]:
    """Per node, the nodes a path of edges leads to it from."""
    up = []
    for node in nodes:
        up.append(set().union(*([{d} | up[d] for d in node["deps"]] or [set()])))
    return up


def test_table_writer_edges_go_to_the_roots_only(builds, tmp_path):
    """Node 0 gets an edge only to a table reader no path already orders after it (its fan-out
    to every node of a decode graph was a suspect for the 12-17 µs before a graph's first kernel,
    docs/performance.md); TABLE_WRITER_FANOUT=True restores the edge to every table reader. Both
    are proven race-free, and describe the same order: the same nodes after the table writer."""
    from grace.aot import manifest as aot_manifest
    from grace.tools.variants import applied, parse_variant

    reduced = read_package(builds["sm_90"]).manifest
    with applied(parse_variant("fanout:manifest.TABLE_WRITER_FANOUT=True")):
        path = grace_compile(_model(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                             output=tmp_path / "fanout.grace", progress=False, fp32_matmul="ieee",
                             archs=("sm_90",), pdl=True,
                             dynamic_shapes={"idx": {1: Dim("seq", min=1, max=MAX_SEQ)},
                                             "input_pos": {0: Dim("seq", min=1, max=MAX_SEQ)}},
                             buckets={"seq": [8, MAX_SEQ]},
                             generate={"tokens": "idx", "positions": "input_pos"})
    assert aot_manifest.TABLE_WRITER_FANOUT is False   # the variant is undone after the compile
    fanout = read_package(path).manifest
    assert check_races(fanout) == [] and check_races(reduced) == []
    for g_red, g_fan in zip(reduced["graphs"], fanout["graphs"]):
        red, fan = g_red["nodes"], g_fan["nodes"]
        up_red, up_fan = _reaches(red), _reaches(fan)
        writer_red = [j for j, n in enumerate(red) if 0 in n["deps"]]
        writer_fan = [j for j, n in enumerate(fan) if 0 in n["deps"]]
        assert len(writer_red) < len(writer_fan)
        for j in writer_red:   # no other path from node 0: the edge is needed
            assert not any(0 in up_red[d] for d in red[j]["deps"] if d != 0), (g_red["name"], j)
        assert [0 in up for up in up_red] == [0 in up for up in up_fan]
        assert [set(n["deps"]) - {0} for n in red] == [set(n["deps"]) - {0} for n in fan]


def test_kernels_declare_what_they_write(builds):
    m = read_package(builds["sm_90"]).manifest
    for k in m["kernels"]:
        assert k["writes"], k["name"]   # every kernel stores something
        assert all(k["params"][i]["type"].startswith("*") for i in k["writes"])


def _repack(pkg, manifest, sections=None) -> bytes:
    secs = {name: bytes(pkg.section(name)) for name in pkg.section_names
            if not name.startswith("sha256/")}
    secs.update(sections or {})
    return pack_package_bytes(msgpack.packb(manifest, use_bin_type=True), secs,
                              version=tuple(manifest["format_version"]))


def test_race_checker_catches_a_missing_edge(builds):
    pkg = read_package(builds["sm_90"])
    m = copy.deepcopy(pkg.manifest)
    graph = m["graphs"][0]
    # a node whose one dependency is the node right before it, whose output it reads: drop it
    j = next(j for j, n in enumerate(graph["nodes"]) if j >= 2 and n["deps"] == [j - 1])
    graph["nodes"][j]["deps"].remove(j - 1)
    graph["nodes"][j]["programmatic"] = [d for d in graph["nodes"][j].get("programmatic", [])
                                         if d != j - 1]
    problems = check_races(m)
    assert problems and any(f"node {j} " in p for p in problems)
    assert check_races(pkg.manifest) == []


def test_race_checker_catches_writes_to_weights_and_inputs(builds):
    m = copy.deepcopy(read_package(builds["sm_90"]).manifest)
    node = m["graphs"][0]["nodes"][1]
    kernel = m["kernels"][node["kernel"]]
    w = kernel["writes"][0]
    node["args"][w] = {"region": "weights", "offset": 0, "nbytes": 4}
    assert any("writes the weights" in p for p in check_races(m))


def test_pre_wait_checker_catches_an_early_read(builds, tmp_path):
    """A kernel edited to load, before its wait, what the node before it writes (a race PDL would
    make real): reported, naming the writer that may still be running."""
    pkg = read_package(builds["sm_90"])
    m = copy.deepcopy(pkg.manifest)
    graph = m["graphs"][0]
    found = None
    for j, node in enumerate(graph["nodes"]):   # a programmatic target reading its dep's output
        for d in node.get("programmatic", ()):
            dep = graph["nodes"][d]
            out = [dep["args"][w] for w in m["kernels"][dep["kernel"]]["writes"]]
            for i, arg in enumerate(node["args"]):
                if arg.get("region") == "arena" and any(
                        o.get("region") == "arena" and o["offset"] < arg["offset"] + arg["nbytes"]
                        and arg["offset"] < o["offset"] + o["nbytes"] for o in out):
                    found = found or (j, i)
    assert found is not None
    j, i = found
    k = graph["nodes"][j]["kernel"]
    src = bytes(pkg.section(m["kernels"][k]["source"])).decode()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef))
    param = fn.args.args[i].arg
    bad = src.replace("    gdc_launch_dependents()\n",
                      f"    gdc_launch_dependents()\n    early = tl.load({param})\n", 1)
    assert bad != src
    data = _repack(pkg, m, {m["kernels"][k]["source"]: bad.encode()})
    problems = check_pre_wait(read_package(data))
    assert any(f"loads through {param} before gdc_wait()" in p and "may still be running" in p
               for p in problems), problems


def test_grace_verify_proves_and_refuses(builds, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "grace.tools.cli", "verify", str(builds["sm_90"])],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "race-free" in ok.stdout
    pkg = read_package(builds["sm_90"])
    m = copy.deepcopy(pkg.manifest)
    graph = m["graphs"][-1]
    j = next(j for j, n in enumerate(graph["nodes"]) if j >= 2 and j - 1 in n["deps"])
    graph["nodes"][j]["deps"].remove(j - 1)
    graph["nodes"][j]["programmatic"] = [d for d in graph["nodes"][j].get("programmatic", [])
                                         if d != j - 1]
    bad = tmp_path / "bad.grace"
    bad.write_bytes(_repack(pkg, m))
    out = subprocess.run([sys.executable, "-m", "grace.tools.cli", "verify", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "no path of edges orders them" in out.stderr




def test_interpreter_results_are_identical_for_both_builds(builds, tmp_path):
    """PDL changes when kernels may start, never what they compute: same bits on the CPU."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 96, (1, 11)).astype(np.int64)
    outs = {}
    for arch, path in builds.items():
        from grace.tools.interpret import InterpretSession
        sess = InterpretSession(path)
        outs[arch] = [sess.run({"idx": idx, "input_pos": np.arange(11)})["out"],
                      sess.run({"idx": idx[:, :1], "input_pos": np.array([11])})["out"]]
    for a, b in zip(outs["sm_90"], outs["sm_80"]):
        np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        model = _model()
        ref = model(torch.from_numpy(idx), torch.arange(11)).numpy()
    rel = np.linalg.norm(outs["sm_90"][0] - ref) / np.linalg.norm(ref)
    assert rel < 1e-5


def test_pdl_on_sm80_is_refused():
    with pytest.raises(ValueError, match="pdl needs sm_90"):
        grace_compile(_model(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                      output="/nonexistent/x.grace", archs=("sm_80",), pdl=True)


def test_pdl_is_on_by_default_for_sm90_and_off_when_asked(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    for pdl, expected in ((None, True), (False, False)):
        path = grace_compile(m, (torch.randn(2, 16),), output=tmp_path / f"mix-{pdl}.grace",
                             progress=False, archs=("sm_90",), pdl=pdl)
        manifest = read_package(path).manifest
        assert manifest["options"]["pdl"] is expected and (_edges(manifest)[1] > 0) is expected
        assert manifest["options"]["targets"][0]["pdl"] is expected
    # sm_80 alone: nothing to turn on, and no error unless PDL is insisted on
    path = grace_compile(m, (torch.randn(2, 16),), output=tmp_path / "mix-80.grace", progress=False,
                         archs=("sm_80",))
    assert read_package(path).manifest["options"]["pdl"] is False
    with pytest.raises(ValueError, match="pdl needs sm_90 or newer"):
        grace_compile(m, (torch.randn(2, 16),), output=tmp_path / "no.grace", archs=("sm_80",), pdl=True)


def test_data_dependent_sizes_are_race_free_with_pdl(tmp_path):
    """Kernels that write extents words (nonzero, .item()) and the kernels that read them, one of
    them (a linear layer over k rows) the target of programmatic edges."""
    class Select(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 8)

        def forward(self, x, n):
            picked = x[x > 0]                 # a data-dependent size
            k = n.item()
            torch._check(k >= 0)
            torch._check(k <= 16)
            return picked * 2, x[:k] + 1, torch.nonzero(x < 0), self.lin((x[:k] * 3).unsqueeze(1))

    model = Select().eval()
    path = grace_compile(model, (torch.randn(16), torch.tensor(5)), output=tmp_path / "sel.grace",
                         progress=False, pdl=True)
    pkg = read_package(path)
    assert pkg.manifest["symbols"] and _edges(pkg.manifest)[1] > 0
    assert check_races(pkg.manifest) == [] and check_pre_wait(pkg) == []
    x = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    from grace.tools.interpret import run_package
    out = run_package(path, {"x": x, "n": np.array(5)})
    got = list(out.values())
    np.testing.assert_allclose(got[0], x[x > 0] * 2, rtol=1e-6)
    np.testing.assert_allclose(got[1], x[:5] + 1, rtol=1e-6)
    np.testing.assert_array_equal(got[2].reshape(-1), np.nonzero(x < 0)[0])
    with torch.no_grad():
        want = model.lin(torch.from_numpy(x[:5] * 3).unsqueeze(1)).numpy()
    np.testing.assert_allclose(got[3], want, rtol=1e-5, atol=1e-6)
