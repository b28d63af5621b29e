"""Compiler tests that need no GPU: lowering, fusion, memory plan, codegen to sm_90 cubins, errors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grace.tools import models  # noqa: E402

from grace.aot import compile as grace_compile  # noqa: E402
from grace.aot import export, fuse, lower, memplan  # noqa: E402
from grace.aot.lower import LoweringError  # noqa: E402
from grace.formats import read_package  # noqa: E402


def lowered(model, *inputs):
    program = export.to_core_aten(export.export_model(model, inputs))
    prog = lower.lower(program)
    return prog, fuse.fuse_epilogues(prog.kernels)


def families(kernels):
    return [k.family for k in kernels]


def test_mlp_is_two_gemms_with_fused_epilogues():
    prog, kernels = lowered(models.MLP(), torch.randn(4, 64))
    # bias + GELU fold into the first GEMM, bias + output copy into the second
    assert families(kernels) == ["matmul", "matmul"]
    assert kernels[-1].out.kind == "output"


def test_fusion_returns_new_kernels_and_leaves_the_lowered_ones_alone():
    """Passes return new objects: after fusion the lowered program prints as before, holds the
    same kernel objects with the same fields, and the fused producers are new kernels."""
    from grace.aot.ir import format_ir

    core = export.to_core_aten(export.export_model(models.LlamaBlock(), (torch.randn(1, 16, 64),)))
    prog = lower.lower(core)
    text, kernels = format_ir(prog), list(prog.kernels)
    fields = [(k.spec, k.out, k.epilogue, k.label, k.ext) for k in kernels]
    fused = fuse.fuse_epilogues(prog.kernels)
    assert len(fused) < len(kernels)   # something was fused
    assert format_ir(prog) == text
    assert len(prog.kernels) == len(kernels)
    assert all(a is b for a, b in zip(prog.kernels, kernels))
    assert [(k.spec, k.out, k.epilogue, k.label, k.ext) for k in prog.kernels] == fields
    assert any(k not in kernels and "+" in k.label for k in fused)
    assert fused is not prog.kernels


def test_fusion_keeps_reads_of_state_before_its_writes():
    """Folding a state's store into the kernel that computed its value moves that kernel to the
    store's place: not past another store into a state it reads (it would read the new value), and
    not when it would read its own target at other elements than it stores (a race between its
    programs)."""
    from grace.aot.families import Pointwise
    from grace.aot.ir import Buffer, Kernel, Load, Op

    a, b = (Buffer(n, "state", "float32", (64, 64), i) for n, i in (("a", 1), ("b", 2)))
    t = Buffer("t", "arena", "float32", (64, 64), 3)
    x = Buffer("x", "input", "float32", (64, 64), 4)

    def pointwise(out, value, label):
        return Kernel(Pointwise(), out, (64, 64), value, label=label)

    new_b = pointwise(t, Op("mul", [Load(a, 0, (64, 1)), Load(x, 0, (64, 1))], "float32"), "new_b")
    store_a = pointwise(a, Load(x, 0, (64, 1)), "state a")
    store_b = pointwise(b, Load(t, 0, (64, 1)), "state b")
    assert fuse.fuse_epilogues([new_b, store_a, store_b]) == [new_b, store_a, store_b]
    (fused,) = fuse.fuse_epilogues([new_b, store_b])   # nothing in between: folded
    assert fused.out is b and fused.label == "new_b+state b"
    flipped = pointwise(t, Load(a, 63 * 64, (-64, 1)), "flip")
    store = pointwise(a, Load(t, 0, (64, 1)), "state a")
    assert fuse.fuse_epilogues([flipped, store]) == [flipped, store]


def test_a_slice_by_item_tightens_its_clamp_in_a_new_kernel():
    """x[:n.item()] bounds n by x's size: the `.item()` kernel emitted before the slice is replaced
    (Lowering.replace_kernel) by one that clamps to 12, not to the 40 torch._check allowed, and
    the size's bound follows."""
    class Prefix(torch.nn.Module):
        def forward(self, x, n):
            k = n.item()
            torch._check(k >= 0)
            torch._check(k <= 40)
            return x[:k] + 1

    core = export.to_core_aten(export.export_model(Prefix(), (torch.randn(12, 4), torch.tensor(3))))
    (sym,) = core.range_constraints
    prog = lower.lower(core)
    item = prog.kernels[0]
    assert item.family == "to_extent" and (item.spec.lo, item.spec.hi) == (0, 12)
    assert prog.bounds[sym] == 12


