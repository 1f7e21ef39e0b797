"""The translation of caller filters into Milvus expressions: no caller text can change the
expression's structure, the tenant clause is always first and outside the caller's part, and,
run on Milvus Lite, a translated filter keeps exactly what the filter language says."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from retrieval.access import Viewer
from retrieval.backends.milvus import MilvusBackend
from retrieval.backends.milvus_expr import (
    KEY_PATTERN,
    filter_expr,
    scoped_expr,
    string_literal,
)
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.filters import Filter, FilterError, parse_filters
from tests.retrieval.backends_support import milvus_backend, new_tenant
from tests.support.servers import RedisServer

HOSTILE = ['a"b', "x) or (1==1", "k\\", 'k"] or tenant == "x', "k k", "ключ", ""]
_TOKEN = re.compile(
    r'\s+|"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d+)?(?:e[+-]?\d+)?'
    r"|==|>=|<=|>|<|\[|\]|\(|\)|,"
)
WORDS = {"tenant", "public", "true", "false", "and", "or", "array_contains_any", "eq_terms",
         "access_terms", "metadata"}  # fmt: skip
DIGEST = re.compile(r"[0-9a-f]{32}")


def lex(expr: str) -> Iterator[str]:
    """The expression's tokens; fails the test on any character no token explains."""
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        assert match is not None, (
            f"unexpected text at {position}: {expr[position : position + 20]!r}"
        )
        if not match.group().isspace():
            yield match.group()
        position = match.end()


def unquote(literal: str) -> str:
    return re.sub(r"\\(.)", r"\1", literal[1:-1], flags=re.DOTALL)


def test_the_tenant_clause_comes_first_and_the_callers_part_is_parenthesised() -> None:
    caller = filter_expr(parse_filters({"year": {"$gte": 2020}, "lang": "en"}))
    expr = scoped_expr("acme", Viewer("bob", frozenset({"g"})), caller)
    assert expr.startswith('tenant == "acme" and (public == true or array_contains_any(')
    assert expr.endswith(f" and ({caller})")
    assert caller is not None and caller.startswith('(metadata["year"] >= 2020.0) and (')


def test_a_tenant_name_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError):
        scoped_expr('acme" or tenant == "other', None)


@pytest.mark.parametrize("key", HOSTILE)
def test_a_range_on_a_key_that_is_not_an_identifier_is_a_filter_error(key: str) -> None:
    with pytest.raises(FilterError, match="cannot be used"):
        filter_expr(Filter((parse_filters({"k": {"$gt": 1}}).clauses[0].__class__(key, "$gt", 1),)))


@pytest.mark.parametrize("bound", [math.inf, -math.inf, math.nan])
def test_a_bound_that_is_not_finite_is_a_filter_error(bound: float) -> None:
    with pytest.raises(FilterError, match="finite"):
        filter_expr(parse_filters({"year": {"$lt": bound}}))


@pytest.mark.parametrize("bound", ["nul\x00", "line\nbreak", "x" * 1025])
def test_a_string_bound_with_control_characters_or_too_long_is_a_filter_error(bound: str) -> None:
    with pytest.raises(FilterError):
        filter_expr(parse_filters({"date": {"$gt": bound}}))


def test_escaping_doubles_backslashes_and_escapes_quotes() -> None:
    assert string_literal('a"b\\c') == '"a\\"b\\\\c"'


