"""grace.aot — the ahead-of-time compiler. Needs torch and triton, never a GPU.

The pipeline, one module per stage (read them in this order):
    export.py   torch.export + core-ATen decompositions
    lower.py    FX graph -> kernel IR (ir.py, views.py; op handlers in lower_ops.py,
                lower_vision.py for convolutions/pooling/resampling, lower_scan.py for
                scans, arg-reductions and sorts; what each pointwise op means: ops.py)
    fuse.py     epilogue fusion
    memplan.py  arena offsets + graph dependencies
    codegen.py  kernel IR -> Triton source (expressions in codegen_expr.py)
    build.py    Triton source -> cubin per arch (cached, parallel)
    manifest.py manifest + sections -> .grace (written by grace.formats)
    check.py    `grace check`: every op the stages above cannot lower, at once, nothing built
    backend.py  `torch.compile(model, backend="grace")`: each Dynamo graph through the stages above
    versions.py the torch/triton versions the compiler is pinned to (a warning for others)

`grace.aot.check` is the function (check.check); the module's other names import from
grace.aot.check as usual (`from grace.aot.check import user_frame`).
"""
from __future__ import annotations

from .compiler import CompileOptions, compile, compile_program  # noqa: A004
from .check import CheckReport, check  # noqa: E402  (the function shadows the module's name)
from .versions import ProducerVersionWarning  # noqa: E402
from . import backend as _backend  # noqa: E402

# backend="grace" for torch.compile once grace.aot is imported (the torch_dynamo_backends entry
# point in pyproject.toml also finds it without the import)
_backend.register()

__all__ = ["compile", "compile_program", "CompileOptions", "check", "CheckReport",
           "ProducerVersionWarning"]
