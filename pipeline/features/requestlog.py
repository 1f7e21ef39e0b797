"""The request log: what the features stage records about each request, and what
``rag features compute`` derives from many of them, as the nightly job would.

A record holds the tenant, the user, the time, a guess of the last user message's language,
the equality filters the request asked for (``key=value``) and the route the client pinned.
Never any prompt text.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.context import ChatParams
from pipeline.errors import InvalidRequest
from pipeline.features.language import guess_language
from pipeline.features.spec import SPECS, FeatureSpec, FeatureValueError, parse_value
from pipeline.features.store import FeatureRow
from pipeline.model.messages import last_user_text
from pipeline.sources.filters import parse_request_filters
from pipeline.store.keys import validate_name, validate_tenant

MAX_FILTERS = 16


def request_record(params: ChatParams) -> dict[str, Any]:
    """The log record of a request, less tenant, user and time (the store adds those)."""
    return {
        "lang": guess_language(last_user_text(params.messages)),
        "filters": equality_filters(params.rag.filters),
        "route": params.rag.route,
    }


def equality_filters(spec: Any) -> list[str]:
    """The ``key=value`` equality clauses of a request's filter (none if it is not valid: the
    request is refused then anyway)."""
    if not isinstance(spec, Mapping):
        return []
    try:
        parse_request_filters(spec)
    except InvalidRequest:
        return []
    found = []
    for key, value in spec.items():
        if isinstance(value, Mapping) and set(value) == {"$eq"}:
            value = value["$eq"]
        if isinstance(value, bool):
            found.append(f"{key}={str(value).lower()}")
        elif isinstance(value, str | int | float):
            found.append(f"{key}={value}")
    return found[:MAX_FILTERS]


def derive_rows(
    records: Iterable[Mapping[str, Any]], specs: Mapping[str, FeatureSpec] = SPECS
) -> tuple[list[FeatureRow], int]:
    """Batch features per (tenant, user) from request-log records: ``request_count``, the
    most frequent ``language`` guess and the most used filter (``top_filter``); a tie goes to
    the most recent. Returns the rows and the number of records skipped as malformed."""
    grouped: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    skipped = 0
    for record in records:
        tenant, user = record.get("tenant"), record.get("user")
        # Names only: a null or numeric tenant is malformed, not a tenant called "None".
        if not (isinstance(tenant, str) and isinstance(user, str)):
            skipped += 1
            continue
        try:
            validate_tenant(tenant)
            validate_name("user", user)
        except ValueError:
            skipped += 1
            continue
        grouped[(tenant, user)].append(record)
    rows = []
    for (tenant, user), items in sorted(grouped.items()):
        items = sorted(items, key=lambda r: float(r.get("ts") or 0.0))
        values: dict[str, Any] = {"request_count": len(items)}
        language = _most_common(r.get("lang") for r in items)
        top_filter = _most_common(f for r in items for f in (r.get("filters") or []))
        for name, value in (("language", language), ("top_filter", top_filter)):
            if value is not None and name in specs:
                try:
                    values[name] = parse_value(specs[name], value)
                except FeatureValueError:
                    continue
        rows.append(FeatureRow(tenant, user, values))
    return rows, skipped


def _most_common(values: Iterable[Any]) -> Any:
    """The most frequent value (ignoring empty ones); on a tie, the one seen last."""
    counts: Counter[Any] = Counter()
    last: dict[Any, int] = {}
    for position, value in enumerate(values):
        if value in (None, "") or not isinstance(value, str):
            continue
        counts[value] += 1
        last[value] = position
    if not counts:
        return None
    return max(counts, key=lambda v: (counts[v], last[v]))
