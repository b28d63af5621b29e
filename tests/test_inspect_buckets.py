"""`grace inspect` on packages with shape buckets (since format 2.0): symbols, buckets and one row
per graph (CPU only).

The packages are built by hand with `grace.formats.write_package` and dummy cubin bytes: inspect
reads the manifest and the section index, it never loads a binary.

    x[batch, seq, 8] ──k_ln──▶ arena ──k_proj──▶ out[batch, seq, 8]
    symbols: seq (input, 1..512, buckets 128/256/512), batch (input, 1..4, buckets 2/4)
    6 graphs = 3 seq buckets × 2 batch buckets
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from grace.formats import FORMAT_VERSION, read_package, write_package
from grace.tools.inspect import describe, render

SEQ, BATCH = (128, 256, 512), (2, 4)
SLOT_WORDS = 7 + 7  # x and out, rank 3 each
EXT_OFFSET = 128  # the symbol words, after the slots x [0, 56) and out [64, 120)
ARCH = "sm_90"


def _kernel(name: str, family: str, params: list[tuple[str, str]]) -> dict:
    return {"name": name, "family": family, "params": [{"name": n, "type": t} for n, t in params],
            "num_warps": 4, "num_stages": 2, "shared": 0, "binaries": {ARCH: f"cubin/{name}.{ARCH}"}}


def _graph(seq: int, batch: int, n_symbols: int, words: int, ext_offset: int, stats: dict) -> dict:
    arena = seq * batch * 8 * 4
    ext = {"region": "table", "offset": ext_offset, "nbytes": 8 * n_symbols, "dtype": "int64"}
    return {
        "name": f"seq={seq},batch={batch}",
        "bucket": {"seq": seq, "batch": batch},
        "arena": arena,
        "stats": stats,
        "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": ext_offset + 8 * n_symbols}]
             + [{"word": i} for i in range(words)]},
            {"kernel": 1, "grid": [seq * batch // 64, 1, 1], "deps": [0],
             "args": [{"region": "table", "offset": 0, "nbytes": 56}, dict(ext),
                      {"region": "arena", "offset": 0, "nbytes": arena, "dtype": "float32"}]},
            {"kernel": 2, "grid": [seq * batch // 128, 1, 1], "deps": [1],
             "args": [{"region": "arena", "offset": 0, "nbytes": arena, "dtype": "float32"},
                      {"region": "table", "offset": 64, "nbytes": 56}, dict(ext)]},
        ],
    }


def bucket_manifest(graphs=None) -> dict:
    """2 input symbols × buckets; `graphs` restricts the (seq, batch) pairs that get a graph."""
    pairs = graphs if graphs is not None else [(s, b) for s in SEQ for b in BATCH]
    ext_offset, n_symbols = EXT_OFFSET, 2
    words = SLOT_WORDS + n_symbols
    graph_list = []
    for i, (s, b) in enumerate(pairs):
        stats = {"kernels": 2, "est_gpu_us": 1.5 * s * b / 256, "padding": round(1 - 100 / s, 3),
                 "note": "text stats are not columns"}
        if i == 0:
            stats["est_flops"] = 12345  # a key only some graphs have
        graph_list.append(_graph(s, b, n_symbols, words, ext_offset, stats))
    return {
        "producer": {"grace": "0.1.0", "torch": "2.13.0", "triton": "3.6.0"},
        "model": {"name": "buckets"},
        "archs": [ARCH],
        "options": {"buckets": {"seq": list(SEQ), "batch": list(BATCH)},
                    "bucket_cost": "est_gpu_us weighted by a uniform size distribution"},
        "symbols": [
            {"name": "seq", "kind": "input", "min": 1, "max": 512, "sources": [[0, 1]]},
            {"name": "batch", "kind": "input", "min": 1, "max": 4, "sources": [[0, 0]]},
        ],
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", "seq", 8], "slot": 0}],
        "outputs": [{"name": "out", "dtype": "float32", "shape": ["batch", ["+", "seq", 0], 8], "slot": 1}],
        "table": {"nbytes": ext_offset + 8 * n_symbols,
                  "extents": {"offset": ext_offset, "count": n_symbols},
                  "slots": [{"name": "x", "role": "input", "offset": 0, "rank": 3},
                            {"name": "out", "role": "output", "offset": 64, "rank": 3}]},
        "regions": {"weights": 0, "arena": max(g["arena"] for g in graph_list),
                    "table": ext_offset + 8 * n_symbols, "state": 0},
        "weights": [],
        "state": [],
        "kernels": [
            _kernel("table_writer", "table_writer",
                    [("table", "*i64")] + [(f"w{i}", "i64") for i in range(words)]),
            _kernel("k_ln", "layer_norm", [("x_slot", "*i64"), ("ext", "*i64"), ("y", "*fp32")]),
            _kernel("k_proj", "gemm", [("y", "*fp32"), ("out_slot", "*i64"), ("ext", "*i64")]),
        ],
        "graphs": graph_list,
    }


def static_manifest() -> dict:
    m = bucket_manifest(graphs=[(128, 2)])
    m["symbols"] = []
    m["options"] = {}
    m["inputs"][0]["shape"] = [2, 128, 8]
    m["outputs"][0]["shape"] = [2, 128, 8]
    m["table"]["extents"]["count"] = 0
    words = SLOT_WORDS
    m["kernels"][0]["params"] = m["kernels"][0]["params"][:1 + words]
    g = m["graphs"][0]
    g["name"], g["bucket"] = "main", {}
    g["nodes"][0]["args"] = g["nodes"][0]["args"][:1 + words]
    for node in g["nodes"][1:]:
        for arg in node["args"]:
            if arg.get("offset") == EXT_OFFSET and arg.get("region") == "table":
                arg["nbytes"] = 0
    return m


def _sections(m: dict) -> dict:
    return {sec: b"\x7fELF not a real cubin" for k in m["kernels"] for sec in k["binaries"].values()}


def _describe(tmp_path, m: dict) -> dict:
    path = tmp_path / "m.grace"
    write_package(path, m, _sections(m))
    with read_package(path) as pkg:
        return describe(pkg)


def _render_text(d: dict) -> str:
    console = Console(record=True, width=200, color_system=None)
    render(d, console)
    return console.export_text()


@pytest.fixture
def desc(tmp_path) -> dict:
    return _describe(tmp_path, bucket_manifest())


def test_describe_symbols(desc):
    assert desc["format_version"] == list(FORMAT_VERSION)
    assert desc["symbols"] == [
        {"name": "seq", "kind": "input", "min": 1, "max": 512,
         "sources": [{"input": 0, "name": "x", "dim": 1}], "buckets": [128, 256, 512]},
        {"name": "batch", "kind": "input", "min": 1, "max": 4,
         "sources": [{"input": 0, "name": "x", "dim": 0}], "buckets": [2, 4]},
    ]


def test_describe_buckets_summary_and_policy(desc):
    b = desc["buckets"]
    assert b["graphs"] == 6 and b["counts"] == {"seq": 3, "batch": 2}
    assert b["summary"] == "6 graphs = product of buckets: seq 3 × batch 2"
    assert b["policy"] == {"seq": [128, 256, 512], "batch": [2, 4]}
    assert b["cost_model"].startswith("est_gpu_us")


def test_describe_graphs_and_table(desc):
    graphs = desc["graphs"]
    assert [g["bucket"] for g in graphs] == [{"seq": s, "batch": b} for s in SEQ for b in BATCH]
    assert [g["arena"] for g in graphs] == [s * b * 32 for s in SEQ for b in BATCH]
    # launches and distinct kernels of each graph, the table writer (node 0) not counted
    assert {g["kernels"] for g in graphs} == {2} and {g["unique_kernels"] for g in graphs} == {2}
    assert {g["nodes"] for g in graphs} == {3}
    assert graphs[0]["stats"]["est_flops"] == 12345
    assert desc["table"]["words"] == SLOT_WORDS + 2
    assert desc["table"]["extents"] == {"offset": EXT_OFFSET, "count": 2, "first_word": SLOT_WORDS}
    assert desc["kernels"][1]["nodes"] == 6  # counted over all graphs
    json.dumps(desc)  # everything is JSON-able


def test_render_buckets(desc):
    text = _render_text(desc)
    assert "graphs    6 graphs = product of buckets: seq 3 × batch 2" in text
    assert "symbols (2)" in text
    for row in ("seq     input   1..512   x[1]", "batch   input   1..4     x[0]"):
        assert row in text, row
    assert "bucket policy (options.buckets): seq: 128, 256, 512; batch: 2, 4" in text
    assert "bucket cost model (options.bucket_cost): est_gpu_us weighted" in text
    assert "[batch, seq + 0, 8]" in text  # shape expressions, not eaten as rich markup
    assert "extents" in text and "(w14..w15)" in text
    assert "graphs, one per bucket (6)" in text
    header = next(line for line in text.splitlines() if "unique kernels" in line)
    for col in ("graph", "bucket", "kernels", "arena", "est_gpu_us", "padding", "est_flops"):
        assert col in header, col
    assert "note" not in header  # non-numeric stats are not columns
    rows = [line for line in text.splitlines() if line.strip().startswith("seq=")]
    assert len(rows) == 6, rows
    assert "seq=512 batch=4" in rows[-1] and "64.00 KiB" in rows[-1]
    assert rows[0].rstrip().endswith("12345") and rows[1].rstrip().endswith("-")
    assert "kernel families" in text and "layer_norm" in text


def test_partial_product_is_reported(tmp_path):
    d = _describe(tmp_path, bucket_manifest(graphs=[(128, 2), (256, 2), (512, 2), (512, 4)]))
    assert d["buckets"]["summary"] == "4 graphs (buckets: seq 3 × batch 2; not their full product 6)"


def test_data_symbol_only_package(tmp_path):
    """No input symbols, one data symbol: one graph, but not a 'static shapes' one."""
    m = static_manifest()
    m["symbols"] = [{"name": "n", "kind": "data", "min": 0, "max": 256, "sources": []}]
    m["outputs"][0]["shape"] = ["n", 128, 8]
    m["table"]["extents"]["count"] = 1
    m["table"]["nbytes"] = m["regions"]["table"] = EXT_OFFSET + 8
    m["kernels"][0]["params"].append({"name": f"w{SLOT_WORDS}", "type": "i64"})
    g = m["graphs"][0]
    g["bucket"] = {"n": 256}
    g["nodes"][0]["args"].append({"word": SLOT_WORDS})
    g["nodes"][0]["args"][0]["nbytes"] = EXT_OFFSET + 8
    d = _describe(tmp_path, m)
    assert d["buckets"]["summary"] == "1 graph (no input symbols; data-dependent sizes: n)"
    assert d["symbols"][0]["sources"] == [] and d["symbols"][0]["buckets"] == [256]
    text = _render_text(d)
    assert "(computed on the device)" in text and "[n, 128, 8]" in text


def test_no_policy_lines_without_options(tmp_path):
    m = bucket_manifest()
    m["options"] = {"fp32_matmul": "tf32x3"}
    d = _describe(tmp_path, m)
    assert d["buckets"]["policy"] is None and d["buckets"]["cost_model"] is None
    text = _render_text(d)
    assert "bucket policy" not in text and "cost model" not in text
    assert "symbols (2)" in text


def test_static_package(tmp_path):
    d = _describe(tmp_path, static_manifest())
    assert d["symbols"] == [] and d["buckets"]["summary"] == "1 graph (static shapes)"
    assert d["table"]["extents"]["count"] == 0 and d["table"]["words"] == SLOT_WORDS
    assert d["graphs"][0]["bucket"] == {}
    text = _render_text(d)
    assert "1 graph (static shapes)" in text
    assert "symbols (" not in text and "extents" not in text and "bucket policy" not in text
    assert ("graph 'main': 3 nodes (the table writer and 2 kernel launches), 2 unique kernels, "
            "2 dependency edges") in text
    assert "[2, 128, 8]" in text


# ---- compiled packages: every per-graph figure is that graph's, totals are labelled --------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """An MLP with a dynamic batch (three buckets: three arenas, three memory plans) and a cached
    decoder compiled for generation (state, a decode graph of seq=1, a generation-step kernel)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from grace.tools.models import MLP, CachedLlama

    tmp = tmp_path_factory.mktemp("compiled")
    torch.manual_seed(0)
    mlp = grace_compile(MLP().eval(), (torch.randn(8, 64),), output=tmp / "mlp.grace",
                        progress=False, dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
                        buckets={"batch": [4, 16, 64]})
    lm_model = CachedLlama(vocab=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden=48,
                           max_seq=32).eval()
    seq = Dim("seq", min=1, max=32)
    lm = grace_compile(lm_model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                       output=tmp / "lm.grace", progress=False,
                       dynamic_shapes={"idx": {1: seq}, "input_pos": {0: seq}},
                       buckets={"seq": [16, 32]},
                       generate={"tokens": "idx", "positions": "input_pos"})
    return {"mlp": mlp, "lm": lm}


