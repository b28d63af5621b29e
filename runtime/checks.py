"""Index checks (format 3.3, SPEC §5.4): how an out-of-range gather index reaches the caller.

Every gather of the package clamps its indices into its table on the device, and a kernel that saw
one out of range stores that gather's code into one int64 word of the session's table
(`table.errors`). The session zeroes the word when it is made and reads it at every synchronising
point; `IndexChecks.error(code)` turns a nonzero word into the error to raise. The CPU reference
executor (grace.tools.interpret) uses the same class, so both report the same message.
"""

from __future__ import annotations

from grace.formats.view import as_view

from .errors import IndexOutOfRangeError, InvalidPackageError


class IndexChecks:
    """`offset`: the error word's byte offset in the table; `by_code`: code -> its index check
    (a formats.view.IndexCheck)."""

    def __init__(self, offset: int, checks):
        self.offset = int(offset)
        self.by_code = {int(c.code): c for c in checks}

    def error(self, code: int, values: dict | None = None) -> Exception:
        """The error for a nonzero error word. `values` ({symbol name: value}, optional) turns a
        dynamic table size into a number."""
        check = self.by_code.get(int(code))
        if check is None:
            return InvalidPackageError(
                f"the table's error word holds {code}, which no index check of the package lists "
                f"(codes {sorted(self.by_code)}): a kernel of the package is wrong")
        name, op, where = check.input, check.op, check.where
        who = f"input {name!r}" if name is not None else "an index computed in the model"
        size = _size_text(check.size, values)
        neg = size if size.isidentifier() or size.isdigit() else f"({size})"
        at = f" ({where})" if where else ""
        return IndexOutOfRangeError(
            f"{who}: an index is outside [-{neg}, {size}) in {op}{at}; the outputs of the runs since "
            "the last check read clamped rows", input=name, op=op, where=where, code=int(code))


def plan_index_checks(manifest) -> IndexChecks | None:
    """The package's index checks, or None when it has none (no word to read; checks without a
    `table.errors` word do not pass validation). `manifest`: a formats.view.Manifest, or a
    manifest dict (validated first)."""
    m = as_view(manifest)
    if not m.index_checks:
        return None
    return IndexChecks(m.table.errors_offset, m.index_checks)


def _size_text(size, values) -> str:
    """The table size: a number, or its shape expression (evaluated when `values` has its symbols)."""
    if isinstance(size, int):
        return str(size)
    from grace.formats.shapes import eval_shape_expr, format_shape_expr

    if values:
        try:
            return str(eval_shape_expr(size, values))
        except Exception:  # a symbol without a value: keep the expression
            pass
    return format_shape_expr(size)
