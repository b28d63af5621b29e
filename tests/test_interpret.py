"""The CPU reference executor (grace.tools.interpret) on the hand-made packages: the static one, and
the shape-bucket one (format 2.0: one input symbol n, graphs n=16/32/64, optionally a data symbol).

Triton's interpreter runs in this process: run_package switches it on around the kernels
(`_interpret_mode`), so triton may have been imported in compiler mode before (the helpers compile
cubins with it)."""

import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

try:
    from helpers_handmade import (B_COLS, build_bucket_package, build_handmade_package, bucket_reference,
                                  bucket_weights, make_weights, reference)
except ImportError:  # tests/ imported as a package
    from tests.helpers_handmade import (B_COLS, build_bucket_package, build_handmade_package, bucket_reference,
                                        bucket_weights, make_weights, reference)

from grace.tools.interpret import InterpretError, run_package


@pytest.fixture(scope="module")
def pkg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("handmade")


@pytest.fixture(scope="module")
def fp32_path(pkg_dir):
    return build_handmade_package(pkg_dir / "fp32.grace")


@pytest.fixture(scope="module")
def fp32_pkg(fp32_path):
    from grace.formats import read_package

    return read_package(fp32_path)


def _x(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).standard_normal((4, 8)).astype(dtype)


def test_matches_numpy(fp32_pkg):
    x = _x()
    out = run_package(fp32_pkg, {"x": x})
    assert set(out) == {"out"}
    assert out["out"].dtype == np.float32 and out["out"].shape == (4, 8)
    np.testing.assert_allclose(out["out"], reference(x, make_weights()), rtol=1e-6, atol=1e-6)


def test_from_path_and_poison_leaves_no_nan(fp32_path):
    # the arena starts as NaN: a correct package never lets it reach an output
    out = run_package(str(fp32_path), {"x": _x(seed=2)}, poison=True)["out"]
    assert not np.isnan(out).any()


def test_outputs_are_copies(fp32_pkg):
    x = _x()
    a = run_package(fp32_pkg, {"x": x})["out"]
    b = run_package(fp32_pkg, {"x": x * 0})["out"]
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(a, reference(x, make_weights()), rtol=1e-6)


def test_inputs_not_modified(fp32_pkg):
    x = _x()
    keep = x.copy()
    run_package(fp32_pkg, {"x": x})
    np.testing.assert_array_equal(x, keep)


def test_fp16(pkg_dir):
    path = build_handmade_package(pkg_dir / "fp16.grace", dtype="float16")
    x = _x(np.float16)
    out = run_package(path, {"x": x})["out"]
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), reference(x, make_weights("float16")).astype(np.float32),
                               rtol=1e-3, atol=1e-3)


def test_poison_shows_reads_of_unwritten_arena(pkg_dir):
    # k_scale writes only rows 0..2 of the arena buffer t; k_add reads all 4 rows
    path = build_handmade_package(pkg_dir / "bug.grace", bug="partial_t")
    x = _x()
    out = run_package(path, {"x": x}, poison=True)["out"]
    assert np.isnan(out[3]).all()
    assert not np.isnan(out[:3]).any()
    np.testing.assert_allclose(out[:3], reference(x, make_weights())[:3], rtol=1e-6)
    clean = run_package(path, {"x": x}, poison=False)["out"]
    assert not np.isnan(clean).any()  # without poison the bug hides: that is what poison is for


def test_torch_input_accepted(fp32_pkg):
    import torch

    x = _x()
    out = run_package(fp32_pkg, {"x": torch.from_numpy(x)})["out"]
    np.testing.assert_allclose(out, reference(x, make_weights()), rtol=1e-6)


@pytest.mark.parametrize(
    "inputs, match",
    [
        ({"y": np.zeros((4, 8), np.float32)}, r"unknown input 'y'.*x \(float32\[4, 8\]\)"),
        ({}, r"missing input 'x'"),
        ({"x": np.zeros((4, 8), np.float64)}, r"input 'x': dtype float64 .*float32"),
        ({"x": np.zeros((8, 4), np.float32)}, r"input 'x': shape is \[8, 4\], expected \[4, 8\]"),
        ({"x": np.zeros((4, 8, 1), np.float32)}, r"input 'x': rank is 3 \(shape \[4, 8, 1\]\), expected rank 2"),
    ],
)
def test_bad_inputs(fp32_pkg, inputs, match):
    with pytest.raises(InterpretError, match=match):
        run_package(fp32_pkg, inputs)


