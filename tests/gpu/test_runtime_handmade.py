"""The runtime on a real GPU, with packages built by hand (no grace.aot). Run with `pytest -m gpu`.

1. A static package (format 3.0, no symbols, no state):

    out = x * 2 + w        x: [4, 32] float32 input, w: [4, 32] weight, out: [4, 32] output

   Two Triton kernels compiled here for this GPU's arch: the table writer (node 0) and k_scale_add
   (node 1), which reaches x and out only through their argument-table slots.

2. The shape-bucket package of tests/helpers_handmade.py (`build_bucket_package`), compiled for this
   GPU's arch: out[n, 8] = x[n, 8] * 2 + b, n in [1, 64] served by graphs n=16/32/64, and head[k, 8]
   = out[:k] with k = #{r < n : x[r, 0] > 0} computed on the device (a data symbol).

3. Session state (format 3.0): the counter package of tests/helpers_handmade.py, whose kernel
   updates `calls` (+1, starts at 10 from the package's data) and `acc` (+x, zeros) in place.

4. generate(): the handmade LM of tests/helpers_handmade.py (next token = (token + position + 1) % 8,
   a handmade step kernel): prefill, then the token loop as one graph launch with a WHILE node.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from grace.runtime import InputError, NoDeviceError, StaleOutputError, driver, load

try:
    from tests import helpers_handmade as hm
except ImportError:  # run from another directory: tests/ is the parent of this file's directory
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import helpers_handmade as hm
B_COLS, build_bucket_package, bucket_reference, bucket_weights = (
    hm.B_COLS, hm.build_bucket_package, hm.bucket_reference, hm.bucket_weights)

pytestmark = pytest.mark.gpu

ROWS, COLS = 4, 32
SLOT_OFFSETS, RANKS = [0, 48], [2, 2]       # x, out; 5 words each; slots 16-byte aligned
TABLE_NBYTES = 96
WORD_OFFSETS = [off // 8 + j for off, r in zip(SLOT_OFFSETS, RANKS) for j in range(1 + 2 * r)]
N_WORDS = len(WORD_OFFSETS)                 # 10
NBYTES = ROWS * COLS * 4

KERNEL_SOURCE = f'''
import triton
import triton.language as tl


@triton.jit
def k_scale_add(x_slot, w, out_slot):
    # x, out: [{ROWS}, {COLS}] float32, reached through their table slots; w: [{ROWS}, {COLS}] weight
    x_ptr = tl.load(x_slot).to(tl.pointer_type(tl.float32))
    out_ptr = tl.load(out_slot).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, {ROWS * COLS})
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2.0 + tl.load(w + offs))


@triton.jit
def table_writer({", ".join(["table"] + [f"w{k}" for k in range(N_WORDS)])}):
''' + "\n".join(f"    tl.store(table + {off}, w{k})" for k, off in enumerate(WORD_OFFSETS)) + "\n"

WEIGHT = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)


@pytest.fixture(scope="module")
def capability():
    try:
        device = driver.Device(0)
    except NoDeviceError as e:
        pytest.skip(f"no CUDA GPU: {e}")
    device.release()
    return device.capability


def _compile(tmp_dir, capability):
    """{kernel name: (signature, compiled)} for this GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = tmp_dir / "handmade_kernels.py"
    path.write_text(KERNEL_SOURCE)
    spec = importlib.util.spec_from_file_location("handmade_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["handmade_kernels"] = module  # triton reads the source through the module
    spec.loader.exec_module(module)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    signatures = {
        "table_writer": ({"table": "*i64", **{f"w{k}": "i64" for k in range(N_WORDS)}}, 1),
        "k_scale_add": ({"x_slot": "*i64", "w": "*fp32", "out_slot": "*i64"}, 4),
    }
    return {name: (sig, triton.compile(ASTSource(getattr(module, name), sig, {}, {}), target=target,
                                       options={"num_warps": warps}))
            for name, (sig, warps) in signatures.items()}


def _kernel_entry(name, family, signature, compiled, arch):
    md = compiled.metadata
    assert md.name == name
    return {"name": name, "family": family,
            "params": [{"name": k, "type": v} for k, v in signature.items()],
            "num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared,
            "hidden_params": 2, "global_scratch_size": md.global_scratch_size or 0,
            "profile_scratch_size": md.profile_scratch_size or 0,
            "source_sha256": hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest(),
            "binaries": {arch: f"cubin/{name}.{arch}"}, "source": "src/handmade_kernels.py"}


@pytest.fixture(scope="module")
def package_path(tmp_path_factory, capability):
    from grace.formats import encode_weights, write_package

    tmp = tmp_path_factory.mktemp("handmade")
    arch = f"sm_{capability[0]}{capability[1]}"
    kernels = _compile(tmp, capability)
    sections = {f"cubin/{name}.{arch}": bytes(c.asm["cubin"]) for name, (_, c) in kernels.items()}
    sections["src/handmade_kernels.py"] = KERNEL_SOURCE.encode()
    sections["weights"] = encode_weights({"w": ("float32", WEIGHT.shape, WEIGHT.tobytes())})
    table_arg = lambda off, nbytes=8: {"region": "table", "offset": off, "nbytes": nbytes, "dtype": "int64"}  # noqa: E731
    manifest = {
        "format_version": [3, 0],
        "producer": {"grace": "0.1.0", "handmade": True},
        "model": {"name": "scale_add"},
        "archs": [arch],
        "options": {},
        "symbols": [],
        "inputs": [{"name": "x", "dtype": "float32", "shape": [ROWS, COLS], "slot": 0}],
        "outputs": [{"name": "out", "dtype": "float32", "shape": [ROWS, COLS], "slot": 1}],
        "table": {"nbytes": TABLE_NBYTES, "slots": [
            {"name": "x", "role": "input", "offset": SLOT_OFFSETS[0], "rank": 2},
            {"name": "out", "role": "output", "offset": SLOT_OFFSETS[1], "rank": 2}],
            "extents": {"offset": TABLE_NBYTES, "count": 0}},
        "regions": {"weights": NBYTES, "arena": 256, "table": TABLE_NBYTES, "state": 0},
        "state": [],
        "weights": [{"name": "w", "dtype": "float32", "shape": [ROWS, COLS], "offset": 0, "nbytes": NBYTES}],
        "arena_buffers": [],
        "kernels": [_kernel_entry("table_writer", "table_writer", *kernels["table_writer"], arch),
                    _kernel_entry("k_scale_add", "pointwise", *kernels["k_scale_add"], arch)],
        "graphs": [{"name": "main", "bucket": {}, "arena": 256, "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [table_arg(0, TABLE_NBYTES)] + [{"word": k} for k in range(N_WORDS)]},
            {"kernel": 1, "grid": [1, 1, 1], "deps": [0], "label": "scale_add",
             "args": [table_arg(SLOT_OFFSETS[0]),
                      {"region": "weights", "offset": 0, "nbytes": NBYTES, "dtype": "float32"},
                      table_arg(SLOT_OFFSETS[1])]},
        ], "stats": {"kernels": 2}}],
    }
    path = tmp / "scale_add.grace"
    write_package(path, manifest, sections)
    return path


