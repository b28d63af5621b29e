"""The manifest checked against what its kernels were compiled for (issue 10, item 3; format 3.4).

Each edit below keeps the manifest consistent with itself (validate_manifest before 3.4 took every
one) and breaks the program: a race, a node running another kernel, pointers and sizes swapped in
the table words, an argument moved or in the wrong region, an I/O tensor narrower than compiled,
the driver reading past the parameter block, no table writer, a bucket served beyond its bound,
a grid larger than the kernel was built for. Each is applied to a package our compiler wrote, the
container rebuilt with every hash valid (tools/fuzz.py's `pack`), and must be refused with an
error that names the field. Packages without the records (format 3.3) still read, and skip these
checks; the runtime checks each kernel against its cubin (parameter count and sizes from the
ELF, through tools/fuzz.py's FakeDriver) at load either way.

The packages are the fuzz corpus's MLP with batch buckets and one-layer CachedLlama (KV cache,
index checks, --generate), compiled once for the module.
"""

from __future__ import annotations

import copy

import msgpack
import pytest

from grace.formats import ManifestError, read_package
from grace.formats.crosscheck import has_records
from grace.tools import fuzz

pytestmark = pytest.mark.slow   # compiles two small models (once per module)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    specs = fuzz._corpus_specs()
    folder = tmp_path_factory.mktemp("crosscheck")
    out = {}
    for name in ("mlp_buckets", "llama"):
        path = folder / f"{name}.grace"
        specs[name](path)
        out[name] = fuzz.Base(path)
    return out


def repack(base, manifest: dict, version=None) -> bytes:
    """The package with `manifest` instead of its own, every hash valid."""
    return fuzz.pack(msgpack.packb(manifest, use_bin_type=True), base.sections, version or base.version)


def edited(base, edit) -> bytes:
    m = copy.deepcopy(base.manifest)
    edit(m)
    return repack(base, m)


def refused(data: bytes, field: str) -> str:
    """read_package refuses `data` with a ManifestError whose message starts with `field`."""
    with pytest.raises(ManifestError) as info:
        read_package(data)
    message = str(info.value)
    assert message.startswith(field), message
    return message


def _arena_arg(m, nbytes_at_least: int):
    """(graph, node, arg index) of the first arena argument of at least this many bytes."""
    for g, graph in enumerate(m["graphs"]):
        for j, node in enumerate(graph["nodes"]):
            for a, arg in enumerate(node["args"]):
                if arg.get("region") == "arena" and arg["nbytes"] >= nbytes_at_least:
                    return g, j, a
    raise AssertionError("no such argument")


# ---------------------------------------------------------------------------- compiler output

def test_the_compilers_packages_carry_records_and_pass(bases):
    for base in bases.values():
        pkg = read_package(base.path)
        assert pkg.format_version == (3, 6) and has_records(pkg.manifest)
        view = pkg.view
        assert all(k.compiled is not None for k in view.kernels)
        assert all(g.compiled is not None for g in view.graphs)
        writer = view.kernels[view.graphs[0].nodes[0].kernel].compiled
        assert writer.table_words is not None and len(writer.table_words) == view.table.words
        # every node is listed by exactly its own kernel's record
        listed = {(u.graph, u.node): k for k, kernel in enumerate(view.kernels) for u in kernel.compiled.uses}
        for g, graph in enumerate(view.graphs):
            for j, node in enumerate(graph.nodes):
                assert listed[(g, j)] == node.kernel


def test_records_describe_what_the_kernels_were_built_for(bases):
    m = bases["mlp_buckets"].manifest
    for k in m["kernels"]:
        rec = k["compiled"]
        assert rec["nparams"] == len(k["params"]) + k["hidden_params"]
        assert rec["block"] == 32 * k["num_warps"] and rec["shared"] <= k["shared"]
    # the input slot's descriptor carries the bucket's shape: batch 8, then batch 64
    shapes = [d[4] for k in m["kernels"] for u in k["compiled"]["uses"] for d in u["args"]
              if d[0] == "slot" and d[2] == "x"]
    assert sorted(shapes) == [[8, 32], [64, 32]]
    assert m["graphs"][1]["compiled"]["bucket"] == {"batch": [1, 64]}


