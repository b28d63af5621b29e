"""The .grace container: round trips, and typed rejection of every kind of bad file (CPU only)."""

import copy
import hashlib
import os
import random
import struct

import msgpack
import numpy as np
import pytest
import safetensors

from grace.formats import (FORMAT_VERSION, BadMagicError, ChecksumError, FormatError, ManifestError,
                           Package, TruncatedError, UnsupportedVersionError, decode_weights,
                           encode_weights, read_package, validate_manifest, write_package)
from grace.formats.container import ALIGN, HEADER_NBYTES
from grace.formats.package import pack_package_bytes

# ---------------------------------------------------------------------------------------------
# A minimal valid package: table writer + one kernel, x[2,16] -> out[2,4], two weights (fp32, bf16)


def _bf16_bytes(values) -> bytes:
    # bfloat16 = the upper half of a float32 (truncation is fine for test data)
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


W = np.arange(64, dtype=np.float32).reshape(16, 4) / 7
B = _bf16_bytes(np.linspace(-1, 1, 4))


def make_weights() -> bytes:
    return encode_weights({"fc.weight": ("float32", (16, 4), W.tobytes()),
                           "fc.bias": ("bfloat16", (4,), B)})


def make_manifest() -> dict:
    words = 10  # x: 1+2*2, out: 1+2*2
    tw_params = [{"name": "table_ptr", "type": "*i64"}] + [
        {"name": f"w{i}", "type": "i64"} for i in range(words)]
    return {
        "producer": {"grace": "0.1.0", "torch": "2.13.0", "triton": "3.6.0"},
        "model": {"name": "tiny"},
        "archs": ["sm_90"],
        "options": {"opt": 1},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 16], "slot": 0}],
        "outputs": [{"name": "out0", "dtype": "float32", "shape": [2, 4], "slot": 1}],
        "table": {"nbytes": 96, "slots": [
            {"name": "x", "role": "input", "offset": 0, "rank": 2},
            {"name": "out0", "role": "output", "offset": 48, "rank": 2}]},
        "regions": {"weights": 512, "arena": 1024, "table": 96},
        "weights": [
            {"name": "fc.weight", "dtype": "float32", "shape": [16, 4], "offset": 0, "nbytes": 256},
            {"name": "fc.bias", "dtype": "bfloat16", "shape": [4], "offset": 256, "nbytes": 8}],
        "arena_buffers": [{"name": "buf0", "offset": 0, "nbytes": 32, "first": 1, "last": 1}],
        "kernels": [
            {"name": "k_tw", "family": "table_writer", "params": tw_params, "num_warps": 1,
             "num_stages": 1, "shared": 0, "hidden_params": 2, "global_scratch_size": 0,
             "profile_scratch_size": 0, "source_sha256": "0" * 64,
             "binaries": {"sm_90": "cubin/k_tw.sm_90"}, "source": "src/k_tw.py"},
            {"name": "k_mm", "family": "matmul",
             "params": [{"name": "x_slot", "type": "*i64"}, {"name": "w", "type": "*fp32"},
                        {"name": "b", "type": "*bf16"}, {"name": "out_slot", "type": "*i64"},
                        {"name": "tmp", "type": "*fp32"}],
             "num_warps": 4, "num_stages": 3, "shared": 1024,
             "binaries": {"sm_90": "cubin/k_mm.sm_90"}, "source": "src/k_mm.py"},
        ],
        "graphs": [{
            "name": "main",
            "nodes": [
                {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
                 "args": [{"region": "table", "offset": 0, "nbytes": 96}]
                 + [{"word": i} for i in range(words)]},
                {"kernel": 1, "grid": [2, 1, 1], "deps": [0], "label": "addmm",
                 "args": [{"region": "table", "offset": 0, "nbytes": 8, "dtype": "int64"},
                          {"region": "weights", "offset": 0, "nbytes": 256, "dtype": "float32"},
                          {"region": "weights", "offset": 256, "nbytes": 8, "dtype": "bfloat16"},
                          {"region": "table", "offset": 48, "nbytes": 8, "dtype": "int64"},
                          {"region": "arena", "offset": 0, "nbytes": 32, "dtype": "float32"}]},
            ],
            "stats": {"kernels": 2, "est_gpu_us": 1.1},
        }],
    }


