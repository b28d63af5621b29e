"""A package file is written whole or not at all: `grace compile` and `grace sign` (and a crash
in between) leave either the old file or the new one at the path, never a torn one, and no
temporary file behind."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager


@contextmanager
def replacing(path, mode: int | None = None):
    """A binary file, open for reading and writing, that replaces `path` when the block ends
    without an error: written beside it under a temporary name (the same file system, so the
    rename is atomic), flushed to disk, then renamed over `path`. On an error the temporary file
    goes and `path` is as it was. `mode`: its permission bits; by default those open() would give
    a new file (0666 less the umask)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".grace",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w+b") as f:
            os.fchmod(f.fileno(), _new_file_mode() if mode is None else mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _new_file_mode() -> int:
    """0666 less the umask (mkstemp makes its file 0600). The umask comes from /proc where it
    can: reading it with os.umask sets it too, for a moment, for every thread of the process."""
    umask = None
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next((int(ln.split()[1], 8) for ln in status if ln.startswith("Umask:")), None)
    except (OSError, ValueError, IndexError):
        pass
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask
