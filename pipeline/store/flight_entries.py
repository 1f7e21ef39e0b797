"""A flight's entries (``pipeline.store.singleflight``) and their wire form on the Redis stream:
answer events, then one terminal entry with the leader's completion or error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    AnswerEvent,
    Citation,
    ContentDelta,
    Finish,
    ToolCallDelta,
    Usage,
)
from pipeline.errors import PipelineError, ServiceUnavailable


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a flight: ``events`` (answer events), then one terminal kind: ``done``
    (``completion``; ``shared``: the cache would store it), ``failed`` (``error``), ``gone``,
    ``unshared`` or ``off`` (this process lost Redis while reading)."""

    kind: str
    events: tuple[AnswerEvent, ...] = ()
    completion: Completion | None = None
    shared: bool = False
    error: PipelineError | None = None
    detail: str = ""

    @property
    def terminal(self) -> bool:
        return self.kind != "events"


def _event_wire(event: AnswerEvent) -> list[Any]:
    if isinstance(event, ContentDelta):
        return ["c", event.text, list(event.logprobs)]
    if isinstance(event, ToolCallDelta):
        return ["t", event.index, event.id, event.name, event.arguments]
    if isinstance(event, Finish):
        return ["f", event.reason, event.detail]
    if isinstance(event, Usage):
        return ["u", event.prompt_tokens, event.completion_tokens]
    return ["x", event.to_dict()]


def _event_from_wire(item: list[Any]) -> AnswerEvent:
    kind = item[0]
    if kind == "c":
        return ContentDelta(str(item[1]), tuple(item[2]))
    if kind == "t":
        return ToolCallDelta(int(item[1]), item[2], item[3], str(item[4]))
    if kind == "f":
        return Finish(str(item[1]), item[2])
    if kind == "u":
        return Usage(int(item[1]), int(item[2]))
    return Citation.from_dict(item[1])


def _error_classes(base: type[PipelineError]) -> dict[str, type[PipelineError]]:
    classes = {base.__name__: base}
    for sub in base.__subclasses__():
        classes.update(_error_classes(sub))
    return classes


_BASE_FIELDS: Final = frozenset({"message", "param", "code", "headers"})


def error_wire(error: PipelineError) -> dict[str, Any]:
    extra = {
        name: value
        for name, value in vars(error).items()
        if name not in _BASE_FIELDS and isinstance(value, str | int | float | bool)
    }
    return {
        "class": type(error).__name__,
        "status": error.status_code,
        "message": error.message,
        "param": error.param,
        "code": error.code,
        "headers": error.headers,
        "extra": extra,  # a subclass's own fields (a store error's detail and wait)
    }


def error_from_wire(data: dict[str, Any]) -> PipelineError:
    """The leader's error again, as the same class with the same message, param, code and
    headers (so the follower's response is the leader's); an unknown class becomes the
    nearest one by status."""
    classes = _error_classes(PipelineError)
    cls = classes.get(str(data.get("class")))
    if cls is None:
        by_status = {c.status_code: c for c in reversed(list(classes.values()))}
        cls = by_status.get(int(data.get("status") or 502), ServiceUnavailable)
    error = cls.__new__(cls)
    headers = data.get("headers")
    PipelineError.__init__(
        error,
        str(data.get("message") or ""),
        param=_text_or_none(data.get("param")),
        code=_text_or_none(data.get("code")),
        # Only text: a header the response cannot write would make the follower's answer a 500.
        headers={
            name: value
            for name, value in (headers.items() if isinstance(headers, dict) else ())
            if isinstance(name, str) and isinstance(value, str)
        },
    )
    extra = data.get("extra")
    for name, value in extra.items() if isinstance(extra, dict) else ():
        if isinstance(value, str | int | float | bool) and not hasattr(error, name):
            setattr(error, name, value)
    return error


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def entry_wire(entry: Entry) -> bytes:
    body: dict[str, Any] = {"k": entry.kind}
    if entry.events:
        body["e"] = [_event_wire(event) for event in entry.events]
    if entry.completion is not None:
        body["c"] = entry.completion.to_dict()
        body["s"] = entry.shared
    if entry.error is not None:
        body["x"] = error_wire(entry.error)
    if entry.detail:
        body["d"] = entry.detail
    return orjson.dumps(body)


class MalformedEntry(ValueError):
    """An entry on a flight's stream that this code cannot read (another version's, or not a
    flight's at all)."""


def entry_from_wire(raw: object) -> Entry:
    """The entry ``entry_wire`` wrote; ``MalformedEntry`` for anything else."""
    try:
        return _entry(raw)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        # orjson's decode error is a ValueError.
        raise MalformedEntry(f"{type(exc).__name__}: {exc}"[:200]) from exc


def _entry(raw: object) -> Entry:
    if not isinstance(raw, bytes | str):
        raise TypeError(f"an entry is bytes, not {type(raw).__name__}")
    body = orjson.loads(raw)
    completion = body.get("c")
    error = body.get("x")
    return Entry(
        str(body["k"]),
        tuple(_event_from_wire(item) for item in body.get("e") or ()),
        Completion.from_dict(completion) if completion is not None else None,
        bool(body.get("s")),
        error_from_wire(error) if error is not None else None,
        str(body.get("d") or ""),
    )