# ---------------------------------------------------------------------------- the edits

def test_a_node_pointed_at_another_kernel_with_the_same_parameter_count(bases):
    base = bases["mlp_buckets"]
    m = base.manifest
    node = m["graphs"][0]["nodes"][1]
    other = next(i for i, k in enumerate(m["kernels"]) if i != node["kernel"]
                 and [p["type"] for p in k["params"]] == [p["type"] for p in m["kernels"][node["kernel"]]["params"]])
    msg = refused(edited(base, lambda m: m["graphs"][0]["nodes"][1].__setitem__("kernel", other)),
                  "graphs[0].nodes[1].kernel")
    assert "was compiled for kernel" in msg


def test_a_table_writer_word_index_changed(bases):
    base = bases["mlp_buckets"]
    msg = refused(edited(base, lambda m: m["graphs"][0]["nodes"][0]["args"][2].__setitem__("word", 2)),
                  "graphs[0].nodes[0].args[2].word")
    assert "table word 1" in msg


def test_the_table_layout_moved_under_the_writer(bases):
    """The writer's word positions are recomputed from the slots and the extents, not trusted."""
    base = bases["mlp_buckets"]

    def move_extents(m):   # 8 bytes later: still inside the table and clear of the slots
        m["table"]["nbytes"] = m["regions"]["table"] = m["table"]["nbytes"] + 16
        m["table"]["extents"]["offset"] += 8
        for g in m["graphs"]:
            g["nodes"][0]["args"][0]["nbytes"] = m["table"]["nbytes"]
            for node in g["nodes"]:
                for arg in node["args"]:
                    if arg.get("region") == "table" and arg["offset"] == 96:
                        arg["offset"] += 8
    msg = refused(edited(base, move_extents), "table.extents")
    assert "compiled to store it at" in msg


def test_an_offset_moved_with_nbytes_shrunk_to_fit(bases):
    base = bases["llama"]
    g, j, a = _arena_arg(base.manifest, 512)

    def move(m):
        arg = m["graphs"][g]["nodes"][j]["args"][a]
        arg["offset"] += 256
        arg["nbytes"] -= 256
    refused(edited(base, move), f"graphs[{g}].nodes[{j}].args[{a}].offset")


def test_an_offset_moved_inside_the_arena(bases):
    base = bases["llama"]
    g, j, a = _arena_arg(base.manifest, 1)

    def move(m):
        arg = m["graphs"][g]["nodes"][j]["args"][a]
        arg["offset"] = (arg["offset"] + 256) % 1024
    refused(edited(base, move), f"graphs[{g}].nodes[{j}].args[{a}].offset")


def test_nbytes_below_what_the_kernel_touches(bases):
    base = bases["llama"]
    g, j, a = _arena_arg(base.manifest, 8)
    msg = refused(edited(base, lambda m: m["graphs"][g]["nodes"][j]["args"][a].__setitem__("nbytes", 4)),
                  f"graphs[{g}].nodes[{j}].args[{a}].nbytes")
    assert "may touch" in msg


def test_an_argument_in_the_wrong_region(bases):
    base = bases["llama"]
    g, j, a = _arena_arg(base.manifest, 1)
    msg = refused(edited(base, lambda m: m["graphs"][g]["nodes"][j]["args"][a].__setitem__("region", "state")),
                  f"graphs[{g}].nodes[{j}].args[{a}].region")
    assert "compiled for arena buffer" in msg


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["inputs"][0]["shape"].__setitem__(1, 16), "inputs[0].shape"),
    (lambda m: m["inputs"][0].__setitem__("dtype", "float16"), "inputs[0].dtype"),
    (lambda m: m["outputs"][0]["shape"].__setitem__(1, 8), "outputs[0].shape"),
    (lambda m: m["outputs"][0]["shape"].__setitem__(0, ["min", "batch", 4]), "outputs[0].shape"),
])
def test_an_io_shape_or_dtype_other_than_compiled(bases, edit, field):
    msg = refused(edited(bases["mlp_buckets"], edit), field)
    assert "compiled for" in msg


