"""grace.runtime: run `.grace` packages on a GPU with CUDA Graphs. numpy and cuda-python only.

    pkg = grace.runtime.load("model.grace", device=0)   # read + validate, load kernels, upload weights
    sess = pkg.session()                                 # arena, table, outputs, stream, graphs
    out = sess.run(x=tensor)["out0"]                     # one graph launch; out is a DeviceArray
    y = torch.from_dlpack(out)  /  out.numpy()

A package holds one graph per shape bucket (docs/design-buckets.md); each call picks the
smallest bucket that fits the input sizes and launches that graph with the true sizes in the table.

The lifecycle, module by module:
    loader.load       read (grace.formats: hashes, schema) -> validate (calls.ShapePlan: symbols,
                      buckets, shape expressions; graph.plan_graph per graph: every kernel argument
                      inside its region, table consistent) -> device (driver: cuInit, primary context,
                      arch) -> kernels (cuModuleLoadData) -> weights (one allocation, uploaded)
    LoadedPackage.session allocate (arena, table, output buffers for the largest bucket) -> graphs
                      (graph.ExecutableGraph: one kernel node per manifest node, explicit, no capture),
                      instantiated on first use or eagerly (load(..., instantiate="eager"))
    Session.run       validate inputs (validate.ArrayCheck, calls: symbols, ranges, graph choice,
                      remembered per input shapes; all before any launch) -> table words into the
                      chosen graph's table-writer node (SetParams, when they changed) -> cuGraphLaunch
                      -> DeviceArrays with the true shapes (arrays); tools/host_bench.py times it
    state             format 3.0 (docs/design-state.md): each session owns `regions.state` bytes,
                      initialised from the package (state.plan_state) and kept across runs;
                      Session.reset_state / read_state
    Session.generate  packages compiled with --generate: checks (generate.GeneratePlan) -> reset ->
                      prefill run() -> one launch of the generation graph (graph.GenerationGraph:
                      the decode graph inside a WHILE conditional node) -> the new token ids

load(path, trusted_keys=[...]) (or GRACE_TRUSTED_KEYS) refuses a package that is not signed by one
of those ed25519 keys (grace.formats.signing; the check imports `cryptography`, `grace[sign]`).

Importing this package never imports torch, triton, or the CUDA driver; the driver is loaded by the
first load(). Without a GPU, load() raises NoDeviceError; use `grace run --interpret` instead.
"""

from .arrays import DeviceArray
from .errors import (GraceRuntimeError, IndexOutOfRangeError, InputError, InvalidPackageError,
                     NoDeviceError, PackageMismatchError, StaleOutputError, UntrustedPackageError)
from .loader import LoadedPackage, TensorSpec, load
from .session import Session

__all__ = [
    "load", "LoadedPackage", "Session", "DeviceArray", "TensorSpec",
    "GraceRuntimeError", "NoDeviceError", "InputError", "StaleOutputError", "PackageMismatchError",
    "InvalidPackageError", "IndexOutOfRangeError", "UntrustedPackageError",
]
