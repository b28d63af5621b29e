"""The errors the runtime raises. Each says what went wrong and what to do about it.

All of them derive from GraceRuntimeError, so `except GraceRuntimeError` catches anything the runtime
refuses. A bad package file is reported by grace.formats (FormatError) before the runtime looks at it,
and so is a package without a signature by a trusted key (UntrustedPackageError, defined in
grace.formats.signing and re-exported here: the CPU executor and the CLI raise the same class).
"""

from grace.formats.signing import UntrustedPackageError  # noqa: F401 - re-exported


class GraceRuntimeError(RuntimeError):
    """Base class; also used directly for CUDA driver failures (the message names the call and error)."""


class NoDeviceError(GraceRuntimeError):
    """No usable CUDA driver or device. The message points to the CPU reference executor."""

    HINT = ("to run a package without a GPU, use the CPU reference executor: "
            "`grace run --interpret PACKAGE`")

    def __init__(self, reason: str):
        super().__init__(f"{reason}; {self.HINT}")


class InputError(GraceRuntimeError, ValueError):
    """An input (or an out= array) does not match the package; the message names it. Raised before
    anything is launched, so a failed run() leaves the session unchanged."""


class StaleOutputError(GraceRuntimeError):
    """An output array was read after its session ran again (its memory now holds the newer result)."""


class PackageMismatchError(GraceRuntimeError):
    """The package cannot run here: no binary for this GPU's architecture, or a feature it needs is
    not supported by this runtime."""


class InvalidPackageError(GraceRuntimeError):
    """The manifest passed the format checks but contradicts itself (a kernel argument outside its
    region, a node that depends on a later node, ...). A compiler bug or a hand-edited package."""


class KernelMismatchError(InvalidPackageError):
    """A kernel's binary contradicts the manifest: the driver reports another parameter count or
    parameter size than `params` + `hidden_params` describe, or fewer threads per block than
    32·num_warps (grace.runtime.abi, checked at load before any graph is built). The message names
    the kernel and the field."""


class IndexOutOfRangeError(GraceRuntimeError, IndexError):
    """A gather (embedding, x[idx], index_select, gather) met an index outside its table (format 3.3,
    SPEC §5.4). The kernels read a clamped row instead, so nothing outside the table was read; the
    runtime notices at its next synchronising point (.numpy(), sync(), ...), so the outputs of the
    runs since the previous one are not meaningful. The session stays usable.

    `input`: the name of the input the index values came from (None: computed in the model); `op`,
    `where`: the ATen op and the user's source line; `code`: the check's code in the package."""

    def __init__(self, message: str, input=None, op=None, where=None, code=None):
        super().__init__(message)
        self.input, self.op, self.where, self.code = input, op, where, code
