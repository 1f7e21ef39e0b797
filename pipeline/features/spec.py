"""The declared features: every feature the service knows is named, typed and defaulted here.

A batch feature comes from the precompute job (``rag features load`` / ``rag features compute``)
and lives in the user's Redis hash; a real-time one is computed during the request. The loader
and the store both go through ``parse_value`` and ``encode_value``, so a value that reached
Redis is one the request path can read back.

``FEATURE_SET_VERSION`` changes when a feature's meaning or type changes (not when one is
added): a hash written under another version is ignored until the job writes it again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FeatureType = Literal["str", "int", "float", "bool"]
Source = Literal["batch", "realtime"]

FEATURE_SET_VERSION = "1"

# A string feature is a short label (a department, a plan), never free text.
MAX_TEXT = 128
LANGUAGE_CODES = frozenset({"en", "pt", "es", "fr", "de", "it", "nl"})
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


class FeatureValueError(ValueError):
    """A value that does not fit its feature's declaration."""


@dataclass(frozen=True)
class FeatureSpec:
    """One feature: ``filter_key`` names the metadata key it fills as a default retrieval
    filter; ``personalises`` says it reaches the prompt's personalisation line."""

    name: str
    type: FeatureType
    default: Any
    source: Source
    description: str
    filter_key: str | None = None
    personalises: bool = False
    choices: frozenset[str] | None = None
    pattern: str | None = None  # a string value must match it whole


FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec(
        "department",
        "str",
        None,
        "batch",
        "The user's department; retrieval prefers documents whose `department` metadata has it.",
        filter_key="department",
    ),
    FeatureSpec(
        "language",
        "str",
        None,
        "batch",
        "Language the answer is written in (en, pt, es, fr, de, it, nl).",
        personalises=True,
        choices=LANGUAGE_CODES,
    ),
    FeatureSpec(
        "tier",
        "str",
        "free",
        "batch",
        "The user's plan; named in the prompt and read by the router.",
        personalises=True,
    ),
    FeatureSpec("request_count", "int", 0, "batch", "Requests in the log the job last read."),
    FeatureSpec(
        "top_filter",
        "str",
        None,
        "batch",
        "The user's most-used metadata filter, `key=value`.",
        pattern=r"[^=\s][^=]*=.+",
    ),
    FeatureSpec("requests_last_hour", "int", 0, "realtime", "Requests in the last hour (sliding)."),
)

SPECS: dict[str, FeatureSpec] = {spec.name: spec for spec in FEATURES}


def batch_specs(specs: Mapping[str, FeatureSpec] = SPECS) -> dict[str, FeatureSpec]:
    return {name: spec for name, spec in specs.items() if spec.source == "batch"}


def defaults(specs: Mapping[str, FeatureSpec] = SPECS) -> dict[str, Any]:
    return {name: spec.default for name, spec in specs.items()}


def filter_keys(specs: Mapping[str, FeatureSpec] = SPECS) -> dict[str, str]:
    """Feature name -> metadata key, for the features that become a default retrieval filter."""
    return {name: spec.filter_key for name, spec in specs.items() if spec.filter_key}


def parse_value(spec: FeatureSpec, value: Any, *, text: bool = False) -> Any:
    """``value`` typed per ``spec``, or ``FeatureValueError`` saying why it does not fit.

    ``text``: the value comes from a text format (CSV, a Redis hash), so numbers and booleans
    are parsed from strings; from JSON they must have the JSON type already (``"3"`` is not an
    int there, nor is ``true``)."""
    if text:
        if not isinstance(value, str):
            raise FeatureValueError(f"{spec.name}: expected text, got {type(value).__name__}")
        value = _from_text(spec, value.strip())
    if spec.type == "bool":
        if not isinstance(value, bool):
            raise _wrong(spec, value)
        return value
    if spec.type == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong(spec, value)
        return value
    if spec.type == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong(spec, value)
        return float(value)
    if not isinstance(value, str):
        raise _wrong(spec, value)
    return _check_text(spec, value)


def encode_value(spec: FeatureSpec, value: Any) -> str:
    """How a typed value is stored in the user's Redis hash."""
    if spec.type == "bool":
        return "1" if value else "0"
    return str(value)


def _from_text(spec: FeatureSpec, raw: str) -> Any:
    try:
        if spec.type == "int":
            return int(raw)
        if spec.type == "float":
            return float(raw)
    except ValueError:
        raise _wrong(spec, raw) from None
    if spec.type == "bool":
        lowered = raw.lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise _wrong(spec, raw)
    return raw


def _check_text(spec: FeatureSpec, value: str) -> str:
    if not value or len(value) > MAX_TEXT or not value.isprintable():
        raise FeatureValueError(
            f"{spec.name}: expected a printable label of 1 to {MAX_TEXT} characters"
        )
    if spec.choices is not None and value not in spec.choices:
        raise FeatureValueError(f"{spec.name}: expected one of {sorted(spec.choices)}")
    if spec.pattern is not None and not re.fullmatch(spec.pattern, value):
        raise FeatureValueError(f"{spec.name}: expected the form {spec.pattern}")
    return value


def _wrong(spec: FeatureSpec, value: Any) -> FeatureValueError:
    shown = value if isinstance(value, str | int | float | bool) else type(value).__name__
    if isinstance(shown, str) and len(shown) > 40:
        shown = shown[:40] + "…"
    return FeatureValueError(f"{spec.name}: expected {spec.type}, got {shown!r}")
