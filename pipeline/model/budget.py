"""The sources cut to fit the route's context window, so a request never fails for them.

The window must hold the whole prompt and the answer: the room left for the sources is the
window, less the answer's ``max_tokens``, less everything else the prompt holds (our
instructions, the personal line, tool results, the caller's messages and the tools it offers,
the chat template's markers) and a margin. Tokens are counted with the served model's tokenizer
(``pipeline.model.tokens``), each part on its own and rounded up where parts join; the
approximate counter, when no tokenizer is found, counts high, so the sources then get less room,
never more.

When the sources do not all fit, the weakest (lowest score) go first; the weakest one still
kept is cut at a sentence end (else a space) to the room that is left, unless that room is
too small to say anything, when it goes too. The kept passages stay in their ranked order and
are the request's passages from then on (``rag.sources``, the citations), so an answer can cite
only what its prompt held: a cut passage keeps the chunk's whole text as ``source_text``, and
attribution reads only the sentences its prompt showed.

A request whose own part leaves no room runs without sources, and the model server decides:
if even that is too long it answers ``context_length_exceeded``, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import orjson

from pipeline.context import Passage, ToolRun
from pipeline.model.messages import text_of
from pipeline.model.prompt import (
    SEPARATOR,
    SOURCE_CHARS,
    SOURCES_HEADING,
    render_source,
    system_prompt,
)
from pipeline.model.tokens import TokenCounter
from pipeline.sources.compress import sentence_spans

# The chat template's markers around one message (SmolLM2's ChatML: `<|im_start|>role\n` and
# `<|im_end|>\n`, 5 tokens), counted high: other templates spend more.
MESSAGE_OVERHEAD_TOKENS: Final = 8
# Once per prompt: the reply's opening marker, a BOS token, and a default system line some
# templates add when the first message is not a system one.
PROMPT_OVERHEAD_TOKENS: Final = 32
# The separator before each source, plus one for a token that may form across a join.
SOURCE_JOIN_TOKENS: Final = 3
# What counting parts apart may still miss.
MARGIN_TOKENS: Final = 16
# The answer's room when the request sets no max_tokens (the server would give it the rest).
ANSWER_RESERVE_TOKENS: Final = 256
# A source cut shorter than this says too little to be worth its tag: dropped instead.
MIN_CUT_TOKENS: Final = 32
ELLIPSIS: Final = " …"


@dataclass(frozen=True)
class SourceFit:
    """The passages that fit (ranked order; at most one of them cut) and what did not."""

    passages: list[Passage]
    budget_tokens: int  # room the sources had (0: none)
    source_tokens: int  # what the kept ones take
    rest_tokens: int  # everything else in the prompt, counted as above
    answer_tokens: int  # room kept for the answer
    dropped: tuple[str, ...] = ()  # chunk ids, weakest first
    cut: str | None = None  # chunk id of the passage cut to fit
    cut_chars: tuple[int, int] | None = None  # its characters shown, of those it had

    @property
    def changed(self) -> bool:
        return bool(self.dropped) or self.cut is not None


def answer_room(max_tokens: Any, context_length: int) -> int:
    """Tokens kept for the answer: its ``max_tokens``, else ``ANSWER_RESERVE_TOKENS`` (at most
    a quarter of the window)."""
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    return min(ANSWER_RESERVE_TOKENS, context_length // 4)


def message_tokens(messages: Iterable[dict[str, Any]], counter: TokenCounter) -> int:
    """The caller's messages as the model reads them: text, tool calls, names, and markers."""
    texts: list[str] = []
    count = 0
    for message in messages:
        count += MESSAGE_OVERHEAD_TOKENS
        texts.append(text_of(message.get("content")))
        for extra in ("tool_calls", "name", "tool_call_id"):
            if message.get(extra) is not None:
                texts.append(orjson.dumps(message[extra]).decode())
    return count + sum(counter.count_many(texts))


