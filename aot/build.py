"""Stage 6: Triton source → cubin, on a machine with no GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` needs no driver (design §4).
Pointer parameters carry a 16-byte divisibility hint: every pointer we pass is 256-aligned
(arena, weights) or an 8-aligned table slot holding a 16-aligned pointer (checked by the
runtime). Each unique (source, arch, options) is compiled once, in parallel worker processes, and
cached on disk under ~/.cache/grace (GRACE_CACHE_DIR overrides), keyed by a hash that includes the
Triton version.
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

    def key(self) -> str:
        import triton
        blob = json.dumps([self.source, self.param_types, self.num_warps, self.num_stages,
                           self.arch, triton.__version__])
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
    names = fn.arg_names
    signature = dict(zip(names, req.param_types))
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(req.param_types)
             if t.startswith("*")}
    capability = int(req.arch.removeprefix("sm_"))
    try:
        compiled = triton.compile(ASTSource(fn, signature, {}, attrs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": req.num_warps,
                                           "num_stages": req.num_stages})
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
    todo = [r for r in requests if not _is_cached(r)]
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


def _is_cached(req: BuildRequest) -> bool:
    path = cache_dir() / f"{req.key()}.json"
    return path.exists() and path.with_suffix(".cubin").exists()
