"""Right-sized model routing: one route per request, from what the request asks and who asks.

Decisions, cheapest first, each with a short reason code:

- ``pinned``: the request named a route (``rag.route``, or ``model`` is a route's name);
  ``only_candidate``: its ``model`` is served by one route only.
- ``feature:tier=free``: a user whose ``tier`` feature is a capped tier goes to the small
  route (a pinned route still wins). A tier that fell back to its default caps nobody: a
  feature-store outage must not downgrade paying users.
- ``rule:<name>``: the cheap rules of ``pipeline.routing.rules`` (code, step by step,
  comparisons, long prompts, several questions -> large; classification, translation,
  extraction, short factual questions -> small).
- ``centroid:<intent> (0.61 vs 0.47)``: what the rules leave open goes to the intent whose
  labelled example prompts (``pipeline/routing/data/route_examples.jsonl``) are nearest to the query
  embedding: its best cosine similarity, then the other intent's.
- ``length:short`` / ``length:medium``: without an embedder (retrieval off), open cases go by
  length alone.

Intents map to route names in the settings (``small`` and ``large`` by default).
``ROUTER_VERSION`` is part of the cache key: bump it when the rules change (the examples and
the thresholds are hashed into ``Router.version`` by themselves).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from pipeline.context import ChatParams, Features, RouteChoice
from pipeline.model.messages import last_user_text
from pipeline.model.routes import Route, RouteTable
from pipeline.routing.rules import Intent, Thresholds, classify, word_count
from retrieval.vectors import FloatArray

ROUTER_VERSION = "1"

EmbedMany = Callable[[list[str]], FloatArray]

# Embedding model (the embed method's object) -> examples digest -> centroids.
_MEMO: weakref.WeakKeyDictionary[Any, dict[str, dict[Intent, FloatArray]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class Example:
    """A labelled prompt: the centroids are made of these."""

    text: str
    intent: Intent


def load_examples(text: str | None = None) -> list[Example]:
    """The shipped example prompts (or those in ``text``, JSON lines)."""
    if text is None:
        text = (
            resources.files("pipeline.routing")
            .joinpath("data/route_examples.jsonl")
            .read_text("utf-8")
        )
    examples = []
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            if row["intent"] not in ("small", "large"):
                raise ValueError(f"unknown intent {row['intent']!r} in the route examples")
            examples.append(Example(row["text"], row["intent"]))
    return examples


class Centroids:
    """One unit vector per intent, the normalised mean of its examples' embeddings.

    Construction is cheap; ``warm_up`` embeds the examples (once, thread-safe)."""

    def __init__(self, examples: Sequence[Example], embed: EmbedMany) -> None:
        self.examples = list(examples)
        self.embed = embed
        self._vectors: dict[Intent, FloatArray] | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._vectors is not None

    @property
    def digest(self) -> str:
        material = json.dumps([(e.text, e.intent) for e in self.examples]).encode()
        return hashlib.sha256(material).hexdigest()[:12]

    def warm_up(self) -> None:
        with self._lock:
            if self._vectors is not None:
                return
            # Apps that share one embedding model (workers, tests) embed the examples once.
            owner = getattr(self.embed, "__self__", self.embed)
            try:
                known = _MEMO.setdefault(owner, {})
            except TypeError:  # not weakly referable: no sharing
                known = {}
            if self.digest not in known:
                known[self.digest] = self._compute()
            self._vectors = known[self.digest]

    def _compute(self) -> dict[Intent, FloatArray]:
        matrix = self.embed([e.text for e in self.examples])
        vectors: dict[Intent, FloatArray] = {}
        for intent in ("small", "large"):
            rows = [i for i, e in enumerate(self.examples) if e.intent == intent]
            if not rows:
                raise ValueError(f"no example prompts for the {intent!r} intent")
            mean = matrix[rows].mean(axis=0)
            vectors[intent] = (mean / np.linalg.norm(mean)).astype(np.float32)
        return vectors

    def scores(self, vector: FloatArray) -> dict[Intent, float]:
        """Cosine similarity of a unit query vector to each intent's centroid."""
        if self._vectors is None:
            self.warm_up()
        assert self._vectors is not None
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        return {intent: float(centroid @ query) for intent, centroid in self._vectors.items()}