def test_hidden_params_lowered(bases):
    base = bases["mlp_buckets"]
    msg = refused(edited(base, lambda m: m["kernels"][1].__setitem__("hidden_params", 1)),
                  "kernels[1].hidden_params")
    assert "compiled with 7 parameters" in msg


def test_the_table_writer_dropped(bases):
    """Node 0 removed and every edge renumbered (the new node 0 keeps full edges, as node 0 must): a
    consistent manifest without a table writer."""
    base = bases["mlp_buckets"]

    def drop(m):
        for g in m["graphs"]:
            del g["nodes"][0]
            for node in g["nodes"]:
                node["deps"] = [d - 1 for d in node["deps"] if d != 0]
                if "programmatic" in node:
                    node["programmatic"] = [d - 1 for d in node["programmatic"] if d > 1]
    refused(edited(base, drop), "graphs[0].nodes[0]")


def test_a_bucket_bound_raised(bases):
    """A graph built for 8 rows must not serve 31."""
    base = bases["mlp_buckets"]
    msg = refused(edited(base, lambda m: m["graphs"][0]["bucket"].__setitem__("batch", 31)),
                  "graphs[0].bucket.batch")
    assert "compiled for batch up to 8" in msg


def test_a_symbol_minimum_lowered(bases):
    base = bases["mlp_buckets"]
    refused(edited(base, lambda m: m["symbols"][0].__setitem__("min", 0)), "symbols[0].min")


def test_a_gemm_grid_enlarged(bases):
    base = bases["mlp_buckets"]
    msg = refused(edited(base, lambda m: m["graphs"][1]["nodes"][1]["grid"].__setitem__(0, 8)),
                  "graphs[1].nodes[1].grid")
    assert "compiled for grid [4, 2, 1]" in msg


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["kernels"][1].__setitem__("num_warps", 8), "kernels[1].num_warps"),
    (lambda m: m["kernels"][1].__setitem__("shared", m["kernels"][1]["shared"] // 2), "kernels[1].shared"),
    (lambda m: m["kernels"][1].pop("writes"), "kernels[1].writes"),
    (lambda m: m["kernels"][1].__setitem__("writes", []), "kernels[1].writes"),
    (lambda m: m["kernels"][2].pop("compiled"), "kernels[2]"),
    (lambda m: m["graphs"][1].pop("compiled"), "graphs[1]"),
    (lambda m: m["graphs"][0]["compiled"]["target"].__setitem__("pdl", False),
     "graphs[0].nodes[2].programmatic"),
    (lambda m: m["graphs"][0]["nodes"][2].__setitem__("programmatic", [0, 1]), "graphs[0].nodes[2].programmatic"),
    (lambda m: m["kernels"][4].__setitem__("source", m["kernels"][1]["source"]), "kernels[4].source"),
])
def test_launch_fields_against_the_kernel_record(bases, edit, field):
    refused(edited(bases["mlp_buckets"], edit), field)


def test_index_checks_dropped_while_kernels_report_them(bases):
    """Without `index_checks` a runtime never reads the error word: out-of-range indices would go
    unreported."""
    base = bases["llama"]
    msg = refused(edited(base, lambda m: m.pop("index_checks")), "index_checks")
    assert "nothing would ever read it" in msg


def test_a_weights_entry_moved_under_its_kernels(bases):
    base = bases["mlp_buckets"]

    def move(m):
        m["regions"]["weights"] += 256
        m["weights"][-1]["offset"] += 256
    msg = refused(edited(base, move), "graphs[0].nodes[2].args[3].offset")
    assert "weights entry" in msg


