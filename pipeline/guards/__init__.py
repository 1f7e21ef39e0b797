"""Guardrails as pure, text-level modules; the `guard_in` / `guard_out` stages wire them in.

- `normalize`: canonical text for detection (NFKC, invisible characters, look-alikes,
  offsets back to the original) and decoding of smuggled encodings.
- `pii`: typed PII findings with original offsets, and `redact` (`pii_checks`: checksums and
  shapes; `pii_email`: plain and obfuscated e-mail addresses; `segments`: where redaction may
  cut a stream).
- `injection`: prompt-injection decisions from rules (`rules/`) and embedding similarity.
- `output`: `StreamingRedactor`, redaction of PII and blocked terms across chunk boundaries.
- `arguments`: the same for tool-call arguments, inside their JSON, kept valid.
- `grounding`: citations and lexical support of a finished answer.
- `policy`: per-tenant guard policy loaded from settings JSON.
"""
