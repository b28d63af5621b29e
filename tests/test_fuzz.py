"""Every tool survives every file (issue 10): the mutation fuzzer over compiled packages, and the
bad inputs that used to escape the runtime's checks.

The fuzzer (grace.tools.fuzz, docs/format-fuzzing.md) mutates three packages compiled here (a
static MLP, an MLP with batch buckets, a one-layer CachedLlama with a KV cache, index checks and
--generate) with four classes of mutations and runs each mutant through the reader, `grace verify`,
`grace inspect`, the runtime's load path on a fake driver and the CPU executor's planning. A
finding is any exception that is not one of grace's typed errors, a mutant that takes more than a
few seconds, or a MemoryError under the workers' address-space limit; the test asserts there are
none, and that the mutants really reach every stage. The tests that need the corpus are `slow`
(they compile it once, ~10 s); the bad-input tests are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grace.formats import read_package
from grace.formats.container import parse_container
from grace.runtime.arrays import as_record
from grace.runtime.errors import InputError
from grace.tools import fuzz

COUNT = int(os.environ.get("GRACE_FUZZ_COUNT", 2400))   # ~25 s on two cores; more on demand
SEED = int(os.environ.get("GRACE_FUZZ_SEED", 20261201))
STAGES = ("verify", "inspect", "runtime", "interpret")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("cuda.bindings.driver")   # the runtime stage uses its structs
    return fuzz.build_corpus(tmp_path_factory.mktemp("fuzz-corpus"))


@pytest.fixture(scope="module")
def bases(corpus):
    return [fuzz.Base(p) for p in corpus]


@pytest.mark.slow   # compiles the corpus (once per module)
def test_no_findings_in_mutants_of_compiled_packages(corpus):
    summary = fuzz.fuzz(corpus, COUNT, SEED, workers=2, stages=STAGES)
    assert summary["findings"] == [], fuzz.format_summary(summary)
    classes = summary["classes"]
    assert summary["mutants"] == COUNT
    assert all(c["mutants"] == COUNT // 4 for c in classes.values())
    # byte flips and cuts never get past the reader's hashes and lengths ...
    assert classes["bytes"]["rejected"] == {"read": COUNT // 4}
    assert classes["truncate"]["rejected"] == {"read": COUNT // 4}
    # ... while manifest edits (hashes recomputed) reach the validator and the tools behind it
    manifest = classes["manifest"]
    assert manifest["rejected"]["read"] > COUNT // 8
    assert manifest["accepted"] > 0
    assert sum(n for stage, n in manifest["rejected"].items() if stage != "read") > 0
    assert set(summary["stage_seconds"]) == {"read", *STAGES}
    assert all(t > 0 for t in summary["stage_seconds"].values())


@pytest.mark.slow   # compiles the corpus (once per module)
def test_mutants_are_reproducible_and_really_mutated(bases):
    by_class = {}
    for i in range(400):
        cls, base, what, data = fuzz.mutant(bases, SEED, i)
        assert fuzz.mutant(bases, SEED, i)[3] == data, f"mutant {i} is not reproducible"
        original = next(b for b in bases if b.path.stem == base).data
        assert data != original, f"mutant {i} ({what}) is the original package"
        by_class.setdefault(cls, []).append((data, original, what))
    for data, original, what in by_class["truncate"]:
        # the mutant file is shorter (or longer, with trailing bytes), not a slice that was thrown away
        assert len(data) != len(original), what
        assert data[:min(len(data), len(original))] == original[:min(len(data), len(original))]
    hashed = 0
    for data, _, _ in by_class["manifest"]:
        try:
            parse_container(memoryview(data))   # header, index and manifest hashes: all valid
            hashed += 1
        except Exception as e:   # only a mutant that made the manifest too big may fail here
            assert "above the" in str(e), e
    assert hashed >= len(by_class["manifest"]) - 2


@pytest.mark.slow   # compiles the corpus (once per module)
def test_fast_pack_is_the_writers_layout(bases):
    """fuzz.pack (hashes precomputed) writes the bytes grace.formats' writer writes."""
    for b in bases:
        blob = b.data[b.manifest_offset:b.manifest_offset + b.manifest_nbytes]
        assert fuzz.pack(blob, b.sections) == b.data


