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

from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace

from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCallDelta
from pipeline.context import Passage, RequestContext, StageRecord, current_record
from pipeline.guards.arguments import JsonArgumentsRedactor, RedactorFactory, redactor_factory
from pipeline.guards.grounding import GroundingReport, check_grounding
from pipeline.guards.output import StreamingRedactor
from pipeline.guards.policy import PolicyBook
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr


class OutputGuard:
    """The stream filter: redaction and blocking as the text and the tool calls' arguments
    pass, grounding at the end."""

    name = "guard_out"

    def __init__(
        self, redactor: StreamingRedactor, check: GroundingCheck, arguments: RedactorFactory
    ) -> None:
        self.redactor = redactor
        self.check = check
        self.arguments = arguments
        self.calls: dict[int, JsonArgumentsRedactor] = {}
        self.text: list[str] = []
        self.seen: dict[object, int] = {}
        self.held_max = 0

    def _text(self, text: str) -> list[StreamEvent]:
        self.held_max = max(self.held_max, self.redactor.held)
        if text:
            self.text.append(text)
        return [ContentDelta(text)] if text else []

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
        events = self._text(self.redactor.end())
        for index, redactor in sorted(self.calls.items()):
            rest = redactor.end()
            if rest:
                events.append(ToolCallDelta(index, None, None, rest))
        return events

    def _blocked(self, events: list[StreamEvent]) -> list[StreamEvent]:
        """`events`, ended with ``content_filter`` if a violation the policy blocks came up."""
        sources: list[StreamingRedactor | JsonArgumentsRedactor] = [self.redactor]
        sources += self.calls.values()
        for source in sources:
            new = source.violations[self.seen.get(source, 0) :]
            self.seen[source] = len(source.violations)
            blocked = [
                v.rule for v in new if v.rule == "blocked_term" or v.rule in self.check.blocks
            ]
            if blocked:
                rule = blocked[0]
                finish = Finish("content_filter", rule)
                self.check.done("".join(self.text), self.held_max, finish)
                return [*events, finish]
        return events

    def feed(self, event: StreamEvent) -> Sequence[StreamEvent]:
        if isinstance(event, ContentDelta):
            return self._blocked(self._text(self.redactor.feed(event.text)))
        if isinstance(event, ToolCallDelta):
            return self._blocked(self._call(event))
        if isinstance(event, Finish):
            events = self._blocked(self._flush())
            if not any(isinstance(e, Finish) for e in events):
                events.append(event)
                self.check.done("".join(self.text), self.held_max, event)
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

    def done(self, answer: str, held_max: int, finish: StreamEvent) -> None:
        report = check_grounding(
            answer, {p.document_id for p in self.passages}, [p.text for p in self.passages]
        )
        facts = _facts(report, held_max)
        if isinstance(finish, Finish) and finish.reason == "content_filter":
            facts[attr.GUARD_OUTPUT_VIOLATION] = finish.detail or "content_filter"
        with self.tracer.start_as_current_span("guard_out grounding", context=self.parent) as span:
            span.set_attributes(facts)
        if self.record is not None:
            self.record.info.update({k.removeprefix("rag."): v for k, v in facts.items()})


def _facts(report: GroundingReport, held_max: int) -> dict[str, str | int | float | list[str]]:
    facts: dict[str, str | int | float | list[str]] = {
        attr.GROUNDING_SENTENCES: report.sentences,
        attr.GROUNDING_CITED: list(report.cited),
        attr.GROUNDING_UNKNOWN: list(report.unknown_citations),
        attr.GUARD_OUTPUT_HELD_MAX: held_max,
    }
    if report.support is not None:
        facts[attr.GROUNDING_SUPPORT] = round(report.support, 4)
    return facts


class GuardOutput:
    spec = StageSpec.of("guard_out", reads={"principal", "answer"}, optional={"passages"})

    def __init__(self, policies: PolicyBook, tracer: trace.Tracer) -> None:
        self.policies = policies
        self.tracer = tracer

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if ctx.answer is None:
            return ctx
        policy = self.policies.for_tenant(ctx.caller.tenant)
        blocks = policy.kinds_with("block")
        redactor = StreamingRedactor(
            redact_kinds=policy.kinds_with("redact"),
            block_kinds=blocks,
            blocked_terms=policy.blocked_output_terms,
        )
        record = current_record()
        check = GroundingCheck(
            ctx.passages, frozenset(f"pii.{k}" for k in blocks), self.tracer, record
        )
        ctx.answer.add_filter(OutputGuard(redactor, check, redactor_factory(policy)))
        return ctx
