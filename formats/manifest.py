"""Schema validation of the manifest (docs/architecture.md, SPEC.md §4).

The runtime launches kernels with raw device pointers computed from these numbers, so a single bad
offset becomes an out-of-bounds write on the GPU. Everything that feeds a pointer, a size or a launch
configuration is therefore checked here, on the CPU, before anything is allocated. Errors carry the
path of the offending field ("graphs[0].nodes[5].args[2]: ...") so a compiler bug can be found from
the message alone. Unknown keys are ignored: newer minor versions may add them.
"""

from __future__ import annotations

import re

from .container import FORMAT_VERSION, check_section_name
from .dtypes import DTYPES, numel
from .errors import FormatError, ManifestError

SLOT_ROLES = ("input", "output")
REGIONS = ("weights", "arena", "table")
_REGION_WORDS = {"weights": "weights region", "arena": "arena", "table": "table"}
WORD_PARAM_TYPES = ("i64", "i32")  # a {"word": i} argument is an integer scalar
WEIGHT_ALIGN = 256
SLOT_ALIGN = 16
MAX_RANK = 64
_GRID_MAX = (2**31 - 1, 65535, 65535)  # CUDA gridDim limits
_PARAM_TYPE_RE = re.compile(r"\*?(i1|i8|i16|i32|i64|u8|u16|u32|u64|fp8e4nv|fp8e5|fp16|bf16|fp32|fp64)")
_ARCH_RE = re.compile(r"sm_[0-9]+[a-z]?")


def _fail(path: str, msg: str):
    raise ManifestError(f"{path}: {msg}")


def _type_name(v) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(d: dict, key: str, path: str):
    if key not in d:
        _fail(path, f"missing required key {key!r}")
    return d[key]


def _dict(v, path: str) -> dict:
    if not isinstance(v, dict):
        _fail(path, f"expected a map, got {_type_name(v)}")
    return v


def _list(v, path: str) -> list:
    if not isinstance(v, (list, tuple)):
        _fail(path, f"expected a list, got {_type_name(v)}")
    return v


def _str(v, path: str) -> str:
    if not isinstance(v, str):
        _fail(path, f"expected a str, got {_type_name(v)}")
    return v


def _int(v, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v):
        _fail(path, f"expected an int, got {_type_name(v)}")
    if lo is not None and v < lo:
        _fail(path, f"{v} is below the minimum {lo}")
    if hi is not None and v > hi:
        _fail(path, f"{v} is above the maximum {hi}")
    return v


def _dtype(v, path: str) -> str:
    if not isinstance(v, str) or v not in DTYPES:
        _fail(path, f"unknown dtype {v!r} (expected one of {', '.join(DTYPES)})")
    return v


def _shape(v, path: str) -> list:
    v = _list(v, path)
    for i, d in enumerate(v):
        _int(d, f"{path}[{i}]", lo=0)
    return v


def _section_ref(v, path: str, section_names) -> str:
    _str(v, path)
    try:
        check_section_name(v)
    except FormatError as e:
        _fail(path, str(e))
    if section_names is not None and v not in section_names:
        _fail(path, f"section {v!r} is not in the package")
    return v


def _no_overlap(spans, what: str) -> None:
    """spans: (offset, end, path); zero-sized spans never overlap anything."""
    spans = sorted(s for s in spans if s[1] > s[0])
    for (a_off, a_end, a_path), (b_off, _, b_path) in zip(spans, spans[1:]):
        if b_off < a_end:
            _fail(b_path, f"{what} starting at {b_off} overlaps {a_path} [{a_off}, {a_end})")