@dataclass(frozen=True)
class RouterPolicy:
    """What the router is told by the settings."""

    intents: Mapping[str, str] = field(default_factory=lambda: {"small": "small", "large": "large"})
    thresholds: Thresholds = field(default_factory=Thresholds)
    capped_tiers: frozenset[str] = frozenset({"free"})
    tier_feature: str = "tier"

    def describe(self) -> dict[str, Any]:
        return {
            "intents": dict(sorted(self.intents.items())),
            "thresholds": asdict(self.thresholds),
            "capped_tiers": sorted(self.capped_tiers),
            "tier_feature": self.tier_feature,
        }


class Router:
    """Chooses a route per request among ``RouteTable.candidates``.

    ``decide`` settles what needs no embedding (and everything, without centroids); it
    returns None when the rules leave the request open, and ``by_vector`` settles that from
    the query embedding."""

    def __init__(
        self,
        routes: RouteTable,
        policy: RouterPolicy | None = None,
        centroids: Centroids | None = None,
    ) -> None:
        self.routes = routes
        self.policy = policy or RouterPolicy()
        self.centroids = centroids

    @property
    def version(self) -> str:
        """``ROUTER_VERSION`` plus a digest of the thresholds, mapping and examples: whatever
        changes a decision changes the cache key."""
        material = {
            "policy": self.policy.describe(),
            "examples": self.centroids.digest if self.centroids is not None else None,
        }
        digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        return f"{ROUTER_VERSION}-{digest[:8]}"

    def decide(self, params: ChatParams, features: Features) -> RouteChoice | None:
        candidates = self.routes.candidates(params.model, params.rag.route)
        if len(candidates) == 1:
            route = candidates[0]
            pinned = params.rag.route is not None or params.model == route.name
            return _choice(route, "pinned" if pinned else "only_candidate")
        tier = features.get(self.policy.tier_feature)
        if (
            isinstance(tier, str)
            and tier in self.policy.capped_tiers
            and self.policy.tier_feature not in features.defaulted
        ):
            return self._pick(candidates, "small", f"feature:tier={tier}")
        text = last_user_text(params.messages)
        hit = classify(text, self.policy.thresholds)
        if hit is not None:
            return self._pick(candidates, hit.intent, f"rule:{hit.rule}")
        if self.centroids is None:
            if word_count(text) <= self.policy.thresholds.short_words:
                return self._pick(candidates, "small", "length:short")
            return self._pick(candidates, "large", "length:medium")
        return None

    def by_vector(self, params: ChatParams, vector: FloatArray) -> RouteChoice:
        """The open case, by the nearest centroid to the query's embedding."""
        if self.centroids is None:
            raise RuntimeError("this router has no centroids (it routes by rules only)")
        candidates = self.routes.candidates(params.model, params.rag.route)
        scores = self.centroids.scores(vector)
        best: Intent = "large" if scores["large"] > scores["small"] else "small"
        other: Intent = "small" if best == "large" else "large"
        reason = f"centroid:{best} ({scores[best]:.2f} vs {scores[other]:.2f})"
        return self._pick(candidates, best, reason)

    def choose(
        self, params: ChatParams, features: Features, vector: FloatArray | None = None
    ) -> RouteChoice:
        """One decision in one call (for code that has the vector at hand, or no centroids)."""
        choice = self.decide(params, features)
        if choice is not None:
            return choice
        if vector is None:
            raise ValueError("the rules left this request open: the query vector is needed")
        return self.by_vector(params, vector)

    def _pick(self, candidates: Sequence[Route], intent: Intent, reason: str) -> RouteChoice:
        wanted = self.policy.intents.get(intent, intent)
        for route in candidates:
            if route.name == wanted:
                return _choice(route, reason)
        # The intent's route is not among those the request may take: the default one if it
        # may, else the first, and the reason says so.
        fallback = next((r for r in candidates if r.name == self.routes.default), candidates[0])
        return _choice(fallback, f"{reason};no_route={wanted}")


def _choice(route: Route, reason: str) -> RouteChoice:
    return RouteChoice(route.name, route.model, reason)
