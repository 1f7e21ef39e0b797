"""Prompt-injection detection: rules over several views of the text, plus embedding similarity.

Views: the folded text (`normalize.fold`); a de-leeted copy ("1gn0r3" -> "ignore") when words
mix letters and digits; a letters-only copy checked for a few spelled-out phrases
("i.g.n.o.r.e a-l-l ..."); and every smuggled payload `normalize.hidden_views` decodes (base64,
hex, URL-encoding, Unicode escapes and tag characters always; rot13 and reversed text when the
text reads as gibberish or names such an encoding). A rule that fires on a decoded view reports
as `injection.encoded`, one on the de-leeted or letters-only view as `injection.obfuscated`.

Scores of different families combine as 1 - prod(1 - s); the text is flagged at `threshold`.

The similarity signal compares the query's embedding with embeddings of known injection
attempts and of benign texts about the same topics (`ExemplarIndex`); it fires when the
nearest injection exemplar is close (`similarity_threshold`) and closer than the nearest benign
one by `margin` (0.5 and 0.1, chosen on the dev half of `bench/data/injection_eval.jsonl`: alone
they flag 35 of 98 dev attempts and none of the 86 dev benign texts; MiniLM is no classifier, so the
signal backs the rules up rather than replacing them). The caller can pass the query vector
it already has (the request path embeds the query for retrieval anyway); without one the
index's embedder is used.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pipeline.guards import rules
from pipeline.guards.normalize import (
    canonical_lines,
    fold,
    fold_lines,
    hidden_views,
    scrub_surrogates,
)
from pipeline.guards.prefilter import PrefixIndex

FloatArray = npt.NDArray[np.float32]
DEFAULT_EXEMPLARS = Path(__file__).with_name("data") / "injection_exemplars.jsonl"
RULES = rules.RULES
_INDEX = PrefixIndex([rule.prefixes for rule in RULES])
_COMPACT = re.compile("|".join(rules.COMPACT_PHRASES))
MAX_CHECKED = 40_000  # characters; longer texts are checked at their head and tail

_LEET = str.maketrans("013457@$|", "oieastasl")
_MIXED_WORD = re.compile(r"\b(?=[\w@$|]*[a-z])(?=[\w@$|]*[0-9@$|])[\w@$|]+\b")
_ENCODING_HINT = re.compile(
    r"rot-? ?13|caesar|cesar|cifra|backwards|reversed|in reverse|invertid|al reves|a l'envers"
    r"|umgekehrt|ruckwarts|de tras para (?:a )?frente"
)
_COMMON = frozenset(
    """the a an is are to of and in you i it be do for on with this that what how
    de que e o a os as um uma para com nao por se na no em la el y en es un les le et est
    une pas der die das und ist nicht zu ein""".split()  # noqa: SIM905
)
# A chat-template marker followed by "tag", "token", "format"... is being talked about.
_MENTION = re.compile(
    r"[`'\")\]]*\s*(?:(?:and|or|,|/|&)\s*\S+\s*)?(?:tags?|tokens?|markers?|delimiters?|"
    r"format|template|syntax|sequences?|placeholders?)\b"
)
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


def _rule_signals(text: str, view: str, *, strong_only: bool = False) -> list[Signal]:
    out = []
    for index, offsets in _INDEX.candidates(text).items():
        rule = RULES[index]
        if strong_only and rule.score < 0.5:
            continue
        match = _first_match(rule.pattern, text, offsets)
        if match is None:
            continue
        score = rule.score
        if rule.family == "role_marker" and _MENTION.match(text, match.end()):
            score = min(score, 0.2)  # "what does the [INST] tag do?" talks about a marker
        out.append(Signal(f"injection.{rule.family}", score, view))
    return out


def _first_match(pattern: re.Pattern[str], text: str, offsets: list[int]) -> re.Match[str] | None:
    if not offsets:  # a rule without literal prefixes: search everywhere
        return pattern.search(text)
    for offset in offsets:
        match = pattern.match(text, offset)
        if match is not None:
            return match
    return None


def _reads_as_gibberish(folded: str) -> bool:
    words = folded.split()
    return len(words) >= 5 and sum(w in _COMMON for w in words) < 0.1 * len(words)


def _clip(text: str) -> str:
    if len(text) <= MAX_CHECKED:
        return text
    return text[: MAX_CHECKED * 3 // 4] + "\n" + text[-MAX_CHECKED // 4 :]


def rule_signals(text: str) -> list[Signal]:
    """Every rule that fires on any view of `text`."""
    raw = _clip(text)
    lines = canonical_lines(raw)
    folded = fold_lines(lines)
    signals = _rule_signals(folded, "plain")
    mixed = [m.span() for m in _MIXED_WORD.finditer(folded)]
    if mixed:  # the neighbourhood of words like "1gn0r3", de-leeted
        windows = (folded[max(0, a - 120) : b + 120] for a, b in mixed)
        text = _MIXED_WORD.sub(lambda m: m.group().translate(_LEET), "\n".join(windows))
        signals += _rule_signals(text, "leet", strong_only=True)

    compact = re.sub(r"[^a-z]", "", folded.translate(_LEET))
    if _COMPACT.search(compact):
        signals.append(Signal("injection.obfuscated", 0.8, "compact"))
    ciphers = _ENCODING_HINT.search(folded) is not None or _reads_as_gibberish(folded)
    for view, decoded in hidden_views(raw, " ".join(lines), ciphers=ciphers):
        signals += _rule_signals(fold(decoded), view, strong_only=True)
    return signals


class InjectionDetector:
    """Decides whether a user text is a prompt-injection attempt."""

    def __init__(
        self,
        exemplars: ExemplarIndex | None = None,
        *,
        threshold: float = 0.5,
        similarity_threshold: float = 0.5,
        margin: float = 0.1,
        similarity_score: float = 0.6,
    ) -> None:
        self.exemplars = exemplars
        self.threshold = threshold
        self.similarity_threshold = similarity_threshold
        self.margin = margin
        self.similarity_score = similarity_score

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
        if self.exemplars is None:
            return None, None
        if vector is None:
            if self.exemplars.embedder is None or not text.strip():
                return None, None
            vector = self.exemplars.embedder.embed([scrub_surrogates(_clip(text))])[0]
        injection, benign, _ = self.exemplars.nearest(np.asarray(vector, dtype=np.float32))
        fires = injection >= self.similarity_threshold and injection - benign >= self.margin
        signal = Signal("injection.similarity", self.similarity_score) if fires else None
        return injection, signal


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
