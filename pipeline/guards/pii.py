"""PII detection: typed findings with spans in the original text, and redaction.

Kinds: `email` (plain and obfuscated: "name [at] example [dot] com" and the other shapes of
`pii_email`); `phone` (international +CC, 00CC, and the national shapes of `pii_checks`);
`card` (13-19 digits, Luhn, a network's first digit, not an ISBN-13; grouped by spaces, hyphens,
dots, slashes or underscores, mixed too: the last three only in a card's own grouping, 4-4-4-4,
4-6-5...); `iban` (country length and mod 97, any case, the same separators: with lower-case
letters only compact or in groups of four); `ip` (IPv4 with valid octets, IPv6; loopback and
unspecified addresses are not personal); `national_id` (US SSN with its never-issued ranges
excluded, Brazilian CPF with its check digits, UK National Insurance number).

Look-alikes that pass: dates, order/invoice/ticket numbers (a phone-shaped number right after
such a word is not a phone), version strings (an IP-looking string right after "version",
"v", "build" or "release" is a version), ISBNs (checksummed ISBN-13s are not cards; an ISBN-10
is no card, phone or IBAN shape), timestamps and prices (no shape matches them).

Matching runs on the canonical text (`normalize.CanonicalText`), so fullwidth digits, zero-width
characters and homoglyphs do not hide a number; spans are mapped back to the original text.

Every pattern is written so a match can only start where its run starts (the lookbehinds
forbid starting inside a run the pattern could have extended over) and must end where its run
ends (the lookaheads): matches of one pattern never overlap, and what is found from offset `pos`
does not depend on text before `pos - CONTEXT`. The streaming redactor relies on this to scan
only new text and still agree exactly with a scan of the whole answer. No pattern crosses the
end of a run of `segments` (an obfuscated e-mail's spaces and a lower-case IBAN's "gb82 west"
are among the spaces it links).

Every pattern runs in linear time: bounded repetitions that cannot overlap one another, and
starts limited by lookbehinds (`tests/pipeline/guards/test_pii_timing.py` times each one on
inputs built to make a backtracking engine stumble).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from pipeline.guards import pii_checks as checks
from pipeline.guards import pii_email
from pipeline.guards.normalize import CanonicalText, canonicalize

PiiKind = Literal["email", "phone", "card", "iban", "ip", "national_id"]
PII_KINDS: tuple[PiiKind, ...] = ("email", "phone", "card", "iban", "ip", "national_id")
TOKENS: dict[str, str] = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "iban": "[IBAN]",
    "ip": "[IP]",
    "national_id": "[NATIONAL_ID]",
    "blocked": "[BLOCKED]",
}
# Overlaps are resolved in this order (a Luhn-valid card beats the phone shape it also fits).
PRIORITY: dict[str, int] = {
    "blocked": 7, "card": 6, "iban": 5, "national_id": 4, "email": 3, "ip": 2, "phone": 1,
}  # fmt: skip
CONTEXT = checks.CONTEXT  # canonical characters before a match that its rules may look at
MAX_MATCH = 256  # no pattern matches more canonical characters inside one run than this


@dataclass(frozen=True, slots=True)
class Candidate:
    """A validated match in canonical offsets."""

    kind: str
    start: int
    end: int
    score: float
    detail: str = ""


@dataclass(slots=True)
class Scan:
    """What one scan saw: validated matches, and the extent of every pattern match (valid or
    not), which the streaming redactor must never cut through."""

    found: list[Candidate] = field(default_factory=list)
    extents: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PiiFinding:
    """One piece of PII: its kind, its span in the original text, and a confidence in [0, 1]."""

    kind: PiiKind
    start: int
    end: int
    score: float
    detail: str = ""


_before = checks.context_before

_NOT_PHONE = re.compile(
    r"(?:\b(?:order|invoice|ref|reference|ticket|tracking|isbn|issn|pedido|encomenda|fatura"
    r"|factura|protocolo|serial|sku|model|account|acct|conta|cuenta|commande|bestellung"
    r"|rechnung|version|versao|build|id)\b(?:\W+\w+)?|#|\bn[o\u00ba]\.?)\W{0,3}$"
)
_PHONE_WORD = re.compile(
    r"\b(?:phone|tel|telephone|call|mobile|cell|whatsapp|fax|sms|telefone|celular|ligue"
    r"|contato|contact|telefono|movil|telephone|portable|handy|rufnummer)\b[^\d]{0,16}$"
)
_VERSION_WORD = re.compile(
    r"\b(?:version|versao|ver|release|build|firmware|fw|v)\b(?:\W+(?:is|e|es|est|ist))?\W{0,3}$"
)
_SSN_WORD = re.compile(r"\b(?:ssn|social security(?: number| no)?)\b(?:\W+is)?\W{0,6}$")
_CPF_WORD = re.compile(r"\bcpf\b(?:\W+(?:e|is))?\W{0,6}$")

SEPARATORS = " ./_-"  # what may stand between the groups of a card number or an IBAN
_SEP = "[ ./_-]"
_CARD_RUN = re.compile(rf"(?<!\d)(?<!\d{_SEP})\d(?:{_SEP}?\d){{0,30}}+(?!{_SEP}?\d)")
# A card's own groupings, the only ones accepted with dots, slashes or underscores.
_CARD_GROUPINGS = frozenset({(4, 4, 4, 4), (4, 4, 4, 4, 3), (4, 6, 5), (4, 6, 4)})
_PHONE_STEP = r"(?:[ .-]|\)[ .-]?|[ .-]?\()?\d"
_PHONE_RUN = re.compile(
    r"(?:(?<![\w+])\+|(?<![\w+().-])(?<![\d)] ))\(?\d"
    rf"(?:{_PHONE_STEP}){{0,24}}(?!{_PHONE_STEP})"
)
_IBAN_START = re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}\d{2}")
_NINO = re.compile(
    r"(?<![A-Za-z0-9])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?\d{2} ?\d{2} ?\d{2} ?[A-D]"
    r"(?![A-Za-z0-9])"
)
_SSN = re.compile(r"(?<![\d-])(?<!\d )(\d{3})([ -]?)(\d{2})\2(\d{4})(?![\d-])(?! \d)")
_CPF = re.compile(r"(?<![\d.-])(\d{3}\.\d{3}\.\d{3}-\d{2}|\d{11})(?![\d-])(?!\.\d)")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w)(?!\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?=[0-9A-Fa-f.]*:[0-9A-Fa-f.]*:)[0-9A-Fa-f:.]{2,45}(?![\w:.%])")


def _email(text: str, pos: int, scan: Scan) -> None:
    if text.find("@", pos) >= 0:
        for start, end, valid_end in pii_email.plain(text, pos):
            scan.extents.append((start, end))
            if valid_end is not None:
                scan.found.append(Candidate("email", start, valid_end, 0.95))
    for start, end, valid in pii_email.obfuscated(text, pos):
        scan.extents.append((start, end))
        if valid:
            scan.found.append(Candidate("email", start, end, 0.9, "obfuscated"))


Span = tuple[int, int]


def _groups(run: str, sep: str) -> list[Span]:
    """Spans of the pieces of `run` between separators (any character of `sep`)."""
    return [m.span() for m in re.finditer(rf"[^{re.escape(sep)}]+", run)]


def _windows(
    run: str, groups: list[tuple[int, int]], accept: Callable[[str, int, int], float]
) -> Iterator[tuple[int, int, float]]:
    """Leftmost-longest runs of whole groups that `accept` (window, first group, end group)
    scores above 0, without overlaps."""
    i = 0
    while i < len(groups):
        for j in range(len(groups), i, -1):
            start, end = groups[i][0], groups[j - 1][1]
            score = accept(run[start:end], i, j)
            if score > 0:
                yield start, end, score
                i = j
                break
        else:
            i += 1


_SPLIT = re.compile(_SEP)


_GLUE = "./_"  # a number that goes on after one of these is a decimal, a version, a path


def _card_window(window: str) -> float:
    parts = _SPLIT.split(window)
    if min(map(len, parts)) < 3:  # lists of small numbers are not cards
        return 0.0
    odd = set(_SPLIT.findall(window)) - {" ", "-"}
    if odd and tuple(map(len, parts)) not in _CARD_GROUPINGS:
        return 0.0  # decimals, versions, dates and paths are grouped otherwise
    return 0.95 if checks.card_ok("".join(parts)) else 0.0


def _card(text: str, pos: int, scan: Scan) -> None:
    for m in _CARD_RUN.finditer(text, pos):
        scan.extents.append(m.span())
        run = m.group()
        if m.end() - m.start() < 13:
            continue  # fewer digits than any card has
        groups = _groups(run, SEPARATORS)

        def accept(
            window: str, i: int, j: int, run: str = run, groups: list[Span] = groups
        ) -> float:
            (start, _), (_, end) = groups[i], groups[j - 1]
            if (start and run[start - 1] in _GLUE) or (end < len(run) and run[end] in _GLUE):
                return 0.0  # "2.2719650530458397", "4111111111111111.5": not a card
            return _card_window(window)

        for s, e, score in _windows(run, groups, accept):
            scan.found.append(Candidate("card", m.start() + s, m.start() + e, score))


_PHONE_DIGITS = 8  # the fewest digits `checks.phone_score` accepts


def _phone(text: str, pos: int, scan: Scan) -> None:
    for m in _PHONE_RUN.finditer(text, pos):
        scan.extents.append(m.span())
        if m.end() - m.start() < _PHONE_DIGITS:
            continue  # fewer characters than any phone number has digits
        before = _before(text, m.start())
        if text[m.start()] != "+" and _NOT_PHONE.search(before):
            continue  # "order 12345678", "#12345678"; but "+44 ..." is a phone after any word
        context = bool(_PHONE_WORD.search(before))

        def accept(window: str, index: int, _: int, context: bool = context) -> float:
            if window.startswith("+") and index:
                return 0.0
            return checks.phone_score(window, context=context and index == 0)

        run = m.group()
        for s, e, score in _windows(run, _groups(run, " "), accept):
            scan.found.append(Candidate("phone", m.start() + s, m.start() + e, score))


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _iban(text: str, pos: int, scan: Scan) -> None:
    for m in _IBAN_START.finditer(text, pos):
        want = checks.IBAN_LENGTHS.get(m.group()[:2].upper())
        if want is None:
            continue
        chars: list[str] = []
        groups = [0]
        j = m.start()
        while j < len(text) and len(chars) < want:
            c = text[j]
            if _alnum(c):
                chars.append(c)
                groups[-1] += 1
            elif c in SEPARATORS and j + 1 < len(text) and _alnum(text[j + 1]):
                if c == " " and _letters_apart(text[j - 1], text[j + 1]):
                    break
                groups.append(0)
            else:
                break
            j += 1
        scan.extents.append((m.start(), j))
        bounded = j == len(text) or not _alnum(text[j])
        compact = "".join(chars)
        valid = len(chars) == want and bounded and _iban_grouping_ok(compact, groups)
        if valid and checks.iban_ok(compact.upper()):
            scan.found.append(Candidate("iban", m.start(), j, 0.97))


def _letters_apart(left: str, right: str) -> bool:
    """Two letters, one of them lower-case, around a space: prose, never inside one IBAN
    (and a space `segments` does not link)."""
    return left.isalpha() and right.isalpha() and (left.islower() or right.islower())


def _iban_grouping_ok(compact: str, groups: list[int]) -> bool:
    """Upper case in any grouping; with lower-case letters, compact or in groups of four (a
    lower-case IBAN is rarer, and prose words can line up to the right length)."""
    if not any(c.islower() for c in compact) or len(groups) == 1:
        return True
    return all(g == 4 for g in groups[:-1]) and 0 < groups[-1] <= 4


def _national_id(text: str, pos: int, scan: Scan) -> None:
    for m in _NINO.finditer(text, pos):
        scan.extents.append(m.span())
        if checks.nino_ok(m.group(1)):
            scan.found.append(Candidate("national_id", *m.span(), 0.85, "uk_nino"))
    for m in _SSN.finditer(text, pos):
        scan.extents.append(m.span())
        plain = m.group(2) == "-" or _SSN_WORD.search(_before(text, m.start()))
        if plain and checks.ssn_ok(m.group(1), m.group(3), m.group(4)):
            scan.found.append(Candidate("national_id", *m.span(), 0.85, "us_ssn"))
    for m in _CPF.finditer(text, pos):
        scan.extents.append(m.span())
        formatted = "." in m.group()
        digits = m.group().replace(".", "").replace("-", "")
        if (formatted or _CPF_WORD.search(_before(text, m.start()))) and checks.cpf_ok(digits):
            scan.found.append(Candidate("national_id", *m.span(), 0.9, "br_cpf"))


def _ip(text: str, pos: int, scan: Scan) -> None:
    for m in _IPV4.finditer(text, pos):
        scan.extents.append(m.span())
        if checks.ipv4_ok(m.group()) and not _VERSION_WORD.search(_before(text, m.start())):
            scan.found.append(Candidate("ip", *m.span(), 0.85, "ipv4"))
    for m in _IPV6.finditer(text, pos):
        scan.extents.append(m.span())
        address = m.group().rstrip(".")
        if checks.ipv6_ok(address):
            scan.found.append(Candidate("ip", m.start(), m.start() + len(address), 0.85, "ipv6"))


_SCANNERS: dict[str, Callable[[str, int, Scan], None]] = {
    "email": _email,
    "phone": _phone,
    "card": _card,
    "iban": _iban,
    "ip": _ip,
    "national_id": _national_id,
}


_DIGIT = re.compile(r"\d")


def scan(text: str, pos: int = 0, kinds: Collection[str] = PII_KINDS) -> Scan:
    """Scan canonical `text` from `pos` (earlier text is only looked at as context)."""
    result = Scan()
    # Every kind but email needs a digit (an IPv6 address too, see `ipv6_ok`).
    has_digit = _DIGIT.search(text, pos) is not None
    for kind in kinds:
        if has_digit or kind == "email":
            _SCANNERS[kind](text, pos, result)
    return result


def _rank(c: Candidate) -> tuple[int, int, int]:
    return (-PRIORITY[c.kind], c.start - c.end, c.start)


def resolve(found: list[Candidate]) -> list[Candidate]:
    """Non-overlapping matches, by start: matches that overlap become one that spans them all,
    of the kind that ranks first (priority, then the longer, then the earlier), so no character
    of any match is left out ("jane.doe@" of an address with a blocked term at its end)."""
    merged: list[Candidate] = []
    best: Candidate | None = None
    for cand in sorted(found, key=lambda c: (c.start, c.end)):
        if merged and cand.start < merged[-1].end:
            assert best is not None
            best = min(best, cand, key=_rank)
            end = max(merged[-1].end, cand.end)
            merged[-1] = Candidate(best.kind, merged[-1].start, end, best.score, best.detail)
        else:
            best = cand
            merged.append(cand)
    return merged


def to_findings(canon: CanonicalText, found: list[Candidate]) -> list[PiiFinding]:
    """Map canonical matches back to spans of the original text."""
    findings = []
    for c in found:
        start, end = canon.original_span(c.start, c.end)
        findings.append(PiiFinding(c.kind, start, end, c.score, c.detail))  # type: ignore[arg-type]
    return findings


def find_pii(text: str, kinds: Collection[str] = PII_KINDS) -> list[PiiFinding]:
    """Every PII finding in `text`, spans in `text`'s own offsets, in order."""
    canon = canonicalize(text)
    return to_findings(canon, resolve(scan(canon.text, 0, kinds).found))


def redact(text: str, findings: Collection[PiiFinding | Candidate]) -> str:
    """`text` with each finding's span replaced by its token (`[EMAIL]`, `[PHONE]`, ...)."""
    out, last = [], 0
    for f in sorted(findings, key=lambda f: f.start):
        if f.start < last:
            continue
        out += [text[last : f.start], TOKENS[f.kind]]
        last = f.end
    out.append(text[last:])
    return "".join(out)
