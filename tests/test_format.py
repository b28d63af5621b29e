"""The .grace container (format 3.1): round trips, and typed rejection of every kind of bad file.

Two manifests are exercised: a static one (no symbols, one graph) and a shape-bucket one (two input
symbols and a data symbol, one graph per bucket); both stateless (`state: []`). Session state and
`generate` are tested in test_format_state.py. CPU only.
"""

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
                           Package, TruncatedError, UnsupportedVersionError, as_view, decode_weights,
                           encode_weights, eval_shape_expr, expr_symbols, format_shape_expr,
                           read_package, select_graph, validate_manifest, write_package)
from grace.formats.container import ALIGN, HEADER_NBYTES
from grace.formats.package import pack_package_bytes
from grace.formats import limits
from grace.formats.shapes import MAX_EXPR_DEPTH, check_shape_expr

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
        "symbols": [],
        "table": {"nbytes": 96, "slots": [
            {"name": "x", "role": "input", "offset": 0, "rank": 2},
            {"name": "out0", "role": "output", "offset": 48, "rank": 2}],
            "extents": {"offset": 88, "count": 0}},
        "regions": {"weights": 512, "arena": 1024, "table": 96, "state": 0},
        "state": [],
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
            "bucket": {},
            "arena": 1024,
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


# A shape-bucket manifest: x[batch, seq, 16], pos[seq] -> out0[batch, seq + 1, 4], idx[n, 2]
# (n a data symbol), one graph per bucket of batch {1, 8} x seq {128, 256}.
DYN_BATCH, DYN_SEQ = (1, 8), (128, 256)
DYN_WORDS = 7 + 3 + 7 + 5 + 3  # slot words (x rank 3, pos 1, out0 3, idx 2), then 3 symbol words
DYN_EXT = 200  # extents offset: [200, 224) after the last slot [160, 200)


