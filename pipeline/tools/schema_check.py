"""Checking the JSON Schemas a caller sends as ``tools[].function.parameters``, at bounded cost.

A schema is a program for two interpreters: the JSON Schema validator that checks it here and
the guided-decoding compiler that vLLM builds from it. Both grow with its size, nesting and
branching, so a schema is first measured (one iterative pass, no recursion) against limits on
its encoded size, its depth and its branches (subschemas under ``anyOf``/``oneOf``/``allOf``/
``not``/``if``/``then``/``else``), and references outside the schema itself are refused (nothing
here may fetch a URL a caller names). Its regular expressions (``pattern``, the keys of
``patternProperties``) are bounded in length and compiled with RE2, never with Python's `re`:
the meta-schema's `format: regex` check compiled them with `re`, where one class such as
``(?i)[Ā-￿]`` costs 6 ms, so a 2 KB schema kept a thread busy for seconds after its request had
been refused. RE2 is bounded too: each pattern compiles within ``max_pattern_memory`` bytes,
all of a schema's to at most ``max_patterns_program`` instructions, none is kept afterwards
(``compile_callers``), and the compiling is done where the meta-schema check is: ``\\pL{400}``
is a 4 MB program that took 0.3 s to compile on the event loop. Only a schema within the limits
is checked against the JSON Schema meta-schema (formats not checked, so no `re`), in a small
pool of its own under a time budget, so neither the event loop nor the threads that other
requests share ever run it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from pipeline.errors import InvalidRequest
from pipeline.guards.linear import compile_callers

BRANCHING: Final = frozenset({"anyOf", "oneOf", "allOf", "not", "if", "then", "else"})


@dataclass(frozen=True)
class SchemaLimits:
    """What one function's parameters schema may be."""

    max_bytes: int = 16_384
    max_depth: int = 16
    max_branches: int = 64
    max_pattern_chars: int = 1_000  # one regular expression
    max_patterns_chars: int = 4_000  # all of one schema's
    # RE2's memory for one pattern's program (its default is 8 MB) and the instructions of all
    # of one schema's: ordinary patterns are tens of instructions, ^.{0,1000}$ about 9,000.
    max_pattern_memory: int = 1 << 20
    max_patterns_program: int = 50_000
    budget_s: float = 1.0


_META = Draft202012Validator(Draft202012Validator.META_SCHEMA)  # no format checker: no `re`
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tool-schema-check")


class SchemaRefused(InvalidRequest):
    """A tool schema over the limits or not a valid JSON Schema (400 naming the tool)."""