def test_bad_input_is_value_error(fp32_pkg):
    with pytest.raises(ValueError):
        run_package(fp32_pkg, {"x": np.zeros(3, np.float32)})


def test_bf16_package_refused(pkg_dir):
    path = build_handmade_package(pkg_dir / "bf16.grace", dtype="bfloat16")
    with pytest.raises(InterpretError, match="bfloat16"):
        run_package(path, {"x": _x()})


def test_bf16_input_refused(fp32_pkg):
    import torch

    with pytest.raises(InterpretError, match="bfloat16"):
        run_package(fp32_pkg, {"x": torch.zeros(4, 8, dtype=torch.bfloat16)})


def test_interpret_flag_restored(fp32_pkg):
    from triton import knobs

    before_env = os.environ.get("TRITON_INTERPRET")
    before = knobs.runtime.interpret
    run_package(fp32_pkg, {"x": _x()})
    assert os.environ.get("TRITON_INTERPRET") == before_env
    assert knobs.runtime.interpret == before


def test_kernel_modules_cached(fp32_pkg):
    from grace.tools import interpret

    run_package(fp32_pkg, {"x": _x()})
    n = len(interpret._module_cache)
    run_package(fp32_pkg, {"x": _x()})
    assert len(interpret._module_cache) == n


def test_table_words_layout(fp32_pkg, bucket_pkg):
    import torch

    from grace.tools.interpret import table_words

    x = torch.zeros(4, 8)
    out = torch.zeros(4, 8)
    words = table_words(fp32_pkg.manifest, {"x": x, "out": out})
    assert words == [x.data_ptr(), 4, 8, 8, 1, out.data_ptr(), 4, 8, 8, 1]
    x, out = torch.zeros(5, 8), torch.zeros(5, 8)
    words = table_words(bucket_pkg.manifest, {"x": x, "out": out}, [5])
    assert words == [x.data_ptr(), 5, 8, 8, 1, out.data_ptr(), 5, 8, 8, 1, 5]  # then the symbol n


def test_static_package_reports_its_graph(fp32_pkg):
    out = run_package(fp32_pkg, {"x": _x()})
    assert out.graph == "main" and out.symbols == {}


# ---------------------------------------------------------------------------- shape buckets

@pytest.fixture(scope="module")
def bucket_pkg(pkg_dir):
    from grace.formats import read_package

    return read_package(build_bucket_package(pkg_dir / "buckets.grace"))


@pytest.fixture(scope="module")
def data_pkg(pkg_dir):
    from grace.formats import read_package

    return read_package(build_bucket_package(pkg_dir / "buckets_data.grace", data_output=True))


def _rows(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, B_COLS)).astype(np.float32)


@pytest.mark.parametrize("n, graph", [(1, "n=16"), (7, "n=16"), (16, "n=16"), (17, "n=32"), (32, "n=32"),
                                      (33, "n=64"), (64, "n=64")])
def test_bucket_package_is_exact_at_every_size(bucket_pkg, n, graph):
    # arena and outputs NaN-poisoned (the default): padded rows of the bucket must never leak
    x = _rows(n, seed=n)
    out = run_package(bucket_pkg, {"x": x})
    assert out.graph == graph and out.symbols == {"n": n}
    assert out["out"].shape == (n, B_COLS)
    np.testing.assert_array_equal(out["out"], bucket_reference(x, bucket_weights())["out"])


def test_a_larger_bucket_gives_the_same_result(bucket_pkg):
    x = _rows(5)
    chosen = run_package(bucket_pkg, {"x": x})
    largest = run_package(bucket_pkg, {"x": x}, graph="n=64")
    assert (chosen.graph, largest.graph) == ("n=16", "n=64")
    np.testing.assert_array_equal(chosen["out"], largest["out"])


@pytest.mark.parametrize("n", [1, 12, 40, 64])
def test_data_dependent_output_has_the_size_the_kernel_computed(data_pkg, n):
    x = _rows(n, seed=100 + n)
    out = run_package(data_pkg, {"x": x})
    want = bucket_reference(x, bucket_weights(), data_output=True)
    assert out.symbols == {"n": n, "k": len(want["head"])}
    assert out["head"].shape == (len(want["head"]), B_COLS)
    np.testing.assert_array_equal(out["out"], want["out"])
    np.testing.assert_array_equal(out["head"], want["head"])


