"""Stage `export` (compiler.PIPELINE): torch.export and decomposition to core ATen.

We keep `scaled_dot_product_attention` whole (the default table would decompose it into a
bmm/softmax/bmm chain), because attention lowers to one flash-style kernel, and replace the
decompositions that fail on inputs grace takes (`REPLACED`: take with a 0-d index).

Also here: reading a `.pt2` whose pytree types live in another library (`load`), the inputs a
program does not take (`drop_constant_inputs`: a `None` argument) and the names of its outputs
from the model's own output structure (`output_names`: `logits`, `last_hidden_state`, ...).
"""
from __future__ import annotations

import importlib
import json
import re
import zipfile

import torch
from torch.export import ExportedProgram


class ExportError(ValueError):
    pass


KEEP_WHOLE = (
    torch.ops.aten.scaled_dot_product_attention.default,
)


def export_model(model: torch.nn.Module, example_inputs, dynamic_shapes=None,
                 kwargs: dict | None = None) -> ExportedProgram:
    """torch.export.export(model, args, kwargs) in eval mode, without gradients. A `None`
    argument is no input of the program (torch.export records it as a constant)."""
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = (tuple(example_inputs) if isinstance(example_inputs, list)
                          else (example_inputs,))
    model = model.eval()
    try:
        with torch.no_grad():
            return torch.export.export(model, example_inputs, kwargs=dict(kwargs or {}) or None,
                                       dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch's messages are long; keep the first line, chain the rest
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.export failed: {first}") from exc


def _take(self, index):
    """aten.take as an index into the flattened tensor. torch's own decomposition indexes with
    `flat[index]`, which turns a 0-d index tensor into a Python int and so into a data-dependent
    guard (GuardOnDataDependentSymNode, found by the OpInfo sweep): aten.index keeps it a tensor
    of the index's shape, negative positions counted from the end as take counts them."""
    return torch.ops.aten.index.Tensor(self.reshape(-1), [index])


# ops whose default decomposition fails on inputs grace supports, and what replaces it
REPLACED = {
    torch.ops.aten.take.default: _take,
}


def to_core_aten(program: ExportedProgram) -> ExportedProgram:
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    table.update(REPLACED)
    return program.run_decompositions(table)


def drop_constant_inputs(program: ExportedProgram) -> ExportedProgram:
    """Remove the user inputs torch.export recorded as constants (a `None` argument, a Python
    number it specialised on) from `program`, in place: they are no inputs of the compiled
    program, so every stage sees only tensor inputs (the manifest's input indices count tensors).
    Call it on a program of our own (the result of `to_core_aten`): the in_spec no longer matches."""
    from torch.export.graph_signature import ConstantArgument, InputKind

    sig = program.graph_signature
    drop = {s.arg.name for s in sig.input_specs
            if s.kind == InputKind.USER_INPUT and isinstance(s.arg, ConstantArgument)}
    if not drop:
        return program
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in drop:
            if node.users:   # torch folds a constant's value into its uses; never seen otherwise
                raise ExportError(f"input '{node.name}' is a constant "
                                  f"({type(node.meta.get('val')).__name__}) that the graph reads")
            graph.erase_node(node)
    sig.input_specs[:] = [s for s in sig.input_specs if s.arg.name not in drop
                          or s.kind != InputKind.USER_INPUT]
    program.graph_module.recompile()
    return program


# ---- reading a .pt2 -----------------------------------------------------------------------------

# Libraries whose output types a .pt2 may name and that are imported to read it (importing the
# module that defines a transformers ModelOutput registers it with torch's pytree). Anything else
# that is not registered is read through a stand-in container (`_stand_in`).
IMPORTABLE = ("transformers",)
_STAND_INS: dict[str, type] = {}


def load(path) -> ExportedProgram:
    """torch.export.load, for any torch.export file: the pytree types that its input/output specs
    name (transformers' ModelOutput subclasses, e.g. CausalLMOutputWithPast) are imported first
    when they come from a library in IMPORTABLE, and any other unknown type is read as a
    container of its leaves, named by its keys (its serialized context) when it has them."""
    register_pytree_types(path)
    return torch.export.load(path)


def pytree_type_names(path) -> list[str]:
    """The pytree type names of the in/out specs of every program in a torch.export archive
    (empty when the archive cannot be read: torch.export.load then reports the problem)."""
    names: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            t = node.get("type")
            if isinstance(t, str) and t not in names:
                names.append(t)
            for child in node.get("children_spec") or ():
                walk(child)

    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not re.search(r"(^|/)models/[^/]+\.json$", info.filename):
                    continue
                model = json.loads(z.read(info))
                calls = (model.get("graph_module") or {}).get("module_call_graph") or []
                for call in calls:
                    sig = call.get("signature") or {}
                    for key in ("in_spec", "out_spec"):
                        if isinstance(sig.get(key), str):
                            walk(json.loads(sig[key])[1])
    except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile):
        return []
    return names


