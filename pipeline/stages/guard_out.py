"""The output guardrails, on the answer while it streams.

The stage adds one filter to the answer stream (``pipeline.answer.stream``), so the streamed and the
plain answer pass the same code, and the completion that is returned and cached is what came
out of it. The filter redacts PII and blocked terms as the text arrives, holding back only the
tail that could still become a match (so the stream stays a stream), in the answer's text and
in the arguments of the tool calls it passes to the client alike (``guards.arguments``: JSON
redacted inside its strings, kept valid; a forced ``tool_choice`` makes the whole answer such
arguments). A violation the policy blocks, in either, ends the answer with ``finish_reason:
"content_filter"`` and the rule as the detail (such an answer is never cached). The arguments
of server tools never reach this filter: the tool loop redacts them the same way before the
tool runs (``stages.generate``). When the answer is complete the filter checks its grounding:
every cited ``[doc-id]`` was in the context, and the share of its sentences the context
supports; the results go on a ``guard_out grounding`` span and into ``rag.explain``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCallDelta
from pipeline.context import Passage, RequestContext, StageRecord, current_record
from pipeline.guards.arguments import (
    OUTSIDE_STRING,
    JsonArgumentsRedactor,
    RedactorFactory,
    redactor_factory,
)
from pipeline.guards.grounding import GroundingReport, check_grounding
from pipeline.guards.output import StreamingRedactor
from pipeline.guards.policy import PolicyBook
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr

# Rules that end the answer whatever the tenant's policy.
ALWAYS_BLOCKED = frozenset({"blocked_term", OUTSIDE_STRING})


class LogprobAligner:
    """Gives the text the output filter emits the logprob entries of the tokens it covers, and
    drops the entries of tokens that were redacted (any overlap with a replaced span).

    Each entry gets its token's span in the text fed so far; a delta's last entry reaches its
    delta's end, so tokens the server wrote oddly (partial UTF-8) still cover the text."""

    def __init__(self) -> None:
        self.fed = 0
        self.pending: deque[tuple[int, int, dict[str, Any]]] = deque()
        self.original: list[str] = []  # kept only for `align` (answers under a JSON schema)
        self.past = 0  # redacted spans that end before the next pending token

    def take(self, delta: ContentDelta, *, keep_text: bool = False) -> None:
        start, end = self.fed, self.fed + len(delta.text)
        position = start
        for number, entry in enumerate(delta.logprobs):
            token = entry.get("token")
            stop = min(end, position + (len(token) if isinstance(token, str) else 0))
            if number == len(delta.logprobs) - 1:
                stop = end
            self.pending.append((position, stop, entry))
            position = stop
        self.fed = end
        if keep_text:
            self.original.append(delta.text)

    def release(self, emitted: int, redacted: Sequence[tuple[int, int]]) -> tuple[Any, ...]:
        """The entries whose tokens lie wholly in the first `emitted` characters, less those
        that overlap a redacted span."""
        out = []
        while self.pending and self.pending[0][1] <= emitted:
            start, end, entry = self.pending.popleft()
            # Spans come in order: those ending before this token end before every later one.
            while self.past < len(redacted) and redacted[self.past][1] <= start:
                self.past += 1
            if not any(_overlaps(start, end, a, b) for a, b in redacted[self.past :]):
                out.append(entry)
        return tuple(out)

    def align(self, output: str) -> tuple[Any, ...]:
        """All the entries at once, for text redacted by a reader whose offsets are its own
        (JSON): a token is kept when it lies wholly in a stretch the output kept unchanged."""
        stretches = iter(kept_stretches("".join(self.original), output))
        stretch = next(stretches, None)
        out = []
        for start, end, entry in self.pending:  # both in order: one pass over each
            while stretch is not None and stretch[1] < end:
                stretch = next(stretches, None)
            if stretch is not None and stretch[0] <= start:
                out.append(entry)
        self.pending.clear()
        return tuple(out)


ANCHOR = 8  # characters of the original that must reappear for the output to be back in step
LOOK_AHEAD = 512  # how far, in both texts, a changed stretch is looked past


def kept_stretches(original: str, output: str) -> list[tuple[int, int]]:
    """The stretches of `original` that `output` holds unchanged, in order, in linear time:
    `output` is `original` with some short stretches rewritten (redacted, re-escaped). Walk
    both while they agree; where they part, find the first `ANCHOR` characters of the original,
    within `LOOK_AHEAD`, that reappear in the output's next `LOOK_AHEAD`, and go on from there.
    Every stretch returned was compared character by character; past a change that cannot be
    looked past, nothing more is kept (fewer entries, never one of rewritten text)."""
    if original == output:
        return [(0, len(original))] if original else []
    # The common end is kept too (the walk cannot anchor on fewer than ANCHOR characters).
    tail = 0
    limit = min(len(original), len(output))
    while tail < limit and original[-1 - tail] == output[-1 - tail]:
        tail += 1
    kept = _walk(original[: len(original) - tail], output[: len(output) - tail])
    return [*kept, (len(original) - tail, len(original))] if tail else kept


