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
import math
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
    # what the reader and the tools accept is rarely dangerous (issue 10, item 3): the records of
    # format 3.4 tie every launch-relevant field to what the kernels were compiled for
    assert summary["dangerous_rate"] <= 0.01, fuzz.format_summary(summary)
    assert summary["dangerous_rate_without_record_edits"] <= 0.01, fuzz.format_summary(summary)
    assert manifest["without_record_edits"] > COUNT // 8   # the rate is measured on enough of them


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
def test_a_bomb_after_an_edit_that_took_its_target_is_drawn_again(bases):
    """Seed 39's mutant 18879 drew the grid bomb after an edit that had made a graph's nodes a
    string: the fuzzer itself raised IndexError and the 20,000-mutant run ended without a
    summary. Now such a draw is redrawn, reproducibly."""
    cls, base, what, data = fuzz.mutant(bases, 39, 18879)
    assert cls == "manifest" and fuzz.mutant(bases, 39, 18879)[3] == data
    assert data != next(b for b in bases if b.path.stem == base).data, what


@pytest.mark.slow   # compiles the corpus (once per module)
def test_fast_pack_is_the_writers_layout(bases):
    """fuzz.pack (hashes precomputed) writes the bytes grace.formats' writer writes."""
    for b in bases:
        blob = b.data[b.manifest_offset:b.manifest_offset + b.manifest_nbytes]
        assert fuzz.pack(blob, b.sections, b.version) == b.data


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
    summary = fuzz.fuzz(corpus[:1], 2, SEED, workers=1, timeout=0.25, stages=("_hang",))
    assert [f["kind"] for f in summary["findings"]] == ["hang", "hang"]
    assert all(f["what"] for f in summary["findings"])   # the mutant is named for reproduction


def elf(kernel: str, params: list, reqntid=None, shared: int = 0) -> bytes:
    """A minimal ELF64 cubin as ptxas lays one out: .text.<kernel>, .nv.info.<kernel> with an
    EIATTR_KPARAM_INFO entry per parameter (and EIATTR_REQNTID), .nv.shared.<kernel>."""
    import struct

    info = b"".join(struct.pack("<BBHIHHI", 4, 0x17, 12, 0, i, 8 * i, size << 18)
                    for i, size in reversed(list(enumerate(params))))
    if reqntid:
        info += struct.pack("<BBH3I", 4, 0x10, 12, *reqntid)
    names = [b"", b".shstrtab", f".text.{kernel}".encode(), f".nv.info.{kernel}".encode(),
             f".nv.shared.{kernel}".encode()]
    strtab = b"\0".join(names) + b"\0"
    name_at = [strtab.index(n + b"\0") if n else 0 for n in names]
    body = strtab + b"\0" * 8 + info
    data_at = 64
    info_at = data_at + len(strtab) + 8
    shoff = data_at + len(body)
    shoff += -shoff % 8
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(names), 1)
    sections = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                struct.pack("<IIQQQQIIQQ", name_at[1], 3, 0, 0, data_at, len(strtab), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", name_at[2], 1, 0, 0, info_at, 0, 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", name_at[3], 0x70000000, 0, 0, info_at, len(info), 0, 0, 4, 0),
                struct.pack("<IIQQQQIIQQ", name_at[4], 8, 0, 0, 0, shared, 0, 0, 16, 0)]
    image = bytes(header) + body
    return image + b"\0" * (shoff - len(image)) + b"".join(sections)


def test_cubin_functions_reads_what_the_driver_would_report():
    assert fuzz.cubin_functions(elf("k_mm", [8, 8, 4], reqntid=(128, 1, 1), shared=1024)) == {
        "k_mm": {"params": [8, 8, 4], "max_threads": 128, "reqntid": (128, 1, 1), "static_shared": 1024}}
    assert fuzz.cubin_functions(elf("k", []))["k"] == {"params": [], "max_threads": 1024, "reqntid": None,
                                                       "static_shared": 0}
    for bad in (b"", b"not a cubin", b"\x7fELF\x02" + bytes(59), elf("k", [8])[:100]):
        with pytest.raises(ValueError):
            fuzz.cubin_functions(bad)