def make_sections() -> dict:
    return {
        "weights": make_weights(),
        "cubin/k_tw.sm_90": b"\x7fELF" + bytes(range(256)) * 3,
        "cubin/k_mm.sm_90": b"\x7fELF" + os.urandom(5000),
        "src/k_tw.py": b"import triton\n@triton.jit\ndef k_tw(table_ptr): pass\n",
        "src/k_mm.py": b"import triton\n@triton.jit\ndef k_mm(x_slot): pass\n",
    }


@pytest.fixture
def pkg_bytes(tmp_path) -> bytes:
    path = tmp_path / "m.grace"
    write_package(path, make_manifest(), make_sections())
    return path.read_bytes()


def packed(manifest, sections=None, version=FORMAT_VERSION) -> bytes:
    """A container built without the writer's validation, to feed the reader bad manifests."""
    manifest = {"format_version": list(version), **manifest}
    return pack_package_bytes(msgpack.packb(manifest, use_bin_type=True),
                              make_sections() if sections is None else sections, version=version)


def read_only_format_errors(data: bytes, **kw):
    """Read `data`; anything but success or a FormatError is a reader bug."""
    try:
        return read_package(data, **kw)
    except FormatError:
        return None
    except Exception as e:  # pragma: no cover - the failure message is the point
        pytest.fail(f"non-FormatError escaped the reader: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------
# Round trip


def test_round_trip_from_file(tmp_path):
    manifest, sections = make_manifest(), make_sections()
    path = tmp_path / "m.grace"
    write_package(path, manifest, sections)
    assert "format_version" not in manifest  # the caller's dict is not modified

    pkg = read_package(path)
    assert isinstance(pkg, Package)
    assert pkg.format_version == FORMAT_VERSION
    assert pkg.manifest == {**manifest, "format_version": [1, 0]}
    assert pkg.section_names == list(sections)
    for name, data in sections.items():
        assert bytes(pkg.section(name)) == data
    assert pkg.path == str(path) and pkg.nbytes == path.stat().st_size
    for name, offset, nbytes, sha in pkg.section_info:
        assert offset % ALIGN == 0
        assert nbytes == len(sections[name])
        assert sha == hashlib.sha256(sections[name]).hexdigest()
    assert "weights" in pkg and "nope" not in pkg
    pkg.close()


def test_round_trip_from_bytes(pkg_bytes):
    for source in (pkg_bytes, bytearray(pkg_bytes), memoryview(pkg_bytes)):
        pkg = read_package(source)
        assert pkg.path is None and pkg.nbytes == len(pkg_bytes)
        assert bytes(pkg.section("src/k_mm.py")).startswith(b"import triton")


def test_weights_round_trip_zero_copy(tmp_path):
    path = tmp_path / "m.grace"
    write_package(path, make_manifest(), make_sections())
    with read_package(path) as pkg:
        section = pkg.section("weights")
        tensors = decode_weights(section)
        dtype, shape, view = tensors["fc.weight"]
        assert (dtype, shape) == ("float32", (16, 4))
        np.testing.assert_array_equal(np.frombuffer(view, np.float32).reshape(shape), W)
        dtype, shape, view = tensors["fc.bias"]
        assert (dtype, shape, bytes(view)) == ("bfloat16", (4,), B)
        assert view.obj is section.obj  # a view into the mapped file, not a copy
        assert view.readonly


def test_decode_weights_zero_copy_shapes():
    blob = encode_weights({
        "a": ("float32", (2, 3), np.ones((2, 3), np.float32).tobytes()),
        "b": ("int64", (), np.int64(7).tobytes()),
        "c": ("bool", (0, 5), b""),
        "d": ("bfloat16", (3,), _bf16_bytes([1, 2, 3])),
        "e": ("uint8", (4,), bytearray(b"\x01\x02\x03\x04")),
    })
    out = decode_weights(blob)
    assert {k: (v[0], v[1], v[2].nbytes) for k, v in out.items()} == {
        "a": ("float32", (2, 3), 24), "b": ("int64", (), 8), "c": ("bool", (0, 5), 0),
        "d": ("bfloat16", (3,), 6), "e": ("uint8", (4,), 4)}
    assert all(v[2].obj is blob for v in out.values())
    assert np.frombuffer(out["b"][2], np.int64)[0] == 7


def test_safe_open_reads_the_weights_section(tmp_path, pkg_bytes):
    st = tmp_path / "w.safetensors"
    st.write_bytes(bytes(read_package(pkg_bytes).section("weights")))
    with safetensors.safe_open(str(st), framework="numpy") as f:
        assert sorted(f.keys()) == ["fc.bias", "fc.weight"]
        np.testing.assert_array_equal(f.get_tensor("fc.weight"), W)
        bias = f.get_slice("fc.bias")
        assert bias.get_dtype() == "BF16" and list(bias.get_shape()) == [4]


def test_encode_weights_rejects_bad_tensors():
    with pytest.raises(FormatError, match="expected 24"):
        encode_weights({"a": ("float32", (2, 3), bytes(20))})
    with pytest.raises(FormatError, match="unknown dtype"):
        encode_weights({"a": ("complex64", (1,), bytes(8))})


@pytest.mark.parametrize("blob, match", [
    (b"\x01", "shorter than"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
    (struct.pack("<Q", 2) + b"{x", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "must be a JSON object"),
    (struct.pack("<Q", 56) + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}  ' + bytes(8),
     "cover 4 of 8"),
    (struct.pack("<Q", 56) + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}  ' + bytes(4),
     "needs 8"),
    (struct.pack("<Q", 56) + b'{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,4]}}  ' + bytes(4),
     "unsupported dtype"),
])
def test_decode_weights_rejects_bad_blobs(blob, match):
    with pytest.raises(FormatError, match=match):
        decode_weights(blob)


