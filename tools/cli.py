"""The `grace` command: compile | check | inspect | run | generate | bench | verify | keygen | sign.

User errors (a bad or corrupt package, wrong inputs, an op the compiler cannot lower, no GPU) print
one line to stderr and exit with a non-zero code. Internal errors (a bug in grace) print their
traceback and a last line that says so. `--traceback` (before or after the subcommand) shows the
traceback of every error.

Exit codes: 0 ok, 1 error (for `grace check`: an op cannot be lowered), 2 no usable GPU / driver
(and argparse usage errors).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

EXIT_ERROR = 1
EXIT_NO_DEVICE = 2

INTERPRET_HINT = "use `grace run --interpret` to run the package on the CPU with Triton's interpreter"
AOT_INSTALL = "pip install 'grace[aot]'"


class CliError(Exception):
    """A user error with a ready one-line message."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split())


def _read(path: str, verify: bool = True, trusted_keys=None):
    """The package at `path`, fully read; with `trusted_keys` (a list) it must be signed by one of
    them, checked before its manifest is decoded (grace.formats.signing.read_trusted_package)."""
    from grace.formats import read_package

    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CliError(f"{path}: is a directory, expected a .grace file")
    if trusted_keys is not None:
        from grace.formats.signing import read_trusted_package

        return read_trusted_package(path, trusted_keys)
    return read_package(path, verify=verify)


def _trusted_keys(args, launch: bool = True):
    """The keys a package must be signed by, or None for no check: every --trusted-key (a key given
    is a key required), else, for commands that launch the package (`launch`), GRACE_TRUSTED_KEYS,
    the deployment's policy. --require-signature with no key from either is a usage error."""
    from grace.formats import signing

    keys = list(getattr(args, "trusted_key", None) or [])
    if not keys and launch:
        keys = signing.trusted_keys_from_env() or []
    if keys:
        return [signing.parse_public_key(k) for k in keys]   # a bad key file: one line, now
    if getattr(args, "require_signature", False):
        raise CliError("--require-signature needs the keys to trust: --trusted-key KEY.pub "
                       f"(repeatable) or {signing.TRUSTED_KEYS_ENV}")
    return None


def _add_trust_flags(parser, launch: bool = True) -> None:
    """--trusted-key (and, for commands that launch, --require-signature) on a subcommand."""
    if launch:
        parser.add_argument("--require-signature", action="store_true",
                            help="refuse the package unless it is signed by a trusted key (--trusted-key "
                                 "or GRACE_TRUSTED_KEYS; either alone already requires it), checked "
                                 "before anything of it is decoded or launched")
    parser.add_argument("--trusted-key", action="append", default=[], metavar="KEY.pub",
                        help="an ed25519 public key the package must be signed by (a KEY.pub file "
                             "from `grace keygen`, or its base64 text); repeatable: any one of them")


def _shape_str(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def _expected_inputs(manifest) -> str:
    specs = manifest.get("inputs", []) or []
    return ", ".join(f"{s['name']} ({_shape_str(s['dtype'], s['shape'])})" for s in specs) or "none"


def _parse_inputs(pairs: list[str], manifest) -> dict:
    import numpy as np

    names = [s["name"] for s in manifest.get("inputs", []) or []]
    expected = _expected_inputs(manifest)
    inputs = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise CliError(f"--input {pair!r}: expected NAME=FILE.npy; the package's inputs are: {expected}")
        name, file = pair.split("=", 1)
        if name not in names:
            raise CliError(f"--input {name!r}: the package has no input of that name; its inputs are: {expected}")
        if name in inputs:
            raise CliError(f"--input {name!r} given twice")
        if not os.path.isfile(file):
            raise CliError(f"--input {name}: {file}: no such file")
        try:
            inputs[name] = np.load(file, allow_pickle=False)
        except Exception as e:
            raise CliError(f"--input {name}: {file} is not a readable .npy file ({_one_line(e)})") from e
        if not isinstance(inputs[name], np.ndarray):
            raise CliError(f"--input {name}: {file} holds several arrays (.npz); give a .npy file")
    missing = [n for n in names if n not in inputs]
    if missing:
        raise CliError(
            f"missing --input for {', '.join(missing)}; the package's inputs are: {expected} "
            f"(pass each as --input NAME=FILE.npy)"
        )
    return inputs


def _summarize(outputs: dict, console) -> None:
    import numpy as np
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, title="outputs", title_justify="left", title_style="bold")
    # the model's output names (pooler_output, last_hidden_state) in full, not cut to "pooler_ou…"
    longest = max((len(str(n)) for n in outputs), default=4)
    t.add_column("name", justify="left", min_width=min(longest, 40), overflow="fold")
    for c, j in (("dtype", "left"), ("shape", "left"), ("min", "right"), ("max", "right"),
                 ("mean", "right"), ("nan", "right")):
        t.add_column(c, justify=j)
    for name, a in outputs.items():
        a = np.asarray(a)
        if a.size and a.dtype.kind in "fiub":
            af = a.astype(np.float64)
            nan = int(np.isnan(af).sum())
            finite = af[np.isfinite(af)]
            mn, mx, mean = ((f"{finite.min():.6g}", f"{finite.max():.6g}", f"{finite.mean():.6g}")
                            if finite.size else ("-", "-", "-"))
        else:
            mn = mx = mean = "-"
            nan = 0
        t.add_row(name, str(a.dtype), str(list(a.shape)), mn, mx, mean, str(nan))
    console.print(t)


_BUCKETS_FORM = "expected NAME=B1,B2,... (e.g. --buckets input_ids.1=16,32,64,128,512)"


def parse_buckets(specs: list[str] | None) -> dict[str, list[int]]:
    """`--buckets NAME=16,32,64` (repeated) -> {NAME: [16, 32, 64]}.

    Checked here, before torch is imported, so a typo costs no export load; whether NAME is a
    symbol of the program and the bounds lie in its range is the compiler's check (it knows the
    symbols) and comes back as a one-line error too.
    """
    buckets: dict[str, list[int]] = {}
    for spec in specs or []:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep:
            raise CliError(f"--buckets {spec!r}: {_BUCKETS_FORM}")
        if not name:
            raise CliError(f"--buckets {spec!r}: the dimension name before '=' is empty; {_BUCKETS_FORM}")
        if name in buckets:
            raise CliError(f"--buckets {name!r} given twice; give all of a dimension's sizes in one flag")
        buckets[name] = _bucket_sizes(name, values)
    return buckets


