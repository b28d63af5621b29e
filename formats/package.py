"""write_package / read_package: the container, the manifest, the weights and state checked together.

The rule this module enforces is "validate everything before anyone trusts anything": a Package
object only exists for a file whose structure, hashes, manifest schema and cross-references
(sections named by kernels, tensors named by the weights and state tables) have all been checked.
The writer runs the same checks on what it is about to write, so it cannot produce a file the
reader refuses.
"""

from __future__ import annotations

import functools
import io
import mmap
import os

import msgpack

from . import limits
from .atomic import replacing
from .container import COMPANION_PREFIX, FORMAT_VERSION, Container, parse_container, write_container
from .errors import FormatError, ManifestError
from .manifest import validate_manifest
from .view import Manifest, build_view
from .weights import TensorBlob, decode_weights


class _TooManyItems(Exception):
    """Raised from inside msgpack's hooks to stop a decode that passed MAX_MANIFEST_ITEMS."""


def _unpack_manifest(blob) -> dict:
    """Decode msgpack with every count bounded (SPEC R12); never executes anything (no ext types).

    A byte of msgpack can become a 64-byte Python object (an empty map), so the size cap alone
    does not bound memory: the hooks count every map and array with their entries as msgpack
    completes them and stop the decode past MAX_MANIFEST_ITEMS, before it has built more than
    that. Nesting is capped after the decode (msgpack itself stops at 1024 levels)."""
    n = len(blob)
    if n > limits.MAX_MANIFEST_NBYTES:
        raise FormatError(f"manifest is {n} bytes, above the {limits.MAX_MANIFEST_NBYTES}-byte limit")
    items = 0

    def count(container):
        nonlocal items
        items += len(container) + 1
        if items > limits.MAX_MANIFEST_ITEMS:
            raise _TooManyItems
        return container

    most = min(n, limits.MAX_MANIFEST_ITEMS)
    try:
        manifest = msgpack.unpackb(
            blob, raw=False, strict_map_key=True, use_list=True, object_hook=count, list_hook=count,
            max_str_len=min(n, limits.MAX_MANIFEST_STR), max_bin_len=min(n, limits.MAX_MANIFEST_STR),
            max_array_len=most, max_map_len=most, max_ext_len=0)
    except _TooManyItems:
        raise FormatError(f"manifest has more than {limits.MAX_MANIFEST_ITEMS} items (maps, arrays "
                          "and their entries)") from None
    except Exception as e:  # msgpack raises a zoo of types for bad input; all mean "corrupt"
        raise FormatError(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(manifest, dict):
        raise FormatError(f"manifest must be a msgpack map, got {type(manifest).__name__}")
    _check_depth(manifest)
    return manifest


def _check_depth(manifest: dict) -> None:
    """Refuse nesting deeper than MAX_MANIFEST_DEPTH, level by level (no recursion): every reader
    of a manifest (inspect's JSON, msgpack.packb, json.dumps) may then recurse over any part of it.
    About as fast as the decode itself (a type test per value)."""
    level, depth = [manifest], 1
    while level:
        if depth > limits.MAX_MANIFEST_DEPTH:
            raise FormatError(f"manifest nests maps and arrays deeper than {limits.MAX_MANIFEST_DEPTH} levels")
        deeper = []
        for obj in level:
            for v in (obj.values() if type(obj) is dict else obj):
                if type(v) is dict or type(v) is list:
                    deeper.append(v)
        level, depth = deeper, depth + 1


def _tensor_sections(manifest: dict):
    """(section name, [(index, entry)]) for each manifest table whose data is a safetensors section:
    every weight and every state entry with init "data" (R14, R15)."""
    yield "weights", list(enumerate(manifest["weights"]))
    yield "state", [(i, s) for i, s in enumerate(manifest["state"]) if s["init"] == "data"]


def _tensor_specs(data, section: str) -> dict:
    """{tensor: (dtype, shape)} of a tensor section: bytes are decoded, a TensorBlob describes itself."""
    if isinstance(data, TensorBlob):
        return data.tensors
    return {k: (d, s) for k, (d, s, _) in decode_weights(data, section=section).items()}


def _check_tensor_sections(manifest: dict, section) -> None:
    """Decode each tensor section that the manifest needs (`section(name)` gives its bytes or its
    TensorBlob) and check that every entry names a tensor of the same dtype and shape in it. Runs
    after validate_manifest, which has already checked that these sections exist."""
    for name, entries in _tensor_sections(manifest):
        if not entries:
            continue
        tensors = _tensor_specs(section(name), name)
        for i, e in entries:
            t = tensors.get(e["name"])
            if t is None:
                raise ManifestError(f"{name}[{i}]: tensor {e['name']!r} is not in the {name} section")
            if t[0] != e["dtype"] or list(t[1]) != list(e["shape"]):
                raise ManifestError(f"{name}[{i}]: tensor {e['name']!r} is {t[0]}{list(t[1])} in the "
                                    f"{name} section but {e['dtype']}{list(e['shape'])} in the manifest")


def write_package(path, manifest: dict, sections: dict) -> None:
    """Validate, then write atomically: a crash leaves either the old file or the new one.

    A section is bytes-like or a TensorBlob (streamed from the caller's tensors, never copied)."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"manifest: expected a map, got {type(manifest).__name__}")
    manifest = {**manifest, "format_version": list(FORMAT_VERSION)}
    for name in sections:
        if isinstance(name, str) and name.startswith(COMPANION_PREFIX):
            raise FormatError(f"section {name!r}: names under {COMPANION_PREFIX!r} are the chunk "
                              "hashes the writer adds itself")
    validate_manifest(manifest, section_names=list(sections))
    try:
        blob = msgpack.packb(manifest, use_bin_type=True)
    except Exception as e:
        raise ManifestError(f"manifest cannot be encoded as msgpack: {e}") from None
    # Validate what a reader will see (tuples become lists, keys must be strings, ...).
    validate_manifest(_unpack_manifest(blob), section_names=list(sections))
    _check_tensor_sections(manifest, sections.__getitem__)

    with replacing(path) as f:
        write_container(f, blob, sections)


def pack_package_bytes(manifest_blob: bytes, sections: dict, version=FORMAT_VERSION) -> bytes:
    """A container from an already-encoded manifest, unvalidated: for tests and tools only."""
    f = io.BytesIO()
    write_container(f, manifest_blob, sections, version=version)
    return f.getvalue()


def _open_buffer(source):
    """Return (memoryview, mmap or None, path or None); files are mmapped so sections are zero-copy."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source)
        return (view if view.format == "B" and view.ndim == 1 else view.cast("B")), None, None
    path = os.fspath(source)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses empty files
            return memoryview(b""), None, path
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return memoryview(f.read()), None, path
    return memoryview(mm), mm, path


class Package:
    """A read and fully validated `.grace` package; sections are views into the file's bytes."""

    def __init__(self, buf: memoryview, mm, path, container: Container, manifest: dict):
        self._buf = buf
        self._mmap = mm
        self.path = path
        self.nbytes = buf.nbytes
        self.format_version = container.version
        self.manifest = manifest
        self._sections = {s.name: s for s in container.sections}

    @functools.cached_property
    def view(self) -> Manifest:
        """The typed, defaults-filled view of the manifest (formats.view), built on first use."""
        return build_view(self.manifest)

    @property
    def section_names(self) -> list[str]:
        return list(self._sections)

    @property
    def section_info(self) -> list[tuple[str, int, int, str]]:
        return [(s.name, s.offset, s.nbytes, s.sha256.hex()) for s in self._sections.values()]

    def __contains__(self, name) -> bool:
        return name in self._sections

    def section(self, name: str) -> memoryview:
        s = self._sections.get(name)
        if s is None:
            raise FormatError(f"package has no section {name!r}")
        return self._buf[s.offset:s.offset + s.nbytes]

    def close(self) -> None:
        """Unmap the file; views still held by callers keep the mapping alive until released."""
        try:
            self._buf.release()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        name = (self.manifest.get("model") or {}).get("name", "?") if isinstance(
            self.manifest.get("model"), dict) else "?"
        return (f"<grace.Package {name!r} v{self.format_version[0]}.{self.format_version[1]} "
                f"{len(self._sections)} sections, {self.nbytes} bytes>")


def read_package(source, *, verify: bool = True) -> Package:
    """Open a package from a path or bytes and validate all of it; raise a FormatError subclass if not.

    verify=False skips hashing section data (the header, index and manifest are always checked).
    """
    buf, mm, path = _open_buffer(source)
    try:
        container = parse_container(buf, verify=verify)
        manifest = _unpack_manifest(container.manifest_blob)
        if manifest.get("format_version") != list(container.version):
            raise ManifestError(f"format_version: manifest says {manifest.get('format_version')!r}, "
                                f"the header says {list(container.version)}")
        names = [s.name for s in container.sections]
        validate_manifest(manifest, section_names=names)
        spans = {s.name: (s.offset, s.offset + s.nbytes) for s in container.sections}
        _check_tensor_sections(manifest, lambda name: buf[slice(*spans[name])])
        return Package(buf, mm, path, container, manifest)
    except BaseException:
        if mm is not None:
            try:
                buf.release()
                mm.close()
            except BufferError:  # a view is still alive (e.g. in the traceback); GC unmaps later
                pass
        raise