def validate_manifest(manifest, section_names=None) -> None:
    """Raise ManifestError unless `manifest` follows schema v1.

    `section_names` (the package's sections) enables the checks that referenced kernel binaries and
    sources exist; read_package and write_package pass it, a compiler stage may leave it out.
    """
    m = _dict(manifest, "manifest")
    if section_names is not None:
        section_names = set(section_names)

    if "format_version" in m:
        fv = _list(m["format_version"], "format_version")
        if len(fv) != 2 or not all(_is_int(x) for x in fv):
            _fail("format_version", f"expected [major, minor], got {fv!r}")
        if fv[0] != FORMAT_VERSION[0]:
            _fail("format_version", f"major version {fv[0]} is not {FORMAT_VERSION[0]}")
    for key in ("producer", "model", "options"):
        if key in m:
            _dict(m[key], key)

    archs = _list(_get(m, "archs", "manifest"), "archs")
    if not archs:
        _fail("archs", "at least one target architecture is required")
    for i, a in enumerate(archs):
        if not isinstance(a, str) or not _ARCH_RE.fullmatch(a):
            _fail(f"archs[{i}]", f"expected an arch like 'sm_90', got {a!r}")
    if len(set(archs)) != len(archs):
        _fail("archs", "duplicate architectures")

    regions = _regions(m)
    slots, words = _table(m, regions)
    io_slots: dict[int, str] = {}
    _io(m, "inputs", "input", slots, io_slots)
    _io(m, "outputs", "output", slots, io_slots)
    _weights(m, regions, section_names)
    _arena_buffers(m, regions)
    kernels = _kernels(m, archs, section_names)
    _graphs(m, kernels, regions, words)


def _regions(m: dict) -> dict:
    regions = _dict(_get(m, "regions", "manifest"), "regions")
    for r in REGIONS:
        _int(_get(regions, r, "regions"), f"regions.{r}", lo=0)
    return regions


def _table(m: dict, regions: dict) -> tuple[list, int]:
    """Return the slots and the number of table words (1 + 2*rank per slot)."""
    table = _dict(_get(m, "table", "manifest"), "table")
    nbytes = _int(_get(table, "nbytes", "table"), "table.nbytes", lo=0)
    if nbytes != regions["table"]:
        _fail("table.nbytes", f"{nbytes} differs from regions.table ({regions['table']})")
    slots = _list(_get(table, "slots", "table"), "table.slots")
    spans, words = [], 0
    for i, s in enumerate(slots):
        p = f"table.slots[{i}]"
        _dict(s, p)
        _str(_get(s, "name", p), f"{p}.name")
        role = _get(s, "role", p)
        if role not in SLOT_ROLES:
            _fail(f"{p}.role", f"expected one of {SLOT_ROLES}, got {role!r}")
        off = _int(_get(s, "offset", p), f"{p}.offset", lo=0)
        if off % SLOT_ALIGN:
            _fail(f"{p}.offset", f"{off} is not {SLOT_ALIGN}-aligned")
        rank = _int(_get(s, "rank", p), f"{p}.rank", lo=0, hi=MAX_RANK)
        end = off + 8 * (1 + 2 * rank)
        if end > nbytes:
            _fail(p, f"slot bytes [{off}, {end}) exceed the table ({nbytes} bytes)")
        spans.append((off, end, p))
        words += 1 + 2 * rank
    _no_overlap(spans, "slot")
    return slots, words


def _io(m: dict, key: str, role: str, slots: list, io_slots: dict) -> None:
    entries = _list(_get(m, key, "manifest"), key)
    names = set()
    for i, e in enumerate(entries):
        p = f"{key}[{i}]"
        _dict(e, p)
        name = _str(_get(e, "name", p), f"{p}.name")
        if name in names:
            _fail(f"{p}.name", f"duplicate {role} name {name!r}")
        names.add(name)
        _dtype(_get(e, "dtype", p), f"{p}.dtype")
        shape = _shape(_get(e, "shape", p), f"{p}.shape")
        slot = _int(_get(e, "slot", p), f"{p}.slot")
        if not 0 <= slot < len(slots):
            _fail(f"{p}.slot", f"slot {slot} does not exist (the table has {len(slots)} slots)")
        if slots[slot]["role"] != role:
            _fail(f"{p}.slot", f"slot {slot} has role {slots[slot]['role']!r}, expected {role!r}")
        if slots[slot]["rank"] != len(shape):
            _fail(f"{p}.slot", f"slot {slot} has rank {slots[slot]['rank']}, but the shape has rank {len(shape)}")
        if slot in io_slots:
            _fail(f"{p}.slot", f"slot {slot} is already used by {io_slots[slot]}")
        io_slots[slot] = p


