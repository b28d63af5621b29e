"""Shape buckets in grace.runtime without a GPU (docs/design-buckets.md, "Runtime rules").

  * runtime/calls.py on its own: symbol resolution and its errors, graph selection, output shapes,
    table words (slot words, then symbol words), capacities;
  * load -> session -> run of a bucketed package against test_runtime_nogpu.FakeDriver: which graph
    is instantiated and launched, the words its table writer gets, lazy / eager instantiation, the
    lazily read shape of a data-dependent output, out=, and errors before any launch.

The kernels themselves (masking by the true extents) run in test_interpret.py (CPU) and
tests/gpu/test_runtime_handmade.py (GPU).
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

import grace.runtime as rt
from grace.runtime import driver, graph
from grace.runtime.errors import InputError, InvalidPackageError, StaleOutputError
from grace.runtime.calls import ShapePlan, compile_expr, table_words

try:
    from test_runtime_nogpu import CaiArray, FakeDriver, read_params
except ImportError:  # tests/ imported as a package
    from tests.test_runtime_nogpu import CaiArray, FakeDriver, read_params


# ------------------------------------------------------------------------ manifests for the tests

def make_manifest(symbols, inputs, outputs, buckets, arenas=None) -> dict:
    """A valid format-3.0 manifest (stateless) around the given shapes.

    `inputs` / `outputs`: [(name, shape)]; one table slot each (inputs first, 16-aligned), the
    extents words after the last slot. `buckets`: one {symbol: bound} per graph, named by its input
    symbols' bounds ("a=1,b=2").
    Kernel 0 is the table writer (every word, in order); kernel 1 reads every slot and the extents
    and writes the graph's arena (`arenas[i]` bytes, default 256). Binaries are fake bytes.
    """
    io = [(n, s, "input") for n, s in inputs] + [(n, s, "output") for n, s in outputs]
    offsets, end = [], 0
    for _, shape, _ in io:  # slots 16-aligned, back to back
        offsets.append(end)
        end = (end + 8 * (1 + 2 * len(shape)) + 15) // 16 * 16
    slot_words = sum(1 + 2 * len(s) for _, s, _ in io)
    ext_offset = max((off + 8 * (1 + 2 * len(s)) for off, (_, s, _) in zip(offsets, io)), default=0)
    ext_offset = (ext_offset + 7) // 8 * 8
    table_nbytes = (ext_offset + 8 * len(symbols) + 15) // 16 * 16
    n_words = slot_words + len(symbols)
    arenas = arenas or [256] * len(buckets)
    writer = {"name": "table_writer", "family": "table_writer", "num_warps": 1, "num_stages": 1, "shared": 0,
              "params": [{"name": "table", "type": "*i64"}] + [{"name": f"w{k}", "type": "i64"} for k in range(n_words)],
              "hidden_params": 2, "global_scratch_size": 0, "profile_scratch_size": 0,
              "binaries": {"sm_90": "cubin/table_writer.sm_90"}}
    body = {"name": "k_body", "family": "pointwise", "num_warps": 4, "num_stages": 1, "shared": 0,
            "params": [{"name": f"{n}_slot", "type": "*i64"} for n, _, _ in io]
            + [{"name": "ext", "type": "*i64"}, {"name": "t", "type": "*fp32"}],
            "hidden_params": 2, "global_scratch_size": 0, "profile_scratch_size": 0,
            "binaries": {"sm_90": "cubin/k_body.sm_90"}}

    def graph_of(bucket, arena):
        slots = [{"region": "table", "offset": off, "nbytes": 8 * (1 + 2 * len(s)), "dtype": "int64"}
                 for off, (_, s, _) in zip(offsets, io)]
        name = ",".join(f"{s['name']}={bucket[s['name']]}" for s in symbols if s["kind"] == "input")
        return {"name": name or "main", "bucket": bucket,
                "arena": arena, "nodes": [
                    {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
                     "args": [{"region": "table", "offset": 0, "nbytes": table_nbytes}]
                     + [{"word": w} for w in range(n_words)]},
                    {"kernel": 1, "grid": [1, 1, 1], "deps": [0], "label": "body",
                     "args": slots + [{"region": "table", "offset": ext_offset, "nbytes": 8 * len(symbols),
                                       "dtype": "int64"},
                                      {"region": "arena", "offset": 0, "nbytes": arena, "dtype": "float32"}]}]}

    return {
        "format_version": [3, 0], "producer": {"grace": "0.1.0"}, "model": {"name": "buckets"},
        "archs": ["sm_90"], "options": {}, "symbols": symbols,
        "inputs": [{"name": n, "dtype": "float32", "shape": list(s), "slot": i} for i, (n, s) in enumerate(inputs)],
        "outputs": [{"name": n, "dtype": "float32", "shape": list(s), "slot": len(inputs) + i}
                    for i, (n, s) in enumerate(outputs)],
        "table": {"nbytes": table_nbytes, "extents": {"offset": ext_offset, "count": len(symbols)},
                  "slots": [{"name": n, "role": role, "offset": off, "rank": len(s)}
                            for off, (n, s, role) in zip(offsets, io)]},
        "regions": {"weights": 0, "arena": max(arenas), "table": table_nbytes, "state": 0}, "state": [],
        "weights": [], "arena_buffers": [], "kernels": [writer, body],
        "graphs": [graph_of(b, a) for b, a in zip(buckets, arenas)],
    }


def sym(name, lo, hi, sources=()):
    return {"name": name, "kind": "input" if sources else "data", "min": lo, "max": hi,
            "sources": [list(s) for s in sources]}


def two_symbol_manifest() -> dict:
    """b in [1, 8] (x dim 0 and m dim 0), s in [1, 128] (x dim 1), data symbol k; four graphs listed
    out of cost order: products 1024, 256, 512, 512."""
    symbols = [sym("b", 1, 8, [(0, 0), (1, 0)]), sym("s", 1, 128, [(0, 1)]), sym("k", 0, 1024)]
    inputs = [("x", ["b", "s", 4]), ("m", ["b", 3])]
    outputs = [("y", ["b", "s", 4]), ("z", [["+", "s", 1], ["*", "b", 2]]), ("idx", ["k", 2])]
    buckets = [{"b": 8, "s": 128, "k": 1024}, {"b": 4, "s": 64, "k": 256}, {"b": 8, "s": 64, "k": 512},
               {"b": 4, "s": 128, "k": 512}]
    return make_manifest(symbols, inputs, outputs, buckets)


def test_test_manifests_are_valid_format_3():
    from grace.formats import validate_manifest

    validate_manifest(two_symbol_manifest())
    validate_manifest(one_symbol_manifest())


@pytest.fixture
def plan():
    return ShapePlan(two_symbol_manifest())


# ------------------------------------------------------------------------ resolution

def test_resolve_reads_every_symbol_and_leaves_data_symbols_zero(plan):
    assert plan.symbols == ["b", "s", "k"]
    assert plan.input_symbols == [0, 1] and plan.data_symbols == [2]
    assert plan.resolve([(3, 50, 4), (3, 3)]) == [3, 50, 0]
    assert plan.resolve([(8, 128, 4), (8, 3)]) == [8, 128, 0]
    assert plan.resolve([(1, 1, 4), (1, 3)]) == [1, 1, 0]


def test_resolve_static_package():
    p = ShapePlan(make_manifest([], [("x", [4, 8])], [("y", [4, 8])], [{}]))
    assert p.resolve([(4, 8)]) == []
    with pytest.raises(InputError, match=r"input 'x': shape is \[4, 9\], expected \[4, 8\] \(dim 1 must be 8\)"):
        p.resolve([(4, 9)])


@pytest.mark.parametrize("shapes, message", [
    # the sources of b disagree: both inputs and dims are named, with their sizes
    ([(3, 50, 4), (5, 3)], r"input 'm' dim 0 is 5, but input 'x' dim 0 is 3: both are symbol 'b' and must be equal"),
    # out of range: input, dim, symbol, range and the size given
    ([(9, 50, 4), (9, 3)], r"input 'x': dim 0 is 9, but symbol 'b' must be in \[1, 8\] \(shape \[9, 50, 4\], "
                           r"expected \[b, s, 4\]\)"),
    ([(2, 0, 4), (2, 3)], r"input 'x': dim 1 is 0, but symbol 's' must be in \[1, 128\]"),
    ([(2, 129, 4), (2, 3)], r"input 'x': dim 1 is 129, but symbol 's' must be in \[1, 128\]"),
    # static dims and ranks
    ([(2, 50, 5), (2, 3)], r"input 'x': shape is \[2, 50, 5\], expected \[b, s, 4\] \(dim 2 must be 4\)"),
    ([(2, 50, 4), (2, 4)], r"input 'm': shape is \[2, 4\], expected \[b, 3\] \(dim 1 must be 3\)"),
    ([(2, 50), (2, 3)], r"input 'x': rank is 2 \(shape \[2, 50\]\), expected rank 3 \(shape \[b, s, 4\]\)"),
])
def test_resolve_errors_name_what_is_wrong(plan, shapes, message):
    with pytest.raises(InputError, match=message):
        plan.resolve(shapes)


def test_sources_within_one_input_must_agree():
    p = ShapePlan(make_manifest([sym("n", 1, 16, [(0, 0), (0, 1)])], [("a", ["n", "n"])], [("y", ["n"])],
                                [{"n": 16}]))
    assert p.resolve([(5, 5)]) == [5]
    with pytest.raises(InputError, match=r"input 'a' dim 1 is 6, but input 'a' dim 0 is 5: both are symbol 'n'"):
        p.resolve([(5, 6)])


# ------------------------------------------------------------------------ selection

@pytest.mark.parametrize("b, s, name", [
    (3, 50, "b=4,s=64"), (4, 64, "b=4,s=64"), (1, 1, "b=4,s=64"),
    (5, 50, "b=8,s=64"), (3, 65, "b=4,s=128"), (5, 65, "b=8,s=128"),
    (8, 128, "b=8,s=128"),
])
def test_select_takes_the_smallest_covering_bucket(plan, b, s, name):
    assert plan.graph_names[plan.select(plan.resolve([(b, s, 4), (b, 3)]))] == name


def test_select_first_graph_wins_ties():
    buckets = [{"a": 2, "c": 64}, {"a": 4, "c": 32}, {"a": 8, "c": 16}]  # all cost 128
    p = ShapePlan(make_manifest([sym("a", 1, 8, [(0, 0)]), sym("c", 1, 64, [(0, 1)])], [("x", ["a", "c"])],
                                [("y", ["a", "c"])], buckets))
    assert p.select([1, 1]) == 0
    assert p.select([3, 10]) == 1
    assert p.select([5, 10]) == 2


def test_select_with_no_covering_graph_is_an_input_error():
    # buckets that do not reach the range maximum (a hand-written package may do that)
    p = ShapePlan(make_manifest([sym("n", 1, 64, [(0, 0)])], [("x", ["n"])], [("y", ["n"])],
                                [{"n": 16}, {"n": 32}]))
    assert p.select([32]) == 1
    with pytest.raises(InputError, match=r"no graph of this package serves n=33 \(its graphs: n=16, n=32\)"):
        p.select([33])


def test_static_package_always_selects_its_graph():
    p = ShapePlan(make_manifest([], [("x", [4])], [("y", [4])], [{}]))
    assert p.select(p.resolve([(4,)])) == 0 and p.describe([]) == "static shapes"


# ------------------------------------------------------------------------ outputs, words, sizes

def test_output_shapes_evaluate_expressions_and_use_the_bound_for_data_symbols(plan):
    values = plan.resolve([(3, 50, 4), (3, 3)])
    g = plan.select(values)
    assert plan.output_shapes(values, g) == [(3, 50, 4), (51, 6), (256, 2)]  # idx: k at this graph's bound
    assert plan.data_symbols_of(2) == (2,) and plan.data_symbols_of(0) == ()
    assert plan.output_shape(2, [3, 50, 17]) == (17, 2)  # once k is known


def test_table_words_are_slot_words_then_symbol_words(plan):
    values = plan.resolve([(3, 50, 4), (3, 3)])
    out_shapes = plan.output_shapes(values, plan.select(values))
    slots = plan.slot_shapes([(3, 50, 4), (3, 3)], out_shapes)
    words = table_words([10, 20, 30, 40, 50], slots, values)
    assert words == [10, 3, 50, 4, 200, 4, 1,      # x
                     20, 3, 3, 3, 1,               # m
                     30, 3, 50, 4, 200, 4, 1,      # y
                     40, 51, 6, 6, 1,              # z = [s + 1, b * 2]
                     50, 256, 2, 2, 1,             # idx: allocated rows (k's bound), strides exact
                     3, 50, 0]                     # symbols b, s, k (data: 0, a kernel writes it)
    assert len(words) == graph.table_word_count(two_symbol_manifest())


def test_capacities_cover_the_largest_graph(plan):
    assert [plan.output_capacity(o) for o in range(3)] == [8 * 128 * 4, 129 * 16, 1024 * 2]
    assert plan.input_capacity(0) == 8 * 128 * 4 and plan.input_capacity(1) == 8 * 3
    assert plan.bounds(1) == [4, 64, 256]


def test_an_expression_that_shrinks_as_its_symbol_grows_is_checked_against_its_buffer():
    p = ShapePlan(make_manifest([sym("n", 1, 64, [(0, 0)])], [("x", ["n"])],
                                [("y", [["-", 64, "n"], 2])],
                                [{"n": 16}, {"n": 32}, {"n": 64}]))
    assert p.output_capacity(0) == 48 * 2
    assert p.output_shapes([20], 1)[0] == (44, 2)
    with pytest.raises(InvalidPackageError, match=r"output 'y' has shape \[63, 2\] at n=1, more than the 96"):
        p.output_shapes([1], 0)
    negative = ShapePlan(make_manifest([sym("n", 1, 64, [(0, 0)])], [("x", ["n"])], [("z", [["-", "n", 2]])],
                                       [{"n": 64}]))
    with pytest.raises(InputError, match=r"output 'z' would have shape \[-1\] \(\[n - 2\] at n=1\)"):
        negative.output_shapes([1], 0)


def test_prepare_caches_the_shape_work_of_each_size_combination(plan):
    a = plan.prepare([(3, 50, 4), (3, 3)])
    assert a.graph == 1 and a.values == [3, 50, 0] and a.output_shapes[0] == (3, 50, 4)
    assert a.words[plan.pointer_words[0]] == 0 and len(a.words) == 32
    assert plan.prepare([(3, 50, 4), (3, 3)]) is a                 # same sizes: the cached Call
    assert plan.prepare([(3, 51, 4), (3, 3)]).values == [3, 51, 0]  # other sizes: a new one
    with pytest.raises(InputError, match="must be equal"):         # inputs are checked every call
        plan.prepare([(3, 50, 4), (4, 3)])
    for s in range(1, plan.CACHE_SIZE + 2):                         # bounded: the oldest goes
        plan.prepare([(1, s % 128 + 1, 4), (1, 3)])
    assert len(plan._calls) <= plan.CACHE_SIZE


def uncached(plan, shapes):
    """What prepare() computes, from the public steps, without any cache."""
    values = plan.resolve(shapes)
    g = plan.select(values)
    out_shapes = plan.output_shapes(values, g)
    words = table_words([0] * len(plan.pointer_words), plan.slot_shapes(shapes, out_shapes), values)
    return values, g, out_shapes, words


def test_the_cached_call_is_the_uncached_one_for_every_size(plan):
    """Twice over every size combination (the second pass from the cache): the same values, graph,
    output shapes and words as the steps computed from scratch."""
    sizes = [(b, s) for b in (1, 3, 4, 5, 8) for s in (1, 2, 63, 64, 65, 127, 128)]
    for _ in range(2):
        for b, s in sizes:
            shapes = [(b, s, 4), (b, 3)]
            call = plan.prepare(shapes)
            assert (call.values, call.graph, call.output_shapes, call.words) == uncached(plan, shapes)
    assert len(plan._calls) == len(sizes)


def test_different_sizes_select_different_graphs_through_the_cache(plan):
    """Graphs in cost order b=4,s=64 (1), b=8,s=64 (2), b=4,s=128 (3), b=8,s=128 (0); each size
    keeps its own graph however the calls interleave."""
    expect = {(4, 64): 1, (5, 64): 2, (4, 65): 3, (5, 65): 0, (1, 1): 1, (8, 128): 0}
    for _ in range(3):
        for (b, s), g in expect.items():
            call = plan.prepare([(b, s, 4), (b, 3)])
            assert call.graph == g and call.output_shapes[0] == (b, s, 4)
            assert call.words[-3:] == [b, s, 0]   # the symbol words: b, s, and k (computed on the device)


@pytest.mark.parametrize("shapes, message", [
    ([(3, 50, 4), (4, 3)], "must be equal"),
    ([(9, 50, 4), (9, 3)], r"dim 0 is 9, but symbol 'b' must be in \[1, 8\]"),
    ([(3, 50, 5), (3, 3)], r"shape is \[3, 50, 5\], expected \[b, s, 4\] \(dim 2 must be 4\)"),
    ([(3, 50), (3, 3)], "rank is 2"),
])
def test_bad_shapes_raise_every_time_and_are_not_remembered(plan, shapes, message):
    good = plan.prepare([(3, 50, 4), (3, 3)])
    for _ in range(3):
        with pytest.raises(InputError, match=message):
            plan.prepare(shapes)
    assert list(plan._calls) == [((3, 50, 4), (3, 3))]
    assert plan.prepare([(3, 50, 4), (3, 3)]) is good


def test_shapes_given_as_lists_share_the_tuples_entry(plan):
    a = plan.prepare([(3, 50, 4), (3, 3)])
    assert plan.prepare([[3, 50, 4], [3, 3]]) is a
    assert plan.prepare(([np.int64(3), 50, 4], (3, 3))) is a   # numpy ints equal Python ints
    assert len(plan._calls) == 1


def test_a_full_cache_drops_its_oldest_entry(plan, monkeypatch):
    monkeypatch.setattr(ShapePlan, "CACHE_SIZE", 3)
    first = plan.prepare([(1, 1, 4), (1, 3)])
    for s in (2, 3):
        plan.prepare([(1, s, 4), (1, 3)])
    assert plan.prepare([(1, 1, 4), (1, 3)]) is first   # a hit: no reordering, no eviction
    plan.prepare([(1, 4, 4), (1, 3)])
    assert [key[0][1] for key in plan._calls] == [2, 3, 4]
    again = plan.prepare([(1, 1, 4), (1, 3)])
    assert again is not first and again == first          # computed again, the same


def test_pointer_words_index_each_slot():
    p = ShapePlan(make_manifest([], [("x", [2, 3, 4]), ("m", [5])], [("y", [])], [{}]))
    assert p.pointer_words == [0, 7, 10]


def test_word_runs_group_consecutive_parameters():
    assert graph.word_runs([(1 + w, w) for w in range(17)]) == [(1, 0, 17)]   # a table writer
    assert graph.word_runs([(2, 5), (3, 6), (5, 0), (6, 9)]) == [(2, 5, 7), (5, 0, 1), (6, 9, 10)]
    assert graph.word_runs([]) == []


def test_compiled_expressions_agree_with_grace_formats():
    from grace.formats.shapes import SHAPE_OPS, eval_shape_expr

    rng = random.Random(0)
    names = ["a", "b", "c"]

    def expr(depth):
        r = rng.random()
        if depth == 0 or r < 0.3:
            return rng.choice(names) if rng.random() < 0.6 else rng.randint(0, 9)
        op = rng.choice(SHAPE_OPS)
        rhs = expr(depth - 1)
        if op == "//":
            rhs = ["max", rhs, 1]  # no division by zero
        return [op, expr(depth - 1), rhs]

    index = {n: i for i, n in enumerate(names)}
    for _ in range(500):
        e = expr(4)
        values = [rng.randint(0, 50) for _ in names]
        compiled = compile_expr(e, index)
        got = compiled if isinstance(compiled, int) else compiled(values)
        assert got == eval_shape_expr(e, dict(zip(names, values))), e


# ------------------------------------------------------------------------ sessions (FakeDriver)

N_MAX, COLS = 64, 8
BUCKETS = (16, 32, 64)


def one_symbol_manifest() -> dict:
    """x[n, 8] -> out[n, 8], head[k, 8] (k a data symbol); n in [1, 64]; graphs n=16, 32, 64 whose
    arenas grow with the bound. Table: x at 0, out at 48, head at 96, extents at 136 (n, k)."""
    return make_manifest([sym("n", 1, N_MAX, [(0, 0)]), sym("k", 0, N_MAX)], [("x", ["n", COLS])],
                         [("out", ["n", COLS]), ("head", ["k", COLS])],
                         [{"n": b, "k": b} for b in BUCKETS], arenas=[b * COLS * 4 for b in BUCKETS])


N_WORDS = 3 * 5 + 2
EXTENTS = 136


@pytest.fixture
def fake(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")
    f = FakeDriver(n_params={"table_writer": 1 + N_WORDS + 2})
    f.copies_dtoh = 0
    real_dtoh = f.cuMemcpyDtoH

    def counting_dtoh(dst, src, n):
        f.copies_dtoh += 1
        return real_dtoh(dst, src, n)

    f.cuMemcpyDtoH = counting_dtoh
    monkeypatch.setattr(driver, "_cu", f)
    return f


def write(path, m):
    from grace.formats import write_package

    write_package(path, m, {"cubin/table_writer.sm_90": b"\x7fELF fake writer", "cubin/k_body.sm_90": b"\x7fELF fake"})
    return path


@pytest.fixture
def path(tmp_path):
    return write(tmp_path / "buckets.grace", one_symbol_manifest())


@pytest.fixture
def pkg(fake, path):
    p = rt.load(path)
    yield p
    p.close()


def device_x(n):
    """A fake-device input of n rows (CAI, so it is used in place)."""
    return CaiArray(driver.mem_alloc(n * COLS * 4), (n, COLS))


def writer_words(fake):
    """The table words of the last launch (the writer's parameters minus the table pointer and the
    two hidden scratch pointers)."""
    return fake.launches[-1][1:-2]


def launched_graph(fake, sess):
    """The name of the graph whose exec the last launch used."""
    exec_handle, _ = fake.launched[-1]
    for name, g in zip(sess._package.graph_names, sess._graphs):
        if g is not None and int(g.exec) == exec_handle:
            return name
    raise AssertionError("launched an exec the session does not own")


def test_load_plans_every_graph_with_its_own_arena(pkg):
    assert pkg.graph_names == ["n=16", "n=32", "n=64"]
    assert [len(p) for p in pkg.plans] == [2, 2, 2]
    assert [p[1].args[-3] for p in pkg.plans] == [("region", "arena", 0)] * 3


def test_each_call_launches_the_smallest_bucket_with_the_true_sizes(fake, pkg):
    sess = pkg.session()
    for n, name in [(1, "n=16"), (16, "n=16"), (17, "n=32"), (33, "n=64"), (64, "n=64"), (5, "n=16")]:
        x = device_x(n)
        outs = sess.run(x)
        assert sess.last_graph == name and launched_graph(fake, sess) == name
        bound = int(name[2:])
        ptr_x, ptr_out, ptr_head = x.__cuda_array_interface__["data"][0], sess._out_ptrs[0], sess._out_ptrs[1]
        assert writer_words(fake) == [ptr_x, n, COLS, COLS, 1,
                                      ptr_out, n, COLS, COLS, 1,
                                      ptr_head, bound, COLS, COLS, 1,   # head: allocated rows
                                      n, 0]                             # symbols n, k
        assert outs["out"].shape == (n, COLS)
    assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1}
    assert len(fake.instantiated) == 3 and fake.copies_dtoh == 0  # run() never reads the device


def test_lazy_instantiation_builds_only_the_graphs_used(fake, pkg):
    sess = pkg.session()
    assert sess.instantiations == {} and fake.nodes == []
    for n in (3, 9, 16, 12):
        sess.run(device_x(n))
    assert sess.instantiations == {"n=16": 1}
    sess.run(device_x(20))
    assert sess.instantiations == {"n=16": 1, "n=32": 1}


def test_eager_instantiation_builds_every_graph_with_the_session(fake, path):
    pkg = rt.load(path, instantiate="eager")
    sess = pkg.session()
    assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1}
    grids = [n[1] for n in fake.nodes]
    assert len(grids) == 6
    for n in (1, 30, 64):
        sess.run(device_x(n))
    assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1} and len(fake.instantiated) == 3
    pkg.close()


def test_one_arena_and_output_buffers_for_the_largest_graph(fake, pkg):
    sess = pkg.session()
    sizes = {addr: n for addr, (_, n) in fake.memory.items()}
    assert sizes[sess._arena] == 64 * COLS * 4
    assert [sizes[p] for p in sess._out_ptrs] == [64 * COLS * 4, 64 * COLS * 4]
    # every graph's arena arguments point into that one arena
    sess.run(device_x(40))
    sess.run(device_x(2))
    body_nodes = [n for n in fake.nodes if n[0] == "k_body"]
    assert {read_params(n[4], 7)[4] for n in body_nodes} == {sess._arena}


def test_numpy_inputs_are_staged_in_one_buffer_sized_for_the_largest_bucket(fake, pkg):
    sess = pkg.session()
    x = np.arange(5 * COLS, dtype=np.float32).reshape(5, COLS)
    sess.run(x)
    staging = sess._staging["x"]
    assert fake.memory[staging][1] == N_MAX * COLS * 4
    sess.run(np.ones((64, COLS), np.float32))
    assert sess._staging["x"] == staging and writer_words(fake)[:2] == [staging, 64]
    np.testing.assert_array_equal(np.ctypeslib.as_array((ctypes.c_float * (64 * COLS)).from_address(staging)), 1)


def _set_k(sess, k):
    """Play the kernel that computes the data symbol k: write its extents word in the table."""
    ctypes.c_int64.from_address(sess._table + EXTENTS + 8).value = k


def test_a_data_dependent_output_reads_its_size_from_the_table_on_first_use(fake, pkg):
    sess = pkg.session()
    outs = sess.run(device_x(20))
    _set_k(sess, 7)
    head = outs["head"]
    assert "unread" in repr(head) and fake.copies_dtoh == 0
    assert head.shape == (7, COLS) and fake.copies_dtoh == 1
    rows = np.arange(7 * COLS, dtype=np.float32).reshape(7, COLS)
    ctypes.memmove(sess._out_ptrs[1], rows.ctypes.data, rows.nbytes)
    np.testing.assert_array_equal(head.numpy(), rows)
    assert head.__cuda_array_interface__["shape"] == (7, COLS)
    assert fake.copies_dtoh == 2  # the values; the shape was read once
    assert outs["out"].shape == (20, COLS)  # known at launch, no read

    later = sess.run(device_x(3))
    with pytest.raises(StaleOutputError):
        head.shape
    _set_k(sess, 0)
    assert later["head"].shape == (0, COLS) and later["head"].numpy().shape == (0, COLS)


def test_a_data_symbol_outside_its_bound_is_reported(fake, pkg):
    sess = pkg.session()
    head = sess.run(device_x(20))["head"]
    _set_k(sess, 33)  # graph n=32 bounds k at 32
    with pytest.raises(InvalidPackageError, match=r"data symbol 'k' is 33 after graph 'n=32' ran, outside \[0, 32\]"):
        head.shape


def test_out_arrays_must_have_this_calls_shape(fake, pkg):
    sess = pkg.session()
    target = CaiArray(driver.mem_alloc(64 * COLS * 4), (12, COLS))
    result = sess.run(device_x(12), out={"out": target})
    assert result["out"] is target and writer_words(fake)[5:7] == [target.__cuda_array_interface__["data"][0], 12]
    with pytest.raises(InputError, match=r"output 'out' \(out=\): shape is \[12, 8\], expected \[13, 8\]"):
        sess.run(device_x(13), out={"out": target})
    with pytest.raises(InputError, match=r"output 'head' \(out=\): its dim 0 is data-dependent"):
        sess.run(device_x(12), out={"head": target})


@pytest.mark.parametrize("x, message", [
    (np.zeros((0, COLS), np.float32), r"input 'x': dim 0 is 0, but symbol 'n' must be in \[1, 64\]"),
    (np.zeros((65, COLS), np.float32), r"input 'x': dim 0 is 65, but symbol 'n' must be in \[1, 64\]"),
    (np.zeros((5, COLS + 1), np.float32), r"input 'x': shape is \[5, 9\], expected \[n, 8\] \(dim 1 must be 8\)"),
    (np.zeros((5,), np.float32), r"input 'x': rank is 1"),
    (np.zeros((5, COLS), np.float64), r"input 'x': dtype is float64"),
])
def test_bad_sizes_fail_before_anything_is_enqueued(fake, pkg, x, message):
    sess = pkg.session()
    with pytest.raises(InputError, match=message):
        sess.run(x)
    assert fake.launches == [] and sess._staging == {} and sess.instantiations == {} and sess.last_graph is None


def expected_words(sess, x_ptr, n, out_ptr=None):
    bound = next(b for b in BUCKETS if n <= b)
    return [x_ptr, n, COLS, COLS, 1, out_ptr or sess._out_ptrs[0], n, COLS, COLS, 1,
            sess._out_ptrs[1], bound, COLS, COLS, 1, n, 0]


def test_setparams_only_when_the_words_change(fake, pkg):
    """The same buffer at the same size: the table writer keeps the parameters set by the first
    call and runs with them (the fake launches with the values the driver copied, not the runtime's
    cells). A new pointer or a new size inside the same graph sets them again."""
    sess = pkg.session()
    a, b = device_x(64), device_x(64)
    view = lambda x, n: CaiArray(x.__cuda_array_interface__["data"][0], (n, COLS))  # noqa: E731
    ptr = lambda x: x.__cuda_array_interface__["data"][0]  # noqa: E731
    steps = [(a, 20, True), (a, 20, False), (a, 20, False),   # same pointer, same size: once
             (b, 20, True), (b, 20, False),                   # another pointer
             (b, 21, True), (b, 21, False),                   # another size, the same graph n=32
             (a, 21, True), (a, 20, True), (a, 20, False)]
    for x, n, sets in steps:
        before = len(fake.set_params)
        sess.run(view(x, n))
        assert len(fake.set_params) - before == (1 if sets else 0), (ptr(x), n)
        assert sess.last_graph == "n=32" and writer_words(fake) == expected_words(sess, ptr(x), n)
    assert sess.instantiations == {"n=32": 1}


def test_graphs_that_alternate_keep_their_own_words(fake, pkg):
    """The table is the session's, shared by its graphs, but each graph's table writer rewrites it
    from its own parameters at every launch: after one SetParams each, graphs n=16 and n=32 take
    turns without another, each launching with its own words."""
    sess = pkg.session()
    x = device_x(64)
    ptr = x.__cuda_array_interface__["data"][0]
    for k in range(6):
        n = (5, 20, 40)[k % 3]
        before = len(fake.set_params)
        sess.run(CaiArray(ptr, (n, COLS)))
        assert len(fake.set_params) - before == (1 if k < 3 else 0)
        assert sess.last_graph == f"n={next(b for b in BUCKETS if n <= b)}" == launched_graph(fake, sess)
        assert writer_words(fake) == expected_words(sess, ptr, n)


def test_out_arrays_and_numpy_inputs_set_the_words_they_change(fake, pkg):
    sess = pkg.session()
    x = device_x(12)
    ptr = x.__cuda_array_interface__["data"][0]
    target = CaiArray(driver.mem_alloc(64 * COLS * 4), (12, COLS))
    target_ptr = target.__cuda_array_interface__["data"][0]
    for out, sets in ((None, True), ({"out": target}, True), ({"out": target}, False), (None, True)):
        before = len(fake.set_params)
        sess.run(x, out=out)
        assert len(fake.set_params) - before == (1 if sets else 0)
        assert writer_words(fake) == expected_words(sess, ptr, 12, out and target_ptr)
    host = np.ones((12, COLS), np.float32)
    for sets in (True, False):   # the staging buffer: the same pointer every call
        before = len(fake.set_params)
        sess.run(host)
        assert len(fake.set_params) - before == (1 if sets else 0)
        assert writer_words(fake) == expected_words(sess, sess._staging["x"], 12)


def test_a_failed_setparams_is_tried_again(fake, pkg, monkeypatch):
    """Words are remembered only once the driver took them."""
    from grace.runtime.errors import GraceRuntimeError

    sess = pkg.session()
    x = device_x(20)
    real = fake.cuGraphExecKernelNodeSetParams
    monkeypatch.setattr(fake, "cuGraphExecKernelNodeSetParams",
                        lambda e, node, p: (fake._real.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(GraceRuntimeError, match="cuGraphExecKernelNodeSetParams"):
        sess.run(x)
    monkeypatch.setattr(fake, "cuGraphExecKernelNodeSetParams", real)
    before = len(fake.set_params)
    sess.run(x)
    assert len(fake.set_params) == before + 1
    assert writer_words(fake) == expected_words(sess, x.__cuda_array_interface__["data"][0], 20)


def test_run_host_overhead_is_small(fake, pkg):
    """Not a benchmark (the fake driver is Python): a guard against per-call work creeping into
    run(). The GPU run measures the real number (docs/performance.md)."""
    import time

    sess = pkg.session()
    x = device_x(20)
    for _ in range(50):
        sess.run(x)
    t = time.perf_counter()
    for _ in range(500):
        sess.run(x)
    per_call_us = (time.perf_counter() - t) / 500 * 1e6
    assert per_call_us < 200, per_call_us


def test_the_handmade_bucket_package_through_the_fake_driver(monkeypatch, tmp_path):
    """tests/helpers_handmade.py's bucket package (real cubins, as the GPU test loads it): the
    runtime's view of its table matches the kernels' (slot words, then n and k at the extents)."""
    pytest.importorskip("triton")
    try:
        from helpers_handmade import B_COLS, build_bucket_package
    except ImportError:
        from tests.helpers_handmade import B_COLS, build_bucket_package

    path = build_bucket_package(tmp_path / "handmade.grace", data_output=True)
    fake = FakeDriver(n_params={"table_writer": 1 + 17 + 2})
    monkeypatch.setattr(driver, "_cu", fake)
    pkg = rt.load(path)
    try:
        assert pkg.graph_names == ["n=16", "n=32", "n=64"]
        assert [p[1].grid for p in pkg.plans] == [(1, 1, 1), (2, 1, 1), (4, 1, 1)]  # kb_scale: bound / 16
        sess = pkg.session()
        outs = sess.run(np.ones((20, B_COLS), np.float32))
        assert sess.last_graph == "n=32"
        staging, out, head = sess._staging["x"], *sess._out_ptrs
        assert fake.launches[-1][1:-2] == [staging, 20, 8, 8, 1, out, 20, 8, 8, 1, head, 32, 8, 8, 1, 20, 0]
        ext = pkg.manifest["table"]["extents"]["offset"]
        ctypes.c_int64.from_address(sess._table + ext + 8).value = 11  # what kb_count would write
        assert outs["head"].shape == (11, B_COLS) and outs["out"].shape == (20, B_COLS)
    finally:
        pkg.close()
