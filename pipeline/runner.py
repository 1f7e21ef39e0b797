"""The runner: one span per stage, the request's deadline, early exit, concurrent groups, and
each stage's failure policy.

Each stage declares one ``StageSpec``: its name, the context fields it ``reads`` (written before
it runs: ``check_path`` proves it when the path is built, counting a sibling of its concurrent
group, which it then awaits with ``available``), those it reads when a step wrote them and
takes a default otherwise (``optional``), what it ``writes``, its failure ``policy`` and its own
``timeout_s``. ``tests/app/test_stage_contract.py`` runs the real path on a context that records
every field each stage touches and fails on anything undeclared.

The policy says what a failure means: ``fatal`` (auth, validation, retrieval, generation) ends
the request with that error and cancels the siblings of its group; ``degrade`` (features, tools)
is recorded on the span and in ``rag.explain`` and the request goes on, after the stage's
``fallback`` (the ``Fallback`` protocol) has put defaults in place. ``timeout_s`` bounds a
degrading stage, in time the event loop ran on time (``pipeline.looptime.Bound``): a burst that
backlogs the loop is not the stage's dependency being slow, and degrading would not make the
request any faster. Degrading is for faults (a dependency down, a budget spent): a stage's refusal
of the request (a 4xx) and the request's own deadline end the request whatever the policy.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from opentelemetry import trace

from pipeline.context import RequestContext, StageRecord, _current_record
from pipeline.errors import DeadlineExceeded, Described, PipelineError
from pipeline.looptime import Bound
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import current_span, mark_failed

FailurePolicy = Literal["fatal", "degrade"]

# A budgeted stage's span says how much of its time was the event loop's lag, from this much.
LAG_SHOWN_S = 0.001

# Fields every request starts with (set by whoever builds the context).
INPUTS = frozenset({"params", "deadline", "cache_control", "credential"})


@dataclass(frozen=True)
class StageSpec:
    """What a stage is, reads, writes and does when it fails: declared once, checked when the
    path is built (``check_path``) and against behaviour by the contract test."""

    name: str
    reads: frozenset[str] = frozenset()
    optional: frozenset[str] = frozenset()
    writes: frozenset[str] = frozenset()
    policy: FailurePolicy = "fatal"
    timeout_s: float | None = None

    @classmethod
    def of(
        cls,
        name: str,
        *,
        reads: Iterable[str] = (),
        optional: Iterable[str] = (),
        writes: Iterable[str] = (),
        policy: FailurePolicy = "fatal",
        timeout_s: float | None = None,
    ) -> StageSpec:
        return cls(
            name, frozenset(reads), frozenset(optional), frozenset(writes), policy, timeout_s
        )


class Stage(Protocol):
    """A step of the request path. Collaborators come in through ``__init__``."""

    @property
    def spec(self) -> StageSpec: ...

    async def __call__(self, ctx: RequestContext) -> RequestContext: ...


@runtime_checkable
class Fallback(Protocol):
    """A degrading stage's defaults, put in place when it fails and the request goes on."""

    def fallback(self, ctx: RequestContext, exc: Exception) -> None: ...


class Waits:
    """The fields the stages of a running concurrent group have still to write; the runner owns
    one per group, and a stage that needs a sibling's field waits here (``available``)."""

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Event] = {}

    def expect(self, names: Iterable[str]) -> None:
        for name in names:
            self._pending.setdefault(name, asyncio.Event())

    def provide(self, names: Iterable[str]) -> None:
        for name in names:
            pending = self._pending.pop(name, None)
            if pending is not None:
                pending.set()

    async def available(self, name: str) -> None:
        pending = self._pending.get(name)
        if pending is not None:
            await pending.wait()


_waits: contextvars.ContextVar[Waits | None] = contextvars.ContextVar("rag_waits", default=None)


async def available(name: str) -> None:
    """Wait until a sibling stage of the running group has written ``name``, however it ended
    (at once outside a group, or when no running stage is still to write it)."""
    waits = _waits.get()
    if waits is not None:
        await waits.available(name)


class StageObserver(Protocol):
    """Told about every stage that ends (metrics and logs hang here, not in the stages)."""

    def stage_finished(self, record: StageRecord, ctx: RequestContext) -> None: ...


