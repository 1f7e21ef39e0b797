"""Counting tokens as the generation model does: the SmolLM2 tokenizer, loaded once.

The tokenizer is the `tokenizer.json` of the model directory vLLM serves (built under
`$RAG_HOME/models` by `make model`). Where none can be found, an approximate counter stands in
and `load_token_counter` logs a warning saying so: budgets then hold only approximately.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import regex
from tokenizers import Tokenizer

from pipeline.kept import Kept, KeptByScope

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
MODEL_PREFIX = "smollm2-135m-instruct"
# scripts/build_model.py writes this file last, so a directory without it is a half-built one.
COMPLETE_MARKER = ".rag-complete"


class TokenCounter(Protocol):
    """Counts tokens of text; `exact` says whether the counts are the model's own. Hashable
    (compress caches per-passage work per counter).

    `for_scope(scope)` is the counter a request counts with, ``scope`` its memo scope (its
    tenant, and its access scope where the tenant's index has access lists:
    ``pipeline.model.salt.MemoScope``): what a counter keeps to count faster (pieces seen
    before) is kept for each scope apart, since a text counted sooner would say that another
    scope's text held its words (SECURITY.md)."""

    def __hash__(self) -> int: ...

    def for_scope(self, scope: str) -> TokenCounter: ...

    @property
    def exact(self) -> bool: ...

    @property
    def source(self) -> str: ...

    def count(self, text: str) -> int: ...

    def count_many(self, texts: Sequence[str]) -> list[int]: ...

    def token_runs(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """For each text, where runs of its tokens start (character offsets, ascending) and
        how many tokens each run holds; a token belongs to the run it starts in."""
        ...


# GPT-2's pre-tokenisation, which byte-level BPE tokenizers (SmolLM2's among them) apply before
# BPE: the text is cut into these pieces and each piece is encoded on its own.
_GPT2_PIECES = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
PIECE_CACHE_SIZE = 200_000
# And at most this many characters in all: 200,000 pieces of 64 astral letters (a caller's
# texts, counted even when refused) held 125 MB, each a 4-byte-a-letter string with its UTF-8
# copy; ordinary pieces average about five characters, so the count bounds them first.
PIECE_CACHE_CHARS = 2_000_000
# Longer pieces are counted and not kept: a piece is a run of letters of any length (a caller's
# 60,000-letter "word" kept 59 KiB a request, up to 11 GiB at the cache's size; refused
# requests too, since inputs are counted before the limit is checked). Real words are shorter.
LONGEST_CACHED_PIECE = 64


def _is_gpt2_byte_level(tokenizer: Tokenizer) -> bool:
    config = json.loads(tokenizer.to_str())
    pre = config.get("pre_tokenizer") or {}
    return (
        config.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and (config.get("model") or {}).get("type") == "BPE"
        and not (config.get("model") or {}).get("dropout")
    )


class ModelTokenCounter:
    """Exact counts from a Hugging Face `tokenizers` tokenizer (special tokens not added).

    For a byte-level BPE tokenizer (SmolLM2's), the count of a text is the sum of the counts of
    its GPT-2 pieces, each piece encoded on its own; pieces recur across requests (words with
    their leading space), so their counts are kept in a bounded dict and a text is counted with
    one regex pass and dict lookups, the tokenizer running only on pieces not seen before. Text
    holding one of the tokenizer's added tokens (`<|im_start|>`, ...) goes to the tokenizer
    whole. tests/pipeline/test_compress.py checks both ways agree.
    """

    exact = True

    def __init__(
        self, tokenizer: Tokenizer, source: str, *, vocabulary: Mapping[str, int] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source
        # The tokenizer's own BPE cache keeps the first 10,000 words it meets, for ever, and a
        # caller's 250-character runs of punctuation made them 166 MB (8 KB each). The pieces'
        # counts are kept here, bounded, so the tokenizer keeps none (SciFact's abstracts are
        # counted as fast without it: bench.memo_memory's "bpe" row).
        resize = getattr(tokenizer.model, "_resize_cache", None)
        if resize is not None:
            resize(0)
        self.piecewise = _is_gpt2_byte_level(tokenizer)
        # Each memo scope's pieces (None: counts made for no request, by tools and benchmarks),
        # within one bound for all: PIECE_CACHE_SIZE pieces, PIECE_CACHE_CHARS characters.
        self.pieces: KeptByScope[int] = KeptByScope(PIECE_CACHE_SIZE, PIECE_CACHE_CHARS)
        # The pieces that are a token of the model's vocabulary, with their counts
        # (`vocabulary_pieces`): the same for every caller, since they hold nothing of any, so a
        # piece a scope has not kept yet is looked up here before the tokenizer runs. SmolLM2's
        # 48,817 cover 87% of the pieces in SciFact's text (BENCHMARKS.md).
        if vocabulary is None:
            vocabulary = vocabulary_pieces(tokenizer) if self.piecewise else {}
        # A copy, read-only: never added to, and no caller holds the dict behind it.
        self.vocabulary: Mapping[str, int] = MappingProxyType(dict(vocabulary))
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        self._added = re.compile("|".join(map(re.escape, added))) if added else None

    @classmethod
    def from_file(cls, path: Path) -> ModelTokenCounter:
        """Load a `tokenizer.json`; its vocabulary's pieces are worked out once a process for
        each file content (`_shared_vocabulary`)."""
        data = path.read_bytes()
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        counter = cls(tokenizer, str(path), vocabulary={})
        if counter.piecewise:
            counter.vocabulary = _shared_vocabulary(hashlib.sha256(data).hexdigest(), tokenizer)
        return counter

    def for_scope(self, scope: str) -> ScopedTokenCounter:
        return ScopedTokenCounter(self, scope)

    def count(self, text: str) -> int:
        return self.count_many([text])[0]

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [sum(counts) for _, counts in self.token_runs(texts)]

    def count_with_tokenizer(self, texts: Sequence[str]) -> list[int]:
        """Counts from the tokenizer itself, whole texts at once (the reference)."""
        encoded = self.tokenizer.encode_batch_fast(
            [_encodable(t) for t in texts], add_special_tokens=False
        )
        return [len(e.ids) for e in encoded]

    def token_runs(
        self, texts: Sequence[str], *, scope: str | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """``scope``: whose pieces to read and keep (a request's memo scope; see `for_scope`)."""
        cleaned = [_encodable(t) for t in texts]
        piecewise = self.piecewise
        added = self._added
        whole = [i for i, t in enumerate(cleaned) if not piecewise or (added and added.search(t))]
        runs: dict[int, tuple[list[int], list[int]]] = {}
        if whole:
            encoded = self.tokenizer.encode_batch(
                [cleaned[i] for i in whole], add_special_tokens=False
            )
            for i, e in zip(whole, encoded, strict=True):
                runs[i] = ([start for start, _ in e.offsets], [1] * len(e.ids))
        pieces = {i: _GPT2_PIECES.findall(t) for i, t in enumerate(cleaned) if i not in runs}
        counts = self._piece_counts({p for ps in pieces.values() for p in ps}, scope)
        for i, ps in pieces.items():
            starts = list(itertools.accumulate(map(len, ps[:-1]), initial=0)) if ps else []
            runs[i] = (starts, list(map(counts.__getitem__, ps)))
        return [runs[i] for i in range(len(cleaned))]

    def _piece_counts(self, pieces: set[str], scope: str | None) -> Mapping[str, int]:
        """A count for every piece in `pieces`: the scope's kept counts (pieces up to
        `LONGEST_CACHED_PIECE` characters), before those worked out now."""
        cache = self.pieces.words(scope)
        missing = [p for p in pieces if p not in cache]
        if not missing:
            return cache
        # The vocabulary's pieces are kept for the scope too: the next request's lookups stay
        # in one dict, and one let go is found again as cheaply.
        vocabulary = self.vocabulary
        kept = [(p, vocabulary[p]) for p in missing if p in vocabulary]
        if kept:
            missing = [p for p in missing if p not in vocabulary]
        encoded = (
            self.tokenizer.encode_batch_fast(missing, add_special_tokens=False) if missing else []
        )
        long: dict[str, int] = {}
        for piece, n in zip(missing, (len(e.ids) for e in encoded), strict=True):
            if len(piece) <= LONGEST_CACHED_PIECE:
                kept.append((piece, n))
            else:
                long[piece] = n
        self.pieces.add(scope, kept)
        # What this call read stays in `cache` (a dict let go is never emptied).
        return ChainMap(long, dict(kept), cache)

    def kept_pieces(self, scope: str | None) -> dict[str, int]:
        """The pieces kept for ``scope`` (a copy)."""
        return self.pieces.kept(scope)


@dataclass(frozen=True)
class ScopedTokenCounter:
    """A `ModelTokenCounter` as the requests of one memo scope count with it: the same counts,
    from the pieces kept for that scope. Equal to another for the same counter and scope (compress's
    per-passage cache is keyed by counter)."""

    counter: ModelTokenCounter
    scope: str

    exact = True

    @property
    def source(self) -> str:
        return self.counter.source

    def for_scope(self, scope: str) -> TokenCounter:
        return self if scope == self.scope else self.counter.for_scope(scope)

    def count(self, text: str) -> int:
        return self.count_many([text])[0]

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [sum(counts) for _, counts in self.token_runs(texts)]

    def token_runs(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        return self.counter.token_runs(texts, scope=self.scope)


def vocabulary_pieces(tokenizer: Tokenizer) -> dict[str, int]:
    """Each token of ``tokenizer``'s vocabulary that is a whole piece of GPT-2's
    pre-tokenisation (``" the"``, ``" flightless"``, ``"ing"``; up to `LONGEST_CACHED_PIECE`
    characters), with its count as the tokenizer encodes it alone: a count is the tokenizer's
    own, whatever the tokenizer. SmolLM2's 49,152 tokens give 48,817 pieces in about 0.4 s, all
    of 1 token but two: a token that is one byte of a longer character decodes to U+FFFD, whose
    text counts what it counts (``" \ufffd"``: 2)."""
    ids = sorted(tokenizer.get_vocab(with_added_tokens=False).values())
    texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
    pieces = sorted(
        {t for t in texts if 0 < len(t) <= LONGEST_CACHED_PIECE and _GPT2_PIECES.findall(t) == [t]}
    )
    encoded = tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
    return {piece: len(e.ids) for piece, e in zip(pieces, encoded, strict=True)}


# The vocabulary pieces of the tokenizer files loaded, by their contents' SHA-256 (a file
# replaced in place, its size and time kept, is never given another's; a review's find), each
# read-only and shared by the counters of that content: worked out once a process (the service,
# and a test run's many apps, load the same file again; two loads at once may each work it
# out). The last four contents only.
_VOCABULARIES: Kept[str, Mapping[str, int]] = Kept(4)


def _shared_vocabulary(digest: str, tokenizer: Tokenizer) -> Mapping[str, int]:
    return _VOCABULARIES.remembered(digest, lambda: MappingProxyType(vocabulary_pieces(tokenizer)))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str) -> str:
    """`text` with lone surrogates (which a JSON body can carry, and which the Rust tokenizer
    refuses) replaced by U+FFFD, one code point for one, so character offsets still hold."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


_PIECE = re.compile(r"[A-Za-z]+|[0-9]|\s+|[^\sA-Za-z0-9]")


class ApproximateTokenCounter:
    """A stand-in when no tokenizer file is found; errs high, so a budget is rarely exceeded.

    Latin letters: one token per started 4 letters of a word; each digit, each punctuation mark
    and each other character one token, two past U+0800 (CJK and most other scripts); a single
    space before a word folds into it, and any other whitespace counts one token per started 4
    characters, so that no character class passes an input-token cap for free (40,000 newlines
    are 10,000 tokens here). On SciFact abstracts it over-counts SmolLM2's tokens by about 40%
    (never under; see BENCHMARKS.md).
    """

    exact = False
    source = "approximate"

    def for_scope(self, scope: str) -> ApproximateTokenCounter:
        return self  # it keeps nothing

    def count(self, text: str) -> int:
        return len(self._starts(text))

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]

    def token_runs(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        return [(starts, [1] * len(starts)) for starts in map(self._starts, texts)]

    @staticmethod
    def _starts(text: str) -> list[int]:
        starts: list[int] = []
        for piece in _PIECE.finditer(text):
            word = piece.group()
            if word[0].isspace():
                # The last space of a run joins the word after it ("Hello world": 2 tokens).
                end = piece.end() - (1 if piece.end() < len(text) and word[-1] == " " else 0)
                starts.extend(range(piece.start(), end, 4))
                continue
            if word[0].isascii() and word[0].isalpha():
                starts.extend(range(piece.start(), piece.end(), 4))
            else:
                # Byte-level BPE spends two or three tokens on most characters past U+0800
                # (CJK, Devanagari, ...): count two.
                starts.extend([piece.start()] * (2 if ord(word[0]) >= 0x800 else 1))
        return starts


def default_models_dir() -> Path:
    """Where `make model` puts models: `$RAG_MODELS_DIR`, else `$RAG_HOME/models`, else
    `~/.cache/rag/models` (the rule of scripts/build_model.py)."""
    home = Path(os.environ.get("RAG_HOME") or Path.home() / ".cache" / "rag")
    return Path(os.environ.get("RAG_MODELS_DIR") or home / "models")


def find_tokenizer(path: Path | None = None, *, models_dir: Path | None = None) -> Path | None:
    """The tokenizer file to use: `path` (a tokenizer.json, or a model directory holding one)
    when given, else that of the newest complete SmolLM2 directory under `models_dir`."""
    if path is not None:
        candidate = path / TOKENIZER_FILE if path.is_dir() else path
        return candidate if candidate.is_file() else None
    root = models_dir if models_dir is not None else default_models_dir()
    if not root.is_dir():
        return None
    built = [
        d / TOKENIZER_FILE
        for d in root.glob(f"{MODEL_PREFIX}-*")
        if (d / COMPLETE_MARKER).exists() and (d / TOKENIZER_FILE).is_file()
    ]
    return max(built, key=lambda f: f.stat().st_mtime) if built else None


def load_token_counter(
    path: Path | None = None, *, models_dir: Path | None = None
) -> ModelTokenCounter | ApproximateTokenCounter:
    """The model's tokenizer (see `find_tokenizer`), or the approximate counter with a warning.

    A `path` that is given but holds no tokenizer is an error, not a silent fallback.
    """
    found = find_tokenizer(path, models_dir=models_dir)
    if found is not None:
        return ModelTokenCounter.from_file(found)
    if path is not None:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}")
    log.warning(
        "No SmolLM2 tokenizer under %s (build it with `make model`): prompt token budgets are "
        "counted approximately",
        models_dir if models_dir is not None else default_models_dir(),
    )
    return ApproximateTokenCounter()