@pytest.fixture
def session(package_path):
    pkg = load(package_path)
    sess = pkg.session(poison=True)
    yield sess
    pkg.close()


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def expected(x: np.ndarray) -> np.ndarray:
    return x * np.float32(2) + WEIGHT


def test_torch_input_and_dlpack_output(session, torch):
    x = torch.randn(ROWS, COLS, device="cuda")
    out = session.run(x=x)["out"]
    assert out.shape == (ROWS, COLS) and out.dtype == "float32"
    y = torch.from_dlpack(out)  # zero-copy, ordered after the run on torch's stream
    torch.testing.assert_close(y, x * 2 + torch.from_numpy(WEIGHT).cuda())
    np.testing.assert_allclose(out.numpy(), expected(x.cpu().numpy()), rtol=1e-6)


def test_numpy_input(session):
    x = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    np.testing.assert_allclose(session.run(x)["out"].numpy(), expected(x), rtol=1e-6)


def test_every_run_rewrites_the_table(session, torch):
    for seed in range(3):
        x = torch.randn(ROWS, COLS, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        got = session.run(x)["out"].numpy()
        np.testing.assert_allclose(got, expected(x.cpu().numpy()), rtol=1e-6)


def test_outputs_go_stale(session):
    a = np.ones((ROWS, COLS), np.float32)
    first = session.run(x=a)["out"]
    second = session.run(x=a * 3)["out"]
    with pytest.raises(StaleOutputError, match=r"output 'out' was overwritten by a later run\(\)"):
        first.numpy()
    np.testing.assert_allclose(second.numpy(), expected(a * 3), rtol=1e-6)


def test_out_argument(session, torch):
    x = torch.randn(ROWS, COLS, device="cuda")
    target = torch.full((ROWS, COLS), float("nan"), device="cuda")
    result = session.run(x=x, out={"out": target})
    assert result["out"] is target
    session.sync()
    want = x * 2 + torch.from_numpy(WEIGHT).cuda()
    torch.testing.assert_close(target, want)
    # The next run without out= writes the session's buffer again, not `target`.
    plain = session.run(x=x * 0)["out"]
    np.testing.assert_allclose(plain.numpy(), expected(np.zeros((ROWS, COLS), np.float32)), rtol=1e-6)
    torch.testing.assert_close(target, want)


def test_cuda_array_interface_and_dlpack_only_inputs(session, torch):
    x = torch.randn(ROWS, COLS, device="cuda")

    class CaiOnly:
        __cuda_array_interface__ = x.__cuda_array_interface__

    class DlpackOnly:
        def __dlpack__(self, stream=None):
            return x.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return x.__dlpack_device__()

    for wrapped in (CaiOnly(), DlpackOnly()):
        got = session.run(x=wrapped)["out"].numpy()
        np.testing.assert_allclose(got, expected(x.cpu().numpy()), rtol=1e-6)


def test_bad_input_is_rejected_before_launch(session, torch):
    good = session.run(x=np.ones((ROWS, COLS), np.float32))["out"]
    bad = [
        (torch.randn(ROWS, COLS, device="cuda", dtype=torch.float16), "dtype is float16"),
        (torch.randn(COLS, ROWS, device="cuda").t(), "not C-contiguous"),
        (torch.randn(ROWS, COLS + 1, device="cuda")[:, 1:], "not C-contiguous|not 16-byte aligned"),
        (torch.randn(ROWS, COLS), "CPU tensor"),
    ]
    for x, message in bad:
        with pytest.raises(InputError, match=message):
            session.run(x=x)
    # Nothing ran: the earlier output is not stale and still holds its values.
    np.testing.assert_allclose(good.numpy(), expected(np.ones((ROWS, COLS), np.float32)), rtol=1e-6)


def test_two_sessions_are_independent(package_path):
    pkg = load(package_path)
    try:
        s1, s2 = pkg.session(), pkg.session()
        a, b = np.ones((ROWS, COLS), np.float32), np.full((ROWS, COLS), -2, np.float32)
        o1, o2 = s1.run(a)["out"], s2.run(b)["out"]
        np.testing.assert_allclose(o1.numpy(), expected(a), rtol=1e-6)
        np.testing.assert_allclose(o2.numpy(), expected(b), rtol=1e-6)
    finally:
        pkg.close()


# ------------------------------------------------------------------------------- shape buckets

@pytest.fixture(scope="module")
def bucket_path(tmp_path_factory, capability):
    arch = f"sm_{capability[0]}{capability[1]}"
    return build_bucket_package(tmp_path_factory.mktemp("buckets") / "buckets.grace", archs=(arch,),
                                data_output=True)


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, B_COLS)).astype(np.float32)


