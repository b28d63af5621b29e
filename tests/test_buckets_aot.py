"""Compiler side of shape buckets: symbols, bucket lists, extents through views, and what the
package records. Numerics at many sizes are in test_buckets_interpret.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import sympy  # noqa: E402
from torch.export import Dim  # noqa: E402

from grace.aot import check as grace_check  # noqa: E402
from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import extents  # noqa: E402
from grace.aot.lower import LoweringError  # noqa: E402
from grace.formats import read_package  # noqa: E402
from grace.tools import models  # noqa: E402

S = sympy.Symbol("s0", positive=True, integer=True)
B = sympy.Symbol("s1", positive=True, integer=True)


def test_default_buckets_are_powers_of_two_ending_at_the_max():
    assert extents.default_buckets(1, 512) == [1, 16, 32, 64, 128, 256, 512]
    assert extents.default_buckets(1, 100) == [1, 16, 32, 64, 100]
    assert extents.default_buckets(40, 100) == [64, 100]
    assert extents.default_buckets(1, 8) == [1, 8]
    assert extents.default_buckets(2, 512) == [16, 32, 64, 128, 256, 512]
    assert extents.default_buckets(0, 64) == [16, 32, 64]   # no 1: it would also serve size 0


def _bound_one_cases():
    seq, batch = Dim("seq", min=1, max=64), Dim("batch", min=1, max=8)
    return {
        "bert_dynamic_seq": (models.hf_bert(max_pos=64), (torch.randint(0, 128, (1, 9)),),
                             {"input_ids": {1: seq}}, {"seq": [1, 64]}),
        "vit_dynamic_batch": (models.TinyViT(), (torch.randn(2, 3, 32, 32),), {"x": {0: batch}},
                              {"batch": [1, 8]}),
        "llama_batch2_dynamic_seq": (models.LlamaBlock(max_seq=64), (torch.randn(2, 17, 64),),
                                     {"x": {1: seq}}, {"seq": [1, 64]}),
    }


@pytest.mark.parametrize("name", sorted(_bound_one_cases()))
def test_common_models_lower_at_a_bucket_of_one(name):
    """A default bucket of 1 (a batch of 1 not paying for 16): these models lower with a dynamic
    dimension at bound 1, as a static program (its one size), beside their other buckets."""
    torch.manual_seed(0)
    model, args, dynamic, buckets = _bound_one_cases()[name]
    report = grace_check(model.eval(), args, dynamic_shapes=dynamic, buckets=buckets, codegen=False)
    assert report.ok, report.format()


def test_bucket_overrides_are_checked():
    sym = extents.Symbol("seq", S, 1, 300, ((0, 1),))
    assert extents.bucket_lists([sym], {"seq": [64, 512]}) == {"seq": [64, 300]}
    with pytest.raises(extents.ShapeError, match="dynamic dimensions are: seq"):
        extents.bucket_lists([sym], {"len": [64]})
    with pytest.raises(extents.ShapeError, match="below the exported maximum 300"):
        extents.bucket_lists([sym], {"seq": [64, 128]})


def test_symbol_names_are_the_dims_else_input_dot_dim_in_check_as_in_compile():
    """A module exported by grace (check or compile with dynamic_shapes) names a symbol after its
    Dim; an ExportedProgram (a .pt2 for the CLI) after its first input dim, `x.0`. The names
    --buckets / buckets= take are those, and an unknown one lists them."""
    batch = Dim("batch", min=2, max=16)
    model, x = models.MLP().eval(), torch.randn(4, 64)
    assert grace_check(model, (x,), dynamic_shapes={"x": {0: batch}}, buckets={"batch": [8, 16]},
                       codegen=False).ok
    wrong = grace_check(model, (x,), dynamic_shapes={"x": {0: batch}}, buckets={"x.0": [8, 16]},
                        codegen=False)
    assert not wrong.ok and "dynamic dimensions are: batch" in wrong.problems[0].reasons[0]
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}})
    assert grace_check(ep, buckets={"x.0": [8, 16]}, codegen=False).ok
    wrong = grace_check(ep, buckets={"batch": [8, 16]}, codegen=False)
    assert not wrong.ok and "dynamic dimensions are: x.0" in wrong.problems[0].reasons[0]


def test_combinations_are_the_product_of_bucket_lists():
    a = extents.Symbol("seq", S, 1, 64, ((0, 1),))
    b = extents.Symbol("batch", B, 1, 4, ((0, 0),))
    combos = extents.combinations([a, b], {"seq": [32, 64], "batch": [2, 4]})
    assert combos == [{"seq": 32, "batch": 2}, {"seq": 32, "batch": 4},
                      {"seq": 64, "batch": 2}, {"seq": 64, "batch": 4}]


def test_regroup_keeps_dynamic_factors_whole():
    seq = ((32, S),)
    # [S, 64] -> [S*64]: one dimension, the dynamic factor outermost (a prefix)
    merged = extents.regroup((32, 64), (seq, None), (32 * 64,))
    assert merged == (((32, S), (64, 64)),)
    assert extents.is_prefix(merged[0])
    # [B, S] -> [B*S]: valid rows are not a prefix, both factors are kept
    both = extents.regroup((4, 32), (((4, B),), seq), (128,))
    assert both == (((4, B), (32, S)),) and not extents.is_prefix(both[0])
    # and split back
    assert extents.regroup((128,), both, (4, 32)) == (((4, B),), seq)
    # static factors split freely around it: [S, 64] -> [S, 4, 16]
    assert extents.regroup((32, 64), (seq, None), (32, 4, 16)) == (seq, None, None)
    with pytest.raises(extents.ShapeError, match="split the dynamic"):
        extents.regroup((32, 64), (seq, None), (16, 128))


def test_manifest_shape_expressions():
    names = {S: "seq", B: "batch"}
    assert extents.to_manifest(S, names) == "seq"
    assert extents.to_manifest(S * 64, names) in (["*", 64, "seq"], ["*", "seq", 64])
    assert extents.to_manifest(S - 1, names) == ["-", "seq", 1]


def _compile_llama(tmp_path, **kw):
    torch.manual_seed(0)
    model = models.LlamaBlock().eval()
    return grace_compile(model, (torch.randn(1, 17, 64),), output=tmp_path / "llama.grace",
                         progress=False,
                         dynamic_shapes={"x": {1: Dim("seq", min=1, max=128)}}, **kw)


def test_dynamic_package_records_symbols_buckets_and_graphs(tmp_path):
    pkg = read_package(_compile_llama(tmp_path, buckets={"seq": [32, 128]}))
    m = pkg.manifest
    assert m["symbols"] == [{"name": "seq", "kind": "input", "min": 1, "max": 128,
                             "sources": [[0, 1]]}]
    assert m["inputs"][0]["shape"] == [1, "seq", 64]
    assert m["outputs"][0]["shape"] == [1, "seq", 64]
    assert [g["bucket"] for g in m["graphs"]] == [{"seq": 32}, {"seq": 128}]
    assert m["graphs"][0]["arena"] < m["graphs"][1]["arena"] <= m["regions"]["arena"]
    assert m["table"]["extents"]["count"] == 1
    assert m["options"]["buckets"] == {"seq": [32, 128]}
    # every kernel of every graph is passed the extents words (the true length), read from the
    # manifest's arguments rather than by counting lines of generated source
    ext = m["table"]["extents"]
    words = {"region": "table", "offset": ext["offset"], "nbytes": 8 * ext["count"], "dtype": "int64"}
    for g in m["graphs"]:
        assert all(words in node["args"] for node in g["nodes"][1:]), g["name"]


def test_unsupported_dynamic_patterns_are_clear_errors(tmp_path):
    class CatSeq(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x], dim=1)

    with pytest.raises(LoweringError, match="concatenation along a dynamic dimension.*cat"):
        grace_compile(CatSeq(), (torch.randn(1, 17, 8),), output=tmp_path / "c.grace",
                      progress=False, dynamic_shapes={"x": {1: Dim("seq", min=2, max=64)}})


def test_unknown_bucket_name_is_an_error(tmp_path):
    with pytest.raises(LoweringError, match="dynamic dimensions are: seq"):
        _compile_llama(tmp_path, buckets={"length": [64, 128]})


def test_data_dependent_sizes_become_data_symbols(tmp_path):
    class NonZero(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0)

    path = grace_compile(NonZero(), (torch.randn(4, 6),), output=tmp_path / "nz.grace",
                         progress=False)
    m = read_package(path).manifest
    assert m["symbols"] == [{"name": "u0", "kind": "data", "min": 0, "max": 24, "sources": []}]
    assert m["outputs"][0]["shape"] == ["u0", 2]
    assert m["graphs"][0]["bucket"] == {"u0": 24}
    assert "compact" in [k["family"] for k in m["kernels"]]


# ---- patterns the bucket layout cannot serve are refused at compile time -----------------------
class _GatherMerged(torch.nn.Module):
    def forward(self, x, idx):
        return x.reshape(-1, 4)[idx]


class _SelectMerged(torch.nn.Module):
    def forward(self, x):
        return x.reshape(-1)[3] + x.sum()


class _MixedLayouts(torch.nn.Module):
    def forward(self, x):
        f = x.reshape(-1)
        return (f + torch.arange(f.shape[0])).sum()


class _NonzeroMerged(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x.reshape(-1) > 0)


class _DynamicOffset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(128, 4))

    def forward(self, cache, x):
        p = cache.shape[0]
        return x + self.table[p:p + 1]


@pytest.mark.parametrize("model, args, shapes, message", [
    (_GatherMerged(), (torch.randn(2, 8, 4), torch.tensor([0, 5])), ({1: Dim("s", max=64)}, None),
     "merges dynamic dimensions"),
    (_SelectMerged(), (torch.randn(2, 8),), ({1: Dim("s", max=64)},), "merges dynamic ones"),
    (_MixedLayouts(), (torch.randn(2, 8),), ({1: Dim("s", max=64)},), "laid out differently"),
    (_NonzeroMerged(), (torch.randn(2, 8),), ({1: Dim("s", max=64)},), "merges dynamic"),
    (_DynamicOffset(), (torch.randn(5, 4), torch.randn(1, 4)), ({0: Dim("p", max=100)}, None),
     "dynamic offset"),
], ids=["gather_merged", "select_merged", "mixed_layouts", "nonzero_merged", "dynamic_offset"])
def test_layout_dependent_patterns_are_refused(model, args, shapes, message, tmp_path):
    with pytest.raises(LoweringError, match=message):
        grace_compile(model, args, output=tmp_path / "m.grace", progress=False,
                      dynamic_shapes=shapes)


def test_a_view_regrouping_static_dims_next_to_a_dynamic_one():
    seq = ((32, S),)
    # [S, 6, 4] -> [S, 4, 6]: the static run 24 regroups freely
    assert extents.regroup((32, 6, 4), (seq, None, None), (32, 4, 6)) == (seq, None, None)
