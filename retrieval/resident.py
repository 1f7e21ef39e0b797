"""What a loaded snapshot holds in memory, counted from its objects.

A snapshot's size on disk says little of what it holds once loaded: JSON's `"ab",` is 5 bytes
on disk and 59 as a Python string and its list slot, and a filtered search later builds
columns and views that are not on disk at all. The loaded-snapshot budget
(`RAG_RETRIEVAL__LOADED_INDEXES_MB`) counts these figures instead.

The counts are `sys.getsizeof` of the objects a snapshot is made of, walked by their known
shapes (a generic walk of every object cost 40 times more on dense metadata, and reading an
object's `__dict__` would grow it), plus the buffers of numpy arrays and FAISS indexes. They
leave out the allocator's own overhead; BENCHMARKS.md compares them with what tracemalloc
and the resident set see.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrieval.access import AccessList
    from retrieval.documents import Metadata

_getsizeof = sys.getsizeof
_INT_BYTES = _getsizeof(2**20)
_SHARED_INTS = 257  # 0 to 256 are the interpreter's own, made once
_ASCII_BYTES = _getsizeof("")  # an ASCII string's header and closing NUL
_RUN = 4096


def strings_bytes(values: Sequence[object]) -> int:
    """Bytes of the objects in `values` (strings), each occurrence counted (their list is not).
    A string beyond ASCII is counted with the UTF-8 copy CPython keeps inside it once
    something reads it as UTF-8 (orjson writing it into a response, the tokenizer): up to 3x
    its size, and served texts, titles and ids do get it (a review's find: counted at load
    without it, 1,000 sources with Latin-1 titles held 1.6x their count once served). The
    store counts a snapshot when it is loaded, before any search; one that has the copy
    already is counted twice (telling which have it tripled the cost of the whole count)."""
    total = sum(map(_getsizeof, values))
    to_come = [s for s in values if type(s) is str and not s.isascii()]
    if to_come:
        # The UTF-8 of a joined text is the UTF-8 of its parts, end to end; and a NUL each.
        total += len("".join(to_come).encode("utf-8", "surrogatepass")) + len(to_come)
    return total


def short_strings_bytes(values: Sequence[object]) -> int:
    """`strings_bytes` of many short strings (names, terms). A run of ASCII strings is counted
    from its joined length (an ASCII string is a fixed header and a byte a character, and is
    its own UTF-8): six times faster than asking each one. A few thousand at a time, so the
    joined text stays small."""
    if len(values) <= _RUN:
        return _run_bytes(values)
    return sum(_run_bytes(values[at : at + _RUN]) for at in range(0, len(values), _RUN))


def _run_bytes(values: Sequence[object]) -> int:
    try:
        joined = "".join(values)  # type: ignore[arg-type]  # not all strings: TypeError
    except TypeError:
        return strings_bytes(values)  # a damaged file's values: counted one by one
    if joined.isascii():
        return _ASCII_BYTES * len(values) + len(joined)
    return strings_bytes(values)


def range_ints_bytes(n: int) -> int:
    """Bytes of the int objects 0 to n-1 made one each (a vocabulary's column numbers, a
    document's row numbers): those past the shared small ints."""
    return max(0, n - _SHARED_INTS) * _INT_BYTES


def metadata_bytes(metadata: Sequence[Metadata]) -> int:
    """Bytes of a snapshot's metadata dicts and their values. A dict that several chunks share
    (a document's, before a reload) is counted once, and so is a key's string that several
    share (a JSON parse shares a key's string among the objects it makes)."""
    unique = {id(meta): meta for meta in metadata}.values()
    total = sum(map(_getsizeof, unique))
    keys: list[str] = []
    for meta in filter(None, unique):
        if not isinstance(meta, dict):  # a damaged file's (read_snapshot refuses it)
            continue
        keys.extend(meta)
        for value in meta.values():
            if isinstance(value, list):
                total += _getsizeof(value) + short_strings_bytes(value)
            elif not isinstance(value, bool):
                total += _getsizeof(value)
    return total + short_strings_bytes(list(dict(zip(map(id, keys), keys, strict=True)).values()))


def access_bytes(lists: Sequence[AccessList | None]) -> int:
    """Bytes of a snapshot's access lists: each object (its two attributes' slots), its two
    sets and their names; one that several chunks share is counted once."""
    total = 0
    for entry in {id(entry): entry for entry in lists if entry is not None}.values():
        total += _getsizeof(entry) + 32  # its attributes' values (no `__dict__` until asked)
        for names in (entry.groups, entry.users):
            total += _getsizeof(names) + short_strings_bytes(list(names))
    return total


def faiss_bytes(index: Any) -> int:
    """What a FAISS index holds: its codes, and an HNSW graph's links and levels."""
    import faiss

    total = 0
    storage = getattr(index, "storage", None)
    if storage is not None:
        storage = faiss.downcast_index(storage)
    codes = getattr(storage if storage is not None else index, "codes", None)
    if codes is not None:
        total += int(codes.size())
    hnsw = getattr(index, "hnsw", None)
    if hnsw is not None:
        total += 4 * int(hnsw.neighbors.size()) + 4 * int(hnsw.levels.size())
        total += 8 * int(hnsw.offsets.size())
    return total