def test_the_memory_plan_must_keep_live_buffers_apart(bases):
    base = bases["llama"]
    plan = base.manifest["graphs"][1]["compiled"]["buffers"]
    a, b = next((a, b) for a in range(len(plan)) for b in range(len(plan)) if a != b
                and plan[a]["nbytes"] and plan[b]["nbytes"]
                and plan[a]["first"] <= plan[b]["last"] and plan[b]["first"] <= plan[a]["last"])
    msg = refused(edited(base, lambda m: m["graphs"][1]["compiled"]["buffers"][b].__setitem__(
        "offset", plan[a]["offset"])), "graphs[1].compiled.buffers")
    assert "while both are live" in msg


def test_a_removed_edge_is_a_race_refused_at_load(bases, monkeypatch):
    """Edges are not in the records: the race proof (formats/races.py) judges them, in `grace verify`
    and at load, before the GPU is touched."""
    import grace.runtime as rt
    from grace.runtime import driver
    from grace.runtime.errors import InvalidPackageError

    base = bases["mlp_buckets"]

    def remove_edge(m):
        node = m["graphs"][0]["nodes"][2]
        node["deps"], node["programmatic"] = [0], []
    data = edited(base, remove_edge)
    read_package(data)   # consistent with itself and with the records
    fake = fuzz.FakeDriver()
    monkeypatch.setattr(driver, "_cu", fake)
    with pytest.raises(InvalidPackageError, match=r"race: graph 'batch=8': node 1 .* and node 2"):
        rt.load(data)
    assert fake.modules == {}   # refused before any kernel was loaded


# ---------------------------------------------------------------------------- 3.3 packages

def strip_records(m: dict) -> dict:
    """What a 3.3 compiler wrote: no records, format_version [3, 3]."""
    m = copy.deepcopy(m)
    for entry in m["kernels"] + m["graphs"]:
        entry.pop("compiled", None)
    m["format_version"] = [3, 3]
    return m


def test_a_3_3_package_still_reads_and_runs_on_the_fake_driver(bases, monkeypatch):
    import grace.runtime as rt
    from grace.runtime import driver

    for base in bases.values():
        data = repack(base, strip_records(base.manifest), (3, 3))
        pkg = read_package(data)
        assert pkg.format_version == (3, 3) and not has_records(pkg.manifest)
        assert all(k.compiled is None for k in pkg.view.kernels)
        monkeypatch.setattr(driver, "_cu", fuzz.FakeDriver())
        loaded = rt.load(data)
        assert all(info["params_checked"] for info in loaded.kernel_info)
        loaded.close()


def test_without_records_the_cross_checks_are_skipped(bases):
    """What a 3.3 package cannot be checked for: a grid enlarged reads (the cubin check at load
    still catches what the binary itself knows, next test)."""
    base = bases["mlp_buckets"]
    m = strip_records(base.manifest)
    m["graphs"][1]["nodes"][1]["grid"][0] = 8
    read_package(repack(base, m, (3, 3)))


def test_the_cubin_refuses_hidden_params_lowered_at_load(bases, monkeypatch):
    """Without records the reader cannot see it; the driver's answer about the binary can."""
    import grace.runtime as rt
    from grace.runtime import driver
    from grace.runtime.errors import KernelMismatchError

    base = bases["mlp_buckets"]
    m = strip_records(base.manifest)
    m["kernels"][1]["hidden_params"] = 1
    data = repack(base, m, (3, 3))
    read_package(data)
    monkeypatch.setattr(driver, "_cu", fuzz.FakeDriver())
    with pytest.raises(KernelMismatchError, match=r"kernel matmul_\w+: its binary takes at least 7 parameters, "
                                                  r"but the manifest describes 5 .* \+ 1 hidden"):
        rt.load(data)


def test_a_3_4_package_reads_without_its_records_as_an_older_reader_would(bases):
    """A 3.3 reader ignores the `compiled` keys (SPEC §3: unknown keys are ignored): what it
    sees is exactly the manifest without them, which is valid on its own."""
    from grace.formats import validate_manifest

    for base in bases.values():
        m = strip_records(base.manifest)
        m["format_version"] = [3, 4]
        validate_manifest(m, section_names=[name for name, _, _ in base.sections])