# ---------------------------------------------------------------------------------------------
# Container rejection


def test_wrong_magic(pkg_bytes):
    with pytest.raises(BadMagicError):
        read_package(b"NOTGRACE" + pkg_bytes[8:])
    with pytest.raises(BadMagicError):
        read_package(b"PK\x03\x04 a zip file")
    with pytest.raises(TruncatedError):
        read_package(b"")
    with pytest.raises(TruncatedError):
        read_package(pkg_bytes[:5])


@pytest.mark.parametrize("major", [0, 2, 65535])
def test_unknown_major_version(pkg_bytes, major):
    data = bytearray(pkg_bytes)
    data[8:10] = struct.pack("<H", major)
    with pytest.raises(UnsupportedVersionError, match=rf"version {major}\.0 .*1\.x, up to 1\.0"):
        read_package(bytes(data))


def test_newer_minor_version_is_accepted():
    data = packed(make_manifest(), version=(1, 7))
    pkg = read_package(data)
    assert pkg.format_version == (1, 7)
    # Reserved header fields may carry meaning in a newer minor, so they are ignored there...
    data = bytearray(data)
    data[12:16] = struct.pack("<I", 1)
    assert read_package(bytes(data)).format_version == (1, 7)
    # ... but must be zero in a minor this reader knows.
    data[10:12] = struct.pack("<H", 0)
    with pytest.raises(FormatError, match="reserved"):
        read_package(bytes(data))


def test_manifest_version_must_match_header():
    data = packed({**make_manifest(), "format_version": [1, 1]}, version=(1, 0))
    with pytest.raises(ManifestError, match="format_version"):
        read_package(data)


def test_truncated_at_every_interesting_offset(pkg_bytes):
    pkg = read_package(pkg_bytes)
    cuts = set(range(0, HEADER_NBYTES + 300)) | set(range(0, len(pkg_bytes), 97))
    for _, off, nbytes, _ in pkg.section_info:
        cuts |= {off - 1, off, off + 1, off + nbytes - 1}
    cuts = sorted(c for c in cuts if 0 <= c < len(pkg_bytes))
    assert len(cuts) > 500
    for cut in cuts:
        try:
            read_package(pkg_bytes[:cut])
        except TruncatedError:
            continue
        except Exception as e:
            pytest.fail(f"cut at {cut}: {type(e).__name__}: {e}")
        pytest.fail(f"cut at {cut} was accepted")


def test_trailing_bytes_rejected(pkg_bytes):
    with pytest.raises(FormatError, match="trailing"):
        read_package(pkg_bytes + b"\0")


