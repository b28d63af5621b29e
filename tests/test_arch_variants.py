"""Per-arch variants (format 3.5, SPEC §3.5, issue 8 item 1) on the CPU.

One package compiled for sm_80 and sm_90 with --pdl holds sm_90 graphs whose kernels wait
(gdc_wait) and that have programmatic edges, and sm_80 graphs with neither; kernels identical in
both (the table writer, the generation step) are stored once with a binary per arch. Both variants
pass `grace verify` and the race checks, the CPU executor computes the same in each (and what
eager torch computes), and the runtime (on tools/fuzz.py's FakeDriver, which answers from the real
cubins) runs sm_80's graphs on a CC 8.x GPU, sm_90's on 9.0, and refuses 7.5 and 10.0 before
touching the device. The validator refuses each malformed variant; a 3.4 package still loads; the
SM count comes from formats.archs per target (and --sm-count), and the conformance vectors of
tests/conformance/variants/ hold for the reference runtime.
"""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest

from grace.formats import ManifestError, archs, read_package, select_graph, validate_manifest
from grace.formats.package import pack_package_bytes
from grace.formats.view import as_view, for_arch, variants

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from torch.export import Dim  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import compiler  # noqa: E402
from grace.tools.models import MLP, CachedLlama  # noqa: E402

MAX_SEQ = 32
BOTH = ("sm_80", "sm_90")
CONFORMANCE = Path(__file__).resolve().parent / "conformance"


def _llama():
    torch.manual_seed(0)
    return CachedLlama(vocab=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64,
                       max_seq=MAX_SEQ).eval()


def _mlp():
    torch.manual_seed(0)
    return MLP(32, 64, 16).eval()


