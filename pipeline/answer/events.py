"""Typed stream events: what an answer is made of, as it is made.

Generation turns vLLM's chunks into these; the answer stream (``pipeline.answer.stream``) passes
them through the output filters; the SSE writer, the non-streamed response and the cache all read
them. Upstream order is: deltas, then one ``Finish``, then one ``Usage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def _tool_call_deltas(calls: Any) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    for position, call in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
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
    """The events in one OpenAI-style ``chat.completion.chunk`` (as vLLM streams them)."""
    events: list[StreamEvent] = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        logprobs = _logprob_entries(choice.get("logprobs"))
        if delta.get("content") or logprobs:
            events.append(ContentDelta(str(delta.get("content") or ""), logprobs))
        if delta.get("tool_calls"):
            events.extend(_tool_call_deltas(delta["tool_calls"]))
        if choice.get("finish_reason"):
            events.append(Finish(str(choice["finish_reason"])))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        events.append(
            Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
        )
    return events