def test_data_dependent_output_may_be_empty(data_pkg):
    x = -np.abs(_rows(20))
    out = run_package(data_pkg, {"x": x})
    assert out.symbols["k"] == 0 and out["head"].shape == (0, B_COLS)


@pytest.mark.parametrize("shape, match", [
    ((0, B_COLS), r"input 'x': dim 0 is 0, but symbol 'n' must be in \[1, 64\]"),
    ((65, B_COLS), r"input 'x': dim 0 is 65, but symbol 'n' must be in \[1, 64\] \(shape \[65, 8\], "
                   r"expected \[n, 8\]\)"),
    ((5, B_COLS + 1), r"input 'x': shape is \[5, 9\], expected \[n, 8\] \(dim 1 must be 8\)"),
    ((5,), r"input 'x': rank is 1"),
])
def test_bucket_sizes_out_of_range_are_refused(bucket_pkg, shape, match):
    with pytest.raises(InterpretError, match=match):
        run_package(bucket_pkg, {"x": np.zeros(shape, np.float32)})


def test_a_named_graph_must_cover_the_sizes(bucket_pkg):
    with pytest.raises(InterpretError, match=r"graph 'n=16' cannot serve n=20"):
        run_package(bucket_pkg, {"x": _rows(20)}, graph="n=16")
    with pytest.raises(InterpretError, match=r"no graph named 'n=8'; graphs: n=16, n=32, n=64"):
        run_package(bucket_pkg, {"x": _rows(2)}, graph="n=8")


def test_unknown_input_lists_the_symbolic_shape(bucket_pkg):
    with pytest.raises(InterpretError, match=r"unknown input 'y'; the package expects: x \(float32\[n, 8\]\)"):
        run_package(bucket_pkg, {"y": _rows(2)})


_STDLIB_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _helper(v):
    return v * 2


@triton.jit
def stdlib_kernel(x, out):
    # triton.language's own @jit helpers: zeros, sum (free and member), max, cdiv, sigmoid, softmax, argmax
    offs = tl.arange(0, 16)
    v = tl.load(x + offs) + tl.zeros([16], tl.float32)
    tl.store(out + 0, tl.sum(v, axis=0))
    tl.store(out + 1, v.sum(axis=0))
    tl.store(out + 2, tl.max(v, axis=0))
    tl.store(out + 3, tl.cdiv(tl.full([], 17, tl.int32), 16).to(tl.float32))
    tl.store(out + 4, tl.sum(tl.sigmoid(v), axis=0))
    tl.store(out + 5, tl.sum(tl.softmax(v), axis=0))
    tl.store(out + 6, tl.argmax(v, axis=0).to(tl.float32))
    tl.store(out + 7, tl.sum(_helper(v), axis=0))