def test_pointwise_chain_is_one_kernel():
    class Chain(torch.nn.Module):
        def forward(self, x, y):
            return torch.sigmoid(x * 2 + y).relu() - y.exp()

    _, kernels = lowered(Chain(), torch.randn(8, 8), torch.randn(8, 8))
    assert families(kernels) == ["pointwise"]


def test_views_cost_no_kernel():
    class Views(torch.nn.Module):
        def forward(self, x):
            return (x.transpose(0, 1)[1:, ::2].unsqueeze(0) * 3).sum(-1)

    _, kernels = lowered(Views(), torch.randn(6, 10))
    assert families(kernels) == ["reduction"]


def test_llama_block_kernel_families():
    _, kernels = lowered(models.LlamaBlock(), torch.randn(1, 16, 64))
    fam = families(kernels)
    assert fam.count("attention") == 1
    assert fam.count("matmul") == 4          # q+k+v, o, w1+w3 (aot/linear_groups.py), w2
    assert fam.count("reduction") == 2       # the two RMS norms' mean of squares


def test_identical_layers_share_kernels(tmp_path):
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=3)
    out = grace_compile(model, (torch.randint(0, 128, (1, 16)),), output=tmp_path / "g.grace",
                        progress=False)
    m = read_package(out).manifest
    stats = m["graphs"][0]["stats"]
    assert stats["unique_kernels"] < stats["kernels"]
    names = [m["kernels"][n["kernel"]]["name"] for n in m["graphs"][0]["nodes"]]
    attention = {n for n in names if n.startswith("attention")}
    assert len(attention) == 1 and sum(n.startswith("attention") for n in names) == 3


def test_memory_plan_has_no_live_overlap():
    prog, kernels = lowered(models.TinyViT(), torch.randn(1, 3, 32, 32))   # one lowering's buffers
    plan = memplan.plan_memory(kernels, prog.weights)
    memplan.check_plan(plan)
    total = sum(p.nbytes for p in plan.arena.values())
    assert plan.arena_nbytes < total, "no arena reuse at all"
    for p in plan.arena.values():
        assert p.offset % memplan.ALIGN == 0


def test_dependencies_follow_write_after_read():
    """Arena reuse creates an edge that no data flow does: `c` reuses the bytes of `a` once `a` is
    dead, so the kernel writing `c` must wait for the one still reading `a` (write-after-read),
    although it reads nothing of it."""
    from grace.aot.families import Pointwise
    from grace.aot.ir import Buffer, Kernel, Load

    x = Buffer("x", "input", "float32", (16, 16), 1)
    a = Buffer("a", "arena", "float32", (16, 16), 2)
    c = Buffer("c", "arena", "float32", (16, 16), 3)
    y1 = Buffer("y1", "output", "float32", (16, 16), 4)
    y2 = Buffer("y2", "output", "float32", (16, 16), 5)

    def copy(out, src):
        return Kernel(Pointwise(), out, out.shape, Load(src, 0, (16, 1)), label=out.name)

    kernels = [copy(a, x), copy(y1, a), copy(c, x), copy(y2, c)]
    plan = memplan.plan_memory(kernels, [])
    assert plan.arena[a.index].offset == plan.arena[c.index].offset == 0   # the reuse
    deps = memplan.dependencies(kernels, plan)
    assert deps[1] == [0]      # read-after-write: y1 reads a
    assert deps[2] == [1]      # write-after-read: c overwrites a's bytes after y1 read them
    assert deps[3] == [2]      # read-after-write: y2 reads c
    # without the reuse there is no such edge: the two chains are independent
    apart = memplan.MemoryPlan(2048, {a.index: memplan.Placement(a, 0, 1024, 0, 1),
                                      c.index: memplan.Placement(c, 1024, 1024, 2, 3)}, 0, {})
    assert memplan.dependencies(kernels, apart) == [[], [0], [], [2]]


