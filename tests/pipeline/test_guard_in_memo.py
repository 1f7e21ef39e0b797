"""guard_in's memo of verdicts: a text seen again is judged once, and the memo stays small."""

from __future__ import annotations

from pipeline.stages.guard_in import MEMO_CHARS, TextMemo


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