def _bucket_sizes(name: str, values: str) -> list[int]:
    """'16,32,64' -> [16, 32, 64]: positive integers, strictly increasing (bucket upper bounds)."""
    items = [v.strip() for v in values.split(",")]
    if not any(items):
        raise CliError(f"--buckets {name}: no sizes after '='; {_BUCKETS_FORM}")
    sizes: list[int] = []
    for item in items:
        if not re.fullmatch(r"[+-]?\d+", item):
            raise CliError(f"--buckets {name}: {item!r} is not an integer; {_BUCKETS_FORM}")
        size = int(item)
        if size <= 0:
            raise CliError(f"--buckets {name}: bucket sizes must be positive, got {size}")
        if sizes and size <= sizes[-1]:
            raise CliError(f"--buckets {name}: bucket sizes must be strictly increasing, "
                           f"got {size} after {sizes[-1]}")
        sizes.append(size)
    return sizes


_GENERATE_FORM = ("expected tokens=INPUT,positions=INPUT[,logits=OUTPUT] "
                  "(e.g. --generate tokens=idx,positions=input_pos)")
_GENERATE_KEYS = ("tokens", "positions", "logits")


def parse_generate(spec: str | None) -> dict[str, str] | None:
    """`--generate tokens=idx,positions=input_pos[,logits=out]` -> {"tokens": "idx", ...}.

    The form is checked here, before torch is imported; whether the names are inputs/outputs of the
    program is the compiler's check."""
    if spec is None:
        return None
    names: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise CliError(f"--generate {spec!r}: {item.strip()!r} is not KEY=NAME; {_GENERATE_FORM}")
        if key not in _GENERATE_KEYS:
            raise CliError(f"--generate {spec!r}: unknown key {key!r} (keys: {', '.join(_GENERATE_KEYS)}); "
                           f"{_GENERATE_FORM}")
        if key in names:
            raise CliError(f"--generate {spec!r}: {key} given twice; {_GENERATE_FORM}")
        names[key] = value
    missing = [k for k in ("tokens", "positions") if k not in names]
    if missing:
        raise CliError(f"--generate {spec!r}: missing {' and '.join(missing)}; {_GENERATE_FORM}")
    return names


def _aot_installed() -> bool:
    """torch and triton can be imported (without importing them: that takes seconds)."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))
    except (ImportError, ValueError):
        return False


def _interpret_hint() -> str:
    """The advice for a machine without a GPU; a runtime-only install needs the [aot] extra first."""
    if _aot_installed():
        return INTERPRET_HINT
    return f"{INTERPRET_HINT} (it needs torch and triton, which this install lacks: {AOT_INSTALL})"


def _need_aot(what: str):
    """Import torch and triton for `what` (compile, check, --interpret), or a one-line error that
    says how to install them (a runtime-only install: `pip install grace`)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        raise CliError(f"{what} needs torch and triton, which this install lacks "
                       f"({_one_line(e)}): {AOT_INSTALL}") from e
    return torch


def _interpreter():
    """grace.tools.interpret, for --interpret (it needs torch and triton)."""
    _need_aot("--interpret (the CPU reference executor: Triton's interpreter)")
    import grace.tools.interpret as interpret

    return interpret


def _no_device(e: Exception) -> CliError:
    msg = _one_line(e)
    if "--interpret" not in msg:
        msg = f"{msg}; {_interpret_hint()}"
    elif not _aot_installed():   # the runtime's own advice: --interpret, which needs the [aot] extra
        msg = f"{msg} (it needs torch and triton, which this install lacks: {AOT_INSTALL})"
    return CliError(msg, EXIT_NO_DEVICE)


def _runtime():
    """Import grace.runtime; a missing driver binding is a no-device error, not a crash."""
    try:
        import grace.runtime as rt
    except ImportError as e:
        raise CliError(f"the GPU runtime is unavailable ({_one_line(e)}); {_interpret_hint()}",
                       EXIT_NO_DEVICE) from e
    return rt


# path problems the user can fix: one line, not a traceback
_USER_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
# grace's own error classes that mean a bug in grace, not in the user's model or files
_INTERNAL_GRACE_ERRORS = ("BuildError",)   # Triton rejected a kernel grace generated


def _is_grace_error(e: BaseException) -> bool:
    """Errors defined by grace itself (compile errors, format and runtime errors)."""
    mod = type(e).__module__ or ""
    return mod.startswith("grace.") and type(e).__name__.endswith("Error")


def _is_user_error(e: BaseException) -> bool:
    """One line for the user (a bad input, file or model), or False: a bug in grace, whose
    traceback is shown. A plain ValueError/KeyError/... from inside grace is a bug; grace's user
    errors have their own classes (LoweringError, FormatError, InputError, ...)."""
    if isinstance(e, CliError):
        return True
    if isinstance(e, _USER_OS_ERRORS):
        return True
    if _is_grace_error(e):
        return type(e).__name__ not in _INTERNAL_GRACE_ERRORS and not str(e).startswith("internal")
    return False


# ------------------------------------------------------------------------------------------------
# commands
# ------------------------------------------------------------------------------------------------


def _archs(specs) -> list[str]:
    archs = []
    for a in specs or ["sm_90"]:
        archs += [x.strip() for x in a.split(",") if x.strip()]
    from grace.formats import archs as arch_rules   # the one module of arch rules

    bad = [a for a in archs if not arch_rules.is_arch(a)]
    if bad:
        raise CliError(f"--arch {bad[0]!r}: expected names like sm_80, sm_90, sm_100")
    return list(dict.fromkeys(archs))


_SM_COUNT_FORM = "expected ARCH=N, e.g. --sm-count sm_90=114 (an H100 PCIe), comma separated or repeated"


