"""Sparse-matrix BM25 that scores exactly as `rank_bm25.BM25Okapi`.

Every (chunk, term) weight `idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / avglen))` is
computed once when the index is built and stored column-wise (CSC), so a query only adds up the
posting columns of its terms. The IDF follows rank-bm25 to the letter: `ln(N - df + 0.5) -
ln(df + 0.5)`, and a term whose IDF is negative gets `epsilon * average_idf` instead, the average
taken over every term of the index before that floor.

`max_score` gives the highest score a query could reach, for normalising scores across queries
(the relevance gate): a term's weight `idf * tf * (k1 + 1) / (tf + norm)` tends to
`idf * (k1 + 1)` as its count `tf` grows, and is best left at 0 (tf = 0) when its IDF is
negative, so the sum over the query's terms of `max(idf, 0) * (k1 + 1)` bounds every score.

A query's tokens may carry weights (a follow-up question's own words at 1, the earlier turns'
words lower): a token's weight multiplies what it adds, so the score is the weighted sum of
rank-bm25's single-token scores, and without weights it is rank-bm25's score exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
from scipy import sparse

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
ScoreArray = npt.NDArray[np.float32]


def count_terms(token_lists: Iterable[Sequence[str]], vocab: dict[str, int]) -> sparse.csr_array:
    """Term-count matrix (rows: passages, columns: `vocab` ids); new terms are added to vocab."""
    rows: list[int] = []
    cols: list[int] = []
    n = 0
    for n, tokens in enumerate(token_lists, start=1):
        for token in tokens:
            cols.append(vocab.setdefault(token, len(vocab)))
        rows.extend([n - 1] * len(tokens))
    data = np.ones(len(cols), dtype=np.int32)
    coo = sparse.coo_array(
        (data, (np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64))),
        shape=(n, len(vocab)),
    )
    return _canonical(coo.tocsr())


def stack_rows(parts: Sequence[sparse.csr_array], n_terms: int) -> sparse.csr_array:
    """Stack term-frequency matrices built against growing versions of one vocabulary."""
    widened = [
        sparse.csr_array((p.data, p.indices, p.indptr), shape=(p.shape[0], n_terms)) for p in parts
    ]
    return _canonical(sparse.vstack(widened, format="csr"))


def drop_unused_terms(tf: sparse.csr_array, terms: list[str]) -> tuple[sparse.csr_array, list[str]]:
    """Remove the terms no passage holds any more, so IDF averages over live terms only."""
    used = np.zeros(len(terms), dtype=np.bool_)
    used[tf.indices] = True
    if used.all():
        return tf, terms
    remap = np.cumsum(used) - 1
    compact = sparse.csr_array(
        (tf.data, remap[tf.indices].astype(np.int32), tf.indptr),
        shape=(tf.shape[0], int(used.sum())),
    )
    return compact, [t for t, keep in zip(terms, used, strict=True) if keep]


def _canonical(m: sparse.csr_array | sparse.coo_array) -> sparse.csr_array:
    csr = sparse.csr_array(m)
    csr.sum_duplicates()
    csr.indices = csr.indices.astype(np.int32, copy=False)
    csr.data = csr.data.astype(np.int32, copy=False)
    return csr


class BM25Index:
    """BM25 weights of a fixed set of passages, scored by term-id queries.

    `tf` is the passages x terms matrix of term counts; `vocab` maps a token to its column.
    """

    def __init__(
        self,
        tf: sparse.csr_array,
        vocab: dict[str, int],
        *,
        k1: float = 1.5,
        b: float = 0.75,
        epsilon: float = 0.25,
    ) -> None:
        self.vocab = vocab
        self.k1 = k1
        self.size = int(tf.shape[0])
        n_terms = int(tf.shape[1])
        csc = sparse.csc_array(tf)
        csc.sum_duplicates()
        self._indptr = csc.indptr.astype(np.int64)
        self._rows = csc.indices.astype(np.int32)
        if self.size == 0:
            self._weights = np.zeros(0, dtype=np.float32)
            self.idf = np.zeros(n_terms)
            self._nonpositive = False
            return
        doc_len = np.asarray(tf.sum(axis=1), dtype=np.float64).ravel()
        avgdl = float(doc_len.sum()) / self.size
        df = np.diff(self._indptr).astype(np.float64)
        live = df > 0
        idf = np.log(self.size - df + 0.5) - np.log(df + 0.5)
        average_idf = float(idf[live].mean()) if live.any() else 0.0
        idf[live & (idf < 0)] = epsilon * average_idf
        idf[~live] = 0.0
        self.idf = idf
        freq = csc.data.astype(np.float64)
        norm = k1 * (1 - b + b * doc_len[self._rows] / avgdl) if avgdl > 0 else k1 * (1 - b)
        term_of_entry = np.repeat(np.arange(n_terms), np.diff(self._indptr))
        self._weights = (idf[term_of_entry] * freq * (k1 + 1) / (freq + norm)).astype(np.float32)
        # With every IDF positive, a score is > 0 exactly when the passage holds a query term,
        # which spares tracking the matched passages separately.
        self._nonpositive = bool((idf[live] <= 0).any())

    @property
    def nbytes(self) -> int:
        """Memory held by the posting arrays."""
        return int(self._indptr.nbytes + self._rows.nbytes + self._weights.nbytes + self.idf.nbytes)

    def term_ids(self, tokens: Sequence[str]) -> Counter[int]:
        """Query tokens -> {term id: times it occurs}; tokens the index has never seen drop out."""
        return Counter(self.vocab[t] for t in tokens if t in self.vocab)

    def term_weights(
        self, tokens: Sequence[str], weights: Sequence[float] | None = None
    ) -> dict[int, float]:
        """Query tokens -> {term id: the sum of its occurrences' weights} (`weights` parallel to
        `tokens`, each positive; None: 1 each, the times it occurs, as `term_ids`); unseen tokens
        drop out."""
        if weights is None:
            return dict(self.term_ids(tokens))
        if len(weights) != len(tokens):
            raise ValueError("weights must be parallel to tokens")
        total: dict[int, float] = {}
        for token, weight in zip(tokens, weights, strict=True):
            if not 0.0 < weight < math.inf:
                raise ValueError("query token weights must be positive and finite")
            term = self.vocab.get(token)
            if term is not None:
                total[term] = total.get(term, 0.0) + weight
        return total

    @property
    def unseen_idf(self) -> float:
        """The IDF a term no passage holds would get by the same formula (df = 0): the rarest
        possible term, so a query word the index lacks weighs as much as the rarest word in it."""
        return float(np.log(self.size + 0.5) - np.log(0.5)) if self.size else 0.0

    def max_score(
        self,
        tokens: Sequence[str],
        weights: Sequence[float] | None = None,
        *,
        count_unseen: bool = True,
    ) -> float:
        """The supremum of `scores(tokens)` over any passage: the sum, over the query's terms
        (a repeated term counts as often as it repeats, as in `scores`), of
        `max(idf, 0) * (k1 + 1)`, the limit of a term's weight as its count in a passage grows
        (a term with a negative IDF, possible in an index of two or three passages, can only
        lower a score). 0 when no query term can raise a score.

        With `count_unseen`, query tokens the index has never seen are added at `unseen_idf`:
        no passage can match them, so a query made mostly of such words cannot score near the
        maximum (the capital of France against medical abstracts). Without it they are ignored.
        With `weights` (as in `scores`), each token counts at its weight.
        """
        total = sum(
            max(float(self.idf[term]), 0.0) * times
            for term, times in self.term_weights(tokens, weights).items()
        )
        if count_unseen:
            each = [1.0] * len(tokens) if weights is None else weights
            total += self.unseen_idf * sum(
                w for t, w in zip(tokens, each, strict=True) if t not in self.vocab
            )
        return total * (self.k1 + 1)

    def idf_of(self, tokens: Iterable[str]) -> dict[str, float]:
        """IDF of each known token (unknown tokens are left out)."""
        return {t: float(self.idf[self.vocab[t]]) for t in tokens if t in self.vocab}

    def scores(
        self, tokens: Sequence[str], weights: Sequence[float] | None = None
    ) -> tuple[ScoreArray, BoolArray]:
        """BM25 score of every passage, and which passages hold at least one query term.

        `weights`, parallel to `tokens`, scale what each token adds (None: 1 each, rank-bm25's
        score); each must be positive, or a passage holding the token would not count as matched."""
        score = np.zeros(self.size, dtype=np.float32)
        touched: BoolArray | None = (
            np.zeros(self.size, dtype=np.bool_) if self._nonpositive else None
        )
        for term, times in self.term_weights(tokens, weights).items():
            start, end = self._indptr[term], self._indptr[term + 1]
            rows = self._rows[start:end]
            posting = self._weights[start:end]
            # Rows are unique within a column, so fancy-index += adds each weight once.
            score[rows] += posting * times if times != 1 else posting
            if touched is not None:
                touched[rows] = True
        if touched is None:
            touched = score > 0
        return score, touched
