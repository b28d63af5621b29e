"""The `build` stage: Triton source → cubin, on a machine with no GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` needs no driver (measured with
Triton 3.6 for sm_80, sm_90 and sm_100; `python -m triton.tools.compile` does need one).
Pointer parameters carry a 16-byte divisibility hint: every pointer we pass is 256-aligned
(arena, weights, state), a 16-aligned table slot, or a user tensor the runtime checked to be
16-byte aligned (SPEC.md §5.1). Each unique request is compiled once, in parallel worker
processes, and cached on disk under ~/.cache/grace/cubins (GRACE_CACHE_DIR overrides).

The cache key (`BuildRequest.key`) hashes everything the cubin depends on: the source, the
parameter types, the divisibility hints, the target, every option handed to `triton.compile`, the
Triton version, and RECIPE_VERSION for what the code of this module decides. The recipe is read
from the request itself (`signature`, `attrs`, `target`, `triton_options`), by the key and by
`compile_one` alike, so the two cannot drift apart.

The compile target's multiprocessor count (format 3.5: formats.archs.SM_COUNTS, `--sm-count`) is
in the key through the source: the tile plans it decides (split-K, attention splits, block sizes)
are literals of the generated code, and nothing else of a build depends on it (Triton's compile
takes no SM count). It is deliberately not hashed on its own: a kernel whose source does not change
with the count (most of them) keeps one cache entry per arch, whichever part it is planned for.
An option that hands the count to triton.compile belongs in `options`, which the key hashes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path


# The build recipe's version: bump it whenever this module changes how a source becomes a cubin
# (another hint in `attrs`, another option, a different target or compile call), so that
# ~/.cache/grace never serves a cubin built by the old recipe. 1: the recipe before the version
# existed (its keys did not include it); 2: the key hashes the recipe and the full options.
RECIPE_VERSION = 2
WARP_SIZE = 32


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuildRequest:
    name: str
    source: str
    param_types: tuple[str, ...]
    num_warps: int
    num_stages: int
    arch: str                      # "sm_90"
    # further triton.compile options as (name, value) pairs (none so far; a new one goes here,
    # so that it is in the key)
    options: tuple = ()

    def triton_options(self) -> dict:
        """Everything handed to triton.compile as `options`."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.options)}

    def attrs(self) -> dict:
        """The argument attributes: a 16-byte divisibility hint on every pointer parameter."""
        return {(i,): [["tt.divisibility", 16]] for i, t in enumerate(self.param_types)
                if t.startswith("*")}

    def target(self) -> tuple[str, int, int]:
        """(backend, compute capability, warp size) of GPUTarget."""
        return ("cuda", int(self.arch.removeprefix("sm_")), WARP_SIZE)

    def key(self) -> str:
        """The cache key: a sha256 over the recipe version, the Triton version and every input of
        the build (source, entry point, signature, hints, target, options)."""
        import triton
        blob = json.dumps({
            "recipe": RECIPE_VERSION, "triton": triton.__version__, "name": self.name,
            "source": self.source, "signature": list(self.param_types),
            "attrs": sorted([list(k), v] for k, v in self.attrs().items()),
            "target": list(self.target()),
            "options": sorted([k, v] for k, v in self.triton_options().items()),
        }, sort_keys=True, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Binary:
    cubin: bytes
    shared: int
    global_scratch_size: int
    profile_scratch_size: int
    num_warps: int


def cache_dir() -> Path:
    root = Path(os.environ.get("GRACE_CACHE_DIR", Path.home() / ".cache" / "grace" / "cubins"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def load_source(name: str, source: str):
    """Import generated Triton source as a module (Triton's @jit reads source files)."""
    folder = Path(tempfile.gettempdir()) / "grace_kernels"
    folder.mkdir(exist_ok=True)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = folder / f"{name}_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    mod_name = f"grace_kernel_{name}_{digest}"
    if mod_name in sys.modules:
        return getattr(sys.modules[mod_name], name)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def compile_one(req: BuildRequest) -> Binary:
    cached = cache_dir() / f"{req.key()}.json"
    cubin_path = cached.with_suffix(".cubin")
    if cached.exists() and cubin_path.exists():
        meta = json.loads(cached.read_text())
        return Binary(cubin_path.read_bytes(), **meta)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_source(req.name, req.source)
    signature = dict(zip(fn.arg_names, req.param_types))
    try:
        compiled = triton.compile(ASTSource(fn, signature, {}, req.attrs()),
                                  target=GPUTarget(*req.target()),
                                  options=req.triton_options())
    except Exception as exc:
        raise BuildError(f"Triton failed to compile kernel {req.name} for {req.arch}: "
                         f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}\n"
                         f"--- source ---\n{req.source}") from exc
    md = compiled.metadata
    meta = {"shared": int(md.shared), "num_warps": int(md.num_warps),
            "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
            "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0)}
    cubin = compiled.asm["cubin"]
    tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, cubin_path)
    tmp = cached.with_suffix(f".{os.getpid()}.tmpj")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, cached)
    return Binary(cubin, **meta)


def compile_all(requests: list[BuildRequest], jobs: int | None = None, progress=None) -> list[Binary]:
    """Compile in worker processes; results in request order. `progress(done, total)` is called
    as kernels finish."""
    jobs = jobs or max(1, min(os.cpu_count() or 1, 8))
    todo = [r for r in requests if not is_cached(r)]
    if len(todo) > 1 and jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for done, _ in enumerate(pool.map(compile_one, todo), 1):
                if progress:
                    progress(done, len(todo))
    else:
        for done, req in enumerate(todo, 1):
            compile_one(req)
            if progress:
                progress(done, len(todo))
    return [compile_one(r) for r in requests]


def is_cached(req: BuildRequest) -> bool:
    """The cache holds this request's cubin and metadata (compile_one will not build it)."""
    path = cache_dir() / f"{req.key()}.json"
    return path.exists() and path.with_suffix(".cubin").exists()
