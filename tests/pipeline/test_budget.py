"""The sources cut to the context window: weakest dropped first, the last kept one cut at a
sentence end, nothing changed when everything fits, and citations only of what was shown."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.answer.citations import cite
from pipeline.context import Passage, ToolRun
from pipeline.model.budget import (
    ELLIPSIS,
    MIN_CUT_TOKENS,
    answer_room,
    fit_sources,
)
from pipeline.model.prompt import build_messages, render_source
from pipeline.model.tokens import ApproximateTokenCounter, TokenCounter, load_token_counter

QUESTION = [{"role": "user", "content": "What does vitamin D do for bones?"}]
SENTENCES = (
    "Vitamin D is made in the skin under sunlight. It helps the gut absorb calcium. "
    "Low levels in children cause rickets, a softening of the bones. "
    "Adults with too little of it lose bone mass faster. "
)


@pytest.fixture(scope="module", params=["model", "approximate"])
def counter(request: pytest.FixtureRequest) -> TokenCounter:
    if request.param == "approximate":
        return ApproximateTokenCounter()
    found = load_token_counter()
    assert found.exact, "the SmolLM2 tokenizer is missing: `make model` builds it"
    return found


def passage(n: int, score: float, text: str = SENTENCES * 4) -> Passage:
    return Passage(f"doc-{n}", f"doc-{n}#0", f"Title {n}", text, score=score)


def prompt_tokens(counter: TokenCounter, messages: list[dict[str, Any]]) -> int:
    return sum(counter.count(m["content"]) + 5 for m in messages) + 3


def test_everything_that_fits_goes_through_unchanged(counter: TokenCounter) -> None:
    sources = [passage(1, 0.9), passage(2, 0.5)]
    fit = fit_sources(QUESTION, sources, counter=counter, context_length=4096, max_tokens=64)
    assert not fit.changed and fit.passages == sources
    assert 0 < fit.source_tokens <= fit.budget_tokens


def test_the_weakest_passages_are_dropped_first_and_the_last_kept_is_cut(
    counter: TokenCounter,
) -> None:
    # Ranked order is not score order here: the budget goes by score.
    sources = [passage(n, score) for n, score in enumerate([0.2, 0.9, 0.5, 0.1, 0.7, 0.3])]
    fit = fit_sources(QUESTION, sources, counter=counter, context_length=1024, max_tokens=256)
    assert fit.changed
    kept_ids = [p.document_id for p in fit.passages]
    # The kept ones are the strongest, in their original (ranked) order.
    assert kept_ids == [p.document_id for p in sources if p.chunk_id not in fit.dropped]
    scores = {p.chunk_id: p.score for p in sources}
    assert min(p.score for p in fit.passages) > max(scores[c] for c in fit.dropped)
    # Dropped weakest first.
    assert [scores[c] for c in fit.dropped] == sorted(scores[c] for c in fit.dropped)
    if fit.cut is not None:
        cut = next(p for p in fit.passages if p.chunk_id == fit.cut)
        assert cut.score == min(p.score for p in fit.passages)
        assert cut.text.endswith(ELLIPSIS) and cut.source_text == SENTENCES * 4
        assert cut.text.removesuffix(ELLIPSIS).endswith(".")  # at a sentence end
    assert fit.source_tokens <= fit.budget_tokens


def test_the_whole_prompt_and_the_answer_fit_the_window(counter: TokenCounter) -> None:
    sources = [passage(n, 1.0 - n / 10) for n in range(8)]
    personal = "Answer in Portuguese. The user is on the pro plan."
    runs = [ToolRun("calculator", "c1", "ok", "2 + 2 = 4")]
    for window, max_tokens in ((2048, 512), (2048, 1500), (1024, None), (4096, 8)):
        fit = fit_sources(
            QUESTION,
            sources,
            counter=counter,
            context_length=window,
            max_tokens=max_tokens,
            personal=personal,
            tool_runs=runs,
        )
        built = build_messages(QUESTION, fit.passages, personal=personal, tool_runs=runs)
        answer = answer_room(max_tokens, window)
        assert prompt_tokens(counter, built) + answer <= window, (window, max_tokens)


def test_the_rendered_prompt_fits_by_the_models_own_chat_template() -> None:
    """vLLM's count: the chat template applied, tokenised with the model's tokenizer."""
    from transformers import AutoTokenizer

    from pipeline.model.tokens import find_tokenizer

    found = find_tokenizer(None)
    assert found is not None, "the SmolLM2 model directory is missing: `make model` builds it"
    tokenizer = AutoTokenizer.from_pretrained(str(found.parent))
    counter = load_token_counter()
    sources = [passage(n, 1.0 - n / 10) for n in range(8)]
    for max_tokens in (16, 512, 1200):
        fit = fit_sources(
            QUESTION, sources, counter=counter, context_length=2048, max_tokens=max_tokens
        )
        built = build_messages(QUESTION, fit.passages)
        rendered = tokenizer.apply_chat_template(built, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert len(ids) + max_tokens <= 2048
        # And not wastefully: the sources were given most of the room there was.
        if fit.changed:
            assert len(ids) + max_tokens >= 2048 - 120, (len(ids), max_tokens)


def test_no_room_at_all_leaves_the_request_without_sources(counter: TokenCounter) -> None:
    long_question = [{"role": "user", "content": "why " * 3000}]
    fit = fit_sources(
        long_question, [passage(1, 0.9)], counter=counter, context_length=2048, max_tokens=64
    )
    assert fit.passages == [] and fit.dropped == ("doc-1#0",) and fit.budget_tokens == 0


def test_a_room_too_small_to_say_anything_drops_rather_than_cuts(
    counter: TokenCounter,
) -> None:
    one = passage(1, 0.9)
    needed = fit_sources(QUESTION, [one], counter=counter, context_length=100_000, max_tokens=8)
    # A window that leaves the source fewer than MIN_CUT_TOKENS.
    window = needed.rest_tokens + 8 + MIN_CUT_TOKENS // 2
    fit = fit_sources(QUESTION, [one], counter=counter, context_length=window, max_tokens=8)
    assert fit.passages == [] and fit.cut is None


def test_offered_tools_and_earlier_turns_take_room_from_the_sources(
    counter: TokenCounter,
) -> None:
    sources = [passage(n, 1.0 - n / 10) for n in range(8)]
    plain = fit_sources(QUESTION, sources, counter=counter, context_length=2048, max_tokens=256)
    tools = [{"type": "function", "function": {"name": "f", "description": "x " * 200}}]
    turns = [
        {"role": "user", "content": "Tell me about bones. " * 20},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "arguments": "{}"}]},
        *QUESTION,
    ]
    crowded = fit_sources(
        turns, sources, counter=counter, context_length=2048, max_tokens=256, tools=tools
    )
    assert crowded.budget_tokens < plain.budget_tokens - 200


def test_a_cut_source_is_cited_only_for_what_the_prompt_showed(counter: TokenCounter) -> None:
    tail = "Magnesium deficiency also weakens the enamel of teeth in older horses."
    text = SENTENCES * 3 + tail + " " + SENTENCES  # the tail within the characters shown
    fit = fit_sources(
        QUESTION, [passage(1, 0.9, text)], counter=counter, context_length=500, max_tokens=256
    )
    assert fit.cut == "doc-1#0"
    (shown,) = fit.passages
    assert tail not in shown.text and tail not in render_source(shown)
    citations = cite(f"{SENTENCES.split('. ')[0]}. {tail}", fit.passages, scope="t")
    assert citations[0].supported and not citations[1].supported
