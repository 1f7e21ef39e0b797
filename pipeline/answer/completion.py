"""A complete answer: what is returned, cached and replayed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.answer.events import Citation, ToolCall


class UnreadableCompletion(ValueError):
    """A stored completion this code cannot read."""


@dataclass
class Completion:
    """The answer as it came out of the output filters, with what the response reports of it.

    ``tool_calls`` are calls for the client to run; ``tools`` are the server's
    own tool runs (name, status, duration); ``route`` is the model route that answered.
    ``cache_ttl`` caps how long the answer may be cached (a tool whose result changes with time
    was used); None means the cache's own TTL. ``logprobs`` are the content tokens' entries
    when the request asked for them (those of redacted text removed), None when it did not.
    ``citations`` say which source supports each sentence of ``content``
    (``pipeline.answer.citations``); they are cached and replayed with it.
    """

    content: str
    finish_reason: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sources: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    route: dict[str, Any] | None = None
    finish_detail: str | None = None
    cache_ttl: int | None = None
    logprobs: list[dict[str, Any]] | None = None  # None: not asked for
    citations: list[Citation] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        """Prompt and completion: what the answer costs against the caller's token limits."""
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "sources": self.sources,
            "tool_calls": [call.to_openai() for call in self.tool_calls],
            "tools": self.tools,
            "route": self.route,
            "finish_detail": self.finish_detail,
            "logprobs": self.logprobs,
            "citations": [citation.to_dict() for citation in self.citations],
        }

    @classmethod
    def from_stored(cls, raw: bytes | str) -> Completion:
        """The completion ``to_dict`` stored as JSON (the response cache's entry, a coalesced
        flight's answer); ``UnreadableCompletion`` for anything else: another version's entry,
        or a damaged one."""
        try:
            data = orjson.loads(raw)
            completion = cls.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            # orjson's decode error is a ValueError.
            raise UnreadableCompletion(f"{type(exc).__name__}: {exc}"[:200]) from exc
        if not all(isinstance(item, dict) for item in (*completion.sources, *completion.tools)):
            raise UnreadableCompletion("its sources and tools are not all objects")
        return completion

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Completion:
        route = data.get("route")
        detail = data.get("finish_detail")
        logprobs = data.get("logprobs")
        return cls(
            content=str(data["content"]),
            finish_reason=str(data["finish_reason"]),
            model=str(data["model"]),
            prompt_tokens=int(data.get("prompt_tokens", 0)),
            completion_tokens=int(data.get("completion_tokens", 0)),
            sources=list(data.get("sources", [])),
            tool_calls=[ToolCall.from_openai(c) for c in data.get("tool_calls", [])],
            tools=list(data.get("tools", [])),
            route=dict(route) if isinstance(route, dict) else None,
            finish_detail=str(detail) if detail is not None else None,
            logprobs=list(logprobs) if isinstance(logprobs, list) else None,
            citations=[Citation.from_dict(c) for c in data.get("citations") or ()],
        )