def parse_sm_count(specs) -> dict[str, int]:
    """`--sm-count sm_90=114[,sm_80=...]` (repeated) -> {"sm_90": 114}: the multiprocessor count
    to plan an arch's tiles for (format 3.5; default: grace.formats.archs.SM_COUNTS). Whether the
    arch is compiled for is the compiler's check."""
    from grace.formats import archs as arch_rules

    counts: dict[str, int] = {}
    for spec in specs or []:
        for item in (x.strip() for x in spec.split(",")):
            if not item:
                continue
            arch, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not arch_rules.is_arch(arch) or not value.isdigit():
                raise CliError(f"--sm-count {item!r}: {_SM_COUNT_FORM}")
            if arch in counts:
                raise CliError(f"--sm-count {arch} given twice")
            try:
                counts[arch] = arch_rules.check_sm_count(int(value), f"--sm-count {arch}")
            except ValueError as e:
                raise CliError(str(e)) from None
    return counts


def check_output(path: str, name: str = "model") -> Path:
    """`-o PATH`, checked before anything is compiled: a file name (not a directory), in a
    directory that exists or can be made, and that this user may write in."""
    out = Path(path)
    example = out / f"{name}.grace"
    if path.endswith(("/", os.sep)) or out.is_dir():
        raise CliError(f"-o {path}: is a directory; give the package's file name, e.g. -o {example}")
    if out.exists() and not out.is_file():
        raise CliError(f"-o {path}: exists and is not a regular file")
    parent = out.absolute().parent
    existing = parent
    while not existing.exists():   # missing folders are made by the compiler
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"-o {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"-o {path}: cannot write in {existing} (permission denied)")
    return out


def _load_export(src: str):
    """The ExportedProgram in a torch.export.save file, or a one-line error that says how to
    write one."""
    if not os.path.exists(src):
        raise CliError(f"{src}: no such file")
    if os.path.isdir(src):
        raise CliError(f"{src}: is a directory, expected a .pt2 file written by torch.export.save")
    import logging
    import zipfile

    if not zipfile.is_zipfile(src):
        raise CliError(
            f"{src} is not a torch.export file (not a zip archive); write one with "
            f"torch.export.save(torch.export.export(model, args), '{Path(src).stem}.pt2')"
        )
    torch = _need_aot("reading a torch.export file")
    # torch logs a full traceback as a warning before trying its legacy format: collect the records
    # instead of printing them, and name the first error in our one-line message.
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    export_log = logging.getLogger("torch.export")
    saved = (export_log.handlers[:], export_log.propagate, export_log.level)
    export_log.handlers[:] = [_Collect(logging.WARNING)]
    export_log.propagate = False
    export_log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecations, not the user's
            # torch.export.load, with the pytree types the file names (transformers' outputs)
            # imported first, or read by name (grace.aot.export.load)
            from grace.aot.export import load
            ep = load(src)
    except Exception as e:
        cause = f"{type(e).__name__}: {_one_line(e)}"
        for rec in records:
            if rec.exc_info and rec.exc_info[1] is not None:
                cause = f"{type(rec.exc_info[1]).__name__}: {_one_line(rec.exc_info[1])}"
                break
        raise CliError(
            f"{src} is not a torch.export file (write one with torch.export.save(torch.export.export(model, args), "
            f"'{Path(src).stem}.pt2')): {cause}"
        ) from e
    finally:
        export_log.handlers[:] = saved[0]
        export_log.propagate = saved[1]
        export_log.setLevel(saved[2])
    if not isinstance(ep, torch.export.ExportedProgram):
        raise CliError(f"{src}: torch.export.load returned {type(ep).__name__}, not an ExportedProgram")
    return ep


def _compiler(what: str):
    _need_aot(what)
    try:
        import grace.aot as aot
    except ImportError as e:
        raise CliError(f"the compiler is unavailable: {_one_line(e)}") from e
    return aot


def cmd_compile(args) -> int:
    src = args.exported
    if not os.path.exists(src):
        raise CliError(f"{src}: no such file")
    archs = _archs(args.arch)
    buckets = parse_buckets(args.buckets)
    generate = parse_generate(args.generate)
    sm_count = parse_sm_count(getattr(args, "sm_count", None))
    name = args.name or Path(src).stem
    output = check_output(args.output, name)   # before minutes of compiling, not after
    aot = _compiler("grace compile")
    try:   # the compiler's own option checks, as one-line errors before the export is read
        aot.CompileOptions(archs=tuple(archs), fp32_matmul=args.fp32_matmul, pdl=args.pdl,
                           generate=tuple((generate or {}).items()),
                           sm_count=tuple(sm_count.items()))
    except ValueError as e:
        raise CliError(_one_line(e)) from e
    ep = _load_export(src)
    # only passed when given: without it the compiler picks its default buckets
    extra = {"buckets": buckets} if buckets else {}
    if generate is not None:
        extra["generate"] = generate
    if args.pdl is not None:
        extra["pdl"] = args.pdl
    if not args.gemm_tiles:
        extra["gemm_tiles"] = False
    if args.fold_row_stats:
        extra["fold_row_stats"] = True
    if sm_count:
        extra["sm_count"] = sm_count
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecation noise
            # the progress output says it in one line (aot/versions.py)
            warnings.simplefilter("ignore", aot.versions.ProducerVersionWarning)
            path = aot.compile(ep, output=output, archs=tuple(archs), name=name, progress=True,
                               fp32_matmul=args.fp32_matmul, **extra)
    except ValueError as e:   # an op refused: the compile stops at the first, the check lists all
        if _is_user_error(e) and "used at" in str(e) and len(e.args) == 1:
            e.args = (f"{e}; `grace check {src}` lists every op that cannot be lowered",)
        raise
    path = Path(path) if path is not None else output
    if not path.exists():
        raise CliError(f"the compiler reported success but wrote no {path}")
    return 0  # the compiler reports progress and the result itself (progress=True)


def cmd_check(args) -> int:
    src = args.exported
    if not os.path.exists(src):
        raise CliError(f"{src}: no such file")
    buckets = parse_buckets(args.buckets)
    generate = parse_generate(args.generate)
    aot = _compiler("grace check")
    ep = _load_export(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecation noise
        report = aot.check(ep, buckets=buckets or None, generate=generate, name=Path(src).stem)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format(max_locations=args.max_locations))
    return 0 if report.ok else EXIT_ERROR