def _read(path):
    pkg = read_package(path)
    return pkg, describe(pkg), pkg.manifest


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_each_graphs_figures_are_counted_from_that_graph(compiled, name):
    _, d, m = _read(compiled[name])
    assert len(d["graphs"]) == len(m["graphs"]) >= 3
    for got, g in zip(d["graphs"], m["graphs"]):
        nodes = g["nodes"]
        assert got["name"] == g["name"] and got["nodes"] == len(nodes)
        # kernel launches and distinct kernels, node 0 (the table writer) not counted: what the
        # compiler recorded in the graph's stats, and what the columns of the table show
        assert got["kernels"] == len(nodes) - 1 == g["stats"]["kernels"]
        assert got["unique_kernels"] == len({n["kernel"] for n in nodes[1:]}) == g["stats"]["unique_kernels"]
        assert got["edges"] == sum(len(n["deps"]) for n in nodes) == sum(got["edges_by_kind"].values())
        assert sum(got["families"].values()) == len(nodes)
        assert got["arena"] == g["arena"]
        # the memory plan is this graph's own (graphs[i].compiled.buffers)
        buffers = g["compiled"]["buffers"]
        plan = got["arena_buffers"]
        assert plan["count"] == len(buffers) and plan["nbytes"] == sum(b["nbytes"] for b in buffers)
        assert plan["largest"][0]["nbytes"] == max(b["nbytes"] for b in buffers)
        assert {b["name"] for b in plan["largest"]} <= {b["name"] for b in buffers}
        assert max(b["offset"] + b["nbytes"] for b in buffers) <= got["arena"]
    # the buckets differ in what they cost, so a figure taken from the wrong graph would show
    assert len({g["arena"] for g in d["graphs"]}) == len(d["graphs"])
    assert len({g["arena_buffers"]["nbytes"] for g in d["graphs"]}) == len(d["graphs"])


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_memory_plan_and_totals_describe_the_graph_they_name(compiled, name):
    _, d, m = _read(compiled[name])
    widest = max(m["graphs"], key=lambda g: g["arena"])
    # the arena region is the largest graph's, and the buffers shown next to it are its plan
    assert d["memory"]["regions"]["arena"] == widest["arena"]
    shown = d["memory"]["arena_buffers"]
    assert shown["graph"] == widest["name"]
    assert (shown["count"], shown["nbytes"]) == (len(widest["compiled"]["buffers"]),
                                                 sum(b["nbytes"] for b in widest["compiled"]["buffers"]))
    t = d["totals"]
    graphs = d["graphs"]
    assert t["graphs"] == len(m["graphs"])
    for key in ("nodes", "kernels", "edges"):   # sums of the per-graph figures
        assert t[key] == sum(g[key] for g in graphs), key
    assert t["edges_by_kind"] == {k: sum(g["edges_by_kind"][k] for g in graphs) for k in ("full", "programmatic")}
    launched = {n["kernel"] for g in m["graphs"] for n in g["nodes"][1:]}
    assert t["unique_kernels"] == len(launched)   # a union: graphs share kernels
    assert max(g["unique_kernels"] for g in graphs) <= t["unique_kernels"] <= sum(g["unique_kernels"] for g in graphs)
    assert t["largest_arena"] == {"graph": widest["name"], "nbytes": widest["arena"]}
    pk = t["package_kernels"]
    assert pk["count"] == len(m["kernels"]) == len(d["kernels"])
    assert pk["count"] == pk["launched"] + pk["table_writer"] + pk["generate_step"] + pk["unused"]
    assert (pk["launched"], pk["table_writer"], pk["unused"]) == (len(launched), 1, 0)
    assert pk["generate_step"] == (1 if name == "lm" else 0)
    # every kernel's node count is over all graphs, and adds up to the graphs' nodes
    assert sum(k["nodes"] for k in d["kernels"]) == t["nodes"]
    json.dumps(d)


