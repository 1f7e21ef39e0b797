"""Build the labelled citation set, bench/data/citations.jsonl, from SciFact: deterministic.

For each SciFact test claim (in id order) the top 4 abstracts by BM25 are the passages of a
prompt. An answer of about 200 tokens is made of their sentences, each one copied or lightly
paraphrased (words dropped, a clause moved, synonyms swapped; ``PARAPHRASES``), or two
sentences of two passages joined into one (labelled with both); and of unsupported sentences:
from an abstract ranked 5 to 20 for the same claim (on the topic, but not in the prompt: the
hard case), from one outside the claim's top 100, invented from templates, or a passage's
sentence with half its content words replaced by another abstract's (a claim the source does
not make). Some supported sentences carry an ``[n]`` marker, most of them right, some wrong;
some unsupported ones carry one too. A sentence's label is the passage (its place from 1, as in
``rag.sources``) and the span of the abstract's text it was made from, or none.

Source sentences are cut with ``pipeline.answer.citations.segments`` (what is cited is a
sentence as the service cuts it); an answer whose sentences the service would cut differently
from how it was built is skipped, so every label names one answer sentence.

    python -m bench.build_citation_set [--answers 120]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from bench.retrieval_data import load_corpus, load_qrels, load_queries
from pipeline.answer.citations import segments
from pipeline.model.prompt import SOURCE_CHARS
from retrieval.bm25 import BM25Index, count_terms
from retrieval.documents import Document
from retrieval.tokenize import tokenize

OUT = Path(__file__).parent / "data" / "citations.jsonl"
TOP_K = 4
SYNONYMS = {
    "increased": "raised",
    "decreased": "lowered",
    "increase": "rise",
    "decrease": "reduction",
    "patients": "subjects",
    "significant": "notable",
    "significantly": "markedly",
    "associated": "linked",
    "showed": "demonstrated",
    "show": "demonstrate",
    "results": "findings",
    "reduced": "diminished",
    "higher": "greater",
    "lower": "smaller",
    "study": "investigation",
    "effect": "impact",
    "effects": "impacts",
    "using": "with",
    "risk": "likelihood",
    "role": "function",
    "however": "yet",
    "induced": "triggered",
    "required": "needed",
    "observed": "seen",
    "identified": "found",
    "suggest": "indicate",
    "important": "key",
}
INVENTED = [
    "Further work will be needed before these ideas can be applied in everyday clinical care.",
    "Many experts believe that the question remains open and deserves more attention.",
    "The weather in the northern hemisphere was unusually warm during the recruitment period.",
    "Funding agencies have recently increased their support for long-term cohort projects.",
    "In summary, the topic is complex and no single answer fits every situation.",
    "Some readers may find the statistical methods hard to follow without a background course.",
    "The authors of a popular textbook disagree with this view for historical reasons.",
    "It is worth remembering that correlation does not imply causation in observational data.",
    "A ferry service connects the two islands twice a day during the summer months.",
    "Coffee consumption has risen steadily in urban areas over the last two decades.",
]
PARAPHRASES = ("copy", "drop", "move", "synonyms", "drop+synonyms")


def bm25_top(docs: list[Document], queries: dict[str, str], qids: list[str], k: int) -> dict:
    vocab: dict[str, int] = {}
    tf = count_terms((tokenize(f"{d.title} {d.text}") for d in docs), vocab)
    index = BM25Index(tf, vocab)
    top: dict[str, list[int]] = {}
    for qid in qids:
        scores, _ = index.scores(tokenize(queries[qid]))
        top[qid] = [int(i) for i in np.argsort(-scores, kind="stable")[:k]]
    return top


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _full_stop(text: str) -> str:
    text = text.rstrip(" ,;:")
    return text if text.endswith((".", "!", "?")) else text + "."


def paraphrase(sentence: str, kind: str, rng: random.Random) -> str:
    words = sentence.split()
    if "drop" in kind and len(words) > 8:
        droppable = [i for i, w in enumerate(words[1:-1], 1) if len(w) > 3]
        gone = set(rng.sample(droppable, k=min(len(droppable), max(1, len(words) // 7))))
        words = [w for i, w in enumerate(words) if i not in gone]
    if "synonyms" in kind:
        words = [_swap(w) for w in words]
    text = " ".join(words)
    if kind == "move" and ", " in text:
        head, tail = text.split(", ", 1)
        text = f"{_capitalise(tail.rstrip('.'))}, {head[:1].lower()}{head[1:]}"
    return _full_stop(_capitalise(text))


def _swap(word: str) -> str:
    core = word.strip(".,;:()")
    other = SYNONYMS.get(core.lower())
    if other is None:
        return word
    if core[:1].isupper():
        other = _capitalise(other)
    return word.replace(core, other, 1)


def _one_sentence(text: str) -> bool:
    return len(segments(text)) == 1 and 6 <= len(text.split()) <= 60


def _with_marker(sentence: str, marker: int) -> str:
    return f"{sentence[:-1]} [{marker}]{sentence[-1]}"


def _sentences(doc: Document) -> list[tuple[int, int]]:
    """The sentences a prompt shows of the abstract (it cuts a source at SOURCE_CHARS)."""
    return [
        (a, b) for a, b in segments(doc.text) if b <= SOURCE_CHARS and _one_sentence(doc.text[a:b])
    ]


def _joined(first: str, second: str) -> str:
    """Two sentences as one: the first's opening half and the second's closing half."""
    head, tail = first.rstrip(".").split(), second.rstrip(".").split()
    return _full_stop(" ".join([*head[: max(4, len(head) // 2)], "and", *tail[len(tail) // 2 :]]))


def _altered(sentence: str, donor: str, rng: random.Random) -> str:
    """Half the sentence's longer words replaced by the donor's: the same shape, another claim."""
    words = sentence.rstrip(".").split()
    spare = [w.strip(".,;:()") for w in donor.split() if len(w) > 4]
    slots = [i for i, w in enumerate(words) if len(w) > 4]
    for i in rng.sample(slots, k=len(slots) // 2) if spare else ():
        words[i] = rng.choice(spare)
    return _full_stop(_capitalise(" ".join(words)))


def _supported(
    passages: list[Document], pool: list[tuple[int, tuple[int, int]]], rng: random.Random
) -> tuple[str, dict]:
    p, (a, b) = rng.choice(pool)
    if rng.random() < 0.15:
        others = [(q, span) for q, span in pool if q != p]
        if others:
            q, (c, d) = rng.choice(others)
            text = _joined(passages[p].text[a:b], passages[q].text[c:d])
            sources = [{"index": p + 1, "span": [a, b]}, {"index": q + 1, "span": [c, d]}]
            return text, {"supported": True, "kind": "joined", "sources": sources}
    kind = rng.choice(PARAPHRASES)
    text = paraphrase(passages[p].text[a:b], kind, rng)
    label = {"supported": True, "kind": kind, "sources": [{"index": p + 1, "span": [a, b]}]}
    roll = rng.random()
    if roll < 0.25:
        text, label["marker"] = _with_marker(text, p + 1), "right"
    elif roll < 0.33:
        wrong = rng.choice([i for i in range(1, len(passages) + 1) if i != p + 1])
        text, label["marker"] = _with_marker(text, wrong), "wrong"
    return text, label


def _unsupported(
    passages: list[Document],
    pool: list[tuple[int, tuple[int, int]]],
    near: list[Document],
    far: list[Document],
    rng: random.Random,
) -> tuple[str, dict] | None:
    kind = rng.choice(["near", "near", "far", "invented", "altered"])
    if kind == "invented":
        text = rng.choice(INVENTED)
    else:
        doc = rng.choice(near if kind == "near" else far)
        spans = _sentences(doc)
        if not spans:
            return None
        a, b = rng.choice(spans)
        text = doc.text[a:b]
        if kind == "altered":
            p, (c, d) = rng.choice(pool)
            text = _altered(passages[p].text[c:d], text, rng)
    label = {"supported": False, "kind": kind, "sources": []}
    if rng.random() < 0.2:
        text, label["marker"] = _with_marker(text, rng.randint(1, len(passages))), "wrong"
    return text, label


def build_answer(
    qid: str,
    passages: list[Document],
    near: list[Document],
    far: list[Document],
    rng: random.Random,
) -> dict | None:
    pool = [(p, span) for p, doc in enumerate(passages) for span in _sentences(doc)]
    if len(pool) < 5:
        return None
    items = [_supported(passages, pool, rng) for _ in range(rng.randint(4, 5))]
    for _ in range(rng.randint(1, 3)):
        made = _unsupported(passages, pool, near, far, rng)
        if made is not None:
            items.insert(rng.randint(1, len(items)), made)
    if not all(_one_sentence(text) for text, _ in items):
        return None
    answer, sentences = "", []
    for text, label in items:
        start = len(answer) + (1 if answer else 0)
        answer = f"{answer} {text}" if answer else text
        sentences.append({"text_span": [start, start + len(text)], **label})
    if [s["text_span"] for s in sentences] != [list(s) for s in segments(answer)]:
        return None
    return {
        "id": f"scifact-{qid}",
        "passages": [d.id for d in passages],
        "answer": answer,
        "sentences": sentences,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    docs = load_corpus()
    queries = load_queries()
    qids = sorted(load_qrels("test"), key=int)
    top = bm25_top(docs, queries, qids, 100)
    rows = []
    for qid in qids:
        rng = random.Random(f"citations-{qid}")
        ranked = top[qid]
        far = [docs[i] for i in rng.sample(range(len(docs)), 20) if i not in set(ranked)]
        near = [docs[i] for i in ranked[TOP_K:20]]
        row = build_answer(qid, [docs[i] for i in ranked[:TOP_K]], near, far, rng)
        if row is not None:
            rows.append(row)
        if len(rows) == args.answers:
            break
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    sentences = [s for row in rows for s in row["sentences"]]
    supported = sum(s["supported"] for s in sentences)
    print(
        f"{len(rows)} answers, {len(sentences)} sentences ({supported} supported, "
        f"{len(sentences) - supported} not) -> {args.out} ({args.out.stat().st_size} bytes)"
    )


if __name__ == "__main__":
    main()