def _dyn_graph(batch: int, seq: int) -> dict:
    arena = batch * seq * 16 * 4

    def ext():  # the extents words, read by kernels that mask with the true sizes
        return {"region": "table", "offset": DYN_EXT, "nbytes": 24, "dtype": "int64"}

    def x_slot():  # the whole slot: kernels load the runtime sizes and strides from it
        return {"region": "table", "offset": 0, "nbytes": 56}

    return {
        "name": f"batch={batch},seq={seq}",
        "bucket": {"batch": batch, "seq": seq, "n": batch * seq * 16},
        "arena": arena,
        "stats": {"kernels": 3, "est_gpu_us": 2.5, "padding": 0.25},
        "nodes": [
            {"kernel": 0, "grid": [1, 1, 1], "deps": [], "label": "table_writer",
             "args": [{"region": "table", "offset": 0, "nbytes": 224}]
             + [{"word": i} for i in range(DYN_WORDS)]},
            {"kernel": 1, "grid": [max(1, batch * seq // 64), 1, 1], "deps": [0],
             "args": [x_slot(), ext(),
                      {"region": "weights", "offset": 0, "nbytes": 256, "dtype": "float32"},
                      {"region": "table", "offset": 96, "nbytes": 56},
                      {"region": "arena", "offset": 0, "nbytes": arena, "dtype": "float32"}]},
            {"kernel": 2, "grid": [batch, 1, 1], "deps": [1],
             "args": [x_slot(), {"region": "table", "offset": 160, "nbytes": 40}, ext()]},
        ],
    }


def make_dyn_manifest() -> dict:
    m = make_manifest()
    tw_params = [{"name": "table_ptr", "type": "*i64"}] + [
        {"name": f"w{i}", "type": "i64"} for i in range(DYN_WORDS)]
    m["kernels"][0]["params"] = tw_params
    m["kernels"][1]["params"] = [
        {"name": "x_slot", "type": "*i64"}, {"name": "ext", "type": "*i64"}, {"name": "w", "type": "*fp32"},
        {"name": "out_slot", "type": "*i64"}, {"name": "tmp", "type": "*fp32"}]
    m["kernels"].append(
        {"name": "k_nz", "family": "nonzero",
         "params": [{"name": "x_slot", "type": "*i64"}, {"name": "idx_slot", "type": "*i64"},
                    {"name": "ext", "type": "*i64"}],
         "num_warps": 4, "shared": 0, "binaries": {"sm_90": "cubin/k_nz.sm_90"}})
    m["options"] = {"buckets": {"batch": list(DYN_BATCH), "seq": list(DYN_SEQ)}}
    m["symbols"] = [
        {"name": "batch", "kind": "input", "min": 1, "max": 8, "sources": [[0, 0]]},
        {"name": "seq", "kind": "input", "min": 1, "max": 256, "sources": [[0, 1], [1, 0]]},
        {"name": "n", "kind": "data", "min": 0, "max": 8 * 256 * 16, "sources": []},
    ]
    m["inputs"] = [{"name": "x", "dtype": "float32", "shape": ["batch", "seq", 16], "slot": 0},
                   {"name": "pos", "dtype": "int64", "shape": ["seq"], "slot": 1}]
    m["outputs"] = [{"name": "out0", "dtype": "float32", "shape": ["batch", ["+", "seq", 1], 4], "slot": 2},
                    {"name": "idx", "dtype": "int64", "shape": ["n", 2], "slot": 3}]
    m["table"] = {"nbytes": 224, "extents": {"offset": DYN_EXT, "count": 3}, "slots": [
        {"name": "x", "role": "input", "offset": 0, "rank": 3},
        {"name": "pos", "role": "input", "offset": 64, "rank": 1},
        {"name": "out0", "role": "output", "offset": 96, "rank": 3},
        {"name": "idx", "role": "output", "offset": 160, "rank": 2}]}
    m["graphs"] = [_dyn_graph(b, q) for b in DYN_BATCH for q in DYN_SEQ]
    m["regions"] = {"weights": 512, "arena": max(g["arena"] for g in m["graphs"]), "table": 224,
                    "state": 0}
    m["arena_buffers"] = []
    return m


def make_dyn_sections() -> dict:
    return {**make_sections(), "cubin/k_nz.sm_90": b"\x7fELF" + bytes(300)}


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
    assert pkg.manifest == {**manifest, "format_version": list(FORMAT_VERSION)}
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


def test_format_version_is_3_6():
    assert FORMAT_VERSION == (3, 6)


@pytest.mark.parametrize("major", [0, 1, 2, 4, 65535])
def test_unknown_major_version(pkg_bytes, major):
    data = bytearray(pkg_bytes)
    data[8:10] = struct.pack("<H", major)
    with pytest.raises(UnsupportedVersionError,
                       match=rf"version {major}\.\d+ .*3\.x, up to 3\.6\): recompile the model with this grace"):
        read_package(bytes(data))


def _v2_manifest() -> dict:
    """What a 2.x compiler wrote: no session state."""
    m = make_manifest()
    del m["state"], m["regions"]["state"]
    return m


@pytest.mark.parametrize("version, manifest", [
    ((1, 0), lambda: {k: v for k, v in _v2_manifest().items() if k != "symbols"}),
    ((2, 0), _v2_manifest),
    ((2, 3), _v2_manifest),
])
def test_older_major_package_is_rejected_with_a_hint(version, manifest):
    """A package from a 1.x or 2.x compiler: the message names both versions and says what to do."""
    data = packed(manifest(), version=version)
    with pytest.raises(UnsupportedVersionError) as info:
        read_package(data)
    msg = str(info.value)
    assert f"{version[0]}.{version[1]}" in msg and "3.x" in msg and "recompile" in msg


def test_newer_minor_version_is_accepted():
    data = packed(make_manifest(), version=(3, 7))
    pkg = read_package(data)
    assert pkg.format_version == (3, 7)
    # Reserved header fields may carry meaning in a newer minor, so they are ignored there...
    data = bytearray(data)
    data[12:16] = struct.pack("<I", 1)
    assert read_package(bytes(data)).format_version == (3, 7)
    # ... but must be zero in a minor this reader knows.
    data[10:12] = struct.pack("<H", 0)
    with pytest.raises(FormatError, match="reserved"):
        read_package(bytes(data))


def test_manifest_version_must_match_header():
    data = packed({**make_manifest(), "format_version": [3, 0]}, version=(3, 1))
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
     r"graphs\[0\]\.nodes\[1\]\.args\[4\]: arena range \[1000, 1032\) exceeds the graph's arena \(1024 bytes\)"),
    (_set(["graphs", 0, "nodes", 1, "args", 1, "nbytes"], 4096),
     r"args\[1\]: weights range \[0, 4096\) exceeds the weights region \(512 bytes\)"),
    (_set(["graphs", 0, "nodes", 1, "args", 0, "offset"], -8), r"args\[0\]\.offset: -8 is below"),
    (_set(["graphs", 0, "nodes", 1, "args", 0, "region"], "scratch"),
     r"args\[0\]\.region: expected one of \('weights', 'arena', 'table', 'state'\), got 'scratch'"),
    (_set(["graphs", 0, "nodes", 1, "args", 1, "region"], "state"),
     r"args\[1\]: state range \[0, 256\) exceeds the state region \(0 bytes\)"),
    (lambda m: m.pop("state"), r"manifest: missing required key 'state'"),
    (lambda m: m["regions"].pop("state"), r"regions: missing required key 'state'"),
    (_set(["regions", "state"], -1), r"regions\.state: -1 is below the minimum 0"),
    (_set(["graphs", 0, "nodes", 0, "args", 10], {"word": 10}),
     r"nodes\[0\]\.args\[10\]\.word: table word 10 is out of range \(the table has 10 words"),
    (_set(["graphs", 0, "nodes", 1, "args", 1], {"word": 0}),
     r"args\[1\]: table word passed to parameter 'w'"),
    (_set(["graphs", 0, "nodes", 0, "args", 1], {"region": "arena", "offset": 0, "nbytes": 8}),
     r"args\[1\]: arena range passed to scalar parameter 'w0'"),
    (lambda m: m["graphs"][0]["nodes"][1]["args"].pop(), r"nodes\[1\]\.args: 4 arguments .* takes 5"),
    (_set(["graphs", 0, "nodes", 1, "kernel"], 2), r"nodes\[1\]\.kernel: kernel 2 does not exist"),
    (_set(["graphs", 0, "nodes", 0, "deps"], [1]), r"nodes\[0\]\.deps\[0\]: dependency 1 is not an earlier"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [0, 1, 1]), r"grid\[0\]: 0 is below the minimum 1"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [1, 1]), r"grid: expected 3 dimensions"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [1, 70000, 1]), r"grid\[1\]: 70000 is above"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [np.int64(2), 1, 1]),
     r"grid\[0\]: expected an int, got numpy\.int64"),
    (_set(["inputs", 0, "slot"], 1), r"inputs\[0\]\.slot: slot 1 has role 'output', expected 'input'"),
    (_set(["inputs", 0, "slot"], 5), r"inputs\[0\]\.slot: slot 5 does not exist"),
    (_set(["inputs", 0, "shape"], [32]), r"inputs\[0\]\.slot: slot 0 has rank 2, but the shape has rank 1"),
    (_set(["table", "slots", 1, "offset"], 40), r"table\.slots\[1\]\.offset: 40 is not 16-aligned"),
    (_set(["table", "slots", 1, "offset"], 32), r"table\.slots\[1\]: slot starting at 32 overlaps"),
    (_set(["table", "slots", 1, "offset"], 64),
     r"table\.slots\[1\]: slot bytes \[64, 104\) exceed the table"),
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
    (_set(["format_version"], [1, 0]), r"format_version: major version 1 is not 3: recompile"),
    (_set(["format_version"], [2, 0]), r"format_version: major version 2 is not 3: recompile"),
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
    with pytest.raises(ManifestError, match=r"args\[4\]: arena range \[0, 2048\) exceeds the graph's arena"):
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
# Shape buckets (since 2.0): symbols, shape expressions, extents, one graph per bucket


def test_dyn_round_trip(tmp_path):
    manifest, sections = make_dyn_manifest(), make_dyn_sections()
    path = tmp_path / "dyn.grace"
    write_package(path, manifest, sections)
    with read_package(path) as pkg:
        assert pkg.format_version == FORMAT_VERSION
        assert pkg.manifest == {**manifest, "format_version": list(FORMAT_VERSION)}
        assert [g["bucket"] for g in pkg.manifest["graphs"]] == [
            {"batch": b, "seq": q, "n": b * q * 16} for b in DYN_BATCH for q in DYN_SEQ]
        assert pkg.manifest["outputs"][0]["shape"] == ["batch", ["+", "seq", 1], 4]
        symbols = pkg.view.symbols
        assert [s.name for s in symbols] == ["batch", "seq", "n"]
        assert symbols[1].sources == ((0, 1), (1, 0)) and symbols[2].kind == "data"