keys = st.one_of(st.sampled_from(["k", "n", "tags", *HOSTILE]), st.text(max_size=8))
scalars = st.one_of(
    st.text(max_size=12),
    st.sampled_from(HOSTILE),
    st.integers(-1000, 1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
conditions = st.one_of(
    scalars,
    st.fixed_dictionaries({"$eq": scalars}),
    st.fixed_dictionaries({"$in": st.lists(scalars, max_size=4)}),
    st.dictionaries(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), scalars, min_size=1),
)
specs = st.dictionaries(keys, conditions, max_size=3)


@settings(max_examples=400, deadline=None)
@given(spec=specs, groups=st.lists(st.sampled_from(HOSTILE), max_size=3))
@example(spec={'k"] or tenant == "x': {"$gt": '") or tenant == "other'}}, groups=[])
@example(spec={"k": {"$lt": '\\" or 1==1 or "'}}, groups=['a"b'])
def test_no_filter_changes_the_structure_of_the_expression(
    spec: dict[str, Any], groups: list[str]
) -> None:
    try:
        filters = parse_filters(spec)
        caller = filter_expr(filters)
    except FilterError:
        return
    expr = scoped_expr("acme", Viewer('u"x', frozenset(g for g in groups if g)), caller)
    allowed_text = {"acme"} | {c.key for c in filters.clauses}
    allowed_text |= {v for c in filters.clauses if isinstance(v := c.operand, str)}
    tokens = list(lex(expr))
    for token in tokens:
        if token.startswith('"'):
            text = unquote(token)
            assert DIGEST.fullmatch(text) or text in allowed_text, token
        elif token[0].isalpha() or token[0] == "_":
            assert token in WORDS, token
    assert tokens[:3] == ["tenant", "==", '"acme"']
    for key in {c.key for c in filters.clauses if c.op not in ("$eq", "$in")}:
        assert KEY_PATTERN.fullmatch(key)
    # Parentheses balance, and the caller's part closes only at the very end.
    depth, closes_at_zero = 0, []
    for index, token in enumerate(tokens):
        depth += {"(": 1, ")": -1}.get(token, 0)
        assert depth >= 0
        if token == ")" and depth == 0:
            closes_at_zero.append(index)
    assert depth == 0
    if caller:
        assert closes_at_zero[-1] == len(tokens) - 1


# -- the same filters run on Milvus Lite, against the filter language's reference -------------

CORPUS_METADATA: list[dict[str, Any]] = [
    {"k": "plain", "n": 1, "tags": ["a", "b"]},
    {"k": '") or tenant == "other', "n": 2.5, "tags": ["x) or (1==1"]},
    {"k": "ünïcödé 𝄞", "n": True},
    {"k": "back\\slash", "n": -3},
    {"k": "nul\x00byte", "n": "1"},
    {"k": 7, "n": 1.0, "tags": ["a"]},
    {"k": False},
    {},
]
corpus_keys = st.sampled_from(["k", "k", "n", "n", "tags", "missing"])
# Mostly values the corpus holds (so most filters keep something), a few it does not.
corpus_scalars = st.sampled_from(
    ["plain", '") or tenant == "other', "ünïcödé 𝄞", "back\\slash", "nul\x00byte", "a", "b",
     "x) or (1==1", "1", "", "z", 1, 2.5, True, -3, 7, 1.0, False, 0, 5, -4.5]
)  # fmt: skip
corpus_conditions = st.one_of(
    corpus_scalars,
    st.fixed_dictionaries({"$in": st.lists(corpus_scalars, max_size=4)}),
    st.dictionaries(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), corpus_scalars, min_size=1),
)


@pytest.fixture(scope="module")
def loaded_milvus(
    tmp_path_factory: pytest.TempPathFactory, embedder: Embedder, redis_server: RedisServer
) -> Iterator[tuple[MilvusBackend, str, str]]:
    backend = milvus_backend(tmp_path_factory.mktemp("milvus-expr"), embedder, redis_server.url)
    ours, other = new_tenant("o"), new_tenant("x")
    docs = [Document(f"d{i}", f"Note number {i}.", "", m) for i, m in enumerate(CORPUS_METADATA)]
    backend.upsert(ours, docs)
    backend.upsert(other, docs)
    yield backend, ours, other
    backend.close()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spec=st.one_of(
        st.dictionaries(corpus_keys, corpus_conditions, min_size=1, max_size=1),
        st.dictionaries(corpus_keys, corpus_conditions, min_size=2, max_size=2),
    )
)
@example(spec={"k": '") or tenant == "other'})
@example(spec={"k": "back\\slash"})
@example(spec={"k": "nul\x00byte"})
@example(spec={"k": "ünïcödé 𝄞"})
@example(spec={"k": False})
@example(spec={"n": True})
@example(spec={"n": {"$in": [1, "1"]}})
@example(spec={"n": {"$lt": 2}})
@example(spec={"k": {"$gte": "a"}})
@example(spec={"tags": {"$in": ["b", "x) or (1==1"]}})
@example(spec={"n": {"$gte": 1}})
@example(spec={"tags": "a", "k": {"$in": [7, "plain"]}})
@example(spec={"k": {"$gt": "a", "$lt": "z"}})
def test_translated_filters_keep_exactly_what_the_filter_language_says_on_milvus(
    loaded_milvus: tuple[MilvusBackend, str, str], spec: dict[str, Any]
) -> None:
    backend, ours, other = loaded_milvus
    try:
        filters = parse_filters(spec)
        filter_expr(filters)
    except FilterError:
        return
    if any(c.key == "tags" and c.op not in ("$eq", "$in") for c in filters.clauses):
        return  # a range on a list-valued field: documented as scalar-only on Milvus
    vector = np.full(backend.embedder.dimension, 1.0, dtype=np.float32)
    vector /= np.linalg.norm(vector)
    result = backend.search(ours, "note", vector, top_k=50, filters=filters)
    expected = {f"d{i}" for i, m in enumerate(CORPUS_METADATA) if filters.matches(m)}
    event(f"searched on Milvus, {'some' if expected else 'no'} documents expected")
    assert {hit.document_id for hit in result.hits} == expected
    assert result.allowed == len(expected)
    assert backend.stats(other).chunks == len(CORPUS_METADATA)
