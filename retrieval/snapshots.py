"""A snapshot on disk: one directory per version, written completely and fsynced before it is
published, read back with the vectors memory-mapped (so replicas on one host share the pages).

    meta.json      format, version, counts (written last: a directory without it is incomplete)
    chunks.json    the chunk records, column-wise
    vectors.npy    float32 (chunks x 384)
    tf.npz         the chunks x terms count matrix (CSR arrays)
    terms.json     the term of each column
    dense.faiss    the HNSW index, only above the approximate-search threshold
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse

from retrieval.access import access_from_json
from retrieval.index import ChunkRecords, TenantIndex
from retrieval.vectors import read_index, write_index

FORMAT = 1


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    _fsync_file(path)


def _write_json(path: Path, value: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))


def write_snapshot(index: TenantIndex, directory: Path) -> None:
    """Write `index` into the (new, empty) `directory` and fsync everything in it."""
    directory.mkdir(parents=True)
    records = index.records
    _write_json(
        directory / "chunks.json",
        {
            "chunk_id": records.chunk_id,
            "document_id": records.document_id,
            "text": records.text,
            "title": records.title,
            "metadata": records.metadata,
            # Absent in snapshots written before access lists: every chunk tenant-visible.
            "access": [None if a is None else a.to_json() for a in records.access],
        },
    )
    np.save(directory / "vectors.npy", np.ascontiguousarray(index.vectors, dtype=np.float32))
    tf = index.tf
    np.savez(
        directory / "tf.npz",
        data=tf.data,
        indices=tf.indices,
        indptr=tf.indptr,
        shape=np.array(tf.shape, dtype=np.int64),
    )
    _write_json(directory / "terms.json", index.terms)
    if index.approximate is not None:
        write_index(index.approximate, directory / "dense.faiss")
    _write_json(
        directory / "meta.json",
        {
            "format": FORMAT,
            "version": index.version,
            "chunks": len(index),
            "documents": index.documents,
            "dimension": int(index.vectors.shape[1]),
        },
    )
    for path in directory.iterdir():
        _fsync_file(path)
    fsync_dir(directory)


class IndexUnreadable(RuntimeError):
    """A tenant's published snapshot cannot be read: damaged (a partial copy, a disk that
    filled), or written in a format this code does not know. A 503 ``index_unreadable`` for a
    request (``pipeline.sources.search``); the message names no path (the log does)."""

    def __init__(self, tenant: str, version: str) -> None:
        super().__init__(
            f"The index of tenant '{tenant}' (version {version[:40]!r}) cannot be read on this "
            "server; retry later."
        )
        self.tenant = tenant
        self.version = version


def read_snapshot(directory: Path) -> TenantIndex:
    """Load a snapshot written by `write_snapshot`; ValueError (or what the parser raised)
    for one that is not whole or not consistent."""
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory}: unknown snapshot format {meta.get('format')!r}")
    with (directory / "chunks.json").open(encoding="utf-8") as f:
        columns = json.load(f)
    records = ChunkRecords(
        columns["chunk_id"],
        columns["document_id"],
        columns["text"],
        columns["title"],
        columns["metadata"],
        [access_from_json(a) for a in columns.get("access", [])],
    )
    vectors = np.load(directory / "vectors.npy", mmap_mode="r")
    with np.load(directory / "tf.npz") as npz:
        n_rows, n_terms = (int(x) for x in npz["shape"])
        tf = sparse.csr_array((npz["data"], npz["indices"], npz["indptr"]), shape=(n_rows, n_terms))
    terms = json.loads((directory / "terms.json").read_text(encoding="utf-8"))
    dense_path = directory / "dense.faiss"
    approximate = read_index(dense_path) if dense_path.exists() else None
    _check(meta, records, vectors, tf, terms)
    return TenantIndex(meta["version"], records, vectors, tf, terms, approximate)


def _check(meta: dict[str, Any], records: ChunkRecords, vectors: Any, tf: Any, terms: Any) -> None:
    """What must hold of a whole snapshot, checked once at load (cheap: shapes and types), so
    that damage is found here rather than by every search after it."""
    chunks = len(records.chunk_id)
    columns = (records.document_id, records.text, records.title, records.metadata)
    if meta.get("chunks", chunks) != chunks or any(len(column) != chunks for column in columns):
        raise ValueError("the chunk columns do not agree with each other or with meta.json")
    if not all(isinstance(text, str) for text in (*records.chunk_id, *records.text)):
        raise ValueError("a chunk's id or text is not a string")
    if not all(title is None or isinstance(title, str) for title in records.title):
        raise ValueError("a chunk's title is not a string")
    if not all(isinstance(metadata, dict) for metadata in records.metadata):
        raise ValueError("a chunk's metadata is not an object")
    if vectors.ndim != 2 or vectors.shape[0] != chunks:
        raise ValueError(f"vectors of shape {vectors.shape} for {chunks} chunks")
    if vectors.shape[1] != meta.get("dimension", vectors.shape[1]):
        raise ValueError(f"vectors of dimension {vectors.shape[1]}, not meta.json's")
    if not isinstance(terms, list) or tf.shape != (chunks, len(terms)):
        raise ValueError("the term frequencies do not agree with the terms or the chunks")
