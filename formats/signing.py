"""Signed packages: an ed25519 signature inside the package, and loaders that refuse any other.

A package is code: its cubins run on the GPU with the caller's privileges, and what a kernel reads
and writes is decided by its manifest. Hashes (R6, R10) catch a corrupted download, not a package
someone built to do harm. A signature binds a package to the holder of a private key, so "which
packages may launch" becomes a list of public keys the user chooses (SPEC.md §7):

    grace keygen -o release.key                      # release.key (0600) and release.key.pub
    grace sign model.grace --key release.key         # in place, or -o signed.grace
    grace.runtime.load("model.grace", trusted_keys=["release.key.pub"])

Layout (SPEC §7.1). The signature is one more section, named `signature`, of 104 bytes:

    0    8  b"ed25519\\0"        the algorithm
    8   32  public key           raw ed25519 (RFC 8032)
    40  64  signature            ed25519 over the message below

and the signed message is the file's own structure with the two fields zeroed that depend on the
signature itself:

    b"grace package signature v1\\0"                  domain separation, scheme version
    header, 128 bytes, with sha256(index) zeroed     magic, version, flags, every offset and size,
                                                     sha256(manifest)
    index, index_nbytes bytes, with the sha256 of    every section's offset, size, sha256 and name
    the `signature` entry zeroed                     (chunk-hash companions included), in order

Every other byte of the file is then fixed by the message: the index hash and the signature's
section hash are recomputed from bytes the message fixes (R6, R10), the manifest and every section
by their hashes in it, padding must be zero, and the signature section is parsed exactly. The
package stays one file, and a reader that knows nothing of signatures ignores the section as an
unreferenced one (R14): signing is additive and leaves the format version as it was.

The ed25519 code is the `cryptography` library (OpenSSL), imported only when a key is made, a
package signed or a signature checked: `pip install 'grace[sign]'`. Without it everything else,
the runtime included, works as before; reading a signature's key fingerprint needs no library.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from typing import NamedTuple

from .atomic import replacing
from .container import FORMAT_VERSION, HEADER_NBYTES, Container, parse_container, write_container
from .errors import FormatError, UnsupportedVersionError

SIGNATURE_SECTION = "signature"
ALGORITHM = b"ed25519\0"
PUBLIC_KEY_NBYTES = 32
SIGNATURE_NBYTES = 64
SECTION_NBYTES = len(ALGORITHM) + PUBLIC_KEY_NBYTES + SIGNATURE_NBYTES   # 104
DOMAIN = b"grace package signature v1\0"
TRUSTED_KEYS_ENV = "GRACE_TRUSTED_KEYS"
INSTALL_HINT = "pip install 'grace[sign]'"

_INDEX_SHA = slice(64, 96)          # sha256 of the index, in the header
_ENTRY = struct.Struct("<QQ32sH")   # an index entry, then its name (SPEC §1)
_HEADER_FIELDS = struct.Struct("<24xQQ")   # index_offset, index_nbytes


class UntrustedPackageError(ValueError):
    """A signature was required and the package does not have a valid one by a trusted key: it is
    unsigned, signed by another key, its signature section is malformed, or bytes changed after it
    was signed. Raised before anything of the package is decoded, loaded or launched; the package
    may still be read, inspected and verified."""


class SigningUnavailableError(ImportError):
    """A signature is to be made or checked, but the `cryptography` library is not installed."""


class SigningKeyError(ValueError):
    """A key file or key text that cannot be used (missing, not ed25519, encrypted, malformed)."""


class Signature(NamedTuple):
    """The `signature` section of a package, parsed (not yet verified)."""
    public_key: bytes   # 32 raw bytes
    signature: bytes    # 64 bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    @property
    def public_key_text(self) -> str:
        return public_key_text(self.public_key)


# ---- keys ---------------------------------------------------------------------------------------

def fingerprint(public_key: bytes) -> str:
    """A short name for a public key, for people and logs: `ed25519:` and the first 16 hex digits
    of its sha256. Trust decisions compare whole keys, never fingerprints."""
    return "ed25519:" + hashlib.sha256(bytes(public_key)).hexdigest()[:16]


def public_key_text(public_key: bytes) -> str:
    """The text form of a public key: standard base64 of the raw 32 bytes (44 characters)."""
    return base64.b64encode(bytes(public_key)).decode("ascii")


def _ed25519():
    """(ed25519 module, serialization module, InvalidSignature), or SigningUnavailableError."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise SigningUnavailableError(
            f"package signatures need the `cryptography` library, which is not installed ({e}): "
            f"{INSTALL_HINT}") from None
    return ed25519, serialization, InvalidSignature