def _weights(m: dict, regions: dict, section_names) -> None:
    entries = _list(_get(m, "weights", "manifest"), "weights")
    limit = regions["weights"]
    names, spans = set(), []
    for i, w in enumerate(entries):
        p = f"weights[{i}]"
        _dict(w, p)
        name = _str(_get(w, "name", p), f"{p}.name")
        if name in names:
            _fail(f"{p}.name", f"duplicate weight name {name!r}")
        names.add(name)
        dtype = _dtype(_get(w, "dtype", p), f"{p}.dtype")
        shape = _shape(_get(w, "shape", p), f"{p}.shape")
        off = _int(_get(w, "offset", p), f"{p}.offset", lo=0)
        if off % WEIGHT_ALIGN:
            _fail(f"{p}.offset", f"{off} is not {WEIGHT_ALIGN}-aligned")
        nbytes = _int(_get(w, "nbytes", p), f"{p}.nbytes", lo=0)
        expected = numel(shape) * DTYPES[dtype][0]
        if nbytes != expected:
            _fail(f"{p}.nbytes", f"{nbytes} bytes, but {dtype}{list(shape)} needs {expected}")
        if off + nbytes > limit:
            _fail(p, f"weights range [{off}, {off + nbytes}) exceeds the weights region ({limit} bytes)")
        spans.append((off, off + nbytes, p))
    _no_overlap(spans, "weight")
    if entries and section_names is not None and "weights" not in section_names:
        _fail("weights", "the package has no 'weights' section")


def _arena_buffers(m: dict, regions: dict) -> None:
    if "arena_buffers" not in m:
        return
    limit = regions["arena"]
    for i, b in enumerate(_list(m["arena_buffers"], "arena_buffers")):
        p = f"arena_buffers[{i}]"
        _dict(b, p)
        _str(_get(b, "name", p), f"{p}.name")
        off = _int(_get(b, "offset", p), f"{p}.offset", lo=0)
        nbytes = _int(_get(b, "nbytes", p), f"{p}.nbytes", lo=0)
        if off + nbytes > limit:
            _fail(p, f"arena range [{off}, {off + nbytes}) exceeds the arena ({limit} bytes)")
        if "first" in b and "last" in b:
            first = _int(b["first"], f"{p}.first", lo=0)
            if _int(b["last"], f"{p}.last", lo=0) < first:
                _fail(f"{p}.last", f"{b['last']} is before first ({first})")


def _kernels(m: dict, archs: list, section_names) -> list:
    kernels = _list(_get(m, "kernels", "manifest"), "kernels")
    names = set()
    for i, k in enumerate(kernels):
        p = f"kernels[{i}]"
        _dict(k, p)
        name = _str(_get(k, "name", p), f"{p}.name")
        if name in names:
            _fail(f"{p}.name", f"duplicate kernel name {name!r}")
        names.add(name)
        if "family" in k:
            _str(k["family"], f"{p}.family")
        params = _list(_get(k, "params", p), f"{p}.params")
        pnames = set()
        for j, prm in enumerate(params):
            pp = f"{p}.params[{j}]"
            _dict(prm, pp)
            pname = _str(_get(prm, "name", pp), f"{pp}.name")
            if pname in pnames:
                _fail(f"{pp}.name", f"duplicate parameter name {pname!r}")
            pnames.add(pname)
            ptype = _get(prm, "type", pp)
            if not isinstance(ptype, str) or not _PARAM_TYPE_RE.fullmatch(ptype):
                _fail(f"{pp}.type", f"expected a Triton type like '*fp32' or 'i64', got {ptype!r}")
        warps = _int(_get(k, "num_warps", p), f"{p}.num_warps")
        if warps not in (1, 2, 4, 8, 16, 32):
            _fail(f"{p}.num_warps", f"{warps} is not a power of two in 1..32")
        if "num_stages" in k:
            _int(k["num_stages"], f"{p}.num_stages", lo=1)
        _int(_get(k, "shared", p), f"{p}.shared", lo=0)
        for key in ("hidden_params", "global_scratch_size", "profile_scratch_size"):
            if key in k:
                _int(k[key], f"{p}.{key}", lo=0)
        if "source_sha256" in k:
            _str(k["source_sha256"], f"{p}.source_sha256")
        binaries = _dict(_get(k, "binaries", p), f"{p}.binaries")
        for arch in archs:
            if arch not in binaries:
                _fail(f"{p}.binaries", f"no binary for arch {arch!r}")
        for arch, sec in binaries.items():
            if arch not in archs:
                _fail(f"{p}.binaries", f"arch {arch!r} is not listed in archs {list(archs)}")
            _section_ref(sec, f"{p}.binaries.{arch}", section_names)
        if "source" in k:
            _section_ref(k["source"], f"{p}.source", section_names)
    return kernels


