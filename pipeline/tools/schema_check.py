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
been refused. RE2 is bounded too: each pattern compiles within RE2's memory budget, a request's
distinct patterns to at most ``max_patterns_program`` instructions in all (``x\\pL{400}`` is
478,000, 0.2 s; a name such as ``^[\\p{L} '-]{1,100}$`` 120,000; an e-mail address 18), and
no program is kept afterwards (``compile_callers``): re2's own cache kept them for ever, 0.5 GB
after 128. What each pattern compiled to (its size, or why it did not) is kept instead, in a
bounded memo, so a pattern that every tool of a request shares, or that every request sends,
is compiled once. The measuring and compiling run in a small pool of their own under a time
budget (RE2 holds the GIL while it compiles, so the budget is what bounds the loop's wait),
then a schema within the limits is checked against the JSON Schema meta-schema (formats not
checked, so no `re`) there too.
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
from pipeline.kept import Kept

BRANCHING: Final = frozenset({"anyOf", "oneOf", "allOf", "not", "if", "then", "else"})


@dataclass(frozen=True)
class SchemaLimits:
    """What one function's parameters schema may be."""

    max_bytes: int = 16_384
    max_depth: int = 16
    max_branches: int = 64
    max_pattern_chars: int = 1_000  # one regular expression
    max_patterns_chars: int = 4_000  # all of one schema's
    # RE2's memory for one pattern's program (its default) and the instructions of a request's
    # distinct patterns: ordinary ones are tens of instructions, ^.{0,1000}$ 9,000, a Unicode
    # name ^[\p{L}\p{M} .'-]{1,255}$ 339,000 (0.12 s to compile).
    max_pattern_memory: int = 8 << 20
    max_patterns_program: int = 500_000
    budget_s: float = 1.0


_META = Draft202012Validator(Draft202012Validator.META_SCHEMA)  # no format checker: no `re`
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tool-schema-check")


class SchemaRefused(InvalidRequest):
    """A tool schema over the limits or not a valid JSON Schema (400 naming the tool)."""


def measure(schema: Any, limits: SchemaLimits, param: str, kind: str = "tool") -> list[str]:
    """Raise ``SchemaRefused`` if ``schema`` is over the limits or refers outside itself; its
    regular expressions, for ``check_patterns`` to bound and compile."""
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


# What a pattern compiled to, by (memo scope, pattern, memory budget): its program's size, or why
# RE2 refused it; never the program itself (up to 8 MB each). Per memo scope
# (``pipeline.model.salt.MemoScope``: the tenant, and the caller's access scope where its index
# has access lists), as the guard's memos are: how fast a pattern is checked says nothing of what
# another tenant, or a caller who may see what this one may not, sent.
_VERDICTS: Kept[tuple[str, str, int], int | str] = Kept(4096)


def _verdict(pattern: str, max_mem: int, scope: str) -> int | str:
    return _VERDICTS.remembered((scope, pattern, max_mem), lambda: _compiled(pattern, max_mem))


def _compiled(pattern: str, max_mem: int) -> int | str:
    """The size of ``pattern``'s program, or why RE2 refused it."""
    try:
        size: int = compile_callers(pattern, max_mem=max_mem).programsize
    except Exception as exc:  # re2.error: syntax RE2 lacks, or over its memory budget
        reason = exc.args[0] if exc.args else exc
        return str(reason.decode("utf-8", "replace") if isinstance(reason, bytes) else reason)
    return size


def check_patterns(
    patterns: list[str],
    limits: SchemaLimits,
    param: str,
    kind: str = "tool",
    seen: dict[str, int] | None = None,
    *,
    scope: str,
) -> None:
    """Each regular expression of a schema short enough and one RE2 compiles, the request's
    distinct ones (``seen``: those of its schemas checked before, with their sizes) within
    ``max_patterns_program`` instructions in all, or ``SchemaRefused`` (guided decoding has no
    lookaround or backreferences either). The verdicts are kept under ``scope``, the request's
    memo scope."""
    check_lengths(patterns, limits, param, kind)
    seen = {} if seen is None else seen
    for pattern in patterns:
        if pattern in seen:
            continue
        verdict = _verdict(pattern, limits.max_pattern_memory, scope)
        if isinstance(verdict, str):
            raise SchemaRefused(
                f"{param}: the pattern {pattern[:60]!r} is not a regular expression this "
                f"service accepts ({verdict}); lookaround and backreferences are not supported.",
                param=param,
                code=f"invalid_{kind}_schema",
            )
        seen[pattern] = verdict
        if sum(seen.values()) > limits.max_patterns_program:
            raise SchemaRefused(
                f"{param}: the regular expressions compile to more than "
                f"{limits.max_patterns_program} instructions in all; send simpler patterns.",
                param=param,
                code=f"{kind}_schema_too_complex",
            )


def _local(ref: Any) -> bool:
    return isinstance(ref, str) and ref.startswith("#")


def _check(schemas: Sequence[tuple[str, Any]], limits: SchemaLimits, kind: str, scope: str) -> None:
    """In the pool: each schema measured and its patterns compiled, in order, then every
    schema against the meta-schema."""
    seen: dict[str, int] = {}
    for param, schema in schemas:
        patterns = measure(schema, limits, param, kind)
        check_patterns(patterns, limits, param, kind, seen, scope=scope)
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
    tools: Sequence[dict[str, Any]], limits: SchemaLimits | None = None, *, scope: str
) -> None:
    """Every function's parameters schema within the limits and valid, or ``SchemaRefused``
    (``scope``: whose memo the patterns' verdicts are kept in, as ``check_schemas``)."""
    schemas = []
    for index, tool in enumerate(tools):
        schema = (tool.get("function") or {}).get("parameters")
        if schema is not None:
            schemas.append((f"tools.{index}.function.parameters", schema))
    await check_schemas(schemas, limits, kind="tool", param="tools", scope=scope)


async def check_schemas(
    schemas: Sequence[tuple[str, Any]],
    limits: SchemaLimits | None = None,
    *,
    kind: str,
    param: str,
    scope: str,
) -> None:
    """Each ``(param, schema)`` within the limits and a valid JSON Schema, or ``SchemaRefused``
    naming its param; codes say `kind` (``tool_schema_too_large``, ``invalid_response_schema``).
    ``scope`` is the request's memo scope (``pipeline.model.salt.MemoScope``): the patterns'
    verdicts are kept under it."""
    limits = limits or SchemaLimits()
    if not schemas:
        return
    try:
        async with asyncio.timeout(limits.budget_s):
            await asyncio.get_running_loop().run_in_executor(
                _POOL, _check, schemas, limits, kind, scope
            )
    except TimeoutError:
        raise SchemaRefused(
            f"The {kind} schemas could not be checked within {limits.budget_s:g} s; "
            "send smaller schemas.",
            param=param,
            code=f"{kind}_schema_too_complex",
        ) from None
