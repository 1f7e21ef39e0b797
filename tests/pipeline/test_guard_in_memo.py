"""guard_in's memo of verdicts: a text seen again is judged once, and the memo stays small."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.guards.injection import InjectionDetector
from pipeline.guards.policy import PolicyBook
from pipeline.model.tokens import ApproximateTokenCounter
from pipeline.stages.guard_in import MEMO_CHARS, Blocked, GuardInput, TextMemo


def test_guard_in_judges_a_text_seen_again_from_its_memo_and_keeps_no_long_text() -> None:
    calls: list[str] = []

    def compute(text: str) -> int:
        calls.append(text)
        return len(text)

    memo = TextMemo(compute, size=3)
    long_text = "x" * (MEMO_CHARS + 1) + "\ud800"  # a lone surrogate, as JSON allows
    for text in ("a", long_text, "a", long_text, "".join(["x" * (MEMO_CHARS + 1), "\ud800"])):
        assert memo(text, "t1") == len(text)
    assert calls == ["a", long_text], "each text is computed once"
    assert all(isinstance(k, bytes) or len(k) <= MEMO_CHARS for _, k in memo._kept), (
        "a long text is kept by its digest, not itself"
    )
    memo("a", "t2")
    assert calls[-1] == "a", "another tenant's request never finds the first tenant's entry"
    for text in ("b", "c", "d"):
        memo(text, "t1")
    assert len(memo._kept) == 3, "the memo is bounded"
    memo("a", "t1")
    assert calls[-1] == "a" and len(calls) == 7, "the oldest was forgotten and computed again"


async def test_guard_in_counts_a_text_seen_again_once_and_still_refuses_it_when_too_long() -> None:
    counted: list[str] = []

    class Counting(ApproximateTokenCounter):
        def count(self, text: str) -> int:
            counted.append(text)
            return super().count(text)

    stage = GuardInput(
        PolicyBook.from_json({"*": {"max_input_tokens": 600}}), InjectionDetector(), Counting()
    )
    system = "You answer questions about the sources. " * 12  # ~480 characters, ~100 tokens

    def request(question: str, tenant: str = "acme") -> RequestContext:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return RequestContext(
            params=ChatParams(model="m", messages=messages),
            credential=None,
            deadline=asyncio.get_running_loop().time() + 10,
            principal=Principal(tenant, "alice", frozenset({"chat"}), "k"),
        )

    await stage(request("What is the capital of France?"))
    await stage(request("And of Spain?"))
    assert counted == [system, "What is the capital of France?", "And of Spain?"], (
        "the system prompt is counted once"
    )
    await stage(request("And of Spain?", tenant="other"))
    assert counted.count(system) == 2, "another tenant's request is counted on its own"
    long = "word " * 700  # over 600 tokens: refused, the first time and from the memo
    for _ in range(2):
        with pytest.raises(Blocked) as refused:
            await stage(request(long))
        assert refused.value.code == "input_too_long"
    assert counted.count(long) == 1