class Concurrent:
    """Stages that run at the same time; the group costs the slowest of them, not their sum."""

    def __init__(self, *stages: Stage) -> None:
        if len(stages) < 2:
            raise ValueError("a concurrent group needs at least two stages")
        self.stages = stages
        self.name = "+".join(stage.spec.name for stage in stages)


Step = Stage | Concurrent


class PathError(ValueError):
    """The steps do not fit together: a stage reads a field nothing before it writes."""


def check_path(steps: Iterable[Step], inputs: frozenset[str] = INPUTS) -> None:
    """Raise ``PathError`` unless every stage's reads are written before it runs."""
    written = set(inputs)
    problems: list[str] = []
    for step in steps:
        stages = step.stages if isinstance(step, Concurrent) else (step,)
        group_writes = set().union(*(stage.spec.writes for stage in stages))
        for stage in stages:
            spec = stage.spec
            siblings = group_writes - spec.writes if isinstance(step, Concurrent) else set()
            missing = spec.reads - written - siblings
            if missing:
                problems.append(f"{spec.name} reads {sorted(missing)}, written by no step before")
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
    def stages(self) -> list[Stage]:
        """Every stage of the path in order, those of a concurrent group in the group's order."""
        stages: list[Stage] = []
        for step in self.steps:
            stages.extend(step.stages if isinstance(step, Concurrent) else (step,))
        return stages

    @property
    def stage_names(self) -> list[str]:
        return [stage.spec.name for stage in self.stages]

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
        with current_span(self.tracer, f"group {group.name}"):
            waits = Waits()
            for stage in group.stages:
                waits.expect(stage.spec.writes)
            token = _waits.set(waits)  # each stage's task starts with a copy of this context
            try:
                async with asyncio.TaskGroup() as tasks:
                    for stage in group.stages:
                        tasks.create_task(self._run_stage(stage, ctx))
            except* PipelineError as group_error:
                # A fatal failure decides the response; its siblings were cancelled with it.
                raise group_error.exceptions[0] from None
            finally:
                _waits.reset(token)

    async def _run_stage(self, stage: Stage, ctx: RequestContext) -> None:
        spec = stage.spec
        record = StageRecord(name=spec.name, start_ms=round(ctx.elapsed_ms(), 3))
        ctx.records.append(record)
        token = _current_record.set(record)
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"stage {spec.name}",
            attributes={attr.STAGE: spec.name},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                await self._call(stage, ctx)
            except Exception as exc:
                mark_failed(span, exc)
                if spec.policy != "degrade" or ends_the_request(exc):
                    record.status = "error"
                    raise
                self._degrade(stage, ctx, record, exc)
            except BaseException:
                record.status = "cancelled"
                raise
            finally:
                record.duration_ms = round((time.perf_counter() - started) * 1000.0, 3)
                record.ended = True
                _current_record.reset(token)
                waits = _waits.get()
                if waits is not None:
                    waits.provide(spec.writes)
                for observer in self.observers:
                    observer.stage_finished(record, ctx)

    async def _call(self, stage: Stage, ctx: RequestContext) -> None:
        spec = stage.spec
        if spec.timeout_s is None or spec.policy != "degrade":
            await stage(ctx)
            return
        bound = Bound(spec.timeout_s)
        try:
            async with bound:
                await stage(ctx)
        except TimeoutError as exc:
            raise StageTimeout(
                f"{spec.name} ran past its budget of {spec.timeout_s * 1000:.0f} ms"
            ) from exc
        finally:
            if bound.lag_s >= LAG_SHOWN_S:  # what the stage's time on its span does not say
                trace.get_current_span().set_attribute(
                    attr.STAGE_LOOP_LAG_MS, round(bound.lag_s * 1000.0, 1)
                )

    def _degrade(
        self, stage: Stage, ctx: RequestContext, record: StageRecord, exc: Exception
    ) -> None:
        record.status = "degraded"
        record.info["error"] = exc.message if isinstance(exc, PipelineError) else str(exc)
        record.info["error_type"] = type(exc).__name__
        if isinstance(stage, Fallback):
            stage.fallback(ctx, exc)


def ends_the_request(exc: Exception) -> bool:
    """Errors no failure policy absorbs: the request's deadline, and refusals of the request
    (a 4xx decided by a stage, such as a guardrail's block)."""
    if isinstance(exc, DeadlineExceeded):
        return True
    return isinstance(exc, PipelineError) and exc.status_code < 500


class StageTimeout(Described):
    """A degrading stage ran past its own time budget."""