def test_static_manifest_is_the_special_case():
    m = make_manifest()
    assert m["symbols"] == [] and m["table"]["extents"]["count"] == 0
    assert [g["bucket"] for g in m["graphs"]] == [{}]
    assert as_view(m).symbols == ()


def test_tuples_from_the_compiler_are_accepted(tmp_path):
    """The writer validates the caller's dict before msgpack turns tuples into lists."""
    m = make_dyn_manifest()
    m["symbols"][1]["sources"] = [(0, 1), (1, 0)]
    m["outputs"][0]["shape"] = ("batch", ("+", "seq", 1), 4)
    write_package(tmp_path / "t.grace", m, make_dyn_sections())
    assert read_package(tmp_path / "t.grace").manifest["symbols"][1]["sources"] == [[0, 1], [1, 0]]


def test_symbol_words_are_valid_word_arguments():
    """{word: i} reaches the symbol words too: slot words first, then one per symbol."""
    m = make_dyn_manifest()
    assert len(m["graphs"][0]["nodes"][0]["args"]) == 1 + DYN_WORDS
    validate_manifest(m)
    m["graphs"][0]["nodes"][0]["args"][-1] = {"word": DYN_WORDS}
    with pytest.raises(ManifestError, match=rf"args\[{DYN_WORDS}\]\.word: table word {DYN_WORDS} is out "
                                            rf"of range \(the table has {DYN_WORDS} words"):
        validate_manifest(m)


def test_zero_sized_extents_may_sit_anywhere_in_the_table():
    for offset in (0, 48, 88, 96):  # inside or at the end of a slot: 0 bytes overlap nothing
        m = make_manifest()
        m["table"]["extents"]["offset"] = offset
        validate_manifest(m)


# ---- index checks (3.3): `index_checks` and `table.errors` ---------------------------------------

def make_checked_manifest() -> dict:
    """The static manifest with one index check on input x and the error word at byte 88 (after the
    slots; the extents are empty), passed to the kernel as a table range."""
    m = make_manifest()
    m["table"]["errors"] = {"offset": 88}
    m["index_checks"] = [{"code": 1, "input": "x", "op": "aten.embedding",
                          "where": "model.py:12: return self.emb(x)", "size": 128},
                         {"code": 2, "input": None, "op": "aten.gather", "where": "", "size": 7}]
    m["kernels"][1]["params"].append({"name": "errors", "type": "*i64"})
    m["graphs"][0]["nodes"][1]["args"].append(
        {"region": "table", "offset": 88, "nbytes": 8, "dtype": "int64"})
    return m


def test_checked_manifest_passes_and_round_trips(tmp_path):
    m = make_checked_manifest()
    validate_manifest(m, section_names=make_sections())
    write_package(tmp_path / "c.grace", m, make_sections())
    back = read_package(tmp_path / "c.grace").manifest
    assert back["index_checks"] == m["index_checks"] and back["table"]["errors"] == {"offset": 88}


def test_index_checks_are_optional():
    m = make_manifest()
    assert "index_checks" not in m and "errors" not in m["table"]
    validate_manifest(m)
    m["index_checks"] = []          # empty: no checks, no word needed
    validate_manifest(m)
    m["table"]["errors"] = {"offset": 88}   # a word nobody reports into is harmless
    validate_manifest(m)


def test_index_check_size_may_be_a_shape_expression():
    m = make_dyn_manifest()
    m["table"]["nbytes"] = m["regions"]["table"] = 240
    m["graphs"] = [{**g, "nodes": [{**g["nodes"][0], "args": [
        {"region": "table", "offset": 0, "nbytes": 240}] + g["nodes"][0]["args"][1:]}] + g["nodes"][1:]}
        for g in m["graphs"]]
    m["table"]["errors"] = {"offset": 224}
    m["index_checks"] = [{"code": 3, "input": "pos", "op": "aten.index", "where": "", "size": "seq"},
                         {"code": 9, "input": None, "op": "aten.index", "where": "",
                          "size": ["+", "seq", 1]}]
    validate_manifest(m)
    m["index_checks"][0]["size"] = "tokens"
    with pytest.raises(ManifestError, match=r"index_checks\[0\]\.size: 'tokens' is not a declared symbol"):
        validate_manifest(m)


BAD_CHECKED_MANIFESTS = [
    (_set(["table", "errors"], 88), r"table\.errors: expected a map, got int"),
    (_set(["table", "errors"], {}), r"table\.errors: missing required key 'offset'"),
    (_set(["table", "errors", "offset"], 92), r"table\.errors\.offset: 92 is not a multiple of 8"),
    (_set(["table", "errors", "offset"], -8), r"table\.errors\.offset: -8 is below the minimum 0"),
    (_set(["table", "errors", "offset"], 96),
     r"table\.errors: error word bytes \[96, 104\) exceed the table \(96 bytes\)"),
    (_set(["table", "errors", "offset"], 80),
     r"table\.errors: error word bytes \[80, 88\) overlap table\.slots\[1\] \[48, 88\)"),
    (_set(["table", "errors", "offset"], 0),
     r"table\.errors: error word bytes \[0, 8\) overlap table\.slots\[0\] \[0, 40\)"),
    (lambda m: m["table"].pop("errors"),
     r"index_checks: the package has index checks but no table\.errors word"),
    (_set(["index_checks"], {"code": 1}), r"index_checks: expected a list, got dict"),
    (_set(["index_checks", 0], 1), r"index_checks\[0\]: expected a map, got int"),
    (_set(["index_checks", 1, "code"], 1), r"index_checks\[1\]\.code: duplicate code 1 \(also index_checks\[0\]\)"),
    (_set(["index_checks", 0, "code"], 0), r"index_checks\[0\]\.code: 0 is below the minimum 1"),
    (_set(["index_checks", 0, "code"], True), r"index_checks\[0\]\.code: expected an int, got bool"),
    (_set(["index_checks", 0, "input"], "ids"),
     r"index_checks\[0\]\.input: 'ids' is not an input \(the inputs are \['x'\]\)"),
    (_set(["index_checks", 0, "input"], "out0"), r"index_checks\[0\]\.input: 'out0' is not an input"),
    (_set(["index_checks", 0, "input"], 3), r"index_checks\[0\]\.input: expected a str, got int"),
    (lambda m: m["index_checks"][0].pop("input"), r"index_checks\[0\]: missing required key 'input'"),
    (lambda m: m["index_checks"][1].pop("op"), r"index_checks\[1\]: missing required key 'op'"),
    (_set(["index_checks", 0, "where"], None), r"index_checks\[0\]\.where: expected a str, got NoneType"),
    (_set(["index_checks", 0, "size"], -1), r"index_checks\[0\]\.size: -1 is negative"),
    (_set(["index_checks", 0, "size"], "seq"), r"index_checks\[0\]\.size: 'seq' is not a declared symbol"),
    (_set(["index_checks", 0, "size"], 1.5), r"index_checks\[0\]\.size: expected an int, a symbol name"),
]


