"""Planned tools: the calls a request plainly needs, chosen by rules from the last user message.

Three rules, each cheap and each meant to fire only when the need is plain:

- arithmetic: an expression in the text ("What is 1234 * 5678?", "compute (3+4)^2",
  "quanto é 12 x 7", "15% of 80") -> ``calculator``. Word operators between numbers become
  symbols first. An expression with an unmistakable operator (``*``, ``^``, ``×``, or one with
  spaces around it) is taken anywhere; one that could be prose (``24/7``, ``3-4``,
  ``2024-05-01``) only right after a request to calculate and at the end of a sentence.
- time: a question about the current time or date -> ``clock``, with the place it names.
- profile: "my profile / plan / account / features" -> ``profile``.

Anything else plans nothing; the model answers as usual. (Nearest-centroid over the query
embedding was measured against these rules on the labelled set and left out: see
BENCHMARKS.md, "Tools".)
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Collection
from typing import Final

import orjson

from pipeline.answer.events import ToolCall
from pipeline.tools.calculator import CalculatorError, parse
from pipeline.tools.clock import zone_names

MAX_EXPRESSIONS: Final = 3
MAX_PLAN_CHARS: Final = 2000  # a request that plainly needs a tool says so early; bounds the work
_NUMBER: Final = r"\d+(?:\.\d+)?"

# Applied in order, only between a number (or parenthesis) and a number (or parenthesis).
_WORD_OPERATORS: Final = [
    (r"to the power of|raised to the power of|raised to|elevado a", "**"),
    (r"times|multiplied by|multiplicado por|vezes|x", "*"),
    (r"divided by|dividido por|over", "/"),
    (r"plus|mais|mas", "+"),
    (r"minus|menos", "-"),
]
_WORDS: Final = [
    (re.compile(rf"(?<=[\d)])\s+(?:{words})\s+(?=[\d(])"), f" {symbol} ")
    for words, symbol in _WORD_OPERATORS
]
_SQRT: Final = re.compile(rf"\b(?:the )?(?:square root of|raiz quadrada de)\s+({_NUMBER})")
# Starts only where a number starts, and its repeats never give back: on a run of digits a
# pattern free to start anywhere in it backtracks once per digit (2,000 zeros: 110 ms).
_PERCENT: Final = re.compile(
    r"(?<![\d.])(\d++(?:\.\d++)?+)\s*+%\s++(?:of|de)\s++(\d++(?:\.\d++)?+)"
)
_RUN: Final = re.compile(r"(?:[\d.+\-*/%()\s,]|\b(?:sqrt|log|sin|cos|abs|round|min|max|pi)\b)+")
_OPERATION: Final = re.compile(r"[-+*/%]|[a-z]\(")
_STRONG: Final = re.compile(r"\*|\s[-+/%]\s")
_THOUSANDS: Final = re.compile(r"\b\d{1,3}(?:,\d{3})+(?![\d,])")
_DATE: Final = re.compile(r"^\d{1,4}([-/.])\d{1,2}\1\d{1,4}$")
_TRIGGER: Final = re.compile(
    r"(?:calculate|compute|evaluate|solve|what is|what's|whats|how much is|result of|"
    r"quanto e|quanto da|quanto sao|calcule|calcula|calcular|cuanto es)\s*(?::\s*)?$"
)

_CLOCK: Final = re.compile(
    r"\b(?:what time is it|what'?s the (?:current |local )?time|what is the (?:current |local )?"
    r"time|current (?:local )?time|local time|"
    r"(?:what'?s|what is) (?:the date|today'?s date|the date today)|today'?s date|current date|"
    r"what day is (?:it|today)|que horas sao|que hora e|que dia e hoje|data de hoje|"
    r"hora (?:atual|actual|certa)|que hora es|quelle heure)\b"
)
_PLACE: Final = re.compile(r"\b(?:in|em|en|at|no|na|a)\s+([a-z][a-z' /_-]*)")
_PROFILE: Final = re.compile(
    r"\b(?:my|meu|minha|mi)\s+(?:user\s+)?(?:profile|plan|account|features|subscription|"
    r"tier|perfil|plano|conta|assinatura|cuenta)\b|\bwhat do you know about me\b"
)


def fold(text: str) -> str:
    """Lower case without accents ("Quanto é" -> "quanto e"), for the rules to match."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).lower()


