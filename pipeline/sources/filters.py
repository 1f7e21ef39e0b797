"""A request's metadata filter, parsed at the boundary: the request path's searches and the
request log (``rag features compute``) read it alike. Apart from ``search`` so that reading a
filter loads only the filter grammar, not the index code (FAISS, the embedding model)."""

from __future__ import annotations

from typing import Any

from pipeline.errors import InvalidRequest
from retrieval.filters import Filter, FilterError, parse_filters


def parse_request_filters(spec: Any, param: str = "rag.filters") -> Filter | None:
    """The request's filter, or a 400 naming what is wrong with it and the request's field
    that holds it (``rag.filters`` on chat, ``filters`` on /v1/retrieve)."""
    if spec is None:
        return None
    try:
        return parse_filters(spec)
    except FilterError as exc:
        raise InvalidRequest(f"Invalid {param}: {exc}", param=param) from exc