@pytest.mark.parametrize("fn, match", BAD_CHECKED_MANIFESTS)
def test_validate_checked_manifest_rejects(fn, match):
    m = make_checked_manifest()
    fn(m)
    with pytest.raises(ManifestError, match=match):
        validate_manifest(m)


def test_reader_rejects_a_bad_index_check_written_without_validation():
    m = make_checked_manifest()
    m["index_checks"][0]["input"] = "nope"
    with pytest.raises(ManifestError, match=r"index_checks\[0\]\.input: 'nope' is not an input"):
        read_package(packed(m))


def _dyn(fn):
    m = make_dyn_manifest()
    fn(m)
    return m


def _sym(i, key, value):
    return _set(["symbols", i, key], value)


def _add_graph(batch, seq, n):
    def fn(m):
        g = _dyn_graph(batch, seq)
        g["name"] = "extra"
        g["bucket"]["n"] = n
        m["graphs"].append(g)
    return fn


def _nest(depth):
    e = "seq"
    for _ in range(depth):
        e = ["+", e, 1]
    return e


BAD_DYN_MANIFESTS = [
    # symbols
    (lambda m: m.pop("symbols"), r"manifest: missing required key 'symbols'"),
    (_set(["symbols"], {}), r"symbols: expected a list, got dict"),
    (_sym(0, "name", "1batch"), r"symbols\[0\]\.name: '1batch' is not an identifier"),
    (_sym(0, "name", "a-b"), r"symbols\[0\]\.name: 'a-b' is not an identifier"),
    (_sym(0, "name", 3), r"symbols\[0\]\.name: expected a str, got int"),
    (_sym(1, "name", "batch"), r"symbols\[1\]\.name: duplicate symbol name 'batch'"),
    (_sym(0, "kind", "static"), r"symbols\[0\]\.kind: expected one of \('input', 'data'\), got 'static'"),
    (_sym(0, "min", -1), r"symbols\[0\]\.min: -1 is below the minimum 0"),
    (_sym(0, "min", True), r"symbols\[0\]\.min: expected an int, got bool"),
    (_sym(0, "max", 2**63), r"symbols\[0\]\.max: \d+ is above the maximum"),
    (_sym(1, "max", 0), r"symbols\[1\]\.max: 0 is below min \(1\)"),
    (lambda m: m["symbols"][0].pop("sources"), r"symbols\[0\]: missing required key 'sources'"),
    (_sym(0, "sources", []), r"symbols\[0\]\.sources: input symbol 'batch' needs at least one source"),
    (_sym(2, "sources", [[0, 0]]), r"symbols\[2\]\.sources: data symbol 'n' must have no sources"),
    (_sym(1, "sources", [[0, 1], [0]]),
     r"symbols\[1\]\.sources\[1\]: expected \[input_index, dim\], got a list of 1"),
    (_sym(1, "sources", [[0, 1], [1, "0"]]), r"symbols\[1\]\.sources\[1\]\[1\]: expected an int, got str"),
    (_sym(1, "sources", [[0, 1], [0, 1]]), r"symbols\[1\]\.sources\[1\]: duplicate source \[0, 1\]"),
    (_sym(1, "sources", [[0, 1], [1, 0], [2, 0]]),
     r"symbols\[1\]\.sources\[2\]: input 2 does not exist \(there are 2 inputs\)"),
    (_sym(1, "sources", [[0, 1], [1, 0], [1, 3]]),
     r"symbols\[1\]\.sources\[2\]: dim 3 is out of range for inputs\[1\] of rank 1"),
    (_sym(1, "sources", [[0, 1], [1, 0], [0, 2]]),
     r"symbols\[1\]\.sources\[2\]: inputs\[0\]\.shape\[2\] is 16, not the symbol 'seq'"),
    (_sym(1, "sources", [[0, 1], [1, 0], [0, 0]]),
     r"symbols\[1\]\.sources\[2\]: inputs\[0\]\.shape\[0\] is 'batch', not the symbol 'seq'"),
    # input shapes
    (_set(["inputs", 0, "shape", 0], "batches"),
     r"inputs\[0\]\.shape\[0\]: 'batches' is not a declared symbol"),
    (_set(["inputs", 0, "shape", 2], "n"),
     r"inputs\[0\]\.shape\[2\]: 'n' is a data symbol; input dims are ints or input symbols"),
    (_set(["inputs", 1, "shape"], ["batch"]),
     r"inputs\[1\]\.shape\[0\]: symbol 'batch' does not list \[1, 0\] among its sources"),
    (_set(["inputs", 0, "shape", 2], ["+", "seq", 1]),
     r"inputs\[0\]\.shape\[2\]: expected an int or an input symbol name, got list"),
    (_set(["inputs", 0, "shape", 2], -16), r"inputs\[0\]\.shape\[2\]: -16 is below the minimum 0"),
    (_set(["inputs", 1, "shape"], [12]),
     r"symbols\[1\]\.sources\[1\]: inputs\[1\]\.shape\[0\] is 12, not the symbol 'seq'"),
    # output shapes (shape expressions)
    (_set(["outputs", 0, "shape", 1], ["+", "sequence", 1]),
     r"outputs\[0\]\.shape\[1\]\[1\]: 'sequence' is not a declared symbol"),
    (_set(["outputs", 0, "shape", 1], ["%", "seq", 2]),
     r"outputs\[0\]\.shape\[1\]\[0\]: unknown operator '%'"),
    (_set(["outputs", 0, "shape", 1], ["+", "seq"]),
     r"outputs\[0\]\.shape\[1\]: expected \[op, a, b\], got a list of 2"),
    (_set(["outputs", 0, "shape", 1], ["-", "seq", -1]), r"outputs\[0\]\.shape\[1\]\[2\]: -1 is negative"),
    (_set(["outputs", 0, "shape", 1], ["*", "seq", True]),
     r"outputs\[0\]\.shape\[1\]\[2\]: expected an int, a symbol name or \[op, a, b\], got bool"),
    (_set(["outputs", 0, "shape", 1], 1.5),
     r"outputs\[0\]\.shape\[1\]: expected an int, a symbol name or \[op, a, b\], got float"),
    (_set(["outputs", 0, "shape", 1], _nest(MAX_EXPR_DEPTH + 1)),
     rf"shape expression nests deeper than {MAX_EXPR_DEPTH}"),
    (_set(["outputs", 1, "shape"], [2, "n"]),
     r"outputs\[1\]\.shape\[1\]: 'n' uses data symbol 'n', which may only appear in dim 0"),
    (_set(["outputs", 0, "shape", 2], ["max", "n", 1]),
     r"outputs\[0\]\.shape\[2\]: 'max\(n, 1\)' uses data symbol 'n'"),
    # table extents and words
    (lambda m: m["table"].pop("extents"), r"table: missing required key 'extents'"),
    (_set(["table", "extents", "offset"], 204), r"table\.extents\.offset: 204 is not a multiple of 8"),
    (_set(["table", "extents", "count"], 2),
     r"table\.extents\.count: 2, but the manifest declares 3 symbols"),
    (_set(["table", "extents", "offset"], 208),
     r"table\.extents: extents bytes \[208, 232\) exceed the table \(224 bytes\)"),
    (_set(["table", "extents", "offset"], 184),
     r"table\.extents: extents bytes \[184, 208\) overlap table\.slots\[3\] \[160, 200\)"),
    (_set(["table", "extents", "offset"], 48),
     r"table\.extents: extents bytes \[48, 72\) overlap table\.slots\[0\] \[0, 56\)"),
    (_set(["graphs", 1, "nodes", 2, "args", 2, "nbytes"], 32),
     r"graphs\[1\]\.nodes\[2\]\.args\[2\]: table range \[200, 232\) exceeds the table"),
    # buckets
    (lambda m: m["graphs"][0].pop("bucket"), r"graphs\[0\]: missing required key 'bucket'"),
    (lambda m: m["graphs"][2]["bucket"].pop("n"), r"graphs\[2\]\.bucket: missing the bound of symbol 'n'"),
    (_set(["graphs", 2, "bucket", "heads"], 4), r"graphs\[2\]\.bucket: 'heads' is not a declared symbol"),
    (_set(["graphs", 1, "bucket", "seq"], 512),
     r"graphs\[1\]\.bucket\.seq: bound 512 is outside the range \[1, 256\] of symbol 'seq'"),
    (_set(["graphs", 1, "bucket", "batch"], 0),
     r"graphs\[1\]\.bucket\.batch: bound 0 is outside the range \[1, 8\]"),
    (_set(["graphs", 1, "bucket", "n"], -1), r"graphs\[1\]\.bucket\.n: -1 is below the minimum 0"),
    (_set(["graphs", 1, "bucket", "seq"], "256"), r"graphs\[1\]\.bucket\.seq: expected an int, got str"),
    (_set(["graphs", 1, "bucket", "seq"], 128),
     r"graphs\[1\]\.bucket: same input-symbol bounds as graphs\[0\] \(batch=1, seq=128\)"),
    (_add_graph(8, 256, 5),
     r"graphs\[4\]\.bucket: same input-symbol bounds as graphs\[3\] \(batch=8, seq=256\)"),
    # per-graph arena
    (lambda m: m["graphs"][0].pop("arena"), r"graphs\[0\]: missing required key 'arena'"),
    (_set(["graphs", 0, "arena"], 10**6),
     r"graphs\[0\]\.arena: 1000000 bytes exceed regions\.arena \(131072 bytes\)"),
    (_set(["graphs", 0, "arena"], 4096),
     r"graphs\[0\]\.nodes\[1\]\.args\[4\]: arena range \[0, 8192\) exceeds the graph's arena \(4096 bytes\)"),
]


