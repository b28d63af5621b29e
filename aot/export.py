"""Stage 1: torch.export and decomposition to core ATen.

We keep `scaled_dot_product_attention` whole (the default table would decompose it into a
bmm/softmax/bmm chain), because attention lowers to one flash-style kernel.
"""
from __future__ import annotations

import torch
from torch.export import ExportedProgram


class ExportError(ValueError):
    pass


KEEP_WHOLE = (
    torch.ops.aten.scaled_dot_product_attention.default,
)


def export_model(model: torch.nn.Module, example_inputs, dynamic_shapes=None) -> ExportedProgram:
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    model = model.eval()
    try:
        with torch.no_grad():
            return torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch's messages are long; keep the first line, chain the rest
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.export failed: {first}") from exc


def to_core_aten(program: ExportedProgram) -> ExportedProgram:
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return program.run_decompositions(table)