def write_keypair(path) -> bytes:
    """Make a new ed25519 key: the private key to `path` (PKCS#8 PEM, unencrypted, mode 0600, as
    `openssl genpkey -algorithm ed25519` writes it) and the public key to `path`.pub (one line of
    base64, see public_key_text). Refuses to overwrite either file. Returns the raw public key."""
    ed25519, serialization, _ = _ed25519()
    path = os.fspath(path)
    pub_path = path + ".pub"
    for p in (path, pub_path):
        if os.path.lexists(p):
            raise SigningKeyError(f"{p} exists; a key is never overwritten (remove it or choose "
                                  "another name)")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)   # whatever the umask
        f.write(pem)
    fd = os.open(pub_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(public_key_text(public) + "\n")
    return public


def load_private_key(path):
    """The ed25519 private key in a PEM file (PKCS#8, unencrypted: what write_keypair and
    `openssl genpkey -algorithm ed25519` write)."""
    ed25519, serialization, _ = _ed25519()
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise SigningKeyError(f"{path}: cannot read the private key ({e.strerror or e})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:   # the library's way of saying "encrypted, and no password given"
        raise SigningKeyError(f"{path}: the private key is encrypted; grace reads unencrypted PKCS#8 "
                              "PEM keys (key management, e.g. a KMS or an encrypted volume, is "
                              "yours)") from None
    except Exception as e:   # noqa: BLE001 - the library's parse errors vary
        raise SigningKeyError(f"{path}: not a PEM private key ({type(e).__name__}: {e}); make one "
                              "with `grace keygen`") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"{path}: a {type(key).__name__}, not an ed25519 key; make one with "
                              "`grace keygen`")
    return key


def parse_public_key(spec) -> bytes:
    """A trusted key as the raw 32 bytes. `spec`: 32 bytes; or a str / path: a file holding the
    key (one line of base64 as `grace keygen` writes it, or a PEM public key as
    `openssl pkey -pubout` writes it), or the base64 text itself."""
    if isinstance(spec, (bytes, bytearray, memoryview)):
        raw = bytes(spec)
        if len(raw) != PUBLIC_KEY_NBYTES:
            raise SigningKeyError(f"a raw ed25519 public key is {PUBLIC_KEY_NBYTES} bytes, got {len(raw)}")
        return raw
    if not isinstance(spec, (str, os.PathLike)):
        raise SigningKeyError(f"a trusted key is a path, base64 text or 32 bytes, got {type(spec).__name__}")
    text = os.fspath(spec)
    if not os.path.isfile(text):
        if isinstance(spec, str) and _looks_base64(text):
            return base64.b64decode(text, validate=True)
        raise SigningKeyError(f"{text}: no such key file, nor the base64 of an ed25519 public key "
                              "(44 characters, as `grace keygen` writes to KEY.pub)")
    try:
        with open(text, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise SigningKeyError(f"{text}: cannot read the public key ({e.strerror or e})") from None
    if data.lstrip().startswith(b"-----BEGIN"):
        return _pem_public_key(data, text)
    line = data.decode("ascii", "replace").strip()
    if not _looks_base64(line):
        raise SigningKeyError(f"{text}: not a public key: expected one line of base64 of the raw "
                              "32-byte ed25519 key (as `grace keygen` writes to KEY.pub) or a PEM "
                              "public key")
    text = line
    return base64.b64decode(text, validate=True)


def _looks_base64(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == PUBLIC_KEY_NBYTES
    except (binascii.Error, ValueError):
        return False


def _pem_public_key(data: bytes, where: str) -> bytes:
    ed25519, serialization, _ = _ed25519()
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as e:   # noqa: BLE001 - the library's parse errors vary
        raise SigningKeyError(f"{where}: not a PEM public key ({type(e).__name__}: {e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SigningKeyError(f"{where}: a {type(key).__name__}, not an ed25519 public key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def trusted_keys_from_env(environ=None) -> list[bytes] | None:
    """The keys in GRACE_TRUSTED_KEYS (entries separated by os.pathsep, each a key file or the
    base64 of a key), or None when it is unset or empty."""
    value = (os.environ if environ is None else environ).get(TRUSTED_KEYS_ENV, "").strip()
    if not value:
        return None
    try:
        return [parse_public_key(entry.strip()) for entry in value.split(os.pathsep) if entry.strip()]
    except SigningKeyError as e:
        raise SigningKeyError(f"{TRUSTED_KEYS_ENV}: {e}") from None


def resolve_trusted_keys(trusted_keys, environ=None) -> frozenset[bytes] | None:
    """The set of trusted raw keys a load must check, or None for no check. `trusted_keys=None`
    means the deployment's policy: GRACE_TRUSTED_KEYS when set, else no check. An explicit empty
    list is refused rather than read as "trust nothing" or "check nothing"."""
    if trusted_keys is None:
        keys = trusted_keys_from_env(environ)
        return None if keys is None else frozenset(keys)
    if isinstance(trusted_keys, (str, bytes, bytearray, memoryview, os.PathLike)):
        trusted_keys = [trusted_keys]
    keys = frozenset(parse_public_key(k) for k in trusted_keys)
    if not keys:
        raise SigningKeyError("trusted_keys is empty: give at least one public key (or None: no "
                              "signature check unless GRACE_TRUSTED_KEYS is set)")
    return keys


# ---- the signed message -------------------------------------------------------------------------

def _entry_positions(container: Container) -> dict[str, int]:
    """Byte position of each section's entry in the index (entries are packed in index order)."""
    pos, out = 0, {}
    for s in container.sections:
        out[s.name] = pos
        pos += _ENTRY.size + len(s.name.encode("utf-8"))
    return out


def _message(header: bytes, index: bytes, entry_pos: int | None) -> bytes:
    header = bytearray(header)
    header[_INDEX_SHA] = bytes(32)
    index = bytearray(index)
    if entry_pos is not None:
        index[entry_pos + 16:entry_pos + 48] = bytes(32)
    return DOMAIN + bytes(header) + bytes(index)


def signed_message(buf, container: Container) -> bytes:
    """The message a package's signature covers (SPEC §7.1), from a buffer parse_container read."""
    index_offset, index_nbytes = _HEADER_FIELDS.unpack_from(buf, 0)
    index = bytes(buf[index_offset:index_offset + index_nbytes])
    return _message(bytes(buf[:HEADER_NBYTES]), index,
                    _entry_positions(container).get(SIGNATURE_SECTION))


def read_signature(buf, container: Container) -> Signature | None:
    """The package's signature section, parsed; None when there is none. A section of that name
    that is not exactly the 104-byte layout is an UntrustedPackageError."""
    entry = next((s for s in container.sections if s.name == SIGNATURE_SECTION), None)
    if entry is None:
        return None
    data = bytes(buf[entry.offset:entry.offset + entry.nbytes])
    if len(data) != SECTION_NBYTES or not data.startswith(ALGORITHM):
        raise UntrustedPackageError(
            f"the {SIGNATURE_SECTION!r} section is malformed ({len(data)} bytes, algorithm "
            f"{data[:8]!r}; expected {SECTION_NBYTES} bytes starting {ALGORITHM!r})")
    n = len(ALGORITHM)
    return Signature(data[n:n + PUBLIC_KEY_NBYTES], data[n + PUBLIC_KEY_NBYTES:])


def _check_unlisted_bytes_zero(buf, container: Container) -> None:
    """Every byte outside header, index, manifest and sections is zero (R11 checks it too, but only
    for minors this reader knows): no byte escapes the signature."""
    index_offset, index_nbytes = _HEADER_FIELDS.unpack_from(buf, 0)
    manifest = container.manifest_blob
    manifest_offset = struct.unpack_from("<Q", buf, 40)[0]
    spans = sorted([(0, HEADER_NBYTES), (index_offset, index_offset + index_nbytes),
                    (manifest_offset, manifest_offset + manifest.nbytes)]
                   + [(s.offset, s.offset + s.nbytes) for s in container.sections])
    cur = 0
    for start, end in spans + [(buf.nbytes, buf.nbytes)]:
        if start > cur and not _all_zero(buf[cur:start]):
            raise UntrustedPackageError(f"non-zero bytes in [{cur}, {start}), between the parts of "
                                        "the package: they are not covered by its signature")
        cur = max(cur, end)


def _all_zero(view, chunk: int = 1 << 20) -> bool:
    """In C, a MiB at a time: a gap of a newer minor's file may be large."""
    return all(not bytes(view[i:i + chunk]).strip(b"\0") for i in range(0, view.nbytes, chunk))


def verify_signature(buf, container: Container) -> Signature:
    """Check the package's signature against the key it names; return it. UntrustedPackageError
    when it is unsigned or the signature does not verify.

    `container` must come from parse_container(buf, verify=True): that checked every section
    against the hashes the signed message fixes. Whether the key is trusted is the caller's
    question (check_trusted)."""
    sig = read_signature(buf, container)
    if sig is None:
        raise UntrustedPackageError("the package is not signed (sign it with `grace sign PKG --key KEY`)")
    ed25519, _, invalid = _ed25519()
    _check_unlisted_bytes_zero(buf, container)
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(sig.public_key).verify(
            sig.signature, signed_message(buf, container))
    except (invalid, ValueError):
        raise UntrustedPackageError(
            f"the signature by {sig.fingerprint} does not match the package: bytes changed after "
            "it was signed (or it was not signed by that key)") from None
    return sig


def check_trusted(buf, container: Container, trusted: frozenset) -> Signature:
    """verify_signature, and the signing key is one of `trusted` (raw keys)."""
    sig = read_signature(buf, container)
    if sig is None:
        raise UntrustedPackageError(
            "the package is not signed, and a signature by a trusted key is required (sign it with "
            "`grace sign PKG --key KEY`)")
    if sig.public_key not in trusted:
        names = ", ".join(sorted(fingerprint(k) for k in trusted))
        raise UntrustedPackageError(f"the package is signed by {sig.fingerprint}, which is not a "
                                    f"trusted key (trusted: {names})")
    return verify_signature(buf, container)


# ---- reading with a trust check -----------------------------------------------------------------

def read_trusted_package(source, trusted_keys=None):
    """read_package, with a signature check first when `trusted_keys` (or GRACE_TRUSTED_KEYS, see
    resolve_trusted_keys) asks for one: the structure and every section hash are checked, then the
    signature, and only then is the manifest decoded. So the msgpack decoder and the schema checks
    never see the bytes of an untrusted package, let alone a GPU.

    Returns a grace.formats Package; raises UntrustedPackageError, or a FormatError for a package
    that is broken whoever signed it."""
    from .package import _open_buffer, read_package

    trusted = resolve_trusted_keys(trusted_keys)
    if trusted is None:
        return read_package(source, verify=True)
    _ed25519()   # a missing library is said first, whatever the package holds
    buf, mm, path = _open_buffer(source)
    try:
        check_trusted(buf, parse_container(buf, verify=True), trusted)
        # the same bytes, hashed above: the rest of read_package without hashing them again
        package = read_package(buf, verify=False)
    except BaseException:
        if mm is not None:
            try:
                buf.release()
                mm.close()
            except BufferError:   # a view is still alive (e.g. in the traceback); GC unmaps later
                pass
        raise
    package.path, package._mmap = path, mm   # so close() unmaps the file, as read_package's would
    return package


def check_package(package, trusted_keys=None) -> Signature | None:
    """For a Package read elsewhere (whether its sections were hashed is not recorded in it): hash
    it again and check its signature against `trusted_keys` (None: GRACE_TRUSTED_KEYS, and no
    check when that is unset too). Returns the signature checked, or None when none was asked."""
    trusted = resolve_trusted_keys(trusted_keys)
    if trusted is None:
        return None
    _ed25519()
    buf = package._buf
    return check_trusted(buf, parse_container(buf, verify=True), trusted)


def signature_status(package, verified: bool = True) -> dict | None:
    """What `grace inspect` and `grace verify` report: None for an unsigned package, else
    {fingerprint, public_key (base64), valid, error}: `valid` is True or False, or None when the
    signature was not checked (`error` says why: no `cryptography`, or a malformed section).
    `verified`: the package was read with verify=True, so a valid signature covers every byte."""
    buf = package._buf
    container = parse_container(buf, verify=False)   # header and index only: the structure
    try:
        sig = read_signature(buf, container)
    except UntrustedPackageError as e:
        return {"fingerprint": None, "public_key": None, "valid": False, "error": str(e)}
    if sig is None:
        return None
    out = {"fingerprint": sig.fingerprint, "public_key": sig.public_key_text, "valid": None,
           "error": None}
    try:
        verify_signature(buf, container)
        out["valid"] = True
        if not verified:
            out["error"] = "sections not hashed (--no-verify): the signature covers their hashes only"
    except SigningUnavailableError as e:
        out["error"] = str(e)
    except UntrustedPackageError as e:
        out["valid"], out["error"] = False, str(e)
    return out


# ---- signing ------------------------------------------------------------------------------------

class SignResult(NamedTuple):
    path: str
    signature: Signature
    replaced: Signature | None   # the signature the package had before, if any


def sign_package(path, key, output=None) -> SignResult:
    """Sign the package at `path` with `key` (a path to a PEM private key, or a cryptography
    Ed25519PrivateKey) and write it to `output` (default: `path`, replaced atomically).

    The package is read and fully validated first (a broken package is not signed). Its manifest
    bytes and sections are copied unchanged, in their order, with the chunk-hash companions
    recomputed and a `signature` section last; an existing signature is replaced (one signer per
    package; ed25519 is deterministic, so signing twice with one key gives identical bytes). The
    format version stays the package's own."""
    from .package import read_package

    ed25519, serialization, _ = _ed25519()
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        key = load_private_key(key)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    path = os.fspath(path)
    output = path if output is None else os.fspath(output)
    with read_package(path, verify=True) as package:
        if package.format_version[1] > FORMAT_VERSION[1]:
            v = ".".join(map(str, package.format_version))
            raise UnsupportedVersionError(
                f"{path}: format {v} is newer than this grace ({FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}), "
                f"which could not copy what that version adds; sign it with a grace that knows {v}")
        buf = package._buf
        container = parse_container(buf, verify=False)
        try:
            replaced = read_signature(buf, container)
        except UntrustedPackageError:
            replaced = None   # a malformed one: replaced all the same
        sections = {s.name: buf[s.offset:s.offset + s.nbytes] for s in container.sections
                    if s.name != SIGNATURE_SECTION and not _is_companion(s.name, container)}
        sections[SIGNATURE_SECTION] = ALGORITHM + public + bytes(SIGNATURE_NBYTES)
        mode = os.stat(path).st_mode & 0o777   # the signed package keeps the package's mode
        with replacing(output, mode) as f:
            write_container(f, bytes(container.manifest_blob), sections,
                            version=tuple(package.format_version))
            signature = _sign_in_place(f, key, public)
    return SignResult(output, Signature(public, signature), replaced)


def _is_companion(name: str, container: Container) -> bool:
    from .container import COMPANION_PREFIX

    return name.startswith(COMPANION_PREFIX) and any(
        s.name == name[len(COMPANION_PREFIX):] for s in container.sections)


def _sign_in_place(f, key, public: bytes) -> bytes:
    """Fill the placeholder signature of the container just written to `f`: sign the message
    (which zeroes the two hashes that depend on the signature), write the signature, then the
    signature section's sha256 into its index entry and the index's sha256 into the header."""
    f.seek(0)
    header = f.read(HEADER_NBYTES)
    index_offset, index_nbytes = _HEADER_FIELDS.unpack_from(header, 0)
    f.seek(index_offset)
    index = bytearray(f.read(index_nbytes))
    pos = entry = None
    p = 0
    while p < len(index):   # the writer's own index: well-formed
        offset, nbytes, _, name_len = _ENTRY.unpack_from(index, p)
        if index[p + _ENTRY.size:p + _ENTRY.size + name_len].decode("utf-8") == SIGNATURE_SECTION:
            pos, entry = p, (offset, nbytes)
        p += _ENTRY.size + name_len
    if entry is None or entry[1] != SECTION_NBYTES:   # cannot happen: sign_package wrote it
        raise FormatError("internal: the signature section was not written")
    signature = key.sign(_message(header, bytes(index), pos))
    section = ALGORITHM + public + signature
    f.seek(entry[0])
    f.write(section)
    index[pos + 16:pos + 48] = hashlib.sha256(section).digest()
    f.seek(index_offset + pos + 16)
    f.write(index[pos + 16:pos + 48])
    f.seek(_INDEX_SHA.start)
    f.write(hashlib.sha256(index).digest())
    f.seek(0, os.SEEK_END)
    return signature


__all__ = [
    "SIGNATURE_SECTION", "TRUSTED_KEYS_ENV", "INSTALL_HINT", "UntrustedPackageError",
    "SigningUnavailableError", "SigningKeyError", "Signature", "SignResult", "fingerprint",
    "public_key_text", "write_keypair", "load_private_key", "parse_public_key",
    "trusted_keys_from_env", "resolve_trusted_keys", "signed_message", "read_signature",
    "verify_signature", "check_trusted", "read_trusted_package", "check_package",
    "signature_status", "sign_package",
]

