"""One module per shared fact (issue 12, item 1): the argument-table layout (grace.formats.table)
and the one typed, defaults-filled view of a validated manifest (grace.formats.view).

  * the layout functions, and the compiler's packing (`table.pack`) against the format's rules;
  * every consumer agrees with formats.table: the validator, the view, the runtime's table words
    and pointer words, the table writer's stores, `grace inspect`;
  * optional manifest keys take their SPEC defaults in the view, and a manifest without
    `hidden_params` runs through the runtime (fake driver) and the CPU interpreter.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import grace.runtime as rt
from grace.formats import ManifestError, as_view, read_package, table, validate_manifest, write_package
from grace.runtime import calls, driver

try:
    from test_runtime_nogpu import N_WORDS, ROWS, COLS, FakeDriver, read_params
    from test_runtime_nogpu import manifest as static_manifest
    from test_runtime_nogpu import write as write_static
    from test_runtime_buckets import two_symbol_manifest
except ImportError:  # tests/ imported as a package
    from tests.test_runtime_nogpu import N_WORDS, ROWS, COLS, FakeDriver, read_params
    from tests.test_runtime_nogpu import manifest as static_manifest
    from tests.test_runtime_nogpu import write as write_static
    from tests.test_runtime_buckets import two_symbol_manifest


# ---------------------------------------------------------------------------- the layout

def test_a_slot_is_a_pointer_then_sizes_then_strides():
    assert [table.slot_words(r) for r in (0, 1, 2, 3)] == [1, 3, 5, 7]
    assert table.slot_nbytes(2) == 40
    assert table.slot_values(0xA0, (2, 3), (3, 1)) == [0xA0, 2, 3, 3, 1]


def test_words_are_the_slots_in_order_then_the_symbols():
    assert table.first_words([2, 1, 0]) == [0, 5, 8]
    assert table.word_count([2, 1, 0]) == 9 and table.word_count([2, 1, 0], 2) == 11
    # slots at bytes 0 and 48 (rank 2), the symbols at byte 96: int64 positions in the table
    assert table.word_positions([(0, 2), (48, 2)], 96, 2) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13]


def test_pack_is_the_compilers_layout():
    assert table.pack([2, 2], 0) == table.Layout((0, 48), 96, None, 96)
    assert table.pack([2], 1, errors=True) == table.Layout((0,), 48, 56, 64)
    assert table.pack([], 0) == table.Layout((), 0, None, 16)   # never an empty table


@pytest.mark.parametrize("seed", range(20))
def test_packed_tables_follow_the_format_rules(seed):
    """Slots 16-aligned and disjoint, the extents and the error word clear of them, all inside the
    table; the table writer's stores hit every table word once, inside the table."""
    rng = random.Random(seed)
    ranks = [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
    n_symbols, errors = rng.randint(0, 4), rng.random() < 0.5
    lay = table.pack(ranks, n_symbols, errors)
    spans = [(off, off + table.slot_nbytes(r)) for off, r in zip(lay.slot_offsets, ranks)]
    spans.append((lay.extents_offset, lay.extents_offset + 8 * n_symbols))
    if errors:
        spans.append((lay.errors_offset, lay.errors_offset + 8))
    assert all(off % table.SLOT_ALIGN == 0 for off in lay.slot_offsets)
    assert lay.extents_offset % 8 == 0 and lay.nbytes % 16 == 0
    for (a0, a1), (b0, b1) in itertools.combinations(spans, 2):
        assert a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1
    assert all(end <= lay.nbytes for _, end in spans)
    positions = table.word_positions(zip(lay.slot_offsets, ranks), lay.extents_offset, n_symbols)
    assert len(positions) == len(set(positions)) == table.word_count(ranks, n_symbols)
    assert max(positions, default=0) * 8 + 8 <= lay.nbytes
    if errors:
        assert lay.errors_offset // 8 not in positions   # not a table word


# ---------------------------------------------------------------------------- its consumers agree

def test_the_view_locates_every_word():
    m = two_symbol_manifest()
    view = as_view(m)
    ranks = [s["rank"] for s in m["table"]["slots"]]
    assert [s.first_word for s in view.table.slots] == table.first_words(ranks)
    assert [s.words for s in view.table.slots] == [table.slot_words(r) for r in ranks]
    assert view.table.extents_first_word == table.word_count(ranks)
    assert view.table.words == table.word_count(ranks, len(m["symbols"])) == 32
    plan = calls.ShapePlan(view)
    assert plan.pointer_words == table.first_words(ranks)
    values = plan.resolve([(3, 50, 4), (3, 3)])
    assert len(plan.prepare([(3, 50, 4), (3, 3)]).words) == view.table.words
    assert plan.prepare([(3, 50, 4), (3, 3)]).words[view.table.extents_first_word:] == values


def test_the_validator_sizes_slots_by_the_layout():
    m = static_manifest()
    m["table"]["slots"][1]["offset"] = 64                 # out: [64, 104) > 96 bytes
    with pytest.raises(ManifestError, match=r"table.slots\[1\]: slot bytes \[64, 104\) exceed the table"):
        validate_manifest(m)


def test_inspect_reports_the_views_words(tmp_path):
    from grace.tools.inspect import describe

    with read_package(write_static(tmp_path / "m.grace")) as pkg:
        d = describe(pkg)["table"]
    assert [(s["first_word"], s["words"]) for s in d["slots"]] == [(0, 5), (5, 5)]
    assert d["words"] == N_WORDS and d["extents"]["first_word"] == N_WORDS


def test_the_table_writer_stores_at_the_layouts_positions():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from grace.aot.codegen import table_writer_source

    lay = table.pack([2, 0, 3], 2)
    slots = [{"name": f"t{i}", "role": "input", "offset": off, "rank": r}
             for i, (off, r) in enumerate(zip(lay.slot_offsets, [2, 0, 3]))]
    src = table_writer_source(slots, {"offset": lay.extents_offset, "count": 2}).source
    stores = [int(line.split("table + ")[1].split(",")[0]) for line in src.splitlines() if "tl.store" in line]
    assert stores == table.word_positions(zip(lay.slot_offsets, [2, 0, 3]), lay.extents_offset, 2)


# ---------------------------------------------------------------------------- the view's defaults

def test_optional_keys_get_their_spec_defaults():
    m = static_manifest()
    for k in m["kernels"]:
        for key in ("family", "num_stages", "hidden_params", "global_scratch_size", "profile_scratch_size"):
            k.pop(key, None)
    for node in m["graphs"][0]["nodes"]:
        node.pop("label")
    del m["arena_buffers"], m["producer"], m["options"]
    view = as_view(m)
    k = view.kernels[1]
    assert (k.family, k.num_stages, k.hidden_params, k.global_scratch_size, k.profile_scratch_size,
            k.writes, k.source, k.source_sha256) == (None, None, 0, 0, 0, None, None, None)
    node = view.graphs[0].nodes[1]
    assert node.programmatic == () and node.label is None and node.args[1].dtype is None
    assert view.table.errors_offset is None and view.index_checks == () and view.generate is None
    assert view.arena_buffers == () and view.producer == {} and view.options == {}
    assert view.graphs[0].stats == {}


def test_as_view_validates_a_dict_once():
    m = static_manifest()
    view = as_view(m)
    assert as_view(view) is view
    m["graphs"][0]["nodes"][1]["kernel"] = 7
    with pytest.raises(ManifestError, match=r"graphs\[0\].nodes\[1\].kernel: kernel 7 does not exist"):
        as_view(m)


def test_every_slot_belongs_to_an_input_or_an_output():
    m = static_manifest()
    m["outputs"] = []
    m["graphs"][0]["nodes"][1]["args"][2] = {"region": "table", "offset": 48, "nbytes": 8}
    with pytest.raises(ManifestError, match=r"table.slots\[1\]: belongs to no input or output"):
        validate_manifest(m)


# ---------------------------------------------------------------------------- no hidden_params

def _without_hidden_params(m: dict) -> dict:
    for k in m["kernels"]:
        del k["hidden_params"]
    return m


def test_runtime_runs_a_package_without_hidden_params(monkeypatch, tmp_path):
    pytest.importorskip("cuda.bindings.driver")
    fake = FakeDriver(n_params={"table_writer": 1 + N_WORDS})
    monkeypatch.setattr(driver, "_cu", fake)
    pkg = rt.load(write_static(tmp_path / "m.grace", _without_hidden_params(static_manifest())))
    sess = pkg.session()
    sess.run(np.ones((ROWS, COLS), np.float32))
    (_, _, _, _, w_params, _, _), (_, _, _, _, k_params, _, _) = fake.nodes
    assert read_params(k_params, 3) == [sess._table, pkg.weights_ptr, sess._table + 48]
    (launch,) = fake.launches   # the writer's parameters: the table, then the words, nothing after
    assert launch == [sess._table, sess._staging["x"], ROWS, COLS, COLS, 1,
                      sess._out_ptrs[0], ROWS, COLS, COLS, 1]
    assert [len(p.args) for p in pkg.plans[0]] == [1 + N_WORDS, 3]
    pkg.close()


def test_interpreter_runs_a_package_without_hidden_params(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    try:
        from helpers_handmade import handmade_contents, make_weights, reference
    except ImportError:
        from tests.helpers_handmade import handmade_contents, make_weights, reference
    from grace.tools.interpret import run_package

    manifest, sections = handmade_contents()
    write_package(tmp_path / "h.grace", _without_hidden_params(manifest), sections)
    pkg = read_package(tmp_path / "h.grace")
    assert all("hidden_params" not in k for k in pkg.manifest["kernels"])
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    out = run_package(pkg, {"x": x})["out"]
    np.testing.assert_allclose(out, reference(x, make_weights()), rtol=1e-6, atol=1e-6)
