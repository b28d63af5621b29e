"""Schema validation of the manifest, format 3.x (SPEC.md §3, docs/architecture.md).

The runtime launches kernels with raw device pointers computed from these numbers, so a single bad
offset becomes an out-of-bounds write on the GPU. Everything that feeds a pointer, a size or a launch
configuration is therefore checked here, on the CPU, before anything is allocated. Errors carry the
path of the offending field ("graphs[0].nodes[5].args[2]: ...") so a compiler bug can be found from
the message alone. Unknown keys are ignored: newer minor versions may add them.

Format 2.0 adds shape buckets (docs/design-buckets.md): `symbols` (dynamic dimensions), shape
expressions in the I/O shapes, the `table.extents` words that carry the symbol values to kernels,
and per graph its `bucket` (the symbol bounds it was lowered for) and `arena` (the bytes it uses).
The cross-references between them are all checked here, because the runtime derives every
graph's choice and every table word from them without further checks.

Format 3.0 adds session state (docs/design-state.md): the `state` region and its table of named
tensors (`state`), node arguments that point into it, and the optional `generate` map that lets
the runtime drive a causal LM on the device. The runtime launches `generate.step` and feeds the
state entries it names back into the decode graph, so every name it uses is resolved and
type-checked here.

Format 3.3 adds index checks: every gather index (embedding, x[idx], index_select, gather) is
clamped into its table on the device, and a kernel that saw an index out of range stores that
gather's code (`index_checks[i].code`) into one int64 table word (`table.errors`), which the
runtime reads at its synchronising points. Both keys are optional; the word is checked against
the slots and the extents like them, the checks against the inputs they name.

Format 3.4 adds the compiler's records of what each kernel and graph was compiled for
(`kernels[i].compiled`, `graphs[i].compiled`): formats.crosscheck checks every node against them
as the last step here (SPEC §3.4, rules C1-C8), and skips that for a package without records.

Format 3.5 adds per-arch variants (SPEC §3.5): a graph may name the archs it serves
(`graphs[i].archs`, absent: all of `archs`), so one package holds, e.g., sm_90 graphs with
programmatic edges and sm_80 graphs without. The graph rules then hold per arch (one graph per
bucket per arch, one graph per arch without symbols), every arch serves the same buckets, a kernel
has a binary for every arch a graph that runs it serves (and the generation step for every arch),
and no graph of an arch before sm_90 has programmatic edges.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from . import archs as arch_rules
from . import limits
from .container import FORMAT_VERSION, check_section_name
from .crosscheck import check_records
from .dtypes import DTYPES, numel
from .errors import FormatError, ManifestError
from .limits import I64_MAX as _I64_MAX
from .limits import MAX_RANK
from .shapes import check_shape_expr, expr_magnitude, expr_symbols, format_shape_expr
from .table import SLOT_ALIGN, slot_nbytes, word_count

SLOT_ROLES = ("input", "output")
REGIONS = ("weights", "arena", "table", "state")
# how an out-of-range message names each region; arena args are checked against graphs[i].arena
_REGION_WORDS = {"weights": "weights region", "arena": "graph's arena", "table": "table",
                 "state": "state region"}
STATE_INITS = ("zeros", "data")  # zero-filled (no bytes in the file) or a tensor of the state section
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
WORD_PARAM_TYPES = ("i64", "i32")  # a {"word": i} argument is an integer scalar
WEIGHT_ALIGN = 256  # weights and state entries alike
SYMBOL_KINDS = ("input", "data")
EXTENTS_ALIGN = 8  # symbol values are int64 table words
ERRORS_ALIGN = 8   # the index-check error word is one int64
_SYMBOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_GRID_MAX = limits.MAX_GRID
# kernels are looked up by name in their cubin (cuModuleGetFunction): a C identifier
_KERNEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_PARAM_TYPE_RE = re.compile(r"\*?(i1|i8|i16|i32|i64|u8|u16|u32|u64|fp8e4nv|fp8e5|fp16|bf16|fp32|fp64)")
_ARCH_RE = arch_rules.ARCH_RE


class Symbol(NamedTuple):
    """A validated `symbols[index]` entry; `sources` are (input_index, dim) pairs in manifest order."""
    index: int
    name: str
    kind: str
    min: int
    max: int
    sources: tuple


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


def _list(v, path: str, most: int | None = None) -> list:
    """A list; `most`: its cap on entries (formats.limits), so no loop over it is unbounded."""
    if not isinstance(v, (list, tuple)):
        _fail(path, f"expected a list, got {_type_name(v)}")
    if most is not None and len(v) > most:
        _fail(path, f"{len(v)} entries, above the limit of {most}")
    return v


def _str(v, path: str) -> str:
    if not isinstance(v, str):
        _fail(path, f"expected a str, got {_type_name(v)}")
    return v


def _int(v, path: str, lo: int | None = None, hi: int | None = _I64_MAX) -> int:
    """An int (not a bool) in [lo, hi]; every int of a manifest is at most int64's maximum unless
    a tighter cap applies (formats.limits)."""
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
    v = _list(v, path, MAX_RANK)
    for i, d in enumerate(v):
        _int(d, f"{path}[{i}]", lo=0)
    return v


def _span_check(path: str, dims, itemsize: int, what: str) -> None:
    """A tensor's dims (or bounds on them) keep prod(max(d, 1)) * itemsize within
    MAX_TENSOR_NBYTES: that bounds its bytes and also its strides, whatever dims are 0."""
    span = itemsize
    for d in dims:
        span *= max(d, 1)
        if span > limits.MAX_TENSOR_NBYTES:
            _fail(path, f"{what} spans more than {limits.MAX_TENSOR_NBYTES} bytes "
                        "(the product of its dims, zeros counted as 1, times the item size)")


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
    """Raise ManifestError unless `manifest` follows schema 3.x (SPEC.md §3), its compiler records
    (3.4, §3.4) included.

    `section_names` (the package's sections) enables the checks that referenced kernel binaries and
    sources exist; read_package and write_package pass it, a compiler stage may leave it out.
    """
    m = _dict(manifest, "manifest")
    if section_names is not None:
        section_names = set(section_names)

    if "format_version" in m:
        fv = _list(m["format_version"], "format_version")
        if len(fv) != 2 or not all(_is_int(x) and 0 <= x <= 0xFFFF for x in fv):
            _fail("format_version", f"expected [major, minor] (u16 each), got {fv!r}")
        if fv[0] != FORMAT_VERSION[0]:
            _fail("format_version", f"major version {fv[0]} is not {FORMAT_VERSION[0]}: "
                                    "recompile the model with this grace")
    for key in ("producer", "model", "options"):
        if key in m:
            _dict(m[key], key)

    archs = _list(_get(m, "archs", "manifest"), "archs", limits.MAX_ARCHS)
    if not archs:
        _fail("archs", "at least one target architecture is required")
    for i, a in enumerate(archs):
        if not isinstance(a, str) or not _ARCH_RE.fullmatch(a):
            _fail(f"archs[{i}]", f"expected an arch like 'sm_90', got {a!r}")
    if len(set(archs)) != len(archs):
        _fail("archs", "duplicate architectures")

    regions = _regions(m)
    symbols = _symbols(m)
    slots, words = _table(m, regions, len(symbols))
    io_slots: dict[int, str] = {}
    inputs = _io(m, "inputs", "input", slots, io_slots,
                 lambda d, p, i, dim: _input_dim(d, p, i, dim, symbols))
    outputs = _io(m, "outputs", "output", slots, io_slots,
                  lambda d, p, i, dim: _output_dim(d, p, dim, symbols))
    _slots_owned(slots, io_slots)
    _index_checks(m, inputs, symbols)
    _symbol_sources(symbols, inputs)
    _weights(m, regions, section_names)
    state = _state(m, regions, section_names)
    _arena_buffers(m, regions)
    kernels = _kernels(m, archs, section_names)
    graphs, served = _graphs(m, kernels, regions, words, symbols, archs)
    _io_extents(inputs, outputs, m.get("index_checks", ()), graphs, symbols)
    if "generate" in m:
        _generate(m["generate"], inputs, outputs, state, len(graphs), kernels, regions, words)
    _kernel_binaries(m, kernels, served, archs)   # 3.5: a binary for every arch a kernel runs on
    check_records(m, symbols)   # 3.4: every node against what its kernel was compiled for


def _regions(m: dict) -> dict:
    regions = _dict(_get(m, "regions", "manifest"), "regions")
    for r in REGIONS:
        _int(_get(regions, r, "regions"), f"regions.{r}", lo=0, hi=limits.MAX_REGION_NBYTES)
    return regions


def _symbols(m: dict) -> dict[str, Symbol]:
    """Check `symbols` on its own (sources are checked against the inputs by `_symbol_sources`)."""
    entries = _list(_get(m, "symbols", "manifest"), "symbols", limits.MAX_SYMBOLS)
    symbols: dict[str, Symbol] = {}
    for i, s in enumerate(entries):
        p = f"symbols[{i}]"
        _dict(s, p)
        name = _str(_get(s, "name", p), f"{p}.name")
        if not _SYMBOL_NAME_RE.fullmatch(name):
            _fail(f"{p}.name", f"{name!r} is not an identifier ([A-Za-z_][A-Za-z0-9_.]*)")
        if name in symbols:
            _fail(f"{p}.name", f"duplicate symbol name {name!r}")
        kind = _get(s, "kind", p)
        if kind not in SYMBOL_KINDS:
            _fail(f"{p}.kind", f"expected one of {SYMBOL_KINDS}, got {kind!r}")
        lo = _int(_get(s, "min", p), f"{p}.min", lo=0, hi=_I64_MAX)
        hi = _int(_get(s, "max", p), f"{p}.max", lo=0, hi=_I64_MAX)
        if hi < lo:
            _fail(f"{p}.max", f"{hi} is below min ({lo})")
        sources = _sources(_get(s, "sources", p), f"{p}.sources")
        if kind == "input" and not sources:
            _fail(f"{p}.sources", f"input symbol {name!r} needs at least one source [input_index, dim]")
        if kind == "data" and sources:
            _fail(f"{p}.sources", f"data symbol {name!r} must have no sources (a kernel computes its value)")
        symbols[name] = Symbol(i, name, kind, lo, hi, sources)
    return symbols


def _sources(v, path: str) -> tuple:
    """A symbol's sources as (input_index, dim) pairs: well-formed and without repeats."""
    pairs: list[tuple[int, int]] = []
    for j, src in enumerate(_list(v, path, 2 * limits.MAX_IO)):
        sp = f"{path}[{j}]"
        _list(src, sp)
        if len(src) != 2:
            _fail(sp, f"expected [input_index, dim], got a list of {len(src)}")
        pair = (_int(src[0], f"{sp}[0]", lo=0), _int(src[1], f"{sp}[1]", lo=0))
        if pair in pairs:
            _fail(sp, f"duplicate source {list(pair)}")
        pairs.append(pair)
    return tuple(pairs)


def _table(m: dict, regions: dict, n_symbols: int) -> tuple[list, int]:
    """Return the slots and the number of table words (formats.table: the slots' words, then one
    per symbol)."""
    table = _dict(_get(m, "table", "manifest"), "table")
    nbytes = _int(_get(table, "nbytes", "table"), "table.nbytes", lo=0)
    if nbytes != regions["table"]:
        _fail("table.nbytes", f"{nbytes} differs from regions.table ({regions['table']})")
    slots = _list(_get(table, "slots", "table"), "table.slots", 2 * limits.MAX_IO)
    spans = []
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
        end = off + slot_nbytes(rank)
        if end > nbytes:
            _fail(p, f"slot bytes [{off}, {end}) exceed the table ({nbytes} bytes)")
        spans.append((off, end, p))
    _no_overlap(spans, "slot")
    ext_span = _extents(table, nbytes, n_symbols, spans)
    _errors_word(table, nbytes, spans + [ext_span])
    return slots, word_count((s["rank"] for s in slots), n_symbols)


def _extents(table: dict, nbytes: int, n_symbols: int, slot_spans: list) -> None:
    """`table.extents`: one int64 word per symbol, inside the table and clear of every slot."""
    p = "table.extents"
    ext = _dict(_get(table, "extents", "table"), p)
    off = _int(_get(ext, "offset", p), f"{p}.offset", lo=0)
    if off % EXTENTS_ALIGN:
        _fail(f"{p}.offset", f"{off} is not a multiple of {EXTENTS_ALIGN}")
    count = _int(_get(ext, "count", p), f"{p}.count", lo=0)
    if count != n_symbols:
        _fail(f"{p}.count", f"{count}, but the manifest declares {n_symbols} symbols")
    end = off + 8 * count
    if end > nbytes:
        _fail(p, f"extents bytes [{off}, {end}) exceed the table ({nbytes} bytes)")
    for s_off, s_end, s_path in slot_spans:
        if off < s_end and s_off < end:
            _fail(p, f"extents bytes [{off}, {end}) overlap {s_path} [{s_off}, {s_end})")
    return off, end, p


def _errors_word(table: dict, nbytes: int, spans: list) -> None:
    """`table.errors` (3.3, optional): the int64 word index checks store their code into, inside
    the table and clear of every slot and of the extents (the table writer never writes it)."""
    if "errors" not in table:
        return
    p = "table.errors"
    err = _dict(table["errors"], p)
    off = _int(_get(err, "offset", p), f"{p}.offset", lo=0)
    if off % ERRORS_ALIGN:
        _fail(f"{p}.offset", f"{off} is not a multiple of {ERRORS_ALIGN}")
    end = off + 8
    if end > nbytes:
        _fail(p, f"error word bytes [{off}, {end}) exceed the table ({nbytes} bytes)")
    for s_off, s_end, s_path in spans:
        if off < s_end and s_off < end:
            _fail(p, f"error word bytes [{off}, {end}) overlap {s_path} [{s_off}, {s_end})")


def _index_checks(m: dict, inputs: list, symbols: dict) -> None:
    """`index_checks` (3.3, optional): what each code stored into `table.errors` means, so the
    runtime can name the input, the op and the source line of an out-of-range index."""
    if "index_checks" not in m:
        return
    checks = _list(m["index_checks"], "index_checks", limits.MAX_INDEX_CHECKS)
    if checks and "errors" not in m["table"]:
        _fail("index_checks", "the package has index checks but no table.errors word to report them")
    names = [e["name"] for e in inputs]
    codes: dict[int, str] = {}
    for i, c in enumerate(checks):
        p = f"index_checks[{i}]"
        _dict(c, p)
        code = _int(_get(c, "code", p), f"{p}.code", lo=1, hi=_I64_MAX)
        if code in codes:
            _fail(f"{p}.code", f"duplicate code {code} (also {codes[code]})")
        codes[code] = p
        name = _get(c, "input", p)
        if name is not None:
            _str(name, f"{p}.input")
            if name not in names:
                _fail(f"{p}.input", f"{name!r} is not an input (the inputs are {names})")
        _str(_get(c, "op", p), f"{p}.op")
        _str(_get(c, "where", p), f"{p}.where")
        check_shape_expr(_get(c, "size", p), f"{p}.size", symbols)


def _io(m: dict, key: str, role: str, slots: list, io_slots: dict, check_dim) -> list:
    """Check `inputs` or `outputs`; `check_dim(d, path, index, dim)` checks one dim of a shape."""
    entries = _list(_get(m, key, "manifest"), key, limits.MAX_IO)
    names = set()
    for i, e in enumerate(entries):
        p = f"{key}[{i}]"
        _dict(e, p)
        name = _str(_get(e, "name", p), f"{p}.name")
        if name in names:
            _fail(f"{p}.name", f"duplicate {role} name {name!r}")
        names.add(name)
        _dtype(_get(e, "dtype", p), f"{p}.dtype")
        shape = _list(_get(e, "shape", p), f"{p}.shape", MAX_RANK)
        for dim, d in enumerate(shape):
            check_dim(d, f"{p}.shape[{dim}]", i, dim)
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
    return entries


def _slots_owned(slots: list, io_slots: dict) -> None:
    """Every slot describes one input or output: a runtime has no tensor to fill another with."""
    for i in range(len(slots)):
        if i not in io_slots:
            _fail(f"table.slots[{i}]", "belongs to no input or output")


def _input_dim(d, path: str, index: int, dim: int, symbols: dict) -> None:
    """An input dim is a static size or an input symbol that names this dim among its sources."""
    if _is_int(d):
        _int(d, path, lo=0)
        return
    if not isinstance(d, str):
        _fail(path, f"expected an int or an input symbol name, got {_type_name(d)}")
    sym = symbols.get(d)
    if sym is None:
        _fail(path, f"{d!r} is not a declared symbol")
    if sym.kind != "input":
        _fail(path, f"{d!r} is a {sym.kind} symbol; input dims are ints or input symbols")
    if (index, dim) not in sym.sources:
        _fail(path, f"symbol {d!r} does not list [{index}, {dim}] among its sources")


def _output_dim(d, path: str, dim: int, symbols: dict) -> None:
    """An output dim is any shape expression; a data-dependent one only as dim 0, so that the host
    can compute the strides of the (contiguous) output without knowing the data symbol's value."""
    check_shape_expr(d, path, symbols)
    data = sorted(n for n in expr_symbols(d) if symbols[n].kind == "data")
    if data and dim != 0:
        _fail(path, f"{format_shape_expr(d)!r} uses data symbol {data[0]!r}, which may only appear "
                    f"in dim 0 (the host must know the strides), not dim {dim}")


def _symbol_sources(symbols: dict, inputs: list) -> None:
    """Every source of a symbol is an input dim whose shape entry is exactly the symbol's name."""
    for sym in symbols.values():
        for j, (i, dim) in enumerate(sym.sources):
            sp = f"symbols[{sym.index}].sources[{j}]"
            if i >= len(inputs):
                _fail(sp, f"input {i} does not exist (there are {len(inputs)} inputs)")
            shape = inputs[i]["shape"]
            if dim >= len(shape):
                _fail(sp, f"dim {dim} is out of range for inputs[{i}] of rank {len(shape)}")
            if shape[dim] != sym.name:
                _fail(sp, f"inputs[{i}].shape[{dim}] is {shape[dim]!r}, not the symbol {sym.name!r}")


def _weights(m: dict, regions: dict, section_names) -> None:
    entries = _tensor_table(m, "weights", "weight", regions["weights"])
    if entries and section_names is not None and "weights" not in section_names:
        _fail("weights", "the package has no 'weights' section")


def _state(m: dict, regions: dict, section_names) -> dict[str, dict]:
    """`state`: the session state tensors, by name. Laid out like the weights (the runtime computes
    their device pointers the same way) plus an `init`: zeros cost no bytes in the file, data
    entries are tensors of the `state` section."""
    entries = _tensor_table(m, "state", "state entry", regions["state"])
    data = []
    for i, s in enumerate(entries):
        init = _get(s, "init", f"state[{i}]")
        if init not in STATE_INITS:
            _fail(f"state[{i}].init", f"expected one of {STATE_INITS}, got {init!r}")
        if init == "data":
            data.append(i)
    if data and section_names is not None and "state" not in section_names:
        _fail(f"state[{data[0]}].init", "'data', but the package has no 'state' section")
    return {s["name"]: s for s in entries}


def _tensor_table(m: dict, key: str, noun: str, limit: int) -> list:
    """`weights` and `state` share one layout: uniquely named tensors at 256-aligned offsets, sized
    by dtype and shape, inside their region and not overlapping. One function checks both, so the
    two rules cannot drift apart."""
    entries = _list(_get(m, key, "manifest"), key, limits.MAX_TENSORS)
    names, spans = set(), []
    for i, w in enumerate(entries):
        p = f"{key}[{i}]"
        _dict(w, p)
        name = _str(_get(w, "name", p), f"{p}.name")
        if name in names:
            _fail(f"{p}.name", f"duplicate {noun} name {name!r}")
        names.add(name)
        dtype = _dtype(_get(w, "dtype", p), f"{p}.dtype")
        shape = _shape(_get(w, "shape", p), f"{p}.shape")
        off = _int(_get(w, "offset", p), f"{p}.offset", lo=0)
        if off % WEIGHT_ALIGN:
            _fail(f"{p}.offset", f"{off} is not {WEIGHT_ALIGN}-aligned")
        nbytes = _int(_get(w, "nbytes", p), f"{p}.nbytes", lo=0)
        _span_check(f"{p}.shape", shape, DTYPES[dtype][0], f"{dtype}{list(shape)}")
        expected = numel(shape) * DTYPES[dtype][0]
        if nbytes != expected:
            _fail(f"{p}.nbytes", f"{nbytes} bytes, but {dtype}{list(shape)} needs {expected}")
        if off + nbytes > limit:
            _fail(p, f"{key} range [{off}, {off + nbytes}) exceeds the {key} region ({limit} bytes)")
        spans.append((off, off + nbytes, p))
    _no_overlap(spans, noun)
    return entries


def _arena_buffers(m: dict, regions: dict) -> None:
    if "arena_buffers" not in m:
        return
    limit = regions["arena"]
    for i, b in enumerate(_list(m["arena_buffers"], "arena_buffers", limits.MAX_TENSORS)):
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
    kernels = _list(_get(m, "kernels", "manifest"), "kernels", limits.MAX_KERNELS)
    names = set()
    for i, k in enumerate(kernels):
        p = f"kernels[{i}]"
        _dict(k, p)
        name = _str(_get(k, "name", p), f"{p}.name")
        if not _KERNEL_NAME_RE.fullmatch(name):
            _fail(f"{p}.name", f"{name[:80]!r} is not a C identifier of at most 255 characters (the "
                               "name of the kernel's entry point in its binary)")
        if name in names:
            _fail(f"{p}.name", f"duplicate kernel name {name!r}")
        names.add(name)
        if "family" in k:
            _str(k["family"], f"{p}.family")
        params = _list(_get(k, "params", p), f"{p}.params", limits.MAX_KERNEL_PARAMS)
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
        if warps not in limits.NUM_WARPS:
            _fail(f"{p}.num_warps", f"{warps} is not a power of two in 1..32")
        if "num_stages" in k:
            _int(k["num_stages"], f"{p}.num_stages", lo=1, hi=limits.MAX_NUM_STAGES)
        _int(_get(k, "shared", p), f"{p}.shared", lo=0, hi=limits.MAX_SHARED_NBYTES)
        hidden = _int(k.get("hidden_params", 0), f"{p}.hidden_params", lo=0, hi=limits.MAX_HIDDEN_PARAMS)
        if len(params) + hidden > limits.MAX_KERNEL_PARAMS:
            _fail(f"{p}.params", f"{len(params)} parameters and {hidden} hidden ones, above the limit "
                                 f"of {limits.MAX_KERNEL_PARAMS} (CUDA's kernel-parameter space)")
        for key in ("global_scratch_size", "profile_scratch_size"):
            if key in k:
                _int(k[key], f"{p}.{key}", lo=0, hi=limits.MAX_REGION_NBYTES)
        if "writes" in k:   # 3.2: the pointer parameters the kernel stores through (race checks)
            writes = _list(k["writes"], f"{p}.writes", len(params))
            for j, w in enumerate(writes):
                _int(w, f"{p}.writes[{j}]", lo=0, hi=len(params) - 1)
                if not params[w]["type"].startswith("*"):
                    _fail(f"{p}.writes[{j}]", f"parameter {w} is not a pointer")
            if len(set(writes)) != len(writes):
                _fail(f"{p}.writes", "duplicate entries")
        if "source_sha256" in k:
            _str(k["source_sha256"], f"{p}.source_sha256")
        # which archs it needs a binary for depends on the graphs that run it (3.5): checked by
        # _kernel_binaries once the graphs are
        binaries = _dict(_get(k, "binaries", p), f"{p}.binaries")
        for arch, sec in binaries.items():
            if arch not in archs:
                _fail(f"{p}.binaries", f"arch {arch!r} is not listed in archs {list(archs)}")
            _section_ref(sec, f"{p}.binaries.{arch}", section_names)
        if "source" in k:
            _section_ref(k["source"], f"{p}.source", section_names)
    return kernels


def _graphs(m: dict, kernels: list, regions: dict, words: int, symbols: dict,
            archs: list) -> tuple[list, list]:
    """One graph per bucket (per arch, 3.5): each names its bounds (`bucket`), its arena size and
    optionally the archs it serves (`archs`, absent: all), and its nodes may only touch that much
    arena, so the runtime can trust any graph it selects with the session arena. Returns the graphs
    and, per graph, the tuple of archs it serves."""
    graphs = _list(_get(m, "graphs", "manifest"), "graphs", limits.MAX_GRAPHS)
    if not graphs:
        _fail("graphs", "at least one graph is required")
    names = set()
    served: list[tuple] = []
    seen_buckets: dict[tuple, int] = {}   # (arch, input-symbol bounds) -> graph
    for g_i, g in enumerate(graphs):
        gp = f"graphs[{g_i}]"
        _dict(g, gp)
        name = _str(_get(g, "name", gp), f"{gp}.name")
        if name in names:
            _fail(f"{gp}.name", f"duplicate graph name {name!r}")
        names.add(name)
        if "stats" in g:
            _dict(g["stats"], f"{gp}.stats")
        g_archs = _graph_archs(g, gp, archs)
        served.append(g_archs)
        key = _bucket(g, gp, symbols)
        for arch in g_archs:
            other = seen_buckets.get((arch, key))
            if other is not None:
                per_arch = "archs" in g or "archs" in graphs[other]
                if not symbols and not per_arch:
                    _fail("graphs", f"a package without symbols has exactly one graph, got "
                                    f"{len(graphs)}")
                if not symbols:
                    _fail("graphs", f"a package without symbols has exactly one graph per arch, but "
                                    f"graphs[{other}] and graphs[{g_i}] both serve {arch}")
                for_arch = f" for {arch}" if per_arch else ""
                _fail(f"{gp}.bucket", f"same input-symbol bounds as graphs[{other}]{for_arch} "
                                      f"({_bucket_text(g['bucket'], symbols)}): it could never be "
                                      "selected")
            seen_buckets[(arch, key)] = g_i
        arena = _int(_get(g, "arena", gp), f"{gp}.arena", lo=0)
        if arena > regions["arena"]:
            _fail(f"{gp}.arena", f"{arena} bytes exceed regions.arena ({regions['arena']} bytes)")
        region_limits = {**regions, "arena": arena}
        nodes = _list(_get(g, "nodes", gp), f"{gp}.nodes", limits.MAX_NODES)
        before_pdl = [a for a in g_archs if not arch_rules.supports_pdl(a)]
        for n_i, node in enumerate(nodes):
            np_ = f"{gp}.nodes[{n_i}]"
            _node(node, np_, n_i, kernels, region_limits, words)
            if before_pdl and node.get("programmatic"):
                _fail(f"{np_}.programmatic", f"programmatic deps in a graph for {before_pdl[0]}, which "
                                             "has no programmatic dependent launch (griddepcontrol "
                                             "needs sm_90): that arch's graphs have full edges only")
    _same_buckets(graphs, served, archs, symbols)
    return graphs, served


def _graph_archs(g: dict, gp: str, archs: list) -> tuple:
    """`graphs[i].archs` (3.5): a non-empty list of unique archs of the manifest's `archs`, the GPUs
    whose variant the graph belongs to; absent: every arch."""
    if "archs" not in g:
        return tuple(archs)
    p = f"{gp}.archs"
    g_archs = _list(g["archs"], p, limits.MAX_ARCHS)
    if not g_archs:
        _fail(p, "an empty list: a graph serves at least one arch (leave the key out for all)")
    for i, a in enumerate(g_archs):
        if not isinstance(a, str) or a not in archs:
            _fail(f"{p}[{i}]", f"{a!r} is not one of the package's archs {list(archs)}")
    if len(set(g_archs)) != len(g_archs):
        _fail(p, "duplicate architectures")
    return tuple(g_archs)


def _same_buckets(graphs: list, served: list, archs: list, symbols: dict) -> None:
    """Every arch has graphs, and the same buckets as every other arch (3.5): which calls a package
    serves does not depend on the GPU it runs on (SPEC §3.5)."""
    per_arch: dict[str, dict[tuple, int]] = {a: {} for a in archs}
    for g_i, (g, g_archs) in enumerate(zip(graphs, served)):
        key = tuple(g["bucket"][n] for n, s in symbols.items() if s.kind == "input")
        for a in g_archs:
            per_arch[a][key] = g_i
    first = archs[0]
    for i, a in enumerate(archs):
        if not per_arch[a]:
            _fail(f"archs[{i}]", f"no graph serves {a} (graphs[*].archs): a GPU of that arch would "
                                 "have nothing to run")
    for a in archs[1:]:
        for x, y in ((a, first), (first, a)):
            missing = [k for k in per_arch[x] if k not in per_arch[y]]
            if missing:
                g_i = per_arch[x][missing[0]]
                _fail(f"graphs[{g_i}].archs" if "archs" in graphs[g_i] else f"graphs[{g_i}]",
                      f"serves {x} at {_bucket_text(graphs[g_i]['bucket'], symbols)}, but no graph "
                      f"serves {y} there: every arch serves the same buckets")


def _kernel_binaries(m: dict, kernels: list, served: list, archs: list) -> None:
    """A kernel has a binary for every arch of every graph that runs it, and the generation step's
    kernel one for every arch (it runs in every variant), 3.5. The runtime loads the binary of the
    arch it picked for each kernel the picked graphs run."""
    need: dict[int, dict[str, str]] = {}   # kernel -> arch -> the first node that needs it
    for g_i, (g, g_archs) in enumerate(zip(m["graphs"], served)):
        for n_i, node in enumerate(g["nodes"]):
            wanted = need.setdefault(node["kernel"], {})
            for a in g_archs:
                wanted.setdefault(a, f"graphs[{g_i}].nodes[{n_i}]")
    if "generate" in m:
        wanted = need.setdefault(m["generate"]["step"]["kernel"], {})
        for a in archs:
            wanted.setdefault(a, "generate.step")
    for k, wanted in sorted(need.items()):
        binaries = kernels[k]["binaries"]
        for a, where in wanted.items():
            if a not in binaries:
                _fail(f"kernels[{k}].binaries", f"no binary for arch {a!r}, but {where} runs "
                                                f"{kernels[k]['name']} on {a}")


def _io_extents(inputs: list, outputs: list, checks, graphs: list, symbols: dict) -> None:
    """What the runtime computes from the shapes stays bounded at every symbol value a graph can
    serve (an input symbol above every bucket bound selects no graph; a data symbol stays within
    its graph's bound): no shape expression leaves int64 (the table words) and every I/O tensor
    spans at most MAX_TENSOR_NBYTES (its buffer, its strides). Bounded by expr_magnitude, one pass
    per expression instead of one evaluation per graph."""
    magnitudes = {name: max(g["bucket"][name] for g in graphs) for name in symbols}

    def bound(expr, path: str) -> int:
        top, peak = expr_magnitude(expr, magnitudes)
        if peak > _I64_MAX:
            _fail(path, f"{format_shape_expr(expr)!r} may compute values beyond int64 at the symbol "
                        f"values the graphs serve (bounded by {peak})")
        return top

    for key, entries in (("inputs", inputs), ("outputs", outputs)):
        for i, e in enumerate(entries):
            p = f"{key}[{i}].shape"
            dims = [bound(d, f"{p}[{dim}]") for dim, d in enumerate(e["shape"])]
            _span_check(p, dims, DTYPES[e["dtype"]][0], f"{key[:-1]} {e['name']!r} at the largest bounds")
    for i, c in enumerate(checks):
        bound(c["size"], f"index_checks[{i}].size")


def _generate(g, inputs: list, outputs: list, state: dict, n_graphs: int, kernels: list,
              regions: dict, words: int) -> None:
    """`generate`: what `Session.generate` needs to run prefill, then decode steps on the device
    without a host round trip. The runtime writes the named inputs and reads the named state
    entries with fixed dtypes and shapes, so each is checked against them here."""
    p = "generate"
    _dict(g, p)
    _io_ref(g, "tokens", inputs, "input", ("int64",), 2)
    _io_ref(g, "positions", inputs, "input", ("int64",), 1)
    _io_ref(g, "logits", outputs, "output", FLOAT_DTYPES, None)
    capacity = _int(_get(g, "capacity", p), f"{p}.capacity", lo=1, hi=limits.MAX_TENSOR_NBYTES)
    decode = _int(_get(g, "decode_graph", p), f"{p}.decode_graph")
    if not 0 <= decode < n_graphs:
        _fail(f"{p}.decode_graph", f"graph {decode} does not exist (there are {n_graphs})")
    used: dict[str, str] = {}
    for key, shape in (("ctrl", [4]), ("out_tokens", [capacity]), ("next_token", [1, 1]),
                       ("next_position", [1])):
        name = _state_ref(g, key, state, shape)
        if name in used:
            _fail(f"{p}.{key}", f"state entry {name!r} is already {p}.{used[name]}")
        used[name] = key
    step = _dict(_get(g, "step", p), f"{p}.step")
    if _list(_get(step, "deps", f"{p}.step"), f"{p}.step.deps"):
        _fail(f"{p}.step.deps", "must be empty: the step is not part of a graph "
                                "(the runtime orders it in the generation graph)")
    # no arena: the step runs between the prefill graph and the decode graph, which may lay their
    # arenas out differently, so nothing in the arena is meaningful to it
    _node(step, f"{p}.step", 0, kernels, {**regions, "arena": 0}, words)


def _io_ref(g: dict, key: str, entries: list, role: str, dtypes: tuple, rank) -> None:
    """`generate.<key>` names an input or output (per `role`) of one of `dtypes` and rank `rank`."""
    p = f"generate.{key}"
    name = _str(_get(g, key, "generate"), p)
    entry = next((e for e in entries if e["name"] == name), None)
    if entry is None:
        _fail(p, f"{name!r} is not an {role} (the {role}s are {[e['name'] for e in entries]})")
    if entry["dtype"] not in dtypes:
        _fail(p, f"{role} {name!r} is {entry['dtype']}, expected {' or '.join(dtypes)}")
    if rank is not None and len(entry["shape"]) != rank:
        _fail(p, f"{role} {name!r} has rank {len(entry['shape'])}, expected {rank}")


def _state_ref(g: dict, key: str, state: dict, shape: list) -> str:
    """`generate.<key>` names an int64 state entry of exactly `shape`."""
    p = f"generate.{key}"
    name = _str(_get(g, key, "generate"), p)
    entry = state.get(name)
    if entry is None:
        _fail(p, f"{name!r} is not a state entry")
    if entry["dtype"] != "int64" or list(entry["shape"]) != shape:
        _fail(p, f"state entry {name!r} is {entry['dtype']}{list(entry['shape'])}, expected int64{shape}")
    return name


def _bucket(g: dict, gp: str, symbols: dict) -> tuple:
    """Check `graphs[i].bucket`; return its input-symbol bounds, the key graph selection uses."""
    p = f"{gp}.bucket"
    bucket = _dict(_get(g, "bucket", gp), p)
    for name in symbols:
        if name not in bucket:
            _fail(p, f"missing the bound of symbol {name!r}")
    for name in bucket:
        if name not in symbols:
            _fail(p, f"{name!r} is not a declared symbol")
    for name, sym in symbols.items():
        bound = _int(bucket[name], f"{p}.{name}", lo=0, hi=_I64_MAX)
        if sym.kind == "input" and not sym.min <= bound <= sym.max:
            _fail(f"{p}.{name}", f"bound {bound} is outside the range [{sym.min}, {sym.max}] "
                                 f"of symbol {name!r}")
    return tuple(bucket[name] for name, sym in symbols.items() if sym.kind == "input")


def _bucket_text(bucket: dict, symbols: dict) -> str:
    return ", ".join(f"{n}={bucket[n]}" for n, s in symbols.items() if s.kind == "input")


def _node(node, p: str, index: int, kernels: list, regions: dict, words: int) -> None:
    """`regions` holds the byte limit per region for this graph (its own arena size)."""
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
    deps = _list(_get(node, "deps", p), f"{p}.deps", limits.MAX_NODES)
    for d_i, d in enumerate(deps):
        _int(d, f"{p}.deps[{d_i}]")
        if not 0 <= d < index:
            _fail(f"{p}.deps[{d_i}]", f"dependency {d} is not an earlier node (this is node {index})")
    if len(set(deps)) != len(deps):
        _fail(f"{p}.deps", "duplicate dependencies")
    if "programmatic" in node:   # 3.2: the deps whose edges may be programmatic (SPEC §5.3)
        prog = _list(node["programmatic"], f"{p}.programmatic", len(deps))
        for d_i, d in enumerate(prog):
            _int(d, f"{p}.programmatic[{d_i}]")
            if d not in deps:
                _fail(f"{p}.programmatic[{d_i}]", f"node {d} is not one of the deps {deps}")
            if d == 0:
                _fail(f"{p}.programmatic[{d_i}]", "the table writer (node 0) keeps a full edge")
        if len(set(prog)) != len(prog):
            _fail(f"{p}.programmatic", "duplicate entries")
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
            _fail(f"{p}.word", f"table word {w} is out of range (the table has {words} words: "
                               "slot words, then one per symbol)")
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
