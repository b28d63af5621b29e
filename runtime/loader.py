"""load(): from a `.grace` file to kernels on the GPU and weights in device memory.

    read      grace.formats.read_package: magic, versions, sha256 of every section, (with trusted
              keys: the signature, grace.formats.signing, before anything is decoded) the manifest
              schema and every cross-reference. That is the package's only check: the runtime
              reads the manifest through grace.formats.view and refuses only what it cannot run
              (kernels that need Triton scratch memory, a GPU no binary is built for)
    plan      symbols, buckets and shape expressions (calls.ShapePlan); every graph's nodes as
              kernel launches (graph.plan_graph)
    device    cuInit, primary context; the GPU's compute capability picks one of the package's archs
              (SPEC §5.1: exact, else sm_XYa, else the newest earlier minor of its major), and with
              it the kernel binaries and (format 3.5) the variant: the graphs that serve that arch,
              the only ones planned, selected and launched (PackageMismatchError when none fits)
    races     the race proof of `grace verify` (grace.formats.races) on the manifest: every pair of
              nodes touching overlapping bytes, one writing, is ordered by edges (InvalidPackageError)
    kernels   cuModuleLoadData + cuModuleGetFunction per kernel, each checked against its binary
              (abi.py: parameter count and sizes, threads per block, static + dynamic shared
              memory; KernelMismatchError); opt in to >48 KiB shared memory; with programmatic
              edges, each target's launch capped at one wave of its grid (occupancy.py)
    weights   one cuMemAlloc for the weights region; each tensor copied to base + offset from the
              mapped file, its pages registered (pinned) for the copies (upload.py)
    state     the `state` entries and their initial bytes, decoded once (state.plan_state); every
              session allocates and initialises its own copy
    generate  with a `generate` map: its step node and state entries (generate.GeneratePlan);
              the runtime's set_condition kernel is JIT-loaded from PTX on the first generate()

Everything that depends on a call (arena, table, outputs, graphs, stream) belongs to a Session.
`instantiate` says when a session builds each graph: "lazy" (default) on the first call that
selects it, "eager" all of them when the session is made (no first-call latency per bucket).
"""

from __future__ import annotations

import time
import weakref

from grace.formats import archs as arch_rules
from grace.formats.view import TensorSpec, for_arch, variants

from . import abi, driver, graph, occupancy
from .driver import call
from .checks import plan_index_checks
from .errors import GraceRuntimeError, InvalidPackageError, PackageMismatchError
from .generate import SET_CONDITION_NAME, SET_CONDITION_PTX, GeneratePlan
from .calls import ShapePlan
from .state import plan_state
from .upload import upload

_DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
INSTANTIATE_MODES = ("lazy", "eager")


def pick_arch(capability: tuple, archs) -> str:
    """The package arch whose cubins (and, format 3.5, whose graphs) run on a GPU of `capability`
    (major, minor): the exact arch, its arch-specific variant (sm_90a), or else the newest sm_XY of
    the same major with Y <= minor (cubins run on later minors of the same major). The rule is
    grace.formats.archs.pick_arch; PackageMismatchError when no arch fits."""
    arch = arch_rules.pick_arch(tuple(capability), archs)
    if arch is None:
        exact = f"sm_{capability[0]}{capability[1]}"
        raise PackageMismatchError(
            f"this package has kernels and graphs for {', '.join(archs) or 'no arch'}, but the GPU is "
            f"{exact}; compile the model again with --arch {exact} (a package may hold several archs: "
            f"--arch {exact} --arch ...)")
    return arch


def _check_instantiate(mode) -> None:
    if mode not in INSTANTIATE_MODES:
        raise ValueError(f"instantiate={mode!r}: expected one of {', '.join(map(repr, INSTANTIATE_MODES))}")


