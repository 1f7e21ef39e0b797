"""Checksums and shapes that tell real identifiers from look-alikes.

Pure functions over canonical strings (ASCII digits and letters). Used by `pii.py`.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata

CONTEXT = 32  # canonical characters before a match that its rules may look at

# IBAN length per country (SWIFT IBAN registry).
IBAN_LENGTHS: dict[str, int] = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26,
    "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20,
    "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18,
    "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24,
    "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23, "TN": 24,
    "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}  # fmt: skip


def context_before(text: str, start: int) -> str:
    """The `CONTEXT` characters before `start`, lower-case and without accents, for the
    context words of some rules ("phone", "ssn", "email")."""
    window = text[max(0, start - CONTEXT) : start]
    if not window.isascii():
        decomposed = unicodedata.normalize("NFKD", window)
        window = "".join(c for c in decomposed if not unicodedata.combining(c))
    return window.lower()


def luhn_ok(digits: str) -> bool:
    """The Luhn (mod 10) check of payment card numbers."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def isbn13_ok(digits: str) -> bool:
    """An ISBN-13 (EAN-13 with a 978/979 prefix): weights 1,3,1,3... sum to a multiple of 10."""
    if len(digits) != 13 or digits[:3] not in ("978", "979"):
        return False
    return sum((3 if i % 2 else 1) * (ord(c) - 48) for i, c in enumerate(digits)) % 10 == 0


def card_ok(digits: str) -> bool:
    """13-19 digits, a card network's first digit (2-6), the Luhn check, and not an ISBN-13."""
    return (
        13 <= len(digits) <= 19
        and digits[0] in "23456"
        and len(set(digits)) > 1
        and luhn_ok(digits)
        and not isbn13_ok(digits)
    )


def iban_ok(compact: str) -> bool:
    """Country length and the ISO 13616 mod-97 check (the rearranged number mod 97 is 1)."""
    if IBAN_LENGTHS.get(compact[:2]) != len(compact) or compact[2:4] in ("00", "01", "99"):
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


def ssn_ok(area: str, group: str, serial: str) -> bool:
    """US SSN: area not 000, 666 or 900-999; group not 00; serial not 0000."""
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def cpf_ok(digits: str) -> bool:
    """Brazilian CPF: 11 digits whose last two are the mod-11 check digits."""
    if len(digits) != 11 or len(set(digits)) == 1:
        return False
    values = [ord(c) - 48 for c in digits]
    for n in (9, 10):
        total = sum(v * (n + 1 - i) for i, v in enumerate(values[:n]))
        if (total * 10 % 11) % 10 != values[n]:
            return False
    return True


_NINO_BAD_PREFIXES = frozenset({"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"})


def nino_ok(prefix: str) -> bool:
    """UK National Insurance number prefixes that are never issued."""
    return prefix not in _NINO_BAD_PREFIXES


def ipv4_ok(text: str) -> bool:
    """Four octets 0-255 without leading zeros, not loopback, unspecified or broadcast."""
    parts = text.split(".")
    if len(parts) != 4 or any(len(p) > 1 and p[0] == "0" for p in parts):
        return False
    if any(int(p) > 255 for p in parts):
        return False
    return parts[0] not in ("0", "127") and text != "255.255.255.255"


def ipv6_ok(text: str) -> bool:
    """A valid IPv6 address with a decimal digit and two non-empty groups, not loopback/unspecified.

    The digit and group rules keep C++/Rust paths (`a::b`) and words made of hex letters out.
    """
    if not any(c.isdigit() for c in text) or sum(1 for g in text.split(":") if g) < 2:
        return False
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_unspecified)


# National phone shapes (a separator or parentheses required; bare digit runs need context).
_NATIONAL_SHAPES = [
    re.compile(p)
    for p in (
        r"\(?\d{3}\)?[ .-]?\d{3}[ .-]\d{4}",  # North America: (555) 123-4567, 555.123.4567
        r"\(\d{2}\) ?9?\d{4}[ -]?\d{4}",  # Brazil: (11) 91234-5678
        r"\d{2} 9?\d{4}-\d{4}",  # Brazil: 11 91234-5678
        r"0\d{2,4} \d{3,4} ?\d{3,4}",  # UK: 020 7946 0958, 07700 900123
        r"0[1-9](?:[ .]\d{2}){4}",  # France: 01 23 45 67 89
        r"[2-9]\d{2} \d{3} \d{3}",  # Portugal: 912 345 678
        r"[6-9]\d{2} \d{2} \d{2} \d{2}",  # Spain: 612 34 56 78
        r"0\d{2,4}[ /-]\d{5,8}",  # Germany: 030 12345678
        r"\(\d{2,4}\) ?\d{3,5}[ -]\d{4}",  # generic area code in parentheses
    )
]
_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{2,4}")


def phone_score(window: str, *, context: bool) -> float:
    """How phone-like a digit window is: 0 (not a phone) to 0.9 (international format).

    International (+CC): 8-15 digits (E.164). National: one of the shapes above with 9-12
    digits. A bare run of 10-11 digits counts only after a phone word (`context`).
    """
    digits = sum(c.isdigit() for c in window)
    if _DATE.search(window):
        return 0.0
    if window.startswith("+"):
        return 0.9 if 8 <= digits <= 15 and window[1:2] not in ("0", " ") else 0.0
    if window.startswith("00") and 11 <= digits <= 17 and " " in window:
        return 0.8
    if 9 <= digits <= 12 and any(s.fullmatch(window) for s in _NATIONAL_SHAPES):
        return 0.75
    if context and window.isdigit() and 10 <= digits <= 11:
        return 0.6
    return 0.0
