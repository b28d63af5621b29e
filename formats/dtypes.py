"""The closed set of tensor element types a package may contain.

One table serves the manifest validator (nbytes == prod(shape) * itemsize) and the safetensors codec
(our names <-> safetensors header codes), so the two can never disagree about what a dtype means.
bfloat16 is carried as raw bytes: nothing here needs a numpy bf16 type.
"""

# name -> (itemsize in bytes, safetensors header code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}

SAFETENSORS_TO_DTYPE: dict[str, str] = {code: name for name, (_, code) in DTYPES.items()}

# the Triton pointer type of a kernel parameter generated for a buffer of this dtype: the compiler
# writes it into `kernels[i].params`, the cross-check (formats.crosscheck) expects it back
POINTER_TYPES: dict[str, str] = {
    "float64": "*fp64", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16",
    "int64": "*i64", "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1",
}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][0]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
