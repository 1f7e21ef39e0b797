"""Prompt-injection detection: rules over several views of the text, plus embedding similarity.

Views: the folded text (`normalize.fold`); a de-leeted copy ("1gn0r3" -> "ignore") when words
mix letters and digits; a letters-only copy checked for a few spelled-out phrases
("i.g.n.o.r.e a-l-l ..."); and every smuggled payload `normalize.hidden_views` decodes (base64,
hex, URL-encoding, Unicode escapes and tag characters always; rot13 and reversed text when the
text reads as gibberish or names such an encoding). A rule that fires on a decoded view reports
as `injection.encoded`, one on the de-leeted or letters-only view as `injection.obfuscated`.

Scores of different families combine as 1 - prod(1 - s); the text is flagged at `threshold`.

The similarity signal compares the query's embedding with embeddings of known injection
attempts and of benign texts about the same topics (`ExemplarIndex`), in fourteen languages.
When the nearest injection exemplar is close (cosine >= `similarity_threshold`, 0.5) and closer
than the nearest benign one by `margin` (0.2), it decides alone (`similarity_score`, 0.6); closer
by only `weak_margin` to `margin` (0.05 to 0.2), it is a weak signal (0.36) that flags a text only
together with a weak rule signal, so a borderline neighbour of an attack is not refused on its
looks alone. The numbers were chosen on the dev half of `bench/data/injection_eval.jsonl` and the
tune half of `bench/data/injection_dev_extra.jsonl` (no false positive on those benign texts nor
on 571 ordinary requests). MiniLM is an English model and no classifier: the signal backs the
rules up rather than replacing them. Across languages it is weaker still: texts in one script
sit close together whatever they say, so the margin must stay strict, and on its own it decides
1 of the 24 non-Latin attempts of the extra set (the multilingual exemplars mostly add weak
signals, and benign neighbours that keep ordinary text in those languages from firing). The
caller can pass the query vector it already has (the request path embeds the query for
retrieval anyway); without one the text is embedded alone with the index's embedder.

Every pattern that reads caller text runs on RE2 (`linear`): the rules, once per text and view,
each searched once over the view's UTF-8 bytes; the literal-prefix index (`prefilter`) only
chooses which rules can match at all.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pipeline.guards import rules
from pipeline.guards.linear import compile_linear, encode
from pipeline.guards.normalize import (
    canonical_lines,
    fold,
    fold_lines,
    hidden_views,
    scrub_surrogates,
)
from pipeline.guards.prefilter import PrefixIndex
from pipeline.guards.rules import Rule

FloatArray = npt.NDArray[np.float32]
DEFAULT_EXEMPLARS = Path(__file__).with_name("data") / "injection_exemplars.jsonl"
RULES = rules.RULES
_INDEX = PrefixIndex([rule.prefixes for rule in RULES])
_COMPACT = compile_linear("|".join(rules.COMPACT_PHRASES))
MAX_CHECKED = 40_000  # characters; longer texts are checked at their head and tail

_LEET = bytes.maketrans(b"013457@$|", b"oieastasl")
_NOT_A_TO_Z = bytes(b for b in range(256) if not 0x61 <= b <= 0x7A)
# A word of letters and digits or leet symbols ("1gn0r3", "$y$tem"): both kinds in one run.
_MIXED_WORD = compile_linear(r"[\w@$|]*(?:[a-z][\w@$|]*[0-9@$|]|[0-9@$|][\w@$|]*[a-z])[\w@$|]*")
_LEET_CONTEXT = 120  # bytes of context on each side of a de-leeted word
_ENCODING_HINT = compile_linear(
    r"rot-? ?13|caesar|cesar|cifra|backwards|reversed|in reverse|invertid|al reves|a l'envers"
    r"|umgekehrt|ruckwarts|de tras para (?:a )?frente"
)
_COMMON = frozenset(
    """the a an is are to of and in you i it be do for on with this that what how
    de que e o a os as um uma para com nao por se na no em la el y en es un les le et est
    une pas der die das und ist nicht zu ein""".split()  # noqa: SIM905
)
# A chat-template marker followed by "tag", "token", "format"... is being talked about.
_MENTION = compile_linear(
    r"[`'\")\]]*\s*(?:(?:and|or|,|/|&)\s*\S+\s*)?(?:tags?|tokens?|markers?|delimiters?|"
    r"format|template|syntax|sequences?|placeholders?)\b"
)
_AFTER_MATCH = 64  # bytes after a match that `_MENTION` and `Rule.unless` may read
_DECODED = frozenset({"base64", "hex", "url", "unicode_escape", "tags", "rot13", "reversed"})


class TextEmbedder(Protocol):
    """What the similarity signal needs of `retrieval.Embedder`."""

    def embed(self, texts: list[str]) -> FloatArray: ...


@dataclass(frozen=True, slots=True)
class Signal:
    """One rule (or the similarity signal) that fired, on which view of the text."""

    rule: str
    score: float
    view: str = "plain"


@dataclass(frozen=True, slots=True)
class InjectionDecision:
    """The verdict: flagged or not, the combined score, the rule that decided, every signal."""

    flagged: bool
    score: float
    rule: str | None
    signals: tuple[Signal, ...] = ()
    similarity: float | None = None


# Embedding model -> exemplar file -> (texts, labels, vectors).
_EXEMPLARS: weakref.WeakKeyDictionary[Any, dict[str, tuple[list[str], list[str], FloatArray]]] = (
    weakref.WeakKeyDictionary()
)


class ExemplarIndex:
    """Unit embeddings of labelled exemplars ("injection" or "benign"), built once."""

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[str],
        vectors: FloatArray,
        embedder: TextEmbedder | None = None,
    ) -> None:
        mask = np.array([label == "injection" for label in labels], dtype=bool)
        self.texts = list(texts)
        self.labels = list(labels)
        self.vectors = vectors
        self.embedder = embedder
        self.injection = np.ascontiguousarray(vectors[mask], dtype=np.float32)
        self.benign = np.ascontiguousarray(vectors[~mask], dtype=np.float32)
        self._injection_texts = [t for t, m in zip(texts, mask, strict=True) if m]

    @classmethod
    def from_file(cls, embedder: TextEmbedder, path: Path = DEFAULT_EXEMPLARS) -> ExemplarIndex:
        """Read a JSON-lines file of {"text", "label"} and embed every text (once per embedding
        model and file in a process: apps that share a model share the vectors)."""
        memo = _EXEMPLARS.setdefault(embedder, {})
        key = str(path)
        if key not in memo:
            lines = path.read_text("utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            texts = [str(r["text"]) for r in rows]
            memo[key] = (texts, [str(r["label"]) for r in rows], embedder.embed(texts))
        texts, labels, vectors = memo[key]
        return cls(texts, labels, vectors, embedder)

    def nearest(self, vector: FloatArray) -> tuple[float, float, str]:
        """(best cosine to an injection exemplar, best to a benign one, that injection text)."""
        inj = self.injection @ vector if len(self.injection) else np.zeros(1, np.float32)
        ben = self.benign @ vector if len(self.benign) else np.zeros(1, np.float32)
        best = int(np.argmax(inj))
        text = self._injection_texts[best] if self._injection_texts else ""
        return float(inj[best]), float(ben.max()), text


def _combine(signals: Iterable[Signal]) -> float:
    best: dict[str, float] = {}
    for s in signals:
        family = s.rule if s.view == "plain" else f"{s.rule}@{s.view}"
        best[family] = max(best.get(family, 0.0), s.score)
    remaining = 1.0
    for score in best.values():
        remaining *= 1.0 - score
    return 1.0 - remaining


def _rule_signals(data: bytes, view: str, *, strong_only: bool = False) -> list[Signal]:
    out = []
    for index in _INDEX.candidates(data):
        rule = RULES[index]
        if strong_only and rule.score < 0.5:
            continue
        score = _score(rule, data)
        if score is not None:
            out.append(Signal(f"injection.{rule.family}", score, view))
    return out


def _score(rule: Rule, data: bytes) -> float | None:
    """The rule's score if it matches `data` (one search, or one pass over its matches when a
    match can be vetoed): the first match its `unless` does not veto counts; a role marker that
    is only talked about ("what does the [INST] tag do?") is a weak signal (0.2)."""
    marker = rule.family == "role_marker"
    if rule.unless is None and not marker:
        return rule.score if rule.pattern.search(data) is not None else None
    found = None
    for match in rule.pattern.finditer(data):
        end = match.end()
        if rule.unless is not None and rule.unless.match(data, end, end + _AFTER_MATCH):
            continue
        if marker and _MENTION.match(data, end, end + _AFTER_MATCH):
            found = min(rule.score, 0.2)
            continue
        return rule.score
    return found


def _deleeted(data: bytes) -> bytes:
    """The neighbourhood of each word that mixes letters and digits or leet symbols, with those
    words de-leeted ("1gn0r3" -> "ignore"); overlapping neighbourhoods are merged, so the view is
    never longer than the text."""
    windows: list[list[int]] = []
    words: list[tuple[int, int]] = []
    for match in _MIXED_WORD.finditer(data):
        start, end = match.span()
        words.append((start, end))
        low, high = max(0, start - _LEET_CONTEXT), end + _LEET_CONTEXT
        if windows and low <= windows[-1][1]:
            windows[-1][1] = high
        else:
            windows.append([low, high])
    out = bytearray()
    word = 0
    for low, high in windows:
        at = low
        while word < len(words) and words[word][0] < high:
            start, end = words[word]
            out += data[at:start] + data[start:end].translate(_LEET)
            at = end
            word += 1
        out += data[at:high] + b"\n"
    return bytes(out).decode("utf-8", "ignore").encode()  # a window may cut a character


def _reads_as_gibberish(folded: bytes) -> bool:
    """Latin letters that make no common words (rot13 and reversed text only move those)."""
    words = [w for w in folded.decode().split() if w.isascii()]
    return len(words) >= 5 and sum(w in _COMMON for w in words) < 0.1 * len(words)


def _clip(text: str, limit: int = MAX_CHECKED) -> str:
    if len(text) <= limit:
        return text
    return text[: limit * 3 // 4] + "\n" + text[-limit // 4 :]


def rule_signals(text: str) -> list[Signal]:
    """Every rule that fires on any view of `text`."""
    raw = _clip(text)
    lines = canonical_lines(raw)
    # One character can become 18 ("ﷺ"): the folded text is clipped too, to twice the limit.
    folded = encode(_clip(fold_lines(lines), 2 * MAX_CHECKED))
    signals = _rule_signals(folded, "plain")
    leet = _deleeted(folded)
    if leet:
        signals += _rule_signals(leet, "leet", strong_only=True)
    compact = folded.translate(_LEET).translate(None, _NOT_A_TO_Z)
    if _COMPACT.search(compact) is not None:
        signals.append(Signal("injection.obfuscated", 0.8, "compact"))
    ciphers = _ENCODING_HINT.search(folded) is not None or _reads_as_gibberish(folded)
    for view, decoded in hidden_views(raw, " ".join(lines), ciphers=ciphers):
        signals += _rule_signals(encode(fold(decoded)), view, strong_only=True)
    return signals


class InjectionDetector:
    """Decides whether a user text is a prompt-injection attempt."""

    def __init__(
        self,
        exemplars: ExemplarIndex | None = None,
        *,
        threshold: float = 0.5,
        similarity_threshold: float = 0.5,
        margin: float = 0.2,
        weak_margin: float = 0.05,
        similarity_score: float = 0.6,
        weak_similarity_score: float = 0.36,
    ) -> None:
        self.exemplars = exemplars
        self.threshold = threshold
        self.similarity_threshold = similarity_threshold
        self.margin = margin
        self.weak_margin = weak_margin
        self.similarity_score = similarity_score
        self.weak_similarity_score = weak_similarity_score

    def check(self, text: str, vector: FloatArray | None = None) -> InjectionDecision:
        """The decision for `text`; `vector` is its unit embedding if the caller has it."""
        signals = rule_signals(text)
        similarity, signal = self.similarity(text, vector)
        if signal is not None:
            signals.append(signal)
        return decide(signals, self.threshold, similarity)

    def similarity(
        self, text: str, vector: FloatArray | None = None
    ) -> tuple[float | None, Signal | None]:
        """The cosine to the nearest injection exemplar, and the signal if it fires (None, None
        without exemplars, or without a vector and an embedder to make one)."""
        if vector is None:
            vector = self.embed_alone(_clip(text))
        near = self.closeness(vector) if vector is not None else None
        if near is None:
            return None, None
        return near.injection, near.signal

    def embed_alone(self, text: str) -> FloatArray | None:
        """The unit embedding of `text` alone (a batch of one, so no other text's padding moves
        it), or None without an embedder or text."""
        if self.exemplars is None or self.exemplars.embedder is None or not text.strip():
            return None
        vectors = self.exemplars.embedder.embed([scrub_surrogates(text)])
        return np.asarray(vectors[0], dtype=np.float32)

    def closeness(self, vector: FloatArray) -> Closeness | None:
        """How close `vector` is to the exemplars, the similarity signal that gives, and how far
        the cosines are from changing that signal (None without exemplars)."""
        if self.exemplars is None:
            return None
        injection, benign, _ = self.exemplars.nearest(np.asarray(vector, dtype=np.float32))
        above, gap = injection - self.similarity_threshold, injection - benign
        score = 0.0
        if above >= 0 and gap >= self.margin:
            score = self.similarity_score
        elif above >= 0 and gap >= self.weak_margin:
            score = self.weak_similarity_score
        # Both cosines move with the vector: their gap moves up to twice as far as either.
        slack = min(abs(above), abs(gap - self.margin) / 2, abs(gap - self.weak_margin) / 2)
        return Closeness(injection, benign, score, slack)


@dataclass(frozen=True, slots=True)
class Closeness:
    """The nearest exemplars' cosines, the similarity signal's score (0: none), and its slack:
    a change of the vector that moves no cosine by more than `slack` cannot change the score."""

    injection: float
    benign: float
    score: float
    slack: float

    @property
    def signal(self) -> Signal | None:
        return Signal("injection.similarity", self.score) if self.score else None


def decide(
    signals: Sequence[Signal], threshold: float = 0.5, similarity: float | None = None
) -> InjectionDecision:
    """Combine signals into a decision. The rule named is the strongest signal's, preferring
    the text as written ("plain") when a rule there decides on its own."""
    if not signals:
        return InjectionDecision(False, 0.0, None, (), similarity)
    score = _combine(signals)
    top = max(signals, key=lambda s: (s.view == "plain" and s.score >= threshold, s.score))
    rule = top.rule
    if top.view in _DECODED:
        rule = "injection.encoded"
    elif top.view in ("leet", "compact"):
        rule = "injection.obfuscated"
    return InjectionDecision(score >= threshold, round(score, 4), rule, tuple(signals), similarity)
