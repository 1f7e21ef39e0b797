"""The one tokeniser, used for documents and queries alike: lower-case words of two or more
characters, English stop words dropped, Snowball (Porter 2) English stems."""

from __future__ import annotations

import re
import threading

import Stemmer

# The English stop list of scikit-learn/NLTK lineage, as bm25s ships it.
STOP_WORDS = frozenset(
    """a about above after again against ain all am an and any are aren aren't as at be because been
    before being below between both but by can couldn couldn't d did didn didn't do does doesn
    doesn't doing don don't down during each few for from further had hadn hadn't has hasn hasn't
    have haven haven't having he her here hers herself him himself his how i if in into is isn
    isn't it it's its itself just ll m ma me mightn mightn't more most mustn mustn't my myself
    needn needn't no nor not now o of off on once only or other our ours ourselves out over own re
    s same shan shan't she she's should should've shouldn shouldn't so some such t than that
    that'll the their theirs them themselves then there these they this those through to too under
    until up ve very was wasn wasn't we were weren weren't what when where which while who whom
    why will with won won't wouldn wouldn't y you you'd you'll you're you've your yours yourself
    yourselves""".split()  # noqa: SIM905
)

_TOKEN = re.compile(r"\b\w\w+\b")
# The stemmers keep nothing. PyStemmer can cache every word it stems (10,000 per stemmer, one
# stemmer per thread), shared by whatever the thread serves: a word stemmed sooner would tell a
# caller that another tenant's text held it, and a caller's 35,000-letter "word" in a query
# kept 70 KiB a query, up to 0.7 GiB a thread. The cache spared about 0.15 µs a word
# (BENCHMARKS.md); compression and citations keep each tenant's stems themselves, words of up
# to LONGEST_CACHED characters.
LONGEST_CACHED = 64
# PyStemmer objects are not thread-safe; one per thread.
_local = threading.local()


def _stemmer() -> Stemmer.Stemmer:
    stemmer: Stemmer.Stemmer | None = getattr(_local, "stemmer", None)
    if stemmer is None:
        stemmer = Stemmer.Stemmer("english", 0)
        _local.stemmer = stemmer
    return stemmer


def tokenize(text: str) -> list[str]:
    """Return the stemmed, stop-word-free tokens of `text`, in order, duplicates kept."""
    words = [w for w in _TOKEN.findall(text.lower()) if w not in STOP_WORDS]
    result: list[str] = _stemmer().stemWords(words)
    return result
