"""grace.formats: the `.grace` package container (SPEC.md), shared by the compiler and the runtime.

Depends on msgpack only (the safetensors layout of the weights is written and parsed
here, without the library; signing imports `cryptography` only when it signs or checks), so the
deploy runtime can read packages without torch or triton, and the compiler can write them on
machines without a GPU.

One module per shared fact: `manifest.validate_manifest` is the one check of a manifest,
`view` the one typed reading of what it accepted (SPEC defaults filled in), `table` the
argument-table layout that the compiler, the runtime and the tools all use, `archs` the rules
about architecture names (parsing, PDL support, SM counts, which arch a GPU runs), `races` the
proof from a manifest alone that a package's graphs have no races (grace verify, and the runtime's
load).
"""

from .container import FORMAT_VERSION
from .dtypes import DTYPES
from .errors import (BadMagicError, ChecksumError, FormatError, ManifestError, TruncatedError,
                     UnsupportedVersionError)
from .manifest import Symbol, validate_manifest
from .package import Package, read_package, write_package
from .shapes import SHAPE_OPS, eval_shape_expr, expr_symbols, format_shape_expr, select_graph
from .view import Manifest, as_view, for_arch, variants
from .weights import TensorBlob, decode_state, decode_weights, encode_state, encode_weights

__all__ = [
    "write_package", "read_package", "Package", "TensorBlob", "encode_weights", "decode_weights", "encode_state",
    "decode_state",
    "validate_manifest", "as_view", "Manifest", "Symbol", "eval_shape_expr", "expr_symbols",
    "for_arch", "variants",
    "format_shape_expr", "select_graph", "SHAPE_OPS", "FORMAT_VERSION", "DTYPES", "FormatError", "BadMagicError",
    "UnsupportedVersionError", "TruncatedError", "ChecksumError", "ManifestError",
]
