"""tools/variants.py: compiler constants set for one compile, for the benchmarks' A/B runs
(`--variant NAME:module.CONSTANT=VALUE,...` of bench_decode and benchmark)."""
from __future__ import annotations

import pytest

from grace.aot import codegen
from grace.tools import benchmark, bench_decode
from grace.tools.variants import Variant, applied, parse_variant


def test_a_variant_parses_to_typed_settings():
    v = parse_variant("gemv8x512:codegen.GEMV_TILE=4096, codegen.GEMV_BK=512")
    assert v == Variant("gemv8x512", (("codegen", "GEMV_TILE", 4096), ("codegen", "GEMV_BK", 512)))
    assert v.describe() == "codegen.GEMV_TILE=4096,codegen.GEMV_BK=512"


def test_an_optional_constant_takes_a_value_and_none():
    """A constant that is None by default (fuse_rows.PLAIN_ROW_MAX_PER_SM) takes an int
    (and None back); an int constant takes no other type, None included."""
    v = parse_variant("small:fuse_rows.PLAIN_ROW_TILE=2048,fuse_rows.PLAIN_ROW_MAX_PER_SM=6")
    assert v.settings == (("fuse_rows", "PLAIN_ROW_TILE", 2048), ("fuse_rows", "PLAIN_ROW_MAX_PER_SM", 6))
    assert parse_variant("back:fuse_rows.PLAIN_ROW_MAX_PER_SM=None").settings[0][2] is None
    for bad in ("None", "'6'"):
        with pytest.raises(ValueError, match="is a int"):
            parse_variant(f"bad:fuse_rows.PLAIN_ROW_TILE={bad}")


@pytest.mark.parametrize("text, message", [
    ("gemv", "expected NAME:module.CONSTANT=VALUE"),
    (":codegen.GEMV_TILE=1", "expected NAME"),
    ("a b:codegen.GEMV_TILE=1", "expected NAME"),
    ("v:codegen.gemv_tile=1", "not module.CONSTANT=VALUE"),
    ("v:codegen.GEMV_TILE=big", "not a Python literal"),
    ("v:codegen.GEMV_TILE=2.5", "is a int"),
    ("v:codegen.NO_SUCH=1", "has no constant NO_SUCH"),
    ("v:nomodule.GEMV_TILE=1", "has no module 'nomodule'"),
    ("v:codegen.GEMV_TILE=1,codegen.GEMV_TILE=2", "set twice"),
])
def test_bad_variants_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_variant(text)


def test_applied_sets_the_constants_and_restores_them_even_after_an_error():
    before = codegen.GEMV_TILE, codegen.GEMV_BK
    v = parse_variant("small:codegen.GEMV_TILE=1024,codegen.GEMV_BK=256")
    with applied(v):
        assert (codegen.GEMV_TILE, codegen.GEMV_BK) == (1024, 256)
    assert (codegen.GEMV_TILE, codegen.GEMV_BK) == before
    with pytest.raises(RuntimeError), applied(v):
        raise RuntimeError("a compile that failed")
    assert (codegen.GEMV_TILE, codegen.GEMV_BK) == before
    with applied(None):   # no variant: nothing changes
        assert (codegen.GEMV_TILE, codegen.GEMV_BK) == before


def test_a_variant_changes_what_the_compiler_plans():
    """The GEMV plan reads the constant when a GEMM is planned: a 1 x 2048 x 4096 GEMV takes 4
    output rows per program by default, 8 under GEMV_TILE=8192."""
    assert codegen.gemm_plan(1, 4096, 2048, 1, 2, 132).bn == 4
    with applied(parse_variant("eight:codegen.GEMV_TILE=8192")):
        assert codegen.gemm_plan(1, 4096, 2048, 1, 2, 132).bn == 8


def test_the_benchmarks_take_variants_on_their_command_lines():
    args = benchmark.parse_args(["--models", "vit_s", "--variant", "a:codegen.GEMV_TILE=2048",
                                 "--variant", "b:codegen.ATTN_SPLIT_PROGRAMS_PER_SM=8"])
    assert [v.name for v in args.variants] == ["a", "b"]
    for main in (lambda a: benchmark.parse_args(["--models", "vit_s", *a]), bench_decode.main):
        with pytest.raises(SystemExit):
            main(["--variant", "a:codegen.GEMV_TILE=2048", "--variant", "a:codegen.GEMV_BK=512"])
        with pytest.raises(SystemExit):
            main(["--variant", "a:codegen.GEMV_TILE=x"])


