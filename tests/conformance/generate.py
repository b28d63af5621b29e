"""Write the runtime conformance vectors (tests/conformance/*.json) from the compiler.

    .venv/bin/python tests/conformance/generate.py            # rewrite every vector
    .venv/bin/python tests/conformance/generate.py --check    # exit 1 if one would change

Each vector is one small real package's manifest plus calls: input shapes and what SPEC.md §5.1
says a runtime must derive from them before launching (the symbol values, the selected graph, the
output shapes, every table word), or the error kind it must raise. The format is described in
tests/conformance/README.md; tests/test_conformance.py runs our runtime against the vectors.

The expected answers are worked out here from SPEC's rules directly (a few lines each, below),
not by the runtime under test, and checked against two other sources: grace.formats' reference
functions (select_graph, eval_shape_expr, table.word_positions) and torch itself (the model's
eager output shapes at the same input shapes). The packages are compiled by grace.aot; the manifest
keeps what a runtime reads and drops what is informative or optional (producer, options, stats,
memory-plan and compile records, sources), so a vector stays a few KB and does not change with
every codegen tweak that leaves the shapes alone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEMA = "grace-conformance-vector/1"
# format 3.5, per-arch variants: each call also names the GPU's compute capability (README.md)
VARIANT_SCHEMA = "grace-conformance-vector/2"
VARIANTS_DIR = HERE / "variants"
POINTER_BASE = 4096   # the data pointer of table slot i in these vectors: 4096 * (i + 1)

# Dropped from the vectors' manifests: informative (SPEC §3: producer, model, options, stats,
# arena_buffers) or optional keys a runtime needs no value of to plan a call.
DROP_TOP = ("producer", "options", "arena_buffers")
DROP_KERNEL = ("source", "source_sha256", "compiled")
DROP_GRAPH = ("stats", "compiled")
DROP_NODE = ("label",)   # a name for people (SPEC §3): it follows the kernels' ops, not the shapes


# ---- the models -----------------------------------------------------------------------------------
def _models():
    """name -> (make model, example inputs, dynamic_shapes, buckets, input shapes of the calls).
    Each list of calls has the bucket bounds, the values just above them, the ends of each range,
    and one call per kind of error, each with exactly one defect."""
    import torch
    from torch import nn
    from torch.export import Dim

    from grace.tools.models import MLP

    class TwoInputs(nn.Module):
        """Two input symbols, one read from two inputs; an output dim that is an expression
        (seq - 1)."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x, m):   # x [batch, seq, 16], m [seq, 16]
            return self.fc(x + m), x[:, 1:]

    class NonZero(nn.Module):
        """A data symbol: the output's dim 0 is known only on the device."""

        def forward(self, x):
            return torch.nonzero(x > 0)

    class Embed(nn.Module):
        """Index checks: the table has an error word after the extents (not a table word)."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)

        def forward(self, ids):   # [1, seq]
            return self.emb(ids)

    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=16)
    seq3 = Dim("seq", min=3, max=16)   # x[:, 1:] must not be a size-1 dim (torch.export's guard)
    return {
        "static_mlp": (MLP, (torch.randn(2, 64),), None, None,
                       [[[2, 64]], [[3, 64]], [[2, 64, 1]]]),
        "dynamic_batch": (MLP, (torch.randn(3, 64),), {"x": {0: batch}}, {"batch": [2, 4, 8]},
                          [[[1, 64]], [[2, 64]], [[3, 64]], [[4, 64]], [[5, 64]], [[8, 64]],
                           [[9, 64]], [[0, 64]], [[4, 32]], [[4]]]),
        "two_symbols": (TwoInputs, (torch.randn(2, 5, 16), torch.randn(5, 16)),
                        {"x": {0: Dim("batch", min=1, max=4), 1: seq3}, "m": {0: seq3}},
                        {"batch": [2, 4], "seq": [8, 16]},
                        [[[1, 3, 16], [3, 16]], [[2, 8, 16], [8, 16]], [[3, 8, 16], [8, 16]],
                         [[2, 9, 16], [9, 16]], [[4, 16, 16], [16, 16]], [[3, 11, 16], [11, 16]],
                         [[2, 5, 16], [6, 16]], [[5, 5, 16], [5, 16]], [[2, 1, 16], [1, 16]],
                         [[2, 5, 8], [5, 16]]]),
        "data_symbol": (NonZero, (torch.randn(4, 6),), None, None,
                        [[[4, 6]], [[4, 7]], [[24]]]),
        "index_checks": (Embed, (torch.randint(0, 32, (1, 5)),), {"ids": {1: seq}}, {"seq": [4, 16]},
                         [[[1, 2]], [[1, 4]], [[1, 5]], [[1, 16]], [[1, 17]], [[2, 5]]]),
    }


def _drop_last_graph(m: dict) -> dict:
    """dynamic_batch without its batch=8 graph: `batch` may be up to 8, the graphs stop at 4."""
    m["graphs"] = m["graphs"][:-1]
    return m


# Vectors derived from a compiled one by an edit the compiler never makes, for a rule its packages
# never exercise: name -> (compiled vector, edit, calls, what it shows).
DERIVED = {
    "bucket_gap": ("dynamic_batch", _drop_last_graph, [[[3, 64]], [[4, 64]], [[5, 64]], [[8, 64]]],
                   "SPEC §5.1 rule 2: values inside the symbol's range that no graph covers fail "
                   "before any launch (the compiler's buckets always reach the maximum, so this "
                   "manifest is dynamic_batch with its last graph removed)"),
}


# Vectors of packages with per-arch variants (SPEC §3.5), written to variants/ with schema 2:
# name -> (model of _models(), archs, pdl, [(capability, calls)], what it shows). A capability
# that no arch fits is refused before any call ("no_variant"), whatever the shapes.
VARIANTS = {
    "two_variants": (
        "dynamic_batch", ("sm_80", "sm_90"), True,
        [([8, 0], [[[1, 64]], [[3, 64]], [[8, 64]], [[9, 64]]]),
         ([8, 6], [[[3, 64]]]),
         ([9, 0], [[[1, 64]], [[3, 64]], [[8, 64]], [[9, 64]]]),
         ([7, 5], [[[3, 64]]]),
         ([10, 0], [[[3, 64]]])],
        "SPEC §3.5 and §5.1 'Before launch' items 3 and 8: the arch picked for the GPU's compute "
        "capability selects among its own graphs (sm_80 without PDL, sm_90 with), the same "
        "buckets in each; a GPU no arch fits (another major) is refused"),
}


def compile_manifest(name: str, fake_build: bool = False, archs=("sm_90",),
                     pdl: bool = False) -> tuple[dict, object]:
    """Compile model `name`; returns (its manifest as the package holds it, the model).
    `fake_build`: stand-in cubins (the manifest's shape and table facts do not depend on them).
    `archs`, `pdl`: as grace.aot.compile's (several archs compiled differently: variants)."""
    import torch

    from grace.aot import build, compiler
    from grace.formats import read_package

    make, args, dyn, buckets, _ = _models()[name]
    torch.manual_seed(0)
    model = make().eval()
    saved = compiler._build_with_progress
    if fake_build:
        compiler._build_with_progress = lambda reqs, options: [
            build.Binary(hashlib.sha256(r.source.encode()).digest(), 0, 0, 0, r.num_warps)
            for r in reqs]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = compiler.compile(model, args, output=Path(tmp) / f"{name}.grace",
                                    dynamic_shapes=dyn, buckets=buckets, name=name,
                                    archs=tuple(archs), pdl=pdl)
            with read_package(path) as pkg:
                manifest = json.loads(json.dumps(pkg.manifest))
    finally:
        compiler._build_with_progress = saved
    return manifest, model


def strip(manifest: dict) -> dict:
    """The manifest without informative and optional keys (see DROP_*), still valid."""
    m = {k: v for k, v in manifest.items() if k not in DROP_TOP}
    m["kernels"] = [{k: v for k, v in kern.items() if k not in DROP_KERNEL} for kern in m["kernels"]]
    m["graphs"] = [{k: v for k, v in g.items() if k not in DROP_GRAPH} for g in m["graphs"]]
    for g in m["graphs"]:
        g["nodes"] = [{k: v for k, v in node.items() if k not in DROP_NODE} for node in g["nodes"]]
    return m


# ---- SPEC §5.1, worked out directly ---------------------------------------------------------------
class CallError(Exception):
    def __init__(self, kind: str, what: str):
        super().__init__(what)
        self.kind = kind


def _eval(expr, values: dict) -> int:
    """A shape expression (SPEC §3.1): int | symbol name | [op, a, b], floor division."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return values[expr]
    op, a, b = expr[0], _eval(expr[1], values), _eval(expr[2], values)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "//":
        return a // b
    return max(a, b) if op == "max" else min(a, b)


def pick_arch(archs: list, capability) -> str | None:
    """SPEC §5.1 'Before launch' item 3: the arch of `archs` for a GPU of this compute capability —
    the exact sm_XY, else sm_XYa, else the newest sm_XZ with Z <= Y (no letter) — or None."""
    major, minor = capability
    exact = f"sm_{major}{minor}"
    for candidate in (exact, exact + "a"):
        if candidate in archs:
            return candidate
    same = [(int(a[-1]), a) for a in archs if a[3:].isdigit() and len(a) >= 5
            and int(a[3:-1]) == major and int(a[-1]) <= minor]
    return max(same)[1] if same else None


def expect_on(manifest: dict, capability, shapes: list) -> dict:
    """expect() on a GPU of `capability` (schema 2): the arch it picks, then the call among that
    arch's graphs (SPEC §5.1 items 3 and 8), or CallError("no_variant")."""
    arch = pick_arch(manifest["archs"], capability)
    if arch is None:
        raise CallError("no_variant", f"no arch of {manifest['archs']} runs on compute capability "
                                      f"{capability[0]}.{capability[1]}")
    return {"arch": arch, **expect(manifest, shapes, arch)}


def expect(manifest: dict, shapes: list, arch: str | None = None) -> dict:
    """What a runtime must derive before launching a call with these input shapes (SPEC §5.1
    rules 1-3 and 6), or CallError(kind) — rank, static_dim, range, sources_disagree, no_graph.
    `arch`: only the graphs that serve it take part (format 3.5; absent `archs`: every arch)."""
    inputs, symbols = manifest["inputs"], manifest["symbols"]
    if len(shapes) != len(inputs):
        raise ValueError("a vector's call gives one shape per input")
    for i, (inp, shape) in enumerate(zip(inputs, shapes)):                     # rule 1
        if len(shape) != len(inp["shape"]):
            raise CallError("rank", f"input {inp['name']} has rank {len(shape)}")
        for d, size in enumerate(inp["shape"]):
            if isinstance(size, int) and shape[d] != size:
                raise CallError("static_dim", f"input {inp['name']} dim {d} is {shape[d]}, not {size}")
    values = {}
    for s in symbols:
        if s["kind"] != "input":
            values[s["name"]] = 0   # written on the device; its table word is 0 at launch
            continue
        seen = {shapes[i][d] for i, d in s["sources"]}
        if len(seen) > 1:
            raise CallError("sources_disagree", f"symbol {s['name']} is read as {sorted(seen)}")
        (v,) = seen
        if not s["min"] <= v <= s["max"]:
            raise CallError("range", f"symbol {s['name']} = {v} outside [{s['min']}, {s['max']}]")
        values[s["name"]] = v
    names = [s["name"] for s in symbols if s["kind"] == "input"]              # rule 2
    covering = []
    for g, graph in enumerate(manifest["graphs"]):
        if arch is not None and arch not in graph.get("archs", manifest["archs"]):
            continue
        if all(values[n] <= graph["bucket"][n] for n in names):
            cost = 1
            for n in names:
                cost *= graph["bucket"][n]
            covering.append((cost, g))
    if not covering:
        raise CallError("no_graph", "no graph covers the values")
    graph = min(covering)[1]   # smallest product; the first on ties (tuples compare g next)
    at_bound = dict(values)    # rule 3/6: a data symbol's dims at the graph's bound
    for s in symbols:
        if s["kind"] == "data":
            at_bound[s["name"]] = manifest["graphs"][graph]["bucket"][s["name"]]
    outputs = [[_eval(d, at_bound) for d in o["shape"]] for o in manifest["outputs"]]
    slot_shapes = [None] * len(manifest["table"]["slots"])                     # rule 3
    for inp, shape in zip(inputs, shapes):
        slot_shapes[inp["slot"]] = list(shape)
    for out, shape in zip(manifest["outputs"], outputs):
        slot_shapes[out["slot"]] = shape
    words = []
    for i, shape in enumerate(slot_shapes):
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= max(d, 1)
        words += [POINTER_BASE * (i + 1), *shape, *reversed(strides)]
    words += [values[s["name"]] for s in symbols]
    return {"symbols": [values[s["name"]] for s in symbols], "graph": graph,
            "graph_name": manifest["graphs"][graph]["name"], "output_shapes": outputs,
            "table_words": words}


def table_facts(manifest: dict) -> dict:
    """Where the table words go (SPEC §5): word j's byte offset, each slot's pointer word."""
    t = manifest["table"]
    word_bytes, pointer_words = [], []
    for slot in t["slots"]:
        pointer_words.append(len(word_bytes))
        word_bytes += [slot["offset"] + 8 * j for j in range(1 + 2 * slot["rank"])]
    word_bytes += [t["extents"]["offset"] + 8 * k for k in range(t["extents"]["count"])]
    return {"words": len(word_bytes), "word_bytes": word_bytes, "pointer_words": pointer_words,
            "pointer_of_slot": [POINTER_BASE * (i + 1) for i in range(len(t["slots"]))],
            "errors_offset": (t.get("errors") or {}).get("offset")}


def _cross_check(manifest: dict, model, case: dict, shapes: list) -> None:
    """The answers against grace.formats' reference functions and torch's eager shapes."""
    import torch

    from grace.formats import archs, eval_shape_expr, select_graph, table

    names = [s["name"] for s in manifest["symbols"] if s["kind"] == "input"]
    values = dict(zip([s["name"] for s in manifest["symbols"]], case["symbols"]))
    if "capability" in case:
        assert archs.pick_arch(tuple(case["capability"]), manifest["archs"]) == case["arch"], case
    assert select_graph(manifest["graphs"], names, values, case.get("arch")) == case["graph"], case
    t = manifest["table"]
    positions = table.word_positions([(s["offset"], s["rank"]) for s in t["slots"]],
                                     t["extents"]["offset"], t["extents"]["count"])
    assert [8 * p for p in positions] == table_facts(manifest)["word_bytes"]
    bound = manifest["graphs"][case["graph"]]["bucket"]
    at = {**values, **{s["name"]: bound[s["name"]] for s in manifest["symbols"] if s["kind"] == "data"}}
    assert [[eval_shape_expr(d, at) for d in o["shape"]] for o in manifest["outputs"]] == \
        case["output_shapes"]
    torch.manual_seed(1)
    args = [torch.randint(0, 32, s) if i["dtype"].startswith("int") else torch.randn(s)
            for i, s in zip(manifest["inputs"], shapes)]
    with torch.no_grad():
        eager = model(*args)
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    data = {s["name"] for s in manifest["symbols"] if s["kind"] == "data"}
    for out, got, want in zip(manifest["outputs"], case["output_shapes"], eager):
        uses_data = bool(out["shape"]) and any(n in json.dumps(out["shape"][0]) for n in data)
        if uses_data:   # allocated at the bound: the true dim 0 fits, the rest are exact
            assert list(want.shape[1:]) == got[1:] and want.shape[0] <= got[0], (got, want.shape)
        else:
            assert list(want.shape) == got, (out["name"], got, list(want.shape))


def make_vector(name: str, fake_build: bool = False) -> dict:
    from grace.formats import validate_manifest

    base, edit, calls, note = DERIVED.get(name, (name, None, None, None))
    manifest, model = compile_manifest(base, fake_build)
    m = strip(manifest)
    if edit is not None:
        m = edit(m)
    else:
        calls = _models()[name][4]
    validate_manifest(m)   # still a valid manifest without the dropped keys (and after the edit)
    cases = []
    for shapes in calls:
        try:
            case = {"input_shapes": shapes, **expect(m, shapes)}
        except CallError as e:
            cases.append({"input_shapes": shapes, "error": e.kind, "why": str(e)})
            continue
        _cross_check(m, model, case, shapes)
        cases.append(case)
    extra = {"derived_from": base, "note": note} if edit is not None else {}
    return {"schema": SCHEMA, "model": name, **extra,
            "about": "SPEC.md §5.1: manifest + input shapes -> symbol values, selected graph, "
                     "output shapes, table words (slot i's data pointer is 4096*(i+1)); or the "
                     "error kind a runtime raises before any launch. Format: tests/conformance/"
                     "README.md. Written by tests/conformance/generate.py; do not edit.",
            "table": table_facts(m), "manifest": m, "cases": cases}


def make_variant_vector(name: str, fake_build: bool = False) -> dict:
    """A schema-2 vector (variants/, README.md): per call the GPU's compute capability too."""
    from grace.formats import archs as arch_rules
    from grace.formats import validate_manifest

    base, archs, pdl, calls, note = VARIANTS[name]
    manifest, model = compile_manifest(base, fake_build, archs, pdl)
    m = strip(manifest)
    validate_manifest(m)
    if not any("archs" in g for g in m["graphs"]):
        raise AssertionError(f"{name}: the compiler made one variant of {archs}")
    cases = []
    for capability, shapes_list in calls:
        for shapes in shapes_list:
            head = {"capability": capability, "input_shapes": shapes}
            try:
                case = {**head, **expect_on(m, capability, shapes)}
            except CallError as e:
                if e.kind == "no_variant":
                    assert arch_rules.pick_arch(tuple(capability), m["archs"]) is None
                cases.append({**head, "error": e.kind, "why": str(e)})
                continue
            _cross_check(m, model, case, shapes)
            cases.append(case)
    return {"schema": VARIANT_SCHEMA, "model": name, "derived_from": base, "note": note,
            "about": "SPEC.md §3.5 and §5.1: manifest + the GPU's compute capability + input "
                     "shapes -> the arch picked, symbol values, the graph selected among that "
                     "arch's (its index in the manifest), output shapes, table words (slot i's "
                     "data pointer is 4096*(i+1)); or the error kind a runtime raises before any "
                     "launch. Format: tests/conformance/README.md. Written by "
                     "tests/conformance/generate.py; do not edit.",
            "table": table_facts(m), "manifest": m, "cases": cases}


def dumps(vector: dict) -> str:
    """Compact rows (one call per line), so a vector is a few KB and diffs stay readable."""
    head = {k: v for k, v in vector.items() if k not in ("manifest", "cases")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},")
    lines.append(f"  \"manifest\": {json.dumps(vector['manifest'], separators=(',', ':'))},")
    lines.append("  \"cases\": [")
    lines.append(",\n".join(f"    {json.dumps(c)}" for c in vector["cases"]))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a "
                    "difference")
    ap.add_argument("names", nargs="*", help="models (default: all)")
    args = ap.parse_args(argv)
    stale = []
    for name in args.names or [*_models(), *DERIVED, *VARIANTS]:
        if name in VARIANTS:
            text = dumps(make_variant_vector(name))
            VARIANTS_DIR.mkdir(exist_ok=True)
            path = VARIANTS_DIR / f"{name}.json"
        else:
            text = dumps(make_vector(name))
            path = HERE / f"{name}.json"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"wrote {path.relative_to(HERE.parent.parent)} ({len(text)} bytes)")
    if stale:
        print(f"stale vectors: {', '.join(stale)} (run tests/conformance/generate.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
