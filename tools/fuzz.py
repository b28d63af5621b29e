"""`python -m grace.tools.fuzz`: a mutation fuzzer over `.grace` packages that our compiler wrote.

A package is input from anyone. Every tool that reads one without launching GPU code must finish
on any file with one of grace's typed errors (SPEC.md §2.1, "Limits"), within bounded time and
memory. This fuzzer checks that on mutants of real packages (docs/format-fuzzing.md):

  classes   bytes      1-8 bytes XOR-ed anywhere in the file, or aimed at header, index, manifest
            truncate   the file cut at a random length (the mutant file itself is shorter), or
                       grown by trailing bytes
            index      one field of the header or of a section-index entry edited, with the index
                       hash recomputed so that the edit reaches the index parser
            manifest   1-3 edits of the decoded manifest (a field set to an interesting value, a
                       key dropped, a list entry dropped or duplicated, a type swapped, or a
                       "bomb": deep nesting, millions of empty maps, hidden_params = 2**26, ...),
                       re-encoded, the container rebuilt so every hash matches: the mutant passes
                       the checksums and reaches the validator and every tool behind it
  targets   read       grace.formats.read_package (the reader; everything below starts with it,
                       so a mutant it refuses is refused by all of them)
            verify     `grace verify` (tools/cli.py, in-process, --traceback)
            inspect    `grace inspect --json` (every mutant) and its rich tables (every 16th)
            runtime    grace.runtime.load(instantiate="eager") -> session(poison=True) -> one
                       run() with inputs at their smallest sizes, and generate() of one token for a
                       package with a `generate` map, against FakeDriver (below): no GPU, nothing
                       launched; the driver answers about each kernel from its cubin's ELF
                       (cubin_functions: parameter sizes, .reqntid, static shared memory)
            interpret  the CPU executor's planning (InterpretSession: regions, state, shapes),
                       no kernel run; needs torch (--interpret)

A finding is any exception that is not one of grace's typed errors (typed_errors()), a mutant that
takes longer than --timeout seconds of CPU time or WALL_FACTOR times that of wall time (the worker
is killed and restarted), a MemoryError under the worker's address-space limit (--memory-mb above
what the worker uses after warming up), or a device access outside an allocation
(FakeDriver.violations). Mutants are reproducible: mutant i of a run is a function of (--seed, i)
alone; `--save DIR` writes the mutants of the findings there.

A manifest mutant that every target accepts is classified (`classify`) as harmless or dangerous
by what it changed against its base package (the rules at _CLASS_RULES, docs/format-fuzzing.md);
the summary reports the accepted dangerous ones per manifest mutant, the issue's measure.

    python -m grace.tools.fuzz --count 20000 --seed 1 --workers 2
    python -m grace.tools.fuzz --package model.grace --count 500 --json

Without --package the corpus is compiled once (needs grace.aot and torch) into --corpus (default:
~/.cache/grace/fuzz-corpus, or GRACE_FUZZ_CORPUS; delete it to recompile with a newer compiler): a
static MLP, an MLP with batch buckets, and a one-layer CachedLlama with a KV cache, index checks and
--generate. (Packages with per-arch variants, format 3.5, are fuzzed by tests/test_arch_variants.py
with --package.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import io
import json
import math
import os
import random
import re
import resource
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

from grace.formats.container import FORMAT_VERSION

CLASSES = ("bytes", "truncate", "index", "manifest")
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
RENDER_EVERY = 16    # `grace inspect`'s rich tables for every 16th mutant, --json for all
FAKE_DEVICE_NBYTES = 256 << 20   # FakeDriver's device memory: more than any corpus package needs
INTERPRET_HOST_NBYTES = 256 << 20   # the interpreter's host-memory budget in the fuzzer

# Interesting integers: boundaries of the C types a value may end up in, and of grace's caps.
INTERESTING_INTS = (0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 255, 256, 1023, 1024, 4095, 4096,
                    65535, 65536, 2**16 + 1, 2**20, 2**26, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                    2**40, 2**40 + 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -2**31,
                    -2**63)


# ------------------------------------------------------------------------------------ the corpus

def build_corpus(directory) -> list[Path]:
    """Compile the three corpus models into `directory` (skipping the ones already there) and
    return their paths. Needs grace.aot (torch, triton); cubins come from the build cache."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specs = _corpus_specs()
    paths = []
    for name, build in specs.items():
        path = directory / f"{name}.grace"
        if not path.exists() or _version(path) != FORMAT_VERSION:   # a corpus from an older grace
            build(path)
        paths.append(path)
    return paths


def _version(path) -> tuple:
    """(major, minor) of a package file's header."""
    with open(path, "rb") as f:
        return struct.unpack("<8sHH", f.read(12))[1:]


def _corpus_specs() -> dict:
    """name -> function(path) compiling it. Small on purpose: the fuzzer's cost per mutant is the
    package's size (hashes) and its manifest (validation, planning)."""
    def mlp(path):
        import torch
        from grace.aot import compile as grace_compile
        from grace.tools.models import MLP
        torch.manual_seed(0)
        grace_compile(MLP(32, 64, 16).eval(), (torch.randn(4, 32),), output=path, fp32_matmul="ieee")

    def mlp_buckets(path):
        import torch
        from torch.export import Dim
        from grace.aot import compile as grace_compile
        from grace.tools.models import MLP
        torch.manual_seed(0)
        grace_compile(MLP(32, 64, 16).eval(), (torch.randn(4, 32),), output=path, fp32_matmul="ieee",
                      dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}}, buckets={"batch": [8, 64]})

    def llama(path):
        import torch
        from torch.export import Dim
        from grace.aot import compile as grace_compile
        from grace.tools.models import CachedLlama
        torch.manual_seed(0)
        model = CachedLlama(vocab=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden=64,
                            max_seq=16).eval()
        seq = Dim("seq", min=1, max=16)
        grace_compile(model, (torch.zeros(1, 5, dtype=torch.long), torch.arange(5)), output=path,
                      fp32_matmul="ieee", dynamic_shapes={"idx": {1: seq}, "input_pos": {0: seq}},
                      buckets={"seq": [16]}, generate={"tokens": "idx", "positions": "input_pos"})

    return {"mlp": mlp, "mlp_buckets": mlp_buckets, "llama": llama}


def default_corpus_dir() -> Path:
    return Path(os.environ.get("GRACE_FUZZ_CORPUS", Path.home() / ".cache" / "grace" / "fuzz-corpus"))


# ------------------------------------------------------------------------------------ mutations

class Base:
    """A valid package to mutate: its bytes, header fields, index entries and decoded manifest."""

    def __init__(self, path):
        import msgpack

        from grace.formats import read_package

        self.path = Path(path)
        self.data = self.path.read_bytes()
        pkg = read_package(self.data)
        self.manifest = pkg.manifest
        self.blob = msgpack.packb(pkg.manifest, use_bin_type=True)   # a fresh copy: unpackb(blob)
        self.sections = [(name, bytes(pkg.section(name)), bytes.fromhex(sha))
                         for name, _, _, sha in pkg.section_info]
        (_, major, minor, _, _, self.index_offset, self.index_nbytes, self.manifest_offset,
         self.manifest_nbytes, self.section_count, _, _, _) = struct.unpack_from(_HEADER, self.data)
        self.version = (major, minor)   # mutants keep it: the manifest's format_version says it too
        self.entries = []   # (byte position of the entry in the file, name length)
        pos = self.index_offset
        for _ in range(self.section_count):
            name_len = struct.unpack_from("<H", self.data, pos + 48)[0]
            self.entries.append((pos, name_len))
            pos += 50 + name_len
        self.strings = sorted({s for s in _walk_strings(self.manifest)})
        pkg.close()


_HEADER = "<8sHHIQQQQQII32s32s"
# header fields the index class edits: (byte offset, struct format)
_HEADER_FIELDS = {"major": (8, "<H"), "minor": (10, "<H"), "flags": (12, "<I"),
                  "file_nbytes": (16, "<Q"), "index_offset": (24, "<Q"), "index_nbytes": (32, "<Q"),
                  "manifest_offset": (40, "<Q"), "manifest_nbytes": (48, "<Q"),
                  "section_count": (56, "<I"), "reserved": (60, "<I")}
_ENTRY_FIELDS = {"offset": (0, "<Q"), "nbytes": (8, "<Q"), "name_len": (48, "<H")}


def _walk_strings(obj):
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
        elif isinstance(o, str) and len(o) < 80:
            yield o


