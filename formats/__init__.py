"""grace.formats: the `.grace` package container (SPEC.md), shared by the compiler and the runtime.

Depends on numpy, msgpack and safetensors only, so the deploy runtime can read packages without
torch or triton, and the compiler can write them on machines without a GPU.
"""

from .container import FORMAT_VERSION
from .dtypes import DTYPES
from .errors import (BadMagicError, ChecksumError, FormatError, ManifestError, TruncatedError,
                     UnsupportedVersionError)
from .manifest import validate_manifest
from .package import Package, read_package, write_package
from .weights import decode_weights, encode_weights

__all__ = [
    "write_package", "read_package", "Package", "encode_weights", "decode_weights",
    "validate_manifest", "FORMAT_VERSION", "DTYPES", "FormatError", "BadMagicError",
    "UnsupportedVersionError", "TruncatedError", "ChecksumError", "ManifestError",
]