def register_pytree_types(path) -> list[str]:
    """Make every pytree type named in the archive known to torch's pytree; returns the names
    that were read through stand-ins."""
    import torch.utils._pytree as pytree

    stand_ins = []
    for name in pytree_type_names(path):
        if name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] in IMPORTABLE:
            try:
                getattr(importlib.import_module(module), attr)   # defining it registers it
            except Exception:   # not installed, or another version: read it by name
                pass
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            _stand_in(name)
            stand_ins.append(name)
    return stand_ins


def _stand_in(name: str) -> type:
    """A dict subclass registered under a serialized pytree type name nobody else registered:
    its children are keyed by its context when that is a list of distinct keys (ModelOutput,
    dataclass-like containers), else by position."""
    import torch.utils._pytree as pytree

    if name in _STAND_INS:
        return _STAND_INS[name]
    cls = type(name.rpartition(".")[2] or "Unregistered", (dict,),
               {"__module__": "grace.aot.export.stand_in", "serialized_type_name": name,
                "__doc__": f"stand-in for the unregistered pytree type {name}"})

    def flatten(d):
        return list(d.values()), list(d.keys())

    def unflatten(values, context):
        values = list(values)
        keys = context if _keys_of(context, len(values)) else range(len(values))
        return cls(zip(keys, values))

    def from_context(text):
        try:
            return json.loads(text) if isinstance(text, str) else text
        except ValueError:
            return text

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=name,
                                to_dumpable_context=json.dumps, from_dumpable_context=from_context)
    _STAND_INS[name] = cls
    return cls


def _keys_of(context, n: int) -> bool:
    return (isinstance(context, (list, tuple)) and len(context) == n
            and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in context)
            and len(set(context)) == n)


# ---- output names --------------------------------------------------------------------------------

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def output_names(program: ExportedProgram, count: int, taken=()) -> list[str]:
    """The names of a program's `count` user outputs, from the model's output structure (the
    out_spec pytree): the keys of a ModelOutput, dict or namedtuple (`logits`, `pooler_output`),
    joined by `_` through nested containers (`hidden_states_0`), positions as `out<i>` where no
    key names them. A model that returns plain tensors (one, or a tuple/list of them) keeps
    `out` / `out0, out1, ...`. Names are identifiers (other characters become `_`), unique, and
    differ from the names in `taken` (the inputs')."""
    default = ["out"] if count == 1 else [f"out{i}" for i in range(count)]
    spec = getattr(getattr(program, "call_spec", None), "out_spec", None)
    if spec is None:
        return default
    paths: list[list] = []

    def walk(node, path):
        if node.is_leaf():
            paths.append(path)
            return
        children = list(node.children())
        keys = _child_keys(node, len(children))
        for key, child in zip(keys, children):
            walk(child, path + [key])

    try:
        walk(spec, [])
    except Exception:
        return default
    if len(paths) != count or not any(isinstance(k, str) for p in paths for k in p):
        return default
    names, seen = [], set(taken)
    for i, path in enumerate(paths):
        name = "_".join(re.sub(r"[^A-Za-z0-9_]", "_", str(k)) for k in path) or f"out{i}"
        if not NAME_RE.match(name):
            name = f"out{name}"
        base, n = name, 2
        while name in seen:
            name, n = f"{base}_{n}", n + 1
        seen.add(name)
        names.append(name)
    return names


def _child_keys(node, n: int) -> list:
    typ, context = node.type, node.context
    fields = getattr(context, "_fields", None)   # a namedtuple: the context is its class
    if isinstance(fields, tuple) and len(fields) == n:
        return list(fields)
    if isinstance(typ, type) and issubclass(typ, (tuple, list)):
        return list(range(n))
    if (isinstance(context, (list, tuple)) and len(context) == 2 and _keys_of(context[1], n)
            and callable(context[0])):   # defaultdict: [default_factory, keys]
        return list(context[1])
    if _keys_of(context, n):   # dict, OrderedDict, ModelOutput, stand-ins
        return list(context)
    return list(range(n))
