"""Where each group of the service's Redis keys lives, on one Redis and on a Redis Cluster.

The stores build their own names (with ``KeyValueStore.tag`` and ``slot``: a hash tag on a
cluster, nothing or the bare text on one Redis). This table says the same for what must read a
name rather than build one: moving a deployment between one Redis and a cluster
(``rag redis copy``, app.cli.redis_copy). ``tests/app/test_redis_copy.py`` writes through
every store on one Redis, checks that each name it finds is in this table, and reads it back
through the stores on a cluster after a copy, so the table and the stores cannot drift apart
unseen.

A template is the name after the key prefix: literal text, and ``<part>`` for a part (a
tenant, a user, an hour, a ``<rest>`` of any text without braces, or ``<any>`` text). Both
forms of a group hold the same parts, so a name read in one form is written in the other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.store.keys import TENANT_PATTERN

# A part's text. Tenants and users are what validate_name lets in: never a colon or a brace,
# so a name splits into its parts one way only.
_NAME = TENANT_PATTERN.pattern.removeprefix("^").removesuffix("$")
_PARTS = {
    "tenant": _NAME,
    "user": _NAME,
    "hour": r"[0-9]{1,12}",
    "rest": r"[^{}]+",
    "any": r"(?s:.+)",
}
_PLACEHOLDER = re.compile(r"<([a-z]+)>")


def _compile(template: str) -> re.Pattern[str]:
    pattern, at = "", 0
    for found in _PLACEHOLDER.finditer(template):
        pattern += re.escape(template[at : found.start()])
        pattern += f"(?P<{found.group(1)}>{_PARTS[found.group(1)]})"
        at = found.end()
    return re.compile(pattern + re.escape(template[at:]))


@dataclass(frozen=True)
class Group:
    """One group of keys: its name in each form, and whether a copy carries it (False: the
    service rebuilds it by itself, and its values name other keys of the old form)."""

    name: str
    single: str
    cluster: str
    copied: bool = True
    _patterns: tuple[re.Pattern[str], re.Pattern[str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        single, cluster = _compile(self.single), _compile(self.cluster)
        if single.groupindex.keys() != cluster.groupindex.keys():
            raise ValueError(f"{self.name}: both forms must hold the same parts")
        object.__setattr__(self, "_patterns", (single, cluster))

    def parts(self, name: str, *, cluster: bool) -> dict[str, str] | None:
        """The parts of ``name`` (after the prefix) in the given form; None when it is not
        one of this group's."""
        found = self._patterns[cluster].fullmatch(name)
        return found.groupdict() if found else None

    def build(self, parts: dict[str, str], *, cluster: bool) -> str:
        template = self.cluster if cluster else self.single
        return _PLACEHOLDER.sub(lambda found: parts[found.group(1)], template)


GROUPS: tuple[Group, ...] = (
    # API keys: records, id and tenant indexes (pipeline.store.keys.ApiKeyStore).
    Group("API keys", "apikey:<rest>", "apikey:{keys}:<rest>"),
    # The online feature store (pipeline.features.store.FeatureStore).
    Group("features", "features:<tenant>:<user>", "features:{<tenant>:<user>}"),
    Group(
        "features' hourly counts",
        "features-rt:<tenant>:<user>:<hour>",
        "features-rt:{<tenant>:<user>}:<hour>",
    ),
    Group("request logs", "features-log:<tenant>", "features-log:<tenant>"),
    Group("request log (before per-tenant logs)", "features-log", "features-log"),
    # A tenant's limits as `rag keys tenant-limits` set them (pipeline.store.limits).
    Group("tenant limits", "limits:tenant:<tenant>", "limits:tenant:{<tenant>}"),
    Group("webhook secrets", "webhook-secret:<tenant>", "webhook-secret:<tenant>"),
    Group("index versions", "index-version:<tenant>", "index-version:<tenant>"),
    # retrieval.backends: run-time backend records, and a move's fence and write leases.
    Group("backend records", "retrieval-backend", "{backends}:retrieval-backend"),
    Group("backend moves", "backend-move:<tenant>", "{backends}:backend-move:<tenant>"),
    Group("backend writes", "backend-writes:<tenant>", "{backends}:backend-writes:<tenant>"),
    # Jobs carry their own tag on one Redis too (pipeline.jobs.queue): same names in both.
    Group("jobs", "{jobs}:<any>", "{jobs}:<any>"),
    # Rebuilt by the service: answers are cached again, and the cache's copy sets hold the
    # names of its fast-path aliases (old-form names after a copy); flights and rate-limit
    # windows last seconds to minutes.
    Group("cache", "cache:<any>", "cache:<any>", copied=False),
    # The index versions a delete erased: no answer made from them is cached (ResponseCache).
    Group("erased index versions", "cache-erased:<tenant>", "cache-erased:{<tenant>}"),
    # Each tenant's cached answers, named for an erasure to find (rebuilt as answers are).
    Group(
        "cached answers by tenant",
        "cache-entries:<tenant>",
        "cache-entries:{<tenant>}",
        copied=False,
    ),
    Group(
        "cached answers being erased",
        "cache-erasing:<tenant>",
        "cache-erasing:{<tenant>}",
        copied=False,
    ),
    Group("cache aliases", "cache-alias:<any>", "cache-alias:<any>", copied=False),
    Group("coalesced flights", "flight:<any>", "flight:<any>", copied=False),
    Group("rate-limit windows", "ratelimit:<any>", "ratelimit:<any>", copied=False),
)


def classify(name: str, *, cluster: bool) -> tuple[Group, dict[str, str]] | None:
    """The group of ``name`` (after the prefix) in the given form, and its parts; None when the
    service writes no such name. The first group that matches decides (more specific first)."""
    for group in GROUPS:
        parts = group.parts(name, cluster=cluster)
        if parts is not None:
            return group, parts
    return None