def _check(outs: dict, x: np.ndarray) -> None:
    want = bucket_reference(x, bucket_weights(), data_output=True)
    assert outs["out"].shape == want["out"].shape
    np.testing.assert_allclose(outs["out"].numpy(), want["out"], rtol=1e-6, atol=0)
    assert outs["head"].shape == want["head"].shape  # read from the device table (data symbol k)
    np.testing.assert_allclose(outs["head"].numpy(), want["head"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("n, graph", [(1, "n=16"), (17, "n=32"), (64, "n=64")])
def test_bucket_sizes(bucket_path, n, graph):
    pkg = load(bucket_path)
    try:
        sess = pkg.session(poison=True)  # NaN arena and outputs: padded rows must never leak
        x = _rows(n, seed=n)
        outs = sess.run(x)
        assert sess.last_graph == graph
        _check(outs, x)
        assert sess.instantiations == {graph: 1}
    finally:
        pkg.close()


def test_no_graph_is_rebuilt_while_sizes_vary_inside_a_bucket(bucket_path):
    pkg = load(bucket_path)
    try:
        sess = pkg.session(poison=True)
        for n in range(1, 17):
            x = _rows(n, seed=n)
            _check(sess.run(x), x)
        assert sess.instantiations == {"n=16": 1}
        for n in (17, 25, 32, 3, 30, 16):
            x = _rows(n, seed=100 + n)
            _check(sess.run(x), x)
        assert sess.instantiations == {"n=16": 1, "n=32": 1}
        for n in (64, 33, 1, 50):
            x = _rows(n, seed=200 + n)
            _check(sess.run(x), x)
        assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1}
    finally:
        pkg.close()


def test_eager_instantiation(bucket_path):
    pkg = load(bucket_path, instantiate="eager")
    try:
        sess = pkg.session()
        assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1}
        for n in (64, 5, 20):
            x = _rows(n, seed=n)
            _check(sess.run(x), x)
        assert sess.instantiations == {"n=16": 1, "n=32": 1, "n=64": 1}
    finally:
        pkg.close()