def _graphs(m: dict, kernels: list, regions: dict, words: int) -> None:
    graphs = _list(_get(m, "graphs", "manifest"), "graphs")
    if not graphs:
        _fail("graphs", "at least one graph is required")
    names = set()
    for g_i, g in enumerate(graphs):
        gp = f"graphs[{g_i}]"
        _dict(g, gp)
        name = _str(_get(g, "name", gp), f"{gp}.name")
        if name in names:
            _fail(f"{gp}.name", f"duplicate graph name {name!r}")
        names.add(name)
        if "stats" in g:
            _dict(g["stats"], f"{gp}.stats")
        nodes = _list(_get(g, "nodes", gp), f"{gp}.nodes")
        for n_i, node in enumerate(nodes):
            _node(node, f"{gp}.nodes[{n_i}]", n_i, kernels, regions, words)


def _node(node, p: str, index: int, kernels: list, regions: dict, words: int) -> None:
    _dict(node, p)
    k = _int(_get(node, "kernel", p), f"{p}.kernel")
    if not 0 <= k < len(kernels):
        _fail(f"{p}.kernel", f"kernel {k} does not exist (there are {len(kernels)})")
    params = kernels[k]["params"]
    grid = _list(_get(node, "grid", p), f"{p}.grid")
    if len(grid) != 3:
        _fail(f"{p}.grid", f"expected 3 dimensions, got {len(grid)}")
    for d, (g, hi) in enumerate(zip(grid, _GRID_MAX)):
        _int(g, f"{p}.grid[{d}]", lo=1, hi=hi)
    deps = _list(_get(node, "deps", p), f"{p}.deps")
    for d_i, d in enumerate(deps):
        _int(d, f"{p}.deps[{d_i}]")
        if not 0 <= d < index:
            _fail(f"{p}.deps[{d_i}]", f"dependency {d} is not an earlier node (this is node {index})")
    if len(set(deps)) != len(deps):
        _fail(f"{p}.deps", "duplicate dependencies")
    if "label" in node:
        _str(node["label"], f"{p}.label")
    args = _list(_get(node, "args", p), f"{p}.args")
    if len(args) != len(params):
        _fail(f"{p}.args", f"{len(args)} arguments for kernel {k} ({kernels[k]['name']!r}), "
                           f"which takes {len(params)} parameters")
    for a_i, (arg, prm) in enumerate(zip(args, params)):
        _arg(arg, prm, f"{p}.args[{a_i}]", regions, words)


def _arg(arg, prm: dict, p: str, regions: dict, words: int) -> None:
    _dict(arg, p)
    ptype = prm["type"]
    if "word" in arg:
        if "region" in arg:
            _fail(p, "an argument is either a table word or a region range, not both")
        w = _int(arg["word"], f"{p}.word")
        if not 0 <= w < words:
            _fail(f"{p}.word", f"table word {w} is out of range (the table has {words} words)")
        if ptype not in WORD_PARAM_TYPES:
            _fail(p, f"table word passed to parameter {prm['name']!r} of type {ptype!r} "
                     f"(words need an integer scalar: {'/'.join(WORD_PARAM_TYPES)})")
        return
    region = _get(arg, "region", p)
    if region not in REGIONS:
        _fail(f"{p}.region", f"expected one of {REGIONS}, got {region!r}")
    if not ptype.startswith("*"):
        _fail(p, f"{region} range passed to scalar parameter {prm['name']!r} of type {ptype!r}")
    off = _int(_get(arg, "offset", p), f"{p}.offset", lo=0)
    nbytes = _int(_get(arg, "nbytes", p), f"{p}.nbytes", lo=0)
    if "dtype" in arg:
        _dtype(arg["dtype"], f"{p}.dtype")
    limit = regions[region]
    if off + nbytes > limit:
        _fail(p, f"{region} range [{off}, {off + nbytes}) exceeds the {_REGION_WORDS[region]} ({limit} bytes)")
