"""Canonical text for detection: what the detectors look at, never what is sent on.

Two forms:

- `CanonicalText` (for PII and output redaction): every original character is mapped on its own
  to zero or more canonical characters -- NFKC, format and control characters (zero-width
  spaces, joiners, bidi controls, tag characters, variation selectors) removed, look-alikes of
  Latin letters and digits in any script folded to them (`look_alikes`, from Unicode's
  confusables data), every decimal digit of any script turned into 0-9, lone
  surrogates turned into U+FFFD, every whitespace run squashed to one space -- and each
  canonical character remembers the index of the original character it came from. Detectors
  match on the canonical text and report spans in the original text through that map, so
  redaction always cuts the original (obfuscations included) and never rewrites what it keeps.
  Mapping character by character (rather than normalising the whole string) is what lets the
  streaming redactor canonicalise chunk by chunk and get exactly the same result.
- `fold()` (for injection rules): the canonical text, accents stripped, case-folded.

`hidden_views()` decodes what may be smuggled inside a text (base64, hex, URL-encoding, rot13,
reversed text, Unicode tag characters) so injection rules can read the decoded text too.

Every pattern here runs in time linear in the text: those with repetition over canonical text
on RE2 (`linear`); those that read raw text, which may hold lone surrogates RE2 cannot take,
stay on `re` and are single characters or fixed alternatives, or use possessive quantifiers
only, so Python's engine has nothing to retry (tests/pipeline/guards/test_linear_time.py).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import itertools
import re
import unicodedata
import urllib.parse
from collections.abc import Callable

from pipeline.guards.linear import Regex, compile_linear

# Typographic quotes and dashes: "don’t" must read as "don't", "555–123–4567" as a phone.
_PUNCTUATION = dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'")
_PUNCTUATION.update(dict.fromkeys("\u201c\u201d\u201e\u201f\u2033", '"'))
_PUNCTUATION.update(dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"))
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
# Invisible characters that are not format characters (fillers, blanks, grapheme joiner).
_INVISIBLE = frozenset({0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0})
# Printable ASCII other than space maps to itself: the fast path of `CanonicalText.extend`.
_ASCII_SAME = frozenset(chr(c) for c in range(0x21, 0x7F))
# Runs copied as they are: printable ASCII, single spaces inside (no space at either end).
# It reads raw text (lone surrogates included, which RE2 cannot take), so it stays on `re`, with
# possessive quantifiers: there is one way to read each character and nothing is ever retried.
_ASCII_RUN = re.compile(r"[\x21-\x7e]++(?: [\x21-\x7e]++)*+|.", re.DOTALL)


def _is_invisible(cp: int, category: str) -> bool:
    return (
        category in ("Cf", "Cc", "Zl", "Zp")
        or cp in _INVISIBLE
        or 0xFE00 <= cp <= 0xFE0F
        or 0xE0100 <= cp <= 0xE01EF
    )


def _plain_ascii(raw: str) -> bool:
    """Printable ASCII without doubled spaces: already canonical, character for character."""
    return raw.isascii() and raw.isprintable() and "  " not in raw


@functools.cache
def look_alikes() -> dict[str, str]:
    """Every character that Unicode's confusables data (UTS #39, through the
    `confusable-homoglyphs` package) draws like one ASCII letter or digit, mapped to it, plus
    typographic quotes and dashes: Cyrillic "а", Greek "ο", Armenian "օ", Cherokee "Ꭺ", Roman
    numerals, APL symbols... Built once, on first use (the data file takes ~70 ms to load).

    The data's "l" stands for the whole I/l/1/| family; a capital letter of it or a letter
    named I or iota (Greek "Ι", Cyrillic "І", Lisu "ꓲ") becomes "I", as the word it hides in
    reads ("Ιgnore"). Decimal digits of any script are not taken from here: `canonical_char`
    gives them their value ("৪" is 4, not 8)."""
    from confusable_homoglyphs.confusables import confusables_data

    table = dict(_PUNCTUATION)
    for prototype in _ALNUM:
        for entry in confusables_data.get(prototype, ()):
            char = entry["c"]
            if len(char) == 1 and not char.isascii():
                table[char] = _capital_i(char) if prototype == "l" else prototype
    return table


def _capital_i(char: str) -> str:
    name = unicodedata.name(char, "")
    capital = unicodedata.category(char) == "Lu" or name.endswith(" I")
    return "I" if capital or "IOTA" in name or "IAUDA" in name else "l"


def _fold_char(c: str) -> str:
    if c.isascii():
        return c
    digit = unicodedata.decimal(c, None)
    if digit is not None:
        return str(digit)
    return look_alikes().get(c, c)


@functools.lru_cache(maxsize=16384)
def canonical_char(ch: str) -> str:
    """The canonical form of one character: '' for invisible ones, ' ' for any whitespace."""
    cp = ord(ch)
    if 0xD800 <= cp <= 0xDFFF:  # a lone surrogate (JSON can carry them): keep a placeholder
        return "\ufffd"
    if ch.isspace():
        return " "
    if _is_invisible(cp, unicodedata.category(ch)):
        return ""
    nfkc = unicodedata.normalize("NFKC", ch)
    if not nfkc.isascii() and unicodedata.decimal(ch, None) is None and ch in look_alikes():
        return look_alikes()[ch]  # a look-alike NFKC would turn into another non-Latin letter
    out = []
    for c in nfkc:
        if c.isspace():
            out.append(" ")
        elif not _is_invisible(ord(c), unicodedata.category(c)):
            out.append(_fold_char(c))
    return "".join(out)


class CanonicalText:
    """Canonical text built from original text, with the map back to original offsets.

    `origin[i]` is the index (counted from the first character ever given to `extend`) of the
    original character that canonical character `i` came from. `drop_before` forgets a prefix,
    which the streaming redactor uses to keep only a bounded left context.
    """

    __slots__ = ("origin", "source_length", "text")

    def __init__(self, text: str = "") -> None:
        self.text = ""
        self.origin: list[int] = []
        self.source_length = 0
        if text:
            self.extend(text)

    def extend(self, raw: str) -> None:
        """Append the canonical form of `raw`, which follows what was given before."""
        base = self.source_length
        self.source_length += len(raw)
        if _plain_ascii(raw) and not (raw[:1] == " " and self.text[-1:] == " "):
            self.text += raw
            self.origin.extend(range(base, base + len(raw)))
            return
        parts: list[str] = []
        for run in _ASCII_RUN.finditer(raw):
            start, end = run.span()
            if end - start > 1:  # printable ASCII with single spaces inside: already canonical
                parts.append(run.group())
                self.origin.extend(range(base + start, base + end))
            else:
                self._one(raw[start], base + start, parts)
        self.text += "".join(parts)

    def _one(self, ch: str, at: int, parts: list[str]) -> None:
        last_space = (parts[-1][-1:] if parts else self.text[-1:]) == " "
        for c in canonical_char(ch):
            if c == " ":
                if last_space:
                    continue
                last_space = True
            else:
                last_space = False
            parts.append(c)
            self.origin.append(at)

    def original_index(self, index: int) -> int:
        """The original offset where canonical offset `index` starts (the end maps to the end)."""
        return self.origin[index] if index < len(self.origin) else self.source_length

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original span covering canonical characters [start, end)."""
        return self.origin[start], self.origin[end - 1] + 1

    def drop_before(self, index: int) -> None:
        """Forget canonical characters before `index` (their offsets stay as they were)."""
        del self.origin[:index]
        self.text = self.text[index:]