def test_bucket_torch_inputs_and_dlpack_outputs(bucket_path, torch):
    pkg = load(bucket_path)
    try:
        sess = pkg.session(poison=True)
        b = torch.from_numpy(bucket_weights()["b"]).cuda()
        for n in (9, 40):
            x = torch.randn(n, B_COLS, device="cuda")
            outs = sess.run(x=x)
            out = torch.from_dlpack(outs["out"])
            assert tuple(out.shape) == (n, B_COLS)
            torch.testing.assert_close(out, x * 2 + b)
            head = torch.from_dlpack(outs["head"])  # the shape read happens here
            k = int((x[:, 0] > 0).sum())
            assert tuple(head.shape) == (k, B_COLS)
            torch.testing.assert_close(head, (x * 2 + b)[:k])
        # out= with this call's true shape
        x = torch.randn(12, B_COLS, device="cuda")
        target = torch.full((12, B_COLS), float("nan"), device="cuda")
        assert sess.run(x=x, out={"out": target})["out"] is target
        sess.sync()
        torch.testing.assert_close(target, x * 2 + b)
    finally:
        pkg.close()


def test_bucket_sizes_out_of_range_fail_before_launch(bucket_path):
    pkg = load(bucket_path)
    try:
        sess = pkg.session()
        x = _rows(10)
        good = sess.run(x)
        for bad, message in [(_rows(65), r"dim 0 is 65, but symbol 'n' must be in \[1, 64\]"),
                             (np.zeros((0, B_COLS), np.float32), r"dim 0 is 0"),
                             (np.zeros((4, B_COLS + 1), np.float32), r"dim 1 must be 8")]:
            with pytest.raises(InputError, match=message):
                sess.run(bad)
        _check(good, x)  # nothing ran: the earlier outputs are not stale
        assert sess.instantiations == {"n=16": 1}
    finally:
        pkg.close()


# ------------------------------------------------------------------------------- session state

@pytest.fixture(scope="module")
def counter_path(tmp_path_factory, capability):
    arch = f"sm_{capability[0]}{capability[1]}"
    return hm.build_counter_package(tmp_path_factory.mktemp("state") / "counter.grace", archs=(arch,))


def _xs(n, seed=0):
    return [np.random.default_rng(seed + i).standard_normal(hm.SHAPE).astype(np.float32) for i in range(n)]


def _check_state(sess, xs):
    want_out, want_state = hm.counter_reference(xs)
    state = sess.read_state()
    assert list(state) == ["calls", "acc"]
    np.testing.assert_array_equal(state["calls"], want_state["calls"])
    np.testing.assert_allclose(state["acc"], want_state["acc"], rtol=1e-6, atol=1e-6)
    return want_out


def test_state_persists_across_runs(counter_path):
    pkg = load(counter_path)
    try:
        sess = pkg.session(poison=True)  # poison fills the arena, never the state
        assert sess.read_state("calls").tolist() == [hm.CALLS_START] and not sess.read_state("acc").any()
        xs = _xs(3)
        for i, x in enumerate(xs):
            out = sess.run(x)["out"].numpy()
            np.testing.assert_allclose(out, _check_state(sess, xs[:i + 1]), rtol=1e-6, atol=1e-6)
    finally:
        pkg.close()


