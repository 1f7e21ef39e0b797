"""Extractive prompt compression: sentences, budget, sources, and text of any kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.answer.citations import cite
from pipeline.context import Passage
from pipeline.kept import KeptByScope
from pipeline.model.tokens import (
    _GPT2_PIECES,
    ApproximateTokenCounter,
    ModelTokenCounter,
    find_tokenizer,
    load_token_counter,
)
from pipeline.sources.compress import (
    Compressed,
    clear_passage_cache,
    compress,
    sentence_spans,
    split_sentences,
)
from tests.support.data import require_scifact
from tests.support.fuzzing import examples


@pytest.fixture(scope="module")
def counter() -> ModelTokenCounter:
    path = find_tokenizer()
    if path is None:
        pytest.fail("The SmolLM2 tokenizer is missing: `make model` builds it")
    return ModelTokenCounter.from_file(path)


def _tokens(counter: ModelTokenCounter, done: Compressed) -> int:
    """The budget's measure, recounted independently: each kept passage's text, tokenised."""
    return sum(counter.count(p.text) for p in done.passages)


ASPIRIN = Passage(
    "aspirin",
    "aspirin#0",
    "Aspirin",
    "Aspirin was first synthesised in 1897. Low-dose aspirin lowers the risk of a first heart "
    "attack. It also irritates the stomach lining in some patients. Bleeding risk rises with "
    "age, as Smith et al. reported in 2019.",
    0.9,
)
TIDES = Passage(
    "tides",
    "tides#0",
    "Tides",
    "The Moon pulls on the oceans. This pull causes the tides, about 12.4 h apart. Sailors "
    "have tracked them for centuries, e.g. in tide tables.",
    0.7,
)


def test_sentences_split_at_stops_but_not_inside_abbreviations_or_numbers() -> None:
    text = (
        "Smith et al. found a 3.5-fold rise (p < 0.05). Effects were large, e.g. in mice, "
        "i.e. in vivo. See Fig. 2 for details! Was it real? mRNA levels rose in S. cerevisiae "
        "(p. 561), as B. Demple found. Deficiency was common."
    )
    assert split_sentences(text) == [
        "Smith et al. found a 3.5-fold rise (p < 0.05).",
        "Effects were large, e.g. in mice, i.e. in vivo.",
        "See Fig. 2 for details!",
        "Was it real?",
        "mRNA levels rose in S. cerevisiae (p. 561), as B. Demple found.",
        "Deficiency was common.",
    ]
    assert split_sentences("") == [] and split_sentences("  \n ") == []
    assert split_sentences("No stop at the end") == ["No stop at the end"]
    spans = sentence_spans(text)
    assert all(text[a:b] == s for (a, b), s in zip(spans, split_sentences(text), strict=True))


def test_sentences_in_other_scripts_split_at_their_own_stops() -> None:
    assert split_sentences("人工智能是什么？它很有用。这是第三句。") == [
        "人工智能是什么？",
        "它很有用。",
        "这是第三句。",
    ]
    assert split_sentences("Привет. Как дела? Хорошо!") == ["Привет.", "Как дела?", "Хорошо!"]
    assert split_sentences("यह पहला वाक्य है। यह दूसरा है।") == ["यह पहला वाक्य है।", "यह दूसरा है।"]


def test_kept_sentences_come_out_in_their_original_order(counter: ModelTokenCounter) -> None:
    # The query matches the last sentence best and the second next: they still come out 2, 4.
    done = compress("bleeding risk with age and heart attack", [ASPIRIN], budget_tokens=45,
                    counter=counter, scope="t")  # fmt: skip
    positions = [s.position for s in done.sentences]
    assert positions == sorted(positions) and len(positions) >= 2
    assert done.passages[0].text == " ".join(s.text for s in done.sentences)
    assert done.passages[0].text.startswith("Low-dose aspirin")
    assert done.passages[0].text.endswith("reported in 2019.")


@pytest.mark.parametrize("budget", [0, 5, 12, 20, 40, 80, 1000])
def test_the_budget_holds_counted_with_the_real_tokenizer(
    counter: ModelTokenCounter, budget: int
) -> None:
    done = compress("heart attack risk and ocean tides", [ASPIRIN, TIDES], budget_tokens=budget,
                    counter=counter, scope="t")  # fmt: skip
    assert done.tokens_after == _tokens(counter, done) <= budget
    assert done.tokens_before == counter.count(ASPIRIN.text) + counter.count(TIDES.text)
    if budget >= 1000:  # every sentence holding a query term fits; the others are left out
        assert [(s.document_id, s.position) for s in done.sentences] == [
            ("aspirin", 1),  # heart attack, risk
            ("aspirin", 3),  # risk
            ("tides", 0),  # oceans
            ("tides", 1),  # tides
            ("tides", 2),  # tide (same stem)
        ]


def test_every_kept_sentence_keeps_its_source_ids(counter: ModelTokenCounter) -> None:
    done = compress(
        "aspirin heart tides moon", [ASPIRIN, TIDES], budget_tokens=60, counter=counter, scope="t"
    )
    sources = {(s.document_id, s.chunk_id) for s in done.sentences}
    assert sources == {("aspirin", "aspirin#0"), ("tides", "tides#0")}
    for s in done.sentences:
        source = ASPIRIN if s.document_id == "aspirin" else TIDES
        assert s.text in source.text
    assert [(p.document_id, p.chunk_id, p.title, p.score) for p in done.passages] == [
        ("aspirin", "aspirin#0", "Aspirin", 0.9),
        ("tides", "tides#0", "Tides", 0.7),
    ]


def test_each_passage_keeps_its_best_sentence_before_any_gets_a_second(
    counter: ModelTokenCounter,
) -> None:
    # The first passage's sentences share four query words, the second's one ("moon"): without
    # the rule the 35 tokens go to two sentences of the first passage.
    query = "aspirin heart attack risk bleeding moon"
    tight = 35
    done = compress(query, [ASPIRIN, TIDES], budget_tokens=tight, counter=counter, scope="t")
    assert {p.document_id for p in done.passages} == {"aspirin", "tides"}
    greedy = compress(query, [ASPIRIN, TIDES], budget_tokens=tight, counter=counter,
                      represent_all=False, scope="t")  # fmt: skip
    assert {p.document_id for p in greedy.passages} == {"aspirin"}


def test_no_passages_and_empty_passages(counter: ModelTokenCounter) -> None:
    done = compress("anything", [], budget_tokens=100, counter=counter, scope="t")
    assert done.passages == [] and done.tokens_before == done.tokens_after == 0
    empty = Passage("empty", "empty#0", "", "   ", 0.1)
    done = compress("aspirin", [empty, ASPIRIN], budget_tokens=100, counter=counter, scope="t")
    assert [p.document_id for p in done.passages] == ["aspirin"]
    assert done.dropped == [empty]


def test_a_sentence_longer_than_the_budget_is_cut_into_pieces(counter: ModelTokenCounter) -> None:
    # One 3,000-character "sentence" (a table without stops) against a 120-token budget: it is
    # cut at whitespace into pieces; those with the query's words that fit are kept.
    words = [f"cell{i}" if i % 50 else "aspirin" for i in range(500)]
    huge = Passage("table", "table#0", "", " ".join(words), 0.5)
    done = compress("aspirin", [huge], budget_tokens=120, counter=counter, scope="t")
    assert 0 < done.tokens_after <= 120
    assert all("aspirin" in s.text for s in done.sentences)
    # A piece alone bigger than the budget is skipped, never cut mid-piece.
    assert compress("aspirin", [huge], budget_tokens=3, counter=counter, scope="t").passages == []


def test_text_in_other_scripts_is_budgeted_exactly(counter: ModelTokenCounter) -> None:
    cjk = Passage("zh", "zh#0", "", "人工智能是什么？它很有用。阿司匹林降低心脏病风险。", 1.0)
    ru = Passage("ru", "ru#0", "", "Аспирин снижает риск. Луна вызывает приливы.", 1.0)
    done = compress("аспирин 阿司匹林", [cjk, ru], budget_tokens=30, counter=counter, scope="t")
    assert done.tokens_after == _tokens(counter, done) <= 30
    assert {p.document_id for p in done.passages} == {"zh", "ru"}


def test_the_approximate_counter_over_counts_and_is_used_without_a_tokenizer(
    counter: ModelTokenCounter, tmp_path: pytest.TempPathFactory
) -> None:
    approximate = ApproximateTokenCounter()
    for text in (ASPIRIN.text, TIDES.text, "人工智能是什么？它很有用。", "Привет, как дела?"):
        assert approximate.count(text) >= counter.count(text)
    fallback = load_token_counter(models_dir=tmp_path)  # type: ignore[arg-type]
    assert isinstance(fallback, ApproximateTokenCounter) and not fallback.exact
    with pytest.raises(FileNotFoundError):
        load_token_counter(tmp_path)  # type: ignore[arg-type]


# Any code point, lone surrogates included (a JSON body can carry "\ud800").
ANY_TEXT = st.text(
    st.one_of(st.characters(), st.characters(categories=["Cs"]), st.sampled_from(" .?!。\n")),
    max_size=400,
)


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    query=ANY_TEXT,
    texts=st.lists(ANY_TEXT, max_size=4),
    budget=st.integers(min_value=0, max_value=200),
)
def test_arbitrary_text_never_raises_nor_exceeds_the_budget(
    counter: ModelTokenCounter, query: str, texts: list[str], budget: int
) -> None:
    passages = [Passage(f"d{i}", f"d{i}#0", "", t, 1.0) for i, t in enumerate(texts)]
    done = compress(query, passages, budget_tokens=budget, counter=counter, scope="t")
    assert done.tokens_after <= budget
    assert done.tokens_after == sum(counter.count(p.text) for p in done.passages)
    for s in done.sentences:
        assert s.text in texts[int(s.document_id[1:])]


def test_piece_counts_equal_the_tokenizer_on_scifact_abstracts(counter: ModelTokenCounter) -> None:
    import json

    with (require_scifact() / "corpus.jsonl").open() as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(1500), strict=False)]
    assert counter.count_many(texts) == counter.count_with_tokenizer(texts)


@settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=ANY_TEXT, special=st.sampled_from(["", "<|im_start|>", "<|endoftext|>", "<file_sep>"]))
def test_piece_counts_equal_the_tokenizer_on_any_text(
    counter: ModelTokenCounter, text: str, special: str
) -> None:
    mixed = text[: len(text) // 2] + special + text[len(text) // 2 :]
    assert counter.count(mixed) == counter.count_with_tokenizer([mixed])[0]


def test_a_cached_passage_gives_the_same_result(counter: ModelTokenCounter) -> None:
    clear_passage_cache()
    first = compress(
        "aspirin heart risk", [ASPIRIN, TIDES], budget_tokens=40, counter=counter, scope="t"
    )
    again = compress(
        "aspirin heart risk", [ASPIRIN, TIDES], budget_tokens=40, counter=counter, scope="t"
    )
    assert first == again


def test_a_tenant_never_finds_a_passage_analysis_another_tenant_left(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A memo shared by tenants would answer the second tenant's request faster for a passage
    # the first one holds: how long compression takes would say what another tenant has.
    from pipeline.answer import citations
    from pipeline.sources import compress as compress_module

    clear_passage_cache()
    citations._analyse.cache_clear()
    analysed: list[str] = []  # each analysis of the passage: compression's and citations'
    spans, segments = compress_module.sentence_spans, citations.segments

    def counted_spans(text: str) -> Any:
        analysed.extend(["compress"] if text == TIDES.text else [])
        return spans(text)

    def counted_segments(text: str, start: int = 0) -> Any:
        analysed.extend(["cite"] if text == TIDES.text else [])
        return segments(text, start)

    monkeypatch.setattr(compress_module, "sentence_spans", counted_spans)
    monkeypatch.setattr(citations, "segments", counted_segments)
    answer = "The Moon pulls the tides."
    results = []
    for tenant in ("acme", "acme", "globex", "acme", "globex"):
        done = compress("what pulls the tides", [TIDES], budget_tokens=60, counter=counter,
                        scope=tenant)  # fmt: skip
        results.append((done, cite(answer, done.passages, scope=tenant)))
    assert analysed == ["compress", "cite"] * 2, (
        "each tenant's first request analyses the passage; its later ones find their own"
    )
    assert all(result == results[0] for result in results), "the same result for each tenant"


class CountedTokenizer:
    """The real tokenizer, the pieces it is asked to encode recorded in ``encoded``."""

    def __init__(self, real: Any, encoded: list[str]) -> None:
        self.real = real
        self.encoded = encoded

    def encode_batch_fast(self, pieces: list[str], **options: Any) -> Any:
        self.encoded.extend(pieces)
        return self.real.encode_batch_fast(pieces, **options)


def test_a_tenant_never_finds_a_word_another_tenant_stemmed_or_counted(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stems and the token pieces are kept to count and stem faster; kept for all tenants,
    # a word counted sooner would say that another tenant's text held it (a review's find:
    # about 12 µs a word, timed to the microsecond in `rag.explain`'s stage durations).
    from pipeline.sources import compress as compress_module

    stemmed: list[str] = []
    encoded: list[str] = []
    stem_one = compress_module.tokenize

    def counted_stem(word: str) -> list[str]:
        stemmed.append(word)
        return stem_one(word)

    text = "Zorblaxian quintessences perambulate"  # words no other test holds
    tokens = counter.count_with_tokenizer([text])[0]
    monkeypatch.setattr(compress_module, "tokenize", counted_stem)
    monkeypatch.setattr(counter, "tokenizer", CountedTokenizer(counter.tokenizer, encoded))
    for tenant in ("acme", "acme", "globex"):
        before = len(stemmed), len(encoded)
        assert compress_module.word_stems(tenant, text) == frozenset(stem_one(text))
        assert counter.for_scope(tenant).count(text) == tokens
        stemmed_now, encoded_now = stemmed[before[0] :], encoded[before[1] :]
        if tenant == "acme" and before == (0, 0):
            assert len(stemmed_now) == 3 and len(encoded_now) == 3, "the first sees each word"
        elif tenant == "acme":
            assert stemmed_now == encoded_now == [], "the tenant's own words are kept"
        else:
            assert sorted(stemmed_now) == sorted(stemmed[:3]), "another tenant's are not"
            assert sorted(encoded_now) == sorted(encoded[:3])
    assert counter.kept_pieces("globex").keys() == counter.kept_pieces("acme").keys()
    assert counter.for_scope("acme") == counter.for_scope("acme"), "one key for the memos"
    assert counter.for_scope("acme") != counter.for_scope("globex")


def test_the_vocabularys_pieces_are_counted_without_the_tokenizer_for_every_scope(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pieces that are a token of the model's vocabulary hold nothing of any caller: a
    # scope's first request looks them up there and runs the tokenizer only for the rest, so
    # a scope whose words were let go (many busy scopes) finds most of them again cheaply.
    vocabulary = dict(counter.vocabulary)
    assert len(vocabulary) > 40_000, "the model's vocabulary, whole"
    sample = sorted(vocabulary)[::25]
    assert [vocabulary[p] for p in sample] == counter.count_with_tokenizer(sample)
    assert ModelTokenCounter.from_file(Path(counter.source)).vocabulary is counter.vocabulary, (
        "worked out once a process"
    )
    encoded: list[str] = []

    text = "The kiwi is a flightless bird; zorblaxian quintessences perambulate."
    pieces = set(_GPT2_PIECES.findall(text))
    tokens = counter.count_with_tokenizer([text])[0]
    monkeypatch.setattr(counter, "tokenizer", CountedTokenizer(counter.tokenizer, encoded))
    for scope in ("vocab-acme", "vocab-globex"):
        assert counter.for_scope(scope).count(text) == tokens
        assert counter.kept_pieces(scope).keys() == pieces, "all kept: the next, one lookup"
    unknown = sorted(p for p in pieces if p not in vocabulary)
    assert " bird" in vocabulary and unknown, "the text holds pieces of both kinds"
    assert sorted(encoded) == sorted(unknown * 2), "the tokenizer ran for the others alone"
    assert dict(counter.vocabulary) == vocabulary, "no caller's piece is added to it"
    with pytest.raises(TypeError):
        counter.vocabulary[" zorblaxian"] = 3  # type: ignore[index]


def test_a_tokenizer_file_replaced_in_place_gets_a_vocabulary_of_its_own(
    counter: ModelTokenCounter, tmp_path: Path
) -> None:
    # The vocabulary is worked out once for each content of the file, not each path: a file
    # replaced in place, with its size and time kept (`cp -p`, `rsync -t`), was given the
    # vocabulary of the one before it (a review's find, with a tokenizer whose counts differ).
    import os
    import shutil

    copy = tmp_path / "tokenizer.json"
    shutil.copy2(counter.source, copy)
    first = ModelTokenCounter.from_file(copy)
    assert first.vocabulary is counter.vocabulary, "the same content: the same vocabulary"
    was = copy.stat()
    text = copy.read_text("utf-8")
    changed = text.replace('"truncation": null,', '"truncation":null ,', 1)
    assert changed != text and len(changed) == len(text)
    copy.write_text(changed, "utf-8")
    os.utime(copy, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert (copy.stat().st_size, copy.stat().st_mtime_ns) == (was.st_size, was.st_mtime_ns)
    again = ModelTokenCounter.from_file(copy)
    assert again.vocabulary is not first.vocabulary, "another content: worked out anew"
    assert dict(again.vocabulary) == dict(first.vocabulary)  # (the same tokens, here)


# Found by a review of what a replica keeps (2026-12-06, sixth session): caches bounded by their
# entries, not their size, keyed by text whose length a caller chooses.


def test_a_long_piece_is_counted_exactly_and_not_kept(counter: ModelTokenCounter) -> None:
    # A run of letters is one piece of any length: a caller's 60,000-letter "word" was kept
    # whole, 59 KiB a request (refused ones too: inputs are counted before the limit).
    word = "x" * 60_000 + "yz" * 20_000
    text = f"A question about {word} and the tides."
    assert counter.count(text) == counter.count_with_tokenizer([text])[0]
    kept = counter.kept_pieces(None)
    assert kept, "short pieces are kept"
    assert max(map(len, kept)) <= 64
    assert counter.count(text) == counter.count_with_tokenizer([text])[0], "counted again"


def test_a_long_passage_and_its_long_words_are_analysed_and_not_kept(
    counter: ModelTokenCounter,
) -> None:
    from pipeline.answer import citations
    from pipeline.sources import compress as compress_module

    clear_passage_cache()
    citations._analyse.cache_clear()
    junk = "q" * 200_000  # one chunk of one "word": chunking cuts by words
    passages = [Passage("d0", "d0#0", "", f"Tides rise. {junk}. The Moon pulls.", 1.0), TIDES]
    done = compress("what pulls the tides", passages, budget_tokens=60, counter=counter, scope="t")
    assert done.tokens_after <= 60
    assert len(compress_module._analyse.kept) == 1, "only the ordinary passage"
    assert max(map(len, compress_module.STEMS.kept("t"))) <= 64
    source = citations._analyse("t", passages[0].text)
    assert source.spans and len(citations._analyse.kept) == 0


def test_the_passage_analyses_kept_stay_within_their_items(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.answer import citations
    from pipeline.sources import compress as compress_module

    # Six dense passages (64 sentences each), all of one weight in each cache.
    passages = [
        Passage(f"d{i}", f"d{i}#0", "", f"The Moon pulls tide {i} higher. " * 64, 1.0)
        for i in range(6)
    ]
    caches = (compress_module._analyse, citations._analyse)
    for kept in caches:
        kept.cache_clear()
    compress_module._analyse("t", counter, passages[0].text)
    citations._analyse("t", passages[0].text)
    for kept in caches:
        one = kept.kept.weight
        assert one > 64, "a sentence and its stems are items"
        kept.cache_clear()
        monkeypatch.setattr(kept.kept, "budget", one * 5 // 2)
    first = compress(
        "what pulls the tides", passages, budget_tokens=120, counter=counter, scope="t"
    )
    for passage in passages:
        citations._analyse("t", passage.text)
    for kept in caches:
        assert 0 < kept.kept.weight <= kept.kept.budget, "what is kept stays within its items"
        assert len(kept.kept) == 2, "the two most recent"
    again = compress(
        "what pulls the tides", passages, budget_tokens=120, counter=counter, scope="t"
    )
    assert again == first, "an analysis let go is worked out again, to the same result"


def test_counts_stay_exact_when_the_piece_cache_starts_anew(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # When the cache was full, a new empty one was started: pieces the call had found in the
    # old one were gone, and the call failed with a KeyError (a review's find, older than the
    # size bound; at 200,000 pieces the request that filled it failed).
    monkeypatch.setattr(counter.pieces, "size", 12)
    texts = [
        "the tides rise with the moon",
        "the moon pulls the oceans and the tides",
        "aspirin lowers the risk of a first heart attack",
        "the oceans and the moon and the heart and the risk",
    ]
    for text in texts * 2:
        assert counter.count(text) == counter.count_with_tokenizer([text])[0]
    assert counter.count_many(texts) == counter.count_with_tokenizer(texts)


def test_the_piece_and_stem_caches_keep_few_characters_of_long_astral_words(
    counter: ModelTokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Words of 60 letters from beyond the Basic Multilingual Plane (4 bytes each in a Python
    # string, and a UTF-8 copy beside it): within the 64 characters a cache keeps, 200,000 of
    # them held 125 MB in the piece cache and 135 MB in the stem cache.
    from pipeline.sources import compress as compress_module

    monkeypatch.setattr(counter.pieces, "chars", 2_000)
    stems = KeptByScope(200_000, 2_000, weight=lambda word, stem: len(word) + len(stem))
    monkeypatch.setattr(compress_module, "STEMS", stems)

    def word(n: int) -> str:
        return "".join(chr(0x20000 + (n * 60 + i) % 40_000) for i in range(60))

    for start in range(0, 200, 20):
        text = " ".join(word(n) for n in range(start, start + 20))
        assert counter.count(text) == counter.count_with_tokenizer([text])[0], "still exact"
        assert sum(map(len, counter.kept_pieces(None))) <= 2_000
        compress_module.word_stems("t", text)
        kept = compress_module.STEMS.kept("t")
        assert sum(len(w) + len(s) for w, s in kept.items()) <= 2_000
    assert counter.kept_pieces(None) and compress_module.STEMS.kept("t"), "some are still kept"


def test_a_word_another_thread_stems_meanwhile_keeps_its_stem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stem cache is shared by the threads that compress: a word this call did not find may
    # be added by another before this call stems it. It was then skipped, and its stem lost
    # (a review's find: 7 wrong stem sets in 2,000 SciFact texts on two threads).
    from pipeline.sources import compress as compress_module
    from retrieval.tokenize import tokenize

    class Racing(dict[str, str]):
        def get(self, key: str, default: Any = None) -> Any:
            found = super().get(key, default)
            if found is None:  # another thread stems it just after this read
                stemmed = tokenize(key)
                self[key] = stemmed[0] if stemmed else ""
            return found

    monkeypatch.setattr(compress_module.STEMS, "words", lambda scope: Racing())
    text = "The tides rise and fall with the Moon"
    assert compress_module.word_stems("t", text) == frozenset(tokenize(text))