def _with_symbols(text: str) -> str:
    text = text.replace("×", " * ").replace("÷", " / ").replace("−", "-").replace("^", "**")
    text = _THOUSANDS.sub(lambda m: m.group().replace(",", ""), text)  # 1,234 -> 1234
    text = _SQRT.sub(r"sqrt(\1)", text)
    text = _PERCENT.sub(r"(\1 / 100 * \2)", text)
    for pattern, symbol in _WORDS:
        text = pattern.sub(symbol, text)
    return text


def _pieces(run: str) -> list[tuple[int, str]]:
    """A run split at commas outside parentheses, each piece with its offset in the run."""
    pieces, depth, start = [], 0, 0
    for index, char in enumerate(run):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth <= 0:
            pieces.append((start, run[start:index]))
            start, depth = index + 1, 0
    pieces.append((start, run[start:]))
    return pieces


def _trim(piece: str) -> str:
    text = piece.strip().lstrip("*/%+,.)").rstrip("+-*/%(,. ")
    while text.count("(") > text.count(")") and text.startswith("("):
        text = text[1:].strip()
    while text.count(")") > text.count("(") and text.endswith(")"):
        text = text[:-1].strip()
    return text


def _computes(expression: str) -> bool:
    """True for an expression the calculator reads that does more than state a number."""
    try:
        tree = parse(expression)
    except CalculatorError:
        return False
    return any(isinstance(node, ast.BinOp | ast.Call) for node in ast.walk(tree))


def expressions(text: str) -> list[str]:
    """The arithmetic expressions a message plainly asks to compute, first ones first."""
    head = text[:MAX_PLAN_CHARS]
    if not any(c.isdigit() for c in head):
        return []  # most messages: nothing to compute, and no need to look closer
    folded = _with_symbols(fold(head))
    found: list[str] = []
    for run in _RUN.finditer(folded):
        if not any(c.isdigit() for c in run.group()):
            continue
        for offset, piece in _pieces(run.group()):
            expression = _trim(piece)
            if expression in found or not _OPERATION.search(expression):
                continue
            if not any(c.isdigit() for c in expression):
                continue
            if _DATE.match(expression) or not _computes(expression):
                continue
            start = run.start() + offset + piece.find(expression)
            if _STRONG.search(expression) or _asked_for(folded, start, len(expression)):
                found.append(expression)
                if len(found) == MAX_EXPRESSIONS:
                    return found
    return found


def _asked_for(folded: str, start: int, length: int) -> bool:
    """True when the expression at ``start`` follows a request to calculate and ends a sentence."""
    after = folded[start + length :].lstrip()
    return (not after or after[0] in "?.!") and _TRIGGER.search(folded[:start]) is not None


def clock_zone(text: str) -> str | None:
    """For a question about the current time or date: the zone of the place it names (the
    place as written when no zone is known by it; "" when it names none). None when it is no
    such question."""
    folded = fold(text[:MAX_PLAN_CHARS])
    question = _CLOCK.search(folded)
    if question is None:
        return None
    zones = zone_names()
    for match in _PLACE.finditer(folded):
        words = match.group(1).split()
        for size in range(min(len(words), 4), 0, -1):  # "new york city" before "new"
            zone = zones.find(" ".join(words[:size]))
            if zone is not None:
                return zone
    # A place the zone list does not know: the clock tool says so, rather than answer for UTC.
    tail = _PLACE.search(folded[question.end() :])
    return tail.group(1).strip(" '") if tail else ""


def wants_profile(text: str) -> bool:
    return _PROFILE.search(fold(text[:MAX_PLAN_CHARS])) is not None


def _call(name: str, number: int, arguments: dict[str, str]) -> ToolCall:
    return ToolCall(f"plan-{name}-{number}", name, orjson.dumps(arguments).decode())


class ToolPlanner:
    """Plans calls of the tools in ``available`` (the registry's names) for a message; of those,
    only the ones in ``allowed`` (the caller's tenant may use) when it is given."""

    def __init__(self, available: Collection[str]) -> None:
        self.available = frozenset(available)

    def plan(self, text: str, allowed: Collection[str] | None = None) -> list[ToolCall]:
        tools = self.available if allowed is None else self.available & frozenset(allowed)
        calls: list[ToolCall] = []
        if "calculator" in tools:
            for number, expression in enumerate(expressions(text)):
                calls.append(_call("calculator", number, {"expression": expression}))
        if "clock" in tools:
            zone = clock_zone(text)
            if zone is not None:
                calls.append(_call("clock", 0, {"timezone": zone} if zone else {}))
        if "profile" in tools and wants_profile(text):
            calls.append(_call("profile", 0, {}))
        return calls