def test_flipped_byte_in_each_section(pkg_bytes):
    pkg = read_package(pkg_bytes)
    for name, off, nbytes, _ in pkg.section_info:
        for pos in (off, off + nbytes // 2, off + nbytes - 1):
            data = bytearray(pkg_bytes)
            data[pos] ^= 0x40
            with pytest.raises(ChecksumError, match=f"section '{name}'"):
                read_package(bytes(data))
    # verify=False skips section hashing (large weights), but never the manifest or index
    _, off, nbytes, _ = pkg.section_info[1]
    data = bytearray(pkg_bytes)
    data[off] ^= 1
    assert read_package(bytes(data), verify=False).section_info[1][1] == off


def test_flipped_byte_in_manifest_and_index(pkg_bytes):
    _, _, _, _, _, index_off, _, manifest_off, manifest_n = struct.unpack_from("<8sHHIQQQQQ", pkg_bytes)
    for pos, what in ((index_off + 3, "index"), (manifest_off + manifest_n // 2, "manifest")):
        data = bytearray(pkg_bytes)
        data[pos] ^= 0x01
        with pytest.raises(ChecksumError, match=what):
            read_package(bytes(data), verify=False)


def test_nonzero_padding_rejected(pkg_bytes):
    _, off, _, _ = read_package(pkg_bytes).section_info[0]
    data = bytearray(pkg_bytes)
    data[off - 1] = 0xFF  # the padding just before the first section
    with pytest.raises(FormatError, match="padding"):
        read_package(bytes(data))
    read_package(bytes(data), verify=False)


def test_every_single_byte_flip_is_detected(pkg_bytes):
    """With verify=True every byte of the file is covered by a hash or a rule."""
    positions = list(range(0, 2048)) + list(range(2048, len(pkg_bytes), 61))
    for pos in positions:
        data = bytearray(pkg_bytes)
        data[pos] ^= 0x10
        try:
            read_package(bytes(data))
        except FormatError:
            continue
        except Exception as e:
            pytest.fail(f"flip at {pos}: {type(e).__name__}: {e}")
        pytest.fail(f"flip at byte {pos} went unnoticed")


@pytest.mark.parametrize("blob", [
    b"\xc1",                                        # reserved msgpack byte
    b"\x92\x01",                                    # array cut short
    msgpack.packb([1, 2, 3]),                       # not a map
    msgpack.packb({1: 2}),                          # non-string key
    msgpack.packb({"a": msgpack.ExtType(5, b"x")}),  # ext types are refused
    msgpack.packb({"a": 1}) + b"\x00",              # extra data
    b"\x91" * 5000,                                 # deep nesting
])
def test_corrupt_msgpack_manifest(blob):
    data = pack_package_bytes(blob, make_sections())
    with pytest.raises(FormatError) as info:
        read_package(data)
    assert not isinstance(info.value, (ChecksumError, TruncatedError))


# ---------------------------------------------------------------------------------------------
# Manifest validation


def mutate(fn):
    m = make_manifest()
    fn(m)
    return m


def _set(path, value):
    def fn(m):
        obj = m
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return fn


BAD_MANIFESTS = [
    (_set(["graphs", 0, "nodes", 1, "args", 4, "offset"], 1000),
     r"graphs\[0\]\.nodes\[1\]\.args\[4\]: arena range \[1000, 1032\) exceeds the arena \(1024 bytes\)"),
    (_set(["graphs", 0, "nodes", 1, "args", 1, "nbytes"], 4096),
     r"args\[1\]: weights range \[0, 4096\) exceeds the weights region \(512 bytes\)"),
    (_set(["graphs", 0, "nodes", 1, "args", 0, "offset"], -8), r"args\[0\]\.offset: -8 is below"),
    (_set(["graphs", 0, "nodes", 1, "args", 0, "region"], "state"), r"args\[0\]\.region"),
    (_set(["graphs", 0, "nodes", 0, "args", 10], {"word": 10}),
     r"nodes\[0\]\.args\[10\]\.word: table word 10 is out of range \(the table has 10 words\)"),
    (_set(["graphs", 0, "nodes", 1, "args", 1], {"word": 0}), r"args\[1\]: table word passed to parameter 'w'"),
    (_set(["graphs", 0, "nodes", 0, "args", 1], {"region": "arena", "offset": 0, "nbytes": 8}),
     r"args\[1\]: arena range passed to scalar parameter 'w0'"),
    (lambda m: m["graphs"][0]["nodes"][1]["args"].pop(), r"nodes\[1\]\.args: 4 arguments .* takes 5"),
    (_set(["graphs", 0, "nodes", 1, "kernel"], 2), r"nodes\[1\]\.kernel: kernel 2 does not exist"),
    (_set(["graphs", 0, "nodes", 0, "deps"], [1]), r"nodes\[0\]\.deps\[0\]: dependency 1 is not an earlier"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [0, 1, 1]), r"grid\[0\]: 0 is below the minimum 1"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [1, 1]), r"grid: expected 3 dimensions"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [1, 70000, 1]), r"grid\[1\]: 70000 is above"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [np.int64(2), 1, 1]), r"grid\[0\]: expected an int, got numpy\.int64"),
    (_set(["inputs", 0, "slot"], 1), r"inputs\[0\]\.slot: slot 1 has role 'output', expected 'input'"),
    (_set(["inputs", 0, "slot"], 5), r"inputs\[0\]\.slot: slot 5 does not exist"),
    (_set(["inputs", 0, "shape"], [32]), r"inputs\[0\]\.slot: slot 0 has rank 2, but the shape has rank 1"),
    (_set(["table", "slots", 1, "offset"], 40), r"table\.slots\[1\]\.offset: 40 is not 16-aligned"),
    (_set(["table", "slots", 1, "offset"], 32), r"table\.slots\[1\]: slot starting at 32 overlaps"),
    (_set(["table", "slots", 1, "offset"], 64), r"table\.slots\[1\]: slot bytes \[64, 104\) exceed the table"),
    (_set(["table", "slots", 0, "role"], "state"), r"table\.slots\[0\]\.role"),
    (_set(["table", "nbytes"], 128), r"table\.nbytes: 128 differs from regions\.table"),
    (_set(["weights", 0, "nbytes"], 128), r"weights\[0\]\.nbytes: 128 bytes, but float32\[16, 4\] needs 256"),
    (_set(["weights", 1, "offset"], 512), r"weights\[1\]: weights range \[512, 520\) exceeds"),
    (_set(["weights", 1, "offset"], 100), r"weights\[1\]\.offset: 100 is not 256-aligned"),
    (_set(["weights", 1, "offset"], 0), r"weights\[\d\]: weight starting at 0 overlaps weights\[\d\]"),
    (_set(["weights", 1, "dtype"], "bf16"), r"weights\[1\]\.dtype: unknown dtype 'bf16'"),
    (_set(["kernels", 1, "num_warps"], 3), r"kernels\[1\]\.num_warps: 3 is not a power of two"),
    (_set(["kernels", 1, "num_warps"], 64), r"kernels\[1\]\.num_warps"),
    (_set(["kernels", 1, "params"], "x"), r"kernels\[1\]\.params: expected a list, got str"),
    (_set(["kernels", 1, "params", 1, "type"], "float*"), r"params\[1\]\.type: expected a Triton type"),
    (_set(["kernels", 1, "binaries"], {}), r"kernels\[1\]\.binaries: no binary for arch 'sm_90'"),
    (_set(["kernels", 1, "binaries", "sm_80"], "cubin/x"), r"arch 'sm_80' is not listed in archs"),
    (_set(["kernels", 1, "name"], "k_tw"), r"kernels\[1\]\.name: duplicate kernel name"),
    (_set(["archs"], ["hopper"]), r"archs\[0\]: expected an arch like 'sm_90'"),
    (_set(["arena_buffers", 0, "nbytes"], 4096), r"arena_buffers\[0\]: arena range"),
    (lambda m: m.pop("graphs"), r"manifest: missing required key 'graphs'"),
    (lambda m: m["graphs"][0]["nodes"][1].pop("grid"), r"nodes\[1\]: missing required key 'grid'"),
    (_set(["regions", "arena"], "big"), r"regions\.arena: expected an int, got str"),
    (_set(["format_version"], [2, 0]), r"format_version: major version 2"),
]


