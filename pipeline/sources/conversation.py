"""Follow-up questions: what a conversation's last user message asks, for retrieval.

"And how does the season change it?" finds nothing on its own: the topic is in an earlier turn.
When the last user message depends on earlier turns, retrieval searches with the conversation
instead, cheaply and without a model call:

- BM25 adds the words of the earlier user turns at a lower weight than the message's own
  (``FollowUpWeights.terms``, less again for each turn further back), so the topic's words
  find the passages while the follow-up's own words still rank them;
- the query vector is a blend of the message's vector and the earlier turns' vectors,
  normalised (the message's at weight 1, the most recent earlier turn's at
  ``FollowUpWeights.vector``).

How much the earlier turns count is decided from the message's words (``dependence``): a
pronoun or demonstrative that points back ("it", "these", "that" at a clause's end), an opener
that continues ("what about", "and", "also"), or too few words to stand alone make it a
follow-up, searched with the earlier turns at full weight. A short message with no cue
("Is associated with poorer prognosis?") may be a fragment of the earlier question: it gets
them at a share of that weight (``FollowUpWeights.fragment``). A longer one reads as a complete
question, on a new topic perhaps, and is searched alone, as is a declared change of topic
("different question:"), so a topic shift is not pulled back to the old topic.
Assistant turns are not read: they echo sources the user did not ask for, and a system prompt
is not a question.

The work is bounded whatever the request holds: earlier turns are looked for among the
``SCAN_MESSAGES`` messages before the last user message, ``FollowUpWeights.turns`` of them are
used, each cut to ``MAX_TURN_CHARS``, and the cues are read in the message's first
``CUE_CHARS`` characters. The weights were tuned on the tune half of
bench/data/conversations.jsonl (``python -m bench.conversation_bench --tune``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from pipeline.model.messages import text_of
from retrieval.tokenize import tokenize
from retrieval.vectors import FloatArray

SCAN_MESSAGES: Final = 64
MAX_TURN_CHARS: Final = 2000
CUE_CHARS: Final = 600
# A message of this many content words or fewer cannot name its own topic ("Why?", "In mice?").
SHORT_WORDS: Final = 2

Reason = Literal[
    "pronoun", "opener", "short", "fragment", "standalone", "topic_shift", "first_turn"
]

# Fixed phrases whose "it"/"that" point nowhere: "is it true that ...", "is that right?".
_IDIOMS = re.compile(
    r"\b(?:is|was|isn't|wasn't)\s+(?:it|that|this)\s+(?:true|right|correct|so|the case|"
    r"possible|known)\b|\bit(?:'s|\s+is|\s+was)\s+(?:true|known|possible|likely|said|claimed|"
    r"reported|thought)\b"
)
# "that" introducing a clause after a verb of saying or finding is no reference either.
_COMPLEMENT = re.compile(
    r"\b(?:show|shows|showed|shown|say|says|said|read|heard|claim|claims|claimed|find|finds|"
    r"found|suggest|suggests|suggested|mean|means|true|think|believe|know|known|evidence|"
    r"report|reports|reported|state|states|argue|argues|possible|likely|so|sure)\s+that\b"
)
# Pronouns and determiners that point back to something said before.
_ANAPHORS = re.compile(
    r"\b(?:it|its|itself|they|them|their|theirs|themselves|this|these|those|such|he|she|him|"
    r"his|her|hers|former|latter)\b"
)
# "that" points back at a clause's end or after a preposition or a verb ("about that",
# "does that", "change that?"); elsewhere it is mostly a relative pronoun ("cells that bind").
_THAT = re.compile(
    r"\bthat\s*(?:[?.!,;:]|$)|\b(?:about|of|for|on|with|from|by|does|do|did|affect|affects|"
    r"change|changes|cause|causes|explain|explains)\s+that\b"
)
_OPENERS = re.compile(
    r"^\W*(?:and|also|plus|but|or|so|then|what about|how about|what of|same for|same question|"
    r"now for|and what about|what if)\b"
)
_SHIFT = re.compile(
    r"\b(?:different|new|another|unrelated|separate|other)\s+(?:question|topic|subject)\b|"
    r"\bswitching\s+(?:topics?|gears|subjects?)\b|\bsomething\s+else\b|"
    r"\bon\s+another\s+note\b|\bchang(?:e|ing)\s+(?:the\s+)?(?:topic|subject)\b"
)


@dataclass(frozen=True)
class FollowUpWeights:
    """How much earlier user turns count: ``terms`` is the BM25 weight of the words of the
    most recent one (the message's own weigh 1), ``vector`` its vector's weight in the blend
    (the message's is 1), and each turn further back counts ``decay`` times the one after it;
    at most ``turns`` earlier user turns are used. A message without cues of at most
    ``fragment_words`` content words gets ``fragment`` times those weights; a longer one, and a
    declared change of topic, none."""

    # Tuned on the tune half (bench/conversation_bench.py --tune; BENCHMARKS.md).
    terms: float = 0.9
    vector: float = 0.9
    decay: float = 0.5
    turns: int = 2
    fragment: float = 0.7
    fragment_words: int = 5

    def __post_init__(self) -> None:
        if not (
            self.terms > 0
            and self.vector >= 0
            and 0 < self.decay <= 1
            and self.turns >= 0
            and 0 <= self.fragment <= 1
            and self.fragment_words >= 0
        ):
            raise ValueError("weights must be positive, decay within (0, 1], fragment in [0, 1]")


DEFAULT_WEIGHTS: Final = FollowUpWeights()
# Part of the response cache key: bump it when the rules or the weights change what a
# conversation searches for, so no answer found the old way is served.
VERSION: Final = f"1:{DEFAULT_WEIGHTS}"


@dataclass(frozen=True)
class ConversationQuery:
    """What retrieval searches for: the last user message ``text`` and, when it depends on
    them, the ``earlier`` user turns (most recent first) with the BM25 weight of their words
    (``term_weights``) and their vectors' weight in the blend (``vector_weights``)."""

    text: str
    reason: Reason
    earlier: tuple[str, ...] = ()
    term_weights: tuple[float, ...] = ()
    vector_weights: tuple[float, ...] = ()

    @property
    def mode(self) -> Literal["conversation", "last_message"]:
        return "conversation" if self.earlier else "last_message"

    @property
    def context_terms(self) -> list[tuple[str, float]]:
        """The earlier turns as BM25 takes them (``HybridRetriever.search``)."""
        return list(zip(self.earlier, self.term_weights, strict=True))

    def blend(self, own: FloatArray, earlier: Sequence[FloatArray]) -> FloatArray:
        """The query vector: ``own`` (the message's) plus the earlier turns' vectors at their
        weights, normalised to unit length; ``own`` itself when nothing is blended in."""
        if not self.earlier:
            return own
        if len(earlier) != len(self.earlier):
            raise ValueError("one vector per earlier turn")
        mixed = own.astype(np.float32, copy=True)
        for vector, weight in zip(earlier, self.vector_weights, strict=True):
            mixed += np.float32(weight) * vector
        norm = float(np.linalg.norm(mixed))
        return own if norm == 0.0 or not np.isfinite(norm) else mixed / np.float32(norm)


def user_turns(messages: Sequence[Any], limit: int) -> list[str]:
    """The text of the last user message and of up to ``limit`` user messages before it, most
    recent first; the earlier ones only among the ``SCAN_MESSAGES`` messages before the last.
    Anything that is not a message is passed over."""
    last = next(
        (i for i in range(len(messages) - 1, -1, -1) if _is_user(messages[i])),
        None,
    )
    if last is None:
        return []
    found = [text_of(messages[last].get("content"))]
    for message in reversed(messages[max(0, last - SCAN_MESSAGES) : last]):
        if len(found) > limit:
            break
        if _is_user(message):
            found.append(text_of(message.get("content")))
    return found


def _is_user(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "user"


def dependence(text: str, fragment_words: int = DEFAULT_WEIGHTS.fragment_words) -> Reason:
    """Why the message needs earlier turns to be understood (``pronoun``, ``opener``,
    ``short``), may need them (``fragment``: no cue, at most ``fragment_words`` content
    words), or does not (``standalone``, ``topic_shift``); read from the first ``CUE_CHARS``
    characters."""
    head = " ".join(text[:CUE_CHARS].lower().split())
    if _SHIFT.search(head):
        return "topic_shift"
    if _OPENERS.search(head):
        return "opener"
    words = len(tokenize(head))
    if words <= SHORT_WORDS:
        return "short"
    bare = _COMPLEMENT.sub(" ", _IDIOMS.sub(" ", head))
    if _ANAPHORS.search(bare) or _THAT.search(bare):
        return "pronoun"
    return "fragment" if words <= fragment_words else "standalone"


def build_query(
    messages: Sequence[Any], weights: FollowUpWeights = DEFAULT_WEIGHTS
) -> ConversationQuery:
    """The query for the conversation ``messages`` (the request's, in order), never raising:
    the last user message, with the earlier user turns it depends on."""
    turns = user_turns(messages, weights.turns)
    if not turns:
        return ConversationQuery("", "first_turn")
    text, before = turns[0], [t[:MAX_TURN_CHARS] for t in turns[1:] if t.strip()]
    if not before:
        return ConversationQuery(text, "first_turn")
    reason = dependence(text, weights.fragment_words)
    share = {"topic_shift": 0.0, "standalone": 0.0, "fragment": weights.fragment}.get(reason, 1.0)
    if share == 0.0:
        return ConversationQuery(text, reason)
    scale = [share * weights.decay**i for i in range(len(before))]
    return ConversationQuery(
        text,
        reason,
        tuple(before),
        tuple(weights.terms * s for s in scale),
        tuple(weights.vector * s for s in scale),
    )
