"""The runner: one span per stage, the request's deadline, early exit, concurrent groups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from pipeline import attributes as attr
from pipeline.context import RequestContext, StageRecord, _current_record
from pipeline.errors import DeadlineExceeded, PipelineError


class Stage(Protocol):
    """A step of the request path. Collaborators come in through ``__init__``."""

    name: str

    async def __call__(self, ctx: RequestContext) -> RequestContext: ...


class Concurrent:
    """Stages that run at the same time; the group costs the slowest of them, not their sum."""

    def __init__(self, *stages: Stage) -> None:
        if len(stages) < 2:
            raise ValueError("a concurrent group needs at least two stages")
        self.stages = stages
        self.name = "+".join(stage.name for stage in stages)


Step = Stage | Concurrent


class Runner:
    """Runs the steps in order until one of them finishes the request.

    Each stage gets its own span (``stage {name}``) and explain record; the whole run is bounded
    by ``ctx.deadline`` (event-loop time), past which the request fails with ``DeadlineExceeded``.
    """

    def __init__(self, steps: Sequence[Step], tracer: trace.Tracer) -> None:
        self.steps = list(steps)
        self.tracer = tracer

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
        except TimeoutError as exc:
            raise DeadlineExceeded() from exc
        return ctx

    async def _run_group(self, group: Concurrent, ctx: RequestContext) -> None:
        with self.tracer.start_as_current_span(f"group {group.name}"):
            try:
                async with asyncio.TaskGroup() as tasks:
                    for stage in group.stages:
                        tasks.create_task(self._run_stage(stage, ctx))
            except* PipelineError as group_error:
                # The first failure decides the response; siblings were cancelled with it.
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
                await stage(ctx)
            except BaseException as exc:
                record.status = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
                if not isinstance(exc, asyncio.CancelledError):
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                    span.set_attribute("error.type", type(exc).__name__)
                raise
            finally:
                record.duration_ms = round((time.perf_counter() - started) * 1000.0, 3)
                _current_record.reset(token)