_SURROGATE = re.compile("[\ud800-\udfff]")  # one character: nothing to retry


def scrub_surrogates(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD: what a tokenizer, an encoder to UTF-8 or
    Redis can take (they raise on them). JSON can carry them ("\\ud800"), so request text can."""
    return _SURROGATE.sub("\ufffd", text)


def canonicalize(text: str) -> CanonicalText:
    """The canonical form of `text` with its offset map."""
    return CanonicalText(text)


_LINE_BREAK = re.compile(r"\r\n|[\n\r\x0b\x0c\x85\u2028\u2029]")


# What stripping accents removes: combining marks of Latin, Greek and Cyrillic accents, Hebrew
# points, Arabic vowel marks and the tatweel that stretches Arabic words ("تجـــاهل"). A character
# class without quantifiers: `re` cannot backtrack on it.
_COMBINING = re.compile(
    "[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
    "\u0591-\u05bd\u05bf\u05c1\u05c2\u05c4\u05c5\u05c7\u0610-\u061a\u0640\u064b-\u065f\u0670]"
)


def canonical_lines(text: str) -> list[str]:
    """The canonical text of each line (line breaks are the one whitespace kept apart): what
    `CanonicalText` makes of it, less the offset map, which detection of injections has no use
    for (building it costs a list entry per canonical character, and one character can make 18)."""
    return [_canonical_line(line) for line in _LINE_BREAK.split(text)]


def _canonical_line(line: str) -> str:
    if _plain_ascii(line):
        return line.strip(" ")
    # canonical_char turns every whitespace into " ": split() squashes the runs and the ends.
    return " ".join("".join(map(canonical_char, line)).split())


def fold_lines(lines: list[str]) -> str:
    """`fold` of text already split by `canonical_lines`."""
    canon = "\n".join(lines)
    if canon.isascii():
        return canon.lower()
    return _COMBINING.sub("", unicodedata.normalize("NFKD", canon)).casefold()


def fold(text: str) -> str:
    """Canonical text without accents, case-folded, line breaks kept (chat-turn markers sit at
    line starts): what injection rules are written against."""
    return fold_lines(canonical_lines(text))


# --- smuggled encodings -------------------------------------------------------------------------

_MAX_VIEW_INPUT = 20_000
_MAX_RUNS = 8
# RE2 (linear time) over canonical text. Matches are taken left to right and each run is read
# whole, so a match starts where a run starts: what Python's lookbehinds said.
_BASE64_RUN = compile_linear(r"[A-Za-z0-9+/]{16,}={0,2}|[A-Za-z0-9_-]{16,}={0,2}")
_HEX_RUN = compile_linear(r"(?:\\x[0-9a-fA-F]{2}){6,}|(?:0x)?(?:[0-9a-fA-F]{2}[ :-]?){8,}")
_PERCENT = compile_linear(r"%[0-9A-Fa-f]{2}")
_UNICODE_ESCAPES = compile_linear(r"(?:\\u[0-9a-fA-F]{4}){4,}")


def readable(text: str) -> bool:
    """Does decoded text look like words rather than bytes?"""
    if len(text) < 4 or not all(c.isprintable() or c in "\n\t\r" for c in text):
        return False
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * len(text.replace(" ", "")) and " " in text.strip()


def _decode_base64(run: str) -> str | None:
    padded = run.rstrip("=") + "=" * (-len(run.rstrip("=")) % 4)
    try:
        if "-" in run or "_" in run:
            raw = base64.urlsafe_b64decode(padded)
        else:
            raw = base64.b64decode(padded, validate=True)
        return raw.decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None


def _decode_hex(run: str) -> str | None:
    digits = re.sub(r"\\x|0x|[ :-]", "", run)
    try:
        return bytes.fromhex(digits[: len(digits) // 2 * 2]).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def _decoded_runs(text: str, pattern: Regex, decode: Callable[[str], str | None]) -> list[str]:
    out = []
    for match in itertools.islice(pattern.finditer(text), _MAX_RUNS):
        decoded = decode(match.group())
        if decoded is not None and readable(decoded):
            out.append(decoded)
    return out


_TAG = re.compile("[\U000e0020-\U000e007e]++")  # reads raw text: `re`, possessive
_ASCII_LETTER = re.compile("[A-Za-z]")  # one character: nothing to retry


def _tag_payload(raw: str) -> str:
    """Text hidden in Unicode tag characters (U+E0020..U+E007E spell invisible ASCII)."""
    return "".join(chr(ord(c) - 0xE0000) for run in _TAG.findall(raw) for c in run)


def hidden_views(raw: str, canon: str, *, ciphers: bool = True) -> list[tuple[str, str]]:
    """(encoding, decoded text) for each smuggled payload found in `raw` / its canonical form.

    With `ciphers`, rot13 and reversed views of texts with letters are added: any text has
    them, so the caller decides when they are worth reading.
    """
    text = canon[:_MAX_VIEW_INPUT]
    views: list[tuple[str, str]] = []
    views += [("base64", s) for s in _decoded_runs(text, _BASE64_RUN, _decode_base64)]
    views += [("hex", s) for s in _decoded_runs(text, _HEX_RUN, _decode_hex)]
    if "%" in text and len(list(itertools.islice(_PERCENT.finditer(text), 2))) == 2:
        views.append(("url", urllib.parse.unquote(text, errors="replace")))
    for match in itertools.islice(_UNICODE_ESCAPES.finditer(text), _MAX_RUNS):
        views.append(("unicode_escape", codecs.decode(match.group(), "unicode_escape")))
    tags = _tag_payload(raw[: _MAX_VIEW_INPUT * 2])
    if tags.strip():
        views.append(("tags", tags))
    if ciphers and _ASCII_LETTER.search(text):
        views.append(("rot13", codecs.decode(text, "rot13")))
        views.append(("reversed", text[::-1]))
    return views