def load(path, device: int = 0, instantiate: str = "lazy", pdl: bool = True,
         trusted_keys=None) -> "LoadedPackage":
    """Read, validate and load a `.grace` package onto CUDA device `device`. `instantiate`: "lazy"
    (a session instantiates a graph on the first call that selects it) or "eager" (every graph when
    the session is made). `pdl=False` builds the package's programmatic edges as full edges (A/B
    runs, debugging); on a GPU older than sm_90 they always are (SPEC §5.3).

    `trusted_keys`: ed25519 public keys (KEY.pub files, their base64 text, or 32 raw bytes); the
    package must then be signed by one of them (`grace sign`, SPEC §7), else UntrustedPackageError
    before its manifest is decoded or the GPU is touched. None (the default) applies the
    deployment's policy: the keys in GRACE_TRUSTED_KEYS when it is set, else no signature check.
    A check needs `pip install 'grace[sign]'`."""
    _check_instantiate(instantiate)  # before reading the file
    # the reader pulls in safetensors: import on first use
    from grace.formats.signing import read_trusted_package

    t0 = time.perf_counter()
    package = read_trusted_package(path, trusted_keys)
    t1 = time.perf_counter()
    loaded = LoadedPackage(package, device, instantiate, pdl)
    loaded.load_stats.update(read_s=t1 - t0, total_s=time.perf_counter() - t0)
    return loaded


