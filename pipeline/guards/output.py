"""Output redaction that keeps a stream a stream: PII and blocked terms, across chunk boundaries.

`StreamingRedactor.feed(chunk)` returns what is safe to emit now; `end()` flushes the rest. For
any chunking, the concatenated output equals `redact_answer(whole text)`. What is held back is
only what could still become part of a match:

- for PII, the run at the end of the text (see `segments`: ordinary prose holds back its last
  word, and the word before a final space until the next character shows it is not "[at]";
  a long run of pattern characters is split every `segments.RUN_LIMIT`);
- for blocked terms, the longest tail that is a prefix of a term (a whole term too, while the
  character after it, which decides the word boundary, has not arrived);
- and never a cut through a pattern match, valid or not.

Only new text is scanned on each feed, with `pii.CONTEXT` characters of what was already
emitted kept as context, which is exact because of how the patterns are written (see `pii`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from pipeline.guards import pii
from pipeline.guards.normalize import CanonicalText
from pipeline.guards.segments import (
    LINK_AHEAD,
    MAX_EXPANSION,
    RUN_LIMIT,
    RunSplitter,
    pii_tail_start,
    split_points,
)
from pipeline.guards.terms import TermMatcher, lower


@dataclass(frozen=True, slots=True)
class Violation:
    """A policy violation in the answer: `rule` is "blocked_term" or "pii.<kind>"."""

    rule: str
    detail: str
    offset: int


class StreamingRedactor:
    """Redacts PII and blocked terms in an answer that arrives in chunks.

    `redact_kinds` are replaced by their tokens; `block_kinds` and `blocked_terms` are replaced
    too and recorded in `violations`, so the caller can end the stream with
    ``finish_reason: "content_filter"``. `context` is read as if it came just before the text
    (a JSON value's key: "phone: " before "5551234567"), and never emitted.
    """

    def __init__(
        self,
        *,
        redact_kinds: Collection[str] = pii.PII_KINDS,
        block_kinds: Collection[str] = (),
        blocked_terms: Iterable[str] = (),
        context: str = "",
    ) -> None:
        self.kinds = tuple(k for k in pii.PII_KINDS if k in set(redact_kinds) | set(block_kinds))
        self.block_kinds = frozenset(block_kinds)
        self.terms = TermMatcher(blocked_terms)
        self.violations: list[Violation] = []
        # The most canonical characters `held` can reach: the tail run's piece, plus a term's
        # prefix; plus, when the tail run begins inside the expansion of one original character
        # ("ﷺ" is four Arabic words), the rest of that expansion and the piece of the run before
        # it (the cut may not split the character, nor a match in that run that reaches into it).
        # Plus the few characters after the last split point that decide whether it is one.
        self.max_holdback = 2 * (RUN_LIMIT + MAX_EXPANSION) + LINK_AHEAD + self.terms.longest
        self._canon = CanonicalText()
        self._splitter = RunSplitter()
        self._splits: list[int] = []  # split points not yet reached, absolute canonical offsets
        self._dropped = 0  # canonical characters forgotten from the front of `_canon`
        self._pos = 0  # offset in `_canon` of the first character not yet emitted
        self._pending = ""  # original text not yet emitted
        self._emitted = 0  # original offset where `_pending` starts
        self._start = 0  # canonical offset where the text (after the context) starts
        self._context = len(context)
        # Original spans (offsets in the text after the context) replaced so far, in order.
        self.redacted: list[tuple[int, int]] = []
        if context:
            self._canon.extend(context)
            self._start = len(self._canon.text)
            self._splitter.extend(self._canon.text, self._canon.origin)
            self._emitted = len(context)
            self._forget_before(self._start)

    @property
    def held(self) -> int:
        """Canonical characters received but not yet emitted."""
        return len(self._canon.text) - self._pos

    @property
    def emitted(self) -> int:
        """Characters of the text (after the context) emitted so far, redacted or not."""
        return self._emitted - self._context

    @property
    def passes_all(self) -> bool:
        """Nothing to find (no PII kind to redact or block, no blocked term): every chunk is
        emitted whole, as it comes, with nothing held back."""
        return not self.kinds and not self.terms.terms

    def feed(self, text: str) -> str:
        """Take the next chunk of the answer; return the text that is safe to emit now."""
        if not text:
            return ""
        if self.passes_all:
            self._emitted += len(text)
            return text
        known = len(self._canon.text)
        self._canon.extend(text)
        self._pending += text
        canon, origin = self._canon.text, self._canon.origin
        self._take_splits(self._splitter.extend(canon[known:], origin[known:]))
        return self._emit(final=False)

    def end(self) -> str:
        """The answer is complete: return everything still held, redacted."""
        if self.passes_all:
            return ""
        self._take_splits(self._splitter.finish())
        return self._emit(final=True)

    def _take_splits(self, splits: list[int]) -> None:
        self._splits += [p for p in splits if p > self._start]  # none inside the context

    def _emit(self, *, final: bool) -> str:
        out = []
        while self._splits:  # pieces of long runs, each scanned on its own as in one call
            split = self._splits.pop(0) - self._dropped
            out.append(self._emit_until(split, self._canon.text[:split]))
        canon = self._canon.text
        if final:
            out.append(self._emit_until(len(canon), canon))
            return "".join(out)
        lowered = lower(canon) if self.terms.terms else canon
        splitter, dropped = self._splitter, self._dropped
        run = pii_tail_start(
            canon,
            self._pos,
            decided=splitter.decided - dropped,
            run_start=splitter.run_start - dropped,
        )
        cut = min(run, self.terms.tail_start(lowered, self._pos))
        if cut > self._pos:
            out.append(self._emit_until(cut, canon, lowered))
        return "".join(out)

    def _emit_until(self, cut: int, canon: str, lowered: str | None = None) -> str:
        """Emit up to `cut` (moved back where it would split a match) scanning `canon`."""
        if lowered is None:
            lowered = lower(canon) if self.terms.terms else canon
        result = pii.scan(canon, self._pos, self.kinds)
        self.terms.scan(lowered, self._pos, result)
        if cut < len(canon):
            cut = self._safe_cut(cut, result)
        emitted = [c for c in result.found if c.end <= cut]
        found = pii.resolve(emitted)
        self.violations += violations(emitted, self._canon, self.block_kinds)
        end = self._canon.original_index(cut)
        spans = [
            pii.Candidate(c.kind, *self._canon.original_span(c.start, c.end), c.score)
            for c in found
        ]
        out = self._redact_pending(end, spans)
        self._forget_before(cut)
        return out

    def _safe_cut(self, cut: int, result: pii.Scan) -> int:
        """Move `cut` back until it splits no match and no original character."""
        origin = self._canon.origin
        moved = True
        while moved:
            moved = False
            # One original character can expand to several ("ﷺ" is 18): never split one.
            while self._pos < cut < len(origin) and origin[cut] == origin[cut - 1]:
                cut, moved = cut - 1, True
            for start, end in result.extents:
                if start < cut < end:
                    cut, moved = start, True
        return max(cut, self._pos)

    def _redact_pending(self, end: int, spans: list[pii.Candidate]) -> str:
        base = self._emitted
        local = [pii.Candidate(s.kind, s.start - base, s.end - base, s.score) for s in spans]
        self.redacted += [(s.start - self._context, s.end - self._context) for s in spans]
        out = pii.redact(self._pending[: end - base], local)
        self._pending = self._pending[end - base :]
        self._emitted = end
        return out

    def _forget_before(self, cut: int) -> None:
        """Emitted up to `cut`: keep only `pii.CONTEXT` characters of it as context."""
        keep_from = max(0, cut - pii.CONTEXT)
        self._canon.drop_before(keep_from)
        self._dropped += keep_from
        self._pos = cut - keep_from


def violations(
    found: list[pii.Candidate], canon: CanonicalText, block_kinds: Collection[str]
) -> list[Violation]:
    """The blocked terms and blocked PII kinds among the matches (all of them, overlapping ones
    too: a blocked kind under a match of another kind still counts), at original offsets."""
    out = []
    for c in sorted(found, key=lambda c: (c.start, c.end, c.kind)):
        if c.kind == "blocked":
            rule = "blocked_term"
        elif c.kind in block_kinds:
            rule = f"pii.{c.kind}"
        else:
            continue
        out.append(Violation(rule, c.detail or c.kind, canon.original_span(c.start, c.end)[0]))
    return out


def redact_answer(
    text: str,
    *,
    redact_kinds: Collection[str] = pii.PII_KINDS,
    block_kinds: Collection[str] = (),
    blocked_terms: Iterable[str] = (),
) -> tuple[str, list[Violation]]:
    """The whole answer in one call: what `StreamingRedactor` produces for any chunking of it.

    The same as `pii.find_pii` + `pii.redact` (plus blocked terms), except inside runs longer
    than `segments.RUN_LIMIT`, which both redactors scan piece by piece."""
    canon = CanonicalText(text)
    kinds = [k for k in pii.PII_KINDS if k in set(redact_kinds) | set(block_kinds)]
    terms = TermMatcher(blocked_terms)
    full, lowered = canon.text, lower(canon.text)
    bounds = [0, *split_points(full, canon.origin), len(full)]
    found: list[pii.Candidate] = []
    every: list[pii.Candidate] = []
    for start, end in itertools.pairwise(bounds):
        result = pii.scan(full[:end], start, kinds)
        terms.scan(lowered[:end], start, result)
        found += pii.resolve(result.found)
        every += result.found
    spans = [pii.Candidate(c.kind, *canon.original_span(c.start, c.end), c.score) for c in found]
    return pii.redact(text, spans), violations(every, canon, block_kinds)
