"""The prompt layout: fixed instructions, then the sources tagged by document id in canonical
order, then the personal line and tool results, then the caller's messages."""

from __future__ import annotations

from pipeline.context import Passage
from pipeline.model.prompt import INSTRUCTIONS, build_messages

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def passage(doc: str, text: str) -> Passage:
    return Passage(document_id=doc, chunk_id=f"{doc}#0", title=doc.title(), text=text, score=1.0)


def test_without_passages_the_messages_go_through_untouched() -> None:
    assert build_messages(MESSAGES, []) is MESSAGES


def test_sources_come_first_each_tagged_with_its_document_id() -> None:
    built = build_messages(
        MESSAGES, [passage("rayleigh", "Short wavelengths scatter more."), passage("sun", "Hot.")]
    )
    assert built[1:] == MESSAGES
    system = built[0]
    assert system["role"] == "system"
    assert system["content"].startswith(INSTRUCTIONS)
    assert "[rayleigh] Rayleigh: Short wavelengths scatter more." in system["content"]
    assert system["content"].index("[rayleigh]") < system["content"].index("[sun]")


def test_the_prefix_is_byte_stable_across_questions() -> None:
    sources = [passage("a", "alpha")]
    one = build_messages([{"role": "user", "content": "q1"}], sources)
    two = build_messages([{"role": "user", "content": "q2"}], sources)
    assert one[0] == two[0]


def test_the_rendered_prefix_is_identical_across_users_and_requests() -> None:
    """What vLLM's prefix cache sees: the model's own chat template, tokenised. Every prompt
    that carries our system message starts with the same tokens, through the instructions,
    whoever asks and whatever the sources, the personal line and the question."""
    from transformers import AutoTokenizer

    from pipeline.context import Features, ToolRun
    from pipeline.model.prompt import personalisation
    from pipeline.model.tokens import find_tokenizer

    found = find_tokenizer(None)
    assert found is not None, "the SmolLM2 model directory is missing: `make model` builds it"
    tokenizer = AutoTokenizer.from_pretrained(str(found.parent))
    pro = Features({"language": "pt", "tier": "pro"})
    prompts = [
        build_messages([{"role": "user", "content": "q1"}], [passage("a", "alpha")]),
        build_messages(
            [{"role": "user", "content": "another question entirely"}],
            [passage("b", "beta"), passage("c", "gamma")],
            personal=personalisation(pro),
        ),
        build_messages(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q3"}],
            [],
            tool_runs=[ToolRun("calculator", "c1", "ok", "2 + 2 = 4")],
        ),
    ]
    rendered = [
        tokenizer(tokenizer.apply_chat_template(p, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        for p in prompts
    ]
    instructions = len(tokenizer(INSTRUCTIONS, add_special_tokens=False)["input_ids"])
    shared = min(
        next((i for i, (x, y) in enumerate(zip(rendered[0], r, strict=False)) if x != y), len(r))
        for r in rendered[1:]
    )
    assert shared >= instructions, (shared, instructions)
    texts = [p[0]["content"] for p in prompts]
    assert all(t.startswith(INSTRUCTIONS + "\n\n") for t in texts)
    # The user's line comes after the sources: users who retrieve the same share them.
    assert texts[1].index("Sources:") < texts[1].index("About the user:")


def test_sources_are_laid_out_by_document_and_chunk_whatever_their_rank() -> None:
    ranked = [
        Passage("b", "b#1", "", "two", score=0.9),
        Passage("a", "a#0", "", "one", score=0.1),
        Passage("b", "b#0", "", "three", score=0.5),
    ]
    content = build_messages(MESSAGES, ranked)[0]["content"]
    assert content.index("[a] one") < content.index("[b] three") < content.index("[b] two")
    assert build_messages(MESSAGES, list(reversed(ranked))) == build_messages(MESSAGES, ranked)


def test_a_second_question_over_the_same_sources_shares_everything_before_the_question() -> None:
    """Tokens as vLLM's prefix cache sees them: the chat template applied. Two users (one
    with a personal line) asking different questions that retrieved the same passages, in a
    different rank order, share the prompt through the last source."""
    from transformers import AutoTokenizer

    from pipeline.context import Features
    from pipeline.model.prompt import personalisation, render_sources
    from pipeline.model.tokens import find_tokenizer

    found = find_tokenizer(None)
    assert found is not None, "the SmolLM2 model directory is missing: `make model` builds it"
    tokenizer = AutoTokenizer.from_pretrained(str(found.parent))
    sources = [passage("rayleigh", "Short wavelengths scatter more."), passage("sun", "Hot.")]
    one = build_messages([{"role": "user", "content": "Why is the sky blue?"}], sources)
    two = build_messages(
        [{"role": "user", "content": "How hot is the sun?"}],
        list(reversed(sources)),
        personal=personalisation(Features({"language": "pt"})),
    )
    ids = [
        tokenizer(tokenizer.apply_chat_template(p, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        for p in (one, two)
    ]
    shared = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    through_sources = INSTRUCTIONS + "\n\nSources:\n\n" + render_sources(sources)
    assert shared >= len(tokenizer(through_sources, add_special_tokens=False)["input_ids"])
