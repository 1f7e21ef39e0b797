"""Build the labelled multi-turn conversations over SciFact (bench/data/conversations.jsonl).

    .venv/bin/python -m bench.build_conversations

Each conversation ends in a follow-up whose relevant documents are a SciFact claim's (its
qrels), and carries the same information asked as one standalone question, so retrieval for
the follow-up can be compared with retrieval for the question a user could have asked alone.
A claim is split where its first verb starts ("ALDH1 expression | is associated with poorer
prognosis ..."): the subject and the predicate are then spread over the turns, four ways:

- ``pronoun``: an earlier turn names the subject, the follow-up says "it"/"they"
  ("Tell me about ALDH1 expression." ... "Is it true that it is associated with ...?");
- ``ellipsis``: the follow-up is the bare predicate ("And is associated with ...?");
- ``what_about``: an earlier turn asks the predicate of another claim's subject, the follow-up
  swaps the subject in ("What about ALDH1 expression?");
- ``topic_shift``: the earlier turns are about another claim altogether and the follow-up is a
  complete question: retrieval must ignore them (``earlier_relevant`` lists their documents).

A third of the first three kinds open with an unrelated exchange about another claim, so the
turn a follow-up depends on is not always the first. Claims come from SciFact **train** for
the ``tune`` half and from **test** for the ``report`` half; the choice and the phrasing are
drawn from a seeded generator over sorted ids, so the file is the same on every run.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.retrieval_data import load_qrels, load_queries
from retrieval.tokenize import tokenize

OUTPUT = Path(__file__).parent / "data" / "conversations.jsonl"
CASES = ("pronoun", "ellipsis", "what_about", "topic_shift")
HALVES = {"tune": "train", "report": "test"}
SEED = 17

# Finite verbs a SciFact claim's predicate starts with (auxiliaries and the common verbs of
# findings). A claim whose first such word is not among its first eight is left out.
VERBS = frozenset(
    """is are was were has have had can cannot may might could does do did will would should
    must increase increases decrease decreases reduce reduces cause causes promote promotes
    inhibit inhibits induce induces improve improves prevent prevents bind binds suppress
    suppresses regulate regulates activate activates enhance enhances lead leads result results
    contribute contributes affect affects mediate mediates correlate correlates restrict
    restricts produce produces require requires protect protects impair impairs block blocks
    lower lowers raise raises predict predicts undergo undergoes carry carries occur occurs play
    plays slow slows govern governs convert converts enable enables destabilize destabilizes
    stabilize stabilizes provide provides survive survives delay delays trigger triggers drive
    drives alter alters exhibit exhibits show shows display displays lack lacks contain contains
    depend depends act acts facilitate facilitates interact interacts target targets modulate
    modulates control controls limit limits attenuate attenuates exacerbate exacerbates
    accelerate accelerates mimic mimics confer confers elicit elicits form forms encode encodes
    express expresses localize localizes occupy occupies maintain maintains reverse reverses
    worsen worsens recruit recruits repress represses stimulate stimulates disrupt disrupts
    impede impedes""".split()  # noqa: SIM905
)
# A subject may not end on these (the split would cut a phrase) nor start with them (it would
# be a pronoun or an expletive already).
_DANGLING = frozenset("of in to for with by on and the a an or from at".split())  # noqa: SIM905
_OPENING = ("there ", "it ", "this ", "these ", "in ", "a ", "an ", "at ", "during ", "when ")

ASK_TOPIC = (
    "What is known about {s}?",
    "Tell me about {s}.",
    "I am reading up on {s}. What do the studies cover?",
    "Can you summarise the research on {s}?",
)
REPLY_TOPIC = (
    "Several abstracts discuss {s}. What would you like to know?",
    "There is research on {s}; ask me about a specific finding.",
)
ASK_CLAIM = (
    "Is it true that {s} {p}?",
    "Do studies show that {s} {p}?",
    "Does the evidence say that {s} {p}?",
    "I read that {s} {p}. Is that right?",
)
REPLY_CLAIM = (
    "Some of the abstracts address that question for {s}.",
    "The sources have findings on {s}.",
)
ELLIPSIS = ("And {p}?", "{P}?", "Also, {p}?")
WHAT_ABOUT = ("What about {s}?", "How about {s}?", "And {s}?", "What about for {s}?")
# Half the topic shifts say so, half do not.
SHIFT = ("", "", "Different question: ", "Switching topics. ")


@dataclass(frozen=True)
class Claim:
    """A SciFact claim split into subject and predicate, with its relevant documents."""

    id: str
    subject: str
    predicate: str
    relevant: dict[str, int]

    @property
    def plural(self) -> bool:
        head = self.subject.split()[-1].lower()
        return " and " in self.subject or (head.endswith("s") and not head.endswith("ss"))

    @property
    def pronoun(self) -> str:
        return "they" if self.plural else "it"


def clean(text: str) -> str:
    """Whitespace collapsed (claims carry stray double spaces)."""
    return re.sub(r"\s+", " ", text).strip()


def split_claim(text: str) -> tuple[str, str] | None:
    """(subject, predicate) at the claim's first finite verb, or None when it has no clean
    split (several sentences, too long, no verb early on, a subject cut mid-phrase)."""
    text = clean(text).rstrip(".")
    words = text.split()
    if ". " in text or len(words) > 28:
        return None
    for i, word in enumerate(words[1:9], start=1):
        if word.lower() not in VERBS:
            continue
        subject, predicate = " ".join(words[:i]), " ".join(words[i:])
        if subject.lower().startswith(_OPENING) or words[i - 1].lower() in _DANGLING:
            return None
        if len(words) - i < 3:
            return None
        return mid_sentence(subject), predicate
    return None


def mid_sentence(phrase: str) -> str:
    """The phrase as it reads inside a sentence: a capital kept only for names and acronyms
    ("Statins" -> "statins", "ALDH1 expression" stays)."""
    first = phrase.split()[0]
    if first[:1].isupper() and first[1:].islower() and first.isalpha():
        return phrase[0].lower() + phrase[1:]
    return phrase


def sentence(text: str) -> str:
    return text[0].upper() + text[1:] if text else text


def load_claims(split: str) -> list[Claim]:
    queries = load_queries()
    claims = []
    for qid, relevant in sorted(load_qrels(split).items(), key=lambda item: int(item[0])):
        parts = split_claim(queries[qid])
        if parts is not None:
            claims.append(Claim(qid, parts[0], parts[1], relevant))
    return claims


def unrelated(rng: random.Random, claims: list[Claim], target: Claim, *avoid: Claim) -> Claim:
    """Another claim sharing no relevant document and almost no term with `target`."""
    words = set(tokenize(f"{target.subject} {target.predicate}"))
    taken = {c.id for c in avoid} | {target.id}
    docs = set(target.relevant)
    while True:
        other = rng.choice(claims)
        if other.id in taken or docs & set(other.relevant):
            continue
        theirs = set(tokenize(f"{other.subject} {other.predicate}"))
        if len(words & theirs) <= len(words) // 8:
            return other


def turn(role: str, text: str) -> dict[str, str]:
    return {"role": role, "content": text}


def conversation(
    rng: random.Random, case: str, target: Claim, claims: list[Claim]
) -> dict[str, Any]:
    """One labelled conversation of `case` whose follow-up asks about `target`."""
    s, p = target.subject, target.predicate
    messages: list[dict[str, str]] = []
    earlier: dict[str, int] = {}
    if case != "topic_shift" and rng.random() < 1 / 3:
        old = unrelated(rng, claims, target)
        messages += [
            turn("user", rng.choice(ASK_CLAIM).format(s=old.subject, p=old.predicate)),
            turn("assistant", rng.choice(REPLY_CLAIM).format(s=old.subject)),
        ]
    if case == "pronoun":
        messages += [
            turn("user", rng.choice(ASK_TOPIC).format(s=s)),
            turn("assistant", rng.choice(REPLY_TOPIC).format(s=s)),
        ]
        ask = rng.choice(ASK_CLAIM)
        follow_up, standalone = ask.format(s=target.pronoun, p=p), ask.format(s=s, p=p)
    elif case == "ellipsis":
        messages += [
            turn("user", rng.choice(ASK_TOPIC).format(s=s)),
            turn("assistant", rng.choice(REPLY_TOPIC).format(s=s)),
        ]
        follow_up = rng.choice(ELLIPSIS).format(p=p, P=sentence(p))
        standalone = f"{sentence(s)} {p}?"
    elif case == "what_about":
        other = unrelated(rng, claims, target)
        ask = rng.choice(ASK_CLAIM)
        messages += [
            turn("user", ask.format(s=other.subject, p=p)),
            turn("assistant", rng.choice(REPLY_CLAIM).format(s=other.subject)),
        ]
        follow_up, standalone = rng.choice(WHAT_ABOUT).format(s=s), ask.format(s=s, p=p)
    else:
        old = unrelated(rng, claims, target)
        earlier = dict(old.relevant)
        messages += [
            turn("user", rng.choice(ASK_TOPIC).format(s=old.subject)),
            turn("assistant", rng.choice(REPLY_TOPIC).format(s=old.subject)),
            turn("user", rng.choice(ASK_CLAIM).format(s=old.pronoun, p=old.predicate)),
            turn("assistant", rng.choice(REPLY_CLAIM).format(s=old.subject)),
        ]
        follow_up = rng.choice(SHIFT) + rng.choice(ASK_CLAIM).format(s=s, p=p)
        follow_up = sentence(follow_up)
        standalone = follow_up
    messages.append(turn("user", sentence(follow_up)))
    row: dict[str, Any] = {
        "case": case,
        "claim_id": target.id,
        "messages": messages,
        "standalone": sentence(standalone),
        "relevant": target.relevant,
    }
    if earlier:
        row["earlier_relevant"] = earlier
    return row


def build(per_case: int) -> list[dict[str, Any]]:
    """`per_case` conversations of each case in each half; a claim is the target of one only."""
    rows = []
    for half, split in HALVES.items():
        rng = random.Random(f"{SEED}-{half}")
        claims = load_claims(split)
        targets = rng.sample(claims, per_case * len(CASES))
        for n, target in enumerate(targets):
            case = CASES[n % len(CASES)]
            row = conversation(rng, case, target, claims)
            rows.append({"id": f"{half}-{case}-{n // len(CASES):03d}", "half": half, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-case", type=int, default=40)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    rows = build(args.per_case)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    counts = {case: sum(r["case"] == case for r in rows) for case in CASES}
    print(f"{len(rows)} conversations -> {args.output} ({counts}, per half {len(rows) // 2})")


if __name__ == "__main__":
    main()
