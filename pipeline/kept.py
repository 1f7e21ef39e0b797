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
