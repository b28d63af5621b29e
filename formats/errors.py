"""Typed errors for reading and writing `.grace` packages.

Every rule in SPEC.md maps to one of these classes, so callers (the runtime, `grace inspect`, tests)
can tell a truncated download from a corrupted byte from a package built by a newer compiler without
parsing messages. All of them are ValueErrors: a bad package is bad input, never a bug in the reader,
and nothing else (IndexError, struct.error, msgpack exceptions) may escape a read.
"""


class FormatError(ValueError):
    """A `.grace` package (or a part of one) breaks a rule of SPEC.md."""


class BadMagicError(FormatError):
    """The bytes do not start with the `.grace` magic: not a package at all."""


class UnsupportedVersionError(FormatError):
    """The package's major format version is not one this reader understands."""


class TruncatedError(FormatError):
    """The header points at bytes that are not there (a cut-off file or a lying length)."""


class ChecksumError(FormatError):
    """A stored sha256 does not match the bytes it covers; the message names the section."""


class ManifestError(FormatError):
    """The manifest decodes but breaks the schema; the message gives the path of the bad field."""
