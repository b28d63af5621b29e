"""What the compiler's stages hand each other, as files: GRACE_DUMP and GRACE_OVERRIDE.

Debugging a miscompile means finding the first stage whose output is wrong. With

    GRACE_DUMP=DIR grace compile model.pt2 -o model.grace

the compiler writes the state after every stage of `compiler.PIPELINE` (also when a stage fails:
then ERROR.txt says which and why, and the stages before it are there):

    DIR/index.txt                       the stages, in order, and the file each one wrote
    DIR/01-export.txt                   the core-ATen program (the FX graph, with shapes)
    DIR/02-symbols.txt                  size symbols, bucket lists, one line per graph
    DIR/graph-<bucket>/03-lower.txt     per bucket: the lowered IR (ir.format_ir: buffers, kernels)
    DIR/graph-<bucket>/04-fuse.txt      ... after epilogue fusion (and empty kernels dropped)
    DIR/graph-<bucket>/05-memplan.txt   ... the arena placements, weights and state offsets
    DIR/graph-<bucket>/06-codegen.txt   ... each kernel's name, grid, parameters, dependencies
    DIR/07-table.txt                    the argument table, index checks, unique kernels
    DIR/08-override.txt                 the sources GRACE_OVERRIDE replaced (when it did)
    DIR/09-build.txt                    every build request: kernel, arch, cache hit, cubin size
    DIR/10-package.json                 the manifest as written
    DIR/kernels/<kernel name>.py        every kernel source, as codegen generated it

`<bucket>` is the graph's name (`seq=128`, `main` for a static model). A directory that already
holds a dump (it has `.grace-dump`) is emptied first; any other files in DIR are left alone.

    GRACE_OVERRIDE=DIR grace compile model.pt2 -o model.grace

replaces the source of every kernel that has a file `DIR/<kernel name>.py` (so: copy a file out
of a dump's kernels/, edit it, rebuild). The override keeps the kernel's name, parameters, grid and
launch settings; only the text that Triton compiles changes, and it must still define the function
`<kernel name>` with the same parameters. A file that names no kernel of the program is an error
(a typo would otherwise build a clean package silently). Overrides are warned about
(`OverrideWarning`, on stderr by default) and recorded in the manifest's
`producer.overrides` (the kernel names), which `grace inspect` shows.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

from .ir import format_ir

DUMP_ENV = "GRACE_DUMP"
OVERRIDE_ENV = "GRACE_OVERRIDE"
MARKER = ".grace-dump"


class OverrideWarning(UserWarning):
    """A package is being built with kernel sources from GRACE_OVERRIDE, not from codegen."""


class OverrideError(ValueError):
    """GRACE_OVERRIDE names something that is not a kernel of the program (or no directory)."""


# ---- GRACE_OVERRIDE -----------------------------------------------------------------------------
def load_overrides(unique: dict, folder: str | os.PathLike | None = None) -> dict:
    """{kernel name: KernelSource with the override's text} for every `<name>.py` in `folder`
    (default: $GRACE_OVERRIDE; {} when unset). `unique`: kernel name -> KernelSource.
    OverrideError for a file that names no kernel of `unique` (listing the kernels there are)."""
    from .codegen import stored_params
    from .families import FAMILIES

    folder = folder if folder is not None else os.environ.get(OVERRIDE_ENV)
    if not folder:
        return {}
    root = Path(folder)
    if not root.is_dir():
        raise OverrideError(f"{OVERRIDE_ENV}={folder}: not a directory")
    replaced = {}
    unknown = []
    for path in sorted(root.glob("*.py")):
        src = unique.get(path.stem)
        if src is None:
            unknown.append(path.name)
            continue
        text = path.read_text()
        if text == src.source:
            continue   # an unchanged copy of the dump overrides nothing
        # the parameters a kernel stores through (manifest `writes`, for the race checker) follow
        # the new text of a template's kernel (its pointers are p<i>); the sources made outside
        # the templates (the table writer, the generation step) name theirs differently
        writes = stored_params(text) if src.family in FAMILIES else src.writes
        replaced[src.name] = replace(src, source=text, writes=writes)
    if unknown:
        raise OverrideError(f"{OVERRIDE_ENV}={folder}: {', '.join(unknown)} name(s) no kernel of this "
                         f"program; its kernels are: {', '.join(sorted(unique))}")
    return replaced


def warn_overrides(names: list[str]) -> None:
    warnings.warn(f"{OVERRIDE_ENV}: the sources of {len(names)} kernel(s) were replaced "
                  f"({', '.join(names)}); this package is not a clean build (recorded in its "
                  "manifest as producer.overrides)", OverrideWarning, stacklevel=3)


# ---- GRACE_DUMP ---------------------------------------------------------------------------------
def _safe(name: str) -> str:
    """A graph name as a directory name (symbol names are identifiers with dots; keep them)."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name) or "_"


class Dump:
    """Writes each stage's state under `root` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, model: str = "model"):
        self.root = Path(root)
        if (self.root / MARKER).exists():   # our previous dump: replace it whole
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).write_text(f"grace compile dump of {model}\n")
        self.index: list[str] = []
        self.numbers: dict[str, int] = {}

    @classmethod
    def from_env(cls, model: str = "model") -> "Dump | None":
        folder = os.environ.get(DUMP_ENV)
        return cls(folder, model) if folder else None

    def _number(self, stage) -> int:
        from .compiler import PIPELINE

        names = [s.name for s in PIPELINE]
        return names.index(stage.name) + 1 if stage.name in names else len(names) + 1

    def _write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel not in self.index:
            self.index.append(rel)
            (self.root / "index.txt").write_text(
                "the compiler's stages in order, and what each wrote (aot/dump.py)\n"
                + "".join(f"  {r}\n" for r in self.index))

    def stage(self, stage, state, st) -> None:
        """After `stage` ran: its state (`state`: a BucketState for per-bucket stages, else the
        CompileState `st`) as text."""
        n = self._number(stage)
        if stage.per_bucket:
            rel = f"graph-{_safe(state.name)}/{n:02d}-{stage.name}.txt"
        else:
            rel = f"{n:02d}-{stage.name}.{'json' if stage.name == 'package' else 'txt'}"
        fmt = FORMATS.get(stage.name)
        text = fmt(state, st) if fmt else f"(aot/dump.py has no format for stage {stage.name!r})\n"
        if text is not None:
            self._write(rel, text)
        if stage.name == "codegen":
            for src in state.sources:
                self._write(f"kernels/{src.name}.py", src.source)
        elif stage.name == "table":
            for src in [st.writer] + ([st.step.source] if st.step else []):
                self._write(f"kernels/{src.name}.py", src.source)

    def error(self, stage, bucket, exc: BaseException) -> None:
        where = f"stage {stage.name}" + (f", bucket {bucket.name}" if bucket is not None else "")
        text = f"{where} failed:\n" + "".join(traceback.format_exception(exc))
        self._write("ERROR.txt", text)
        print(f"grace: {DUMP_ENV}: {where} failed; the dump is in {self.root}", file=sys.stderr)


# ---- one text per stage --------------------------------------------------------------------------
def _export(st, _):
    gm = st.core.graph_module
    sig = st.core.graph_signature
    head = [f"# {st.name}: the core-ATen program (aot/export.py), as torch.export prints it",
            f"# user inputs: {[s.arg.name for s in sig.input_specs if str(s.kind).endswith('USER_INPUT')]}",
            ""]
    return "\n".join(head) + gm.print_readable(print_output=False, include_stride=False) + "\n"


def _symbols(st, _):
    lines = [f"symbols ({len(st.symbols)}):"]
    for i, s in enumerate(st.symbols):
        src = ", ".join(f"input {a} dim {d}" for a, d in s.sources) or "computed on the device"
        lines.append(f"  {i}: {s.name} ({s.kind}, torch {s.expr}) in [{s.lo}, {s.hi}]  from {src}"
                     f"  -> extents word {st.sym_index.get(s.expr)}")
    lines.append("bucket lists:" if st.lists else "bucket lists: none (static shapes)")
    lines += [f"  {k}: {v}" for k, v in st.lists.items()]
    lines.append(f"graphs ({len(st.buckets)}):")
    lines += [f"  {b.name}" for b in st.buckets]
    lines.append(f"outputs: {st.output_names}")
    return "\n".join(lines) + "\n"


def _lower(b, _):
    return format_ir(b.program, title=f"# graph {b.name}: lowered (aot/lower.py)")


def _fuse(b, _):
    return format_ir(b.program, b.kernels, title=f"# graph {b.name}: after fusion (aot/fuse.py)")


def _memplan(b, _):
    plan = b.plan
    lines = [f"# graph {b.name}: memory plan (aot/memplan.py)",
             f"arena: {plan.arena_nbytes} bytes; weights: {plan.weights_nbytes} bytes; "
             f"state: {plan.state_nbytes} bytes",
             "arena placements (offset, bytes, live from kernel..to kernel):"]
    for p in sorted(plan.arena.values(), key=lambda p: (p.offset, p.first)):
        lines.append(f"  {p.buffer.name:<24} [{p.offset}, {p.offset + p.nbytes})  "
                     f"{p.nbytes} B  live #{p.first}..#{p.last}  {p.buffer.dtype}{list(p.buffer.shape)}")
    for what, bufs, offsets in (("weights", b.program.weights, plan.weights),
                                ("state", b.program.state, plan.state or {})):
        if bufs:
            lines.append(f"{what}:")
            lines += [f"  {w.name:<24} offset {offsets.get(w.index)}  {w.nbytes} B  "
                      f"{w.dtype}{list(w.shape)}" for w in bufs]
    return "\n".join(lines) + "\n"


def _codegen(b, _):
    g = b.graph
    lines = [f"# graph {b.name}: kernels (aot/codegen.py); sources in ../kernels/<name>.py",
             f"bucket bounds: {g.bucket}"]
    for j, (k, src) in enumerate(zip(b.kernels, b.sources)):
        params = ", ".join(f"{t} {buf.name}" for t, buf in zip(src.param_types, src.buffers))
        lines += [f"#{j} {src.name}  ({k.family} {k.label!r})",
                  f"    grid {list(src.grid)}  num_warps {src.num_warps}  num_stages "
                  f"{src.num_stages}  writes params {list(src.writes)}",
                  f"    params {params}",
                  f"    after kernels {['#%d' % d for d in g.deps[j]] or '-'}"]
    return "\n".join(lines) + "\n"


def _table(st, _):
    slots, extents, nbytes, errors = st.layout
    lines = [f"argument table: {nbytes} bytes"]
    lines += [f"  slot {i}: {s['name']} ({s['role']}, rank {s['rank']}) at byte {s['offset']}"
              for i, s in enumerate(slots)]
    lines.append(f"  extents: {extents['count']} word(s) at byte {extents['offset']}")
    if errors is not None:
        lines.append(f"  error word at byte {errors['offset']}")
    if st.checks:
        lines.append("index checks:")
        lines += [f"  {c['code']}: {c['op']} on {c['input']} ({c['where']}), size {c['size']}"
                  for c in st.checks]
    lines.append(f"table writer: {st.writer.name}")
    if st.step is not None:
        lines.append(f"generation step: {st.step.source.name} (decode graph "
                     f"{st.graphs[st.step.decode_graph].name})")
    lines.append(f"recorded options: {json.dumps(st.recorded, default=str)}")
    lines.append(f"unique kernels ({len(st.unique)}):")
    lines += [f"  {name} ({src.family})" for name, src in st.unique.items()]
    return "\n".join(lines) + "\n"


def _override(st, _):
    if not st.overrides:
        return None
    return (f"{OVERRIDE_ENV}: these kernels are built from the override's source, not codegen's "
            "(kernels/ holds codegen's):\n" + "".join(f"  {n}\n" for n in st.overrides))


def _build(st, _):
    lines = [f"build requests ({len(st.requests)}): kernel, arch, cache (hit/built), shared "
             "memory, cubin bytes, cache key"]
    for r, hit in zip(st.requests, st.cached):
        b = st.binaries[(r.name, r.arch)]
        lines.append(f"  {r.name} {r.arch} {'hit' if hit else 'built'} shared {b.shared} "
                     f"cubin {len(b.cubin)} key {r.key()[:16]}")
    return "\n".join(lines) + "\n"


def _package(st, _):
    def plain(x):
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x if x is None or isinstance(x, (bool, int, float, str)) else repr(x)
    return json.dumps(plain(st.manifest), indent=1) + "\n"


FORMATS = {"export": _export, "symbols": _symbols, "lower": _lower, "fuse": _fuse,
           "memplan": _memplan, "codegen": _codegen, "table": _table, "override": _override,
           "build": _build, "package": _package}