def test_fake_driver_answers_like_a_device():
    """What the fuzzer's driver refuses, as a GPU would: more memory than it has, a size_t
    overflow, a non-ELF image, a function the image does not contain, too much shared memory, a
    block other than the binary's .reqntid; and what it reports about a binary's parameters."""
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
    assert f.cuModuleLoadData(b"\x7fELF...k_mm...")[0] == err.CUDA_ERROR_INVALID_IMAGE
    _, module = f.cuModuleLoadData(elf("k_mm", [8, 8, 4], reqntid=(128, 1, 1), shared=1024))
    ok, function = f.cuModuleGetFunction(module, b"k_mm")
    assert ok == f.ok
    assert f.cuModuleGetFunction(module, b"k_m")[0] == err.CUDA_ERROR_NOT_FOUND   # names, not bytes
    assert f.cuModuleGetFunction(module, b"k_other")[0] == err.CUDA_ERROR_NOT_FOUND
    assert [f.cuFuncGetParamInfo(function, i) for i in range(4)] == [
        (f.ok, 0, 8), (f.ok, 8, 8), (f.ok, 16, 4), (err.CUDA_ERROR_INVALID_VALUE, 0, 0)]
    attr = f._real.CUfunction_attribute
    assert f.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function) == (f.ok, 128)
    assert f.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function) == (f.ok, 1024)
    p = f._real.CUDA_KERNEL_NODE_PARAMS()
    p.func, p.blockDimX, p.blockDimY, p.blockDimZ = function, 64, 1, 1
    assert f.cuGraphAddKernelNode(None, [], 0, p)[0] == err.CUDA_ERROR_INVALID_VALUE   # not .reqntid
    p.blockDimX = 128
    assert f.cuGraphAddKernelNode(None, [], 0, p)[0] == f.ok
    assert f.cuFuncSetAttribute(None, None, 232449)[0] == err.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(OverflowError):
        f.cuFuncSetAttribute(None, None, 2**31)


@pytest.mark.slow   # compiles the corpus (once per module)
def test_fake_driver_reads_the_real_cubins_like_the_manifest_says(bases):
    """Every kernel of the corpus: the ELF's parameters are the manifest's params + hidden_params
    (8 bytes each here), its .reqntid the 32 * num_warps threads Triton generated the code for."""
    from grace.runtime.abi import param_nbytes

    for b in bases:
        pkg = read_package(b.path)
        for kernel in pkg.view.kernels:
            info = fuzz.cubin_functions(bytes(pkg.section(kernel.binaries["sm_90"])))[kernel.name]
            assert info["params"] == param_nbytes(kernel), kernel.name
            assert info["reqntid"] == (32 * kernel.num_warps, 1, 1), kernel.name


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
    from grace.runtime.calls import ShapePlan

    base = next(b for b in bases if b.path.stem == "mlp_buckets")
    m = copy.deepcopy(base.manifest)
    m["outputs"][0]["shape"][0] = ["*", "batch", ["//", ["-", "batch", 1], ["-", "batch", 1]]]
    plan = ShapePlan(as_view(m))
    assert plan.prepare([(5, 32)]).output_shapes[0] == (5, 16)
    with pytest.raises(InvalidPackageError, match="divides 0 by zero"):
        plan.prepare([(1, 32)])