@pytest.mark.parametrize("fn, match", BAD_DYN_MANIFESTS)
def test_validate_dyn_manifest_rejects(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(_dyn(fn))


@pytest.mark.parametrize("fn, match", [
    (lambda m: m["graphs"].append({**copy.deepcopy(m["graphs"][0]), "name": "second"}),
     r"graphs: a package without symbols has exactly one graph, got 2"),
    (_set(["graphs", 0, "bucket"], {"seq": 4}), r"graphs\[0\]\.bucket: 'seq' is not a declared symbol"),
    (_set(["graphs", 0, "arena"], 2048),
     r"graphs\[0\]\.arena: 2048 bytes exceed regions\.arena \(1024 bytes\)"),
    (_set(["table", "extents", "count"], 1),
     r"table\.extents\.count: 1, but the manifest declares 0 symbols"),
    (_set(["table", "extents", "offset"], 104),
     r"table\.extents: extents bytes \[104, 104\) exceed the table"),
])
def test_validate_static_manifest_rejects(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(mutate(fn))


def test_reader_rejects_bad_dyn_manifest_written_without_validation():
    m = _dyn(_set(["graphs", 1, "bucket", "seq"], 512))
    with pytest.raises(ManifestError, match=r"graphs\[1\]\.bucket\.seq: bound 512"):
        read_package(packed(m, make_dyn_sections()))


def test_dyn_manifest_variants_that_stay_valid():
    """Rules that are deliberately permissive: expressions everywhere, data bounds free."""
    validate_manifest(_dyn(_set(["outputs", 0, "shape", 1], ["//", ["*", "seq", "batch"], ["max", 1, "seq"]])))
    validate_manifest(_dyn(_set(["outputs", 1, "shape", 0], ["min", "n", ["*", "batch", "seq"]])))
    validate_manifest(_dyn(_set(["outputs", 0, "shape", 1], _nest(MAX_EXPR_DEPTH))))
    validate_manifest(_dyn(_set(["graphs", 0, "bucket", "n"], 10**9)))  # data bounds: any int >= 0
    validate_manifest(_dyn(_set(["outputs", 0, "shape", 1], 7)))  # a static output dim
    validate_manifest(_dyn(_rename_batch("s0.batch_2")))  # dots and digits are identifier-like
    # ... but a rename must reach every use; a bucket key left behind is caught:
    with pytest.raises(ManifestError, match=r"graphs\[0\]\.bucket: missing the bound of symbol 'b'"):
        validate_manifest(_dyn(_rename_batch("b", buckets=False)))


def _rename_batch(new: str, buckets: bool = True):
    def fn(m):
        m["symbols"][0]["name"] = new
        m["inputs"][0]["shape"][0] = new
        m["outputs"][0]["shape"][0] = new
        for g in m["graphs"] if buckets else []:
            g["bucket"][new] = g["bucket"].pop("batch")
    return fn


# ---- shape expressions and graph selection (pure functions the runtime imports) ---------------


@pytest.mark.parametrize("expr, values, expected", [
    (7, {}, 7),
    ("s", {"s": 5}, 5),
    (["+", "s", 1], {"s": 5}, 6),
    (["-", "s", 1], {"s": 0}, -1),  # may go negative: the caller decides
    (["*", "b", "s"], {"b": 3, "s": 5}, 15),
    (["//", "s", 2], {"s": 7}, 3),
    (["//", ["-", 0, "s"], 2], {"s": 7}, -4),  # floor division, like torch's FloorDiv
    (["max", ["-", "s", 4], 0], {"s": 2}, 0),
    (["min", "n", ["*", "b", "s"]], {"n": 100, "b": 2, "s": 8}, 16),
    (("+", ("*", "b", "s"), 1), {"b": 2, "s": 3}, 7),  # tuples work too
])
def test_eval_shape_expr(expr, values, expected):
    assert eval_shape_expr(expr, values) == expected


def test_eval_shape_expr_errors():
    """A missing symbol is the caller's bug (KeyError); a division by zero or a value outside
    int64 at these values is the package's (ManifestError), never a ZeroDivisionError."""
    with pytest.raises(KeyError):
        eval_shape_expr(["+", "s", 1], {})
    with pytest.raises(ManifestError, match="divides by zero"):
        eval_shape_expr(["//", 4, "s"], {"s": 0})
    with pytest.raises(ManifestError, match="outside int64"):
        eval_shape_expr(["*", "s", ["*", "s", "s"]], {"s": 2**22})
    assert eval_shape_expr(["*", "s", "s"], {"s": 2**31}) == 2**62


def test_expr_symbols():
    assert expr_symbols(3) == set()
    assert expr_symbols("s") == {"s"}
    assert expr_symbols(["max", ["*", "b", "s"], ["+", "s", "n"]]) == {"b", "s", "n"}


@pytest.mark.parametrize("expr, text", [
    (4, "4"), ("seq", "seq"),
    (["+", "seq", 1], "seq + 1"),
    (["+", ["*", "b", "s"], 1], "b*s + 1"),
    (["*", ["+", "s", 1], "b"], "(s + 1)*b"),
    (["-", "s", ["+", "a", 1]], "s - (a + 1)"),
    (["-", ["-", "s", "a"], 1], "s - a - 1"),
    (["//", "s", ["*", 2, "b"]], "s//(2*b)"),
    (["max", ["-", "s", 4], 0], "max(s - 4, 0)"),
])
def test_format_shape_expr(expr, text):
    assert format_shape_expr(expr) == text


def test_check_shape_expr_depth_is_bounded():
    check_shape_expr(_nest(MAX_EXPR_DEPTH), "e", {"seq"})
    with pytest.raises(ManifestError, match=f"nests deeper than {MAX_EXPR_DEPTH}"):
        check_shape_expr(_nest(MAX_EXPR_DEPTH + 1), "e", {"seq"})
    with pytest.raises(ManifestError, match=f"nests deeper than {MAX_EXPR_DEPTH}"):
        check_shape_expr(_nest(5000), "e", {"seq"})  # no RecursionError on a hostile manifest


def test_select_graph_smallest_covering_bucket():
    graphs = make_dyn_manifest()["graphs"]  # (1,128) (1,256) (8,128) (8,256)
    inputs = ["batch", "seq"]
    assert select_graph(graphs, inputs, {"batch": 1, "seq": 1}) == 0
    assert select_graph(graphs, inputs, {"batch": 1, "seq": 128}) == 0
    assert select_graph(graphs, inputs, {"batch": 1, "seq": 129}) == 1
    assert select_graph(graphs, inputs, {"batch": 2, "seq": 100}) == 2
    assert select_graph(graphs, inputs, {"batch": 8, "seq": 256}) == 3
    assert select_graph(graphs, inputs, {"batch": 9, "seq": 1}) is None
    # smallest product of bounds wins, the first one on ties
    tie = [{"bucket": {"a": 4, "b": 1}}, {"bucket": {"a": 1, "b": 4}}, {"bucket": {"a": 2, "b": 2}}]
    assert select_graph(tie, ["a", "b"], {"a": 1, "b": 1}) == 0
    assert select_graph(tie, ["a", "b"], {"a": 2, "b": 1}) == 0
    assert select_graph(tie, ["a", "b"], {"a": 1, "b": 2}) == 1
    assert select_graph(tie, ["a", "b"], {"a": 2, "b": 2}) == 2
    assert select_graph([{"bucket": {}}], [], {}) == 0


# ---------------------------------------------------------------------------------------------
# Limits (SPEC §2.1, grace.formats.limits): every count, size, depth and integer is capped


def _each_kernel(key, value):
    def fn(m):
        for k in m["kernels"]:
            k[key] = value
    return fn


def _nested_map(depth):
    obj = {}
    for _ in range(depth - 1):
        obj = {"a": obj}
    return obj


LIMIT_MANIFESTS = [
    # the crashes: each is a ManifestError now, before anything is allocated
    (_each_kernel("hidden_params", 2**26), rf"hidden_params: 67108864 is above the maximum {limits.MAX_HIDDEN_PARAMS}"),
    (_each_kernel("shared", 2**31), rf"shared: 2147483648 is above the maximum {limits.MAX_SHARED_NBYTES}"),
    (_each_kernel("shared", limits.MAX_SHARED_NBYTES + 1), r"shared: 232449 is above the maximum 232448"),
    (_set(["regions", "arena"], 2**63), r"regions\.arena: \d+ is above the maximum 1099511627776"),
    (_set(["regions", "weights"], 2**40 + 1), r"regions\.weights: 1099511627777 is above"),
    (_set(["outputs", 0, "shape", 0], ["//", 2, 0]), r"outputs\[0\]\.shape\[0\]: divides by 0, which is 0"),
    (_set(["outputs", 0, "shape", 0], ["//", 2, ["-", 3, 3]]), r"divides by 3 - 3, which is 0"),
    (_set(["outputs", 0, "shape", 0], ["*", 2**40, 2**40]),
     r"outputs\[0\]\.shape\[0\]: .* may compute values beyond int64"),
    (_set(["outputs", 0, "shape", 0], 2**40), r"outputs\[0\]\.shape: output 'out0' at the largest bounds spans more than"),
    (_set(["inputs", 0, "shape", 0], 2**62), r"inputs\[0\]\.shape: input 'x' at the largest bounds spans more than"),
    (_set(["weights", 0, "shape"], [1] * 65), r"weights\[0\]\.shape: 65 entries, above the limit of 64"),
    (_set(["weights", 0, "shape"], [0, 2**62]), r"weights\[0\]\.shape: float32\[0, \d+\] spans more than"),
    (_set(["graphs", 0, "nodes", 1, "grid"], [2**31, 1, 1]), r"grid\[0\]: 2147483648 is above the maximum"),
    (_set(["kernels", 1, "num_stages"], 65), r"num_stages: 65 is above the maximum 64"),
    (_set(["kernels", 1, "global_scratch_size"], 2**41), r"global_scratch_size: \d+ is above the maximum"),
    (_set(["kernels", 1, "name"], "k mm"), r"kernels\[1\]\.name: 'k mm' is not a C identifier"),
    (_set(["kernels", 1, "name"], "k" * 256), r"is not a C identifier of at most 255 characters"),
    (_set(["kernels", 0, "params"], [{"name": f"p{i}", "type": "*fp32"} for i in range(4094)]),
     r"kernels\[0\]\.params: 4094 parameters and 2 hidden ones, above the limit of 4095"),
    (_set(["kernels", 1, "params"], [{"name": f"p{i}", "type": "*fp32"} for i in range(4096)]),
     r"kernels\[1\]\.params: 4096 entries, above the limit of 4095"),
    (_set(["archs"], [f"sm_{i}" for i in range(17)]), r"archs: 17 entries, above the limit of 16"),
    (_set(["arena_buffers"], [{"name": "b", "offset": 0, "nbytes": 0}] * (limits.MAX_TENSORS + 1)),
     rf"arena_buffers: {limits.MAX_TENSORS + 1} entries, above the limit"),
    (_set(["arena_buffers", 0, "last"], 2**63), r"arena_buffers\[0\]\.last: \d+ is above the maximum"),
    (_set(["format_version"], [3, 2**16]), r"format_version: expected \[major, minor\] \(u16 each\)"),
    (lambda m: m["graphs"][0]["nodes"].extend([m["graphs"][0]["nodes"][1]] * limits.MAX_NODES),
     rf"graphs\[0\]\.nodes: {limits.MAX_NODES + 2} entries, above the limit of {limits.MAX_NODES}"),
]


@pytest.mark.parametrize("fn, match", LIMIT_MANIFESTS)
def test_validate_manifest_enforces_the_limits(fn, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(mutate(fn))


@pytest.mark.parametrize("fn, match", [
    (_sym(0, "max", 2**63 - 1), None),   # allowed: the graphs' bounds are what sizes are computed at
    (_set(["graphs", 3, "bucket", "n"], 2**62), r"outputs\[1\]\.shape: output 'idx' at the largest bounds spans"),
    (_set(["outputs", 1, "shape", 0], ["*", "n", ["*", "n", ["*", "n", ["*", "n", "n"]]]]),   # 2**75
     r"outputs\[1\]\.shape\[0\]: .* may compute values beyond int64"),
    (_set(["outputs", 1, "shape", 0], ["//", ["*", "n", ["*", "n", ["*", "n", ["*", "n", "n"]]]], 2**70]),
     r"may compute values beyond int64"),   # an intermediate value overflows, the result would not
    (_set(["outputs", 0, "shape", 1], ["*", "seq", ["*", "seq", ["*", "seq", ["*", "seq", "seq"]]]]),
     r"outputs\[0\]\.shape: output 'out0' at the largest bounds spans more than"),   # 2**40 * 4 bytes
    (_set(["symbols"], [{"name": f"s{i}", "kind": "data", "min": 0, "max": 1, "sources": []} for i in range(65)]),
     r"symbols: 65 entries, above the limit of 64"),
])
def test_shape_limits_hold_at_the_bounds_the_graphs_serve(fn, match):
    """I/O sizes are bounded at the largest bucket bound of each symbol (a larger value selects no
    graph), not at the symbol's declared max."""
    m = _dyn(fn)
    if match is None:
        validate_manifest(m)
        return
    with pytest.raises(ManifestError, match=match):
        validate_manifest(m)


def test_shape_magnitude_bounds_every_intermediate_value():
    from grace.formats.shapes import expr_magnitude

    assert expr_magnitude(["+", "s", 1], {"s": 10}) == (11, 11)
    assert expr_magnitude(["-", 0, "s"], {"s": 10}) == (10, 10)
    assert expr_magnitude(["//", ["*", "s", "s"], "s"], {"s": 10}) == (100, 100)
    assert expr_magnitude(["*", ["*", "s", "s"], 0], {"s": 10}) == (0, 100)   # 0 at the top, 100 inside
    assert expr_magnitude(["max", 3, ["min", "s", 7]], {"s": 10}) == (10, 10)
    top, peak = expr_magnitude(["*", 2**63, 2**63], {})
    assert top == peak == 2**64   # saturated: anything past int64 is refused anyway


def _decode(blob):
    return read_package(pack_package_bytes(blob, make_sections()))


def test_manifest_nesting_is_capped():
    """Deep informative maps (model, options, stats) are refused by the reader: inspect's JSON and
    msgpack.packb recurse over them."""
    ok = {**make_manifest(), "format_version": list(FORMAT_VERSION), "model": _nested_map(limits.MAX_MANIFEST_DEPTH - 1)}
    assert read_package(packed(ok)).manifest["model"]
    deep = {**ok, "model": _nested_map(limits.MAX_MANIFEST_DEPTH)}
    with pytest.raises(FormatError, match=r"nests maps and arrays deeper than 32 levels"):
        read_package(packed(deep))
    with pytest.raises(FormatError, match="not valid msgpack"):   # msgpack's own stack: 1024
        _decode(b"\x81\xa1a" * 2000 + b"\x80")


def test_manifest_item_count_is_capped_while_decoding():
    """A byte of msgpack can become a 64-byte dict: 2**21 empty maps (2 MB) would take the reader
    to ~150 MB. The decode stops once it has built MAX_MANIFEST_ITEMS items."""
    import time
    import tracemalloc

    n = limits.MAX_MANIFEST_ITEMS // 2 + 1   # n maps + their n entries + the list: over the cap
    blob = msgpack.packb({"model": [{} for _ in range(n)]})
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=rf"more than {limits.MAX_MANIFEST_ITEMS} items"):
            _decode(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 400 << 20, peak
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("blob, match", [
    (msgpack.packb({"a": "x" * (limits.MAX_MANIFEST_STR + 1)}), "not valid msgpack"),
    (msgpack.packb({"a": b"x" * (limits.MAX_MANIFEST_STR + 1)}, use_bin_type=True), "not valid msgpack"),
])
def test_manifest_strings_are_capped(blob, match):
    with pytest.raises(FormatError, match=match):
        _decode(blob)


def test_manifest_size_is_capped():
    blob = msgpack.packb({"a": ["x" * 1000] * (limits.MAX_MANIFEST_NBYTES // 1000 + 1)})
    with pytest.raises(FormatError, match=r"manifest is \d+ bytes, above the 67108864-byte limit"):
        _decode(blob)


def test_safetensors_header_is_bounded_before_json_builds_it():
    header = b'{"__metadata__":{"a":"' + b"[]," * limits.MAX_SAFETENSORS_CONTAINERS + b'"}}'
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header)) + header
    with pytest.raises(FormatError, match=r"safetensors header has \d+ brackets"):
        decode_weights(blob)
    big = struct.pack("<Q", limits.MAX_SAFETENSORS_HEADER + 8) + bytes(limits.MAX_SAFETENSORS_HEADER + 8)
    with pytest.raises(FormatError, match="is above the limit"):
        decode_weights(big)
    deep_shape = encode_weights({"w": ("float32", (1,) * 64, b"\0" * 4)})
    assert decode_weights(deep_shape)["w"][1] == (1,) * 64
    with pytest.raises(FormatError, match="at most 64"):
        encode_weights({"w": ("float32", (1,) * 65, b"\0" * 4)})


def test_missing_hidden_params_means_zero():
    """SPEC: absent optional ints are 0 (the issue's KeyError: 'hidden_params')."""
    m = make_manifest()
    for k in m["kernels"]:
        k.pop("hidden_params", None)
    assert all(k.hidden_params == 0 for k in as_view(m).kernels)


# ---------------------------------------------------------------------------------------------
# Fuzzing: only FormatError may escape


@pytest.fixture(params=["static", "buckets"])
def any_pkg_bytes(request, tmp_path) -> bytes:
    """Both a static package and a shape-bucket one, for the fuzz loops."""
    path = tmp_path / "m.grace"
    if request.param == "static":
        write_package(path, make_manifest(), make_sections())
    else:
        write_package(path, make_dyn_manifest(), make_dyn_sections())
    return path.read_bytes()


def _flip_bytes(rng, data: bytearray, span: int, count: int) -> None:
    """XOR `count` distinct bytes among the first `span` with non-zero masks: the result always
    differs from the input (assigning a random byte may rewrite the byte that was there)."""
    for pos in rng.sample(range(min(span, len(data))), min(count, span, len(data))):
        data[pos] ^= rng.randrange(1, 256)


def test_fuzz_random_byte_mutations(any_pkg_bytes):
    rng = random.Random(1234)
    for _ in range(300):
        data = bytearray(any_pkg_bytes)
        kind = rng.random()
        if kind < 0.6:
            _flip_bytes(rng, data, len(data), rng.randint(1, 8))
        elif kind < 0.8:  # aim at the header and index, where lengths and offsets live
            _flip_bytes(rng, data, HEADER_NBYTES + 300, rng.randint(1, 4))
        else:  # cut a run of bytes out of the file itself (not out of a temporary slice of it)
            start = rng.randrange(len(data))
            del data[start:start + rng.randint(1, 64)]
        assert data != any_pkg_bytes  # every mutant is a different file
        read_only_format_errors(bytes(data))


@pytest.mark.parametrize("make", [make_manifest, make_dyn_manifest])
def test_fuzz_manifest_bytes_with_valid_hashes(make):
    """Mutate the msgpack itself and re-pack, so decoding and validation see the damage."""
    rng = random.Random(99)
    blob = msgpack.packb({"format_version": list(FORMAT_VERSION), **make()}, use_bin_type=True)
    sections = make_dyn_sections()
    for _ in range(300):
        b = bytearray(blob)
        _flip_bytes(rng, b, len(b), rng.randint(1, 6))
        assert b != blob
        read_only_format_errors(pack_package_bytes(bytes(b), sections))


@pytest.mark.parametrize("make", [make_manifest, make_dyn_manifest])
def test_fuzz_manifest_structure(make):
    fuzz_manifest_tree(make(), make_dyn_sections(), seed=7)


FUZZ_JUNK = [None, -1, 0, 2**64 - 1, 1.5, "x", b"\x00", [], {}, [1, 2, 3], {"region": "arena"},
             {"region": "state", "offset": 0, "nbytes": 8}, "data", "zeros",
             {"word": -1}, True, "sm_90", [0, 0, 0], "seq", "n", ["+", "seq", 1], ["//", 1, 0],
             [0, 7], {"seq": 128}, _nest(40)]


def fuzz_manifest_tree(base: dict, sections: dict, seed: int, rounds: int = 600) -> None:
    """Replace random nodes of the manifest tree with values of random types; only ManifestError
    (from the validator) and FormatError (from the reader) may come out."""
    rng = random.Random(seed)
    for _ in range(rounds):
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
                obj[key] = copy.deepcopy(rng.choice(FUZZ_JUNK))  # shared junk could form cycles
                break
        try:
            validate_manifest(m)
        except ManifestError:
            pass
        read_only_format_errors(packed(m, sections))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """formats.atomic.replacing, under write_package and sign_package: an error inside the block
    leaves the file at the path as it was and removes the temporary one; success replaces it
    whole, with the mode asked for."""
    from grace.formats.atomic import replacing
    path = tmp_path / "m.grace"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with replacing(path) as f:
            f.write(b"new, half")
            raise RuntimeError("midway")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.grace"]
    with replacing(path, 0o600) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" and os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.grace"]
