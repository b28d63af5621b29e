"""The byte layout of a `.grace` file: header, section index, manifest bytes, aligned sections.

This module knows nothing about what the manifest or the sections mean; it only moves bytes and
refuses any file whose structure it cannot fully account for. Keeping the layout separate from the
schema means a reader can list and hash sections (`grace inspect`) even when the manifest is bad.

Layout (all integers little-endian; see SPEC.md §2 for the normative table):

    0    8  magic  b"GRACE\\0PK"
    8    2  major  u16
    10   2  minor  u16
    12   4  flags  u32, reserved, 0
    16   8  file_nbytes      u64
    24   8  index_offset     u64
    32   8  index_nbytes     u64
    40   8  manifest_offset  u64
    48   8  manifest_nbytes  u64
    56   4  section_count    u32
    60   4  reserved u32, 0
    64  32  sha256(index)
    96  32  sha256(manifest)
    128     index entries: offset u64, nbytes u64, sha256[32], name_len u16, name (utf-8)
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from .errors import BadMagicError, ChecksumError, FormatError, TruncatedError, UnsupportedVersionError

MAGIC = b"GRACE\0PK"
# 2.0: shape buckets (symbols, shape expressions, table extents, one graph per bucket); a 1.x
# reader would silently mis-size the table and ignore the extra graphs.
# 3.0: session state and token generation (docs/design-state.md): a new region kind `state`, node
# arguments that point into it, the `state` section and the `generate` map. A major bump because a
# 2.x reader would mis-launch: it neither allocates nor initialises the state those arguments need.
# 3.1: chunk-hash companions `sha256/<section>` for sections over HASH_CHUNK_NBYTES, so a reader
# verifies a 16 GB weights section on all cores (a 3.0 reader ignores them and hashes it whole).
# 3.2: graph nodes may list `programmatic` deps (programmatic dependent launch); a 3.1 reader
# ignores the key and builds full edges, which order strictly more.
# 3.3: `index_checks` and `table.errors`: gathers clamp out-of-range indices on the device and
# store a code into one table word that the runtime reads at its synchronising points; a 3.2
# reader ignores both keys (it never reads out of range either, it just reports nothing).
# 3.4: the compiler's records (`kernels[i].compiled`, `graphs[i].compiled`, SPEC §3.4), which the
# validator checks every node against (formats/crosscheck.py); a 3.3 reader ignores them.
# 3.5: per-arch variants: `graphs[i].archs` (the archs a graph serves; absent: all) so one package
# holds graphs per target (PDL sources and edges for sm_90+, none for sm_80; tile plans per SM
# count), a kernel's `binaries` cover the archs of the graphs that use it. A package with one
# variant is a 3.4 package; one with several is refused by a 3.4 reader (duplicate buckets or a
# missing binary: a ManifestError, never a misread), SPEC §6.
# 3.6: a kernel behind a programmatic edge may load before its wait what only nodes certain to have
# finished (a path with a full edge) write (SPEC §5.3); no manifest key changes, and a 3.5 reader's
# race check refuses a package that does so (never misreads it).
FORMAT_VERSION = (3, 6)
ALIGN = 4096  # section data starts on a page boundary so the weights blob can be mmapped in place

_HEADER = struct.Struct("<8sHHIQQQQQII32s32s")
HEADER_NBYTES = _HEADER.size  # 128
_ENTRY = struct.Struct("<QQ32sH")
_ENTRY_NBYTES = _ENTRY.size  # 50, followed by the name
_MAX_NAME = 255

# Section names must be safe relative paths (a tool that writes sections to files cannot escape its
# directory): a closed alphabet, no empty, "." or ".." components.
_NAME_RE = re.compile(r"[A-Za-z0-9._+\-]+(/[A-Za-z0-9._+\-]+)*")

assert HEADER_NBYTES == 128

# A section larger than one chunk gets a companion section `sha256/<name>`: u64 chunk size, then
# the sha256 of each chunk in order. One sha256 runs at ~1.25 GB/s on the H200 host, so the whole-
# section hash of an 8B model's weights took 13 s of a 16 s load; chunks hash on every core.
HASH_CHUNK_NBYTES = 64 << 20
COMPANION_PREFIX = "sha256/"
_VERIFY_THREADS = min(32, os.cpu_count() or 1)


class SectionEntry(NamedTuple):
    name: str
    offset: int
    nbytes: int
    sha256: bytes


class Container(NamedTuple):
    version: tuple[int, int]
    sections: list[SectionEntry]
    manifest_blob: memoryview


def check_section_name(name) -> None:
    """Reject names that a reader would refuse, so the writer can never produce an unreadable file."""
    if not isinstance(name, str):
        raise FormatError(f"section name must be a str, got {type(name).__name__}")
    encoded = name.encode("utf-8", "replace")
    if not 1 <= len(encoded) <= _MAX_NAME:
        raise FormatError(f"section name {name!r}: length must be 1..{_MAX_NAME} bytes")
    if not _NAME_RE.fullmatch(name) or any(part in (".", "..") for part in name.split("/")):
        raise FormatError(
            f"section name {name!r}: must be a relative path of [A-Za-z0-9._+-] components "
            "separated by '/', without '.' or '..' components")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _chunks_of(data) -> tuple[int, "callable"]:
    """(nbytes, a function yielding the section's bytes as memoryviews) for bytes-like data or a
    streamed section (an object with `nbytes` and `chunks()`, such as weights.TensorBlob)."""
    if hasattr(data, "chunks") and hasattr(data, "nbytes"):
        return int(data.nbytes), data.chunks
    try:
        view = memoryview(data)
    except TypeError:
        raise FormatError(f"section data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise FormatError("section data must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return view.nbytes, lambda: iter((view,))


def write_container(f, manifest_blob: bytes, sections: dict, version=FORMAT_VERSION) -> int:
    """Stream a complete container to the binary file object `f`; return the bytes written.

    Sections are written from the caller's buffers, chunk by chunk, and hashed on the way: a
    multi-GB weights blob is neither concatenated nor read twice. The header and index (which hold
    the hashes) are written last, over placeholders, so `f` must be seekable. `version` exists for
    tests of forward compatibility.
    """
    if not f.seekable():
        raise FormatError("write_container needs a seekable file (it writes the hashes last)")
    names, sources, chunk_digests = [], [], {}
    for name in sections:
        check_section_name(name)
        nbytes, chunks = _chunks_of(sections[name])
        names.append(name)
        sources.append((nbytes, chunks))
        if nbytes > HASH_CHUNK_NBYTES:   # its companion follows it, filled once it is written
            digests = chunk_digests[name] = []
            companion = COMPANION_PREFIX + name
            check_section_name(companion)
            if companion in sections:
                raise FormatError(f"section {companion!r} is the chunk hashes of {name!r}, which "
                                  "the writer computes")
            names.append(companion)
            sources.append((8 + 32 * _chunk_count(nbytes),
                            lambda d=digests: iter((struct.pack("<Q", HASH_CHUNK_NBYTES), *d))))

    encoded_names = [n.encode("utf-8") for n in names]
    index_offset = HEADER_NBYTES
    index_nbytes = sum(_ENTRY_NBYTES + len(n) for n in encoded_names)
    manifest_offset = index_offset + index_nbytes
    pos = manifest_offset + len(manifest_blob)

    offsets, paddings = [], []
    for nbytes, _ in sources:
        paddings.append(_align(pos) - pos)
        pos = _align(pos)
        offsets.append(pos)
        pos += nbytes
    file_nbytes = pos

    start = f.tell()
    f.write(bytes(manifest_offset))  # header and index: placeholders until the hashes are known
    f.write(manifest_blob)
    with ThreadPoolExecutor(1, thread_name_prefix="grace-sha256") as hasher, \
            ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="grace-chunk") as chunker:
        digests = [_write_section(f, chunks, nbytes, padding, hasher,
                                  chunker if name in chunk_digests else None,
                                  chunk_digests.get(name))
                   for name, (nbytes, chunks), padding in zip(names, sources, paddings)]

    index = b"".join(
        _ENTRY.pack(off, nbytes, digest, len(enc)) + enc
        for off, (nbytes, _), digest, enc in zip(offsets, sources, digests, encoded_names))
    header = _HEADER.pack(
        MAGIC, version[0], version[1], 0, file_nbytes, index_offset, index_nbytes,
        manifest_offset, len(manifest_blob), len(names), 0,
        hashlib.sha256(index).digest(), hashlib.sha256(manifest_blob).digest())
    end = f.tell()
    f.seek(start)
    f.write(header)
    f.write(index)
    f.seek(end)
    return file_nbytes


def _chunk_count(nbytes: int) -> int:
    return -(-nbytes // HASH_CHUNK_NBYTES)


def _write_section(f, chunks, nbytes: int, padding: int, hasher, chunker=None,
                   chunk_digests=None) -> bytes:
    """Write `padding` zero bytes then the section's chunks; return its sha256. With `chunker`,
    also hash every HASH_CHUNK_NBYTES of it on that pool and append the digests, in order, to
    `chunk_digests` (the companion section's body)."""
    f.write(bytes(padding))
    sha, written = hashlib.sha256(), 0
    pending, pieces, filled = [], [], 0   # chunk hashes in flight; the chunk being gathered

    def close_chunk():
        nonlocal pieces, filled
        pending.append(chunker.submit(_sha256_of, pieces))
        pieces, filled = [], 0

    for chunk in chunks():
        chunk = memoryview(chunk)
        if chunk.format != "B" or chunk.ndim != 1:
            chunk = chunk.cast("B")
        # hashlib and the file write both release the GIL: hash a chunk while it is written
        hashing = hasher.submit(sha.update, chunk)
        if chunker is not None:
            start = 0
            while start < chunk.nbytes:
                take = min(HASH_CHUNK_NBYTES - filled, chunk.nbytes - start)
                pieces.append(chunk[start:start + take])
                filled, start = filled + take, start + take
                if filled == HASH_CHUNK_NBYTES:
                    close_chunk()
        f.write(chunk)
        hashing.result()
        written += chunk.nbytes
    if written != nbytes:
        raise FormatError(f"a section produced {written} bytes, but declared {nbytes}")
    if chunker is not None:
        if filled:
            close_chunk()
        chunk_digests.extend(p.result() for p in pending)
    return sha.digest()


def _sha256_of(pieces) -> bytes:
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    return sha.digest()


def _need(what: str, offset: int, nbytes: int, total: int) -> None:
    if offset + nbytes > total:
        raise TruncatedError(
            f"{what} at [{offset}, {offset + nbytes}) lies past the end of the package ({total} bytes)")


def parse_container(buf: memoryview, *, verify: bool = True) -> Container:
    """Check the structure of `buf` and return the section index and the raw manifest bytes.

    The header, index and manifest hashes are always checked (they are small); `verify` adds the
    sha256 of every section and the all-zero check of padding, which touch every byte of the file.
    """
    total = buf.nbytes
    head = bytes(buf[:8])
    if head != MAGIC:
        if total < len(MAGIC) and MAGIC.startswith(head):
            raise TruncatedError(f"package is only {total} bytes; the magic alone is 8")
        raise BadMagicError(f"not a .grace package: magic is {head!r}, expected {MAGIC!r}")
    if total < 12:
        raise TruncatedError(f"package is only {total} bytes; the version ends at byte 12")
    major, minor = struct.unpack_from("<HH", buf, 8)
    if major != FORMAT_VERSION[0]:
        raise UnsupportedVersionError(
            f"package format version {major}.{minor} is not supported by this reader "
            f"(reads {FORMAT_VERSION[0]}.x, up to {FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}): "
            "recompile the model with this grace (grace compile)")
    if total < HEADER_NBYTES:
        raise TruncatedError(f"package is only {total} bytes; the header is {HEADER_NBYTES}")
    (_, _, _, flags, file_nbytes, index_offset, index_nbytes, manifest_offset, manifest_nbytes,
     section_count, reserved, index_sha, manifest_sha) = _HEADER.unpack_from(buf, 0)

    # Fields reserved in our minor may carry meaning in a newer one; only then do we look away.
    strict = minor <= FORMAT_VERSION[1]
    if strict and (flags or reserved):
        raise FormatError(f"reserved header fields must be zero (flags={flags}, reserved={reserved})")
    if file_nbytes > total:
        raise TruncatedError(f"package is {total} bytes but its header says {file_nbytes}")
    if file_nbytes < total:
        raise FormatError(f"package has {total - file_nbytes} trailing bytes after its declared end")

    _need("section index", index_offset, index_nbytes, total)
    _need("manifest", manifest_offset, manifest_nbytes, total)
    index = buf[index_offset:index_offset + index_nbytes]
    if hashlib.sha256(index).digest() != index_sha:
        raise ChecksumError("sha256 mismatch in the section index")
    manifest_blob = buf[manifest_offset:manifest_offset + manifest_nbytes]
    if hashlib.sha256(manifest_blob).digest() != manifest_sha:
        raise ChecksumError("sha256 mismatch in the manifest")

    sections = _parse_index(index, section_count)
    spans = [("header", 0, HEADER_NBYTES), ("section index", index_offset, index_nbytes),
             ("manifest", manifest_offset, manifest_nbytes)]
    for s in sections:
        if s.offset % ALIGN:
            raise FormatError(f"section {s.name!r}: offset {s.offset} is not {ALIGN}-aligned")
        _need(f"section {s.name!r}", s.offset, s.nbytes, total)
        spans.append((f"section {s.name!r}", s.offset, s.nbytes))
    spans.sort(key=lambda s: (s[1], s[2]))
    for (a, a_off, a_len), (b, b_off, _) in zip(spans, spans[1:]):
        if a_off + a_len > b_off:
            raise FormatError(f"{a} [{a_off}, {a_off + a_len}) overlaps {b} starting at {b_off}")

    if verify:
        _verify_sections(buf, sections)
        if strict:
            _check_padding(buf, spans, total)
    return Container((major, minor), sections, manifest_blob)


def _verify_sections(buf: memoryview, sections: list[SectionEntry]) -> None:
    """R10 on every core: a section with a companion `sha256/<name>` is checked chunk by chunk
    against it (the companion itself against the index), any other against its index hash."""
    by_name = {s.name: s for s in sections}
    jobs = []   # (what, view, expected digest)
    for s in sections:
        if s.name.startswith(COMPANION_PREFIX) and s.name[len(COMPANION_PREFIX):] in by_name:
            continue   # a companion: checked below, with the section it describes
        companion = by_name.get(COMPANION_PREFIX + s.name)
        if companion is None:
            jobs.append((f"section {s.name!r}", buf[s.offset:s.offset + s.nbytes], s.sha256))
            continue
        table = buf[companion.offset:companion.offset + companion.nbytes]
        if hashlib.sha256(table).digest() != companion.sha256:
            raise ChecksumError(f"sha256 mismatch in section {companion.name!r}")
        chunk = struct.unpack_from("<Q", table, 0)[0] if table.nbytes >= 8 else 0
        if chunk == 0 or table.nbytes != 8 + 32 * -(-s.nbytes // chunk):
            raise FormatError(f"section {companion.name!r}: {table.nbytes} bytes is not a chunk size "
                              f"and one sha256 per chunk of the {s.nbytes}-byte section {s.name!r}")
        for k, start in enumerate(range(0, s.nbytes, chunk)):
            view = buf[s.offset + start:s.offset + min(start + chunk, s.nbytes)]
            jobs.append((f"section {s.name!r} (chunk {k}, bytes {start}..{start + view.nbytes})",
                         view, bytes(table[8 + 32 * k:8 + 32 * (k + 1)])))
    def digest(job):
        return hashlib.sha256(job[1]).digest()

    if sum(view.nbytes for _, view, _ in jobs) > HASH_CHUNK_NBYTES:
        with ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="grace-verify") as pool:
            digests = list(pool.map(digest, jobs))
    else:   # a small package: hashing takes less than starting a thread
        digests = map(digest, jobs)
    for (what, _, expected), got in zip(jobs, digests):
        if got != expected:
            raise ChecksumError(f"sha256 mismatch in {what}")


def _parse_index(index: memoryview, count: int) -> list[SectionEntry]:
    if count * _ENTRY_NBYTES > index.nbytes:
        raise FormatError(f"section index of {index.nbytes} bytes cannot hold {count} entries")
    sections, seen, pos = [], set(), 0
    for i in range(count):
        if pos + _ENTRY_NBYTES > index.nbytes:
            raise FormatError(f"section index entry {i} is cut off")
        offset, nbytes, sha, name_len = _ENTRY.unpack_from(index, pos)
        pos += _ENTRY_NBYTES
        if pos + name_len > index.nbytes:
            raise FormatError(f"section index entry {i}: name is cut off")
        try:
            name = bytes(index[pos:pos + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"section index entry {i}: name is not valid utf-8") from None
        pos += name_len
        check_section_name(name)
        if name in seen:
            raise FormatError(f"section {name!r} appears twice in the index")
        seen.add(name)
        sections.append(SectionEntry(name, offset, nbytes, sha))
    if pos != index.nbytes:
        raise FormatError(f"section index has {index.nbytes - pos} unexplained trailing bytes")
    return sections


def _check_padding(buf: memoryview, spans, total: int) -> None:
    """Padding must be zero so that every byte of a file is covered by a rule (no hidden payload)."""
    cur = 0
    for name, off, nbytes in spans + [("end of file", total, 0)]:
        if off > cur and bytes(buf[cur:off]) != bytes(off - cur):
            raise FormatError(f"non-zero padding bytes in [{cur}, {off}) before {name}")
        cur = max(cur, off + nbytes)