'''


def test_stdlib_helpers_work_after_a_compiler_import():
    """triton was imported in compiler mode (this process compiled cubins); the interpreter still
    runs kernels that call triton.language's @jit helpers, and everything is restored afterwards."""
    import hashlib

    import torch
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from grace.tools.interpret import _interpret_mode, _load_kernel_module

    x = torch.tensor(np.random.default_rng(0).standard_normal(16).astype(np.float32))
    out = torch.full((8,), float("nan"))
    sha = hashlib.sha256(_STDLIB_KERNEL.encode()).hexdigest()
    with _interpret_mode():
        mod = _load_kernel_module(_STDLIB_KERNEL, sha)
        mod.stdlib_kernel[(1,)](x, out)
    v = x.numpy().astype(np.float64)
    sig = 1 / (1 + np.exp(-v))
    expected = [v.sum(), v.sum(), v.max(), 2, sig.sum(), 1.0, v.argmax(), 2 * v.sum()]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(tl.zeros, JITFunction) and isinstance(tl.standard.sum, JITFunction)
    assert isinstance(tl.core.tensor.sum, JITFunction)


_COMPILE_AFTER_INTERPRET = """
import sys, torch
from grace.aot import compile as grace_compile
from grace.tools.interpret import run_package
torch.manual_seed(0)
first = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
path = grace_compile(first, (torch.randn(2, 16),), output=sys.argv[1] + "/a.grace", progress=False)
x = torch.randn(2, 16)
out = next(iter(run_package(path, {"input": x.numpy()}).values()))
assert abs(out - first(x).detach().numpy()).max() < 1e-4
second = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8)).eval()
grace_compile(second, (torch.randn(3, 24),), output=sys.argv[1] + "/b.grace", progress=False,
              jobs=int(sys.argv[2]))
print("compiled after interpreting")
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_compiling_after_interpreting_in_the_same_process(tmp_path, jobs):
    """Triton's interpreter leaves triton.language patched after interpreted device-function calls;
    _interpret_mode puts it back, or a later (uncached) compile in the same process fails (jobs=1),
    and so does one in build workers forked from it (jobs=2). A process of its own, with empty
    grace and Triton caches, so that every kernel is really compiled."""
    import subprocess
    import sys

    env = {**os.environ, "GRACE_CACHE_DIR": str(tmp_path / "cubins"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    r = subprocess.run([sys.executable, "-c", _COMPILE_AFTER_INTERPRET, str(tmp_path), str(jobs)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "compiled after interpreting" in r.stdout, r.stderr[-3000:]


def test_a_kernel_pointed_at_another_kernels_source_is_refused(fp32_pkg, pkg_dir):
    """Two kernels' source sections swapped (hashes recomputed, as anyone can): each source is valid
    codegen output, so only source_sha256 tells that it is not the code this kernel was built from."""
    from grace.formats import write_package

    m = fp32_pkg.manifest
    srcs = [k["source"] for k in m["kernels"] if k.get("source")]
    assert len(srcs) >= 2
    sections = {n: bytes(fp32_pkg.section(n)) for n in fp32_pkg.section_names}
    sections[srcs[0]], sections[srcs[1]] = sections[srcs[1]], sections[srcs[0]]
    path = pkg_dir / "swapped.grace"
    write_package(path, m, sections)
    with pytest.raises(InterpretError, match="is not this kernel's source"):
        run_package(str(path), {"x": _x()})


# ---------------------------------------------------------------------------- progress per node


def _expected_lines(pkg, graph: str) -> list[str]:
    """The progress lines run_package writes for `graph`: one per node, before it runs."""
    m = pkg.manifest
    nodes = next(g for g in m["graphs"] if g["name"] == graph)["nodes"]
    lines = []
    for i, node in enumerate(nodes):
        k = m["kernels"][node["kernel"]]
        lines.append(f"interpret graph {graph!r}: node {i + 1}/{len(nodes)} "
                     f"{node.get('label') or k['family']} ({k['family']}, {k['name']})")
    return lines


def test_progress_is_off_unless_asked(bucket_pkg, capsys):
    run_package(bucket_pkg, {"x": _rows(20)})
    assert capsys.readouterr() == ("", "")


def test_progress_names_every_node_on_stderr(bucket_pkg, capsys):
    """Not a terminal (pytest's capture): one line per node, n of N, its label, family, kernel."""
    out = run_package(bucket_pkg, {"x": _rows(20)}, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""   # results and progress never mix
    assert out.graph == "n=32"
    assert captured.err.splitlines() == _expected_lines(bucket_pkg, "n=32")
    # a stream of the caller's, and each call of a session reports its own graph
    import io

    from grace.tools.interpret import InterpretSession

    log = io.StringIO()
    sess = InterpretSession(bucket_pkg, progress=log)
    sess.run({"x": _rows(5)})
    sess.run({"x": _rows(40)})
    assert log.getvalue().splitlines() == _expected_lines(bucket_pkg, "n=16") + _expected_lines(bucket_pkg, "n=64")
    assert capsys.readouterr() == ("", "")


def test_progress_on_a_terminal_is_a_bar(bucket_pkg, capsys):
    """A terminal gets a rich bar (terminal control sequences, no line per node), redrawn before
    each node with the nodes done so far: the last drawing is N of N with the last node's kernel."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    run_package(bucket_pkg, {"x": _rows(20)}, progress=tty)
    text = tty.getvalue()
    nodes = next(g for g in bucket_pkg.manifest["graphs"] if g["name"] == "n=32")["nodes"]
    n = len(nodes)
    last = bucket_pkg.manifest["kernels"][nodes[-1]["kernel"]]["name"]
    assert "\x1b[" in text and "interpret" in text and "graph 'n=32'" in text
    assert "node 1/" not in text   # the bar, not the lines of a log
    assert f"{n}/{n}" in text and last in text
    for i in range(n):   # every node was shown, as "i done of n" while it ran
        assert f"{i}/{n}" in text, i
    assert capsys.readouterr() == ("", "")


def test_progress_text_escapes_what_the_package_says():
    """Labels and kernel names come from the package: a terminal escape in one is shown as text."""
    from types import SimpleNamespace

    from grace.tools.interpret import _node_text

    kernel = SimpleNamespace(name="k", family="pointwise")
    node = SimpleNamespace(kernel=0, label="add\x1b[2J\x07")
    assert _node_text([kernel], node) == "add\\x1b[2J\\x07 (pointwise, k)"


# ---------------------------------------------------------------------------- floating-point warnings


class _CausalAttention:
    """Attention written out (scores, an additive -inf causal mask, softmax), as many models do:
    on a dynamic length a softmax row block holds padded rows, all -inf, where numpy computes
    -inf - -inf (the GPU too, silently: those lanes are masked and never stored)."""

    @staticmethod
    def make():
        import torch

        class Attn(torch.nn.Module):
            def __init__(self, d=16, heads=2):
                super().__init__()
                self.qkv, self.o, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

            def forward(self, x):
                b, t, d = x.shape
                q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
                mask = torch.full((t, t), float("-inf")).triu(1)
                a = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + mask, -1) @ v
                return self.o(a.transpose(1, 2).reshape(b, t, d))

        return Attn()


@pytest.fixture(scope="module")
def attention(pkg_dir):
    import torch
    from torch.export import Dim

    from grace.aot import compile as grace_compile

    torch.manual_seed(0)
    model = _CausalAttention.make().eval()
    path = grace_compile(model, (torch.randn(1, 13, 16),), output=pkg_dir / "attn.grace",
                         progress=False, fp32_matmul="ieee", buckets={"seq": [16, 32]},
                         dynamic_shapes={"x": {1: Dim("seq", min=1, max=32)}})
    return model, path


@pytest.mark.slow
def test_interpreting_attention_with_a_causal_mask_warns_nothing(attention):
    """numpy's floating-point warnings are off while the kernels run, as the GPU has none; the
    results still match eager, and the caller's numpy error settings are as they were."""
    import warnings

    import torch

    model, path = attention
    x = torch.randn(1, 13, 16)   # 3 padded rows in the seq=16 bucket
    before = np.geterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_package(path, {"x": x.numpy()})
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert np.geterr() == before
    assert out.graph == "seq=16"
    with torch.no_grad():
        ref = model.double()(x.double()).numpy()
    np.testing.assert_allclose(out["out"], ref, rtol=1e-5, atol=1e-6)
    # a caller who made numpy raise on them (np.seterr(all="raise")) still gets the kernels' IEEE
    # results, and keeps the setting outside them
    old = np.seterr(all="raise")
    try:
        again = run_package(path, {"x": x.numpy()})
        assert np.geterr()["invalid"] == "raise"
    finally:
        np.seterr(**old)
    np.testing.assert_array_equal(again["out"], out["out"])


def _cli_run(path, x_path, stderr_tty: bool) -> tuple[int, str, str]:
    """`grace run --interpret` in a process of its own, stderr a pseudo-terminal or a pipe."""
    import pty
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "grace.tools.cli", "run", str(path), "--input", f"x={x_path}",
           "--interpret"]
    if not stderr_tty:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:   # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=300)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode("utf-8", "replace")


def test_cli_run_interpret_shows_progress_only_on_a_terminal(bucket_pkg, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, _rows(20))
    rc, out, err = _cli_run(bucket_pkg.path, x, stderr_tty=True)
    assert rc == 0, err
    assert "interpreter (CPU)" in out and "interpret" not in out.replace("interpreter (CPU)", "")
    n = len(next(g for g in bucket_pkg.manifest["graphs"] if g["name"] == "n=32")["nodes"])
    assert "graph 'n=32'" in err and f"{n}/{n}" in err and "\x1b[" in err
    rc, out, err = _cli_run(bucket_pkg.path, x, stderr_tty=False)   # piped: no progress at all
    assert rc == 0 and err == "", err
    assert "interpreter (CPU)" in out
