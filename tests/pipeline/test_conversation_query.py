"""The query a follow-up stands for: which earlier turns it takes, at what weight, and never an
error or unbounded work, whatever the message list holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.sources.conversation import (
    MAX_TURN_CHARS,
    SCAN_MESSAGES,
    ConversationQuery,
    FollowUpWeights,
    build_query,
    dependence,
)
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore
from tests.support.fuzzing import examples
from tests.support.strategies import json_values

WEIGHTS = FollowUpWeights(terms=0.4, vector=0.5, decay=0.5, turns=2)


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


VITAMIN_D = [
    user("What environmental factors influence how much vitamin D the skin makes?"),
    assistant("Sunlight (UVB), latitude, skin pigmentation and age all matter [1]."),
]


def test_a_pronoun_follow_up_takes_the_earlier_user_turn_at_a_lower_weight() -> None:
    query = build_query([*VITAMIN_D, user("And how does the season change it?")], WEIGHTS)
    assert query.mode == "conversation"
    assert query.text == "And how does the season change it?"
    assert query.earlier == (VITAMIN_D[0]["content"],)
    assert query.term_weights == (0.4,) and query.vector_weights == (0.5,)
    assert query.context_terms == [(VITAMIN_D[0]["content"], 0.4)]


@pytest.mark.parametrize(
    ("follow_up", "reason"),
    [
        ("Is it true that it increases the risk of fractures?", "pronoun"),
        ("Do studies show that they lower blood pressure in older adults?", "pronoun"),
        ("Are these effects seen in children as well?", "pronoun"),
        ("How strong is the clinical evidence for that?", "pronoun"),
        ("What about in people with darker skin?", "opener"),
        ("How about sunscreen use?", "opener"),
        ("And in winter?", "opener"),
        ("Also, increases calcium absorption in the gut?", "opener"),
        ("Why?", "short"),
        ("Dosage?", "short"),
    ],
)
def test_each_kind_of_follow_up_reads_as_depending_on_earlier_turns(
    follow_up: str, reason: str
) -> None:
    assert dependence(follow_up) == reason
    query = build_query([*VITAMIN_D, user(follow_up)], WEIGHTS)
    assert query.reason == reason and query.earlier == (VITAMIN_D[0]["content"],)


@pytest.mark.parametrize(
    ("question", "reason"),
    [
        ("Is it true that statins increase blood cholesterol in adults?", "standalone"),
        (
            "I read that aspirin lowers the risk of a first heart attack. Is that right?",
            "standalone",
        ),
        ("Do cytokines that inhibit IL-6 reduce inflammation in arthritis?", "standalone"),
        ("Different question: do statins increase blood cholesterol?", "topic_shift"),
        ("Switching topics. Does it rain more in Norway than in Spain?", "topic_shift"),
    ],
)
def test_a_complete_question_or_a_declared_topic_shift_is_searched_alone(
    question: str, reason: str
) -> None:
    query = build_query([*VITAMIN_D, user(question)], WEIGHTS)
    assert query.reason == reason
    assert query.mode == "last_message" and query.earlier == () and query.context_terms == []


def test_a_short_fragment_without_a_cue_takes_a_share_of_the_weight() -> None:
    weights = FollowUpWeights(terms=0.4, vector=0.5, fragment=0.5, fragment_words=5)
    query = build_query([*VITAMIN_D, user("Is lower at high latitudes?")], weights)
    assert query.reason == "fragment"
    assert query.term_weights == pytest.approx((0.2,))
    assert query.vector_weights == pytest.approx((0.25,))
    longer = "Is lower at high latitudes in elderly people living indoors?"
    assert build_query([*VITAMIN_D, user(longer)], weights).reason == "standalone"
    off = FollowUpWeights(fragment=0.0)
    assert build_query([*VITAMIN_D, user("Is lower at high latitudes?")], off).earlier == ()


def test_the_first_question_of_a_conversation_is_searched_alone() -> None:
    query = build_query([{"role": "system", "content": "Be brief."}, user("Why is it so?")])
    assert (query.reason, query.earlier) == ("first_turn", ())


def test_only_user_turns_count_and_older_ones_weigh_less() -> None:
    messages = [
        user("Tell me about statins."),
        assistant("Statins lower LDL cholesterol."),
        user("What do they do to the liver?"),
        {"role": "tool", "content": "tool output that must not be searched", "tool_call_id": "x"},
        assistant("They can raise liver enzymes."),
        user("And is that dangerous?"),
    ]
    query = build_query(messages, WEIGHTS)
    assert query.earlier == ("What do they do to the liver?", "Tell me about statins.")
    assert query.term_weights == pytest.approx((0.4, 0.2))
    assert query.vector_weights == pytest.approx((0.5, 0.25))
    one_turn = build_query(messages, FollowUpWeights(turns=1))
    assert one_turn.earlier == ("What do they do to the liver?",)


def test_content_parts_are_read_as_the_request_schema_reads_them() -> None:
    parts = [{"type": "text", "text": "Tell me about"}, {"type": "input_text", "text": "statins."}]
    query = build_query([user(parts), user([{"type": "text", "text": "Are they safe?"}])])
    assert query.text == "Are they safe?"
    assert query.earlier == ("Tell me about\nstatins.",)


def test_the_blend_is_a_unit_vector_between_the_follow_up_and_the_earlier_turn() -> None:
    own = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    before = np.array([0.0, 1.0, 0.0], dtype=np.float32)
    query = ConversationQuery("it?", "pronoun", ("topic",), (0.4,), (0.5,))
    mixed = query.blend(own, [before])
    assert float(np.linalg.norm(mixed)) == pytest.approx(1.0)
    assert mixed[0] > mixed[1] > 0
    alone = ConversationQuery("a whole question", "standalone")
    assert alone.blend(own, []) is own
    with pytest.raises(ValueError):
        query.blend(own, [])


def test_earlier_words_find_the_topic_and_the_follow_up_still_ranks_it(
    tmp_path: Path, shared_embedder: Embedder
) -> None:
    store = IndexStore(tmp_path, shared_embedder)
    store.upsert(
        "t",
        [
            Document(
                "seasons", "Vitamin D made in the skin falls in winter: the season changes UVB."
            ),
            Document("skin", "Skin synthesis of vitamin D depends on UVB, latitude and pigment."),
            Document("tides", "The season changes the tides little; the moon sets them."),
            Document("fashion", "Each season changes which clothes are in fashion."),
            Document("statins", "Statins reduce LDL cholesterol in patients at risk."),
            Document("bread", "Sourdough bread rises with wild yeast and lactic bacteria."),
        ],
    )
    messages = [*VITAMIN_D, user("And how does the season change it?")]
    query = build_query(messages)
    vectors = shared_embedder.embed([query.text, *query.earlier])
    retriever = HybridRetriever(store)
    alone = retriever.search("t", query.text, vectors[0], top_k=6)
    together = retriever.search(
        "t", query.text, query.blend(vectors[0], list(vectors[1:])), top_k=6,
        context_terms=query.context_terms,
    )  # fmt: skip
    ranked = [h.document_id for h in together.hits]
    # The topic's words find the vitamin D passages; the follow-up's own word (the season)
    # still puts the one about seasons first.
    assert ranked[:2] == ["seasons", "skin"], ranked
    print("ALONE", [h.document_id for h in alone.hits])


hostile_content = st.one_of(
    st.text(max_size=50),
    st.none(),
    st.integers(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url"])}),
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["text", "output_text"]),
                    "text": json_values(max_leaves=3),
                }
            ),
            json_values(max_leaves=3),
        ),
        max_size=4,
    ),
    json_values(max_leaves=5),
)
hostile_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", ""])},
        optional={"content": hostile_content},
    ),
    json_values(max_leaves=4),
)


@settings(max_examples=examples(150), deadline=None)
@given(messages=st.lists(hostile_message, max_size=12), huge=st.integers(0, 3))
def test_any_message_list_gives_a_query_without_an_error(messages: list[Any], huge: int) -> None:
    # A few turns far over every limit: the work must not grow with them.
    messages = [*[user("word " * 200_000) for _ in range(huge)], *messages]
    query = build_query(messages)
    assert isinstance(query.text, str)
    assert len(query.earlier) == len(query.term_weights) == len(query.vector_weights) <= 2
    assert all(len(turn) <= MAX_TURN_CHARS for turn in query.earlier)
    assert all(0 < w <= 1 for w in query.term_weights)


def test_only_the_last_messages_are_scanned() -> None:
    messages = [user("Tell me about statins."), *[assistant("ok")] * SCAN_MESSAGES]
    query = build_query([*messages, user("Are they safe?")])
    assert query.earlier == ()
