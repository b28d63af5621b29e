"""Compiler variants for A/B runs: a named set of module constants of grace.aot, patched while a
package compiles.

    --variant gemv8x512:codegen.GEMV_TILE=4096,codegen.GEMV_BK=512

Why: the tile and launch constants (codegen.GEMV_TILE, codegen.ATTN_SPLIT_PROGRAMS_PER_SM, ...)
were tuned by compiling one package per setting and timing it inside the model's graph, which
until now took a throwaway script per session (lost with the session's scratch files). A variant
names the setting on the benchmark's command line instead, and the benchmark records it.

Only what the compiler reads at compile time can vary: a constant is looked up on its module
when a kernel is generated, so patching the module attribute is enough, and it is restored when
the compile ends (also when it fails). Kernel names hash the generated source, so a variant's
kernels never collide with the default's in the build cache.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SETTING = re.compile(r"^([a-z_][a-z0-9_]*)\.([A-Z][A-Z0-9_]*)=(.+)$")


@dataclass(frozen=True)
class Variant:
    name: str
    settings: tuple   # ((module, CONSTANT, value), ...), module relative to grace.aot

    def describe(self) -> str:
        return ",".join(f"{m}.{c}={v!r}" for m, c, v in self.settings)


def parse_variant(text: str) -> Variant:
    """'NAME:module.CONSTANT=VALUE[,module.CONSTANT=VALUE...]' -> Variant. VALUE is a Python
    literal of the constant's own type (any type for a constant that is None: an optional
    setting); the module and constant must exist in grace.aot."""
    name, sep, body = text.partition(":")
    if not sep or not _NAME.match(name) or not body:
        raise ValueError(f"variant {text!r}: expected NAME:module.CONSTANT=VALUE[,...], e.g. "
                         "gemv8x512:codegen.GEMV_TILE=4096,codegen.GEMV_BK=512")
    settings = []
    for part in body.split(","):
        m = _SETTING.match(part.strip())
        if not m:
            raise ValueError(f"variant {name}: {part!r} is not module.CONSTANT=VALUE "
                             "(a constant is upper case, e.g. codegen.GEMV_TILE=4096)")
        module, const, raw = m.groups()
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name}: {raw!r} is not a Python literal") from None
        current = getattr(_module(name, module), const, _MISSING)
        if current is _MISSING:
            raise ValueError(f"variant {name}: grace.aot.{module} has no constant {const}")
        if current is not None and type(value) is not type(current):   # None: an optional setting
            raise ValueError(f"variant {name}: {module}.{const} is a {type(current).__name__} "
                             f"({current!r}), not a {type(value).__name__}")
        settings.append((module, const, value))
    if len({(m, c) for m, c, _ in settings}) != len(settings):
        raise ValueError(f"variant {name}: a constant is set twice")
    return Variant(name, tuple(settings))


_MISSING = object()


def _module(variant: str, module: str):
    try:
        return importlib.import_module(f"grace.aot.{module}")
    except ImportError:
        raise ValueError(f"variant {variant}: grace.aot has no module {module!r}") from None


@contextlib.contextmanager
def applied(variant: Variant | None):
    """Within the block the variant's constants hold; the originals come back after it."""
    saved = []
    try:
        for module, const, value in (variant.settings if variant else ()):
            mod = _module(variant.name, module)
            saved.append((mod, const, getattr(mod, const)))
            setattr(mod, const, value)
        yield
    finally:
        for mod, const, value in reversed(saved):
            setattr(mod, const, value)


def nodes_changed(base: dict, manifest: dict) -> int:
    """How many graph nodes of `manifest` (and generate()'s step) differ from the same node of
    `base` (both package manifests of one model): in kernel (by name, a hash of its source, and
    its launch: warps, pipeline stages), grid, arguments or edges, counting the nodes only one of
    them has. 0 means the variant's settings changed nothing this model compiles to (a pass whose
    conditions the model does not meet, a tile no kernel uses), so timing it would only measure
    noise."""
    def node(names, n):
        return (names[n["kernel"]], n["grid"], n["args"], n["deps"], n.get("programmatic", []))

    def nodes(m):
        names = [(k["name"], k["num_warps"], k["num_stages"]) for k in m["kernels"]]
        found = {g["name"]: [node(names, n) for n in g["nodes"]] for g in m["graphs"]}
        step = (m.get("generate") or {}).get("step")
        if step:   # generate()'s step node: a variant may change only it (its warps, programs)
            found[" generate step"] = [node(names, step)]
        return found
    a, b = nodes(base), nodes(manifest)
    changed = 0
    for graph in a.keys() | b.keys():
        x, y = a.get(graph, []), b.get(graph, [])
        changed += sum(p != q for p, q in zip(x, y)) + abs(len(x) - len(y))
    return changed
