"""Kernel sources from a package are data: only the Triton subset grace's codegen emits is ever run.

`--interpret` executes each kernel's `src/<kernel>.py` with Triton's interpreter, i.e. as Python on
this machine, and anyone can edit a package and recompute its hashes. So before a source is
imported it is parsed (`ast.parse` runs nothing) and checked against what aot/codegen.py,
aot/generation.py and the table writer produce:

  module      the imports `import triton`, `import triton.language as tl`,
              `from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait`, then one
              function decorated `@triton.jit` with plain positional parameters; nothing else
  statements  assignments and augmented assignments to plain names, expression statements that
              are calls, `for NAME in range(...)` or `tl.static_range(...)`, `if`, a bare `return`, `pass`
  expressions names (parameters, locals, `tl`, `range`, `float`, the two gdc functions; nothing
              that starts with an underscore), constants, arithmetic, comparisons, subscripts
              and slices, tuples and lists, calls of `tl.<name>` for the names in TL_NAMES, of
              `range`, `float` and the gdc functions, and of `.to(...)` on a value

Everything else (other imports, attribute access off the whitelist, builtins such as `open`,
dunder names, lambdas, comprehensions, nested functions, `while`, `with`, `try`) is refused with
the line and the reason. The whitelist is the codegen's vocabulary; tests/test_source_check.py
checks that every `tl.<name>` the compiler can emit is in it.
"""
from __future__ import annotations

import ast

# The triton.language names grace's code generators emit (plus `argmax`, used by handmade test
# packages). Adding a tl function to the codegen means adding it here.
TL_NAMES = frozenset("""
abs arange argmax bfloat16 broadcast_to ceil cos cumsum dot erf exp float16 float32 float64 floor
full int1 int16 int32 int64 int8 load log max maximum min minimum multiple_of pointer_type
program_id rsqrt sigmoid sin sqrt store sum uint8 where zeros
cumprod reshape atomic_add atomic_max atomic_min atomic_xchg debug_barrier log2 exp2 static_range
""".split())
GDC = ("gdc_launch_dependents", "gdc_wait")
CALLABLE_NAMES = frozenset({"range", "float", *GDC})
METHODS = frozenset({"to"})
_IMPORTS = {
    ast.dump(ast.parse("import triton").body[0]),
    ast.dump(ast.parse("import triton.language as tl").body[0]),
    ast.dump(ast.parse("from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait").body[0]),
}
_JIT = ast.dump(ast.parse("triton.jit", mode="eval").body)
_MAX_SOURCE = 4 << 20   # bytes; our largest kernels are a few KiB


class SourceRefused(ValueError):
    pass


def check_kernel_source(source: str) -> str:
    """Return the kernel function's name, or raise SourceRefused naming the first violation."""
    if len(source) > _MAX_SOURCE:
        raise SourceRefused(f"source is {len(source)} bytes, above the {_MAX_SOURCE}-byte limit")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise SourceRefused(f"source does not parse: {type(e).__name__}: {e}") from None
    fn = None
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) and ast.dump(stmt) in _IMPORTS and fn is None:
            continue
        if isinstance(stmt, ast.FunctionDef) and fn is None:
            fn = stmt
            continue
        raise SourceRefused(f"line {stmt.lineno}: only the triton imports and one @triton.jit "
                            "function may appear at module level")
    if fn is None:
        raise SourceRefused("no kernel function")
    if [ast.dump(d) for d in fn.decorator_list] != [_JIT]:
        raise SourceRefused(f"line {fn.lineno}: the kernel must be decorated with exactly @triton.jit")
    a = fn.args
    if a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or fn.returns or \
            any(arg.annotation for arg in a.args):
        raise SourceRefused(f"line {fn.lineno}: the kernel takes plain positional parameters only")
    _Checker({arg.arg for arg in a.args}).body(fn.body)
    return fn.name