def _walk(original: str, output: str) -> list[tuple[int, int]]:
    kept: list[tuple[int, int]] = []
    i = j = 0
    while i < len(original) and j < len(output):
        start = i
        while i < len(original) and j < len(output) and original[i] == output[j]:
            i, j = i + 1, j + 1
        if i > start:
            kept.append((start, i))
            continue
        for skip in range(min(LOOK_AHEAD, len(original) - i)):
            anchor = original[i + skip : i + skip + ANCHOR]
            if len(anchor) < ANCHOR:
                return kept
            found = output.find(anchor, j + 1, j + 1 + LOOK_AHEAD + ANCHOR)
            if found >= 0:
                i, j = i + skip, found
                break
        else:
            return kept
    return kept


def _overlaps(start: int, end: int, a: int, b: int) -> bool:
    if start == end:  # a token of no text: inside a span or not
        return a <= start < b
    return start < b and a < end


@dataclass
class Holdback:
    """What the answer's redaction held back: the most characters at once, and how long its
    first text waited (from the model's first text to the first text let out, in ms) and how
    many of the model's pieces of text it took for that, the answer's end counting as one
    when it let the text out (1: let out as it came; 2: at the next piece)."""

    most: int = 0
    first_ms: float | None = None
    first_pieces: int = 0
    _first_in: float | None = field(default=None, init=False, repr=False)

    def took(self, piece: str, released: str, held: int) -> None:
        """One piece of the model's text went in, ``released`` came out, ``held`` stays."""
        self.most = max(self.most, held)
        if self.first_ms is None and piece:
            if self._first_in is None:
                self._first_in = time.perf_counter()
            self._counted(released)

    def ended(self, released: str) -> None:
        """The answer ended, letting out ``released``: a first text held to the end."""
        if self.first_ms is None and self._first_in is not None:
            self._counted(released)

    def _counted(self, released: str) -> None:
        """One more piece waited for; the wait ends when ``released`` is the first text."""
        self.first_pieces += 1
        if released and self._first_in is not None:
            self.first_ms = round((time.perf_counter() - self._first_in) * 1000.0, 3)

    def facts(self) -> dict[str, int | float]:
        facts: dict[str, int | float] = {attr.GUARD_OUTPUT_HELD_MAX: self.most}
        if self.first_ms is not None:
            facts[attr.GUARD_OUTPUT_FIRST_HELD_MS] = self.first_ms
            facts[attr.GUARD_OUTPUT_FIRST_HELD_PIECES] = self.first_pieces
        return facts


