"""Signed packages (SPEC §7, grace.formats.signing): keys, the signed message, sign/verify round
trips, refusal of every tampered byte, of other keys and of unsigned packages when keys are
required, the runtime refusing before the GPU is touched (FakeDriver), the CPU executor and the CLI.

Packages are small: the FakeDriver package of test_runtime_nogpu (fake cubins, written in
milliseconds) for everything that does not execute kernels, and the handmade package (real cubins,
compiled once per module) for `grace run --interpret`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("cryptography")

import grace.runtime as rt  # noqa: E402
from grace.formats import FormatError, read_package  # noqa: E402
from grace.formats import signing  # noqa: E402
from grace.formats.container import HEADER_NBYTES, parse_container  # noqa: E402
from grace.formats.signing import (SigningKeyError, SigningUnavailableError,  # noqa: E402
                                   UntrustedPackageError, read_trusted_package, sign_package)
from grace.runtime import driver  # noqa: E402
from grace.tools.cli import main  # noqa: E402

try:
    from test_runtime_nogpu import COLS, ROWS, WEIGHT, FakeDriver, write
except ImportError:  # tests/ imported as a package
    from tests.test_runtime_nogpu import COLS, ROWS, WEIGHT, FakeDriver, write

_ENTRY = struct.Struct("<QQ32sH")


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key pairs: {"alice": path, "alice.pub": path, "alice.raw": bytes, "bob": ...}."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("alice", "bob"):
        out[f"{name}.raw"] = signing.write_keypair(d / name)
        out[name], out[f"{name}.pub"] = str(d / name), str(d / f"{name}.pub")
    return out


@pytest.fixture(scope="module")
def packages(tmp_path_factory, keys):
    """The FakeDriver package unsigned, and signed by alice."""
    d = tmp_path_factory.mktemp("pkgs")
    unsigned = str(write(d / "m.grace"))
    signed = str(d / "signed.grace")
    sign_package(unsigned, keys["alice"], signed)
    return {"unsigned": unsigned, "signed": signed, "dir": d}


@pytest.fixture
def fake(monkeypatch):
    f = FakeDriver()
    monkeypatch.setattr(driver, "_cu", f)
    return f


def _layout(data: bytes) -> dict:
    """Header fields and index entries of a package's bytes: {index_offset, index_nbytes,
    manifest_offset, manifest_nbytes, entries: [(name, entry_pos, offset, nbytes)]}."""
    index_offset, index_nbytes, manifest_offset, manifest_nbytes, count = struct.unpack_from(
        "<QQQQI", data, 24)
    entries, pos = [], 0
    for _ in range(count):
        offset, nbytes, _, name_len = _ENTRY.unpack_from(data, index_offset + pos)
        start = index_offset + pos + _ENTRY.size
        entries.append((data[start:start + name_len].decode(), pos, offset, nbytes))
        pos += _ENTRY.size + name_len
    return {"index_offset": index_offset, "index_nbytes": index_nbytes,
            "manifest_offset": manifest_offset, "manifest_nbytes": manifest_nbytes,
            "entries": entries}


def rehash(data: bytearray) -> bytes:
    """Recompute every hash a reader checks (sections, index, manifest), as an attacker who
    edits a package would: only the signature can then tell."""
    lay = _layout(data)
    for _, pos, offset, nbytes in lay["entries"]:
        at = lay["index_offset"] + pos + 16
        data[at:at + 32] = hashlib.sha256(data[offset:offset + nbytes]).digest()
    m0 = lay["manifest_offset"]
    data[96:128] = hashlib.sha256(data[m0:m0 + lay["manifest_nbytes"]]).digest()
    i0 = lay["index_offset"]
    data[64:96] = hashlib.sha256(data[i0:i0 + lay["index_nbytes"]]).digest()
    return bytes(data)


def _section(data: bytes, name: str) -> tuple[int, int]:
    return next((off, n) for nm, _, off, n in _layout(data)["entries"] if nm == name)


# ---- keys ---------------------------------------------------------------------------------------

def test_keygen_writes_a_0600_pem_key_and_a_base64_public_key(keys, tmp_path):
    assert stat.S_IMODE(os.stat(keys["alice"]).st_mode) == 0o600
    pem = open(keys["alice"], "rb").read()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")      # PKCS#8, unencrypted
    text = open(keys["alice.pub"]).read()
    assert text.endswith("\n") and len(text.strip()) == 44
    raw = keys["alice.raw"]
    assert base64.b64decode(text) == raw and len(raw) == 32
    # the same key from the file, its text, raw bytes, and a PEM public key (openssl pkey -pubout)
    from cryptography.hazmat.primitives import serialization

    public = signing.load_private_key(keys["alice"]).public_key()
    (tmp_path / "a.pem").write_bytes(public.public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    for spec in (keys["alice.pub"], text.strip(), raw, tmp_path / "a.pem"):
        assert signing.parse_public_key(spec) == raw
    assert signing.fingerprint(raw) == "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]
    with pytest.raises(SigningKeyError, match="never overwritten"):
        signing.write_keypair(keys["alice"])


def test_bad_keys_are_typed_errors(keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    (tmp_path / "junk.pub").write_text("not a key\n")
    for spec, words in ((tmp_path / "junk.pub", "not a public key"), ("no/such.pub", "no such key file"),
                        (b"short", "32 bytes"), (42, "path, base64 text or 32 bytes"),
                        (base64.b64encode(bytes(31)).decode(), "no such key file")):
        with pytest.raises(SigningKeyError, match=words):
            signing.parse_public_key(spec)
    encrypted = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"))
    (tmp_path / "enc.key").write_bytes(encrypted)
    with pytest.raises(SigningKeyError, match="encrypted"):
        signing.load_private_key(tmp_path / "enc.key")
    with pytest.raises(SigningKeyError, match="not a PEM private key"):
        signing.load_private_key(keys["alice.pub"])
    with pytest.raises(SigningKeyError, match="empty"):
        signing.resolve_trusted_keys([])


# ---- the signature: layout and round trip ------------------------------------------------------

def test_signed_message_is_the_structure_with_two_hashes_zeroed(packages, keys):
    data = open(packages["signed"], "rb").read()
    lay = _layout(data)
    name, pos, off, nbytes = lay["entries"][-1]
    assert name == "signature" and nbytes == 104 and off % 4096 == 0      # last, one more section
    section = data[off:off + nbytes]
    assert section[:8] == b"ed25519\0" and section[8:40] == keys["alice.raw"]
    header, index = bytearray(data[:HEADER_NBYTES]), bytearray(
        data[lay["index_offset"]:lay["index_offset"] + lay["index_nbytes"]])
    header[64:96] = bytes(32)
    index[pos + 16:pos + 48] = bytes(32)
    message = b"grace package signature v1\0" + bytes(header) + bytes(index)
    buf = memoryview(data)
    assert signing.signed_message(buf, parse_container(buf)) == message
    # an independent check of SPEC §7.1: plain ed25519 over that message, by the embedded key
    from cryptography.hazmat.primitives.asymmetric import ed25519

    ed25519.Ed25519PublicKey.from_public_bytes(section[8:40]).verify(section[40:], message)


def test_round_trip_keeps_every_byte_of_the_package(packages, keys):
    with read_package(packages["unsigned"]) as plain, \
            read_trusted_package(packages["signed"], [keys["alice.pub"]]) as signed:
        assert signed.path == packages["signed"]
        assert signed.format_version == plain.format_version      # signing leaves the version alone
        assert signed.manifest == plain.manifest
        assert signed.section_names == plain.section_names + ["signature"]
        for name in plain.section_names:
            assert bytes(signed.section(name)) == bytes(plain.section(name)), name
        status = signing.signature_status(signed)
        assert status == {"fingerprint": signing.fingerprint(keys["alice.raw"]),
                          "public_key": open(keys["alice.pub"]).read().strip(),
                          "valid": True, "error": None}
        assert signing.signature_status(plain) is None
    # a reader that knows nothing of signatures reads it: an unreferenced section (R14)
    with read_package(packages["signed"]) as p:
        assert "signature" in p.section_names


def test_signing_twice_is_identical_and_resigning_replaces(packages, keys, tmp_path):
    again = tmp_path / "again.grace"
    result = sign_package(packages["signed"], keys["alice"], again)
    assert result.replaced.public_key == keys["alice.raw"]
    assert again.read_bytes() == open(packages["signed"], "rb").read()   # ed25519 is deterministic
    bob = tmp_path / "bob.grace"
    bob.write_bytes(again.read_bytes())
    os.chmod(bob, 0o640)
    result = sign_package(bob, keys["bob"])                              # in place
    assert result.path == str(bob) and result.replaced.fingerprint == signing.fingerprint(keys["alice.raw"])
    assert stat.S_IMODE(os.stat(bob).st_mode) == 0o640
    with read_package(bob) as p:
        assert p.section_names.count("signature") == 1
    read_trusted_package(bob, [keys["bob.pub"]]).close()
    with pytest.raises(UntrustedPackageError, match="not a trusted key"):
        read_trusted_package(bob, [keys["alice.pub"]])
    read_trusted_package(bob, [keys["alice.pub"], keys["bob.pub"]]).close()   # any one of them


def test_big_sections_keep_their_chunk_hashes(keys, tmp_path, monkeypatch):
    """A section above the chunk size has a `sha256/` companion; signing recomputes it (and the
    signature covers the companion's hash like any other section's)."""
    from grace.formats import container

    monkeypatch.setattr(container, "HASH_CHUNK_NBYTES", 256)
    path = write(tmp_path / "big.grace")
    sign_package(path, keys["alice"], tmp_path / "big.signed.grace")
    with read_trusted_package(tmp_path / "big.signed.grace", [keys["alice.pub"]]) as p:
        assert p.section_names.count("sha256/weights") == 1 and p.section_names[-1] == "signature"
        assert bytes(p.section("weights")) == bytes(read_package(path).section("weights"))


# ---- refusals -----------------------------------------------------------------------------------

def test_every_flipped_byte_is_refused(packages, keys):
    """One flipped bit anywhere (header, index, manifest, padding, kernels, weights, signature):
    the hashes or the signature refuse it, before the manifest is decoded."""
    data = open(packages["signed"], "rb").read()
    trusted = signing.resolve_trusted_keys([keys["alice.pub"]])
    read_trusted_package(data, trusted).close()
    accepted = []
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        try:
            read_trusted_package(bytes(bad), trusted)
            accepted.append(i)
        except (UntrustedPackageError, FormatError):
            pass
    assert accepted == []


@pytest.mark.parametrize("where", ["manifest", "cubin/k_scale_add.sm_90", "weights",
                                   "index name", "signature key", "signature bytes"])
def test_tampering_with_every_hash_recomputed_is_refused(packages, keys, where):
    """What an attacker does: edit, then fix every hash. Only the signature can tell, and it
    does, with UntrustedPackageError, before the manifest is decoded."""
    data = bytearray(open(packages["signed"], "rb").read())
    lay = _layout(data)
    if where == "manifest":
        at = lay["manifest_offset"] + lay["manifest_nbytes"] // 2
    elif where == "index name":   # rename a section (its entry's last name byte)
        name, pos, _, _ = lay["entries"][0]
        at = lay["index_offset"] + pos + _ENTRY.size + len(name) - 1
    else:
        off, nbytes = _section(data, where.split()[0])
        at = {"signature key": off + 8, "signature bytes": off + 60}.get(where, off + nbytes // 2)
    data[at] ^= 0x01
    tampered = rehash(data)
    with pytest.raises(UntrustedPackageError) as e:
        read_trusted_package(tampered, [keys["alice.pub"]])
    expected = "not a trusted key" if where == "signature key" else "does not match the package"
    assert expected in str(e.value)


def test_a_newer_minor_gets_no_leeway(packages, keys, tmp_path):
    """Readers look away from reserved header fields and padding of a newer minor (R4, R11); the
    signature does not: a set flag or a padding byte in such a file is refused. (This grace will
    not sign a minor it does not know, so the package is signed through the signer's own steps.)"""
    import io

    import msgpack

    from grace.formats.container import write_container
    from grace.formats.errors import UnsupportedVersionError

    key = signing.load_private_key(keys["alice"])
    with read_package(packages["unsigned"]) as p:
        sections = {n: bytes(p.section(n)) for n in p.section_names}
        manifest = {**p.manifest, "format_version": [3, 99]}
    f = io.BytesIO()
    write_container(f, msgpack.packb(manifest, use_bin_type=True),
                    {**sections, "signature": b"ed25519\0" + keys["alice.raw"] + bytes(64)},
                    version=(3, 99))
    signing._sign_in_place(f, key, keys["alice.raw"])
    data = f.getvalue()
    read_trusted_package(data, [keys["alice.pub"]]).close()          # a valid signed 3.99 file
    (tmp_path / "new.grace").write_bytes(data)
    with pytest.raises(UnsupportedVersionError, match="newer than this grace"):
        sign_package(tmp_path / "new.grace", keys["alice"], tmp_path / "out.grace")
    lay = _layout(data)
    flags, padding = bytearray(data), bytearray(data)
    flags[12] = 1
    padding[lay["manifest_offset"] + lay["manifest_nbytes"] + 1] = 7
    for bad, words in ((flags, "does not match"), (padding, "non-zero bytes")):
        read_package(bytes(bad)).close()                 # a reader of 3.3/3.4 accepts either
        with pytest.raises(UntrustedPackageError, match=words):
            read_trusted_package(bytes(bad), [keys["alice.pub"]])


def test_a_malformed_signature_section_is_refused(packages, keys):
    from grace.formats.package import pack_package_bytes

    with read_package(packages["unsigned"]) as p:
        sections = {n: bytes(p.section(n)) for n in p.section_names}
        blob = bytes(parse_container(p._buf).manifest_blob)
        version = tuple(p.format_version)
    for body in (b"ed25519\0" + bytes(95), b"rsa\0\0\0\0\0" + bytes(96)):
        data = pack_package_bytes(blob, {**sections, "signature": body}, version=version)
        read_package(data).close()                       # a well-formed package all the same
        with pytest.raises(UntrustedPackageError, match="malformed"):
            read_trusted_package(data, [keys["alice.pub"]])


def test_wrong_key_and_unsigned_are_refused(packages, keys):
    with pytest.raises(UntrustedPackageError, match=r"signed by ed25519:\w+, which is not a trusted key"):
        read_trusted_package(packages["signed"], [keys["bob.pub"]])
    with pytest.raises(UntrustedPackageError, match="not signed"):
        read_trusted_package(packages["unsigned"], [keys["alice.pub"]])
    read_trusted_package(packages["unsigned"], None).close()      # no keys: no check


# ---- the runtime (FakeDriver) -------------------------------------------------------------------

def test_runtime_refuses_before_touching_the_gpu(fake, packages, keys):
    for path, key in ((packages["unsigned"], "alice.pub"), (packages["signed"], "bob.pub")):
        with pytest.raises(rt.UntrustedPackageError):
            rt.load(path, trusted_keys=[keys[key]])
        assert fake.functions == {} and fake.memory == {}       # no module, no allocation
    assert rt.errors.UntrustedPackageError is UntrustedPackageError
    loaded = rt.load(packages["signed"], trusted_keys=[keys["alice.pub"]])
    assert sorted(fake.functions.values()) == ["k_scale_add", "table_writer"]
    uploaded = np.ctypeslib.as_array((__import__("ctypes").c_float * (ROWS * COLS)).from_address(
        loaded.weights_ptr))
    np.testing.assert_array_equal(uploaded.reshape(ROWS, COLS), WEIGHT)
    loaded.close()
    rt.load(packages["unsigned"]).close()                        # no keys: loads as before


def test_grace_trusted_keys_is_the_default_policy(fake, packages, keys, monkeypatch):
    monkeypatch.setenv("GRACE_TRUSTED_KEYS", os.pathsep.join(
        [keys["bob.pub"], open(keys["alice.pub"]).read().strip()]))   # a file and a base64 key
    with pytest.raises(rt.UntrustedPackageError, match="not signed"):
        rt.load(packages["unsigned"])
    rt.load(packages["signed"]).close()
    monkeypatch.setenv("GRACE_TRUSTED_KEYS", "nope.pub")
    with pytest.raises(SigningKeyError, match="GRACE_TRUSTED_KEYS"):
        rt.load(packages["signed"])


def test_without_cryptography_only_a_check_fails(fake, packages, keys, monkeypatch):
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    rt.load(packages["signed"]).close()                           # no check asked: works
    with pytest.raises(SigningUnavailableError, match=r"pip install 'grace\[sign\]'"):
        rt.load(packages["unsigned"], trusted_keys=[keys["alice.pub"]])
    with read_package(packages["signed"]) as p:                  # inspect: who signed, not checked
        status = signing.signature_status(p)
    assert status["fingerprint"] == signing.fingerprint(keys["alice.raw"]) and status["valid"] is None
    assert "grace[sign]" in status["error"]


def test_importing_the_runtime_does_not_import_cryptography(packages):
    code = ("import sys, grace.runtime, grace.formats.signing as s\n"
            f"s.read_trusted_package({packages['signed']!r}).close()\n"
            "assert 'cryptography' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the CLI (in process; `run --interpret` as a subprocess) ------------------------------------

def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_keygen_sign_verify_inspect(capsys, keys, packages, tmp_path):
    code, out, _ = _cli(capsys, "keygen", "-o", tmp_path / "carol")
    assert code == 0 and "fingerprint ed25519:" in out and (tmp_path / "carol.pub").is_file()
    code, _, err = _cli(capsys, "keygen", "-o", tmp_path / "carol")
    assert code == 1 and "never overwritten" in err
    signed = tmp_path / "c.grace"
    code, out, _ = _cli(capsys, "sign", packages["unsigned"], "--key", tmp_path / "carol", "-o", signed)
    carol = signing.fingerprint(signing.parse_public_key(tmp_path / "carol.pub"))
    assert code == 0 and out.strip() == f"signed {signed} by {carol}"

    code, out, _ = _cli(capsys, "verify", signed)
    assert code == 0 and out.startswith("OK") and f"signed by {carol} (valid)" in out
    code, out, _ = _cli(capsys, "verify", signed, "--trusted-key", tmp_path / "carol.pub")
    assert code == 0 and f"signed by {carol} (valid, trusted)" in out
    code, _, err = _cli(capsys, "verify", signed, "--trusted-key", keys["alice.pub"])
    assert code == 1 and "UntrustedPackageError" in err and carol in err
    code, out, _ = _cli(capsys, "verify", packages["unsigned"])
    assert code == 0 and "not signed" in out
    code, _, err = _cli(capsys, "verify", packages["unsigned"], "--trusted-key", keys["alice.pub"])
    assert code == 1 and "not signed" in err
    # a signature that no longer holds (hashes fixed up) fails verify even without trusted keys
    data = bytearray(signed.read_bytes())
    off, n = _section(data, "weights")
    data[off + n // 2] ^= 0x40
    forged = tmp_path / "forged.grace"
    forged.write_bytes(rehash(data))
    code, _, err = _cli(capsys, "verify", forged)
    assert code == 1 and "signature refused" in err and len(err.strip().splitlines()) == 1

    code, out, _ = _cli(capsys, "inspect", signed)
    assert code == 0 and re.search(rf"signed +by {carol}: valid", out), out
    code, out, _ = _cli(capsys, "inspect", packages["unsigned"])
    assert code == 0 and re.search(r"signed +no\b", out), out
    import json

    code, out, _ = _cli(capsys, "inspect", signed, "--json")
    assert json.loads(out)["signature"]["fingerprint"] == carol
    code, out, _ = _cli(capsys, "inspect", packages["unsigned"], "--json")
    assert json.loads(out)["signature"] is None


def test_cli_launches_require_a_trusted_signature(capsys, fake, keys, packages, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.ones((ROWS, COLS), np.float32))
    code, _, err = _cli(capsys, "run", packages["unsigned"], "--input", f"x={x}", "--require-signature")
    assert code == 1 and "--require-signature needs the keys to trust" in err
    for cmd in (["run", packages["unsigned"], "--input", f"x={x}"], ["bench", packages["unsigned"]],
                ["run", packages["unsigned"], "--input", f"x={x}", "--interpret"]):
        code, _, err = _cli(capsys, *cmd, "--require-signature", "--trusted-key", keys["alice.pub"])
        assert code == 1 and "UntrustedPackageError" in err and "not signed" in err, cmd
    code, _, err = _cli(capsys, "run", packages["signed"], "--input", f"x={x}", "--trusted-key",
                        keys["bob.pub"])
    assert code == 1 and "not a trusted key" in err
    assert fake.functions == {}                                 # nothing reached the "GPU"
    code, out, _ = _cli(capsys, "run", packages["signed"], "--input", f"x={x}", "--trusted-key",
                        keys["alice.pub"])
    assert code == 0 and "ran on GPU 0" in out and fake.functions


@pytest.fixture(scope="module")
def handmade(tmp_path_factory, keys):
    """The handmade package (real sm_90 cubins, kernels the CPU executor can run), signed by alice."""
    pytest.importorskip("triton")
    try:
        from helpers_handmade import build_handmade_package
    except ImportError:
        from tests.helpers_handmade import build_handmade_package
    d = tmp_path_factory.mktemp("handmade")
    plain = build_handmade_package(d / "h.grace")
    sign_package(plain, keys["alice"], d / "h.signed.grace")
    return {"unsigned": plain, "signed": d / "h.signed.grace"}


def test_interpreter_honours_trusted_keys(handmade, keys):
    from grace.tools import interpret

    try:
        from helpers_handmade import make_weights, reference
    except ImportError:
        from tests.helpers_handmade import make_weights, reference
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    out = interpret.run_package(handmade["signed"], {"x": x}, trusted_keys=[keys["alice.pub"]])
    np.testing.assert_allclose(out["out"], reference(x, make_weights()), rtol=1e-6, atol=1e-6)
    with pytest.raises(UntrustedPackageError):
        interpret.run_package(handmade["unsigned"], {"x": x}, trusted_keys=[keys["alice.pub"]])
    with read_package(handmade["signed"]) as pkg, pytest.raises(UntrustedPackageError):
        interpret.InterpretSession(pkg, trusted_keys=[keys["bob.pub"]])   # a Package read elsewhere


def test_cli_run_interpret_with_a_signature(handmade, keys, tmp_path):
    """The whole path as a user runs it: `grace run --interpret --require-signature --trusted-key`."""
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GRACE_TRUSTED_KEYS")}
    r = subprocess.run([sys.executable, "-m", "grace.tools.cli", "run", str(handmade["signed"]),
                        "--input", f"x={tmp_path / 'x.npy'}", "--interpret", "--require-signature",
                        "--trusted-key", keys["alice.pub"], "--output", str(tmp_path / "out.npz")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        from helpers_handmade import make_weights, reference
    except ImportError:
        from tests.helpers_handmade import make_weights, reference
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_allclose(z["out"], reference(x, make_weights()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sub", ["keygen", "sign"])
def test_new_subcommands_have_help_with_examples(capsys, sub):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"grace {sub}" in out and "examples:" in out