def mutant(bases: list[Base], seed: int, i: int) -> tuple[str, str, str, bytes]:
    """Mutant i of a run with this seed: (class, base name, description, bytes). Deterministic."""
    rng = random.Random(f"grace-fuzz/{seed}/{i}")
    cls = CLASSES[i % len(CLASSES)]
    base = bases[(i // len(CLASSES)) % len(bases)]
    mutate = {"bytes": _mutate_bytes, "truncate": _mutate_truncate, "index": _mutate_index,
              "manifest": _mutate_manifest}[cls]
    what, data = mutate(rng, base)
    return cls, base.path.stem, what, data


def _mutate_bytes(rng: random.Random, base: Base) -> tuple[str, bytes]:
    data = bytearray(base.data)
    meta_end = base.manifest_offset + base.manifest_nbytes
    span = rng.choice([len(data), len(data), meta_end, 128 + 64])   # whole file, metadata, header
    count = rng.choice([1, 1, 1, 2, 4, 8])
    positions = rng.sample(range(min(span, len(data))), min(count, span, len(data)))
    for pos in positions:
        data[pos] ^= rng.randrange(1, 256)   # never a no-op
    return f"xor {len(positions)} byte(s) at {sorted(positions)[:8]}", bytes(data)


def _mutate_truncate(rng: random.Random, base: Base) -> tuple[str, bytes]:
    n = len(base.data)
    if rng.random() < 0.1:
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 4096])))
        return f"{len(extra)} trailing byte(s)", base.data + extra
    marks = [0, 8, 12, 127, 128, base.index_offset + base.index_nbytes, base.manifest_offset,
             base.manifest_offset + base.manifest_nbytes]
    marks += [struct.unpack_from("<Q", base.data, pos)[0] for pos, _ in base.entries]   # sections
    choice = rng.random()
    if choice < 0.4:
        cut = max(0, min(n - 1, rng.choice(marks) + rng.randint(-2, 2)))
    elif choice < 0.6:
        cut = rng.randrange(min(n, 512))
    else:
        cut = rng.randrange(n)
    return f"cut to {cut} of {n} bytes", base.data[:cut]


