"""Fuzzing the service from its own OpenAPI document with schemathesis: every operation's
generated requests, sent over HTTP, their answers checked against what the document declares,
and a tally of how many reached a handler (and how many the door turned away, and why)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, Response
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# No 5xx, and every answer as declared: its status, content type, headers and body.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Statuses that are refusals at the door: the key (401, 403), the body or query (400, 413),
# an id or name that does not exist (404), a limit (429). Anything else reached a handler.
REFUSALS = frozenset({400, 401, 403, 404, 413, 422, 429})


@dataclass
class Tally:
    """Per operation: answers by status, and the error codes of the refusals."""

    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    refusals: dict[str, Counter[str]] = field(default_factory=dict)
    seconds: Counter[str] = field(default_factory=Counter)

    def record(self, label: str, status: int, body: bytes, elapsed: float = 0.0) -> None:
        self.statuses.setdefault(label, Counter())[status] += 1
        self.seconds[label] += elapsed
        if status in REFUSALS:
            self.refusals.setdefault(label, Counter())[f"{status} {_code(body)}"] += 1

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    @property
    def reached(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if s not in REFUSALS)

    @property
    def share(self) -> float:
        return self.reached / self.total if self.total else 0.0

    @property
    def share_without_ids(self) -> float:
        """``share`` over the operations with no id in their path: a generated id names
        nothing, so those are 404s however many examples are drawn (the linked phase, which
        follows real ids, measures them)."""
        kept = [c for label, c in self.statuses.items() if "{" not in label]
        total = sum(sum(c.values()) for c in kept)
        reached = sum(n for c in kept for s, n in c.items() if s not in REFUSALS)
        return reached / total if total else 0.0

    def report(self, title: str) -> str:
        lines = [
            f"{title}: {self.reached}/{self.total} reached a handler ({self.share:.0%}; "
            f"{self.share_without_ids:.0%} of those with no id in their path)"
        ]
        for label in sorted(self.statuses):
            counts = self.statuses[label]
            reached = sum(n for s, n in counts.items() if s not in REFUSALS)
            top = ", ".join(
                f"{k} x{n}" for k, n in self.refusals.get(label, Counter()).most_common(4)
            )
            lines.append(
                f"  {label}: {reached}/{sum(counts.values())} reached "
                f"({self.seconds[label]:.1f} s); refused: {top}"
            )
        return "\n".join(lines)


def _code(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return f"{error.get('code')} ({error.get('param')})"
    except (ValueError, KeyError, TypeError):
        return "?"


def operations(schema: schemathesis.BaseSchema) -> Iterator[Any]:
    for result in schema.get_all_operations():
        yield result.ok()


def fuzz_operation(
    operation: Any,
    *,
    base_url: str,
    headers: dict[str, str],
    tally: Tally,
    max_examples: int,
    mode: schemathesis.GenerationMode = schemathesis.GenerationMode.POSITIVE,
    adjust: Callable[[Case], None] | None = None,
    checks: list[Any] = CHECKS,
) -> None:
    """Send ``max_examples`` generated requests for one operation; a failing check raises
    (hypothesis shrinks it and prints the smallest example)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        if adjust is not None:
            adjust(case)
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        tally.record(operation.label, response.status_code, response.content, response.elapsed)
        case.validate_response(response, checks=checks, headers=headers)

    try:
        run()
    except Unsatisfiable:
        # Nothing to break: an operation without parameters or body has no invalid request.
        if mode is not schemathesis.GenerationMode.NEGATIVE or tally.statuses.get(operation.label):
            raise


def fuzz_links(
    schema: Any, *, base_url: str, headers: dict[str, str], tally: Tally, scenarios: int, steps: int
) -> None:
    """The stateful phase: sequences of calls that follow the document's links (submit a job,
    then read, list or cancel it; ingest a document, then delete it), each answer checked."""
    machine = schema.as_state_machine()

    class Linked(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: Case) -> dict[str, Any]:
            return {"base_url": base_url, "headers": headers, "timeout": 60}

        def after_call(self, response: Response, case: Case) -> None:
            tally.record(
                case.operation.label, response.status_code, response.content, response.elapsed
            )

        def validate_response(
            self, response: Response, case: Case, additional_checks: Any = None, **kwargs: Any
        ) -> None:
            case.validate_response(response, checks=CHECKS, headers=headers)

    Linked.run(
        settings=settings(
            max_examples=scenarios,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
    )
