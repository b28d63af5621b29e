"""The CPU reference executor (grace.tools.interpret) on the hand-made package."""

import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

try:
    from helpers_handmade import build_handmade_package, make_weights, reference
except ImportError:  # tests/ imported as a package
    from tests.helpers_handmade import build_handmade_package, make_weights, reference

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
        ({"x": np.zeros((8, 4), np.float32)}, r"input 'x': shape \[8, 4\] .*\[4, 8\]"),
        ({"x": np.zeros((4, 8, 1), np.float32)}, r"input 'x': shape"),
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


def test_table_words_layout(fp32_pkg):
    import torch

    from grace.tools.interpret import table_words

    x = torch.zeros(4, 8)
    out = torch.zeros(4, 8)
    words = table_words(fp32_pkg.manifest, {"x": x, "out": out})
    assert words == [x.data_ptr(), 4, 8, 8, 1, out.data_ptr(), 4, 8, 8, 1]


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
