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


def read_snapshot(directory: Path) -> TenantIndex:
    """Load a snapshot written by `write_snapshot`."""
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
    return TenantIndex(meta["version"], records, vectors, tf, terms, approximate)
