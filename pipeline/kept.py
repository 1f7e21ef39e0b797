"""Values kept for texts seen again (a guard's verdict, a passage's analysis): the least
recently used go first, and what is kept is bounded twice, by entries and by weight.

The weight is what a value costs to keep, in a unit its owner picks (a PII scan's findings, a
passage's characters). Counting entries alone bounds nothing when one entry can be made large:
4,096 texts packed with e-mail addresses kept 0.35 GB of findings (BENCHMARKS.md, "What a
replica's memos keep"). A value that weighs more than the whole budget is not kept at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Kept(Generic[K, V]):
    """At most ``size`` values and ``budget`` of their weights (None: no bound on weight).
    Safe to use from the event loop and worker threads at once."""

    def __init__(self, size: int, *, budget: int | None = None) -> None:
        self.size = size
        self.budget = budget
        self.weight = 0  # the weights of what is kept, summed
        self._values: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: K) -> tuple[V] | None:
        """``(value,)`` when kept (it is then the most recently used), else None."""
        with self._lock:
            found = self._values.get(key)
            if found is None:
                return None
            self._values.move_to_end(key)
            return (found[0],)

    def remembered(
        self, key: K, make: Callable[[], V], weight: Callable[[V], int] | None = None
    ) -> V:
        """The value kept for ``key``, else ``make()``'s, kept by its ``weight``."""
        found = self.get(key)
        if found is not None:
            return found[0]
        value = make()
        self.put(key, value, weight(value) if weight else 0)
        return value

    def put(self, key: K, value: V, weight: int = 0) -> None:
        if self.budget is not None and weight > self.budget:
            return
        with self._lock:
            if key in self._values:  # put meanwhile by another thread
                return
            self._values[key] = (value, weight)
            self.weight += weight
            while len(self._values) > self.size or (
                self.budget is not None and self.weight > self.budget
            ):
                _, (_, dropped) = self._values.popitem(last=False)
                self.weight -= dropped

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.weight = 0


class KeptByScope(Generic[V]):
    """One dict of words (a word's stem, a piece's token count) for each memo scope
    (``pipeline.model.salt.MemoScope``), bounded in all by ``size`` entries and ``chars``
    characters (each entry's ``weight``: its word's, and its value's where that is text).
    Past the bound the least recently used scopes' dicts are let go, so the scopes in use keep
    theirs (clearing all at once, ten busy tenants of a SciFact's vocabulary each found none of
    their words kept: a review's find); a scope that alone holds the bound starts a new dict.

    A caller reads words from ``words(scope)`` without a lock (a dict let go is never emptied:
    it stays whole for whoever holds it) and adds those it worked out with ``add``. Safe from
    the event loop and worker threads at once."""

    def __init__(
        self,
        size: int,
        chars: int,
        weight: Callable[[str, V], int] = lambda word, _: len(word),
        scopes: int = 10_000,
    ) -> None:
        self.size = size
        self.chars = chars
        self.weight = weight
        self.most_scopes = scopes  # and at most this many dicts, empty ones too
        self._scopes: OrderedDict[str | None, tuple[dict[str, V], list[int]]] = OrderedDict()
        self._count = 0  # entries, all scopes
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def words(self, scope: str | None) -> dict[str, V]:
        """The scope's dict (a new one when it has none), now its most recently used."""
        with self._lock:
            return self._entry(scope)[0]

    def add(self, scope: str | None, items: list[tuple[str, V]]) -> None:
        """Keep ``items`` for ``scope`` (as many as the bound holds), the scope now its most
        recently used: other scopes are let go first (another may have been used since this
        one was read; a review's find: the adding scope was let go while newer ones stayed,
        and the bound was passed)."""
        # Each word once (its last value), with its weight.
        weighed = [(word, value, self.weight(word, value)) for word, value in dict(items).items()]
        with self._lock:
            kept, counts = self._entry(scope)
            fresh = [item for item in weighed if item[0] not in kept]
            need, chars = len(fresh), sum(n for *_, n in fresh)
            while self._count + need > self.size or self._chars + chars > self.chars:
                oldest = next(iter(self._scopes))
                if oldest == scope:  # the scope alone holds the bound: it starts anew
                    self._let_go(scope)
                    kept, counts = self._entry(scope)
                    fresh = weighed
                    room, fit = self.chars, 0
                    for *_, n in fresh[: self.size]:
                        if n > room:
                            break
                        room, fit = room - n, fit + 1
                    fresh = fresh[:fit]
                    need, chars = len(fresh), sum(n for *_, n in fresh)
                    break
                self._let_go(oldest)
            for word, value, _ in fresh:
                kept[word] = value
            counts[0] += need
            counts[1] += chars
            self._count += need
            self._chars += chars

    def _entry(self, scope: str | None) -> tuple[dict[str, V], list[int]]:
        found = self._scopes.get(scope)
        if found is None:
            while len(self._scopes) >= self.most_scopes:
                self._let_go(next(iter(self._scopes)))
            found = self._scopes[scope] = ({}, [0, 0])
        else:
            self._scopes.move_to_end(scope)
        return found

    def _let_go(self, scope: str | None) -> None:
        found = self._scopes.pop(scope, None)
        if found is None:
            return
        _, (count, chars) = found
        self._count -= count
        self._chars -= chars

    def kept(self, scope: str | None) -> dict[str, V]:
        """What is kept for ``scope`` (a copy; nothing is made for a scope that has none)."""
        with self._lock:
            found = self._scopes.get(scope)
            return dict(found[0]) if found is not None else {}

    def scopes(self) -> list[str | None]:
        with self._lock:
            return list(self._scopes)

    def clear(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._count = self._chars = 0