def cmd_inspect(args) -> int:
    from grace.tools.inspect import describe, render

    pkg = _read(args.package, verify=not args.no_verify)
    if args.source:   # one kernel's source, as the package holds it (names: `grace inspect`)
        from grace.tools.inspect import kernel_source

        sys.stdout.write(kernel_source(pkg, args.source))
        return 0
    desc = describe(pkg, path=args.package, verified=not args.no_verify)
    if args.json:
        print(json.dumps(desc, indent=2))
    else:
        from rich.console import Console

        # piped output (CI logs, `| less`) gets a wide table instead of rich's 80-column default
        render(desc, Console() if sys.stdout.isatty() else Console(width=160))
    return 0


def cmd_verify(args) -> int:
    import grace.formats as formats
    from grace.formats.signing import signature_status

    keys = _trusted_keys(args, launch=False)   # verify reads: only --trusted-key asks for trust
    pkg = _read(args.package, verify=True, trusted_keys=keys)
    signature = signature_status(pkg)
    if signature is not None and signature["valid"] is False:   # a signature that lies: tampered
        raise CliError(f"{args.package}: signature refused: {signature['error']}")
    validate = getattr(formats, "validate_manifest", None)
    if callable(validate):
        validate(pkg.manifest)
    sections = getattr(pkg, "section_info", []) or []
    version = pkg.format_version
    version = ".".join(map(str, version)) if isinstance(version, (list, tuple)) else str(version)
    from grace.formats.races import check_pre_wait, check_races, unchecked_reason

    from grace.tools.source_check import SourceRefused, check_kernel_source

    for kernel in pkg.manifest["kernels"]:   # sources are what --interpret would run
        if "source" in kernel:
            try:
                check_kernel_source(bytes(pkg.section(kernel["source"])).decode("utf-8"))
            except (SourceRefused, UnicodeDecodeError) as e:
                raise CliError(f"{args.package}: kernel {kernel['name']}: source refused: {e}") from None
    problems = check_races(pkg.manifest) + check_pre_wait(pkg)
    if problems:
        for problem in problems[:20]:
            print(f"race: {problem}", file=sys.stderr)
        more = " (first 20 shown)" if len(problems) > 20 else ""
        raise CliError(f"{args.package}: {len(problems)} ordering problem(s){more}")
    reason = unchecked_reason(pkg.manifest)
    races = "graphs race-free" if reason is None else "race check skipped"
    from grace.formats.view import variants
    found = variants(pkg.view)   # format 3.5: graphs per arch
    if len(found) > 1:
        races += (f", {len(found)} arch variants ("
                  + "; ".join(f"{'+'.join(a)}: {len(g)} graph(s)" for a, g in found) + ")")
    if signature is None:
        signed = "not signed"
    elif signature["valid"]:
        signed = f"signed by {signature['fingerprint']} (valid{', trusted' if keys else ''})"
    else:
        signed = f"signed by {signature['fingerprint']} (signature not checked)"
    print(f"OK {args.package}: format {version}, {len(sections)} sections verified (sha256), manifest valid, "
          f"{races}, {signed}")
    if reason:
        print(f"note: {reason}", file=sys.stderr)
    if signature is not None and signature["valid"] is None:
        print(f"note: {_one_line(signature['error'])}", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    import numpy as np
    from rich.console import Console

    keys = _trusted_keys(args)
    pkg = _read(args.package, verify=True, trusted_keys=keys)
    inputs = _parse_inputs(args.input, pkg.manifest)
    poison = not args.no_poison
    t0 = time.perf_counter()
    if args.interpret:
        # keys: checked again by the executor itself (None: it applies the same policy)
        trust = {} if keys is None else {"trusted_keys": keys}
        # a bar per node on a terminal's stderr (a CPU run takes minutes); quiet when piped
        outputs = _interpreter().run_package(pkg, inputs, poison=poison,
                                             progress=sys.stderr.isatty(), **trust)
        mode = "interpreter (CPU)"
    else:
        rt = _runtime()
        try:
            loaded = rt.load(args.package, device=args.device, trusted_keys=keys)
            sess = loaded.session(poison=poison)
            dev_out = sess.run(**inputs)
            sess.sync()
            outputs = {k: v.numpy() for k, v in dev_out.items()}
        except getattr(rt, "NoDeviceError", ()) as e:
            raise _no_device(e) from e
        mode = f"GPU {args.device}"
    dt = time.perf_counter() - t0
    # piped output (CI logs) gets a wider table than rich's 80-column default, as inspect does
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    console = Console(width=120) if wide else Console(stderr=False)
    _summarize(outputs, console)
    console.print(f"ran on {mode} in {dt * 1e3:.1f} ms" + ("" if poison else " (arena not poisoned)"))
    if args.output:
        np.savez(args.output, **{k: np.asarray(v) for k, v in outputs.items()})
        console.print(f"wrote {args.output}")
    return 0


def _load_prompt(path: str):
    """The prompt ids from a .npy file: 1-D or [1, P] integers (the runtime checks the limits)."""
    import numpy as np

    if not os.path.isfile(path):
        raise CliError(f"--prompt {path}: no such file")
    try:
        prompt = np.load(path, allow_pickle=False)
    except Exception as e:
        raise CliError(f"--prompt {path} is not a readable .npy file ({_one_line(e)})") from e
    if not isinstance(prompt, np.ndarray):
        raise CliError(f"--prompt {path} holds several arrays (.npz); give a .npy file of token ids")
    if prompt.dtype.kind not in "iu":
        raise CliError(f"--prompt {path}: token ids must be integers, got {prompt.dtype}")
    return prompt


def cmd_generate(args) -> int:
    import numpy as np

    keys = _trusted_keys(args)
    pkg = _read(args.package, verify=True, trusted_keys=keys)
    if not pkg.manifest.get("generate"):
        raise CliError(f"{args.package} was not compiled with --generate, so it cannot generate; compile "
                       "it with `grace compile ... --generate tokens=NAME,positions=NAME`")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompt = _load_prompt(args.prompt)
    t0 = time.perf_counter()
    if args.interpret:
        trust = {} if keys is None else {"trusted_keys": keys}
        tokens = _interpreter().generate_package(pkg, prompt, args.max_new_tokens, args.eos,
                                                 progress=sys.stderr.isatty(), **trust)
        mode = "interpreter (CPU)"
    else:
        rt = _runtime()
        try:
            sess = rt.load(args.package, device=args.device, trusted_keys=keys).session()
            t0 = time.perf_counter()  # the generation, not the load
            tokens = sess.generate(prompt, args.max_new_tokens, eos_token_id=args.eos)
        except getattr(rt, "NoDeviceError", ()) as e:
            raise _no_device(e) from e
        mode = f"GPU {args.device}"
    dt = time.perf_counter() - t0
    tokens = np.asarray(tokens, dtype=np.int64)
    print(" ".join(str(int(t)) for t in tokens))
    rate = f"{len(tokens) / dt:.1f} tokens/s" if dt > 0 else "-"
    print(f"{len(tokens)} new tokens after a {prompt.size}-token prompt on {mode} in {dt * 1e3:.1f} ms ({rate})")
    if args.output:
        np.save(args.output, tokens)
        print(f"wrote {args.output}")
    return 0


def _symbol_sizes(manifest, pairs) -> dict:
    """Values for a package's input symbols: NAME=VALUE pairs, the others at their maximum."""
    symbols = {s["name"]: s for s in manifest.get("symbols", []) or [] if s.get("kind") == "input"}
    sizes = {name: s["max"] for name, s in symbols.items()}
    for pair in pairs or []:
        name, _, value = pair.partition("=")
        if name not in symbols:
            raise CliError(f"--size {pair!r}: the package's size symbols are: "
                           f"{', '.join(symbols) or 'none'}")
        if not value.isdigit() or not symbols[name]["min"] <= int(value) <= symbols[name]["max"]:
            raise CliError(f"--size {pair!r}: expected an integer in "
                           f"[{symbols[name]['min']}, {symbols[name]['max']}]")
        sizes[name] = int(value)
    return sizes


def _random_inputs(manifest, seed: int = 0, sizes: dict | None = None) -> dict:
    """Random inputs of the package's dtypes and shapes (size symbols at `sizes`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = sizes if sizes is not None else _symbol_sizes(manifest, [])
    out = {}
    for s in manifest.get("inputs", []) or []:
        dtype = s["dtype"]
        shape = tuple(sizes[d] if isinstance(d, str) else int(d) for d in s["shape"])
        if dtype in ("float32", "float16", "float64"):
            out[s["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bfloat16":
            raise CliError(
                f"input {s['name']!r} is bfloat16, which numpy cannot hold; bench needs a device-array input path"
            )
        elif dtype == "bool":
            out[s["name"]] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            # small non-negative integers: valid as indices into any embedding/gather
            out[s["name"]] = rng.integers(0, 2, shape).astype(dtype)
    return out


def cmd_bench(args) -> int:
    import numpy as np

    if args.iters < 1 or args.warmup < 0:
        raise CliError("--iters must be >= 1 and --warmup >= 0")
    keys = _trusted_keys(args)
    pkg = _read(args.package, verify=True, trusted_keys=keys)
    inputs = _random_inputs(pkg.manifest, sizes=_symbol_sizes(pkg.manifest, args.size))
    rt = _runtime()
    try:
        loaded = rt.load(args.package, device=args.device, trusted_keys=keys)
        sess = loaded.session()
        for _ in range(args.warmup):
            sess.run(**inputs)
        sess.sync()
        per_call = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            sess.run(**inputs)
            sess.sync()
            per_call.append(time.perf_counter() - t0)
        host = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            sess.run(**inputs)
            host.append(time.perf_counter() - t0)
            sess.sync()
    except getattr(rt, "NoDeviceError", ()) as e:
        raise CliError(f"grace bench needs an NVIDIA GPU: {_one_line(e)}", EXIT_NO_DEVICE) from e
    ms = np.array(per_call) * 1e3
    host_us = float(np.median(host)) * 1e6
    name = (pkg.manifest.get("model") or {}).get("name", Path(args.package).stem)
    print(
        f"{name}: {args.iters} iters (warmup {args.warmup}), numpy inputs (host copy included)\n"
        f"  run()+sync  median {np.median(ms):.4f} ms   p10 {np.percentile(ms, 10):.4f} ms   "
        f"p90 {np.percentile(ms, 90):.4f} ms\n"
        f"  run() alone median {host_us:.1f} us host time"
    )
    return 0


def cmd_keygen(args) -> int:
    from grace.formats import signing

    out = args.output
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        raise CliError(f"-o {out}: is a directory; give the private key's file name, e.g. -o {Path(out) / 'release.key'}")
    parent = Path(out).absolute().parent
    if not parent.is_dir():
        raise CliError(f"-o {out}: {parent} is not a directory")
    public = signing.write_keypair(out)
    print(f"wrote {out} (private key, PKCS#8 PEM, mode 0600: keep it secret) and {out}.pub (public key)")
    print(f"public key {signing.public_key_text(public)}  fingerprint {signing.fingerprint(public)}")
    return 0


def cmd_sign(args) -> int:
    from grace.formats import signing

    if not os.path.exists(args.package):
        raise CliError(f"{args.package}: no such file")
    if os.path.isdir(args.package):
        raise CliError(f"{args.package}: is a directory, expected a .grace file")
    if not os.path.isfile(args.key):
        raise CliError(f"--key {args.key}: no such file (make a key with `grace keygen -o KEY`)")
    output = None
    if args.output:
        out = check_output(args.output, Path(args.package).stem)
        out.absolute().parent.mkdir(parents=True, exist_ok=True)   # as compile makes them
        output = str(out)
    result = signing.sign_package(args.package, args.key, output)
    replaced = ""
    if result.replaced is not None:
        same = result.replaced.public_key == result.signature.public_key
        replaced = (" (re-signed by the same key)" if same else
                    f" (replaced the signature by {result.replaced.fingerprint})")
    print(f"signed {result.path} by {result.signature.fingerprint}{replaced}")
    return 0


# ------------------------------------------------------------------------------------------------
# parser
# ------------------------------------------------------------------------------------------------

_EPILOG = """\
examples:
  grace check model.pt2                                    # every op that cannot be lowered
  grace compile model.pt2 -o model.grace --arch sm_90,sm_80
  grace compile model.pt2 -o model.grace --buckets input_ids.1=64,128,256,512
  grace inspect model.grace
  grace inspect model.grace --json > model.json
  grace run model.grace --input x=x.npy --output out.npz
  grace run model.grace --input x=x.npy --interpret        # CPU, no GPU needed
  grace compile lm.pt2 -o lm.grace --generate tokens=idx,positions=input_pos
  grace generate lm.grace --prompt ids.npy --max-new-tokens 32 --output new.npy
  grace bench model.grace --iters 200
  grace verify model.grace
  grace keygen -o release.key && grace sign model.grace --key release.key
  grace run model.grace --input x=x.npy --trusted-key release.key.pub   # refuses unsigned packages

exit codes: 0 ok, 1 error (grace check: an op cannot be lowered), 2 no usable GPU (or a usage error)
--traceback (anywhere on the line) shows the full traceback of an error
"""


class _Formatter(argparse.HelpFormatter):
    """Wrap one-paragraph descriptions; keep multi-line text (the examples) exactly as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def version_text() -> str:
    """`grace --version`: grace's version, the package format it writes, and the compiler's
    torch/triton when installed (read from their metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    try:
        from grace.formats import FORMAT_VERSION

        fmt = f"package format {'.'.join(map(str, FORMAT_VERSION))}"
    except Exception:  # noqa: BLE001 - the version must print even from a broken install
        fmt = "package format unknown"
    torch, triton = of("torch"), of("triton")
    aot = (f"compiler: torch {torch}, triton {triton}" if torch and triton and _aot_installed()
           else f"compiler: not installed ({AOT_INSTALL})")
    return f"grace {of('grace') or 'unknown'} ({fmt}; {aot})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    # --traceback after the subcommand too: SUPPRESS keeps a subcommand's parser from resetting
    # the value the main parser set (`grace --traceback compile ...`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error (debugging)")
    p = argparse.ArgumentParser(
        prog="grace",
        description="grace: ahead-of-time compiler and torch-free runtime for CUDA Graphs. "
        "Compile a torch.export program into one .grace package, inspect it, and run it on a GPU "
        "(or on the CPU with Triton's interpreter).",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--version", action=_Version,
                   help="print grace's version (and the compiler's torch/triton) and exit")
    p.add_argument("--traceback", action="store_true", default=False,
                   help="show the full traceback of an error (debugging); also accepted after the subcommand")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser(
        "compile",
        help="compile a torch.export program (.pt2) into a .grace package",
        description="Compile a program saved with torch.export.save into a .grace package: Triton kernels "
        "compiled to cubins for each --arch (no GPU needed), weights, memory plan and argument table. "
        "A program exported with dynamic_shapes gets one CUDA graph per shape bucket (per combination "
        "of buckets when several dimensions are dynamic); at run time the smallest bucket that holds "
        "the inputs' sizes serves the call, with exact-size results. "
        "Needs the [aot] extra (torch, triton).",
        epilog="examples:\n"
        "  python -c \"import torch; torch.export.save(torch.export.export(model, (x,)), 'model.pt2')\"\n"
        "  grace compile model.pt2 -o model.grace\n"
        "  grace compile model.pt2 -o model.grace --arch sm_90,sm_80 --name my-model\n"
        "  # sm_90 graphs with PDL (132 SMs) and sm_80 graphs without it (108 SMs), one package\n"
        "  grace compile model.pt2 -o model.grace --arch sm_80 --arch sm_90\n"
        "  grace compile model.pt2 -o model.grace --no-pdl     # full edges only (A/B runs)\n"
        "  grace compile model.pt2 -o model.grace --arch sm_90 --sm-count sm_90=114   # H100 PCIe\n"
        "\n"
        "  # a dynamic sequence length, exported with\n"
        "  #   dynamic_shapes={'input_ids': {1: torch.export.Dim('seq', min=1, max=512)}}\n"
        "  grace compile bert.pt2 -o bert.grace        # default buckets: 16,32,64,128,256,512\n"
        "  grace compile bert.pt2 -o bert.grace --buckets input_ids.1=64,128,256,512\n"
        "\n"
        "  # a causal LM with a KV cache (mutated buffers), for `grace generate`\n"
        "  grace compile lm.pt2 -o lm.grace --generate tokens=idx,positions=input_pos\n"
        "  grace compile lm.pt2 -o lm.grace --generate tokens=idx,positions=input_pos,logits=logits\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    c.add_argument("exported", metavar="EXPORTED.pt2", help="file written by torch.export.save")
    c.add_argument("-o", "--output", required=True, metavar="MODEL.grace", help="package to write")
    c.add_argument("--arch", action="append", metavar="SM[,SM...]",
                   help="target architectures, comma separated or repeated (default: sm_90). Archs "
                        "compiled alike (the same PDL setting and SM count) share one set of graphs; "
                        "archs that differ (PDL applies to sm_90+ only; sm_80 plans for 108 SMs, sm_90 "
                        "for 132) get a variant each in the same package, and the runtime runs its GPU's. "
                        "Each variant is lowered and generated on its own: two variants take about twice "
                        "as long to compile as one")
    c.add_argument("--name", help="model name recorded in the package (default: the file's stem)")
    c.add_argument("--fp32-matmul", choices=("tf32x3", "tf32", "ieee"), default="tf32x3",
                   help="precision of fp32 GEMMs and attention: tf32x3 is near-fp32 accuracy "
                        "(default), tf32 is fastest (~1e-3 relative error), ieee is exact fp32")
    c.add_argument("--buckets", action="append", default=[], metavar="NAME=B1,B2,...",
                   help="upper bounds of the shape buckets of one dynamic dimension: positive, strictly "
                        "increasing; repeat the flag per dimension. NAME is INPUT.DIM, the input's name "
                        "and the dimension's index (e.g. input_ids.1=64,128,256,512); the largest must be "
                        "at least the exported maximum. Default: powers of two from 16 (smaller sizes "
                        "share the first bucket) covering the dimension's exported range, the last bucket "
                        "being the range's maximum. Fewer buckets make a smaller package and fewer graphs; "
                        "more buckets pad less (a call runs at its bucket's size, masked to the true size)")
    c.add_argument("--generate", metavar="tokens=IN,positions=IN[,logits=OUT]",
                   help="compile a causal LM for `grace generate` / Session.generate: the input that takes "
                        "the token ids ([1, seq] int64), the input that takes their positions in the KV "
                        "cache ([seq] int64) and optionally the logits output (default: the first output). "
                        "Adds a one-token decode graph and the on-device argmax step; the token loop then "
                        "runs on the GPU with no host round trip per token")
    c.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="programmatic dependent launch between kernels (docs/design-pdl.md), in the graphs of "
                        "the sm_90+ archs; archs before sm_90 get graphs without it. Default: on wherever the "
                        "arch has it (on the H200 every model measured ran 3-18%% faster, docs/performance.md); "
                        "--pdl insists (an error when no arch is sm_90+), --no-pdl turns it off. "
                        "grace.runtime.load(path, pdl=False) runs a PDL package with full edges, for A/B")
    c.add_argument("--gemm-tiles", action=argparse.BooleanOptionalAction, default=True,
                   help="GEMMs of 128 rows or more near a shape of the arch's measured table (aot/gemm_tiles/, "
                        "made by python -m grace.tools.tile_sweep on that GPU) take its tile, split-K included; "
                        "other shapes keep the heuristic. Default: on (ViT-S 0.437 against 0.550 ms on the "
                        "H200, docs/performance.md); --no-gemm-tiles: the heuristic everywhere, for A/B")
    c.add_argument("--fold-row-stats", action="store_true",
                   help="reduce a one-row statistic that only a GEMV's row reads (an RMSNorm's mean of squares "
                        "in a decode step) inside that GEMV instead of a kernel of its own (aot/fuse_stats.py); "
                        "off by default: fewer kernels, but its first form was 3.7-5%% slower per token on "
                        "the H200, and the current one is not measured yet (docs/performance.md)")
    c.add_argument("--sm-count", action="append", metavar="SM=N[,SM=N...]",
                   help="the multiprocessor count to plan an arch's tiles (split-K, attention splits) for, "
                        "for a part other than the default one: sm_80 108 (A100), sm_86 84, sm_89 128 (RTX "
                        "4090), sm_90 132 (H100 SXM, H200), sm_100 148 (B200), sm_120 170; e.g. "
                        "--sm-count sm_90=114 for an H100 PCIe. Needed for an arch without a default")
    c.set_defaults(func=cmd_compile)

    k = sub.add_parser(
        "check",
        help="list every op of a .pt2 program that cannot be compiled (seconds, nothing built)",
        description="Check a program saved with torch.export.save against the compiler: every op that "
        "grace cannot lower, each op once with how often it occurs and the line of your model it comes "
        "from (the innermost frame outside torch). It runs the compiler's own stages (decomposition, "
        "lowering at every shape bucket, fusion, memory plan, kernel source generation) but builds no "
        "kernel, so it takes seconds where a compile takes minutes, and a compile stops at the first "
        "unsupported op. Exit code 0 when every op can be lowered, 1 otherwise. Needs the [aot] extra "
        "(torch, triton).",
        epilog="examples:\n"
        "  grace check model.pt2\n"
        "  grace check model.pt2 --json | jq '.problems[] | {op, count, locations}'\n"
        "  grace check bert.pt2 --buckets input_ids.1=64,512     # the buckets you will compile\n"
        "  grace check lm.pt2 --generate tokens=idx,positions=input_pos\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    k.add_argument("exported", metavar="EXPORTED.pt2", help="file written by torch.export.save")
    k.add_argument("--json", action="store_true",
                   help="print the report as JSON: ok, ops, problems[] with op, count, reasons, nodes, "
                        "locations, internal")
    k.add_argument("--buckets", action="append", default=[], metavar="NAME=B1,B2,...",
                   help="the shape buckets to check, as for `grace compile --buckets`")
    k.add_argument("--generate", metavar="tokens=IN,positions=IN[,logits=OUT]",
                   help="check as `grace compile --generate` would compile it (adds the decode bucket)")
    k.add_argument("--max-locations", type=int, default=3, metavar="N",
                   help="source lines shown per op (default 3; --json lists them all)")
    k.set_defaults(func=cmd_check)

    i = sub.add_parser(
        "inspect",
        help="show what is inside a package",
        description="Show a package's header, inputs/outputs, argument table, memory plan, kernels and graphs. "
        "--json prints the same information as JSON (keys documented in docs/inspect.md).",
        epilog="examples:\n  grace inspect model.grace\n  grace inspect model.grace --json | jq '.kernels[].name'\n"
        "  grace inspect model.grace --source matmul_3fa9c2d1e0ab\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    i.add_argument("package", metavar="MODEL.grace")
    i.add_argument("--json", action="store_true", help="print JSON instead of tables")
    i.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the sections (faster)")
    i.add_argument("--source", metavar="KERNEL", help="print the Triton source of one kernel (a name from "
                   "the kernels table) instead")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser(
        "run",
        help="run a package once on .npy inputs (GPU, or CPU with --interpret)",
        description="Run a package once. Inputs come from .npy files, one --input NAME=FILE.npy per package "
        "input. Prints name, dtype, shape, min/max/mean (and NaN count) per output; --output saves all "
        "outputs to an .npz file. Without --interpret the GPU runtime is used; with --interpret the "
        "package's own kernels run on the CPU with Triton's interpreter (fp32/fp16 only). The arena is "
        "filled with NaN first (--no-poison to skip), so reads of unwritten memory show.",
        epilog="examples:\n"
        "  python -c \"import numpy as np; np.save('x.npy', np.random.randn(2, 16).astype('float32'))\"\n"
        "  grace run model.grace --input x=x.npy\n"
        "  grace run model.grace --input x=x.npy --interpret --output out.npz\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    r.add_argument("package", metavar="MODEL.grace")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input (repeat per input)")
    r.add_argument("--output", metavar="OUT.npz", help="write all outputs to this .npz file")
    r.add_argument("--interpret", action="store_true", help="run on the CPU with Triton's interpreter (no GPU)")
    r.add_argument("--no-poison", action="store_true", help="do not fill the arena with NaN before running")
    r.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    _add_trust_flags(r)
    r.set_defaults(func=cmd_run)

    g = sub.add_parser(
        "generate",
        help="greedy token generation with a package compiled with --generate",
        description="Generate tokens greedily (argmax) from a prompt of token ids: a prefill run over the "
        "prompt, then the whole decode loop as one CUDA graph launch (a WHILE conditional node; no host "
        "round trip per token). Stops after --max-new-tokens or at --eos (included in the output). "
        "Prints the new ids and tokens/s; --output saves them as an int64 .npy file. --interpret runs the "
        "same kernels on the CPU with Triton's interpreter.",
        epilog="examples:\n"
        "  python -c \"import numpy as np; np.save('ids.npy', np.array([1, 15043, 29892]))\"\n"
        "  grace generate lm.grace --prompt ids.npy --max-new-tokens 32\n"
        "  grace generate lm.grace --prompt ids.npy --max-new-tokens 64 --eos 2 --output new.npy\n"
        "  grace generate lm.grace --prompt ids.npy --max-new-tokens 4 --interpret   # CPU\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    g.add_argument("package", metavar="MODEL.grace")
    g.add_argument("--prompt", required=True, metavar="IDS.npy", help="prompt token ids: 1-D or [1, P] integers")
    g.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="tokens to generate at most")
    g.add_argument("--eos", type=int, default=None, metavar="ID", help="stop after this token id")
    g.add_argument("--output", metavar="TOKENS.npy", help="write the new token ids (int64) to this .npy file")
    g.add_argument("--interpret", action="store_true", help="run on the CPU with Triton's interpreter (no GPU)")
    g.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    _add_trust_flags(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser(
        "bench",
        help="time a package on the GPU with random inputs",
        description="Time run() + sync on random inputs of the package's shapes/dtypes (numpy inputs, so the "
        "host-to-device copy is included). Prints median/p10/p90 ms per call, and the median host time of "
        "run() alone (without sync). GPU only.",
        epilog="examples:\n  grace bench model.grace\n  grace bench model.grace --iters 1000 --warmup 50\n"
        "  grace bench bert.grace --size seq=129     (a package with shape buckets)\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    b.add_argument("package", metavar="MODEL.grace")
    b.add_argument("--iters", type=int, default=100, help="timed calls (default 100)")
    b.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    b.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    b.add_argument("--size", action="append", default=[], metavar="NAME=VALUE",
                   help="value of a size symbol (repeatable; default: each at its maximum, which "
                   "runs the largest bucket)")
    _add_trust_flags(b)
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser(
        "verify",
        help="check a package's hashes and manifest",
        description="Read a package with full sha256 verification of every section and manifest validation, "
        "then check every kernel source against the Triton subset grace emits (what --interpret may run), "
        "and prove its graphs race-free: every two nodes whose memory overlaps, one writing, are ordered "
        "by edges, and kernels behind programmatic edges read only weights before gdc_wait() "
        "(docs/design-pdl.md). Reports the package's signature (SPEC §7): who signed it (key "
        "fingerprint) and whether it holds; a signature that does not hold is an error, and "
        "--trusted-key requires one by that key. Prints OK, or the problems found (exit 1).",
        epilog="examples:\n  grace verify model.grace\n"
        "  grace verify model.grace --trusted-key release.key.pub   # exit 1 unless signed by it\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    v.add_argument("package", metavar="MODEL.grace")
    _add_trust_flags(v, launch=False)
    v.set_defaults(func=cmd_verify)

    kg = sub.add_parser(
        "keygen",
        help="make an ed25519 key pair for signing packages",
        description="Make an ed25519 key pair (SPEC §7): the private key is written to KEY (PKCS#8 PEM, "
        "unencrypted, mode 0600; openssl reads it) and the public key to KEY.pub (one line: the base64 "
        "of the raw 32-byte key). Prints the public key and its fingerprint. Existing files are never "
        "overwritten. Keeping the private key safe is yours to do. Needs the [sign] extra (cryptography).",
        epilog="examples:\n  grace keygen -o release.key        # release.key, release.key.pub\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    kg.add_argument("-o", "--output", required=True, metavar="KEY", help="private key file to write")
    kg.set_defaults(func=cmd_keygen)

    sg = sub.add_parser(
        "sign",
        help="sign a package with an ed25519 key",
        description="Sign a package (SPEC §7): its structure (header and section index: every section's "
        "size and sha256, the manifest's sha256) is signed with the private key and the signature stored "
        "as the package's `signature` section, so the package stays one file and no byte of it can change "
        "without the signature failing. An existing signature is replaced. The package is verified first "
        "(a broken one is not signed). Loaders given --trusted-key (grace run, bench, generate; "
        "grace.runtime.load(..., trusted_keys=...); GRACE_TRUSTED_KEYS) then refuse any package not "
        "signed by a trusted key. Needs the [sign] extra (cryptography).",
        epilog="examples:\n  grace sign model.grace --key release.key                 # in place\n"
        "  grace sign model.grace --key release.key -o model.signed.grace\n"
        "  grace verify model.signed.grace --trusted-key release.key.pub\n",
        formatter_class=_Formatter,
        parents=[common],
    )
    sg.add_argument("package", metavar="MODEL.grace")
    sg.add_argument("--key", required=True, metavar="KEY", help="the private key (from `grace keygen`)")
    sg.add_argument("-o", "--output", metavar="OUT.grace", help="write the signed package here (default: "
                    "replace MODEL.grace, atomically)")
    sg.set_defaults(func=cmd_sign)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("grace: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - user errors become one line, bugs keep their traceback
        if args.traceback:
            raise
        rt = sys.modules.get("grace.runtime")
        no_dev = getattr(rt, "NoDeviceError", None) if rt is not None else None
        if isinstance(no_dev, type) and isinstance(e, no_dev):
            e = _no_device(e)
        if isinstance(e, CliError):
            code, msg = e.code, str(e)
        elif _is_user_error(e):
            code, msg = EXIT_ERROR, f"{type(e).__name__}: {e}"
        else:   # a bug: its traceback, then one line that says what happened
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            print(f"grace {args.command}: internal error (a bug in grace; please report it with the "
                  f"traceback above): {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
            return EXIT_ERROR
        print(f"grace {args.command}: error: {_one_line(msg)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