def _check_races(manifest) -> None:
    """The race proof of `grace verify` (grace.formats.races, SPEC §5.3), before the GPU is touched:
    every pair of nodes whose ranges overlap, one writing, is ordered by a path of edges. A package
    whose kernels do not declare `writes` (before format 3.2) cannot be judged and is not refused.
    Pure Python on the manifest (no torch, no Triton): a sweep over each resource's ranges."""
    from grace.formats.races import check_races

    problems = check_races(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidPackageError(f"the package's graphs race: {problems[0]}{more}")


class LoadedPackage:
    """A package on one GPU: kernels loaded, weights uploaded. Make Sessions to run it.

    `package`: a grace.formats Package (read_package). `view`: its manifest as a
    grace.formats.view.Manifest; `manifest`: the manifest dict itself.
    `inputs` / `outputs`: lists of TensorSpec (name, dtype, shape, slot) in manifest order.
    `arch`: the package arch picked for this GPU (SPEC §5.1); `view` is the view of its variant
    (format 3.5, grace.formats.view.for_arch: the graphs that serve `arch`, numbered from 0;
    `view.graph_index[i]` is graph i's index in the manifest), `package_view` the whole package's.
    `graph_names`: one per bucket of the variant; `plans[i]`: its graph i's NodePlans; `shapes`:
    the ShapePlan. `functions[k]`: kernel k's CUfunction, None for a kernel without a binary for
    `arch` (one of another variant's graphs only).
    `state`: the StateEntry list (empty for a stateless package); `generate`: the GeneratePlan, or
    None when the package was compiled without --generate. `load_stats`: seconds spent reading and
    verifying the file (read_s, set by load()), loading kernels (kernels_s) and uploading the weights
    (weights_s, weights_nbytes, upload: the copy method). `kernel_info[i]`: what the driver reported
    about kernel i's binary (abi.check_function: parameter sizes, max threads, static shared memory,
    registers), checked against the manifest.
    """

    def __init__(self, package, device: int = 0, instantiate: str = "lazy", pdl: bool = True):
        _check_instantiate(instantiate)
        self.device = None
        self.instantiate = instantiate
        self._modules, self.functions, self.weights_ptr = [], [], None
        self.kernel_info = []   # per kernel, what the driver reported about its binary (abi.py)
        self._set_condition = None  # (module, function), loaded on the first generate()
        self._sessions = weakref.WeakSet()
        self.shapes, self.plans, self.generate, self.graph_names = None, [], None, []
        self.manifest = package.manifest
        # read_package validated it: nothing is checked twice
        self.package_view = self.view = whole = package.view
        self.inputs, self.outputs = list(whole.inputs), list(whole.outputs)
        self.index_checks = plan_index_checks(whole)  # None: the package has no error word
        self.state = plan_state(package)
        # What this runtime cannot run fails here, before the GPU is touched: every variant is
        # planned (a package is refused for what any of its graphs needs), the GPU's is kept.
        planned = {graphs: self._plan(for_arch(whole, archs[0])) for archs, graphs in variants(whole)}
        self.extents_offset = whole.table.extents_offset  # symbol k: 8 bytes at + 8k
        _check_races(package.manifest)
        self.load_stats = {}
        self.device = driver.Device(device)
        # programmatic edges need sm_90 (griddepcontrol); full edges are always a correct stand-in
        self.pdl = bool(pdl) and arch_rules.supports_pdl(self.device.capability)
        try:
            # the GPU's arch picks the binaries and the variant (SPEC §5.1, "Before launch" 3, 8)
            self.arch = pick_arch(self.device.capability, whole.archs)
            self.view = for_arch(whole, self.arch)
            self.shapes, self.plans, self.generate = planned[self.view.graph_index]
            self.graph_names = self.shapes.graph_names
            t0 = time.perf_counter()
            self._load_kernels(package)
            if self.pdl:
                self._cap_programmatic_waves()
            t1 = time.perf_counter()
            self._upload_weights(package)
            self.load_stats.update(kernels_s=t1 - t0, weights_s=time.perf_counter() - t1)
        except BaseException:
            self.close()
            raise

    def _plan(self, view) -> tuple:
        """(ShapePlan, NodePlans per graph, GeneratePlan or None) of one variant's view."""
        shapes = ShapePlan(view)
        plans = [graph.plan_graph(view, i) for i in range(len(view.graphs))]
        generate = GeneratePlan(view, self.state) if view.generate else None
        return shapes, plans, generate

    # --- loading
    def _load_kernels(self, package) -> None:
        """Load every kernel that has a binary for the picked arch: each kernel the variant's graphs
        and the generation step run has one (the validator checked it, SPEC §3.5); a kernel of
        another variant's graphs only has none and stays unloaded (None)."""
        cu = driver.cuda()
        self._check_shared_memory(cu)
        for kernel in self.view.kernels:
            section = kernel.binaries.get(self.arch)
            if section is None:
                self.functions.append(None)
                self.kernel_info.append(None)
                continue
            module = call(cu.cuModuleLoadData, bytes(package.section(section)))
            self._modules.append(module)
            try:
                function = call(cu.cuModuleGetFunction, module, kernel.name.encode())
            except GraceRuntimeError as e:
                raise InvalidPackageError(f"kernel {kernel.name}: entry point not found in {section} ({e})") from None
            # the binary itself: parameter count and sizes, threads per block, shared memory
            self.kernel_info.append(abi.check_function(cu, function, kernel, lambda: self._shared_limit(cu)))
            if kernel.shared > _DEFAULT_SHARED_LIMIT:
                call(cu.cuFuncSetAttribute, function,
                     cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel.shared)
            self.functions.append(function)

    def _cap_programmatic_waves(self) -> None:
        """Launch every programmatic-edge target one wave wide on this GPU (runtime/occupancy.py):
        the nodes get the extra dynamic shared memory, their functions the opt-in for it."""
        cu = driver.cuda()
        limits = occupancy.device_limits(cu, self.device.handle)
        self.plans = [occupancy.cap_programmatic(plans, limits) for plans in self.plans]
        need = {}
        for plans in self.plans:
            for plan in plans:
                need[plan.kernel] = max(need.get(plan.kernel, 0), plan.shared)
        for k, shared in need.items():
            if shared > max(self.view.kernels[k].shared, _DEFAULT_SHARED_LIMIT):
                call(cu.cuFuncSetAttribute, self.functions[k],
                     cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)

    def _shared_limit(self, cu) -> int:
        """This GPU's opt-in shared memory per block (CU_DEVICE_ATTRIBUTE_..._OPTIN)."""
        return call(cu.cuDeviceGetAttribute,
                    cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                    self.device.handle)

    def _check_shared_memory(self, cu) -> None:
        """Every kernel's dynamic shared memory within what this GPU grants a block (the format caps
        it at the H100/H200's 227 KiB; an A100 has 163 KiB): PackageMismatchError before any module
        is loaded, instead of a failed cuFuncSetAttribute. Asked only when a kernel needs more than
        the 48 KiB every GPU gives without opting in."""
        kernels = [k for k in self.view.kernels if self.arch in k.binaries]
        need = max((k.shared for k in kernels), default=0)
        if need <= _DEFAULT_SHARED_LIMIT:
            return
        limit = call(cu.cuDeviceGetAttribute,
                     cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                     self.device.handle)
        kernel = next(k for k in kernels if k.shared == need)
        if need > limit:
            raise PackageMismatchError(
                f"kernel {kernel.name} needs {need} bytes of dynamic shared memory, but this GPU "
                f"({self.device.arch}) allows {limit} per block; compile the model for {self.device.arch}")

    def _upload_weights(self, package) -> None:
        """Each weight to base + its offset. read_package has checked that every entry lies in the
        weights region and is a tensor of the `weights` section with the entry's dtype and shape."""
        weights = self.view.weights
        self.weights_ptr = driver.mem_alloc(self.view.regions["weights"])
        if not weights:
            return
        from grace.formats import decode_weights

        section = package.section("weights")
        tensors = decode_weights(section)
        copies = [(self.weights_ptr + w.offset, tensors[w.name][2]) for w in weights]  # views of the file
        info = upload(copies, section)
        self.load_stats.update(weights_nbytes=info["bytes"], upload=info["method"])

    def set_condition_function(self):
        """The runtime's set_condition kernel (generate.SET_CONDITION_PTX), JIT-compiled by the driver
        for this GPU on first use and shared by the package's sessions."""
        if self._set_condition is None:
            self.device.make_current()
            cu = driver.cuda()
            module = call(cu.cuModuleLoadData, SET_CONDITION_PTX.encode() + b"\0")  # PTX: NUL-terminated text
            try:
                function = call(cu.cuModuleGetFunction, module, SET_CONDITION_NAME.encode())
            except BaseException:
                call(cu.cuModuleUnload, module)
                raise
            self._set_condition = (module, function)
        return self._set_condition[1]

    # --- use
    def session(self, poison: bool = False, stream=None):
        """A Session: its own arena, table, output buffers, stream and graphs (instantiated as the
        package's `instantiate` says).
        poison=True fills the arena with 0xFF bytes (NaN in every float format) to expose reads of
        memory no kernel wrote. `stream`: run on this stream (a CUstream, an int handle, or a
        torch.cuda.Stream) instead of one the session creates."""
        from .session import Session

        if self.device is None or self.device.ctx is None:
            raise GraceRuntimeError("this package was closed")
        s = Session(self, poison=poison, stream=stream)
        self._sessions.add(s)
        return s

    def close(self) -> None:
        """Close every session, unload the kernels, free the weights, release the context."""
        for s in list(self._sessions):
            s.close()
        device = self.device
        if device is None or device.ctx is None:
            return
        device.make_current()
        cu = driver.cuda()
        if self.weights_ptr is not None:
            driver.mem_free(self.weights_ptr)
            self.weights_ptr = None
        if self._set_condition is not None:
            self._modules.append(self._set_condition[0])
            self._set_condition = None
        for module in self._modules:
            call(cu.cuModuleUnload, module)
        self._modules, self.functions, self.kernel_info = [], [], []
        device.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: the driver may already be gone

    def __repr__(self) -> str:
        name = self.view.model.get("name", "?")
        arch = getattr(self, "arch", "?")
        return (f"LoadedPackage({name!r}, {len(self.view.kernels)} kernels, "
                f"{len(self.plans)} graph(s), {arch} on {self.device})")