class OutputGuard:
    """The stream filter: redaction and blocking as the text and the tool calls' arguments
    pass, grounding at the end.

    An answer that must be JSON (``response_format`` json_object or json_schema) is read as
    JSON, as tool-call arguments are: PII is redacted inside its strings, so it stays valid
    JSON, and PII outside a string (a number) ends the answer with ``content_filter``
    (``pii_outside_string``) rather than turning a number into a string against its schema."""

    name = "guard_out"

    def __init__(
        self,
        check: GroundingCheck,
        arguments: RedactorFactory,
        *,
        structured: bool = False,
        logprobs: bool = False,
    ) -> None:
        # The answer's redactor: as text, or as JSON read string by string.
        self.answer: StreamingRedactor | JsonArgumentsRedactor = (
            JsonArgumentsRedactor(arguments, quote_bare=False) if structured else arguments("")
        )
        self.check = check
        self.arguments = arguments
        self.calls: dict[int, JsonArgumentsRedactor] = {}
        self.text: list[str] = []
        self.seen: dict[object, int] = {}
        self.holdback = Holdback()
        self.logprobs = LogprobAligner() if logprobs else None

    def _content(self, delta: ContentDelta) -> list[StreamEvent]:
        if self.logprobs is not None:
            self.logprobs.take(delta, keep_text=isinstance(self.answer, JsonArgumentsRedactor))
        text = self.answer.feed(delta.text)
        self.holdback.took(delta.text, text, self.answer.held)
        return self._text(text, self._released())

    def _released(self) -> tuple[Any, ...]:
        """The logprobs entries of text emitted so far (a JSON answer's: at its end only)."""
        if self.logprobs is None or not isinstance(self.answer, StreamingRedactor):
            return ()
        return self.logprobs.release(self.answer.emitted, self.answer.redacted)

    def _text(self, text: str, entries: tuple[Any, ...] = ()) -> list[StreamEvent]:
        if text:
            self.text.append(text)
        return [ContentDelta(text, entries)] if text or entries else []

    def _call(self, delta: ToolCallDelta) -> list[StreamEvent]:
        redactor = self.calls.get(delta.index)
        if redactor is None:
            redactor = self.calls[delta.index] = JsonArgumentsRedactor(self.arguments)
        arguments = redactor.feed(delta.arguments)
        if not (arguments or delta.id or delta.name):
            return []
        return [ToolCallDelta(delta.index, delta.id, delta.name, arguments)]

    def _flush(self) -> list[StreamEvent]:
        """Everything still held: the text, then each call's arguments."""
        rest = self.answer.end()
        entries = self._released()
        if self.logprobs is not None and isinstance(self.answer, JsonArgumentsRedactor):
            entries = self.logprobs.align("".join(self.text) + rest)
        self.holdback.ended(rest)
        events = self._text(rest, entries)
        for index, redactor in sorted(self.calls.items()):
            rest = redactor.end()
            if rest:
                events.append(ToolCallDelta(index, None, None, rest))
        return events

    def _blocked(self, events: list[StreamEvent]) -> list[StreamEvent]:
        """`events`, ended with ``content_filter`` if a violation the policy blocks came up."""
        sources: list[StreamingRedactor | JsonArgumentsRedactor] = [self.answer]
        sources += self.calls.values()
        for source in sources:
            new = source.violations[self.seen.get(source, 0) :]
            self.seen[source] = len(source.violations)
            blocks = ALWAYS_BLOCKED | self.check.blocks
            blocked = [v.rule for v in new if v.rule in blocks]
            if blocked:
                rule = blocked[0]
                finish = Finish("content_filter", rule)
                self.check.done("".join(self.text), self.holdback, finish)
                return [*events, finish]
        return events

    def feed(self, event: StreamEvent) -> Sequence[StreamEvent]:
        if isinstance(event, ContentDelta):
            return self._blocked(self._content(event))
        if isinstance(event, ToolCallDelta):
            return self._blocked(self._call(event))
        if isinstance(event, Finish):
            events = self._blocked(self._flush())
            if not any(isinstance(e, Finish) for e in events):
                events.append(event)
                self.check.done("".join(self.text), self.holdback, event)
            return events
        return [event]

    def end(self) -> Sequence[StreamEvent]:
        return self._blocked(self._flush())


class GroundingCheck:
    """Judges the finished answer against the passages that were in the prompt."""

    def __init__(
        self,
        passages: Sequence[Passage],
        blocks: frozenset[str],
        tracer: trace.Tracer,
        record: StageRecord | None,
    ) -> None:
        self.passages = list(passages)
        self.blocks = blocks
        self.tracer = tracer
        self.record = record
        self.parent = otel_context.get_current()

    def done(self, answer: str, holdback: Holdback, finish: StreamEvent) -> None:
        report = check_grounding(
            answer, {p.document_id for p in self.passages}, [p.text for p in self.passages]
        )
        facts = _facts(report, holdback)
        if isinstance(finish, Finish) and finish.reason == "content_filter":
            facts[attr.GUARD_OUTPUT_VIOLATION] = finish.detail or "content_filter"
        with self.tracer.start_as_current_span("guard_out grounding", context=self.parent) as span:
            span.set_attributes(facts)
        if self.record is not None:
            self.record.info.update({attr.info_key(k): v for k, v in facts.items()})


def _facts(report: GroundingReport, holdback: Holdback) -> dict[str, str | int | float | list[str]]:
    facts: dict[str, str | int | float | list[str]] = {
        attr.GROUNDING_SENTENCES: report.sentences,
        attr.GROUNDING_CITED: list(report.cited),
        attr.GROUNDING_UNKNOWN: list(report.unknown_citations),
        **holdback.facts(),
    }
    if report.support is not None:
        facts[attr.GROUNDING_SUPPORT] = round(report.support, 4)
    return facts


def structured_output(response_format: Any) -> bool:
    """Whether the answer must be JSON (``response_format`` json_object or json_schema)."""
    return isinstance(response_format, dict) and response_format.get("type") in (
        "json_object",
        "json_schema",
    )


class GuardOutput:
    spec = StageSpec.of("guard_out", reads={"params", "principal", "answer"}, optional={"passages"})

    def __init__(self, policies: PolicyBook, tracer: trace.Tracer) -> None:
        self.policies = policies
        self.tracer = tracer

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if ctx.answer is None:
            return ctx
        policy = self.policies.for_tenant(ctx.caller.tenant)
        blocks = policy.kinds_with("block")
        record = current_record()
        check = GroundingCheck(
            ctx.passages, frozenset(f"pii.{k}" for k in blocks), self.tracer, record
        )
        sampling = ctx.params.sampling
        ctx.answer.add_filter(
            OutputGuard(
                check,
                redactor_factory(policy),
                structured=structured_output(sampling.get("response_format")),
                logprobs=bool(sampling.get("logprobs")),
            )
        )
        return ctx