def _compile_lm(path, archs, pdl):
    t = Dim("seq", min=1, max=MAX_SEQ)
    return grace_compile(_llama(), (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                         output=path, fp32_matmul="ieee", archs=archs, pdl=pdl,
                         dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                         buckets={"seq": [8, MAX_SEQ]},
                         generate={"tokens": "idx", "positions": "input_pos"})


def _compile_mlp(path, archs, pdl=False, **kw):
    return grace_compile(_mlp(), (torch.randn(4, 32),), output=path, fp32_matmul="ieee",
                         archs=archs, pdl=pdl, dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
                         buckets={"batch": [8, 64]}, **kw)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("variants")
    return {"lm": _compile_lm(tmp / "lm.grace", BOTH, True),
            "lm_sm_90": _compile_lm(tmp / "lm90.grace", ("sm_90",), True),
            "lm_sm_80": _compile_lm(tmp / "lm80.grace", ("sm_80",), False),
            "mlp": _compile_mlp(tmp / "mlp.grace", BOTH, True),
            "static": grace_compile(_mlp(), (torch.randn(4, 32),), output=tmp / "static.grace",
                                    fp32_matmul="ieee", archs=BOTH, pdl=True)}


def _graphs_of(m, arch):
    return [g for g in m["graphs"] if arch in g.get("archs", m["archs"])]


def _source(pkg, kernel) -> str:
    return bytes(pkg.section(kernel["source"])).decode()


# ---------------------------------------------------------------------------------- the package

def test_the_manifest_records_one_variant_per_target(builds):
    m = read_package(builds["lm"]).manifest
    assert m["format_version"] == [3, 6] and m["archs"] == list(BOTH)
    assert m["options"]["targets"] == [{"archs": ["sm_80"], "pdl": False, "sm_count": 108, "gemm_tiles": None},
                                       {"archs": ["sm_90"], "pdl": True, "sm_count": 132, "gemm_tiles": "sm_90"}]
    assert [a for a, _ in variants(as_view(m))] == [("sm_80",), ("sm_90",)]
    for arch, pdl, sms in (("sm_80", False, 108), ("sm_90", True, 132)):
        graphs = _graphs_of(m, arch)
        assert [g["bucket"]["seq"] for g in graphs] == [1, 8, 32]     # the same buckets in each
        assert all(g["archs"] == [arch] and g["name"].endswith(f"@{arch}") for g in graphs)
        assert all(g["compiled"]["target"] == {"pdl": pdl, "sm_count": sms} for g in graphs)
    # the decode graph (seq=1) of the first variant; each variant's own is found by its bucket
    gen = m["generate"]
    assert m["graphs"][gen["decode_graph"]]["bucket"]["seq"] == 1
    for arch in BOTH:
        v = for_arch(as_view(m), arch)
        assert v.graphs[v.generate.decode_graph].bucket["seq"] == 1
        assert m["graphs"][v.graph_index[v.generate.decode_graph]]["archs"] == [arch]


def test_sm90_graphs_wait_and_have_programmatic_edges_sm80_graphs_neither(builds):
    for name in ("lm", "mlp"):
        pkg = read_package(builds[name])
        m = pkg.manifest
        for arch, waits in (("sm_80", False), ("sm_90", True)):
            prog = sum(len(n.get("programmatic", ())) for g in _graphs_of(m, arch) for n in g["nodes"])
            assert (prog > 0) == waits, (name, arch, prog)
            for g in _graphs_of(m, arch):
                for node in g["nodes"]:
                    k = m["kernels"][node["kernel"]]
                    if k["family"] in ("table_writer", "generate_step"):
                        continue
                    src = _source(pkg, k)
                    assert ("gdc_wait()" in src) == waits and ("gdc_" in src) == waits, (arch, k["name"])
                    assert k["compiled"]["waits"] == waits


def test_kernels_of_both_variants_are_stored_once_with_a_binary_per_arch(builds):
    pkg = read_package(builds["lm"])
    m = pkg.manifest
    names = [k["name"] for k in m["kernels"]]
    assert len(set(names)) == len(names)
    assert len({k["source_sha256"] for k in m["kernels"]}) == len(names)   # one entry per source
    runs_on: dict[int, set] = {m["generate"]["step"]["kernel"]: set(BOTH)}
    for g in m["graphs"]:
        for node in g["nodes"]:
            runs_on.setdefault(node["kernel"], set()).update(g["archs"])
    for k, kernel in enumerate(m["kernels"]):
        assert set(kernel["binaries"]) == runs_on[k], kernel["name"]   # exactly the archs that run it
        for arch, section in kernel["binaries"].items():
            assert section == f"cubin/{kernel['name']}.{arch}" and section in pkg.section_names
    shared = sorted(m["kernels"][k]["family"] for k, a in runs_on.items() if a == set(BOTH))
    assert shared == ["generate_step", "table_writer"]
    assert sum(n.startswith("cubin/") for n in pkg.section_names) == \
        sum(len(k["binaries"]) for k in m["kernels"])


def test_each_variant_is_what_a_build_for_its_arch_alone_makes(builds):
    """The per-target stages ran once per variant, with that target's settings: the same kernels,
    grids and edges as a package compiled for that arch alone."""
    both = read_package(builds["lm"]).manifest

    def shape(m, graphs):
        return [[(m["kernels"][n["kernel"]]["name"], n["grid"], n["deps"], n.get("programmatic", []))
                 for n in g["nodes"]] for g in graphs]

    for arch in BOTH:
        alone = read_package(builds[f"lm_{arch}"]).manifest
        assert "archs" not in alone["graphs"][0]   # one target: a 3.4-shaped package
        assert shape(both, _graphs_of(both, arch)) == shape(alone, alone["graphs"])
        assert [g["name"] for g in alone["graphs"]] == \
            [g["name"].split("@")[0] for g in _graphs_of(both, arch)]


def test_both_variants_pass_grace_verify_and_the_race_checks(builds, capsys):
    from grace.tools import cli
    from grace.formats.races import check_pre_wait, check_races

    for name in ("lm", "mlp"):
        pkg = read_package(builds[name])
        assert check_races(pkg.manifest) == [] and check_pre_wait(pkg) == []
        assert cli.main(["verify", str(builds[name])]) == 0
        out = capsys.readouterr().out
        assert "graphs race-free, 2 arch variants (sm_80: " in out and "; sm_90: " in out


# ------------------------------------------------------------------------------- interpreter

def test_interpreted_variants_agree_with_each_other_and_with_eager(builds):
    from grace.tools.interpret import InterpretSession

    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    with torch.no_grad():
        want = _mlp()(torch.from_numpy(x)).numpy()
    outs = {}
    for arch in BOTH:
        result = InterpretSession(builds["mlp"], arch=arch).run({"x": x})
        assert result.graph == f"batch=8@{arch}"
        outs[arch] = result["out"]
        np.testing.assert_allclose(outs[arch], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs["sm_80"], outs["sm_90"])

    idx = np.random.default_rng(1).integers(0, 96, (1, 11)).astype(np.int64)
    prompt = [3, 17, 42, 5]
    logits, tokens = {}, {}
    for arch in BOTH:
        sess = InterpretSession(builds["lm"], arch=arch)
        logits[arch] = sess.run({"idx": idx, "input_pos": np.arange(11)})["out"]
        tokens[arch] = list(sess.generate(np.array(prompt), 6))
    np.testing.assert_array_equal(logits["sm_80"], logits["sm_90"])
    with torch.no_grad():
        model = _llama()
        ref = model(torch.from_numpy(idx), torch.arange(11)).numpy()
        greedy = model.greedy(torch.tensor(prompt), 6)
    assert np.linalg.norm(logits["sm_90"] - ref) / np.linalg.norm(ref) < 1e-5
    assert tokens["sm_80"] == tokens["sm_90"] == greedy


def test_the_interpreter_defaults_to_the_first_arch_and_names_a_missing_one(builds):
    from grace.tools.interpret import InterpretError, InterpretSession

    assert InterpretSession(builds["mlp"]).view.arch == "sm_80"
    with pytest.raises(InterpretError, match="no variant for sm_86"):
        InterpretSession(builds["mlp"], arch="sm_86")


# ---------------------------------------------------------------------------------- runtime

def _load(path, monkeypatch, capability, **kw):
    pytest.importorskip("cuda.bindings.driver")
    import grace.runtime as rt
    from grace.runtime import driver
    from grace.tools.fuzz import FakeDriver

    fake = FakeDriver(capability=capability)
    monkeypatch.setattr(driver, "_cu", fake)
    return rt.load(path, **kw), fake


@pytest.mark.parametrize("capability, arch", [((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80"),
                                              ((9, 0), "sm_90")])
def test_the_runtime_runs_the_variant_of_its_gpu(builds, monkeypatch, capability, arch):
    path = builds["lm"]
    m = read_package(path).manifest
    loaded, fake = _load(path, monkeypatch, capability)
    try:
        assert loaded.arch == arch and loaded.view.arch == arch
        assert loaded.graph_names == [f"seq={n}@{arch}" for n in (1, 8, 32)]
        assert [m["graphs"][i]["archs"] for i in loaded.view.graph_index] == [[arch]] * 3
        for k, kernel in enumerate(m["kernels"]):   # this GPU's binaries only
            assert (loaded.functions[k] is not None) == (arch in kernel["binaries"]), kernel["name"]
        sess = loaded.session()
        sess.run(idx=np.zeros((1, 5), np.int64), input_pos=np.arange(5))
        assert sess.last_graph == f"seq=8@{arch}"
        fake.kernel_nodes.clear()
        sess.generate(np.array([1, 2, 3]), 2)
        assert sess.last_generate["graph"] == f"seq=8@{arch}"
        theirs = {k["name"] for k in m["kernels"] if arch not in k["binaries"]}
        assert fake.kernel_nodes and not theirs & set(fake.kernel_nodes)
        sess.close()
    finally:
        loaded.close()


def test_programmatic_edges_only_on_sm90_and_not_with_pdl_off(builds, monkeypatch):
    edges = {}
    for capability, pdl in (((8, 0), True), ((9, 0), True), ((9, 0), False)):
        loaded, fake = _load(builds["mlp"], monkeypatch, capability, instantiate="eager", pdl=pdl)
        loaded.session().close()
        edges[capability, pdl] = fake.programmatic
        loaded.close()
    assert edges[(9, 0), True] > 0 and edges[(8, 0), True] == 0 and edges[(9, 0), False] == 0


@pytest.mark.parametrize("capability", [(7, 5), (10, 0)])
def test_a_gpu_no_variant_fits_is_refused_before_anything_is_allocated(builds, monkeypatch, capability):
    from grace.runtime.errors import PackageMismatchError

    pytest.importorskip("cuda.bindings.driver")
    import grace.runtime as rt
    from grace.runtime import driver
    from grace.tools.fuzz import FakeDriver

    fake = FakeDriver(capability=capability)
    monkeypatch.setattr(driver, "_cu", fake)
    gpu = f"sm_{capability[0]}{capability[1]}"
    with pytest.raises(PackageMismatchError, match=rf"kernels and graphs for sm_80, sm_90, but the "
                                                   rf"GPU is {gpu}; compile the model again with "
                                                   rf"--arch {gpu}"):
        rt.load(builds["lm"])
    assert fake.used == 0 and not fake.names   # no allocation, no module loaded


def test_shape_plans_need_a_variant(builds):
    from grace.runtime.errors import InvalidPackageError
    from grace.runtime.calls import ShapePlan

    m = read_package(builds["mlp"]).manifest
    with pytest.raises(InvalidPackageError, match=r"several GPU variants \(sm_80; sm_90\)"):
        ShapePlan(m)
    for arch in BOTH:
        plan = ShapePlan(m, arch=arch)
        assert plan.graph_names == [f"batch=8@{arch}", f"batch=64@{arch}"]
        call = plan.prepare([(9, 32)])
        assert plan.graph_names[call.graph] == f"batch=64@{arch}"
        values = {"batch": 9}
        got = select_graph(m["graphs"], ["batch"], values, arch)
        assert m["graphs"][got]["name"] == f"batch=64@{arch}"
    assert select_graph(m["graphs"], ["batch"], {"batch": 9}) == 1   # without an arch: every graph


# ------------------------------------------------------------------------------- the validator

@pytest.fixture(scope="module")
def lm(builds):
    pkg = read_package(builds["lm"])
    return pkg.manifest, list(pkg.section_names)


def _node_of(m, arch, programmatic=False):
    """(graph, node) of the first kernel node of an `arch` graph (with programmatic deps)."""
    for g, graph in enumerate(m["graphs"]):
        if arch in graph.get("archs", m["archs"]):
            for j, node in enumerate(graph["nodes"]):
                if j and (node.get("programmatic") or not programmatic):
                    return g, j
    raise AssertionError


def _waiting_kernel(m):
    return next(k for k, kern in enumerate(m["kernels"]) if kern["compiled"]["waits"])


def _edit_archs_unknown(m):
    m["graphs"][0]["archs"] = ["sm_86"]


def _edit_archs_empty(m):
    m["graphs"][0]["archs"] = []


def _edit_archs_twice(m):
    m["graphs"][0]["archs"] = ["sm_80", "sm_80"]


def _edit_no_binary(m):
    g, j = _node_of(m, "sm_80")
    kernel = m["kernels"][m["graphs"][g]["nodes"][j]["kernel"]]
    del kernel["binaries"]["sm_80"]


def _edit_step_binary(m):
    del m["kernels"][m["generate"]["step"]["kernel"]]["binaries"]["sm_90"]


def _edit_same_bucket_twice(m):
    g = next(i for i, graph in enumerate(m["graphs"]) if graph["archs"] == ["sm_90"])
    m["graphs"][g]["archs"] = ["sm_80", "sm_90"]   # sm_80 now has two graphs of that bucket


def _edit_bucket_sets_differ(m):
    g = next(i for i, graph in enumerate(m["graphs"]) if graph["archs"] == ["sm_80"]
             and graph["bucket"]["seq"] == 32)
    del m["graphs"][g]


def _edit_arch_without_graphs(m):
    m["archs"].append("sm_86")


def _edit_programmatic_on_sm80(m):
    g, j = next((g, j) for g, graph in enumerate(m["graphs"]) if graph["archs"] == ["sm_80"]
                for j, node in enumerate(graph["nodes"]) if any(node["deps"]))
    node = m["graphs"][g]["nodes"][j]
    node["programmatic"] = [next(d for d in node["deps"] if d)]


def _edit_waiting_kernel_on_sm80(m):
    k = _waiting_kernel(m)
    kernel = m["kernels"][k]
    kernel["binaries"]["sm_80"] = kernel["binaries"]["sm_90"]


def _edit_sm80_graph_runs_a_waiting_kernel(m):
    """An sm_80 node pointed at the sm_90 twin of its kernel (same parameters): that kernel has
    no sm_80 binary (and could have none: it waits)."""
    g, j = _node_of(m, "sm_80")
    node = m["graphs"][g]["nodes"][j]
    twin = next(k for k, kern in enumerate(m["kernels"]) if kern["compiled"]["waits"]
                and kern["family"] == m["kernels"][node["kernel"]]["family"]
                and kern["params"] == m["kernels"][node["kernel"]]["params"])
    node["kernel"] = twin


def _edit_pdl_target_on_sm80(m):
    g = next(i for i, graph in enumerate(m["graphs"]) if graph["archs"] == ["sm_80"])
    m["graphs"][g]["compiled"]["target"]["pdl"] = True


def _edit_programmatic_without_pdl(m):
    g, _ = _node_of(m, "sm_90", programmatic=True)
    m["graphs"][g]["compiled"]["target"]["pdl"] = False


def _edit_bad_sm_count(m):
    m["graphs"][0]["compiled"]["target"]["sm_count"] = 0


MALFORMED = [
    (_edit_archs_unknown, r"graphs\[0\]\.archs\[0\]: 'sm_86' is not one of the package's archs"),
    (_edit_archs_empty, r"graphs\[0\]\.archs: an empty list"),
    (_edit_archs_twice, r"graphs\[0\]\.archs: duplicate architectures"),
    (_edit_no_binary, r"kernels\[\d+\]\.binaries: no binary for arch 'sm_80', but graphs\[\d+\]\.nodes"),
    (_edit_step_binary, r"kernels\[\d+\]\.binaries: no binary for arch 'sm_90', but generate\.step"),
    (_edit_same_bucket_twice, r"graphs\[\d+\]\.bucket: same input-symbol bounds as graphs\[\d+\] for "
                              r"sm_80 \(seq=\d+\)"),
    (_edit_bucket_sets_differ, r"graphs\[\d+\]\.archs: serves sm_90 at seq=32, but no graph serves "
                               r"sm_80 there"),
    (_edit_arch_without_graphs, r"archs\[2\]: no graph serves sm_86"),
    (_edit_programmatic_on_sm80, r"graphs\[\d+\]\.nodes\[\d+\]\.programmatic: programmatic deps in a "
                                 r"graph for sm_80"),
    (_edit_waiting_kernel_on_sm80, r"kernels\[\d+\]\.binaries: a binary for sm_80, but .* waits"),
    (_edit_sm80_graph_runs_a_waiting_kernel, r"kernels\[\d+\]\.binaries: no binary for arch 'sm_80', "
                                             r"but graphs\[\d+\]\.nodes\[\d+\] runs"),
    (_edit_pdl_target_on_sm80, r"graphs\[\d+\]\.compiled\.target\.pdl: true, but the graph serves sm_80"),
    (_edit_programmatic_without_pdl, r"graphs\[\d+\]\.nodes\[\d+\]\.programmatic: programmatic deps, "
                                     r"but the graph was planned without pdl"),
    (_edit_bad_sm_count, r"graphs\[0\]\.compiled\.target\.sm_count: 0 is outside"),
]


@pytest.mark.parametrize("edit, message", MALFORMED, ids=[e.__name__[6:] for e, _ in MALFORMED])
def test_the_validator_refuses_malformed_variants(lm, edit, message):
    manifest, sections = lm
    validate_manifest(manifest, section_names=sections)   # the package itself is valid
    m = copy.deepcopy(manifest)
    edit(m)
    with pytest.raises(ManifestError, match=message):
        validate_manifest(m, section_names=sections)


@pytest.mark.slow
def test_mutants_of_a_package_with_variants_find_nothing(builds):
    """The mutation fuzzer (tools/fuzz.py) over the two-variant MLP: every tool finishes on every
    mutant with a typed error, nothing accepted is dangerous beyond the corpus' rate."""
    pytest.importorskip("cuda.bindings.driver")
    from grace.tools import fuzz

    summary = fuzz.fuzz([builds["mlp"]], 400, 20261208, workers=1,
                        stages=("verify", "inspect", "runtime", "interpret"))
    assert summary["findings"] == [], fuzz.format_summary(summary)
    assert summary["classes"]["manifest"]["accepted"] > 0
    assert summary["dangerous_rate"] <= 0.01, fuzz.format_summary(summary)


def test_a_static_package_has_one_graph_per_arch(builds):
    pkg = read_package(builds["static"])
    m, sections = pkg.manifest, list(pkg.section_names)
    assert [(g["name"], g["archs"]) for g in m["graphs"]] == [("main@sm_80", ["sm_80"]),
                                                              ("main@sm_90", ["sm_90"])]
    bad = copy.deepcopy(m)
    bad["graphs"][1]["archs"] = list(BOTH)
    with pytest.raises(ManifestError, match=r"graphs: a package without symbols has exactly one graph "
                                            r"per arch, but graphs\[0\] and graphs\[1\] both serve sm_80"):
        validate_manifest(bad, section_names=sections)
    bad = copy.deepcopy(m)
    for g in bad["graphs"]:
        del g["archs"]
    with pytest.raises(ManifestError, match=r"graphs: a package without symbols has exactly one graph, "
                                            r"got 2"):
        validate_manifest(bad, section_names=sections)


def test_an_older_reader_refuses_a_package_with_variants(lm):
    """What a reader before 3.5 would check (binaries for exactly `archs`, one graph per bucket)
    fails on a package with two variants: it is refused, never misread (SPEC §6)."""
    m, _ = lm
    assert any(set(k["binaries"]) != set(m["archs"]) for k in m["kernels"])
    buckets = [g["bucket"]["seq"] for g in m["graphs"]]
    assert len(set(buckets)) < len(buckets)


# ------------------------------------------------------------------------- 3.4 packages, options

def _as_3_4(path, out: Path) -> Path:
    """The package as grace 3.4 wrote it: no 3.5 keys, version 3.4."""
    pkg = read_package(path)
    m = copy.deepcopy(pkg.manifest)
    assert not any("archs" in g for g in m["graphs"])
    m["format_version"] = [3, 4]
    m["options"].pop("targets")
    for g in m["graphs"]:
        g["compiled"].pop("target")
    secs = {name: bytes(pkg.section(name)) for name in pkg.section_names
            if not name.startswith("sha256/")}
    out.write_bytes(pack_package_bytes(msgpack.packb(m, use_bin_type=True), secs, version=(3, 4)))
    return out


def test_a_3_4_package_still_loads_and_runs(builds, tmp_path, monkeypatch):
    from grace.tools.interpret import InterpretSession

    old = _as_3_4(builds["lm_sm_90"], tmp_path / "old.grace")
    pkg = read_package(old)
    assert pkg.format_version == (3, 4)
    assert all(set(k["binaries"]) == {"sm_90"} for k in pkg.manifest["kernels"])
    assert [a for a, _ in variants(pkg.view)] == [("sm_90",)]
    loaded, _ = _load(old, monkeypatch, (9, 0))
    assert loaded.graph_names == ["seq=1", "seq=8", "seq=32"] and loaded.view.graph_index == (0, 1, 2)
    sess = loaded.session()
    sess.run(idx=np.zeros((1, 3), np.int64), input_pos=np.arange(3))
    assert sess.last_graph == "seq=8"
    sess.close()
    loaded.close()
    tokens = InterpretSession(old).generate(np.array([3, 17, 42, 5]), 3)
    assert list(tokens) == _llama().greedy(torch.tensor([3, 17, 42, 5]), 3)


def test_archs_compiled_alike_share_one_set_of_graphs(tmp_path):
    """sm_80 and sm_86 plan for 108 and 84 SMs; this MLP's tiles do not depend on it, so the two
    targets lower to the same graphs, stored once without `archs`: a 3.4-shaped package."""
    m = read_package(_compile_mlp(tmp_path / "m.grace", ("sm_80", "sm_86"))).manifest
    assert m["options"]["targets"] == [{"archs": ["sm_80"], "pdl": False, "sm_count": 108, "gemm_tiles": None},
                                       {"archs": ["sm_86"], "pdl": False, "sm_count": 84, "gemm_tiles": None}]
    assert [g["name"] for g in m["graphs"]] == ["batch=8", "batch=64"]
    assert not any("archs" in g for g in m["graphs"])
    assert all(set(k["binaries"]) == {"sm_80", "sm_86"} for k in m["kernels"])
    # planned for two different counts: no single target to record
    assert not any("target" in g["compiled"] for g in m["graphs"])


def _split_model():
    """A [16, 4096] x [4096, 960] GEMM: 30 output tiles, so split-K fills 132 SMs with 8 splits
    but 108 with 4 (codegen.gemm_plan)."""
    torch.manual_seed(0)
    return torch.nn.Linear(4096, 960, bias=False).eval(), torch.randn(16, 4096)


def _splits(m, graph) -> list:
    return [n["grid"][2] for n in graph["nodes"] if m["kernels"][n["kernel"]]["family"] == "matmul"]


@pytest.mark.slow   # two CPU runs of a 16x4096x960 GEMM in Triton's interpreter (~25 s)
def test_the_sm_count_of_each_target_decides_its_tile_plans(tmp_path):
    from grace.tools.interpret import InterpretSession

    model, x = _split_model()
    path = grace_compile(model, (x,), output=tmp_path / "split.grace", archs=BOTH, fp32_matmul="ieee")
    m = read_package(path).manifest
    assert [(g["name"], _splits(m, g), g["compiled"]["target"]) for g in m["graphs"]] == \
        [("main@sm_80", [4], {"pdl": False, "sm_count": 108}),
         ("main@sm_90", [8], {"pdl": True, "sm_count": 132})]
    with torch.no_grad():
        want = model(x).numpy()
    for arch in BOTH:
        got = InterpretSession(path, arch=arch).run({"input": x.numpy()})["out"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sm_count_overrides_make_archs_alike(tmp_path):
    """--sm-count sm_90=108 plans the sm_90 graphs like the A100's: one target, one set of
    graphs (a 3.4-shaped package), split-K as for 108 SMs."""
    model, x = _split_model()
    path = grace_compile(model, (x,), output=tmp_path / "split.grace", archs=BOTH, fp32_matmul="ieee",
                         sm_count={"sm_90": 108}, pdl=False, gemm_tiles=False)
    m = read_package(path).manifest
    assert m["options"]["targets"] == [{"archs": list(BOTH), "pdl": False, "sm_count": 108,
                                        "gemm_tiles": None}]
    assert [(g["name"], "archs" in g, _splits(m, g)) for g in m["graphs"]] == [("main", False, [4])]


def test_each_target_lowers_with_its_own_sm_count(tmp_path, monkeypatch):
    from grace.aot import lower

    seen = []
    real = lower.lower

    def spy(core, name, options, *rest):
        seen.append((options["sm_count"], options["pdl"]))
        return real(core, name, options, *rest)

    monkeypatch.setattr(lower, "lower", spy)
    m = read_package(_compile_mlp(tmp_path / "m.grace", ("sm_80", "sm_90"), True,
                                  sm_count={"sm_90": 114})).manifest
    assert seen == [(108, False)] * 2 + [(114, True)] * 2   # two buckets per target
    assert m["options"]["targets"][1] == {"archs": ["sm_90"], "pdl": True, "sm_count": 114, "gemm_tiles": "sm_90"}
    assert {g["compiled"]["target"]["sm_count"] for g in _graphs_of(m, "sm_90")} == {114}


def test_compile_options():
    CompileOptions = compiler.CompileOptions
    assert [t.recorded() for t in CompileOptions(archs=BOTH, pdl=True).targets()] == \
        [{"archs": ["sm_80"], "pdl": False, "sm_count": 108, "gemm_tiles": None},
         {"archs": ["sm_90"], "pdl": True, "sm_count": 132, "gemm_tiles": "sm_90"}]
    # same pdl, SM count and GEMM tile table: one target
    alike = CompileOptions(archs=("sm_80", "sm_86"), sm_count=(("sm_86", 108),)).targets()
    assert [t.archs for t in alike] == [("sm_80", "sm_86")]
    same = CompileOptions(archs=("sm_80", "sm_90"), sm_count=(("sm_80", 132),), pdl=False,
                          gemm_tiles=False).targets()
    assert [t.archs for t in same] == [("sm_80", "sm_90")]
    # pdl by default: on for the sm_90+ archs, so sm_80 and sm_90 differ even at one SM count
    default = CompileOptions(archs=("sm_80", "sm_90"), sm_count=(("sm_80", 132),)).targets()
    assert [(t.archs, t.pdl) for t in default] == [(("sm_80",), False), (("sm_90",), True)]
    assert CompileOptions(archs=("sm_80",)).targets()[0].pdl is False   # no error: nothing to turn on
    # with measured GEMM tiles (the default), only sm_90 has a table: two targets
    tables = CompileOptions(archs=("sm_80", "sm_90"), sm_count=(("sm_80", 132),),
                            pdl=False).targets()
    assert [(t.archs, t.gemm_tiles) for t in tables] == [(("sm_80",), None), (("sm_90",), "sm_90")]
    assert CompileOptions(archs=("sm_87",), sm_count=(("sm_87", 16),)).targets()[0].sm_count == 16
    for kw, message in [
            ({"archs": ("sm_80",), "pdl": True}, "pdl needs sm_90 or newer, but the archs are sm_80"),
            ({"archs": ("sm_87",)}, r"no multiprocessor count for sm_87; give it with --sm-count sm_87=N"),
            ({"archs": ("sm_90",), "sm_count": (("sm_80", 100),)}, "sm_count: sm_80 is not one of"),
            ({"archs": ("sm_90",), "sm_count": (("sm_90", 0),)}, "not a multiprocessor count"),
            ({"archs": ("sm_90", "sm_90")}, "lists an arch twice"),
            ({"archs": ("sm_75",)}, "unsupported arch 'sm_75'"),
            ({"archs": ("sm_90a",)}, "unsupported arch 'sm_90a'")]:
        with pytest.raises(ValueError, match=message):
            CompileOptions(**kw)


def test_the_arch_table():
    assert archs.SM_COUNTS == {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_100": 148,
                               "sm_120": 170}
    assert archs.capability("sm_100") == (10, 0) and archs.capability("sm_90a") == (9, 0)
    assert [archs.supports_pdl(a) for a in ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100")] == \
        [False, False, True, True, True]
    assert archs.pick_arch((8, 6), BOTH) == "sm_80" and archs.pick_arch((9, 0), BOTH) == "sm_90"
    assert archs.pick_arch((7, 5), BOTH) is None and archs.pick_arch((10, 0), BOTH) is None
    assert archs.pick_arch((9, 0), ["sm_90a", "sm_80"]) == "sm_90a"


def test_cli_options(tmp_path, capsys):
    from grace.tools import cli

    assert cli.parse_sm_count(["sm_90=114", "sm_80=100,sm_86=84"]) == \
        {"sm_90": 114, "sm_80": 100, "sm_86": 84}
    for bad in (["sm_90"], ["sm_90=x"], ["hopper=1"], ["sm_90=1", "sm_90=2"], ["sm_90=0"]):
        with pytest.raises(cli.CliError):
            cli.parse_sm_count(bad)
    src = tmp_path / "m.pt2"
    src.write_bytes(b"")
    rc = cli.main(["compile", str(src), "-o", str(tmp_path / "m.grace"), "--arch", "sm_80", "--pdl"])
    assert rc != 0 and "pdl needs sm_90 or newer" in capsys.readouterr().err
    rc = cli.main(["compile", str(src), "-o", str(tmp_path / "m.grace"), "--arch", "sm_90",
                   "--sm-count", "sm_80=100"])
    assert rc != 0 and "sm_count: sm_80 is not one of the archs" in capsys.readouterr().err


# --------------------------------------------------------------------------------- conformance

VARIANT_VECTORS = sorted((CONFORMANCE / "variants").glob("*.json"))


@pytest.mark.parametrize("path", VARIANT_VECTORS, ids=[p.stem for p in VARIANT_VECTORS])
def test_the_runtime_plans_every_call_of_the_variant_vectors(path):
    from grace.runtime.errors import InputError, PackageMismatchError
    from grace.runtime.loader import pick_arch
    from grace.runtime.calls import ShapePlan

    vector = json.loads(path.read_text())
    assert vector["schema"] == "grace-conformance-vector/2"
    view = as_view(vector["manifest"])
    assert len(variants(view)) > 1
    for case in vector["cases"]:
        shapes = [tuple(s) for s in case["input_shapes"]]
        if case.get("error") == "no_variant":
            with pytest.raises(PackageMismatchError):
                pick_arch(tuple(case["capability"]), view.archs)
            continue
        arch = pick_arch(tuple(case["capability"]), view.archs)
        plan = ShapePlan(view, arch=arch)
        if "error" in case:
            with pytest.raises(InputError):
                plan.prepare(shapes)
            continue
        call = plan.prepare(shapes)
        assert arch == case["arch"]
        assert for_arch(view, arch).graph_index[call.graph] == case["graph"], case
        assert plan.graph_names[call.graph] == case["graph_name"]
        assert call.values == case["symbols"]
        assert [list(s) for s in call.output_shapes] == case["output_shapes"]
        words = list(call.words)
        for word, ptr in zip(plan.pointer_words, vector["table"]["pointer_of_slot"]):
            words[word] = ptr
        assert words == case["table_words"]


@pytest.mark.parametrize("path", VARIANT_VECTORS, ids=[p.stem for p in VARIANT_VECTORS])
def test_the_variant_vectors_follow_from_their_manifests(path):
    spec = importlib.util.spec_from_file_location("conformance_generate", CONFORMANCE / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    vector = json.loads(path.read_text())
    for case in vector["cases"]:
        head = {"capability": case["capability"], "input_shapes": case["input_shapes"]}
        try:
            want = {**head, **gen.expect_on(vector["manifest"], case["capability"], case["input_shapes"])}
        except gen.CallError as e:
            want = {**head, "error": e.kind, "why": str(e)}
        assert want == case