@pytest.mark.slow   # compiles the corpus (once per module)
def test_accepted_mutants_are_classified_by_what_they_change(bases):
    """The rules of docs/format-fuzzing.md, "Classifying accepted mutants", on edits of real
    packages: what the runtime acts on is dangerous, displays and claims are harmless, sizes and
    edges are judged against the base package."""
    import copy

    base = next(b for b in bases if b.path.stem == "mlp_buckets")

    def verdict(edit):
        m = copy.deepcopy(base.manifest)
        edit(m)
        return fuzz.classify(base, m)

    assert verdict(lambda m: m["graphs"][1]["nodes"][1]["grid"].__setitem__(0, 8))["dangerous"] == ["grid"]
    assert verdict(lambda m: m["graphs"][0]["nodes"][1]["args"][4].__setitem__("offset", 256))["dangerous"] == ["args"]
    assert verdict(lambda m: m["kernels"][1].pop("hidden_params"))["dangerous"] == ["kernel ABI"]
    assert verdict(lambda m: m["graphs"][0]["bucket"].__setitem__("batch", 9))["dangerous"] == ["bucket bounds"]
    assert verdict(lambda m: m["inputs"][0]["shape"].__setitem__(1, 16))["dangerous"] == ["io"]
    harmless = [
        lambda m: m["graphs"][0]["nodes"][1].__setitem__("label", "x"),
        lambda m: m["graphs"][0]["nodes"][1]["args"][4].__setitem__("nbytes", 4096),   # a claim
        lambda m: m["kernels"][1].pop("profile_scratch_size"),                        # absent: 0, as it was
        lambda m: m["kernels"][1].__setitem__("shared", m["kernels"][1]["shared"] + 16),
        lambda m: m["kernels"][1]["compiled"].__setitem__("shared", 0),               # a record
        lambda m: m["regions"].__setitem__("arena", m["regions"]["arena"] + 256),      # more memory
        lambda m: m["graphs"][0]["nodes"][2]["deps"].insert(0, 0),                     # implied by 0 -> 1 -> 2
        lambda m: m["symbols"][0].__setitem__("max", 80),                             # no graph serves 80
        lambda m: m.setdefault("model", {}).__setitem__("x", 1),
        lambda m: m["weights"].reverse(),                                            # looked up by name
    ]
    for edit in harmless:
        assert verdict(edit)["dangerous"] == [], edit
    assert verdict(lambda m: m["regions"].__setitem__("arena", 256))["dangerous"] == ["sizes"]
    assert verdict(lambda m: m["graphs"][0]["nodes"][2].__setitem__("deps", [0]))["dangerous"] == ["edges"]
    assert verdict(lambda m: m["symbols"][0].__setitem__("min", 0))["dangerous"] == ["symbols"]
    llama = next(b for b in bases if b.path.stem == "llama")   # seq has two sources, a set
    m = copy.deepcopy(llama.manifest)
    m["symbols"][0]["sources"].reverse()
    assert fuzz.classify(llama, m) == {"dangerous": [], "harmless": []}
    # index checks: one dropped (seed 39's mutant 2099) only changes which error an unlisted code
    # raises; none left, and the session would read no error word
    assert len(llama.manifest["index_checks"]) > 1
    m = copy.deepcopy(llama.manifest)
    del m["index_checks"][0]
    assert fuzz.classify(llama, m) == {"dangerous": [], "harmless": ["index checks"]}
    m["index_checks"] = []
    assert fuzz.classify(llama, m)["dangerous"] == ["index checks"]
    del m["index_checks"]
    assert fuzz.classify(llama, m)["dangerous"] == ["index checks"]
    # a zeroed state entry reshaped with as many elements (seed 40's mutant 11987): only the array
    # read_state() returns changes; another element count, or a data-initialised entry, is not
    cache = next(i for i, e in enumerate(llama.manifest["state"]) if e["init"] == "zeros"
                 and len(e["shape"]) == 4)

    def reshaped(shape, init=None):
        m = copy.deepcopy(llama.manifest)
        m["state"][cache]["shape"] = shape
        if init is not None:
            m["state"][cache]["init"] = init
        return fuzz.classify(llama, m)["dangerous"]

    dims = llama.manifest["state"][cache]["shape"]
    assert reshaped([1] + dims) == [] and reshaped([math.prod(dims)]) == []
    assert reshaped(dims[:-1] + [dims[-1] * 2]) == ["weights and state"]
    assert reshaped([1] + dims, init="data") == ["weights and state"]
    assert reshaped([1.0] + dims) == ["weights and state"]