def _graph_rows(text: str, names) -> dict:
    """{graph name: the columns of its row in the graphs table}."""
    rows = {}
    for line in text.splitlines():
        cols = line.split()
        if cols and cols[0] in names and len(cols) > 10:
            rows[cols[0]] = cols
    return rows


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_table_shows_each_graphs_figures_and_labelled_totals(compiled, name):
    from grace.tools.inspect import human_bytes

    _, d, m = _read(compiled[name])
    console = Console(record=True, width=260, color_system=None)
    render(d, console)
    text = console.export_text()
    rows = _graph_rows(text, {g["name"] for g in d["graphs"]})
    assert set(rows) == {g["name"] for g in d["graphs"]}
    for g in d["graphs"]:
        # graph, bucket, nodes, kernels, unique kernels, edges (programmatic), arena, buffers, before reuse
        cols = rows[g["name"]]
        assert cols[2:5] == [str(g["nodes"]), str(g["kernels"]), str(g["unique_kernels"])], cols
        assert cols[5:7] == [str(g["edges"]), f"({g['edges_by_kind']['programmatic']})"]
        assert " ".join(cols[7:9]) == human_bytes(g["arena"])
        assert cols[9] == str(g["arena_buffers"]["count"])
        assert " ".join(cols[10:12]) == human_bytes(g["arena_buffers"]["nbytes"])
    t, shown = d["totals"], d["memory"]["arena_buffers"]
    assert (f"totals over {t['graphs']} graphs: {t['nodes']} nodes, {t['kernels']} kernel launches "
            f"(summed), {t['unique_kernels']} distinct kernels launched (the union") in text
    assert f"arena: the largest graph's, {shown['graph']!r} {human_bytes(t['largest_arena']['nbytes'])}" in text
    assert (f"sized for the largest of {len(d['graphs'])} graphs, {shown['graph']!r}, one arena per "
            f"session; its plan: {shown['count']} buffers ({human_bytes(shown['nbytes'])} before reuse)") in text
    assert f"largest arena buffers of graph {shown['graph']!r}" in text
    step = ", the generation step" if name == "lm" else ""
    assert (f"kernels ({len(m['kernels'])} in the package: {t['unique_kernels']} launched by the "
            f"graphs, the table writer{step})") in text


def test_cli_json_is_the_description(compiled):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "grace.tools.cli", "inspect", str(compiled["mlp"]), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    _, d, _ = _read(compiled["mlp"])
    assert got["graphs"] == json.loads(json.dumps(d["graphs"]))
    assert got["totals"] == d["totals"] and got["memory"]["arena_buffers"] == d["memory"]["arena_buffers"]
