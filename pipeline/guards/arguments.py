"""Redaction of tool-call arguments: JSON text, redacted where it carries text, kept valid.

A model writes a call's arguments as JSON, a fragment at a time. PII and blocked terms in them
reach whoever runs the call (the client's function, or a server tool that may send them on to
a third party) as surely as the answer's text reaches the client, so they pass the same
redaction (`output.StreamingRedactor`, under the same policy), and the JSON stays valid:

- each string, keys too, is decoded (escapes, surrogate pairs), redacted on its own and written
  back as a JSON string: a token replaces text inside the string, and an escape sequence is
  never cut (one split across fragments waits for its last character);
- a value is read with its key as context (``"phone": "5551234567"`` is a phone number, as
  "phone: 5551234567" is in text);
- everything else (numbers, ``true``/``false``/``null``, and whatever is not JSON at all) is
  redacted too, stretch by stretch between the structural characters ``{}[],:"`` (held until
  the stretch ends: a number is short); a stretch that had something redacted is written as a
  JSON string (the number ``4111111111111111`` becomes ``"[CARD]"``).

Arguments that were valid JSON stay valid JSON; arguments that were not stay invalid, without
the PII. Whatever the fragments, the result is the same (each redactor gives the same output
for any chunking, and the JSON reading is character by character).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.guards.output import StreamingRedactor, Violation
from pipeline.guards.policy import GuardPolicy

_STRUCTURE = frozenset("{}[],:")
_STRING_RUN = re.compile(r'[^"\\]+')
_BARE_RUN = re.compile(r'[^{}\[\],:"]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ENCODE = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\ud800-\udfff]')
_KEY_CONTEXT = 32  # characters of a key kept as its value's context

RedactorFactory = Callable[[str], StreamingRedactor]
# The rule of a redaction outside the strings of an answer that must follow a JSON schema.
OUTSIDE_STRING = "pii_outside_string"


def encode(text: str) -> str:
    """`text` as the inside of a JSON string (lone surrogates escaped: JSON can carry them)."""
    return _NEEDS_ESCAPE.sub(lambda m: _ENCODE.get(m.group(), f"\\u{ord(m.group()):04x}"), text)


def _decode_escape(escape: str) -> str:
    """The character of one complete escape (``\\n``, ``\\u00e9``); a malformed one reads as
    the characters after the backslash."""
    if escape[1] == "u":
        try:
            return chr(int(escape[2:], 16))
        except ValueError:
            return escape[1:]
    return _ESCAPES.get(escape[1], escape[1])


class JsonArgumentsRedactor:
    """Redacts one call's arguments as they arrive; `violations` collects what the redactors
    of its strings and other stretches found."""

    def __init__(self, make: RedactorFactory, *, quote_bare: bool = True) -> None:
        self.make = make
        # False (an answer under a JSON schema): a redacted stretch outside strings is not
        # quoted, which would change its type, but recorded as a `pii_outside_string` violation.
        self.quote_bare = quote_bare
        self.violations: list[Violation] = []
        self._containers: list[str] = []  # "{" or "[" for each open container
        self._last = ""  # the last structural character
        self._string: StreamingRedactor | None = None
        self._bare: list[str] = []  # the stretch outside strings read so far
        self._seen = 0  # violations of the current redactor already collected
        self._escape = ""  # an escape sequence not complete yet
        self._high = ""  # a decoded high surrogate waiting for its pair
        self._is_key = False
        self._key: list[str] = []  # the current key's decoded text (its first characters)
        self._context = ""  # the last key, for its value

    def feed(self, text: str) -> str:
        """Take the next fragment; return the redacted JSON text that is safe to pass on."""
        out: list[str] = []
        i = 0
        while i < len(text):
            if self._string is not None:
                i = self._in_string(text, i, out)
            elif text[i] == '"':
                out.append(self._close_bare())
                self._open_string()
                out.append('"')
                i += 1
            elif text[i] in _STRUCTURE:
                out.append(self._close_bare())
                self._structure(text[i])
                out.append(text[i])
                i += 1
            else:
                run = _BARE_RUN.match(text, i)
                assert run is not None
                self._bare.append(run.group())
                i = run.end()
        return "".join(out)

    @property
    def held(self) -> int:
        """Characters received but not yet passed on (about: a string's are counted decoded)."""
        string = self._string.held if self._string is not None else 0
        return string + sum(map(len, self._bare)) + len(self._escape) + len(self._high)

    def end(self) -> str:
        """The arguments are complete: the rest, redacted (an unclosed string stays open)."""
        if self._string is not None:
            return self._close_string(closed=False)
        return self._close_bare()

    def _in_string(self, text: str, i: int, out: list[str]) -> int:
        assert self._string is not None
        c = text[i]
        if self._escape:
            self._escape += c
            need = 6 if self._escape[1:2] == "u" else 2
            if len(self._escape) == need:
                char, self._escape = _decode_escape(self._escape), ""
                out.append(self._string_text(char))
            return i + 1
        if c == "\\":
            self._escape = c
            return i + 1
        if c == '"':
            out.append(self._close_string(closed=True))
            return i + 1
        run = _STRING_RUN.match(text, i)
        assert run is not None
        out.append(self._string_text(run.group()))
        return run.end()

    def _string_text(self, decoded: str) -> str:
        """Feed decoded string text (pairing surrogates) to the string's redactor."""
        assert self._string is not None
        if self._high:
            decoded, self._high = self._high + decoded, ""
            if "\udc00" <= decoded[1:2] <= "\udfff":
                decoded = _pair(decoded[0], decoded[1]) + decoded[2:]
        if decoded and "\ud800" <= decoded[-1] <= "\udbff":
            decoded, self._high = decoded[:-1], decoded[-1]
        if self._is_key and len(self._key) < _KEY_CONTEXT:
            self._key.append(decoded[: _KEY_CONTEXT - len(self._key)])
        return encode(self._collect(self._string, self._string.feed(decoded)))

    def _open_string(self) -> None:
        self._is_key = (
            bool(self._containers) and self._containers[-1] == "{" and (self._last in "{,")
        )
        self._key = []
        self._string = self._redactor("" if self._is_key else self._value_context())

    def _close_string(self, *, closed: bool) -> str:
        assert self._string is not None
        rest = self._high + self._escape if not closed else self._high
        self._high = self._escape = ""
        tail = self._collect(self._string, self._string.feed(rest) + self._string.end())
        self._string = None
        if self._is_key:
            self._context = "".join(self._key)
        return encode(tail) + ('"' if closed else "")

    def _close_bare(self) -> str:
        """The stretch outside strings that just ended, redacted (quoted if anything was)."""
        if not self._bare:
            return ""
        text = "".join(self._bare)
        self._bare = []
        core = text.strip(" \t\r\n")
        if not core:
            return text
        redactor = self._redactor(self._value_context())
        redacted = self._collect(redactor, redactor.feed(core) + redactor.end())
        if redacted == core:
            return text
        if not self.quote_bare:
            self.violations.append(Violation(OUTSIDE_STRING, "a value outside a string", 0))
        start = text.index(core[0])
        return f'{text[:start]}"{encode(redacted)}"{text[start + len(core) :]}'

    def _structure(self, c: str) -> None:
        if c in "{[":
            self._containers.append(c)
        elif c in "}]" and self._containers:
            self._containers.pop()
        if c != ":":
            self._context = "" if c in "{[," else self._context
        self._last = c

    def _value_context(self) -> str:
        return f"{self._context}: " if self._last == ":" and self._context else ""

    def _redactor(self, context: str) -> StreamingRedactor:
        self._seen = 0
        return self.make(context)

    def _collect(self, redactor: StreamingRedactor, text: str) -> str:
        self.violations += redactor.violations[self._seen :]
        self._seen = len(redactor.violations)
        return text


def _pair(high: str, low: str) -> str:
    return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(low) - 0xDC00))


