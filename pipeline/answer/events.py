"""Typed stream events: what an answer is made of, as it is made.

Generation turns vLLM's chunks into these; the answer stream (``pipeline.answer.stream``) passes
them through the output filters; the SSE writer, the non-streamed response and the cache all read
them. Upstream order is: deltas, then one ``Finish``, then one ``Usage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.errors import UpstreamError


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """A piece of the answer's text, with the log probabilities of its tokens when the request
    asked for them (OpenAI's ``logprobs.content`` entries: token, logprob, bytes,
    top_logprobs), as the model server gave them."""

    text: str
    logprobs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One whole call of a tool, by the planner or by the model (``arguments`` is the raw
    JSON). ``to_openai``/``from_openai`` are the one conversion to and from OpenAI's shape, for
    the response, the cache, the replay and the messages of the next round."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        function = call.get("function") or {}
        return cls(
            str(call.get("id") or ""),
            str(function.get("name") or ""),
            str(function.get("arguments") or ""),
        )


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of a tool call: the first of a call carries its id and name, later ones more
    of its JSON arguments. ``index`` tells the calls of one answer apart."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The fragment as a streamed chunk's ``delta.tool_calls`` entry."""
        call: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function")
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        call["function"] = function
        return call


@dataclass(frozen=True, slots=True)
class Finish:
    """The answer ended: ``stop``, ``length``, ``tool_calls`` or ``content_filter``.

    ``detail`` says why a filter ended it (the rule), for the final chunk and the span."""

    reason: str
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


StreamEvent = ContentDelta | ToolCallDelta | Finish | Usage


@dataclass(frozen=True, slots=True)
class CitedSource:
    """A passage of the prompt that supports an answer sentence: ``index`` is its place in
    ``rag.sources`` (from 1), ``start``/``end`` the supporting span of the chunk's own text
    (Python string offsets: code points), ``score`` the share of the sentence's content words
    the span holds, IDF-weighted (``pipeline.answer.citations``)."""

    index: int
    document_id: str
    chunk_id: str
    start: int
    end: int
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "document_id": self.document_id,
            "chunk_id": self.chunk_id,
            "span": [self.start, self.end],
            "score": self.score,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CitedSource:
        start, end = data["span"]
        return cls(
            int(data["index"]),
            str(data["document_id"]),
            str(data["chunk_id"]),
            int(start),
            int(end),
            float(data["score"]),
        )


@dataclass(frozen=True, slots=True)
class Citation:
    """One answer sentence (``sentence``: its number from 0; ``start``/``end``: its span of the
    answer text as the client receives it) and the sources that support it, best first;
    ``supported`` is False, and ``sources`` empty, when none does. Made after the output
    filters, so never seen by them; ``to_dict``/``from_dict`` are the one wire shape, for the
    response, the stream and the cache."""

    sentence: int
    start: int
    end: int
    supported: bool
    sources: tuple[CitedSource, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "sentence": self.sentence,
            "text_span": [self.start, self.end],
            "supported": self.supported,
            "sources": [source.to_dict() for source in self.sources],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Citation:
        start, end = data["text_span"]
        return cls(
            int(data["sentence"]),
            int(start),
            int(end),
            bool(data["supported"]),
            tuple(CitedSource.from_dict(s) for s in data.get("sources") or ()),
        )


# What a reader of an answer stream gets: the model's events as the filters let them out, and
# the citations made of that text.
AnswerEvent = StreamEvent | Citation


def _tool_call_deltas(calls: Any) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    for position, call in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        if not isinstance(function, dict) or not all(
            isinstance(field, str | None)
            for field in (call.get("id"), function.get("name"), function.get("arguments"))
        ):
            raise _malformed({"tool_calls": calls})
        index = call.get("index")
        events.append(
            ToolCallDelta(
                index=index if isinstance(index, int) else position,
                id=call.get("id") or None,
                name=function.get("name") or None,
                arguments=function.get("arguments") or "",
            )
        )
    return events


def _logprob_entries(logprobs: Any) -> tuple[dict[str, Any], ...]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return ()
    return tuple(entry for entry in content if isinstance(entry, dict))


def events_from_chunk(chunk: dict[str, Any]) -> list[StreamEvent]:
    """The events in one OpenAI-style ``chat.completion.chunk`` (as vLLM streams them). A chunk
    of another shape (``choices`` not a list of objects, a ``delta`` not an object, a content
    or finish reason not a string, a token count not a number of 0 or more) is the model
    server failing: ``UpstreamError`` 502 ``upstream_malformed``, never a crash further on."""
    events: list[StreamEvent] = []
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise _malformed(chunk)
    for choice in choices:
        delta = (choice.get("delta") or {}) if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise _malformed(chunk)
        content = delta.get("content")
        finish = choice.get("finish_reason")
        if not isinstance(content, str | None) or not isinstance(finish, str | None):
            raise _malformed(chunk)
        logprobs = _logprob_entries(choice.get("logprobs"))
        if content or logprobs:
            events.append(ContentDelta(content or "", logprobs))
        if delta.get("tool_calls"):
            events.extend(_tool_call_deltas(delta["tool_calls"]))
        if finish:
            events.append(Finish(finish))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not all(_count(n) for n in (prompt, completion)):
            raise _malformed(chunk)
        events.append(Usage(int(prompt or 0), int(completion or 0)))
    return events


def _count(value: Any) -> bool:
    """Whether ``value`` can be a token count (absent counts as 0)."""
    if value is None:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _malformed(chunk: dict[str, Any]) -> UpstreamError:
    return UpstreamError(
        f"The model server sent a chunk of an unknown shape: {str(chunk)[:200]}",
        code="upstream_malformed",
    )
