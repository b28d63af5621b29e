"""The op-conformance sweep (grace.tools.op_sweep): its classifier, and the fast subset of torch's
OpInfo database through export → compile → Triton's interpreter, compared with torch.

The fast-subset test asserts that no op comes out `wrong` or `crash`; `not_lowered` (grace's own
clear error) and `export_refused` (torch.export's) are allowed. docs/op-conformance.md has the
full-sweep counts."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("expecttest")   # torch.testing._internal.common_methods_invocations needs it

from grace.tools import op_sweep  # noqa: E402

pytestmark = pytest.mark.slow


# ---- the classifier (no compiling) ---------------------------------------------------------------

def test_matching_outputs_pass():
    ref = np.array([1.0, -2.5, 3.25], np.float32)
    assert op_sweep.compare_outputs([ref.copy()], [ref], [ref])[0] == "pass"


def test_wrong_value_is_wrong():
    ref = np.array([1.0, 2.0, 3.0], np.float32)
    outcome, msg, err = op_sweep.compare_outputs([ref + np.float32(0.01)], [ref], [ref])
    assert outcome == "wrong" and "outside tolerance" in msg and err > 1e-3


def test_tiny_relative_error_is_wrong_for_elementwise_ops():
    """expm1(1e-30) computed as exp(x) - 1 = 0 is wrong, though tiny in absolute terms."""
    ref = np.array([1e-30, 0.5], np.float32)
    got = np.array([0.0, 0.5], np.float32)
    assert op_sweep.compare_outputs([got], [ref], [ref], strict=True)[0] == "wrong"


def test_nan_positions_must_match():
    ref = np.array([1.0, np.nan, np.inf], np.float32)
    assert op_sweep.compare_outputs([ref.copy()], [ref], [ref])[0] == "pass"
    got = np.array([np.nan, np.nan, np.inf], np.float32)
    assert op_sweep.compare_outputs([got], [ref], [ref])[0] == "wrong"
    got = np.array([1.0, 0.0, np.inf], np.float32)
    assert op_sweep.compare_outputs([got], [ref], [ref])[0] == "wrong"
    got = np.array([1.0, np.nan, -np.inf], np.float32)
    assert op_sweep.compare_outputs([got], [ref], [ref])[0] == "wrong"


def test_shape_dtype_and_count_mismatches_are_wrong():
    ref = np.zeros((2, 3), np.float32)
    assert "shape" in op_sweep.compare_outputs([np.zeros((3, 2), np.float32)], [ref], None)[1]
    assert "dtype" in op_sweep.compare_outputs([np.zeros((2, 3), np.float16)], [ref], None)[1]
    assert op_sweep.compare_outputs([ref, ref], [ref], None)[0] == "wrong"


def test_integers_exact_and_empty_outputs():
    big = np.array([2**24 + 1, -(2**40) - 3], np.int64)
    assert op_sweep.compare_outputs([big.copy()], [big], None)[0] == "pass"
    assert op_sweep.compare_outputs([big + 1], [big], None)[0] == "wrong"
    empty = np.zeros((0, 3), np.float32)
    assert op_sweep.compare_outputs([empty.copy()], [empty], None)[0] == "pass"


def test_eager_error_is_an_allowance():
    """An ill-conditioned result: fp16 eager is off from the float64 reference; grace no worse
    than twice that passes, grace far off fails."""
    ref = np.array([1.0, 100.0], np.float16)
    eager = np.array([1.0, 100.5], np.float16)
    near = np.array([1.0, 100.75], np.float16)
    assert op_sweep.compare_outputs([near], [eager], [ref])[0] == "pass"
    far = np.array([1.0, 104.0], np.float16)
    assert op_sweep.compare_outputs([far], [eager], [ref])[0] == "wrong"


def test_compile_errors_are_classified():
    from grace.aot.build import BuildError
    from grace.aot.export import ExportError
    from grace.aot.lower import LoweringError

    msg = ("cannot lower aten.frobnicate.default (node 'frob'), used at "
           "File \"model.py\", line 3, in forward: return x.frobnicate()")
    outcome, first = op_sweep.classify_compile_error(LoweringError(msg))
    assert outcome == "not_lowered" and "aten.frobnicate" in first
    assert op_sweep.names_op(first) and op_sweep.names_line(first)
    assert not op_sweep.names_line("cannot lower aten.x (node 'x'), used at (no source location "
                                   "recorded)")
    assert not op_sweep.names_op("LoweringError: dtype torch.complex64 is not supported")
    assert op_sweep.classify_compile_error(ExportError("torch.export failed: x"))[0] == "export_refused"
    assert op_sweep.classify_compile_error(BuildError("ptxas died"))[0] == "crash"
    assert op_sweep.classify_compile_error(LoweringError("internal: bad extents"))[0] == "crash"
    assert op_sweep.classify_compile_error(KeyError("buf3"))[0] == "crash"


def test_a_decomposition_failure_is_torchs_through_a_symlinked_grace(tmp_path):
    """torch's decompositions fail inside export.to_core_aten: export_refused, also when grace is
    imported through a symlink (PYTHONPATH=dir with dir/grace -> the checkout), whose frames are
    named by the link; before, that sweep counted them as crashes."""
    link = tmp_path / "grace"
    link.symlink_to(op_sweep._grace_dir(), target_is_directory=True)
    code = compile("def to_core_aten():\n    raise RuntimeError('guard on u0')\n",
                   str(link / "aot" / "export.py"), "exec")
    scope: dict = {}
    exec(code, scope)
    with pytest.raises(RuntimeError) as info:
        scope["to_core_aten"]()
    assert op_sweep.classify_compile_error(info.value) == (
        "export_refused", "decomposition failed: RuntimeError: guard on u0")


def test_torch_refusing_the_sample_is_unsupported():
    def refuses(x):
        raise RuntimeError("not for this dtype")

    case = op_sweep.Case(0, "refuses", "float32", "opinfo[0]", False, fn=refuses,
                         sample_input=(torch.ones(2), (), {}))
    assert "torch raises" in op_sweep.references(case)
    case.fn = lambda x: x.shape[0]
    assert "non-tensor" in op_sweep.references(case)


def test_module_takes_listed_tensors_as_inputs():
    """cat([a, b], dim=1): the list's tensors are separate inputs, the dim is closed over."""
    a, b = torch.randn(2, 3), torch.randn(2, 1)
    tensors, rebuild = op_sweep._split(([a, b], (1,), {}))
    assert len(tensors) == 2
    module = op_sweep.make_module(lambda xs, d: torch.cat(xs, d), rebuild)
    (out,) = module(*tensors)
    assert torch.equal(out, torch.cat([a, b], 1))
    ep = torch.export.export(module, tuple(tensors))
    assert list(ep.graph_signature.user_inputs) == [op_sweep.input_name(i) for i in range(2)]


