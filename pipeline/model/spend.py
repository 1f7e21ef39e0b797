"""What a request's model calls spent, in tokens: its charge when its answer did not end.

A request's tokens are charged to its caller's limits (``pipeline.store.limits``) from the
answer's usage, which the model server sends at the end of a stream. A stream that never gets
there (its client cut it short, a write stalled, the deadline or the upstream ended it) has no
usage, and would cost its caller nothing: a client could read long answers for free by hanging
up just before their end. So each model call adds what it spent to the request's ``Spend``
(``spent``, set by the HTTP layer): the running usage vLLM puts on every chunk (its continuous
usage stats, ``pipeline.model.client``), exact up to the last chunk read; where an upstream
sends none, an estimate: the prompt's tokens counted here (without the chat template's own, so
it errs low) and one token per streamed delta. A call that streamed nothing is counted as
nothing: it left the queue, was refused, or failed before it generated.
"""

from __future__ import annotations

import contextvars
from typing import Any

import orjson

from pipeline.answer.completion import Completion
from pipeline.context import ChatParams
from pipeline.model.tokens import TokenCounter

# The framing of one chat message around its content (role and separators), as chat templates
# such as SmolLM2's add it.
MESSAGE_OVERHEAD_TOKENS = 4


class Spend:
    """The tokens a request's model calls have spent so far."""

    def __init__(self) -> None:
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += max(0, tokens)

    def charge(self, completion: Completion | None) -> int:
        """What the request is charged: its answer's usage, or what its calls spent where that
        is more (an answer cut short, or ended by a filter before its usage was read); a
        follower of a shared generation, which spent nothing itself, pays the answer's."""
        return max(completion.total_tokens if completion is not None else 0, self.tokens)


spent: contextvars.ContextVar[Spend | None] = contextvars.ContextVar("rag_spent", default=None)


def prompt_tokens(payload: dict[str, Any], counter: TokenCounter) -> int:
    """The prompt tokens of a chat call's ``payload``, counted with ``counter``."""
    total = 0
    for message in payload.get("messages") or []:
        if not isinstance(message, dict):
            continue
        total += MESSAGE_OVERHEAD_TOKENS + counter.count(_text(message.get("content")))
        if message.get("tool_calls"):
            total += counter.count(orjson.dumps(message["tool_calls"]).decode())
    if payload.get("tools"):
        total += counter.count(orjson.dumps(payload["tools"]).decode())
    return total


# Characters per token in OpenAI's estimate of a request before it runs.
CHARS_PER_TOKEN = 4


def estimated_tokens(params: ChatParams, context_length: int) -> int:
    """What a request may spend, from its body alone, as OpenAI's limits reckon it when a
    request arrives: its messages' and tools' text at four characters a token, plus its
    ``max_tokens`` (the whole context where it sets none); at most ``context_length``, the
    most one model call can take. The sources retrieved for it are not known yet: what it
    spends is settled when it ends (``pipeline.store.limits.RateLimiter.settle``)."""
    chars = sum(len(_text(m.get("content"))) for m in params.messages if isinstance(m, dict))
    if params.tools:
        chars += len(orjson.dumps(params.tools))
    answer = params.sampling.get("max_tokens") or context_length
    return min(context_length, chars // CHARS_PER_TOKEN + int(answer))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return ""