def _mutate_index(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """One header or index field changed; the index hash recomputed over the (new) index range
    when that range lies in the file, so the change reaches the parser behind the hash check."""
    data = bytearray(base.data)
    if rng.random() < 0.35:
        field = rng.choice(list(_HEADER_FIELDS))
        off, fmt = _HEADER_FIELDS[field]
        where = f"header.{field}"
    else:
        k = rng.randrange(len(base.entries))
        pos, name_len = base.entries[k]
        kind = rng.random()
        if kind < 0.15 and name_len:   # one byte of the name
            b = pos + 50 + rng.randrange(name_len)
            data[b] = rng.choice(b"./\x00\xff-_aZ")
            return _rehash_index(data, f"index[{k}].name byte {b - pos - 50}")
        if kind < 0.25:                # two entries swap their data (names stay)
            j = rng.randrange(len(base.entries))
            pj = base.entries[j][0]
            a, b = bytes(data[pos:pos + 48]), bytes(data[pj:pj + 48])
            data[pos:pos + 48], data[pj:pj + 48] = b, a
            return _rehash_index(data, f"index[{k}] and index[{j}] swap offset/nbytes/sha256")
        field = rng.choice(list(_ENTRY_FIELDS))
        rel, fmt = _ENTRY_FIELDS[field]
        off = pos + rel
        where = f"index[{k}].{field}"
    old = struct.unpack_from(fmt, data, off)[0]
    limit = 1 << (8 * struct.calcsize(fmt))
    value = rng.choice([old + 1, old - 1, old + 4096, old - 4096, 0, limit - 1, old * 2, old // 2,
                        rng.randrange(limit), len(base.data), len(base.data) - 1]) % limit
    if value == old:
        value = (old + 1) % limit
    struct.pack_into(fmt, data, off, value)
    return _rehash_index(data, f"{where}: {old} -> {value}")


def _rehash_index(data: bytearray, what: str) -> tuple[str, bytes]:
    import hashlib

    index_offset, index_nbytes = struct.unpack_from("<QQ", data, 24)
    if index_offset + index_nbytes <= len(data):
        data[64:96] = hashlib.sha256(bytes(data[index_offset:index_offset + index_nbytes])).digest()
    return what, bytes(data)


def _mutate_manifest(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """1-3 edits of the manifest, re-encoded and re-packed with every hash valid."""
    import msgpack

    # Drawn again: an edit msgpack cannot encode (an int >= 2**64), and a bomb whose target an
    # edit before it took away (a graph's nodes made a string: seed 39 drew one).
    for _ in range(20):
        m = msgpack.unpackb(base.blob, raw=False)
        edits = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            if rng.random() < 0.03:   # a bomb is the last edit (editing its millions of maps is slow)
                what, fn = rng.choice(_bombs(base))
                try:
                    fn(m, rng)
                except (LookupError, TypeError, AttributeError):
                    edits = None
                    break
                edits.append(what)
                break
            edits.append(_edit(rng, m, base))
        if edits is None:
            continue
        try:
            blob = msgpack.packb(m, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            continue
        return "; ".join(edits), pack(blob, base.sections, base.version)
    return "no encodable edit", base.data


def pack(manifest_blob: bytes, sections, version=None) -> bytes:
    """A container around `manifest_blob` with the layout of grace.formats' writer (SPEC §1) and
    every hash valid; `sections` are (name, bytes, sha256) with their digests precomputed, so a
    manifest mutant costs one sha256 of the manifest (the writer would hash every section).
    `version`: the header's (major, minor), by default this grace's."""
    import hashlib

    from grace.formats.container import ALIGN, MAGIC

    names = [name.encode() for name, _, _ in sections]
    index_nbytes = sum(50 + len(n) for n in names)
    pos = 128 + index_nbytes + len(manifest_blob)
    offsets = []
    for _, data, _ in sections:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += len(data)
    index = b"".join(struct.pack("<QQ32sH", off, len(data), sha, len(n)) + n
                     for off, (_, data, sha), n in zip(offsets, sections, names))
    out = bytearray(pos)
    out[128:128 + index_nbytes] = index
    out[128 + index_nbytes:128 + index_nbytes + len(manifest_blob)] = manifest_blob
    for off, (_, data, _) in zip(offsets, sections):
        out[off:off + len(data)] = data
    struct.pack_into(_HEADER, out, 0, MAGIC, *(version or FORMAT_VERSION), 0, pos, 128, index_nbytes,
                     128 + index_nbytes, len(manifest_blob), len(sections), 0,
                     hashlib.sha256(index).digest(), hashlib.sha256(manifest_blob).digest())
    return bytes(out)


def _paths(m) -> list[tuple]:
    """Every position in the manifest tree as (container, key) pairs."""
    out, stack = [], [m]
    while stack:
        obj = stack.pop()
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            out.append((obj, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _path_text(m, target) -> str:
    """A readable path of a container inside m (for mutant descriptions), found by identity."""
    stack = [(m, "")]
    while stack:
        obj, p = stack.pop()
        if obj is target:
            return p or "manifest"
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(v, (dict, list)) and len(p) < 120:
                stack.append((v, f"{p}.{k}" if isinstance(k, str) else f"{p}[{k}]"))
    return "..."


def _nest(depth: int):
    obj = {}
    for _ in range(depth):
        obj = {"a": obj}
    return obj


# Targeted edits: what the issue's 40,000 manifest mutants found, and the caps' boundaries.
def _bombs(base: Base):
    m = base.manifest
    graph_nodes = [(g, n) for g in range(len(m["graphs"])) for n in range(len(m["graphs"][g]["nodes"]))]
    return [
        ("kernels[*].hidden_params = 2**26", lambda m, r: _each(m["kernels"], "hidden_params", 2**26, r)),
        ("kernels[*].hidden_params deleted", lambda m, r: r.choice(m["kernels"]).pop("hidden_params", None)),
        ("kernels[*].shared = 2**31", lambda m, r: _each(m["kernels"], "shared", 2**31, r)),
        ("kernels[*].shared = 232449", lambda m, r: _each(m["kernels"], "shared", 232449, r)),
        ("regions.arena = 2**63", lambda m, r: m["regions"].__setitem__("arena", 2**63)),
        ("regions.weights = 2**41", lambda m, r: m["regions"].__setitem__("weights", 2**41)),
        ("symbols[*].max = 2**63 - 1", lambda m, r: [s.__setitem__("max", 2**63 - 1) for s in m["symbols"]]),
        ("graphs[*].bucket bounds = 2**40", lambda m, r: [g["bucket"].__setitem__(k, 2**40)
                                                          for g in m["graphs"] for k in g["bucket"]]),
        ("outputs[0].shape[0] = [// 1 0]", lambda m, r: _set_dim(m["outputs"], ["//", 1, 0], 0)),
        ("outputs[0].shape[0] = [// 1 sym]", lambda m, r: _set_dim(
            m["outputs"], ["//", 1, m["symbols"][0]["name"]] if m["symbols"] else 1, 0)),
        ("outputs[0].shape[0] = x*x*x*x", lambda m, r: _set_dim(
            m["outputs"], _power(m["symbols"][0]["name"] if m["symbols"] else 2**20, 4), 0)),
        ("model.deep = 1000-deep maps", lambda m, r: m.setdefault("model", {}).__setitem__("deep", _nest(1000))),
        ("options.deep = 100-deep maps", lambda m, r: m.setdefault("options", {}).__setitem__("deep", _nest(100))),
        ("model.wide = 2**21 empty maps", lambda m, r: m.setdefault("model", {}).__setitem__(
            "wide", [{} for _ in range(2**21)])),
        ("model.long = 4 MiB string", lambda m, r: m.setdefault("model", {}).__setitem__("long", "x" * (4 << 20))),
        ("weights[*].shape = 100000 dims", lambda m, r: m["weights"] and r.choice(m["weights"]).__setitem__(
            "shape", [1] * 100000)),
        ("graphs[*].nodes[*].grid = [2**31, 1, 1]", lambda m, r: _node(m, graph_nodes, r).__setitem__(
            "grid", [2**31, 1, 1])),
        ("kernels[*].num_warps = 64", lambda m, r: _each(m["kernels"], "num_warps", 64, r)),
        ("graphs x 1100", lambda m, r: m["graphs"].extend(copy.deepcopy(m["graphs"][0]) for _ in range(1100))),
    ]


def _each(entries, key, value, rng):
    rng.choice(entries)[key] = value


def _set_dim(outputs, expr, dim):
    if outputs and len(outputs[0]["shape"]) > dim:
        outputs[0]["shape"][dim] = expr


def _power(x, n):
    expr = x
    for _ in range(n - 1):
        expr = ["*", expr, x]
    return expr


def _node(m, graph_nodes, rng):
    g, n = rng.choice(graph_nodes)
    return m["graphs"][g]["nodes"][n]


def _edit(rng: random.Random, m: dict, base: Base) -> str:
    """One edit of m in place; returns its description."""
    container, key = rng.choice(_paths(m))
    value = container[key]
    where = f"{_path_text(m, container)}" + (f".{key}" if isinstance(key, str) else f"[{key}]")
    choice = rng.random()
    if choice < 0.08 and isinstance(container, dict):
        del container[key]
        return f"{where} deleted"
    if isinstance(value, bool) or value is None:
        new = rng.choice([0, 1, "x", None if value is not None else True, [], {}])
    elif isinstance(value, int):
        new = rng.choice([value + 1, value - 1, value * 2, value // 2, -value,
                          rng.choice(INTERESTING_INTS), rng.choice(INTERESTING_INTS),
                          value + rng.choice((4, 8, 16, 256, 4096))])
    elif isinstance(value, str):
        new = rng.choice(["", "x", value + "_", value[:-1], rng.choice(base.strings), 0, None,
                          rng.choice(base.strings), [value], "[/x]", value + "\0", "é" * 300])
    elif isinstance(value, list):
        new = list(value)
        op = rng.random()
        if op < 0.3 and new:
            del new[rng.randrange(len(new))]
        elif op < 0.55 and new:
            new.insert(rng.randrange(len(new) + 1), copy.deepcopy(rng.choice(new)))
        elif op < 0.7 and len(new) > 1:
            a, b = rng.sample(range(len(new)), 2)
            new[a], new[b] = new[b], new[a]
        elif op < 0.8:
            new = []
        else:
            new = rng.choice([{}, 0, "x", None, [new]])
    elif isinstance(value, dict):
        op = rng.random()
        if op < 0.4 and value:
            new = dict(value)
            del new[rng.choice(list(new))]
        elif op < 0.7:
            new = {**value, rng.choice(["x", "region", "word", "offset", "nbytes", "dtype", "init",
                                        "programmatic", "writes", "errors"]):
                   rng.choice([0, 1, -1, "arena", "int64", [], {}, 2**40])}
        else:
            new = rng.choice([[], 0, "x", None, [value]])
    else:   # float, bytes
        new = rng.choice([0, "x", None])
    if type(new) is type(value) and new == value:   # e.g. 0 // 2: change it after all
        new = value + 1 if isinstance(value, int) and not isinstance(value, bool) else [value]
    container[key] = new
    return f"{where}: {_short(value)} -> {_short(new)}"


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------ cubins

_EIATTR_KPARAM_INFO, _EIATTR_REQNTID, _EIATTR_MAX_THREADS = 0x17, 0x10, 0x05


def cubin_functions(image: bytes) -> dict:
    """What the CUDA driver would report about each kernel of a cubin, read from the ELF itself:
    {name: {"params": [size of each parameter, in order], "max_threads": threads per block the
    binary allows (its .reqntid/.maxntid, else 1024), "reqntid": the exact block it must be
    launched with (.reqntid, which Triton sets) or None, "static_shared": bytes of its
    .nv.shared.<name> section}}. For FakeDriver, so that the
    runtime's cubin checks (grace.runtime.abi) meet the real binaries' answers without a GPU.
    Raises ValueError for an image that is not a well-formed ELF64 cubin."""
    data = bytes(image)
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 image")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise ValueError("section headers outside the image")
    sections = []
    for i in range(shnum):
        name, typ, _, _, off, size, link, info, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((name, typ, off, size, link, info))
    strtab = sections[shstrndx][2]

    def text(at: int) -> str:
        end = data.find(b"\0", at)
        return data[at:end if end >= 0 else len(data)].decode("latin-1")

    named = [(text(strtab + s[0]), *s[1:]) for s in sections]
    kernels: dict = {}
    for name, typ, off, size, link, info in named:
        if name.startswith(".text."):
            kernels.setdefault(name[6:], {"params": {}, "max_threads": 1024, "reqntid": None,
                                          "static_shared": 0})
    for name, typ, off, size, link, info in named:
        if name.startswith(".nv.shared.") and name[11:] in kernels:
            kernels[name[11:]]["static_shared"] = size
        if not name.startswith(".nv.info.") or name[9:] not in kernels:
            continue
        k, blob, pos = kernels[name[9:]], data[off:off + size], 0
        while pos + 2 <= len(blob):
            fmt, attr = blob[pos], blob[pos + 1]
            if fmt == 4:      # EIFMT_SVAL: u16 size, then the value
                n, = struct.unpack_from("<H", blob, pos + 2)
                value, pos = blob[pos + 4:pos + 4 + n], pos + 4 + n
            elif fmt == 3:    # EIFMT_HVAL: a u16
                value, pos = blob[pos + 2:pos + 4], pos + 4
            elif fmt == 2:    # EIFMT_BVAL: a byte
                value, pos = blob[pos + 2:pos + 3], pos + 3
            else:             # EIFMT_NVAL: nothing
                value, pos = b"", pos + 2
            if attr == _EIATTR_KPARAM_INFO and len(value) >= 12:
                _, ordinal, _, flags = struct.unpack_from("<IHHI", value)
                k["params"][ordinal] = (flags >> 18) & 0x3FFF
            elif attr in (_EIATTR_REQNTID, _EIATTR_MAX_THREADS) and len(value) >= 12:
                x, y, z = struct.unpack_from("<III", value)
                k["max_threads"] = min(k["max_threads"], x * y * z)
                if attr == _EIATTR_REQNTID:
                    k["reqntid"] = (x, y, z)
    for k in kernels.values():
        k["params"] = [k["params"][i] for i in sorted(k["params"])]
    return kernels


# ------------------------------------------------------------------------------------ targets

def typed_errors() -> tuple:
    """grace's typed errors: what a tool may raise for a bad package or bad input."""
    from grace.formats import FormatError
    from grace.runtime.errors import GraceRuntimeError
    from grace.tools.cli import CliError
    from grace.tools.source_check import SourceRefused

    errors = [FormatError, GraceRuntimeError, CliError, SourceRefused]
    interpret = sys.modules.get("grace.tools.interpret")
    if interpret is not None:
        errors.append(interpret.InterpretError)
    return tuple(errors)


class FakeDriver:
    """cuda.bindings.driver with host memory for device memory, for the load path without a GPU.

    It keeps the real bindings' structs and enums (so a field out of range of its C type raises
    OverflowError as it would on a GPU), and answers like a device would where a runtime must not
    rely on luck: `cuMemAlloc` refuses more than `device_nbytes` (CUDA_ERROR_OUT_OF_MEMORY) and
    sizes beyond size_t (OverflowError, as the binding does), `cuModuleLoadData` an image that is
    not an ELF (CUDA_ERROR_INVALID_IMAGE), `cuModuleGetFunction` a name the image does not contain
    (CUDA_ERROR_NOT_FOUND), `cuFuncSetAttribute` more dynamic shared memory than an H200 has.
    Copies and memsets outside an allocation are refused and recorded in `violations`: the
    runtime computed a device address outside the memory it owns."""

    SHARED_OPTIN_MAX = 232448   # H100/H200 cudaDevAttrMaxSharedMemoryPerBlockOptin
    SHARED_PER_SM = 233472      # H100/H200: 228 KiB per multiprocessor
    SHARED_RESERVED = 1024      # what the driver keeps per block
    SHARED_DEFAULT = 48 * 1024  # a block's dynamic shared memory without opting in
    SM_COUNT = 132

    def __init__(self, device_nbytes: int = FAKE_DEVICE_NBYTES, capability: tuple = (9, 0)):
        from cuda.bindings import driver as real

        self._real = real
        self.capability = tuple(capability)   # the compute capability it reports (an H200's)
        self.names = {}          # function handle -> its kernel name
        self.kernel_nodes = []   # the kernel name of every kernel node added to a graph
        self.programmatic = 0    # programmatic edges added (cuGraphAddDependencies)
        self.node_shared = []    # the dynamic shared memory of every kernel node added
        self.opted_in = {}       # function handle -> its MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.ok = real.CUresult.CUDA_SUCCESS
        self._err = real.CUresult
        self.device_nbytes = device_nbytes
        self.used = 0
        self.memory = {}      # address -> (buffer, nbytes)
        self.modules = {}     # module handle -> {kernel name: what its binary reports}
        self.functions = {}   # function handle -> what its binary reports
        self.conditionals = []   # the body graphs' handle arrays of the WHILE nodes (kept alive)
        self.violations = []  # what the runtime asked outside its memory
        self._handles = 0x100

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _handle(self) -> int:
        self._handles += 1
        return self._handles

    def cuGetErrorName(self, err): return (self.ok, str(err).encode())
    def cuGetErrorString(self, err): return (self.ok, b"fake driver")

    # device and context
    def cuInit(self, flags): return (self.ok,)
    def cuDeviceGetCount(self): return (self.ok, 1)
    def cuDeviceGet(self, i): return (self.ok, self._real.CUdevice(i))
    def cuDeviceGetName(self, n, dev): return (self.ok, b"Fake H200")
    def cuDevicePrimaryCtxRetain(self, dev): return (self.ok, self._real.CUcontext(0xC0))
    def cuDevicePrimaryCtxRelease(self, dev): return (self.ok,)
    def cuCtxSetCurrent(self, ctx): return (self.ok,)

    def cuDeviceGetAttribute(self, attr, dev):
        a = self._real.CUdevice_attribute
        if attr == a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
            return (self.ok, self.SHARED_OPTIN_MAX)
        if attr == a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
            return (self.ok, self.capability[0])
        if attr == a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
            return (self.ok, self.capability[1])
        return (self.ok, {a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.SM_COUNT,
                          a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: self.SHARED_PER_SM,
                          a.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: self.SHARED_RESERVED,
                          }.get(attr, 0))

    # modules: a cubin's kernels and what the driver would report about each are read from the
    # ELF itself (cubin_functions); PTX text (the runtime's set_condition kernel) by its entries
    def cuModuleLoadData(self, image):
        image = bytes(image)
        if image.startswith(b".version"):
            entries = re.findall(rb"\.entry\s+(\w+)\s*\(([^)]*)\)", image)
            functions = {name.decode(): {"params": [8] * len(re.findall(rb"\.param", params)),
                                         "max_threads": 1024, "reqntid": None, "static_shared": 0}
                         for name, params in entries}
        else:
            try:
                functions = cubin_functions(image)
            except (ValueError, struct.error):
                return (self._err.CUDA_ERROR_INVALID_IMAGE, None)
        module = self._real.CUmodule(self._handle())
        self.modules[int(module)] = functions
        return (self.ok, module)

    def cuModuleGetFunction(self, module, name):
        info = self.modules.get(int(module), {}).get(bytes(name).decode("latin-1"))
        if info is None:
            return (self._err.CUDA_ERROR_NOT_FOUND, None)
        function = self._real.CUfunction(self._handle())
        self.functions[int(function)] = info
        self.names[int(function)] = bytes(name).decode("latin-1")
        return (self.ok, function)

    def cuFuncGetParamInfo(self, function, index):
        sizes = self.functions[int(function)]["params"]
        if not 0 <= index < len(sizes):
            return (self._err.CUDA_ERROR_INVALID_VALUE, 0, 0)
        return (self.ok, 8 * index, sizes[index])

    def cuFuncGetAttribute(self, attr, function):
        info, a = self.functions[int(function)], self._real.CUfunction_attribute
        value = {a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: info["max_threads"],
                 a.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: info["static_shared"],
                 a.CU_FUNC_ATTRIBUTE_NUM_REGS: 32}.get(attr)
        return (self._err.CUDA_ERROR_INVALID_VALUE, 0) if value is None else (self.ok, value)

    def cuFuncSetAttribute(self, function, attr, value):
        if not -2**31 <= value < 2**31:
            raise OverflowError(f"value {value} does not fit a C int")   # as the binding does
        if value > self.SHARED_OPTIN_MAX:
            return (self._err.CUDA_ERROR_INVALID_VALUE,)
        if attr == self._real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            self.opted_in[int(function)] = value
        return (self.ok,)

    def cuModuleUnload(self, module):
        self.modules.pop(int(module), None)
        return (self.ok,)

    # memory
    def cuMemAlloc(self, n):
        if not 0 <= n < 2**64:
            raise OverflowError(f"{n} does not fit a size_t")   # as the binding does
        if self.used + n > self.device_nbytes:
            return (self._err.CUDA_ERROR_OUT_OF_MEMORY, None)
        buf = ctypes.create_string_buffer(n + 256)
        addr = (ctypes.addressof(buf) + 255) // 256 * 256
        self.memory[addr] = (buf, n)
        self.used += n
        return (self.ok, self._real.CUdeviceptr(addr))

    def cuMemFree(self, p):
        _, n = self.memory.pop(int(p))
        self.used -= n
        return (self.ok,)

    def _inside(self, ptr: int, n: int, what: str) -> bool:
        ptr = int(ptr)
        for addr, (_, size) in self.memory.items():
            if addr <= ptr and ptr + n <= addr + size:
                return True
        self.violations.append(f"{what} of {n} bytes at {ptr:#x}: outside every allocation")
        return False

    def cuMemHostRegister(self, p, n, flags): return (self.ok,)
    def cuMemHostUnregister(self, p): return (self.ok,)

    def cuMemcpyHtoD(self, dst, src, n):
        if not self._inside(dst, n, "cuMemcpyHtoD"):
            return (self._err.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(int(dst), src, n)
        return (self.ok,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream): return self.cuMemcpyHtoD(dst, src, n)

    def cuMemcpyDtoH(self, dst, src, n):
        if not self._inside(src, n, "cuMemcpyDtoH"):
            return (self._err.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, int(src), n)
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream): return self.cuMemcpyDtoH(dst, src, n)

    def cuMemsetD8Async(self, p, value, n, stream):
        if not self._inside(p, n, "cuMemsetD8Async"):
            return (self._err.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memset(int(p), value, n)
        return (self.ok,)

    def cuPointerGetAttribute(self, attr, ptr):
        for addr, (_, n) in self.memory.items():
            if addr <= ptr < addr + n:
                return (self.ok, 0)
        return (self._err.CUDA_ERROR_INVALID_VALUE, None)

    # streams and events
    def cuStreamCreate(self, flags): return (self.ok, self._real.CUstream(0x5000))
    def cuStreamDestroy(self, s): return (self.ok,)
    def cuStreamSynchronize(self, s): return (self.ok,)
    def cuStreamWaitEvent(self, s, e, flags): return (self.ok,)
    def cuEventCreate(self, flags): return (self.ok, self._real.CUevent(0x6000))
    def cuEventRecord(self, e, s): return (self.ok,)
    def cuEventDestroy(self, e): return (self.ok,)

    # graphs
    def cuGraphCreate(self, flags): return (self.ok, self._real.CUgraph(self._handle()))

    def cuGraphAddKernelNode(self, g, deps, n, p):
        info = self.functions.get(int(p.func))
        block = (p.blockDimX, p.blockDimY, p.blockDimZ)
        if n != len(deps) or info is None or block[0] * block[1] * block[2] > info["max_threads"] \
                or (info["reqntid"] is not None and block != info["reqntid"]) \
                or p.sharedMemBytes > self.opted_in.get(int(p.func), self.SHARED_DEFAULT):
            return (self._err.CUDA_ERROR_INVALID_VALUE, None)   # a real GPU: at the launch
        self.kernel_nodes.append(self.names.get(int(p.func)))
        self.node_shared.append(p.sharedMemBytes)
        return (self.ok, self._real.CUgraphNode(self._handle()))

    def cuGraphConditionalHandleCreate(self, g, ctx, default, flags):
        return (self.ok, self._real.CUgraphConditionalHandle(self._handle()))

    def cuGraphAddNode(self, g, deps, edge_data, n, p):
        """A WHILE conditional node: its body graph is returned through phGraph_out, as the
        driver does (the array belongs to the driver, so the fake keeps it alive)."""
        if n != len(deps) or p.type != self._real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL:
            return (self._err.CUDA_ERROR_INVALID_VALUE, None)
        body = (ctypes.c_uint64 * 1)(self._handle())
        self.conditionals.append(body)
        ctypes.c_uint64.from_address(p.conditional.getPtr() + 16).value = ctypes.addressof(body)
        return (self.ok, self._real.CUgraphNode(self._handle()))

    def cuGraphAddDependencies(self, g, from_, to, edges, n):
        self.programmatic += sum(
            int(e.type) == int(self._real.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
            for e in edges)
        return (self.ok,)

    def cuGraphInstantiate(self, g, flags): return (self.ok, self._real.CUgraphExec(self._handle()))
    def cuGraphUpload(self, e, s): return (self.ok,)
    def cuGraphExecKernelNodeSetParams(self, e, node, p): return (self.ok,)
    def cuGraphLaunch(self, e, s): return (self.ok,)
    def cuGraphExecDestroy(self, e): return (self.ok,)
    def cuGraphDestroy(self, g): return (self.ok,)


def _cli(argv: list[str]) -> str:
    """Run `grace ARGV --traceback` in this process; return its stdout. Exceptions propagate."""
    from grace.tools import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--traceback", *argv])
    if rc != 0:
        raise cli.CliError(f"exit status {rc}: {err.getvalue().strip()[-200:]}")
    return out.getvalue()


def _smallest_inputs(view) -> list:
    """Per input, its shape at every symbol's minimum (static dims as they are)."""
    lo = {s.name: s.min for s in view.symbols}
    return [tuple(lo[d] if isinstance(d, str) else d for d in spec.shape) for spec in view.inputs]


def _stage_runtime(path: str, fake: FakeDriver) -> None:
    """load (eager) -> session (poison) -> run() at the smallest input sizes, and for a package
    with a `generate` map generate() of one token after the shortest prompt (its WHILE-loop
    graph, the runtime's PTX set_condition kernel), on FakeDriver. The driver module the runtime
    uses is restored afterwards (a test may call this in its own process)."""
    import numpy as np

    import grace.runtime as rt
    from grace.runtime import driver
    from grace.runtime.arrays import DeviceArray

    previous, driver._cu = driver._cu, fake
    try:
        pkg = rt.load(path, instantiate="eager")
        try:
            session = pkg.session(poison=True)
            scratch = driver.mem_alloc(256)   # inputs are device arrays: nothing reads them here
            inputs = [DeviceArray(scratch, shape, spec.dtype, 0)
                      for spec, shape in zip(pkg.inputs, _smallest_inputs(pkg.view))]
            session.run(*inputs)
            if pkg.generate is not None:
                shortest = max(pkg.generate.prompt_limit[0], 1)
                session.generate(np.zeros(shortest, np.int64), max_new_tokens=1)
            session.close()
            driver.mem_free(scratch)
        finally:
            pkg.close()
    finally:
        driver._cu = previous


def _stage_interpret(path: str) -> None:
    """The CPU executor up to its first kernel: regions, weights, state, the call's shapes."""
    import numpy as np

    from grace.tools import interpret

    sess = interpret.InterpretSession(path, max_host_nbytes=INTERPRET_HOST_NBYTES)
    view = sess.view
    arrays = {}
    for spec, shape in zip(view.inputs, _smallest_inputs(view)):
        dtype = interpret._DTYPES[spec.dtype][0]
        # zero strides: any shape without its memory (only the shape is read while planning)
        arrays[spec.name] = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))
    values, g = interpret._resolve(sess.plan, view, arrays, None)
    with interpret._as_interpret_errors():
        sess.plan.output_shapes(values, g)


def run_mutant(path: str, stages: tuple, render: bool = True,
               fake_nbytes: int = FAKE_DEVICE_NBYTES) -> dict:
    """Every target on the file at `path`; {"outcome": "rejected" | "accepted" | "finding", ...}.
    `stages`: the targets after `read` to run; `render`: inspect also renders its tables (rich
    takes ~100 ms for a small package, 8x the rest of inspect)."""
    from grace.formats import read_package

    typed = typed_errors()
    result = {"outcome": "accepted", "stages": {}}
    if "_hang" in stages:   # never ends: tests/test_fuzz.py checks the hang detection with it
        time.sleep(3600)
        stages = tuple(s for s in stages if s != "_hang")
    for stage in ("read", *stages):
        t0 = time.perf_counter()
        fake = None
        try:
            if stage == "read":
                read_package(path).close()
            elif stage == "verify":
                _cli(["verify", path])
            elif stage == "inspect":
                json.loads(_cli(["inspect", "--json", path]))
                if render:
                    _cli(["inspect", path])
            elif stage == "runtime":
                fake = FakeDriver(fake_nbytes)
                _stage_runtime(path, fake)
            elif stage == "interpret":
                _stage_interpret(path)
            status = "ok"
        except typed as e:
            status = f"{type(e).__name__}"
            if result["outcome"] == "accepted":
                result.update(outcome="rejected", first=stage, error=f"{type(e).__name__}: {_one_line(e)}")
        except BaseException as e:   # noqa: BLE001 - anything else is what we are looking for
            if isinstance(e, KeyboardInterrupt):
                raise
            result.update(outcome="finding", kind="memory" if isinstance(e, MemoryError) else "crash",
                          stage=stage, error=f"{type(e).__name__}: {_one_line(e)}",
                          where=_where(e))
            return result
        finally:
            result["stages"][stage] = round(time.perf_counter() - t0, 4)
        if fake is not None and fake.violations:
            result.update(outcome="finding", kind="device memory", stage=stage,
                          error=fake.violations[0], where="")
            return result
        if stage == "read" and status != "ok":
            return result   # every later target starts with the same read_package
    return result


def _one_line(e) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _where(e: BaseException) -> str:
    """The innermost frame inside grace of a traceback ("formats/manifest.py:123 in _node")."""
    frames = traceback.extract_tb(e.__traceback__)
    inside = [f for f in frames if "/grace/" in f.filename or "/work/" in f.filename] or frames
    f = inside[-1] if inside else None
    return f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} in {f.name}" if f else "?"


# ------------------------------------------------------------------------------------ classifying

# A manifest mutant that every target accepted is *dangerous* when it changes something the runtime
# or the CPU executor acts on (which kernel runs, with which pointers, words, grid, block, shared
# memory, hidden parameters, in which order; what is allocated, uploaded and initialised; which
# inputs are accepted and which graph serves them; where table words are written and the error word
# is read; the generate loop), and *harmless* when it only changes what is displayed (names, labels,
# stats, options) or a claim that only the checks read (an argument's nbytes and dtype, a kernel's
# `writes`, the compiler's records): a claim changes nothing that runs. Two kinds of field are judged
# against the base package instead of by their name alone (docs/format-fuzzing.md, "Classifying"):
#   sizes   a region, a graph's arena, the table's bytes: dangerous only when below what the base
#           package's nodes touch there (more memory is harmless)
#   edges   deps and programmatic deps: dangerous only when the base package's own accesses (its
#           kernels' `writes`, its argument ranges) are no longer ordered, i.e. formats/races.py finds
#           a race in the base package with the mutant's edges, or a programmatic edge now targets a
#           kernel that does not wait (an added edge, or a redundant one removed, is harmless)
# A mutant is dangerous when one of its changes is. Anything not listed is an unknown key, which
# every reader ignores (SPEC §3): harmless.
_NODE = r"(graphs\[\]\.nodes\[\]|generate\.step)"
_CLASS_RULES = [   # (regex over the generalised path, category, verdict); the first match wins
    (r"(format_version|producer|model|options|arena_buffers)\b.*", "informative", "harmless"),
    (r"(kernels|graphs)\[\]\.compiled\b.*", "compiler records", "harmless"),
    (r"kernels\[\]\.(num_stages|family|source_sha256)", "informative", "harmless"),
    (r"kernels\[\]\.writes\b.*", "claims", "harmless"),
    (r"kernels\[\]\.params\[\]\.name", "informative", "harmless"),
    (r"kernels\[\]\.params(\[\](\.type)?)?", "kernel ABI", "dangerous"),
    (r"kernels\[\]\.hidden_params", "kernel ABI", "hidden"),
    (r"kernels\[\]\.(global_scratch_size|profile_scratch_size)", "kernel ABI", "default0"),
    (r"kernels\[\]\.shared", "kernel ABI", "lowered"),
    (r"kernels\[\]\.(name|num_warps)", "kernel ABI", "dangerous"),
    (r"kernels\[\]\.source", "kernel binary", "source"),
    (r"kernels\[\]\.binaries\b.*", "kernel binary", "dangerous"),
    (r"kernels(\[\])?", "kernels", "dangerous"),
    (_NODE + r"\.(deps|programmatic)\b.*", "edges", "edges"),
    (_NODE + r"\.kernel", "node kernel", "dangerous"),
    (_NODE + r"\.grid\b.*", "grid", "dangerous"),
    (_NODE + r"\.args\[\]\.(nbytes|dtype)", "claims", "harmless"),
    (_NODE + r"\.args\[\]\.(region|offset|word)", "args", "arg"),
    (_NODE + r"\.args(\[\])?", "args", "dangerous"),
    (_NODE + r"\.label", "informative", "harmless"),
    (r"graphs\[\]\.nodes(\[\])?", "nodes", "dangerous"),
    (r"generate\.step", "generate", "dangerous"),
    (r"graphs\[\]\.bucket\b.*", "bucket bounds", "dangerous"),
    (r"graphs\[\]\.archs\b.*", "variants", "dangerous"),   # which GPUs run the graph (3.5)
    (r"graphs\[\]\.arena", "sizes", "size"),
    (r"graphs\[\]\.(name|stats)\b.*", "informative", "harmless"),
    (r"graphs(\[\])?", "graphs", "dangerous"),
    (r"regions\.(weights|arena|table|state)", "sizes", "size"),
    (r"regions", "regions", "dangerous"),
    (r"table\.nbytes", "sizes", "size"),
    (r"table\.slots\[\]\.name", "informative", "harmless"),
    (r"table\.slots(\[\](\.(offset|rank|role))?)?", "table layout", "dangerous"),
    (r"table\.extents\.offset", "table layout", "extents"),
    (r"table\.extents(\.count)?", "table layout", "dangerous"),
    (r"table\.errors(\.offset)?", "table layout", "dangerous"),
    (r"table", "table layout", "dangerous"),
    (r"(inputs|outputs)\[\]\.name", "informative", "harmless"),
    (r"(inputs|outputs)\[\]\.(dtype|slot|shape\b.*)", "io", "dangerous"),
    (r"(inputs|outputs)(\[\])?", "io", "dangerous"),
    (r"symbols\[\]\.max", "symbols", "harmless"),
    (r"symbols\[\]\.min", "symbols", "lowered"),
    (r"symbols\[\]\.(name|kind|sources\b.*)", "symbols", "dangerous"),
    (r"symbols(\[\])?", "symbols", "dangerous"),
    (r"state\[\]\.name", "state", "state-name"),
    (r"state\[\]\.shape\b.*", "weights and state", "state-shape"),
    (r"(weights|state)\[\]\.(name|dtype|offset|nbytes|shape\b.*)", "weights and state", "dangerous"),
    (r"state\[\]\.init", "weights and state", "dangerous"),
    (r"(weights|state)(\[\])?", "weights and state", "dangerous"),
    (r"generate\.(tokens|positions|logits|capacity|decode_graph|ctrl|out_tokens|next_token|"
     r"next_position)", "generate", "dangerous"),
    (r"generate", "generate", "dangerous"),
    (r"index_checks\[\]\.(code|input|op|where|size\b.*)", "informative", "harmless"),
    (r"index_checks(\[\])?", "index checks", "checks"),
]
_CLASS_RULES = [(re.compile(p), cat, verdict) for p, cat, verdict in _CLASS_RULES]


def manifest_changes(base, mutant) -> list[tuple]:
    """The paths (tuples of keys and indices) where `mutant` differs from `base`: a key added or
    removed, a value or type changed, or a list whose length changed (the list's own path; its
    entries are not compared then). Cheap on bombs: a list of 2**21 maps is one changed path."""
    out = []
    stack = [(base, mutant, ())]
    while stack:
        a, b, path = stack.pop()
        if type(a) is not type(b):
            out.append(path)
        elif isinstance(a, dict):
            for k in a.keys() | b.keys():
                if k not in a or k not in b:
                    out.append(path + (k,))
                else:
                    stack.append((a[k], b[k], path + (k,)))
        elif isinstance(a, list):
            if len(a) != len(b):
                out.append(path)
            else:
                stack.extend((x, y, path + (i,)) for i, (x, y) in enumerate(zip(a, b)))
        elif a != b:
            out.append(path)
    return out


def _by_name(m):
    """`m` with the lists whose order means nothing in a canonical order (a shallow copy): weights
    and state entries by name (they are looked up by name), each symbol's sources (a set: every
    source must agree). Lists of other shapes stay as they are."""
    if not isinstance(m, dict):
        return m
    out = dict(m)
    for key in ("weights", "state"):
        entries = m.get(key)
        if isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                             for e in entries):
            out[key] = sorted(entries, key=lambda e: e["name"])
    symbols = m.get("symbols")
    if isinstance(symbols, list):
        out["symbols"] = [_sorted_sources(s) for s in symbols]
    return out


def _sorted_sources(symbol):
    sources = symbol.get("sources") if isinstance(symbol, dict) else None
    if not isinstance(sources, list) or not all(
            isinstance(p, list) and all(isinstance(x, int) for x in p) for p in sources):
        return symbol
    return {**symbol, "sources": sorted(sources)}


def _general(path: tuple) -> str:
    """("graphs", 0, "nodes", 5, "deps") -> "graphs[].nodes[].deps"."""
    text = ""
    for k in path:
        text += "[]" if isinstance(k, int) else (f".{k}" if text else str(k))
    return text


def classify(base: "Base", mutant_manifest: dict) -> dict:
    """{"dangerous": sorted categories, "harmless": sorted categories} of an accepted mutant's
    changes against its base package (the rules above)."""
    dangerous, harmless = set(), set()
    edges = sizes = False
    # the judged rules read the entries at the changed paths, so they see the same order
    old, new = _by_name(base.manifest), _by_name(mutant_manifest)
    for path in manifest_changes(old, new):
        general = _general(path)
        for pattern, category, verdict in _CLASS_RULES:
            if pattern.fullmatch(general):
                break
        else:
            category, verdict = "unknown key", "harmless"
        if verdict == "edges":
            edges = True
        elif verdict == "size":
            sizes = True
        else:
            if verdict in _JUDGED:
                verdict = "dangerous" if _JUDGED[verdict](old, new, path) else "harmless"
            (dangerous if verdict == "dangerous" else harmless).add(category)
    if edges:
        (dangerous if _edges_lose_order(base, mutant_manifest) else harmless).add("edges")
    if sizes:
        (dangerous if _sizes_shrink(base, mutant_manifest) else harmless).add("sizes")
    return {"dangerous": sorted(dangerous), "harmless": sorted(harmless)}


def _at(m, path: tuple, default=None):
    """The value at `path` in m, `default` where the path does not exist."""
    for k in path:
        try:
            m = m[k]
        except (KeyError, IndexError, TypeError):
            return default
    return m


_MISSING = object()


def _default0(base: dict, m: dict, path: tuple) -> bool:
    """hidden_params and the scratch sizes: absent means 0 (SPEC §3); dangerous iff the value the
    runtime uses changed."""
    return _at(base, path, 0) != _at(m, path, 0)


def _hidden(base: dict, m: dict, path: tuple) -> bool:
    """hidden_params (absent: 0): fewer than the binary takes and the driver reads past the
    parameter block; more, and it copies only the parameters the function has (harmless)."""
    old, new = _at(base, path, 0), _at(m, path, 0)
    return not (isinstance(new, int) and not isinstance(new, bool) and new >= old)


def _lowered(base: dict, m: dict, path: tuple) -> bool:
    """A kernel's shared memory or a symbol's min: more shared memory or a higher minimum is
    harmless (a block reserves more, fewer sizes are served); a lower value is dangerous."""
    old, new = _at(base, path, _MISSING), _at(m, path, _MISSING)
    return not (isinstance(old, int) and isinstance(new, int) and not isinstance(new, bool) and new >= old)


def _state_name(base: dict, m: dict, path: tuple) -> bool:
    """Renaming a zero-initialised state entry only changes the key read_state() returns; a `data`
    entry's name picks the tensor it is initialised from."""
    return _at(base, path[:-1] + ("init",)) != "zeros"


def _state_shape(base: dict, m: dict, path: tuple) -> bool:
    """A zero-initialised state entry's shape with as many elements: the session clears and moves
    it by `nbytes` and its kernels address it by offset, so only the array read_state() returns
    changes shape (a `data` entry's shape is its tensor's; another element count, another size)."""
    old, new = _at(base, path[:2]), _at(m, path[:2])
    if not (isinstance(old, dict) and isinstance(new, dict) and old.get("init") == "zeros"):
        return True
    dims = new.get("shape")
    if not (isinstance(dims, list) and all(type(d) is int and d >= 0 for d in dims)):
        return True
    return math.prod(dims) != math.prod(old["shape"])


def _source(base: dict, m: dict, path: tuple) -> bool:
    """Only the CPU executor and `grace verify` read a kernel's source: without one the executor
    refuses to run the kernel (harmless); another kernel's source would run the wrong code."""
    return _at(m, path, _MISSING) is not _MISSING


def _arg(base: dict, m: dict, path: tuple) -> bool:
    """A node argument's region, offset or word. A table-word argument is its `word` alone: any
    other key of it is unknown to every reader (SPEC §3) unless it makes the argument a region
    range, which the validator refuses."""
    old = _at(base, path[:-1])
    return not (isinstance(old, dict) and "word" in old and path[-1] != "word")


def _extents(base: dict, m: dict, path: tuple) -> bool:
    """Where the extents words are matters only when there are some (one per symbol)."""
    return bool(base["symbols"])


def _checks(base: dict, m: dict, path: tuple) -> bool:
    """The index checks, an entry added or dropped: while some are listed the session reads the
    error word, and a code no entry lists still raises (InvalidPackageError, "a kernel of the
    package is wrong", runtime/checks.py) where the dropped entry's code raised
    IndexOutOfRangeError: a message changes, as with an entry's `code` or `where`. Dangerous when
    none is left of the base's (no word read: an out-of-range index would pass unreported)."""
    old, new = _at(base, path, []), _at(m, path, _MISSING)
    return bool(old) and not (isinstance(new, list) and new)


_JUDGED = {"default0": _default0, "lowered": _lowered, "state-name": _state_name, "source": _source,
           "extents": _extents, "arg": _arg, "hidden": _hidden, "checks": _checks,
           "state-shape": _state_shape}


def _edges_lose_order(base: "Base", m: dict) -> bool:
    """The base package with the mutant's deps and programmatic deps: does formats/races.py find a
    race, or a programmatic edge into a kernel that does not wait first?"""
    from grace.formats import races

    hybrid = copy.deepcopy(base.manifest)
    try:
        for g, graph in enumerate(hybrid["graphs"]):
            nodes = m["graphs"][g]["nodes"]
            if len(nodes) != len(graph["nodes"]):
                return True   # the nodes changed too: "nodes" already calls it dangerous
            for node, other in zip(graph["nodes"], nodes):
                node["deps"] = list(other["deps"])
                node.pop("programmatic", None)
                if other.get("programmatic"):
                    node["programmatic"] = list(other["programmatic"])
        sections = {name: data for name, data, _ in base.sections}
        shim = type("Shim", (), {"manifest": hybrid, "section": staticmethod(sections.__getitem__)})
        return bool(races.check_races(hybrid) or races.check_pre_wait(shim))
    except (KeyError, IndexError, TypeError):
        return True


def _touched(m: dict) -> dict:
    """What the base package's nodes (and its weights and state entries) reach, per size field:
    {("regions", r): end, ("graphs", g): arena end}."""
    ends: dict = {}

    def reach(key, end):
        ends[key] = max(ends.get(key, 0), end)

    nodes = [(g, n) for g, graph in enumerate(m["graphs"]) for n in graph["nodes"]]
    if "generate" in m:
        nodes.append((None, m["generate"]["step"]))
    for g, node in nodes:
        for arg in node["args"]:
            if "region" in arg:
                end = arg["offset"] + arg["nbytes"]
                reach(("regions", arg["region"]), end)
                if arg["region"] == "arena" and g is not None:
                    reach(("graphs", g), end)
    for key in ("weights", "state"):
        for e in m[key]:
            reach(("regions", key), e["offset"] + e["nbytes"])
    return ends


def _sizes_shrink(base: "Base", m: dict) -> bool:
    """A region, a graph's arena or the table's bytes below what the base package touches there."""
    try:
        for (kind, key), end in _touched(base.manifest).items():
            value = m["regions"][key] if kind == "regions" else m["graphs"][key]["arena"]
            if not isinstance(value, int) or value < end:
                return True
        return not isinstance(m["table"]["nbytes"], int) or m["table"]["nbytes"] < _touched(base.manifest).get(("regions", "table"), 0)
    except (KeyError, IndexError, TypeError):
        return True


# ------------------------------------------------------------------------------------ workers

def _worker(conn, paths: list[str], seed: int, stages: tuple, memory_mb: int, workdir: str) -> None:
    """One worker process: builds the mutants it is sent (by index) and runs every target on them.
    Its address space is limited to what it uses after a warm-up plus `memory_mb`."""
    bases = [Base(p) for p in paths]
    target = os.path.join(workdir, f"mutant-{os.getpid()}.grace")
    for p in paths:                       # warm-up: imports, thread pools, allocator arenas
        run_mutant(p, tuple(s for s in stages if s != "_hang"))
    if memory_mb:
        used = _address_space()
        limit = used + (memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    conn.send("ready")
    while True:
        i = conn.recv()
        if i is None:
            break
        cls, base, what, data = mutant(bases, seed, i)
        with open(target, "wb") as f:     # "wb" truncates: the mutant file is exactly `data`
            f.write(data)
        assert os.path.getsize(target) == len(data)
        t0 = time.perf_counter()
        try:
            result = run_mutant(target, stages, render=i % RENDER_EVERY == 0)
        except MemoryError as e:          # outside a stage (building the message, ...)
            result = {"outcome": "finding", "kind": "memory", "stage": "?", "error": repr(e), "where": ""}
        if cls == "manifest":
            result["edits_records"] = ".compiled" in what   # the edit's path names a record
            if result["outcome"] == "accepted":
                result.update(classify(next(b for b in bases if b.path.stem == base), _manifest_of(data)))
        result.update(i=i, cls=cls, base=base, what=what, seconds=round(time.perf_counter() - t0, 4),
                      rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
        conn.send(result)


def _manifest_of(data: bytes) -> dict:
    """The decoded manifest of a package that read_package accepted."""
    import msgpack

    from grace.formats.container import parse_container

    blob = parse_container(memoryview(data), verify=False).manifest_blob
    return msgpack.unpackb(bytes(blob), raw=False, strict_map_key=False)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


WALL_FACTOR = 4   # a mutant may take this many times --timeout of wall time (a loaded machine)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process `pid` has used so far; 0.0 where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class _Pool:
    """Worker processes with one mutant in flight each; a mutant past the timeout kills its worker
    (a hang finding) and a fresh worker takes its place. The timeout counts the worker's CPU time,
    so that a machine shared with other jobs does not turn slow mutants into hangs; a mutant that
    waits without computing is caught by the wall clock at WALL_FACTOR times the timeout."""

    def __init__(self, n: int, args: tuple):
        import multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self._args = args
        self.workers = [self._start() for _ in range(n)]

    def _start(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, *self._args), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError("a fuzz worker did not start")
        return {"proc": proc, "conn": parent, "job": None, "since": 0.0, "cpu": 0.0}

    def run(self, indices, timeout: float, on_result) -> None:
        from multiprocessing.connection import wait

        pending = list(reversed(list(indices)))
        while pending or any(w["job"] is not None for w in self.workers):
            for w in self.workers:
                if w["job"] is None and pending:
                    w["job"], w["since"] = pending.pop(), time.monotonic()
                    w["cpu"] = _cpu_seconds(w["proc"].pid)
                    w["conn"].send(w["job"])
            busy = [w for w in self.workers if w["job"] is not None]
            ready = wait([w["conn"] for w in busy], timeout=0.2)
            for w in busy:
                if w["conn"] in ready:
                    try:
                        result = w["conn"].recv()
                    except EOFError:     # the worker died (a segfault, an abort)
                        on_result(self._dead(w, "the worker process died"))
                        continue
                    w["job"] = None
                    on_result(result)
                elif _cpu_seconds(w["proc"].pid) - w["cpu"] > timeout:
                    on_result(self._dead(w, f"no result after {timeout:g} s of CPU time"))
                elif time.monotonic() - w["since"] > WALL_FACTOR * timeout:
                    on_result(self._dead(w, f"no result after {WALL_FACTOR * timeout:g} s"))

    def _dead(self, w, why: str) -> dict:
        i = w["job"]
        w["proc"].kill()
        w["proc"].join()
        code = w["proc"].exitcode
        w.update(self._start())
        kind = "hang" if why.startswith("no result") else "crash"
        return {"i": i, "outcome": "finding", "kind": kind, "stage": "?", "error": f"{why} (exit code {code})",
                "where": ""}

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w["conn"].send(None)
            w["proc"].join(5)
            if w["proc"].is_alive():
                w["proc"].kill()


# ------------------------------------------------------------------------------------ a run

def fuzz(paths, count: int, seed: int = 0, *, workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
         memory_mb: int = DEFAULT_MEMORY_MB, stages=("verify", "inspect", "runtime"),
         progress=None) -> dict:
    """Run mutants 0..count-1 of `paths` with this seed; return the summary (see `summarize`)."""
    paths = [str(p) for p in paths]
    stages = tuple(stages)
    results = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="grace-fuzz-") as workdir:
        pool = _Pool(workers, (paths, seed, stages, memory_mb, workdir))
        started = time.monotonic()
        try:
            def collect(r):
                results.append(r)
                if progress is not None:
                    progress(len(results), count, r)
            pool.run(range(count), timeout, collect)
        finally:
            pool.close()
    summary = summarize(results, paths, seed, stages)
    summary["seconds"] = {"total": round(time.monotonic() - t0, 2), "fuzzing": round(time.monotonic() - started, 2)}
    return summary


def summarize(results: list[dict], paths, seed: int, stages) -> dict:
    """Counts per class (rejected by the first stage that refused, accepted, findings) and the
    findings themselves, each with what mutant it was."""
    bases = [Base(p) for p in paths]
    per_class = {c: {"mutants": 0, "rejected": {}, "accepted": 0, "findings": 0} for c in CLASSES}
    per_class["manifest"].update(dangerous=0, without_record_edits=0, dangerous_without_record_edits=0)
    stage_seconds = {s: 0.0 for s in ("read", *stages)}
    findings, dangerous, categories = [], [], {}
    for r in sorted(results, key=lambda r: r["i"]):
        for stage, seconds in r.get("stages", {}).items():
            stage_seconds[stage] += seconds
        if "cls" not in r:   # a hang or a dead worker: rebuild the mutant's description
            r["cls"], r["base"], r["what"], _ = mutant(bases, seed, r["i"])
        c = per_class[r["cls"]]
        c["mutants"] += 1
        clean = r["cls"] == "manifest" and not r.get("edits_records")
        if clean:
            c["without_record_edits"] += 1
        if r["outcome"] == "rejected":
            c["rejected"][r["first"]] = c["rejected"].get(r["first"], 0) + 1
        elif r["outcome"] == "accepted":
            c["accepted"] += 1
            for cat in r.get("dangerous", ()):
                categories[cat] = categories.get(cat, 0) + 1
            if r.get("dangerous"):
                c["dangerous"] += 1
                c["dangerous_without_record_edits"] += clean
                dangerous.append({k: r.get(k) for k in ("i", "base", "what", "dangerous")})
        else:
            c["findings"] += 1
            findings.append({k: r.get(k) for k in ("i", "cls", "base", "what", "kind", "stage", "error", "where")})
    timed = [r for r in results if "seconds" in r]
    slowest = sorted(timed, key=lambda r: -r["seconds"])[:3]
    return {"seed": seed, "packages": [Path(p).name for p in paths], "stages": ["read", *stages],
            "mutants": len(results), "classes": per_class,
            "stage_seconds": {k: round(v, 2) for k, v in stage_seconds.items()},
            "slowest": [{"i": r["i"], "seconds": r["seconds"], "what": r["what"]} for r in slowest],
            "worker_peak_rss_mb": max((r.get("rss_mb", 0) for r in timed), default=0),
            "findings": findings, "dangerous_rate": _rate(per_class["manifest"]),
            "dangerous_rate_without_record_edits": _rate(per_class["manifest"], "without_record_edits"),
            "dangerous_categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "accepted_dangerous": dangerous}


def _rate(c: dict, key: str = "") -> float:
    """Accepted dangerous manifest mutants per manifest mutant (the issue's measure); with key
    "without_record_edits": among the mutants whose edits leave the compiler's records alone (a
    record edit is harmless when accepted, so records would otherwise dilute the rate)."""
    if key:
        return c[f"dangerous_{key}"] / c[key] if c[key] else 0.0
    return c["dangerous"] / c["mutants"] if c["mutants"] else 0.0


def save_findings(summary: dict, paths, directory) -> None:
    """Write the mutant of every finding to DIRECTORY/<i>-<class>.grace, plus findings.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bases = [Base(p) for p in paths]
    for f in summary["findings"]:
        *_, data = mutant(bases, summary["seed"], f["i"])
        (directory / f"{f['i']}-{f['cls']}.grace").write_bytes(data)
    (directory / "findings.json").write_text(json.dumps(summary["findings"], indent=2))


def format_summary(s: dict) -> str:
    lines = [f"{s['mutants']} mutants of {', '.join(s['packages'])} (seed {s['seed']}), "
             f"targets {' -> '.join(s['stages'])}"]
    for cls, c in s["classes"].items():
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(c["rejected"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  {cls:9s} {c['mutants']:7d} mutants: rejected {sum(c['rejected'].values())} "
                     f"({rejected or '-'}), accepted {c['accepted']}, findings {c['findings']}")
    seconds = s.get("seconds", {})
    if seconds:
        per_stage = ", ".join(f"{k} {v:g} s" for k, v in s.get("stage_seconds", {}).items())
        lines.append(f"  {seconds['total']} s ({seconds['fuzzing']} s fuzzing; summed over workers: {per_stage})")
    if s.get("slowest"):
        lines.append(f"  slowest mutant {s['slowest'][0]['seconds']} s (#{s['slowest'][0]['i']}: "
                     f"{s['slowest'][0]['what'][:80]}); worker peak RSS {s.get('worker_peak_rss_mb')} MB")
    m = s["classes"]["manifest"]
    lines.append(f"accepted dangerous manifest mutants: {m.get('dangerous', 0)} of {m['mutants']} "
                 f"({100 * s.get('dangerous_rate', 0):.2f}%); {m.get('dangerous_without_record_edits', 0)} "
                 f"of the {m.get('without_record_edits', 0)} that edit no record "
                 f"({100 * s.get('dangerous_rate_without_record_edits', 0):.2f}%)"
                 + "".join(f"; {k} {v}" for k, v in s.get("dangerous_categories", {}).items()))
    for d in s.get("accepted_dangerous", [])[:20]:
        lines.append(f"  #{d['i']} {d['base']} [{', '.join(d['dangerous'])}] {d['what'][:150]}")
    lines.append(f"findings: {len(s['findings'])}")
    for f in s["findings"][:50]:
        lines.append(f"  #{f['i']} {f['cls']}/{f['base']} [{f['kind']} in {f['stage']}] {f['error']} "
                     f"({f['where']}); mutant: {f['what']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m grace.tools.fuzz",
        description="Mutation fuzzer over .grace packages: every mutant must be refused with one of "
                    "grace's typed errors (or accepted) by the reader, grace verify, grace inspect, the "
                    "runtime's load path (fake driver) and optionally the CPU executor's planning, "
                    "within --timeout seconds and --memory-mb. Exit status 1 when there are findings.")
    p.add_argument("--count", type=int, default=1000, help="mutants to run (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="mutant i is a function of (seed, i) (default 0)")
    p.add_argument("--package", action="append", default=[], metavar="PATH",
                   help="a package to mutate (repeatable); default: the compiled corpus")
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help=f"where the corpus is compiled and cached (default {default_corpus_dir()})")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: 2)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"CPU seconds per mutant before it counts as a hang, {WALL_FACTOR}x that of wall "
                        f"time (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB,
                   help=f"address space a worker may add while running a mutant (default {DEFAULT_MEMORY_MB})")
    p.add_argument("--interpret", action="store_true",
                   help="also run the CPU executor's planning (imports torch in every worker)")
    p.add_argument("--no-runtime", action="store_true", help="skip the runtime's load path")
    p.add_argument("--save", metavar="DIR", help="write the mutants of the findings to DIR")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)

    paths = args.package or build_corpus(args.corpus or default_corpus_dir())
    stages = ["verify", "inspect"]
    if not args.no_runtime:
        stages.append("runtime")
    if args.interpret:
        stages.append("interpret")

    def progress(done, total, r):
        if not args.json and (done % 500 == 0 or done == total):
            print(f"  {done}/{total}", file=sys.stderr, flush=True)

    summary = fuzz(paths, args.count, args.seed, workers=args.workers, timeout=args.timeout,
                   memory_mb=args.memory_mb, stages=stages, progress=progress)
    if args.save and summary["findings"]:
        save_findings(summary, paths, args.save)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
