"""The runner: one span per stage, the request's deadline, early exit, concurrent groups, and
each stage's failure policy.

A stage declares what it ``reads`` and ``writes`` of the context; ``check_path`` proves, when
the path is built, that every field a stage reads is written before it (or by a sibling of its
concurrent group, which it then awaits with ``ctx.available``). Its ``policy`` says what its
failure means: ``fatal`` (auth, validation, retrieval, generation) ends the request with that
error and cancels the siblings of its group; ``degrade`` (features, tools) is recorded on the
span and in ``rag.explain`` and the request goes on, after the stage's ``fallback`` has put
defaults in place. A degrading stage may also set ``timeout_s``, its own time budget. Degrading
is for faults (a dependency down, a budget spent): a stage's refusal of the request (a 4xx) and
the request's own deadline end the request whatever the policy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from opentelemetry import trace

from pipeline.context import RequestContext, StageRecord, _current_record
from pipeline.errors import DeadlineExceeded, PipelineError
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import mark_failed

FailurePolicy = Literal["fatal", "degrade"]

# Fields every request starts with (set by whoever builds the context).
INPUTS = frozenset({"params", "deadline", "cache_control", "credential"})


class Stage(Protocol):
    """A step of the request path. Collaborators come in through ``__init__``."""

    name: str
    reads: frozenset[str]
    writes: frozenset[str]
    policy: FailurePolicy

    async def __call__(self, ctx: RequestContext) -> RequestContext: ...


class StageObserver(Protocol):
    """Told about every stage that ends (metrics and logs hang here, not in the stages)."""

    def stage_finished(self, record: StageRecord, ctx: RequestContext) -> None: ...


class Concurrent:
    """Stages that run at the same time; the group costs the slowest of them, not their sum."""

    def __init__(self, *stages: Stage) -> None:
        if len(stages) < 2:
            raise ValueError("a concurrent group needs at least two stages")
        self.stages = stages
        self.name = "+".join(stage.name for stage in stages)


Step = Stage | Concurrent


class PathError(ValueError):
    """The steps do not fit together: a stage reads a field nothing before it writes."""


def _reads(stage: Stage) -> frozenset[str]:
    return frozenset(getattr(stage, "reads", frozenset()))


def _writes(stage: Stage) -> frozenset[str]:
    return frozenset(getattr(stage, "writes", frozenset()))


def policy_of(stage: Stage) -> FailurePolicy:
    policy: FailurePolicy = getattr(stage, "policy", "fatal")
    return policy


def check_path(steps: Iterable[Step], inputs: frozenset[str] = INPUTS) -> None:
    """Raise ``PathError`` unless every stage's reads are written before it runs."""
    written = set(inputs)
    problems: list[str] = []
    for step in steps:
        stages = step.stages if isinstance(step, Concurrent) else (step,)
        group_writes = set().union(*(_writes(stage) for stage in stages))
        for stage in stages:
            siblings = group_writes - _writes(stage) if isinstance(step, Concurrent) else set()
            missing = _reads(stage) - written - siblings
            if missing:
                problems.append(f"{stage.name} reads {sorted(missing)}, written by no step before")
        written |= group_writes
    if problems:
        raise PathError("; ".join(problems))


class Runner:
    """Runs the steps in order until one of them finishes the request.

    Each stage gets its own span (``stage {name}``) and explain record; the whole run is bounded
    by ``ctx.deadline`` (event-loop time), past which the request fails with ``DeadlineExceeded``.
    A plain (non-streamed) answer is read to its end inside the same deadline.
    """

    def __init__(
        self,
        steps: Sequence[Step],
        tracer: trace.Tracer,
        *,
        observers: Sequence[StageObserver] = (),
        inputs: frozenset[str] = INPUTS,
    ) -> None:
        check_path(steps, inputs)
        self.steps = list(steps)
        self.tracer = tracer
        self.observers = list(observers)

    @property
    def stage_names(self) -> list[str]:
        names: list[str] = []
        for step in self.steps:
            names.extend(s.name for s in (step.stages if isinstance(step, Concurrent) else [step]))
        return names

    async def run(self, ctx: RequestContext) -> RequestContext:
        try:
            async with asyncio.timeout_at(ctx.deadline):
                for step in self.steps:
                    if ctx.finished:
                        break
                    if isinstance(step, Concurrent):
                        await self._run_group(step, ctx)
                    else:
                        await self._run_stage(step, ctx)
                if not ctx.params.stream and ctx.answer is not None and ctx.completion is None:
                    ctx.completion = await ctx.answer.drain()
        except TimeoutError as exc:
            raise DeadlineExceeded() from exc
        return ctx

    async def _run_group(self, group: Concurrent, ctx: RequestContext) -> None:
        with self.tracer.start_as_current_span(f"group {group.name}"):
            for stage in group.stages:
                ctx.expect(_writes(stage))
            try:
                async with asyncio.TaskGroup() as tasks:
                    for stage in group.stages:
                        tasks.create_task(self._run_stage(stage, ctx))
            except* PipelineError as group_error:
                # A fatal failure decides the response; its siblings were cancelled with it.
                raise group_error.exceptions[0] from None

    async def _run_stage(self, stage: Stage, ctx: RequestContext) -> None:
        record = StageRecord(name=stage.name, start_ms=round(ctx.elapsed_ms(), 3))
        ctx.records.append(record)
        token = _current_record.set(record)
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"stage {stage.name}",
            attributes={attr.STAGE: stage.name},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                await self._call(stage, ctx)
            except Exception as exc:
                mark_failed(span, exc)
                if policy_of(stage) != "degrade" or ends_the_request(exc):
                    record.status = "error"
                    raise
                self._degrade(stage, ctx, record, exc)
            except BaseException:
                record.status = "cancelled"
                raise
            finally:
                record.duration_ms = round((time.perf_counter() - started) * 1000.0, 3)
                _current_record.reset(token)
                ctx.provide(_writes(stage))
                for observer in self.observers:
                    observer.stage_finished(record, ctx)

    async def _call(self, stage: Stage, ctx: RequestContext) -> None:
        budget: float | None = getattr(stage, "timeout_s", None)
        if budget is None or policy_of(stage) != "degrade":
            await stage(ctx)
            return
        try:
            async with asyncio.timeout(budget):
                await stage(ctx)
        except TimeoutError as exc:
            raise StageTimeout(
                f"{stage.name} ran past its budget of {budget * 1000:.0f} ms"
            ) from exc

    def _degrade(
        self, stage: Stage, ctx: RequestContext, record: StageRecord, exc: Exception
    ) -> None:
        record.status = "degraded"
        record.info["error"] = exc.message if isinstance(exc, PipelineError) else str(exc)
        record.info["error_type"] = type(exc).__name__
        fallback = getattr(stage, "fallback", None)
        if fallback is not None:
            fallback(ctx, exc)


def ends_the_request(exc: Exception) -> bool:
    """Errors no failure policy absorbs: the request's deadline, and refusals of the request
    (a 4xx decided by a stage, such as a guardrail's block)."""
    if isinstance(exc, DeadlineExceeded):
        return True
    return isinstance(exc, PipelineError) and exc.status_code < 500


class StageTimeout(Exception):
    """A degrading stage ran past its own time budget."""
