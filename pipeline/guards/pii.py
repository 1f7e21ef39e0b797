"""PII detection: typed findings with spans in the original text, and redaction.

Kinds: `email`; `phone` (international +CC, 00CC, and the national shapes of `pii_checks`);
`card` (13-19 digits, Luhn, a network's first digit, not an ISBN-13); `iban` (country length
and mod 97); `ip` (IPv4 with valid octets, IPv6; loopback and unspecified addresses are not
personal); `national_id` (US SSN with its never-issued ranges excluded, Brazilian CPF with its
check digits, UK National Insurance number).

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
only new text and still agree exactly with a scan of the whole answer.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from pipeline.guards import pii_checks as checks
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
CONTEXT = 32  # canonical characters before a match that its rules may look at
MAX_MATCH = 256  # no pattern matches more canonical characters than this


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


def _before(text: str, start: int) -> str:
    """The few characters before `start`, lower-case and without accents, for context words."""
    window = text[max(0, start - CONTEXT) : start]
    if not window.isascii():
        decomposed = unicodedata.normalize("NFKD", window)
        window = "".join(c for c in decomposed if not unicodedata.combining(c))
    return window.lower()


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

_EMAIL = re.compile(r"(?<![\w.%+@-])[\w.%+-]{1,64}@[\w.-]{1,190}(?![\w.%+@-])")
_CARD_RUN = re.compile(r"(?<!\d)(?<!\d[ -])\d(?:[ -]?\d){0,30}(?![ -]?\d)")
_PHONE_STEP = r"(?:[ .-]|\)[ .-]?|[ .-]?\()?\d"
_PHONE_RUN = re.compile(
    r"(?:(?<![\w+])\+|(?<![\w+().-])(?<![\d)] ))\(?\d"
    rf"(?:{_PHONE_STEP}){{0,24}}(?!{_PHONE_STEP})"
)
_IBAN_START = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}")
_NINO = re.compile(
    r"(?<![A-Za-z0-9])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?\d{2} ?\d{2} ?\d{2} ?[A-D]"
    r"(?![A-Za-z0-9])"
)
_SSN = re.compile(r"(?<![\d-])(?<!\d )(\d{3})([ -]?)(\d{2})\2(\d{4})(?![\d-])(?! \d)")
_CPF = re.compile(r"(?<![\d.-])(\d{3}\.\d{3}\.\d{3}-\d{2}|\d{11})(?![\d-])(?!\.\d)")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w)(?!\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?=[0-9A-Fa-f.]*:[0-9A-Fa-f.]*:)[0-9A-Fa-f:.]{2,45}(?![\w:.%])")


def _email(text: str, pos: int, scan: Scan) -> None:
    for m in _EMAIL.finditer(text, pos):
        scan.extents.append(m.span())
        address = m.group().rstrip(".-")
        local, _, domain = address.partition("@")
        labels = domain.split(".")
        if (
            local[0] != "."
            and local[-1] != "."
            and ".." not in address
            and len(labels) >= 2
            and all(0 < len(x) <= 63 and x[0] != "-" and x[-1] != "-" for x in labels)
            and labels[-1].isalpha()
            and len(labels[-1]) >= 2
        ):
            scan.found.append(Candidate("email", m.start(), m.start() + len(address), 0.95))


def _groups(run: str, sep: str) -> list[tuple[int, int]]:
    """Spans of the pieces of `run` between separators (any character of `sep`)."""
    return [m.span() for m in re.finditer(rf"[^{re.escape(sep)}]+", run)]


def _windows(
    run: str, groups: list[tuple[int, int]], accept: Callable[[str, int], float]
) -> Iterator[tuple[int, int, float]]:
    """Leftmost-longest runs of whole groups that `accept` scores above 0, without overlaps."""
    i = 0
    while i < len(groups):
        for j in range(len(groups), i, -1):
            start, end = groups[i][0], groups[j - 1][1]
            score = accept(run[start:end], i)
            if score > 0:
                yield start, end, score
                i = j
                break
        else:
            i += 1


def _card_window(window: str, _: int) -> float:
    parts = re.split(r"[ -]", window)
    if min(map(len, parts)) < 3:  # lists of small numbers are not cards
        return 0.0
    return 0.95 if checks.card_ok("".join(parts)) else 0.0


def _card(text: str, pos: int, scan: Scan) -> None:
    for m in _CARD_RUN.finditer(text, pos):
        scan.extents.append(m.span())
        run = m.group()
        for s, e, score in _windows(run, _groups(run, " -"), _card_window):
            scan.found.append(Candidate("card", m.start() + s, m.start() + e, score))


def _phone(text: str, pos: int, scan: Scan) -> None:
    for m in _PHONE_RUN.finditer(text, pos):
        scan.extents.append(m.span())
        before = _before(text, m.start())
        if _NOT_PHONE.search(before):
            continue
        context = bool(_PHONE_WORD.search(before))

        def accept(window: str, index: int, context: bool = context) -> float:
            if window.startswith("+") and index:
                return 0.0
            return checks.phone_score(window, context=context and index == 0)

        run = m.group()
        for s, e, score in _windows(run, _groups(run, " "), accept):
            scan.found.append(Candidate("phone", m.start() + s, m.start() + e, score))


def _iban(text: str, pos: int, scan: Scan) -> None:
    for m in _IBAN_START.finditer(text, pos):
        want = checks.IBAN_LENGTHS.get(m.group()[:2])
        if want is None:
            continue
        chars: list[str] = []
        j = m.start()
        while j < len(text) and len(chars) < want:
            c = text[j]
            if c.isascii() and (c.isdigit() or c.isupper()):
                chars.append(c)
            elif not (c == " " and j + 1 < len(text) and text[j + 1].isalnum()):
                break
            j += 1
        scan.extents.append((m.start(), j))
        bounded = j == len(text) or not (text[j].isascii() and text[j].isalnum())
        if len(chars) == want and bounded and checks.iban_ok("".join(chars)):
            scan.found.append(Candidate("iban", m.start(), j, 0.97))


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
    # Every kind but email needs a digit (an IPv6 address too, see `ipv6_ok`); email needs "@".
    has_digit = _DIGIT.search(text, pos) is not None
    for kind in kinds:
        if has_digit if kind != "email" else text.find("@", pos) >= 0:
            _SCANNERS[kind](text, pos, result)
    return result


def resolve(found: list[Candidate]) -> list[Candidate]:
    """Non-overlapping matches: higher priority first, then longer, then earlier; by start."""
    kept: list[Candidate] = []
    for cand in sorted(found, key=lambda c: (-PRIORITY[c.kind], c.start - c.end, c.start)):
        if all(cand.end <= k.start or cand.start >= k.end for k in kept):
            kept.append(cand)
    return sorted(kept, key=lambda c: c.start)


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
