"""guard_in's memo of verdicts: a text seen again is judged once, and the memo stays small."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.guards.injection import InjectionDetector
from pipeline.guards.policy import PolicyBook
from pipeline.model.salt import MemoScope
from pipeline.model.tokens import ApproximateTokenCounter
from pipeline.stages import guard_in
from pipeline.stages.guard_in import MEMO_CHARS, Blocked, GuardInput, TextMemo


def test_guard_in_judges_a_text_seen_again_from_its_memo_and_keeps_no_long_text() -> None:
    calls: list[str] = []

    def compute(text: str, tenant: str) -> int:
        calls.append(text)
        return len(text)

    memo = TextMemo(compute, size=3)
    long_text = "x" * (MEMO_CHARS + 1) + "\ud800"  # a lone surrogate, as JSON allows
    for text in ("a", long_text, "a", long_text, "".join(["x" * (MEMO_CHARS + 1), "\ud800"])):
        assert memo(text, "t1") == len(text)
    assert calls == ["a", long_text], "each text is computed once"
    assert all(isinstance(k, bytes) or len(k) <= MEMO_CHARS for _, k in memo.kept._values), (
        "a long text is kept by its digest, not itself"
    )
    memo("a", "t2")
    assert calls[-1] == "a", "another tenant's request never finds the first tenant's entry"
    for text in ("b", "c", "d"):
        memo(text, "t1")
    assert len(memo.kept) == 3, "the memo is bounded"
    memo("a", "t1")
    assert calls[-1] == "a" and len(calls) == 7, "the oldest was forgotten and computed again"


async def test_guard_in_counts_a_text_seen_again_once_and_still_refuses_it_when_too_long() -> None:
    counted: list[str] = []

    class Counting(ApproximateTokenCounter):
        def count(self, text: str) -> int:
            counted.append(text)
            return super().count(text)

    stage = GuardInput(
        PolicyBook.from_json({"*": {"max_input_tokens": 600}}),
        InjectionDetector(),
        Counting(),
        MemoScope(),
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


def test_the_memo_keeps_its_values_weight_within_the_budget() -> None:
    calls: list[str] = []

    def compute(text: str, tenant: str) -> tuple[int, ...]:
        calls.append(text)
        return tuple(range(int(text.split(":")[0])))  # "4:a" weighs 4

    memo = TextMemo(compute, size=100, weight=len, budget=10)
    for text in ("4:a", "4:b", "4:a"):
        memo(text, "t1")
    assert calls == ["4:a", "4:b"] and memo.kept.weight == 8
    memo("4:c", "t1")  # 12 over 10: the least recently used (b) goes
    assert memo.kept.weight == 8 and len(memo.kept) == 2
    memo("4:b", "t1")
    assert calls[-1] == "4:b", "the one let go is computed again"
    for _ in range(2):
        assert len(memo("11:x", "t1")) == 11  # over the budget alone: answered, never kept
    assert calls.count("11:x") == 2 and memo.kept.weight <= 10
    memo("0:empty", "t1")
    memo("0:empty", "t1")
    assert calls.count("0:empty") == 1, "a weightless value is kept as before"


async def test_texts_packed_with_pii_cannot_grow_the_guards_memo_past_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(guard_in, "MEMO_FINDINGS", 1_500)
    stage = GuardInput(
        PolicyBook.from_json({}), InjectionDetector(), ApproximateTokenCounter(), MemoScope()
    )

    async def ask(text: str) -> str:
        ctx = RequestContext(
            params=ChatParams(model="m", messages=[{"role": "user", "content": text}]),
            credential=None,
            deadline=asyncio.get_running_loop().time() + 30,
            principal=Principal("acme", "alice", frozenset({"chat"}), "k"),
        )
        await stage(ctx)
        content: str = ctx.params.messages[0]["content"]
        return content

    # A careless or hostile caller: distinct texts, each as many addresses as its tokens allow.
    def letters(i: int) -> str:
        return "".join("abcdefghijklmnopqrstuvwxyz"[int(d)] for d in f"{i:04d}")

    for n in range(5):
        text = " ".join(f"{letters(n)}{letters(i)}@x.io" for i in range(600))
        redacted = await ask(text)
        assert "@" not in redacted and redacted.count("[EMAIL]") == 600, "each one redacted"
        assert stage._pii.kept.weight <= 1_500, "the memo stays within its findings"
    assert len(stage._pii.kept) <= 2
    # An everyday text is still judged once.
    calls = len(stage._pii.kept)
    assert await ask("mail bob@example.org please") == "mail [EMAIL] please"
    assert await ask("mail bob@example.org please") == "mail [EMAIL] please"
    assert len(stage._pii.kept) == calls + 1


async def test_texts_packed_with_attacks_cannot_grow_the_verdict_memo_past_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json
    from pathlib import Path

    monkeypatch.setattr(guard_in, "MEMO_SIGNALS", 100)
    stage = GuardInput(
        PolicyBook.from_json({}), InjectionDetector(), ApproximateTokenCounter(), MemoScope()
    )
    exemplars = Path(guard_in.__file__).parents[1] / "guards/data/injection_exemplars.jsonl"
    rows = [json.loads(line) for line in exemplars.read_text("utf-8").splitlines()]
    attacks = "\n".join(row["text"] for row in rows if row["label"] == "injection")[:6000]
    signals = len(stage.detector.check(attacks).signals)
    assert signals > 40, "a text that fires many rules"

    async def ask(text: str) -> str | None:
        ctx = RequestContext(
            params=ChatParams(model="m", messages=[{"role": "user", "content": text}]),
            credential=None,
            deadline=asyncio.get_running_loop().time() + 30,
            principal=Principal("acme", "alice", frozenset({"chat"}), "k"),
        )
        try:
            await stage(ctx)
        except Blocked as refused:
            return refused.code
        return None

    for n in range(6):  # distinct texts, each refused, and refused again from the memo or not
        for _ in range(2):
            code = await ask(f"note {n}:\n{attacks}")
            assert code is not None and code.startswith("injection"), code
        assert stage._judged.kept.weight <= 100, "the memo stays within its signals"
    assert await ask("What do the tides depend on?") is None
    assert len(stage._judged.kept) >= 1, "an ordinary text's verdict is still kept"
