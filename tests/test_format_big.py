"""Big packages (format 3.1): weights streamed into the file without a second copy in memory, the
safetensors bytes exactly as the library writes them, chunk-hash companions (`sha256/<section>`)
that let a reader verify a multi-GB section on every core, and what a reader does with a bad one.
HASH_CHUNK_NBYTES is shrunk in most tests so that small sections have companions."""
from __future__ import annotations

import hashlib
import io
import struct
import tracemalloc

import numpy as np
import pytest
import safetensors

from grace.formats import (FORMAT_VERSION, ChecksumError, FormatError, TensorBlob, decode_weights, encode_weights,
                           read_package, write_package)
from grace.formats import container
from grace.formats.dtypes import DTYPES
from grace.formats.package import pack_package_bytes

from test_format import make_manifest, make_sections


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i, (dtype, (size, _)) in enumerate(DTYPES.items()):
        for j, shape in enumerate([(), (0,), (3,), (2, 5)]):
            n = int(np.prod(shape, dtype=np.int64)) * size
            out[f"t{i}.{j}.é"] = (dtype, shape, rng.integers(0, 256, n, dtype=np.uint8))
    return out


def test_tensor_blob_is_byte_identical_to_safetensors_serialize():
    """Every dtype, 0-d, empty and non-ASCII names: the streamed blob is what the library writes."""
    tensors = _tensors()
    ours = bytes(TensorBlob(tensors))
    ref = bytes(safetensors.serialize({
        k: safetensors.TensorSpec(dtype=d, shape=list(s), data_ptr=a.ctypes.data, data_len=a.nbytes)
        for k, (d, s, a) in tensors.items()}))
    assert ours == ref
    assert encode_weights(tensors) == ref
    decoded = decode_weights(ours)
    for k, (d, s, a) in tensors.items():
        assert decoded[k][:2] == (d, tuple(s)) and bytes(decoded[k][2]) == a.tobytes()


def test_tensor_blob_describes_itself_without_copying():
    data = np.arange(1000, dtype=np.float32)
    blob = TensorBlob({"w": ("float32", (10, 100), data)})
    assert blob.tensors == {"w": ("float32", (10, 100))}
    header, view = list(blob.chunks())
    assert blob.nbytes == header.nbytes + data.nbytes
    assert np.frombuffer(view, np.float32).ctypes.data == data.ctypes.data   # a view, not a copy


def test_streamed_and_bytes_sections_write_the_same_file(tmp_path, monkeypatch):
    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 4096)
    from test_format import B, W
    a = make_sections()   # weights as bytes
    b = {**a, "weights": TensorBlob({"fc.weight": ("float32", (16, 4), W),
                                     "fc.bias": ("bfloat16", (4,), np.frombuffer(B, np.uint8))})}
    write_package(tmp_path / "a.grace", make_manifest(), a)
    write_package(tmp_path / "b.grace", make_manifest(), b)
    assert (tmp_path / "a.grace").read_bytes() == (tmp_path / "b.grace").read_bytes()


def test_writing_big_weights_does_not_copy_them(tmp_path):
    """48 MB of weights go to disk with a few MB of Python allocations at most (tracemalloc counts
    every bytes object and numpy buffer a copy would make)."""
    big = np.random.default_rng(2).integers(0, 256, 48 << 20, dtype=np.uint8)
    sections = make_sections()
    manifest = make_manifest()
    manifest["weights"] = [{"name": "fc.weight", "dtype": "uint8", "shape": [big.size],
                            "offset": 0, "nbytes": big.size}]
    manifest["regions"]["weights"] = big.size
    sections["weights"] = TensorBlob({"fc.weight": ("uint8", (big.size,), big)})
    tracemalloc.start()
    try:
        write_package(tmp_path / "big.grace", manifest, sections)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"writing allocated {peak / 2**20:.1f} MiB for 48 MiB of weights"
    pkg = read_package(tmp_path / "big.grace")
    assert bytes(decode_weights(pkg.section("weights"))["fc.weight"][2]) == big.tobytes()


def test_big_sections_get_a_companion_of_chunk_hashes(tmp_path, monkeypatch):
    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 64)
    sections = make_sections()
    write_package(tmp_path / "m.grace", make_manifest(), sections)
    pkg = read_package(tmp_path / "m.grace")
    names = pkg.section_names
    for name, data in sections.items():
        data = memoryview(data).cast("B")
        if data.nbytes <= 64:
            assert "sha256/" + name not in names
            continue
        assert names.index("sha256/" + name) == names.index(name) + 1
        table = bytes(pkg.section("sha256/" + name))
        assert struct.unpack_from("<Q", table)[0] == 64
        expect = [hashlib.sha256(data[i:i + 64]).digest() for i in range(0, data.nbytes, 64)]
        assert table[8:] == b"".join(expect)


