"""Adversarial texts for regular expressions and other parsers of caller text, and a time bound
per kilobyte to hold them to.

A backtracking matcher, or any parser that rescans, is slow on text that almost matches again
and again: a long run of a character the pattern loops on (40,000 newlines against
``\\n\\s*system\\s*:``), one alternative's prefix repeated ("1@1@1@..." against a word pattern
with lookaheads), its literals repeated with and without separators. The API:

- `inputs_for(pattern, size)`: such texts for one pattern (Python or RE2 syntax, as far as
  `re._parser` reads it), built from its parse tree: runs of each character its classes and
  literals name (newlines and spaces always), runs of two such characters alternating, each
  literal string and each alternative's shortest text repeated (glued, and separated by a
  space or a newline), and the whole pattern's shortest text less its last character repeated.
- `generic_inputs(size)`: the same kinds of texts for a parser that is no regex (runs of
  newlines, spaces, punctuation, digits, table-of-contents leader dots, mixed scripts...).
- `cpu_ms_per_kb(fn, text)`: the CPU milliseconds `fn(text)` takes per 1,024 characters
  (`time.process_time`, the best of `repeats` runs: a busy machine slows wall time, not this).
- `assert_linear(fn, inputs, ms_per_kb=2.0)`: fails, naming the worst inputs, if `fn` costs more
  than the bound on any input. Linear code costs about the same per KB at any size; quadratic
  code costs ~size/2 times its per-character work per character, which at 32 KB is hundreds of
  milliseconds per KB: orders of magnitude over a bound that a busy machine meets.

    from tests.support.adversarial import assert_linear, generic_inputs, inputs_for

    assert_linear(split_sentences, generic_inputs(32_768))
    assert_linear(lambda text: list(PATTERN.finditer(text)), inputs_for(PATTERN.pattern))
"""

from __future__ import annotations

import itertools
import re._constants as sre
import re._parser as sre_parse
import time
from collections.abc import Callable, Iterable
from typing import Any

Input = tuple[str, str]  # (what the text is, the text)

SIZE = 32_768
SEPARATORS = ("", " ", "\n")
# Characters tried against negated classes (one of them is outside almost any class).
_PROBES = (" ", "\n", "\t", "a", "Z", "0", ".", ",", "-", "_", "@", "|", ":", "<", ">", "é", "я")
_CATEGORY_SAMPLES: dict[Any, tuple[str, ...]] = {
    sre.CATEGORY_DIGIT: ("0", "9"),
    sre.CATEGORY_NOT_DIGIT: ("a", "."),
    sre.CATEGORY_SPACE: (" ", "\n", "\t"),
    sre.CATEGORY_NOT_SPACE: ("x", "."),
    sre.CATEGORY_WORD: ("a", "_", "9"),
    sre.CATEGORY_NOT_WORD: (".", " ", "-"),
}
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def fill(unit: str, size: int = SIZE) -> str:
    """`unit` repeated to exactly `size` characters."""
    return (unit * (size // max(1, len(unit)) + 1))[:size]


def _in_class(ch: str, items: list[Any]) -> bool:
    negate = bool(items) and items[0][0] is sre.NEGATE
    hit = False
    for op, av in items[1:] if negate else items:
        if op is sre.LITERAL:
            hit = hit or ord(ch) == av
        elif op is sre.RANGE:
            hit = hit or av[0] <= ord(ch) <= av[1]
        elif op is sre.CATEGORY:
            hit = hit or ch in _CATEGORY_SAMPLES.get(av, ()) or _category(ch, av)
    return hit != negate


def _category(ch: str, category: Any) -> bool:
    tests: dict[Any, Callable[[str], bool]] = {
        sre.CATEGORY_DIGIT: str.isdigit,
        sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
        sre.CATEGORY_SPACE: str.isspace,
        sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
        sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
        sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
    }
    test = tests.get(category)
    return test(ch) if test is not None else False


def _class_samples(items: list[Any]) -> list[str]:
    if items and items[0][0] is sre.NEGATE:
        return [c for c in _PROBES if _in_class(c, items)][:4]
    out: list[str] = []
    for op, av in items:
        if op is sre.LITERAL:
            out.append(chr(av))
        elif op is sre.RANGE:
            out += [chr(av[0]), chr(av[1])]
        elif op is sre.CATEGORY:
            out += _CATEGORY_SAMPLES.get(av, ())
    return out


class _Reading:
    """What a parse tree names: characters of classes (which loops consume), characters of
    literals, literal strings, and the shortest text of each alternative."""

    def __init__(self) -> None:
        self.class_chars: list[str] = []
        self.literal_chars: list[str] = []
        self.literals: list[str] = []
        self.alternatives: list[str] = []

    def shortest(self, items: Iterable[Any]) -> str:
        """The shortest text of `items` (one pass through loops with no minimum, so that what
        they loop on shows), recording what it names along the way."""
        out: list[str] = []
        literal = ""
        for op, av in items:
            if op is sre.LITERAL:
                literal += chr(av)
                self.literal_chars.append(chr(av))
                continue
            if len(literal) >= 2:
                self.literals.append(literal)
            out.append(literal)
            literal = ""
            out.append(self._node(op, av))
        if len(literal) >= 2:
            self.literals.append(literal)
        out.append(literal)
        return "".join(out)

    def _node(self, op: Any, av: Any) -> str:
        if op is sre.NOT_LITERAL:
            sample = next(c for c in _PROBES if ord(c) != av)
            self.class_chars.append(sample)
            return sample
        if op is sre.ANY:
            self.class_chars += ["x", "\n"]
            return "x"
        if op is sre.IN:
            samples = _class_samples(av)
            self.class_chars += samples
            return samples[0] if samples else ""
        if op is sre.BRANCH:
            texts = [self.shortest(alt) for alt in av[1]]
            self.alternatives += [t for t in texts if t]
            return texts[0] if texts else ""
        if op is sre.SUBPATTERN:
            return self.shortest(av[-1])
        if op is sre.ATOMIC_GROUP:
            return self.shortest(av)
        if op in _REPEATS:
            low, high, sub = av
            once = self.shortest(sub)
            return once * min(high, max(low, 1))
        return ""  # anchors, boundaries, lookaround, group references: no text of their own


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v))