def test_package_has_sm90_cubins_and_sources(tmp_path):
    out = grace_compile(models.MLP(), (torch.randn(2, 64),), output=tmp_path / "m.grace",
                        archs=("sm_90", "sm_80"), progress=False)
    pkg = read_package(out)
    m = pkg.manifest
    assert m["archs"] == ["sm_90", "sm_80"]
    # PDL on for sm_90 only (the default): two variants, each kernel built for the archs it runs on
    for arch in ("sm_90", "sm_80"):
        assert any(arch in kernel["binaries"] for kernel in m["kernels"][1:])
    for kernel in m["kernels"]:
        assert kernel["binaries"]
        for arch, section in kernel["binaries"].items():
            blob = bytes(pkg.section(section))
            assert blob[:4] == b"\x7fELF"
        source = bytes(pkg.section(kernel["source"]))
        assert b"@triton.jit" in source
        if kernel["family"] != "table_writer":   # PDL sources wait; sm_80 has no griddepcontrol
            assert (b"gdc_wait()" in source) == ("sm_90" in kernel["binaries"])
    assert m["graphs"][0]["nodes"][0]["label"] == "table_writer"
    assert [i["name"] for i in m["inputs"]] == ["x"]


def test_buffers_are_named_when_made_and_the_table_layout_leaves_them_alone():
    """Outputs get the package's names from the lowering (no pass renames a buffer the kernels
    share), and an I/O buffer's table slot is the layout's (manifest.slot_of): buffers are
    frozen."""
    import dataclasses

    from grace.aot import manifest

    class Two(torch.nn.Module):
        def forward(self, x, y):
            return x + y, x * y

    core = export.to_core_aten(export.export_model(Two(), (torch.randn(4), torch.randn(4))))
    prog = lower.lower(core, output_names=["total", "product"])
    assert [b.name for b in prog.outputs] == ["total", "product"]
    assert list(prog.sizes) == ["x", "y", "total", "product"]
    slots, _, _, _ = manifest.table_layout(prog)
    assert [manifest.slot_of(b, slots) for b in prog.inputs + prog.outputs] == [0, 1, 2, 3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        prog.outputs[0].name = "renamed"


def test_unsupported_op_names_op_and_source_line():
    class Histogram(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=4)  # the line the error must point at

    with pytest.raises(LoweringError) as err:
        lowered(Histogram(), torch.randn(5))
    msg = str(err.value)
    assert "aten.histc" in msg
    assert "test_aot.py" in msg and "torch.histc(x" in msg


def test_mutated_buffers_become_session_state():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x):
            self.n.add_(1)
            return x + self.n

    prog, kernels = lowered(Counter(), torch.randn(3))
    assert [b.name for b in prog.state] == ["n"] and not prog.weights
    assert kernels[-1].out.kind == "state"   # the new value is stored after every reader of the old