def test_edge_samples_cover_the_issue():
    op = next(o for o in op_sweep.load_op_db() if op_sweep.full_name(o) == "pow")
    names = {n: s for n, s in op_sweep.edge_samples(op, torch.float32)}
    assert {"edge:values", "edge:0-d", "edge:empty", "edge:size-1"} <= set(names)
    base, (expo,), _ = names["edge:values"]
    assert (base < 0).any() and {0.5, -0.5, 1.5, -1.5} <= set(expo.tolist())
    assert names["edge:0-d"][0].dim() == 0 and names["edge:empty"][0].numel() == 0
    ((_, (a, _, _)),) = op_sweep.edge_samples(op, torch.int64)
    assert a.dtype == torch.int64 and a.abs().max() > 2**24


def test_random_ops_are_skipped():
    db = op_sweep.load_op_db()
    cases = op_sweep.build_cases(op_sweep.select_ops(db, ["bernoulli", "rand_like"]), ("float32",))
    assert cases and all(c.outcome == "skipped" for c in cases)


def test_dead_worker_costs_one_sample(tmp_path):
    """A job the worker cannot run comes back as an error, and the worker serves the next."""
    w = op_sweep.Worker("interpret", 0, tmp_path / "w.log")
    try:
        job = {"id": 0, "package": str(tmp_path / "missing.grace"),
               "inputs": str(tmp_path / "missing.npz"), "outputs": str(tmp_path / "o.npz")}
        assert w.run(job, 120)["ok"] is False
        assert w.run({**job, "id": 1}, 120)["ok"] is False
        w.proc.kill()        # the child process this test started
        w.proc.wait()
        reply = w.run({**job, "id": 2}, 120)   # restarted
        assert "crash" in reply or reply["ok"] is False
    finally:
        w.stop()


# ---- the fast subset, compiled and interpreted ---------------------------------------------------

def test_fast_subset_interpreted():
    """Every op of FAST_OPS, one OpInfo sample plus the edge samples, in fp32 (and int64 edges):
    nothing wrong, nothing crashing. The failures are listed in the assertion message."""
    db = op_sweep.load_op_db()
    ops = [o for o in db if op_sweep.full_name(o) in op_sweep.FAST_OPS]
    assert len(ops) == len(op_sweep.FAST_OPS)
    cases = op_sweep.build_cases(ops, ("float32",), samples=1)
    results = op_sweep.sweep(cases, "interpret", jobs=1, timeout=240, progress=False)
    assert len(results) == len(cases)
    bad = [r for r in results if r["outcome"] in ("wrong", "crash")]
    counts = op_sweep.counts(results)
    assert counts["pass"] > len(results) // 2, counts
    assert not bad, f"{counts}\n" + "\n".join(
        f"{r['op']} {r['dtype']} {r['sample']}: {r['outcome']}: {r['message']}" for r in bad)