class _Checker:
    def __init__(self, params: set):
        self.names = set(params) | {"tl"} | CALLABLE_NAMES
        for n in self.names:
            _plain(n, 0)

    def body(self, stmts):
        for s in stmts:
            self.stmt(s)

    def stmt(self, s):
        if isinstance(s, ast.Assign):
            self.expr(s.value)
            for t in s.targets:
                self.target(t)
        elif isinstance(s, ast.AugAssign):
            self.expr(s.value)
            self.target(s.target)
        elif isinstance(s, ast.Expr):
            if not isinstance(s.value, ast.Call):
                raise SourceRefused(f"line {s.lineno}: an expression statement must be a call")
            self.expr(s.value)
        elif isinstance(s, ast.For):
            it = s.iter
            plain = isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
            unrolled = (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                        and isinstance(it.func.value, ast.Name) and it.func.value.id == "tl"
                        and it.func.attr == "static_range")
            if s.orelse or not (plain or unrolled):
                raise SourceRefused(f"line {s.lineno}: loops must be `for NAME in range(...)` "
                                    "or `tl.static_range(...)`")
            self.expr(s.iter)
            self.target(s.target)
            self.body(s.body)
        elif isinstance(s, ast.If):
            self.expr(s.test)
            self.body(s.body)
            self.body(s.orelse)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                raise SourceRefused(f"line {s.lineno}: a kernel returns nothing")
        elif not isinstance(s, ast.Pass):
            raise SourceRefused(f"line {s.lineno}: {type(s).__name__} statements are not allowed")

    def target(self, t):
        if not isinstance(t, ast.Name):
            raise SourceRefused(f"line {t.lineno}: only plain names may be assigned")
        _plain(t.id, t.lineno)
        self.names.add(t.id)

    def expr(self, e):
        if isinstance(e, ast.Name):
            _plain(e.id, e.lineno)
            if e.id not in self.names:
                raise SourceRefused(f"line {e.lineno}: name {e.id!r} is neither a parameter, a "
                                    "local nor part of the kernel language")
        elif isinstance(e, ast.Constant):
            if not isinstance(e.value, (int, float, str, bool, type(None))):
                raise SourceRefused(f"line {e.lineno}: constant of type {type(e.value).__name__}")
        elif isinstance(e, ast.BinOp):
            self.expr(e.left)
            self.expr(e.right)
        elif isinstance(e, ast.UnaryOp):
            self.expr(e.operand)
        elif isinstance(e, ast.BoolOp):
            for v in e.values:
                self.expr(v)
        elif isinstance(e, ast.Compare):
            self.expr(e.left)
            for c in e.comparators:
                self.expr(c)
        elif isinstance(e, (ast.Tuple, ast.List)):
            for v in e.elts:
                self.expr(v)
        elif isinstance(e, ast.Subscript):
            self.expr(e.value)
            self.expr(e.slice)
        elif isinstance(e, ast.Slice):
            for part in (e.lower, e.upper, e.step):
                if part is not None:
                    self.expr(part)
        elif isinstance(e, ast.Attribute):
            self.attribute(e)
        elif isinstance(e, ast.Call):
            self.call(e)
        else:
            raise SourceRefused(f"line {e.lineno}: {type(e).__name__} expressions are not allowed")

    def attribute(self, e: ast.Attribute):
        if not (isinstance(e.value, ast.Name) and e.value.id == "tl" and e.attr in TL_NAMES):
            raise SourceRefused(f"line {e.lineno}: attribute {ast.unparse(e)!r} is not part of "
                                "the kernel language grace emits")

    def call(self, e: ast.Call):
        f = e.func
        if isinstance(f, ast.Name):
            if f.id not in CALLABLE_NAMES:
                raise SourceRefused(f"line {e.lineno}: call of {f.id!r} is not allowed")
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl":
            self.attribute(f)
        elif isinstance(f, ast.Attribute) and f.attr in METHODS:
            self.expr(f.value)
        else:
            raise SourceRefused(f"line {e.lineno}: call of {ast.unparse(f)!r} is not allowed")
        for arg in e.args:
            if isinstance(arg, ast.Starred):
                raise SourceRefused(f"line {e.lineno}: *args are not allowed")
            self.expr(arg)
        for kw in e.keywords:
            if kw.arg is None:
                raise SourceRefused(f"line {e.lineno}: **kwargs are not allowed")
            _plain(kw.arg, e.lineno)
            self.expr(kw.value)


def _plain(name: str, line: int) -> None:
    if name.startswith("_"):
        raise SourceRefused(f"line {line}: names starting with '_' are not allowed ({name!r})")