def measure(schema: Any, limits: SchemaLimits, param: str, kind: str = "tool") -> list[str]:
    """Raise ``SchemaRefused`` if ``schema`` is over the limits or refers outside itself; its
    regular expressions, within their lengths, to compile (``check_patterns``) off the loop."""
    try:
        size = len(orjson.dumps(schema))
    except orjson.JSONEncodeError as exc:  # an integer past 64 bits, a non-string key
        raise SchemaRefused(
            f"{param}: the schema cannot be encoded as JSON ({exc}).",
            param=param,
            code=f"invalid_{kind}_schema",
        ) from None
    if size > limits.max_bytes:
        raise SchemaRefused(
            f"{param}: the schema is {size} bytes; at most {limits.max_bytes} are accepted.",
            param=param,
            code=f"{kind}_schema_too_large",
        )
    branches = 0
    patterns: list[str] = []
    stack: list[tuple[int, Any]] = [(0, schema)]
    while stack:
        depth, node = stack.pop()
        if isinstance(node, dict | list) and depth >= limits.max_depth:
            raise SchemaRefused(
                f"{param}: the schema is nested more than {limits.max_depth} levels deep.",
                param=param,
                code=f"{kind}_schema_too_deep",
            )
        if isinstance(node, dict):
            for key, value in node.items():
                if key in BRANCHING:
                    branches += len(value) if isinstance(value, list) else 1
                if key == "pattern" and isinstance(value, str):
                    patterns.append(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    patterns.extend(str(name) for name in value)
                if key in ("$ref", "$dynamicRef") and not _local(value):
                    raise SchemaRefused(
                        f"{param}: only references inside the schema ('#...') are accepted.",
                        param=param,
                        code=f"{kind}_schema_remote_ref",
                    )
                stack.append((depth + 1, value))
        elif isinstance(node, list):
            stack.extend((depth + 1, item) for item in node)
        if branches > limits.max_branches:
            raise SchemaRefused(
                f"{param}: the schema has more than {limits.max_branches} branches "
                "(subschemas of anyOf, oneOf, allOf, not, if/then/else).",
                param=param,
                code=f"{kind}_schema_too_complex",
            )

    check_lengths(patterns, limits, param, kind)
    return patterns


def check_lengths(patterns: list[str], limits: SchemaLimits, param: str, kind: str) -> None:
    if sum(map(len, patterns)) > limits.max_patterns_chars:
        raise SchemaRefused(
            f"{param}: the schema's regular expressions hold more than "
            f"{limits.max_patterns_chars} characters.",
            param=param,
            code=f"{kind}_schema_too_complex",
        )
    if any(len(pattern) > limits.max_pattern_chars for pattern in patterns):
        raise SchemaRefused(
            f"{param}: a pattern is longer than {limits.max_pattern_chars} characters.",
            param=param,
            code=f"{kind}_schema_too_complex",
        )


def check_patterns(
    patterns: list[str], limits: SchemaLimits, param: str, kind: str = "tool"
) -> None:
    """Each regular expression of a schema short enough and one RE2 compiles within its
    memory, all of them within ``max_patterns_program`` instructions, or ``SchemaRefused``
    (guided decoding has no lookaround or backreferences either)."""
    check_lengths(patterns, limits, param, kind)
    program = 0
    for pattern in patterns:
        try:
            program += compile_callers(pattern, max_mem=limits.max_pattern_memory).programsize
        except Exception as exc:  # re2.error: syntax RE2 lacks, or over its memory budget
            reason = exc.args[0] if exc.args else exc
            reason = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else reason
            raise SchemaRefused(
                f"{param}: the pattern {pattern[:60]!r} is not a regular expression this "
                f"service accepts ({reason}); lookaround and backreferences are not supported, "
                f"and a pattern's program may take {limits.max_pattern_memory} bytes.",
                param=param,
                code=f"invalid_{kind}_schema",
            ) from None
        if program > limits.max_patterns_program:
            raise SchemaRefused(
                f"{param}: the schema's regular expressions compile to more than "
                f"{limits.max_patterns_program} instructions; send simpler patterns.",
                param=param,
                code=f"{kind}_schema_too_complex",
            )


def _local(ref: Any) -> bool:
    return isinstance(ref, str) and ref.startswith("#")


def _check(
    schemas: Sequence[tuple[str, dict[str, Any]]],
    patterns: Sequence[list[str]],
    limits: SchemaLimits,
    kind: str,
) -> None:
    """In the pool: each schema's patterns compiled, then every schema against the
    meta-schema."""
    for (param, _), found in zip(schemas, patterns, strict=True):
        check_patterns(found, limits, param, kind)
    for param, schema in schemas:
        try:
            error = best_match(_META.iter_errors(schema))
        except RecursionError:
            raise SchemaRefused(
                f"{param}: not a valid JSON Schema: nested too deeply",
                param=param,
                code=f"{kind}_schema_too_deep",
            ) from None
        if error is not None:
            raise SchemaRefused(
                f"{param}: not a valid JSON Schema: {error.message}",
                param=param,
                code=f"invalid_{kind}_schema",
            )


async def check_tool_schemas(
    tools: Sequence[dict[str, Any]], limits: SchemaLimits | None = None
) -> None:
    """Every function's parameters schema within the limits and valid, or ``SchemaRefused``."""
    schemas = []
    for index, tool in enumerate(tools):
        schema = (tool.get("function") or {}).get("parameters")
        if schema is not None:
            schemas.append((f"tools.{index}.function.parameters", schema))
    await check_schemas(schemas, limits, kind="tool", param="tools")


async def check_schemas(
    schemas: Sequence[tuple[str, Any]],
    limits: SchemaLimits | None = None,
    *,
    kind: str,
    param: str,
) -> None:
    """Each ``(param, schema)`` within the limits and a valid JSON Schema, or ``SchemaRefused``
    naming its param; codes say `kind` (``tool_schema_too_large``, ``invalid_response_schema``)."""
    limits = limits or SchemaLimits()
    patterns = [measure(schema, limits, name, kind) for name, schema in schemas]
    if not schemas:
        return
    try:
        async with asyncio.timeout(limits.budget_s):
            await asyncio.get_running_loop().run_in_executor(
                _POOL, _check, schemas, patterns, limits, kind
            )
    except TimeoutError:
        raise SchemaRefused(
            f"The {kind} schemas could not be checked within {limits.budget_s:g} s; "
            "send smaller schemas.",
            param=param,
            code=f"{kind}_schema_too_complex",
        ) from None
