"""Guardrail quality and cost: injection detection and false positives on the labelled set, and
the time per request of the input checks and of the streaming output redactor.

    python -m bench.guard_eval [--rounds 3] [--misses tune]

Quality: `bench/data/injection_eval.jsonl` (lines {"text", "label", "lang", "kind", "split"}),
reported on its held-out half (never looked at while writing the rules), its dev half and all
of it, with the rules alone and with the similarity signal (real MiniLM embedder; the exemplars
are `pipeline/guards/data/injection_exemplars.jsonl`, not lines of this set). Then
`bench/data/injection_dev_extra.jsonl`, written later for the classes the first set lacked
(indirect requests for earlier instructions, claims of a special mode or authority, fake
delimiters, look-alike letters of other scripts, eleven more languages, and benign look-alikes
of each): its `tune` half was used to write rules and exemplars, its `check` half only counted.
`--misses SPLIT` lists the misses and false positives of a tuning split (dev or tune; the
held-out and check halves are refused).

Cost (one thread, after a warm-up): input checks = PII detection + injection rules on the eval
texts as they are (short questions) and on requests of ~1 KB and ~4 KB (a question with pasted
text); the similarity signal given the query vector the request path already has; the streaming
redactor on ~1.2 KB answers fed in 4-character chunks like a token stream, and the same answers
redacted in one call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.guards.injection import ExemplarIndex, FloatArray, InjectionDetector
from pipeline.guards.output import StreamingRedactor, redact_answer
from pipeline.guards.pii import find_pii
from retrieval import Embedder

Vectors = dict[str, FloatArray]
ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "bench" / "data" / "injection_eval.jsonl"
EXTRA = ROOT / "bench" / "data" / "injection_dev_extra.jsonl"
TUNING_SPLITS = ("dev", "tune")

ANSWER_SENTENCES = [
    "Vitamin D supplementation reduced the risk of fractures in older adults [doc-12].",
    "The effect was smaller in people who already had adequate levels [doc-7].",
    "Two trials found no benefit for falls, so the evidence is mixed [doc-3, doc-9].",
    "You can reach the study coordinator at maria.santos@example.org for details.",
    "For appointments call +44 20 7946 0958 between 9:00 and 17:00.",
    "Dosage in the trials ranged from 400 to 2,000 IU per day, version 2.1 of the protocol.",
    "Serum levels above 30 ng/mL were considered sufficient in most of the cohorts.",
    "Adverse events were rare and similar between the treatment and placebo groups.",
]


Row = dict[str, str]
BLOCKED = ["project bluebird", "internal use only"]


def load(path: Path = EVAL) -> list[Row]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def rates(detector: InjectionDetector, rows: Sequence[Row], vectors: Vectors) -> tuple[str, str]:
    flagged = {r["text"]: detector.check(r["text"], vectors.get(r["text"])).flagged for r in rows}
    attacks = [r for r in rows if r["label"] == "injection"]
    benign = [r for r in rows if r["label"] == "benign"]
    hits = sum(flagged[r["text"]] for r in attacks)
    false = sum(flagged[r["text"]] for r in benign)
    return share(hits, len(attacks)), share(false, len(benign))


def share(count: int, total: int) -> str:
    return f"{count / total:.3f} ({count}/{total})" if total else "-"


def quality(
    rows: list[Row], exemplars: ExemplarIndex, vectors: Vectors, splits: Sequence[str]
) -> None:
    rules, both = InjectionDetector(), InjectionDetector(exemplars)
    print(
        "| split | attempts / benign | detection, rules | FP, rules "
        "| detection, rules + similarity | FP, rules + similarity |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in (*splits, "all"):
        part = [r for r in rows if name == "all" or r["split"] == name]
        attacks = sum(r["label"] == "injection" for r in part)
        cells = [*rates(rules, part, {}), *rates(both, part, vectors)]
        print(f"| {name} | {attacks} / {len(part) - attacks} | " + " | ".join(cells) + " |")
    print("\n| language | attempts detected (rules + similarity) | false positives |")
    print("| --- | --- | --- |")
    for lang in sorted({r["lang"] for r in rows}):
        detection, fp = rates(both, [r for r in rows if r["lang"] == lang], vectors)
        print(f"| {lang} | {detection} | {fp} |")
    print()


Sample = tuple[float, float]  # (CPU ms of this thread, wall-clock ms)


def timed(fn: Callable[[], object], repeat: int) -> list[Sample]:
    """CPU and wall milliseconds of `repeat` calls, after one warm-up call. CPU time (this
    thread's) is what the check costs; wall time also counts waiting for a core, which on a
    shared machine can be most of it."""
    fn()
    samples = []
    for _ in range(repeat):
        cpu, wall = time.thread_time(), time.perf_counter()
        fn()
        samples.append(((time.thread_time() - cpu) * 1000, (time.perf_counter() - wall) * 1000))
    return samples


def over(texts: Sequence[str], fn: Callable[[str], object], rounds: int) -> list[Sample]:
    """Milliseconds of `fn` on each text, `rounds` times."""
    return [ms for text in texts for ms in timed(functools.partial(fn, text), rounds)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples: list[Sample]) -> None:
    cpu, wall = [c for c, _ in samples], [w for _, w in samples]
    cells = [
        percentile(cpu, 0.5),
        percentile(cpu, 0.99),
        percentile(wall, 0.5),
        percentile(wall, 0.99),
    ]
    print(f"| {name} | {len(samples)} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


def requests_of(size: int, rows: list[Row], rng: random.Random) -> list[str]:
    """Requests of `size` characters made of benign eval texts (a question with pasted text)."""
    benign = [r["text"] for r in rows if r["label"] == "benign"]
    out = []
    for _ in range(100):
        text = ""
        while len(text) < size:
            text += rng.choice(benign) + " "
        out.append(text[:size])
    return out


def answers(rng: random.Random, count: int = 100) -> list[str]:
    return [" ".join(rng.choice(ANSWER_SENTENCES) for _ in range(14)) for _ in range(count)]


def stream(answer: str, size: int = 4) -> tuple[str, int]:
    """Redact `answer` fed in `size`-character chunks; return the output and the most held."""
    redactor = StreamingRedactor(blocked_terms=BLOCKED)
    out, held = [], 0
    for i in range(0, len(answer), size):
        out.append(redactor.feed(answer[i : i + size]))
        held = max(held, redactor.held)
    out.append(redactor.end())
    return "".join(out), held


def input_checks(text: str, detector: InjectionDetector) -> None:
    find_pii(text)
    detector.check(text)


def cost(rows: list[Row], exemplars: ExemplarIndex, vector: FloatArray, rounds: int) -> None:
    rng = random.Random(7)
    check = functools.partial(input_checks, detector=InjectionDetector())
    no_embedder = ExemplarIndex(exemplars.texts, exemplars.labels, exemplars.vectors)
    similarity = InjectionDetector(no_embedder).similarity
    short = [r["text"] for r in rows]
    print("| step | samples | CPU p50 ms | CPU p99 ms | wall p50 ms | wall p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    median = statistics.median(map(len, short))
    row(
        f"input checks (PII + injection), eval texts ({median:.0f} chars)",
        over(short, check, rounds),
    )
    for size in (1000, 4000):
        row(
            f"input checks, {size:,}-char requests",
            over(requests_of(size, rows, rng), check, rounds),
        )
    row(
        "of which PII only, 1,000-char requests",
        over(requests_of(1000, rows, rng), find_pii, rounds),
    )
    row(
        "similarity signal, query vector given",
        timed(lambda: similarity("x", vector), 300 * rounds),
    )
    texts = answers(rng)
    for text in texts:
        assert stream(text)[0] == redact_answer(text, blocked_terms=BLOCKED)[0]
    median = statistics.median(map(len, texts))
    row(
        f"streaming redactor, per answer ({median:.0f} chars, 4-char chunks)",
        over(texts, stream, rounds),
    )
    whole = functools.partial(redact_answer, blocked_terms=BLOCKED)
    row("whole-answer redaction in one call, per answer", over(texts, whole, rounds))
    held = max(stream(text)[1] for text in texts)
    bound = StreamingRedactor().max_holdback
    print(f"\nmost canonical characters held back while streaming: {held} (bound {bound})")


def misses(rows: list[Row], exemplars: ExemplarIndex, vectors: Vectors, split: str) -> None:
    """The attempts missed and the benign texts flagged in a tuning split, with their scores."""
    if split not in TUNING_SPLITS:
        raise SystemExit(f"--misses lists only tuning splits ({', '.join(TUNING_SPLITS)})")
    detector = InjectionDetector(exemplars)
    for row in rows:
        if row["split"] != split:
            continue
        decision = detector.check(row["text"], vectors.get(row["text"]))
        if decision.flagged != (row["label"] == "injection"):
            kind = "MISSED" if row["label"] == "injection" else "FALSE+"
            print(f"{kind} {row['lang']} {row['kind']} sim={decision.similarity or 0:.2f} "
                  f"{decision.rule} {row['text']!r}")  # fmt: skip


def pii_quality() -> None:
    """PII recall and false positives on the labelled cases of tests/pipeline/guards/pii_cases.py
    (cards and IBANs with every separator, lower-case IBANs, written-out e-mail addresses, and
    look-alikes that must pass); the held cases were written after the rules were settled."""
    from tests.pipeline.guards import pii_cases as cases

    def kinds(text: str) -> list[str]:
        return [f.kind for f in find_pii(text)]

    sets = [
        ("labelled", [(t, k) for t, k, _ in cases.POSITIVES], cases.BENIGN),
        ("held", cases.HELD_OUT_POSITIVES, cases.HELD_OUT_BENIGN),
    ]
    print("| PII set | positives found | benign flagged |")
    print("| --- | --- | --- |")
    for name, positives, benign in sets:
        found = sum(kinds(t) == [k] for t, k in positives)
        flagged = sum(bool(kinds(t)) for t in benign)
        print(
            f"| {name} | {found / len(positives):.3f} ({found}/{len(positives)}) | "
            f"{flagged / len(benign):.3f} ({flagged}/{len(benign)}) |"
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--misses", help="list misses of a tuning split (dev or tune), only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows, extra = load(), load(EXTRA)
    embedder = Embedder()
    embedder.warm_up()
    exemplars = ExemplarIndex.from_file(embedder)
    texts = [r["text"] for r in rows + extra]
    vectors = dict(zip(texts, (embedder.embed([t])[0] for t in texts), strict=True))
    if args.misses:
        misses(rows + extra, exemplars, vectors, args.misses)
        return
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print(f"`{EVAL.relative_to(ROOT)}`:\n")
    quality(rows, exemplars, vectors, ("heldout", "dev"))
    print(f"`{EXTRA.relative_to(ROOT)}`:\n")
    quality(extra, exemplars, vectors, ("check", "tune"))
    pii_quality()
    cost(rows, exemplars, embedder.embed(["How do I reset my router?"])[0], args.rounds)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