def fit_sources(
    messages: Sequence[dict[str, Any]],
    passages: Sequence[Passage],
    *,
    counter: TokenCounter,
    context_length: int,
    max_tokens: Any = None,
    personal: str = "",
    tool_runs: Sequence[ToolRun] = (),
    tools: Any = None,
) -> SourceFit:
    """The passages (ranked, as retrieval left them) that fit the window with the rest."""
    system = system_prompt((), personal=personal, tool_runs=tool_runs)
    texts = [system, SOURCES_HEADING + SEPARATOR]
    if tools:
        texts.append(orjson.dumps(tools).decode())  # a template may render the offered tools
    rest = (
        sum(counter.count_many(texts))
        + message_tokens(messages, counter)
        + MESSAGE_OVERHEAD_TOKENS  # our system message
        + PROMPT_OVERHEAD_TOKENS
        + MARGIN_TOKENS
    )
    answer = answer_room(max_tokens, context_length)
    budget = max(0, context_length - answer - rest)
    costs = [
        c + SOURCE_JOIN_TOKENS for c in counter.count_many([render_source(p) for p in passages])
    ]
    if sum(costs) <= budget:
        return SourceFit(list(passages), budget, sum(costs), rest, answer)
    # Weakest first out: walk from the strongest and keep while the room lasts; the first that
    # does not fit is cut to what is left (or dropped), and every weaker one is dropped.
    ranked = sorted(range(len(passages)), key=lambda i: -passages[i].score)
    kept: dict[int, Passage] = {}
    left = budget
    cut: int | None = None
    for i in ranked:
        if costs[i] <= left:
            kept[i] = passages[i]
            left -= costs[i]
            continue
        if left >= MIN_CUT_TOKENS + SOURCE_JOIN_TOKENS:
            shortened = cut_to(passages[i], left - SOURCE_JOIN_TOKENS, counter)
            if shortened is not None:
                kept[i], cut = shortened, i
                left -= counter.count(render_source(shortened)) + SOURCE_JOIN_TOKENS
        break
    dropped = [i for i in reversed(ranked) if i not in kept]
    return SourceFit(
        [kept[i] for i in sorted(kept)],
        budget,
        budget - left,
        rest,
        answer,
        dropped=tuple(passages[i].chunk_id for i in dropped),
        cut=passages[cut].chunk_id if cut is not None else None,
        cut_chars=(
            (len(kept[cut].text) - len(ELLIPSIS), len(passages[cut].text[:SOURCE_CHARS]))
            if cut is not None
            else None
        ),
    )


def cut_to(passage: Passage, tokens: int, counter: TokenCounter) -> Passage | None:
    """``passage`` with its text cut so that its rendered source takes at most ``tokens``
    (at the last sentence end that keeps half of what fits, else at a space); None when not
    even ``MIN_CUT_TOKENS`` of its text would fit."""
    shown = passage.text[:SOURCE_CHARS]
    head = render_source(replace(passage, text=""))
    room = tokens - counter.count(head) - counter.count(ELLIPSIS) - 1
    if room < MIN_CUT_TOKENS:
        return None
    starts, counts = counter.token_runs([shown])[0]
    end, used = len(shown), 0
    for start, count in zip(starts, counts, strict=True):
        if used + count > room:
            end = start
            break
        used += count
    ends = [b for _, b in sentence_spans(shown) if b <= end]
    if ends and ends[-1] >= end // 2:
        end = ends[-1]
    else:
        space = shown.rfind(" ", 0, end)
        end = space if space > end // 2 else end
    text = shown[:end].rstrip()
    while text:
        candidate = replace(
            passage,
            text=text + ELLIPSIS,
            source_text=passage.source_text if passage.source_text is not None else passage.text,
        )
        if counter.count(render_source(candidate)) <= tokens:
            return candidate
        text = text[: len(text) * 9 // 10].rstrip()  # a count that joined differently: shorter
    return None
