"""The argument-table layout (SPEC.md §5): the one module that knows where the table words live.

A table *slot* describes one user tensor in `slot_words(rank) = 1 + 2*rank` 8-byte words: the data
pointer, then the sizes, then the strides (in elements). A slot starts at a 16-byte aligned offset
of the table. The *table words* are the words of every slot in slot order, then one word per size
symbol (the *extents*, stored back to back at `table.extents.offset`): word `first_words(ranks)[i]`
is slot i's data pointer and word `word_count(ranks, 0) + k` is symbol k. The table writer stores
table word j at int64 position `word_positions(...)[j]` of the table.

A reader takes the slot offsets and the extents offset from the manifest and relies only on the
rules above; `pack` is the layout the compiler chooses (slots back to back, then the extents, then
the optional error word of the index checks).

Pure Python without imports: the compiler, grace.formats, the torch-free runtime and the tools all
use it.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

WORD_NBYTES = 8    # every table word is one int64 / uint64
SLOT_ALIGN = 16    # slot offsets are multiples of this


def slot_words(rank: int) -> int:
    """Words of a slot of this rank: data pointer, `rank` sizes, `rank` strides."""
    return 1 + 2 * rank


def slot_nbytes(rank: int) -> int:
    """Bytes a slot of this rank occupies from its offset (a kernel's `table` range over it)."""
    return WORD_NBYTES * slot_words(rank)


def slot_values(ptr: int, shape, strides) -> list:
    """The words of one slot, in order: data pointer, sizes, strides."""
    return [ptr, *shape, *strides]


def first_words(ranks: Iterable[int]) -> list[int]:
    """The table-word index of each slot's data pointer (the words of all slots, in slot order)."""
    firsts, word = [], 0
    for rank in ranks:
        firsts.append(word)
        word += slot_words(rank)
    return firsts


def word_count(ranks: Iterable[int], n_symbols: int = 0) -> int:
    """Table words: every slot's words, then one per symbol."""
    return sum(slot_words(rank) for rank in ranks) + n_symbols


def word_positions(slots: Iterable[tuple[int, int]], extents_offset: int = 0,
                   n_symbols: int = 0) -> list[int]:
    """Where each table word goes, as an int64 index into the table: `slots` are (offset, rank)
    pairs in slot order (word j of a slot at offset + 8*j), then symbol k at extents_offset + 8*k."""
    positions = [offset // WORD_NBYTES + j for offset, rank in slots for j in range(slot_words(rank))]
    return positions + [extents_offset // WORD_NBYTES + k for k in range(n_symbols)]


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Layout(NamedTuple):
    """The compiler's table layout: byte offsets of the slots, of the extents and of the error
    word (None when the package has no index checks), and the table's size in bytes."""
    slot_offsets: tuple
    extents_offset: int
    errors_offset: int | None
    nbytes: int


def pack(ranks: Iterable[int], n_symbols: int, errors: bool = False) -> Layout:
    """Slots back to back, each at the next 16-byte boundary; the extents right after the last
    slot (so 16-aligned too); then, with `errors`, the one int64 error word; the table rounded up to
    16 bytes, at least 16."""
    offsets, offset = [], 0
    for rank in ranks:
        offsets.append(offset)
        offset = _align(offset + slot_nbytes(rank), SLOT_ALIGN)
    extents_offset = offset
    offset += WORD_NBYTES * n_symbols
    errors_offset = None
    if errors:   # 8-aligned: the extents start 16-aligned and are int64 words
        errors_offset = offset
        offset += WORD_NBYTES
    return Layout(tuple(offsets), extents_offset, errors_offset, max(_align(offset, SLOT_ALIGN), SLOT_ALIGN))