def test_a_package_compiled_under_a_variant_has_its_kernels(tmp_path):
    """End to end through the compiler: a decoder's GEMVs launch 8 rows per program under
    GEMV_TILE=8192 (the default's 4), and the default comes back for the next compile. Rows of at
    most 2048 columns: longer ones take the persistent GEMV form, which GEMV_TILE does not shape."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.models import MLP

    def gemv_rows(path):
        m = read_package(path).manifest
        return {m["kernels"][n["kernel"]]["name"]: n["grid"][0] for g in m["graphs"]
                for n in g["nodes"] if "kernel" in n and m["kernels"][n["kernel"]]["family"] == "matmul"}

    torch.manual_seed(0)
    model, x = MLP(1024, 2048).eval(), torch.randn(1, 1024)
    with applied(parse_variant("eight:codegen.GEMV_TILE=8192")):
        wide = gemv_rows(grace_compile(model, (x,), output=tmp_path / "wide.grace"))
    default = gemv_rows(grace_compile(model, (x,), output=tmp_path / "default.grace"))
    assert set(wide).isdisjoint(default)   # other sources, other names
    assert sorted(wide.values()) == sorted(-(-g // 2) for g in default.values())


def test_a_variant_that_changes_nothing_is_told_apart(tmp_path):
    """nodes_changed (what the benchmarks record, and warn about at 0): a variant whose constant
    this model never reaches builds the very graphs of the default (0 nodes differ); one that
    retiles its GEMVs changes every GEMV node. Another package of the same settings: 0 again."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.models import MLP
    from grace.tools.variants import nodes_changed

    torch.manual_seed(0)
    model, x = MLP(1024, 2048).eval(), torch.randn(1, 1024)

    def manifest(name, variant=None):
        with applied(parse_variant(variant) if variant else None):
            return read_package(grace_compile(model, (x,), output=tmp_path / f"{name}.grace")).manifest

    base = manifest("base")
    # no attention in an MLP: its split never comes up
    assert nodes_changed(base, manifest("attn", "attn:codegen.ATTN_SPLIT_PROGRAMS_PER_SM=8")) == 0
    assert nodes_changed(base, manifest("again")) == 0
    wide = manifest("wide", "wide:codegen.GEMV_TILE=8192")
    gemvs = sum(wide["kernels"][n["kernel"]]["family"] == "matmul"
                for g in wide["graphs"] for n in g["nodes"])
    assert gemvs and nodes_changed(base, wide) >= gemvs
    # the same sources launched with other warps count too (this session's ATTN_WARPS runs were
    # once reported as no-ops: the kernel names, hashes of the source, had not changed)
    warps = manifest("warps", "warps:codegen.GEMV_WARPS=8")
    assert ({k["name"] for k in warps["kernels"]} == {k["name"] for k in base["kernels"]})
    assert nodes_changed(base, warps) >= gemvs


def test_a_variant_of_the_generation_step_alone_counts(tmp_path):
    """A variant that changes only generate()'s step kernel (not in any graph) is not taken for
    a no-op: the step node counts."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from grace.tools.models import CachedLlama
    from grace.tools.variants import nodes_changed

    torch.manual_seed(0)
    model = CachedLlama(vocab=96, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden=64,
                        max_seq=8).eval()

    def manifest(name, variant=None):
        t = Dim("seq", min=1, max=8)
        with applied(parse_variant(variant) if variant else None):
            path = grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)),
                                 output=tmp_path / f"{name}.grace", progress=False,
                                 dynamic_shapes={"idx": {1: t}, "input_pos": {0: t}},
                                 buckets={"seq": [1, 8]},
                                 generate={"tokens": "idx", "positions": "input_pos"})
        return read_package(path).manifest

    base = manifest("base")
    assert nodes_changed(base, manifest("step", "step:codegen.GENERATE_STEP_BLOCK=32")) == 1
