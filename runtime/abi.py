"""Each loaded kernel checked against its cubin, through the driver (SPEC.md §5, "Kernel ABI").

The manifest says how to launch a kernel: its parameters (`params`, then `hidden_params` pointers),
its block (32·`num_warps` threads) and its dynamic shared memory (`shared`). The cubin says what
the code really takes. The two are only tied by the compiler having written both, so a manifest
that passes every format check may still launch a kernel with a parameter block of the wrong
length (the driver reads past it: a parameter too few, `hidden_params` lowered, or an i32 where the
code has an i64), with more threads than the binary allows (a launch failure at the first call,
long after load), or with more shared memory than the GPU grants next to the kernel's static
shared memory (a cryptic cuFuncSetAttribute failure). `check_function` asks the driver, once per
kernel at load and before any graph is built:

    cuFuncGetParamInfo(f, i)        (offset, size) of parameter i; an error past the last one.
                                    The count and every size MUST match the manifest's types
                                    (a pointer: 8 bytes; i64/u64/fp64: 8; i32/u32/fp32: 4; ...).
    cuFuncGetAttribute(MAX_THREADS_PER_BLOCK)  >= 32·num_warps (Triton's `.reqntid` makes it
                                    exactly the block the code was generated for)
    cuFuncGetAttribute(SHARED_SIZE_BYTES)      static shared memory; static + `shared` MUST fit
                                    the GPU's opt-in limit per block
    cuFuncGetAttribute(NUM_REGS)    reported in LoadedPackage.kernel_info (MAX_THREADS_PER_BLOCK
                                    already accounts for it)

A driver without cuFuncGetParamInfo (before CUDA 12.4) skips the parameter check, and says so in
the result (`params_checked`); the attributes exist on every driver.
"""

from __future__ import annotations

from .driver import call, describe
from .errors import GraceRuntimeError, KernelMismatchError, PackageMismatchError

DEFAULT_SHARED_LIMIT = 48 * 1024   # what every GPU grants a block without opting in

# bytes of a kernel parameter of each Triton type in the CUDA parameter layout
SCALAR_NBYTES = {"i1": 1, "i8": 1, "u8": 1, "fp8e4nv": 1, "fp8e5": 1, "i16": 2, "u16": 2, "fp16": 2,
                 "bf16": 2, "i32": 4, "u32": 4, "fp32": 4, "i64": 8, "u64": 8, "fp64": 8}
POINTER_NBYTES = 8


def param_nbytes(kernel) -> list[int]:
    """The size of every entry-point parameter the manifest describes for `kernel` (a
    formats.view.Kernel): its `params`, then `hidden_params` pointers."""
    return [POINTER_NBYTES if p.type.startswith("*") else SCALAR_NBYTES[p.type] for p in kernel.params] \
        + [POINTER_NBYTES] * kernel.hidden_params


def driver_params(cu, function, most: int) -> list[int] | None:
    """The size of each parameter of `function` as the driver reports it, asking for at most
    `most` + 1 of them (enough to see that there are more than `most`); None when the driver cannot
    say (no cuFuncGetParamInfo)."""
    query = getattr(cu, "cuFuncGetParamInfo", None)
    if query is None:
        return None
    invalid = cu.CUresult.CUDA_ERROR_INVALID_VALUE
    sizes = []
    for i in range(most + 1):
        try:
            result = query(function, i)
        except RuntimeError:   # the binding exists, the driver function does not (an old libcuda)
            return None
        err = result[0]
        if err == invalid:     # past the last parameter
            break
        if err:
            if i == 0 and err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:
                return None
            raise GraceRuntimeError(f"cuFuncGetParamInfo failed: {describe(err)}")
        sizes.append(int(result[2]))
    return sizes


def check_function(cu, function, kernel, device_limit) -> dict:
    """Check loaded `function` against `kernel` (a formats.view.Kernel); return what the driver
    reported: {"params": [sizes] or None, "params_checked": bool, "max_threads", "static_shared",
    "regs"}. `device_limit()` gives the GPU's opt-in shared memory per block (asked only when a
    kernel needs more than 48 KiB). KernelMismatchError when the binary contradicts the manifest,
    PackageMismatchError when the GPU cannot give the kernel its shared memory."""
    attr = cu.CUfunction_attribute
    expected = param_nbytes(kernel)
    sizes = driver_params(cu, function, len(expected))
    name = kernel.name
    if sizes is not None:
        if len(sizes) != len(expected):
            more = "at least " if len(sizes) > len(expected) else ""   # it was asked for one more
            raise KernelMismatchError(
                f"kernel {name}: its binary takes {more}{len(sizes)} parameters, but the manifest "
                f"describes {len(kernel.params)} (kernels[].params) + {kernel.hidden_params} hidden "
                f"(kernels[].hidden_params) = {len(expected)}: the package was edited or built for "
                "another Triton ABI")
        for i, (got, want) in enumerate(zip(sizes, expected)):
            if got != want:
                what = (f"parameter {i} ({kernel.params[i].name}: {kernel.params[i].type})"
                        if i < len(kernel.params) else f"hidden parameter {i - len(kernel.params)}")
                raise KernelMismatchError(f"kernel {name}: {what} is {got} bytes in its binary, but "
                                          f"{want} in the manifest")
    max_threads = call(cu.cuFuncGetAttribute, attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function)
    block = 32 * kernel.num_warps
    if block > max_threads:
        raise KernelMismatchError(
            f"kernel {name}: launched with {block} threads per block (kernels[].num_warps = "
            f"{kernel.num_warps}), but its binary allows at most {max_threads} "
            "(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)")
    static = call(cu.cuFuncGetAttribute, attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
    if static + kernel.shared > DEFAULT_SHARED_LIMIT:
        limit = device_limit()
        if static + kernel.shared > limit:
            raise PackageMismatchError(
                f"kernel {name} needs {static} bytes of static and {kernel.shared} of dynamic "
                f"shared memory, {static + kernel.shared} in all, but this GPU allows {limit} per "
                "block")
    regs = call(cu.cuFuncGetAttribute, attr.CU_FUNC_ATTRIBUTE_NUM_REGS, function)
    return {"params": sizes, "params_checked": sizes is not None, "max_threads": int(max_threads),
            "static_shared": int(static), "regs": int(regs)}
