"""The word memos kept per memo scope (``pipeline.kept.KeptByScope``): one bound for all the
scopes, the least recently used scopes let go past it."""

from __future__ import annotations

import threading

from pipeline.kept import KeptByScope


def words(scope: str, n: int) -> list[tuple[str, int]]:
    return [(f"{scope}-{i}", i) for i in range(n)]


def test_the_scopes_in_use_keep_their_words_when_others_fill_the_bound() -> None:
    # Cleared all at once past the bound, as before, twelve busy tenants of one vocabulary each
    # found none of their words kept (a review's find). Now the ones in use keep theirs.
    kept: KeptByScope[int] = KeptByScope(size=1_000, chars=10**9)
    kept.add("busy", words("busy", 300))
    for n in range(12):  # others, each its own 300 words, the busy scope used in between
        kept.add(f"other{n}", words(f"other{n}", 300))
        assert kept.words("busy").get("busy-299") == 299, f"after {n + 1} others"
        assert len(kept) <= 1_000
    assert len(kept.scopes()) <= 3 and "busy" in kept.scopes()


def test_the_bound_holds_by_characters_and_a_scope_alone_over_it_starts_anew() -> None:
    kept: KeptByScope[int] = KeptByScope(size=10**9, chars=20)  # 5 words of 3 letters: 15
    kept.add("a", words("a", 5))
    held = kept.words("a")
    kept.add("b", words("b", 5))  # 30 > 20: a, the least recently used, is let go
    assert kept.scopes() == ["b"] and kept.kept("a") == {}
    assert held["a-4"] == 4, "a dict let go stays whole for whoever holds it"
    kept.add("b", words("c", 5))  # b alone would hold 30: it starts anew
    assert kept.kept("b") == dict(words("c", 5))
    assert kept.kept("nobody") == {} and "nobody" not in kept.scopes(), "a look makes nothing"


def test_scopes_are_bounded_in_number_empty_ones_too() -> None:
    kept: KeptByScope[int] = KeptByScope(size=100, chars=100, scopes=8)
    for n in range(50):
        kept.words(f"s{n}")
    assert kept.scopes() == [f"s{n}" for n in range(42, 50)]


def test_threads_adding_at_once_keep_the_counts_within_the_bound() -> None:
    kept: KeptByScope[int] = KeptByScope(size=2_000, chars=10**9)

    def work(t: int) -> None:
        for n in range(200):
            scope = f"s{(t + n) % 7}"
            found = kept.words(scope)
            kept.add(scope, [(f"w{n % 50}-{t}", n)])
            assert isinstance(found, dict)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(kept) == sum(len(kept.kept(s)) for s in kept.scopes()) <= 2_000


def test_what_one_add_brings_beyond_the_bound_is_not_kept() -> None:
    kept: KeptByScope[int] = KeptByScope(size=3, chars=10**9)
    kept.add("a", words("a", 10))
    assert len(kept) == 3 == len(kept.kept("a"))
    weighed: KeptByScope[str] = KeptByScope(size=100, chars=10, weight=lambda w, v: len(w) + len(v))
    weighed.add("a", [("abc", "ab"), ("def", "de"), ("ghi", "gh")])  # 5 characters each
    assert weighed.kept("a") == {"abc": "ab", "def": "de"}


def test_a_scope_adding_after_another_was_used_keeps_its_words_within_the_bound() -> None:
    # Read, then another scope used, then added: the adding scope was let go while the newer
    # one stayed, and the bound was passed until the next add (a review's find: 13 of 10).
    kept: KeptByScope[int] = KeptByScope(size=10, chars=10**9)
    kept.add("a", words("a", 3))
    kept.words("a")
    kept.add("b", words("b", 6))
    kept.add("a", [(f"a-{n}", n) for n in range(3, 8)])
    assert kept.kept("a") == dict(words("a", 8)), "the scope in use keeps its words"
    assert len(kept) == sum(len(kept.kept(s)) for s in kept.scopes()) <= 10
    assert kept.scopes() == ["a"], "the other, least recently used, was let go"


def test_a_word_added_again_is_weighed_once() -> None:
    kept: KeptByScope[int] = KeptByScope(size=100, chars=10)
    for _ in range(10):
        kept.add("a", [("abcd", 1), ("abcd", 1)])
    kept.add("a", [("efgh", 2)])
    assert kept.kept("a") == {"abcd": 1, "efgh": 2}, "8 characters kept, not 44"