@pytest.mark.parametrize("fn, match", BAD_MANIFESTS)
def test_validate_manifest_rejects(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(mutate(fn))


def test_valid_manifest_passes():
    validate_manifest(make_manifest())
    validate_manifest(make_manifest(), section_names=make_sections())


def test_validate_manifest_rejects_non_map():
    with pytest.raises(ManifestError, match="expected a map"):
        validate_manifest([1, 2])


def test_reader_rejects_bad_manifest_written_without_validation():
    m = mutate(_set(["graphs", 0, "nodes", 1, "args", 4, "nbytes"], 2048))
    with pytest.raises(ManifestError, match=r"args\[4\]: arena range \[0, 2048\) exceeds the arena"):
        read_package(packed(m))
    with pytest.raises(ManifestError, match=r"inputs\[0\]\.slot"):
        read_package(packed(mutate(_set(["inputs", 0, "slot"], 1))))


def test_writer_rejects_bad_manifest_and_keeps_old_file(tmp_path):
    path = tmp_path / "m.grace"
    write_package(path, make_manifest(), make_sections())
    before = path.read_bytes()
    with pytest.raises(ManifestError, match="arena range"):
        write_package(path, mutate(_set(["graphs", 0, "nodes", 1, "args", 4, "offset"], 1000)),
                      make_sections())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.grace"]  # no temporary file left behind


def test_missing_section():
    sections = make_sections()
    del sections["cubin/k_mm.sm_90"]
    with pytest.raises(ManifestError, match=r"kernels\[1\]\.binaries\.sm_90: section 'cubin/k_mm.sm_90' is not"):
        write_package("/nonexistent/never.grace", make_manifest(), sections)
    with pytest.raises(ManifestError, match="is not in the package"):
        read_package(packed(make_manifest(), sections))
    sections = make_sections()
    del sections["weights"]
    with pytest.raises(ManifestError, match="no 'weights' section"):
        read_package(packed(make_manifest(), sections))
    with pytest.raises(FormatError, match="no section 'nope'"):
        read_package(packed(make_manifest())).section("nope")


def test_weights_section_must_match_manifest():
    sections = make_sections()
    sections["weights"] = encode_weights({"fc.weight": ("float32", (16, 4), W.tobytes()),
                                          "fc.bias": ("float16", (4,), B)})
    with pytest.raises(ManifestError, match=r"weights\[1\]: tensor 'fc.bias' is float16\[4\]"):
        read_package(packed(make_manifest(), sections))
    sections["weights"] = encode_weights({"fc.weight": ("float32", (16, 4), W.tobytes())})
    with pytest.raises(ManifestError, match="'fc.bias' is not in the weights section"):
        write_package("/nonexistent/never.grace", make_manifest(), sections)


@pytest.mark.parametrize("name", ["../evil", "/abs", "a//b", "a/./b", "", "sp ace", "x" * 256])
def test_unsafe_section_names_rejected(tmp_path, name):
    with pytest.raises(FormatError, match="section name"):
        write_package(tmp_path / "m.grace", make_manifest(), {**make_sections(), name: b""})


def test_writer_refuses_unencodable_manifest(tmp_path):
    m = make_manifest()
    m["options"] = {"fn": object()}
    with pytest.raises(ManifestError, match="msgpack"):
        write_package(tmp_path / "m.grace", m, make_sections())
    m["options"] = {1: "int keys are unreadable with strict_map_key"}
    with pytest.raises(FormatError):
        write_package(tmp_path / "m.grace", m, make_sections())
    assert not (tmp_path / "m.grace").exists()


# ---------------------------------------------------------------------------------------------
# Fuzzing: only FormatError may escape


def test_fuzz_random_byte_mutations(pkg_bytes):
    rng = random.Random(1234)
    for _ in range(300):
        data = bytearray(pkg_bytes)
        kind = rng.random()
        if kind < 0.6:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind < 0.8:  # aim at the header and index, where lengths and offsets live
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(HEADER_NBYTES + 300)] = rng.randrange(256)
        else:
            del data[rng.randrange(len(data)):][:rng.randint(1, 64)]
        read_only_format_errors(bytes(data))


def test_fuzz_manifest_bytes_with_valid_hashes():
    """Mutate the msgpack itself and re-pack, so decoding and validation see the damage."""
    rng = random.Random(99)
    blob = msgpack.packb({"format_version": [1, 0], **make_manifest()}, use_bin_type=True)
    sections = make_sections()
    for _ in range(300):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        read_only_format_errors(pack_package_bytes(bytes(b), sections))


def test_fuzz_manifest_structure():
    """Replace random nodes of the manifest tree with values of random types."""
    rng = random.Random(7)
    junk = [None, -1, 0, 2**64 - 1, 1.5, "x", b"\x00", [], {}, [1, 2, 3], {"region": "arena"},
            {"word": -1}, True, "sm_90", [0, 0, 0]]
    base = make_manifest()
    sections = make_sections()
    for _ in range(300):
        m = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            obj = m
            while True:
                keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
                if not keys:
                    break
                key = rng.choice(keys)
                child = obj[key]
                if isinstance(child, (dict, list)) and child and rng.random() < 0.7:
                    obj = child
                    continue
                obj[key] = rng.choice(junk)
                break
        try:
            validate_manifest(m)
        except ManifestError:
            pass
        read_only_format_errors(packed(m, sections))
