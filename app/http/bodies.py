"""Reading a JSON request body after auth, with every cost bounded by what the caller sent.

A body is parsed by pydantic-core's JSON parser (integers keep their exact value, lone
surrogates and malformed UTF-8 are refused, nesting past 200 levels is refused), then walked
once, iteratively, for what no downstream part can use: nesting deeper than ``max_depth``, more
than ``max_nodes`` values, integers outside 64 bits, non-finite numbers. Each is a 400 that names
the field (``messages.0.content``), so a client can tell what to fix, and none of them can reach
the cache key (two requests that differ must never hash alike: ``1e400`` and ``1e401`` would
both be infinity, two 80-bit integers would both round to one float), the tokenizer, Redis or
the JSON encoder (which refuses integers past 64 bits: that was a 500 once).

Bodies larger than ``offload_bytes`` are parsed, walked and validated in a worker thread, so a
large body holds the event loop for no longer than a small one; small bodies (almost all of
them) are handled inline, where a thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic_core
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pipeline.errors import InvalidRequest
from retrieval.documents import INT64_MIN, UINT64_MAX

M = TypeVar("M", bound=BaseModel)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class BodyLimits:
    """What one JSON body may hold (the byte size is the middleware's ``max_body_bytes``)."""

    max_depth: int = 32
    max_nodes: int = 100_000
    offload_bytes: int = 16_384


class BodyError(InvalidRequest):
    """A body that is not JSON this service can use; ``param`` is the field's path."""


def _path(parts: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in parts) or "body"


def _children(value: Any) -> Iterator[tuple[str | int, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    return enumerate(value)


def _problem(item: Any, depth: int, limits: BodyLimits) -> str | None:
    """What is wrong with one value on its own (its children aside), if anything."""
    if isinstance(item, dict | list):
        return "too_deep" if depth >= limits.max_depth else None
    if isinstance(item, bool) or not isinstance(item, int | float):
        return None
    if isinstance(item, int):
        return None if INT64_MIN <= item <= UINT64_MAX else "integer_out_of_range"
    return None if math.isfinite(item) else "number_out_of_range"


_MESSAGES = {
    "too_deep": "nested more than {depth} levels deep",
    "integer_out_of_range": "integers must fit in 64 bits",
    "number_out_of_range": "numbers must be finite",
}


def check_values(value: Any, limits: BodyLimits) -> None:
    """Raise ``BodyError`` naming the first field that is nested too deeply, is an integer past
    64 bits or a non-finite number, or the body holds more than ``max_nodes`` values. Iterative
    (no depth can raise ``RecursionError``); a fast pass that keeps depths only, then, for a
    body with a problem, a second pass that finds the field's path."""
    nodes = 0
    stack: list[tuple[int, Any]] = [(0, value)]
    found = False
    while stack:
        depth, item = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise BodyError(
                f"The body holds more than {limits.max_nodes} JSON values.",
                code="too_many_values",
            )
        if _problem(item, depth, limits) is not None:
            found = True
            break
        if isinstance(item, dict):
            stack.extend((depth + 1, child) for child in item.values())
        elif isinstance(item, list):
            stack.extend((depth + 1, child) for child in item)
    if found:
        _locate(value, limits)


def _locate(value: Any, limits: BodyLimits) -> None:
    paths: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while paths:
        path, item = paths.pop()
        problem = _problem(item, len(path), limits)
        if problem is not None:
            where = _path(path)
            detail = _MESSAGES[problem].format(depth=limits.max_depth)
            raise BodyError(f"{where}: {detail}.", param=where, code=problem)
        if isinstance(item, dict | list):
            paths.extend(((*path, key), child) for key, child in _children(item))


def _surrogate_path(raw: bytes) -> str | None:
    """Where a lone surrogate sits, found with the standard parser (which accepts them); only
    called after the fast parser refused the body for one."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return _path(path)
        elif isinstance(item, dict | list):
            if len(path) > 200:
                return None
            for key, child in _children(item):
                if isinstance(key, str) and not _encodable(key):
                    return _path((*path, key.encode("utf-8", "replace").decode()))
                stack.append(((*path, key), child))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes, limits: BodyLimits) -> Any:
    """The body's JSON value, checked (see the module docstring), or ``BodyError``.

    Brackets are counted first (in C, a pass over the bytes): a body of 200,000 empty arrays
    is refused before the parser builds them, which holds the interpreter for ~75 ms."""
    if raw.count(b"[") + raw.count(b"{") > limits.max_nodes:
        raise BodyError(
            f"The body holds more than {limits.max_nodes} JSON arrays and objects.",
            code="too_many_values",
        )
    try:
        value = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        detail = str(exc)
        where = _surrogate_path(raw) if _SURROGATE_ESCAPE.search(raw) else None
        if where is not None:
            raise BodyError(
                f"{where}: strings must not hold lone UTF-16 surrogates ({detail}).",
                param=where,
                code="invalid_string",
            ) from None
        if "recursion limit" in detail:
            raise BodyError(
                f"The body is nested more than {limits.max_depth} levels deep ({detail}).",
                code="too_deep",
            ) from None
        raise BodyError(
            f"We could not parse the JSON body of your request: {detail}.", code="invalid_json"
        ) from None
    check_values(value, limits)
    return value


Refine = Callable[[list[Any]], Exception | None]


def validate(raw: bytes, model: type[M], limits: BodyLimits, refine: Refine | None = None) -> M:
    """Parse, check and validate a body as ``model``. Pydantic's errors become the usual 400,
    or what ``refine`` makes of them (a route's own wording of one kind of error).

    A refusal leaves here without a traceback and without the input in its details: both
    would keep the parsed body alive, and a large one freed later on the event loop's thread
    (400,000 small objects) would hold the loop as long as parsing it did here."""
    try:
        return _validate(raw, model, limits, refine)
    except (InvalidRequest, RequestValidationError) as exc:
        error = exc
    error.__traceback__ = None  # the frames that hold the body are freed now, on this thread
    raise error


def _validate(raw: bytes, model: type[M], limits: BodyLimits, refine: Refine | None) -> M:
    value = parse_json(raw, limits)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
    refined = refine(errors) if refine is not None else None
    raise refined if refined is not None else RequestValidationError(errors)


async def read_body(
    raw: bytes, model: type[M], limits: BodyLimits, refine: Refine | None = None
) -> M:
    """``validate``, in a worker thread when the body is large."""
    if len(raw) <= limits.offload_bytes:
        return validate(raw, model, limits, refine)
    return await asyncio.to_thread(validate, raw, model, limits, refine)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` itself (``app.http.openapi`` adds
    the model's schema to the document)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    }
