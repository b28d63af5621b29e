"""grace.runtime: run `.grace` packages on a GPU with CUDA Graphs. numpy and cuda-python only.

    pkg = grace.runtime.load("model.grace", device=0)   # read + validate, load kernels, upload weights
    sess = pkg.session()                                 # arena, table, outputs, stream, graph
    out = sess.run(x=tensor)["out0"]                     # one graph launch; out is a DeviceArray
    y = torch.from_dlpack(out)  /  out.numpy()

The lifecycle, module by module:
    package.load      read (grace.formats: hashes, schema) -> validate (graph.plan_graph: every kernel
                      argument inside its region, table consistent) -> device (driver: cuInit, primary
                      context, arch) -> kernels (cuModuleLoadData) -> weights (one allocation, uploaded)
    Package.session   allocate (arena, table, output buffers) -> build graph (graph.ExecutableGraph:
                      one kernel node per manifest node, explicit, no capture) -> instantiate
    Session.run       validate inputs (validate.check_array, before any launch) -> table words into
                      the table-writer node (SetParams) -> cuGraphLaunch -> DeviceArrays (arrays)

Importing this package never imports torch, triton, or the CUDA driver; the driver is loaded by the
first load(). Without a GPU, load() raises NoDeviceError; use `grace run --interpret` instead.
"""

from .arrays import DeviceArray
from .errors import (GraceRuntimeError, InputError, InvalidPackageError, NoDeviceError,
                     PackageMismatchError, StaleOutputError)
from .package import LoadedPackage, TensorSpec, load
from .session import Session

__all__ = [
    "load", "LoadedPackage", "Session", "DeviceArray", "TensorSpec",
    "GraceRuntimeError", "NoDeviceError", "InputError", "StaleOutputError", "PackageMismatchError",
    "InvalidPackageError",
]
