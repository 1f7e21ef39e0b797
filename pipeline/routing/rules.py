"""The router's cheap rules: what a request plainly is, read from its words alone.

Markers are matched on a folded copy of the text (lower case, accents removed, so "migração"
and "migracao" read the same) in English and Portuguese. Quoted material (``'...'``, ``"..."``,
code fences) is the object of a request, not its instruction: a review that says "compare"
does not make "classify this review" a comparison, so markers are looked for outside quotes.

Order matters and is the policy: code first; then what the instruction asks for (a large
marker, else a small task); then length and several questions; then short factual openings.
Anything else is left open (``None``) for the nearest-centroid step.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

Intent = Literal["small", "large"]


@dataclass(frozen=True)
class Thresholds:
    """Lengths past which a prompt is long (large), and up to which it may be short (small)."""

    long_words: int = 60
    long_chars: int = 400
    short_words: int = 20


@dataclass(frozen=True)
class RuleHit:
    intent: Intent
    rule: str


def _any(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


CODE_FENCE = re.compile(r"```|^\s{4}\S.*\n\s{4}\S", re.MULTILINE)
CODE_SYNTAX = _any(
    r"\bdef \w+\(",
    r"\bfunction\s*\w*\(",
    r"=>",
    r"\w\(\w*\)\.\w+\(",  # call chains: fetch(url).then(
    r"#include\b",
    r"\bconsole\.log\b",
    r"\btraceback\b",
    r"\bstack ?trace\b",
    r"\bsegfault\b",
)
EXCEPTION_NAME = re.compile(r"\b[A-Z][a-z]+[A-Za-z]*(Error|Exception)\b")  # KeyError, ...
CODE_VERB = _any(
    r"\b(write|implement|debug|fix|refactor|optimi[sz]e|convert|port)\b",
    r"\b(escreva|implemente|crie|corrija|depure|refatore|otimize|converta|programe)\b",
)
CODE_NOUN = _any(
    r"\b(function|script|program|class|method|query|sql|regex|code|algorithm|endpoint)\b",
    r"\b(component|unit tests?|bug|api)\b",
    r"\b(funcao|programa|classe|metodo|consulta|codigo|algoritmo|componente|testes?)\b",
)
CODE_NAMES = _any(r"\b(react|django|javascript|typescript|python|java|rust|golang|kotlin)\b")

# Instructions that call for several reasoning steps, whatever the length.
LARGE_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("step_by_step", _any(r"step[- ]by[- ]step", r"passo a passo", r"etapa por etapa")),
    ("step_by_step", _any(r"walk me through", r"one (stage|step) at a time")),
    ("prove", _any(r"\bprove\b", r"\bproof\b", r"\bprova(r)? que\b", r"\bdemonstr(e|ar) que\b")),
    ("prove", _any(r"\bderive\b", r"\bdeduz(a|ir)\b", r"\bshow that\b", r"\bmostre que\b")),
    ("trade_offs", _any(r"trade[- ]?offs?", r"pros and cons", r"pros e contras")),
    ("trade_offs", _any(r"(advantages|vantagens) (and|e) (disadvantages|desvantagens)")),
    ("compare", _any(r"\bcompar(e|ing|ar)\b", r"\bcontrast\b", r"\bversus\b", r"\bvs\b")),
    ("recommend", _any(r"\brecommend", r"\brecomend(e|ar)\b", r"\bweigh\b", r"\bpondere\b")),
    ("recommend", _any(r"\bshould (we|i) (use|choose|pick|hire|buy|go|adopt)\b")),
    ("plan", _any(r"\bplan (a|an|the|our|my|for)\b", r"\bstudy plan\b", r"\broadmap\b")),
    ("plan", _any(r"\bplane(je|jar)\b", r"\bplano (de|para)\b", r"\bcronograma\b")),
    ("plan", _any(r"\bmigrat(e|ion|ing)\b", r"\bmigra(cao|r)\b", r"\bstrateg(y|ies)\b")),
    ("plan", _any(r"\bestrategias?\b", r"\brollout\b")),
    ("design", _any(r"\b(design|architect|sketch) (a|an|the)\b", r"\barquitetura\b")),
    ("design", _any(r"\bhow (would|should) (you|we|i) (design|architect|build|structure)\b")),
    ("design", _any(r"\b(projete|projetar|estruturar)\b")),
    ("analyse", _any(r"\banaly[sz]e\b", r"\banalis(e|ar)\b", r"\bevaluate\b", r"\bavali(e|ar)\b")),
    ("analyse", _any(r"\bjustif(y|ique)\b", r"\bdiscuss\b", r"\bdiscuta\b", r"\binvestigate\b")),
    ("explain", _any(r"\bexplain (in detail|why|how)\b", r"\bexpliqu?e (em detalhe|por que)\b")),
    ("essay", _any(r"\b(essay|ensaio|redacao)\b")),
)

# Tasks a small model does well: one label, one translation, one item pulled out.
SMALL_TASKS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("classify", _any(r"\bclassif(y|ies|ique|icar)\b", r"\bcategori[sz]e\b", r"\brotule\b")),
    ("classify", _any(r"\b(tag|label) (this|the|these)\b", r"\bsentiment(o)?\b", r"\bspam\b")),
    ("classify", _any(r"\bpositive or negative\b", r"\bpositiv[ao] ou negativ[ao]\b")),
    ("translate", _any(r"\btranslat(e|ion)\b", r"\btraduz(a|ir)?\b", r"\btraducao\b")),
    ("translate", _any(r"\bhow do you say\b", r"\bcomo se diz\b")),
    ("extract", _any(r"\bextract\b", r"\bextrai(a|r)\b", r"\bpull out\b", r"\bretire\b")),
    ("yes_no", _any(r"\byes or no\b", r"\bsim ou nao\b", r"\btrue or false\b")),
    ("yes_no", _any(r"\bverdadeiro ou falso\b")),
    ("convert", _any(r"^(convert|converta)\b")),
)

FACTUAL_OPENING = _any(
    r"^(what|what's|whats|who|who's|when|where|which|whose)\b",
    r"^how (many|much|old|far|tall|long|big)\b",
    r"^(define|name|give me|spell|list)\b",
    r"^(is|are|was|were|does|do|did|can|has|have|will)\b",
    r"^(o que|quem|quando|onde|qual|quais|quantos|quantas|quanto)\b",
    r"^(defina|diga|nomeie|liste|cite)\b",
)

QUOTED = re.compile(
    r"```.*?```|(?<!\w)'[^'\n]{1,400}'(?!\w)|\"[^\"\n]{1,400}\"|“[^”]{1,400}”|‘[^’]{1,400}’|«[^»]{1,400}»",
    re.DOTALL,
)


def fold(text: str) -> str:
    """Lower case without accents: the form the markers are written in."""
    decomposed = unicodedata.normalize("NFKD", text.lower())
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def word_count(text: str) -> int:
    return len(text.split())


def _first(markers: tuple[tuple[str, re.Pattern[str]], ...], text: str) -> str | None:
    for rule, pattern in markers:
        if pattern.search(text):
            return rule
    return None


def _is_code(raw: str, folded: str) -> bool:
    if CODE_FENCE.search(raw) or CODE_SYNTAX.search(raw.lower()) or EXCEPTION_NAME.search(raw):
        return True
    return bool(
        CODE_VERB.search(folded) and (CODE_NOUN.search(folded) or CODE_NAMES.search(folded))
    )


def classify(text: str, thresholds: Thresholds) -> RuleHit | None:
    """The intent the rules see in ``text``, or None when they leave it open."""
    folded = fold(text.strip())
    unquoted = QUOTED.sub(" ", folded)
    # The instruction is what comes before a colon that introduces the material ("Classify
    # this review: ..."), when it is short enough to be one.
    head, colon, _ = unquoted.partition(":")
    if not colon or word_count(head) > thresholds.short_words:
        head = unquoted
    words = word_count(text)
    if _is_code(text, unquoted):
        return RuleHit("large", "code")
    rule = _first(LARGE_MARKERS, head)
    if rule is not None:
        return RuleHit("large", rule)
    rule = _first(SMALL_TASKS, head.strip())
    if rule is not None and word_count(unquoted) <= thresholds.long_words:
        return RuleHit("small", rule)
    rule = _first(LARGE_MARKERS, unquoted)
    if rule is not None:
        return RuleHit("large", rule)
    if words > thresholds.long_words or len(text) > thresholds.long_chars:
        return RuleHit("large", "long")
    if unquoted.count("?") >= 2:
        return RuleHit("large", "several_questions")
    if words <= thresholds.short_words and FACTUAL_OPENING.search(unquoted.strip()):
        return RuleHit("small", "factual")
    return None