@pytest.mark.slow   # compiles the corpus (once per module)
def test_untyped_errors_are_findings(corpus, monkeypatch):
    """The classifier: typed errors are rejections, anything else a finding with its stage."""
    path = str(corpus[0])
    assert fuzz.run_mutant(path, ("verify", "inspect", "runtime"))["outcome"] == "accepted"

    def boom(*_):
        raise KeyError("hidden_params")
    monkeypatch.setattr(fuzz, "_stage_runtime", boom)
    r = fuzz.run_mutant(path, ("verify", "runtime"))
    assert (r["outcome"], r["kind"], r["stage"]) == ("finding", "crash", "runtime")
    assert r["error"] == "KeyError: 'hidden_params'"

    def hungry(*_):
        raise MemoryError
    monkeypatch.setattr(fuzz, "_stage_runtime", hungry)
    assert fuzz.run_mutant(path, ("runtime",))["kind"] == "memory"

    def refused(*_):
        from grace.runtime.errors import InvalidPackageError
        raise InvalidPackageError("no")
    monkeypatch.setattr(fuzz, "_stage_runtime", refused)
    r = fuzz.run_mutant(path, ("runtime",))
    assert (r["outcome"], r["first"], r["error"]) == ("rejected", "runtime", "InvalidPackageError: no")


@pytest.mark.slow   # compiles the corpus (once per module)
def test_hangs_are_findings(corpus):
    """A mutant past the timeout kills its worker; the run goes on with a fresh one."""
    summary = fuzz.fuzz(corpus[:1], 2, SEED, workers=1, timeout=1.0, stages=("_hang",))
    assert [f["kind"] for f in summary["findings"]] == ["hang", "hang"]
    assert all(f["what"] for f in summary["findings"])   # the mutant is named for reproduction


def test_fake_driver_answers_like_a_device():
    """What the fuzzer's driver refuses, as a GPU would: more memory than it has, a size_t
    overflow, a non-ELF image, a function the image does not contain, too much shared memory."""
    pytest.importorskip("cuda.bindings.driver")
    f = fuzz.FakeDriver(device_nbytes=1 << 20)
    err = f._real.CUresult
    assert f.cuMemAlloc(2 << 20)[0] == err.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(OverflowError):
        f.cuMemAlloc(2**64)
    ok, ptr = f.cuMemAlloc(1024)
    assert ok == f.ok
    assert f.cuMemsetD8Async(int(ptr) + 1000, 0, 100, None)[0] == err.CUDA_ERROR_INVALID_VALUE
    assert f.violations and "outside every allocation" in f.violations[0]
    assert f.cuModuleLoadData(b"not a cubin")[0] == err.CUDA_ERROR_INVALID_IMAGE
    _, module = f.cuModuleLoadData(b"\x7fELF...k_mm...")
    assert f.cuModuleGetFunction(module, b"k_mm")[0] == f.ok
    assert f.cuModuleGetFunction(module, b"k_other")[0] == err.CUDA_ERROR_NOT_FOUND
    assert f.cuFuncSetAttribute(None, None, 232449)[0] == err.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(OverflowError):
        f.cuFuncSetAttribute(None, None, 2**31)


