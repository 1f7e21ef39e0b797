"""Helpers of the tool tests: in-memory spans, a caller's tool context, tools that sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.context import Principal
from pipeline.tools.base import Tool, ToolContext
from tests.support.tracing import memory_tracing

OBJECT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class Tracing:
    def __init__(self) -> None:
        self.provider, self.exporter = memory_tracing()
        self.tracer = self.provider.get_tracer("tools-test")

    def spans(self, prefix: str = "execute_tool") -> dict[str, Any]:
        return {s.name: s for s in self.exporter.get_finished_spans() if s.name.startswith(prefix)}


def caller(tenant: str = "acme", user: str = "alice") -> ToolContext:
    return ToolContext(Principal(tenant, user, frozenset({"chat"}), "key-1"))


class Sleeper:
    """A tool that sleeps, recording when each call started and ended (monotonic seconds)."""

    def __init__(self, name: str, seconds: float, **limits: Any) -> None:
        self.seconds = seconds
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.tool = Tool(name, f"sleeps {seconds} s", OBJECT, self.run, **limits)

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.starts.append(time.monotonic())
        await asyncio.sleep(self.seconds)
        self.ends.append(time.monotonic())
        return f"slept {self.seconds}"

    def most_at_once(self) -> int:
        events = sorted([(t, 1) for t in self.starts] + [(t, -1) for t in self.ends])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        return peak
