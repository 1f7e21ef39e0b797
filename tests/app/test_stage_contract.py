"""The stage contract, checked against behaviour: the real path (`app.path`, through the chat
route, against the real vLLM) runs on a context that records every field each stage reads and
writes, and the test fails when a stage touches a field its ``StageSpec`` does not declare, or
writes one after it has returned (from a stream or a task it left running), or when anything
but the runner writes the context outside a stage.

Cases: a miss with retrieval, compression and planned tools; the same request again (a cache
hit); a forced server tool (the function-calling loop inside generate), plain and streamed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest

import app.routes.chat as chat_route
from pipeline.context import RequestContext, current_record
from pipeline.runner import Concurrent, StageSpec
from tests.conftest import chat_request, make_settings

FIELDS = frozenset(f.name for f in dataclasses.fields(RequestContext)) - {"_log"}
# The runner's own bookkeeping, which every stage may touch through the context's methods
# (``respond`` sets ``finished``; ``annotate`` writes the running stage's record).
RUNNER_FIELDS = frozenset({"records", "finished", "request_id", "created", "started"})
# What the runner writes itself outside any stage: a plain answer drained after the path.
RUNNER_WRITES = frozenset({"completion"})

Access = tuple[str | None, bool, str, str]  # stage (None: no stage), after it returned, kind, field


class RecordingList(list[Any]):
    """A list field of the context whose changes are writes of that field."""

    def __init__(self, items: Iterable[Any], owner: RecordingContext, name: str) -> None:
        super().__init__(items)
        self._owner, self._name = owner, name

    def _changed(self) -> None:
        self._owner._note("write", self._name)


class RecordingDict(dict[str, Any]):
    """A dict field of the context whose changes are writes of that field."""

    def __init__(self, items: Any, owner: RecordingContext, name: str) -> None:
        super().__init__(items)
        self._owner, self._name = owner, name

    def _changed(self) -> None:
        self._owner._note("write", self._name)


def _mutator(cls: type, method: str) -> None:
    original = getattr(cls.__mro__[1], method)

    def changed(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._changed()
        return original(self, *args, **kwargs)

    setattr(cls, method, changed)


for _method in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"):
    _mutator(RecordingList, _method)
for _method in ("__setitem__", "__delitem__", "__iadd__"):
    _mutator(RecordingList, _method)
for _method in ("__setitem__", "__delitem__", "update", "pop", "popitem", "setdefault", "clear"):
    _mutator(RecordingDict, _method)


@dataclasses.dataclass
class RecordingContext(RequestContext):
    """A request context that notes, for every field read or written, which stage did it."""

    _log: list[Access] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_on", True)  # construction is the route's, not a stage's
        LOGS.append(self._log)

    def _note(self, kind: str, name: str) -> None:
        if not self.__dict__.get("_on"):
            return
        record = current_record()
        stage = record.name if record is not None else None
        self._log.append((stage, record is not None and record.ended, kind, name))

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name in FIELDS:
            object.__getattribute__(self, "_note")("read", name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FIELDS:
            if type(value) is list:
                value = RecordingList(value, self, name)
            elif type(value) is dict:
                value = RecordingDict(value, self, name)
        object.__setattr__(self, name, value)
        if name in FIELDS:
            self._note("write", name)


LOGS: list[list[Access]] = []


def specs(harness: Any) -> dict[str, StageSpec]:
    return {stage.spec.name: stage.spec for stage in harness.paths.chat.stages}


def violations(log: list[Access], declared: dict[str, StageSpec]) -> list[str]:
    found: set[str] = set()
    for stage, after, kind, name in log:
        if name in RUNNER_FIELDS:
            continue
        if stage is None:
            if kind == "write" and name not in RUNNER_WRITES:
                found.add(f"{name} written outside any stage")
            continue
        spec = declared[stage]
        if kind == "write" and after:
            found.add(f"{stage} writes {name} after it returned")
        elif kind == "write" and name not in spec.writes:
            found.add(f"{stage} writes {name}, undeclared")
        elif kind == "read" and name not in spec.reads | spec.optional | spec.writes:
            found.add(f"{stage} reads {name}, undeclared")
    return sorted(found)


@pytest.fixture
async def harness(make_app, redis_server, vllm, monkeypatch):
    monkeypatch.setattr(chat_route, "RequestContext", RecordingContext)
    # The hit takes the stages (the fast path, which has none, is tested on its own).
    settings = make_settings(redis_server.url, vllm.url, cache={"fast_path": False})
    async with make_app(settings) as h:
        yield h


async def run_case(harness: Any, key: str, request: dict[str, Any]) -> list[str]:
    LOGS.clear()
    response = await harness.chat(key, request)
    assert response.status_code == 200, response.text
    (log,) = LOGS
    return violations(log, specs(harness))


FJORDS = {
    "id": "fjords",
    "title": "Fjords",
    "text": "Fjords form where glaciers carve deep valleys that the sea later floods. "
    "They are common in Norway. The water in them can be very deep.",
}


async def test_every_stage_touches_only_what_it_declares(harness) -> None:
    key = await harness.key(scopes="chat,retrieve,ingest")
    ingested = await harness.client.post(
        "/v1/documents",
        json={"documents": [FJORDS]},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert ingested.status_code == 200, ingested.text
    miss = chat_request("How do fjords form? And what is 12 * 7?", max_tokens=12)
    cases = {
        "miss": miss,
        "hit": miss,
        "miss, streamed": {
            **miss,
            "stream": True,
            "messages": [{"role": "user", "content": "Where are fjords common?"}],
        },
        "forced server tool": chat_request(
            "What is 1234 * 5678?",
            tool_choice={"type": "function", "function": {"name": "calculator"}},
            rag={"enabled": False, "plan_tools": False},
            max_tokens=48,
        ),
    }
    cases["forced server tool, streamed"] = {
        **cases["forced server tool"],
        "stream": True,
        "messages": [{"role": "user", "content": "What is 4321 * 8765?"}],
    }
    found = {name: await run_case(harness, key, request) for name, request in cases.items()}
    assert found == {name: [] for name in cases}, "\n".join(
        f"{name}: {problem}" for name, problems in found.items() for problem in problems
    )


async def test_the_recorder_sees_an_undeclared_access(harness, monkeypatch) -> None:
    """The check can fail: a stage that reads a field it does not declare is reported."""
    validate = next(
        step
        for step in harness.paths.chat.steps
        if not isinstance(step, Concurrent) and step.spec.name == "validate"
    )
    original = type(validate).__call__

    async def peeking(self: Any, ctx: RequestContext) -> RequestContext:
        _ = ctx.passages  # undeclared
        return await original(self, ctx)

    monkeypatch.setattr(type(validate), "__call__", peeking)
    key = await harness.key()
    found = await run_case(harness, key, chat_request("Hello there.", max_tokens=4))
    assert "validate reads passages, undeclared" in found
