"""Our runtime against the conformance vectors (tests/conformance/*.json, README.md there): for each
small real package and each call, the shape planner (runtime/calls.py) must resolve the same
symbol values, select the same graph, compute the same output shapes and write the same table
words (laid out by grace.formats.table) as SPEC.md §5.1 says, or refuse the call with the same
kind of error, before any launch. No GPU: this is the part of a runtime that runs on the host."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from grace.formats import as_view, table
from grace.runtime import calls
from grace.runtime.errors import InputError

HERE = Path(__file__).resolve().parent / "conformance"
VECTORS = sorted(HERE.glob("*.json"))
# the error kinds of the vectors, and how our runtime words them (runtime/calls.py)
ERRORS = {"rank": r"rank is \d+", "static_dim": r"expected \[.*\(dim \d+ must be \d+\)",
          "range": r"must be in \[", "sources_disagree": r"both are symbol .* and must be equal",
          "no_graph": r"no graph of this package serves"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _generator():
    spec = importlib.util.spec_from_file_location("conformance_generate", HERE / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_runtime_plans_every_call_as_the_vector_says(path):
    vector = _load(path)
    assert vector["schema"] == "grace-conformance-vector/1"
    plan = calls.ShapePlan(vector["manifest"])   # validates the manifest first
    facts = vector["table"]
    assert plan.pointer_words == facts["pointer_words"]
    for case in vector["cases"]:
        shapes_in = [tuple(s) for s in case["input_shapes"]]
        if "error" in case:
            with pytest.raises(InputError, match=ERRORS[case["error"]]):
                plan.prepare(shapes_in)
            continue
        call = plan.prepare(shapes_in)
        assert call.values == case["symbols"], case
        assert (call.graph, plan.graph_names[call.graph]) == (case["graph"], case["graph_name"]), case
        assert [list(s) for s in call.output_shapes] == case["output_shapes"], case
        words = list(call.words)
        for word, ptr in zip(plan.pointer_words, facts["pointer_of_slot"]):
            words[word] = ptr   # what run() does with the call's data pointers
        assert words == case["table_words"], case


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_table_layout_matches_the_vector(path):
    """Where each word goes: formats.table and the manifest view agree with the vector."""
    vector = _load(path)
    view = as_view(vector["manifest"])
    facts = vector["table"]
    slots = [(s.offset, s.rank) for s in view.table.slots]
    positions = table.word_positions(slots, view.table.extents_offset, len(view.symbols))
    assert [8 * p for p in positions] == facts["word_bytes"]
    assert view.table.words == facts["words"] == len(facts["word_bytes"])
    assert view.table.errors_offset == facts["errors_offset"]
    if facts["errors_offset"] is not None:   # the error word is no table word (SPEC §5.4)
        assert facts["errors_offset"] not in facts["word_bytes"]


def test_the_vectors_cover_the_rules_and_stay_small():
    vectors = [_load(p) for p in VECTORS]
    assert {v["model"] for v in vectors} >= {"static_mlp", "dynamic_batch", "two_symbols",
                                            "data_symbol", "index_checks", "bucket_gap"}
    kinds = {c["error"] for v in vectors for c in v["cases"] if "error" in c}
    assert kinds == set(ERRORS)
    assert any(len(s["sources"]) > 1 for v in vectors for s in v["manifest"]["symbols"])
    assert any(s["kind"] == "data" for v in vectors for s in v["manifest"]["symbols"])
    assert any(v["table"]["errors_offset"] is not None for v in vectors)
    assert all(p.stat().st_size < 24_000 for p in VECTORS), [p.stat().st_size for p in VECTORS]


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_the_answers_follow_from_the_manifest(path):
    """Nobody edited a vector by hand: the generator's SPEC rules give the committed answers."""
    gen = _generator()
    vector = _load(path)
    for case in vector["cases"]:
        try:
            want = {"input_shapes": case["input_shapes"], **gen.expect(vector["manifest"],
                                                                     case["input_shapes"])}
        except gen.CallError as e:
            want = {"input_shapes": case["input_shapes"], "error": e.kind, "why": str(e)}
        assert want == case
    assert vector["table"] == gen.table_facts(vector["manifest"])


def test_the_vectors_follow_the_compiler():
    """A compile today lays out the same symbols, I/O, table and buckets as the committed vector
    (stand-in cubins; if this fails after a deliberate change, run tests/conformance/generate.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    gen = _generator()
    committed = _load(HERE / "index_checks.json")["manifest"]   # the smallest: one kernel a graph
    fresh = gen.strip(gen.compile_manifest("index_checks", fake_build=True)[0])
    for key in ("symbols", "inputs", "outputs", "table", "index_checks"):
        assert fresh[key] == committed[key], key
    assert [(g["name"], g["bucket"]) for g in fresh["graphs"]] == \
        [(g["name"], g["bucket"]) for g in committed["graphs"]]