@pytest.mark.slow   # compiles the corpus (once per module)
def test_cli(corpus):
    help_text = subprocess.run([sys.executable, "-m", "grace.tools.fuzz", "--help"], check=True,
                               capture_output=True, text=True).stdout
    assert "--count" in help_text and "--seed" in help_text and "--package" in help_text
    proc = subprocess.run([sys.executable, "-m", "grace.tools.fuzz", "--package", str(corpus[0]),
                           "--count", "40", "--seed", "3", "--workers", "1", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["mutants"] == 40 and summary["findings"] == [] and summary["seed"] == 3


# ---------------------------------------------------------------------------------------------
# Bad inputs (issue 10): each a clear InputError naming the input, before anything is launched


class Cai:
    def __init__(self, **fields):
        self.__cuda_array_interface__ = {"shape": (4, 32), "typestr": "<f4", "data": (0x10000, False),
                                         "version": 3, **fields}


@pytest.mark.parametrize("obj, message", [
    (Cai(shape=("4", 32)), r"input 'x': __cuda_array_interface__ shape \['4', 32\] holds str '4'; expected ints"),
    (Cai(shape=(4.0, 32)), r"__cuda_array_interface__ shape \[4.0, 32\] holds float 4.0; expected ints"),
    (Cai(shape=(4, True)), r"shape \[4, True\] holds a bool"),
    (Cai(shape=(-4, 32)), r"shape \[-4, 32\] holds -4, below 0"),
    (Cai(shape=None), r"__cuda_array_interface__ shape must be a tuple of ints, got NoneType"),
    (Cai(strides=(128, "4")), r"__cuda_array_interface__ strides \[128, '4'\] holds str"),
    (Cai(strides=(4,)), r"strides \[4\] do not match the shape \[4, 32\]"),
    (Cai(data=0x10000), r"__cuda_array_interface__ data must be \(pointer, read_only\)"),
    (Cai(data=("0x10000", False)), r"data pointer \['0x10000'\] holds str"),
    (Cai(stream="default"), r"__cuda_array_interface__ stream \['default'\] holds str"),
    (np.ma.array(np.zeros((4, 32), np.float32), mask=False),
     r"input 'x': numpy masked arrays are not supported .* arr\.filled\(value\)"),
    (np.zeros((4, 32), ">f4"), r"input 'x': numpy dtype >f4 is big-endian; .* float32: pass arr\.astype\('<f4'\)"),
    (np.zeros((4, 32), ">i8"), r"numpy dtype >i8 is big-endian; the GPU reads little-endian int64"),
    (np.zeros((4, 32), object), r"numpy dtype object \(Python objects\) is not supported; pass an array of numbers"),
    (np.zeros((4, 32), np.complex64), r"numpy dtype complex64 is not supported \(supported: float64"),
])
def test_bad_inputs_are_input_errors(obj, message):
    with pytest.raises(InputError, match=message) as info:
        as_record(obj, "input 'x'", 1)
    assert "bfloat16" not in str(info.value).split("(supported")[0]   # the old, wrong hint


def test_bad_inputs_fail_a_run_before_any_launch(monkeypatch, tmp_path):
    """Through Session.run on the test FakeDriver: the error names the input, nothing launches."""
    pytest.importorskip("cuda.bindings.driver")
    try:
        from test_runtime_nogpu import FakeDriver, write
    except ImportError:  # pragma: no cover - run from the repository root as a package
        from tests.test_runtime_nogpu import FakeDriver, write
    import grace.runtime as rt
    from grace.runtime import driver

    fake = FakeDriver()
    monkeypatch.setattr(driver, "_cu", fake)
    pkg = rt.load(write(tmp_path / "m.grace"))
    session = pkg.session()
    for obj in (Cai(shape=(4.0, 32)), np.ma.array(np.zeros((4, 32), np.float32)), np.zeros((4, 32), ">f4")):
        with pytest.raises(InputError, match="input 'x'"):
            session.run(obj)
    assert fake.launches == []
    pkg.close()


@pytest.mark.slow   # compiles the corpus (once per module)
def test_interpreter_refuses_masked_inputs(corpus):
    pytest.importorskip("torch")
    from grace.tools.interpret import InterpretError, InterpretSession

    session = InterpretSession(str(corpus[0]))
    spec = session.view.inputs[0]
    masked = np.ma.array(np.zeros(spec.shape, np.float32), mask=True)
    with pytest.raises(InterpretError, match="masked"):
        session.run({spec.name: masked})


@pytest.mark.slow   # compiles the corpus (once per module)
def test_interpreter_refuses_packages_beyond_its_host_memory(corpus):
    pytest.importorskip("torch")
    from grace.tools.interpret import InterpretError, InterpretSession

    with pytest.raises(InterpretError, match=r"needs \d+ bytes of host memory .* above the interpreter's limit of 1000"):
        InterpretSession(str(corpus[0]), max_host_nbytes=1000)
    assert InterpretSession(str(corpus[0])).view.regions == read_package(corpus[0]).view.regions


@pytest.mark.slow   # compiles the corpus (once per module)
def test_a_divisor_that_is_zero_at_some_sizes_fails_those_calls(bases):
    """`batch * ((batch - 1) // (batch - 1))` is valid (its divisor has a symbol) but divides by
    zero at batch = 1: that call fails with InvalidPackageError before any launch, the others run."""
    import copy

    from grace.formats.view import as_view
    from grace.runtime.errors import InvalidPackageError
    from grace.runtime.shapes import ShapePlan

    base = next(b for b in bases if b.path.stem == "mlp_buckets")
    m = copy.deepcopy(base.manifest)
    m["outputs"][0]["shape"][0] = ["*", "batch", ["//", ["-", "batch", 1], ["-", "batch", 1]]]
    plan = ShapePlan(as_view(m))
    assert plan.prepare([(5, 32)]).output_shapes[0] == (5, 16)
    with pytest.raises(InvalidPackageError, match="divides 0 by zero"):
        plan.prepare([(1, 32)])
