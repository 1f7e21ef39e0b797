"""Hypothesis strategies shared by the property tests.

`json_values` draws arbitrary JSON-like values: None, booleans, integers, floats and text at the
leaves, nested in lists and string-keyed dictionaries. Each test picks its own bounds; a bound
left at None is Hypothesis's default (no bound), so the strategy is exactly what the same
`st.recursive(...)` written out in the test would be, and draws the same examples.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(
    *,
    max_leaves: int,
    text_size: int | None = None,
    key_size: int | None = None,
    list_size: int | None = None,
    dict_size: int | None = None,
    allow_nan: bool | None = None,
    allow_infinity: bool | None = None,
) -> st.SearchStrategy[Any]:
    """JSON-like values of at most `max_leaves` leaves: strings of up to `text_size` characters,
    lists of up to `list_size` items, dictionaries of up to `dict_size` entries whose keys have
    up to `key_size` characters; `allow_nan`/`allow_infinity` as `st.floats` takes them."""
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=allow_nan, allow_infinity=allow_infinity)
        | st.text(max_size=text_size),
        lambda children: (
            st.lists(children, max_size=list_size)
            | st.dictionaries(st.text(max_size=key_size), children, max_size=dict_size)
        ),
        max_leaves=max_leaves,
    )