def test_mutated_inputs_are_rejected_clearly():
    class Bump(torch.nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    with pytest.raises(LoweringError, match="mutates its inputs"):
        lowered(Bump(), torch.randn(3))


def test_bad_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unsupported arch"):
        grace_compile(models.MLP(), (torch.randn(2, 64),), output=tmp_path / "m.grace",
                      archs=("sm_7",), progress=False)


def test_deep_small_gemm_splits_k():
    # four rows: one row would be a GEMV (tests/test_gemv_interpret.py), which never splits K
    model = torch.nn.Sequential(torch.nn.Linear(4096, 64), torch.nn.ReLU())
    _, kernels = lowered(model, torch.randn(4, 4096))
    assert families(kernels) == ["matmul", "reduction"]
    assert kernels[0].spec.plan.split > 1
    assert kernels[1].out.kind == "output"   # bias + ReLU + output copy fused into the reduction


def test_dynamic_dims_need_a_bucket_to_lower():
    """Lowering a program with a dynamic dimension needs every symbol's bound (its bucket)."""
    seq = torch.export.Dim("seq", min=2, max=64)
    program = torch.export.export(models.MLP(), (torch.randn(8, 64),), dynamic_shapes=({0: seq},))
    core = export.to_core_aten(program)
    (sym,) = core.range_constraints
    prog = lower.lower(core, bucket={sym: 32})
    assert prog.inputs[0].shape == (32, 64) and prog.inputs[0].dynamic == (True, False)
    assert all(k.ext is not None and any(k.ext) for k in prog.kernels)

def _labels(model, args, dynamic_shapes=None):
    """(family, label) of every kernel of every graph, after fusion (nothing built)."""
    from pathlib import Path

    from grace.aot import compiler

    ep = torch.export.export(model.eval(), args, dynamic_shapes=dynamic_shapes)
    st = compiler.CompileState(ep, Path("unused.grace"), "m", compiler.CompileOptions())
    st = compiler.run_pipeline(st, stages=compiler.PIPELINE[:4])   # export .. fuse
    return {b.name: [(k.family, k.label) for k in b.kernels] for b in st.buckets}


def test_kernel_labels_name_the_ops_they_compute():
    """A realised value is labelled by the node that computed it, not by the consumer that needed
    it in memory: the rotary embedding of q and k is an `add` (q*cos + rotate_half(q)*sin), not
    `scaled_dot_product_attention`; labels are the same in every bucket."""
    torch.manual_seed(0)
    seq = torch.export.Dim("seq", min=2, max=64)
    graphs = _labels(models.LlamaBlock(), (torch.randn(1, 32, 64),), ({1: seq},))
    assert len(graphs) > 1
    for kernels in graphs.values():
        pointwise = [label for family, label in kernels if family == "pointwise"]
        assert not any("scaled_dot_product_attention" in label for label in pointwise), kernels
        assert all(not label.startswith("mm") for label in pointwise), kernels   # the norms: mul
        assert [label for family, label in kernels if family == "attention"] == \
            ["scaled_dot_product_attention"]
    # the pointwise kernels between the q/k/v projection and attention: the rotary embeddings
    rotary = set()
    for kernels in graphs.values():
        first = next(i for i, (family, _) in enumerate(kernels) if family == "matmul")
        attn = next(i for i, (family, _) in enumerate(kernels) if family == "attention")
        rotary |= {label for family, label in kernels[first:attn] if family == "pointwise"}
    assert rotary and len(rotary) <= 2, graphs   # q's and k's, the same names in every bucket
    assert all(label.startswith("add") for label in rotary), rotary
    # a fused copy names no op twice (`mm`, not `mm+mm`)
    assert all(len(set(label.split("+"))) == len(label.split("+"))
               for kernels in graphs.values() for _, label in kernels)


def test_fold_constants_refuses_only_what_torch_cannot_run():
    """A node torch cannot evaluate eagerly stays unfolded (it is lowered instead); any other
    exception while folding is a bug in grace and keeps its traceback."""
    def no_kernel():
        raise NotImplementedError("no CPU kernel")   # a RuntimeError

    def bad_args():
        raise TypeError("argument 'x' must be Tensor")

    def bug():
        raise KeyError("a bug")

    for fn, raises in ((no_kernel, None), (bad_args, None), (bug, KeyError)):
        graph = torch.fx.Graph()
        node = graph.call_function(fn, ())
        node.meta["val"] = torch.zeros(1)
        if raises is None:
            assert lower.fold_constants(graph, {}, {}) == {}
        else:
            with pytest.raises(raises):
                lower.fold_constants(graph, {}, {})