def test_reset_state_is_ordered_after_earlier_runs(counter_path):
    pkg = load(counter_path)
    try:
        sess = pkg.session()
        xs = _xs(2, seed=10)
        for x in xs:
            sess.run(x)
        sess.reset_state()  # no sync before: the reset waits for the runs on the stream
        assert sess.read_state("calls").tolist() == [hm.CALLS_START] and not sess.read_state("acc").any()
        out = sess.run(xs[0])["out"].numpy()
        np.testing.assert_allclose(out, _check_state(sess, xs[:1]), rtol=1e-6, atol=1e-6)
    finally:
        pkg.close()


def test_two_sessions_have_separate_state(counter_path):
    pkg = load(counter_path)
    try:
        s1, s2 = pkg.session(), pkg.session()
        a, b = _xs(3, seed=20), _xs(1, seed=30)
        for x in a:
            s1.run(x)
        s2.run(b[0])
        _check_state(s1, a)
        _check_state(s2, b)
    finally:
        pkg.close()


# ------------------------------------------------------------------------------- generate

@pytest.fixture(scope="module")
def lm_path(tmp_path_factory, capability):
    arch = f"sm_{capability[0]}{capability[1]}"
    return hm.build_lm_package(tmp_path_factory.mktemp("lm") / "lm.grace", archs=(arch,))


@pytest.mark.parametrize("prompt, max_new, eos", [
    ([3, 1], 6, None),
    ([5], 10, 2),                     # stops at the eos token (included)
    (list(range(8)), 9, None),        # prompt + new tokens - 1 == capacity
    ([4], 1, None),                   # the first step alone: the WHILE body never runs
    ([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0], 1, None),  # the longest prompt
])
def test_generate_runs_the_token_loop_on_the_device(lm_path, prompt, max_new, eos):
    pkg = load(lm_path)
    try:
        sess = pkg.session(poison=True)
        got = sess.generate(np.array(prompt), max_new, eos_token_id=eos)
        want = hm.lm_reference(prompt, max_new, eos)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
        # the cache holds every token fed to the model: the prompt, then each new token but the last
        fed = list(prompt) + got.tolist()[:-1]
        assert sess.read_state("hist")[:len(fed)].tolist() == fed
        assert sess.read_state("generate.ctrl").tolist()[0] == len(want)
    finally:
        pkg.close()


def test_the_generation_graph_is_reused(lm_path):
    pkg = load(lm_path)
    try:
        sess = pkg.session()
        for prompt, n in (([3, 1], 6), ([7], 3), ([0, 0, 0], 5), ([3, 1], 6)):
            assert sess.generate(prompt, n).tolist() == hm.lm_reference(prompt, n).tolist()
        assert sess.instantiations == {"seq=16": 1, "generate": 1}
        # run() still works after generate() (it rewrites the whole table)
        logits = sess.run(idx=np.array([[2, 5]]), input_pos=np.array([0, 1]))["logits"].numpy()
        assert logits.shape == (1, 2, hm.LM_V) and logits[0].argmax(-1).tolist() == [3, 7]
    finally:
        pkg.close()


def test_generate_sessions_are_independent(lm_path):
    pkg = load(lm_path)
    try:
        s1, s2 = pkg.session(), pkg.session()
        a, b = s1.generate([3, 1], 6), s2.generate([5], 4)
        assert a.tolist() == hm.lm_reference([3, 1], 6).tolist() and b.tolist() == hm.lm_reference([5], 4).tolist()
        assert s1.read_state("hist")[:7].tolist() == [3, 1, *a.tolist()[:5]]
    finally:
        pkg.close()


def test_generate_rejects_bad_arguments_before_launch(lm_path):
    pkg = load(lm_path)
    try:
        sess = pkg.session()
        first = sess.generate([3, 1], 4)
        for args, message in [(([], 3), "empty"), ((list(range(8)), 10), "capacity of 16"),
                              (([1], 0), "max_new_tokens"), ((list(range(17)), 1), r"\[1, 16\]")]:
            with pytest.raises(InputError, match=message):
                sess.generate(*args)
        hist = sess.read_state("hist")  # untouched by the failed calls
        assert hist[:5].tolist() == [3, 1, *first.tolist()[:3]]
    finally:
        pkg.close()