def _flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def test_a_flipped_byte_names_its_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 64)
    path = tmp_path / "m.grace"
    write_package(path, make_manifest(), make_sections())
    data = path.read_bytes()
    pkg = read_package(data)
    _, offset, nbytes, _ = next(s for s in pkg.section_info if s[0] == "weights")
    last = (nbytes - 1) // 64   # flip the last byte of a weight: the last chunk
    with pytest.raises(ChecksumError, match=rf"section 'weights' \(chunk {last}, "
                                            rf"bytes {64 * last}\.\.{nbytes}\)"):
        read_package(_flip(data, offset + nbytes - 1))
    read_package(_flip(data, offset + nbytes - 1), verify=False)   # R10 is what catches it


def test_a_reader_verifies_the_companion_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 64)
    path = tmp_path / "m.grace"
    write_package(path, make_manifest(), make_sections())
    data = path.read_bytes()
    info = {s[0]: s for s in read_package(data).section_info}
    _, offset, _, _ = info["sha256/weights"]
    with pytest.raises(ChecksumError, match="sha256/weights"):
        read_package(_flip(data, offset + 20))


def _repacked(sections, companion: bytes) -> bytes:
    """A package whose `sha256/weights` companion is `companion` (index hashes all correct)."""
    import msgpack
    manifest = {**make_manifest(), "format_version": list(FORMAT_VERSION)}
    return pack_package_bytes(msgpack.packb(manifest, use_bin_type=True),
                              {**sections, "sha256/weights": companion})


@pytest.mark.parametrize("make_companion, match", [
    (lambda w: b"", "is not a chunk size"),
    (lambda w: struct.pack("<Q", 0), "is not a chunk size"),
    (lambda w: struct.pack("<Q", 64) + bytes(32), "is not a chunk size"),   # too few digests
    (lambda w: struct.pack("<Q", 1 << 40) + bytes(64), "is not a chunk size"),   # too many
])
def test_malformed_companions_are_rejected(make_companion, match):
    sections = make_sections()
    data = _repacked(sections, make_companion(sections["weights"]))
    with pytest.raises(FormatError, match=match):
        read_package(data)


def test_a_companion_with_wrong_digests_is_a_checksum_error():
    sections = make_sections()
    n = len(sections["weights"])
    data = _repacked(sections, struct.pack("<Q", 64) + bytes(32 * -(-n // 64)))
    with pytest.raises(ChecksumError, match=r"section 'weights' \(chunk 0"):
        read_package(data)


def test_a_companion_written_by_hand_that_matches_is_accepted():
    """The companion is a rule of the format, not of our writer: any chunk size works."""
    sections = make_sections()
    w = sections["weights"]
    table = struct.pack("<Q", 100) + b"".join(
        hashlib.sha256(w[i:i + 100]).digest() for i in range(0, len(w), 100))
    assert read_package(_repacked(sections, table)).section("weights") == w


def test_writer_reserves_companion_names(tmp_path, monkeypatch):
    sections = {**make_sections(), "sha256/weights": b"x"}
    with pytest.raises(FormatError, match="sha256/"):
        write_package(tmp_path / "m.grace", make_manifest(), sections)
    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 64)   # the raw writer: only a collision
    with pytest.raises(FormatError, match="is the chunk hashes of 'weights'"):
        container.write_container(io.BytesIO(), b"\x80", sections)


def test_writer_needs_a_seekable_file():
    class Pipe(io.RawIOBase):
        def writable(self): return True
        def seekable(self): return False
    with pytest.raises(FormatError, match="seekable"):
        container.write_container(Pipe(), b"\x80", {"a": b"1"})


def test_a_stream_that_lies_about_its_size_is_refused(tmp_path):
    class Liar:
        nbytes = 10
        def chunks(self): yield memoryview(b"12345")
    with pytest.raises(FormatError, match="produced 5 bytes, but declared 10"):
        container.write_container(io.BytesIO(), b"\x80", {"a": Liar()})


def test_tied_weights_are_stored_once(tmp_path):
    """An LM head tied to the embedding table is one weight in the package, and the package still
    computes what eager does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from grace.aot import compile as grace_compile
    from grace.tools.interpret import run_package

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.mix = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.tanh(self.mix(self.emb(x))))

    torch.manual_seed(0)
    model = Tied().eval()
    x = torch.randint(0, 50, (2, 7))
    path = grace_compile(model, (x,), output=tmp_path / "tied.grace", progress=False,
                         fp32_matmul="ieee")
    manifest = read_package(path).manifest
    names = [w["name"] for w in manifest["weights"]]
    assert names.count("emb.weight") == 1 and "head.weight" not in names
    assert manifest["regions"]["weights"] < 2 * 50 * 16 * 4
    got = run_package(path, {"x": x.numpy()})
    with torch.no_grad():
        ref = model(x).double().numpy()
    out = np.asarray(next(iter(got.values())), np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