def _round_robin(groups: list[list[Input]], limit: int) -> list[Input]:
    out: list[Input] = []
    seen: set[str] = set()
    for row in itertools.zip_longest(*groups):
        for item in row:
            if item is not None and item[1] not in seen:
                seen.add(item[1])
                out.append(item)
                if len(out) == limit:
                    return out
    return out


def _spread(values: list[str], count: int) -> list[str]:
    """At most `count` of `values`, spread evenly over the list (first and last included)."""
    if len(values) <= count:
        return values
    step = (len(values) - 1) / (count - 1)
    return [values[round(i * step)] for i in range(count)]


def inputs_for(pattern: str, size: int = SIZE, *, limit: int = 60) -> list[Input]:
    """At most `limit` adversarial texts of `size` characters for `pattern` (see the module)."""
    reading = _Reading()
    whole = reading.shortest(sre_parse.parse(pattern))
    loop_chars = _unique([*reading.class_chars, "\n", " "])
    other_chars = _unique(c for c in reading.literal_chars if not c.isalnum())
    letters = _spread(_unique(c for c in reading.literal_chars if c.isalnum()), 4)
    runs = [(f"run of {c!r}", fill(c, size)) for c in _unique(loop_chars + other_chars + letters)]
    pairs = [
        (f"{a!r}{b!r} alternating", fill(a + b, size))
        for a, b in itertools.combinations(loop_chars[:6], 2)
    ]
    repeated = [
        (f"{text!r} repeated, separated by {sep!r}", fill(text + sep, size))
        for text in _spread(_unique(reading.literals + reading.alternatives), 24)
        for sep in SEPARATORS
    ]
    near = [
        (
            f"{whole[:-1]!r} (a near match) repeated, separated by {sep!r}",
            fill(whole[:-1] + sep, size),
        )
        for sep in SEPARATORS
        if len(whole) > 1
    ]
    return _round_robin([near, runs, repeated, pairs], limit)


def generic_inputs(size: int = SIZE) -> list[Input]:
    """Adversarial texts for any parser of text: long runs and repeated short groups of the
    characters parsers split and loop on."""
    units = [
        "\n", " ", "\t", "\r\n", "a", "0", ".", ",", "-", "_", "=", "#", "*", "|", "@", "<", "(",
        "[", "'", '"', "`", ":", ";", "!", "?", "/", "\\", "\u200b", "é", "я", "字", "ﷺ", "😀",
        ". ", "! ", "? ", ". . ", "a.", "1.", "a ", "a\n", "1@", "a1", "1,", "a-", "<a>", "[1]",
        "%41", "\\u0041", "\\x41", "aGVsbG8g", "4111 ", "x@y.", "Mr. ", "e.g. ", "...\n", "-\n",
        "\n\n", " \n", "ab", "abc ", "é ", "я ", "a\u200bb",
    ]  # fmt: skip
    out = [(f"run of {unit!r}", fill(unit, size)) for unit in units]
    out.append(("a table of contents", fill("Chapter 1 " + "." * 60 + " 12\n", size)))
    out.append(("one long word", "a" * size))
    return out


def cpu_ms_per_kb(fn: Callable[[str], object], text: str, *, repeats: int = 3) -> float:
    """CPU milliseconds per 1,024 characters of `fn(text)`, the best of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn(text)
        best = min(best, time.process_time() - start)
    return best * 1000 / max(len(text) / 1024, 1e-9)


def assert_linear(
    fn: Callable[[str], object],
    inputs: Iterable[Input],
    *,
    ms_per_kb: float = 2.0,
    repeats: int = 3,
    what: str = "",
) -> None:
    """Fail if `fn` costs more than `ms_per_kb` CPU milliseconds per KB on any input, and that
    is not a constant cost: per KB, it is also over 3 times what an eighth of the input costs
    (quadratic code costs about 8 times), or over 10 times the bound whatever the size.

    Each input is run once; only one over the bound is timed again (best of `repeats`) and
    compared with its eighth, so a linear `fn` costs one run per input. (The eighth keeps a
    function whose constant per-KB cost sits near the bound from failing on a busy machine: a
    sentence splitter at 2.35 ms/KB on ". . . " once did, one run in three.)"""
    over = []
    for name, text in inputs:
        cost = cpu_ms_per_kb(fn, text, repeats=1)
        if cost > ms_per_kb:
            cost = min(cost, cpu_ms_per_kb(fn, text, repeats=repeats))
        if cost > ms_per_kb and cost <= 10 * ms_per_kb:
            eighth = cpu_ms_per_kb(fn, text[: max(1, len(text) // 8)], repeats=repeats)
            if cost <= 3 * max(eighth, ms_per_kb / 8):
                continue  # the same per KB at an eighth of the size: linear, a slow constant
        if cost > ms_per_kb:
            over.append((cost, name, len(text)))
    over.sort(reverse=True)
    shown = "; ".join(f"{name} ({size:,} chars): {cost:.2f} ms/KB" for cost, name, size in over[:5])
    assert not over, (
        f"{what or fn!r} is over {ms_per_kb} ms of CPU per KB on {len(over)} inputs: {shown}"
    )