def redactor_factory(policy: GuardPolicy) -> RedactorFactory:
    """Redactors under one tenant's output policy (as `stages.guard_out` builds for text)."""
    redact, block = policy.kinds_with("redact"), policy.kinds_with("block")
    terms = policy.blocked_output_terms

    def make(context: str) -> StreamingRedactor:
        return StreamingRedactor(
            redact_kinds=redact, block_kinds=block, blocked_terms=terms, context=context
        )

    return make


def blocking(violations: list[Violation], policy: GuardPolicy) -> Violation | None:
    """The first violation that ends an answer under `policy` (a blocked term or kind)."""
    blocked = {f"pii.{kind}" for kind in policy.kinds_with("block")}
    return next((v for v in violations if v.rule == "blocked_term" or v.rule in blocked), None)


@dataclass(frozen=True)
class GuardedArguments:
    """A whole call's arguments after redaction, and the rule that blocks them (or None)."""

    text: str
    blocked: str | None


class ArgumentsGuard:
    """Redacts the whole arguments of a server tool's call before it runs."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self.make = redactor_factory(policy)

    def __call__(self, arguments: str) -> GuardedArguments:
        redactor = JsonArgumentsRedactor(self.make)
        text = redactor.feed(arguments) + redactor.end()
        violation = blocking(redactor.violations, self.policy)
        return GuardedArguments(text, violation.rule if violation is not None else None)
