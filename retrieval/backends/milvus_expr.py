"""A caller's `Filter` (retrieval.filters) as a Milvus boolean expression, built safely.

Tenancy is a security boundary, so the caller's text is kept out of the expression wherever it
can be: equality and `$in` are matched on digests (`term_digest`) of `key`, type and value,
stored per chunk in an ARRAY field (`EQ_FIELD`) at ingest, so the expression holds only hex
digits; access lists likewise (`ACCESS_FIELD`). Only range bounds reach the expression as values:
numbers checked finite, strings escaped (backslash and double quote) and refused when they hold a
control character. Keys must match `KEY_PATTERN`. The tenant clause is written by the backend
and ANDed outside the caller's part, which is wrapped in parentheses, so no caller text can
widen it.

Digests also give the filter language's semantics for free, where Milvus Lite 2.5's JSON
comparisons do not: a list-valued field matches when it contains the value, `1` matches `1.0`
but never `true`, and a key no chunk has matches nothing (Milvus Lite answers "Unsupported data
type" for a JSON path no row has; see `MilvusBackend`).

Range bounds on a key the collection declares typed (`TypedFields`: a DOUBLE or VARCHAR column
per key, `typed_column`, with a BOOL beside it saying whether the chunk's value is in it,
`present_column`) compare that column, which a Milvus server indexes (INVERTED), instead of the
JSON path, which it scans; both hold the same values (a scalar of the bound's kind), so the
answer is the same. A bound of the other kind falls back to the JSON path.

Pymilvus 2.5's expression templates (`filter_params`) would be the cleaner way to pass values,
but the engine embedded in milvus-lite 2.5.1 does not parse them (`{name}` is a token error).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Literal

from retrieval.access import AccessList, Viewer
from retrieval.documents import Metadata
from retrieval.filters import Clause, Filter, FilterError, Scalar
from retrieval.tenants import check_tenant

KEY_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Document metadata keys may also hold . : - (retrieval.documents); those are matched by
# equality through digests, but a range on them cannot be written as a JSON path safely.
EQ_FIELD = "eq_terms"
ACCESS_FIELD = "access_terms"
PUBLIC_FIELD = "public"
METADATA_FIELD = "metadata"
TENANT_FIELD = "tenant"
MAX_STRING_BOUND = 1024
TypedKind = Literal["number", "string"]
TypedFields = Mapping[str, TypedKind]
NO_TYPED_FIELDS: TypedFields = {}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _digest(*parts: str) -> str:
    joined = "\x00".join(parts).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(joined, digest_size=16).hexdigest()


def _typed(value: Scalar) -> tuple[str, str]:
    """A value's type tag and canonical text: bools apart from numbers, `1` equal to `1.0`."""
    if isinstance(value, bool):
        return "b", "true" if value else "false"
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            raise FilterError("a number is too large (beyond a float's range)") from None
        return "n", repr(number + 0.0)  # -0.0 + 0.0 is 0.0: `0` matches `-0.0`, as in Python
    return "s", value


def term_digest(key: str, value: Scalar) -> str:
    """The digest stored for metadata `key` holding `value` (one per list element)."""
    kind, text = _typed(value)
    return _digest("m", key, kind, text)


def metadata_digests(metadata: Metadata) -> list[str]:
    """Every digest a chunk with `metadata` is stored with (`EQ_FIELD`)."""
    digests: set[str] = set()
    for key, value in metadata.items():
        for item in value if isinstance(value, list) else [value]:
            digests.add(term_digest(key, item))
    return sorted(digests)


def access_digests(access: AccessList | None) -> list[str]:
    """The digests of the groups and users an access list names (`ACCESS_FIELD`)."""
    if access is None:
        return []
    groups = [_digest("g", g) for g in access.groups]
    users = [_digest("u", u) for u in access.users]
    return sorted(groups + users)


def viewer_digests(viewer: Viewer) -> list[str]:
    """The digests that admit `viewer`: its user's and each of its groups'."""
    return sorted([_digest("u", viewer.user), *(_digest("g", g) for g in viewer.groups)])


def _hex_list(digests: Iterable[str]) -> str:
    # Digests are our own hex output: nothing of the caller's is in them.
    return "[" + ", ".join(f'"{d}"' for d in digests) + "]"


def string_literal(value: str) -> str:
    """`value` as a double-quoted Milvus string literal; control characters are refused (the
    engine's unescaping of them is not to be relied on)."""
    if len(value) > MAX_STRING_BOUND:
        raise FilterError(f"a string bound is at most {MAX_STRING_BOUND} characters")
    if _CONTROL.search(value):
        raise FilterError("a string bound may not hold control characters")
    if _SURROGATE.search(value):
        raise FilterError("a string bound may not hold a lone surrogate (it is not UTF-8)")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def number_literal(value: int | float) -> str:
    """A finite number as Milvus reads it (always with a decimal point or exponent, so that an
    int and a float bound compare alike)."""
    try:
        number = float(value)
    except OverflowError:
        raise FilterError("a number bound must be finite") from None
    if not math.isfinite(number):
        raise FilterError("a number bound must be finite")
    return repr(number)


# Milvus allows 64 fields a collection: the backend's own take 16, and a typed key takes two
# (its column and whether a chunk has it).
MAX_TYPED_FIELDS = 24


def check_key(key: str) -> str:
    """`key` if it may be written into an expression as a JSON path, else FilterError."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        shown = key[:64] if isinstance(key, str) else type(key).__name__
        raise FilterError(
            f"filter key {shown!r} cannot be used on this index: keys match {KEY_PATTERN.pattern}"
        )
    return key


def typed_column(key: str) -> str:
    """The typed scalar column of metadata `key` (a key matching `KEY_PATTERN`)."""
    return f"f_{check_key(key)}"


def present_column(key: str) -> str:
    """The BOOL column saying whether a chunk's value of `key` is in `typed_column(key)`."""
    return f"h_{check_key(key)}"


def typed_value(kind: TypedKind, value: object) -> tuple[bool, float | str]:
    """What a chunk whose metadata holds `value` stores in a `kind` column: (True, the value)
    for a scalar of that kind (a number that is not a bool, finite; a string), else (False, a
    filler no range reads: `present_column` is false)."""
    if kind == "number":
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                return False, 0.0
            if math.isfinite(number):
                return True, number
        return False, 0.0
    if isinstance(value, str):
        return True, value
    return False, ""


COLLECTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")


def check_collection(name: str) -> str:
    """`name` if Milvus accepts it as a collection name, else ValueError."""
    if not isinstance(name, str) or not COLLECTION_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a Milvus collection name (it matches {COLLECTION_NAME.pattern})"
        )
    return name


_OPS = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}


def clause_expr(clause: Clause, typed: TypedFields = NO_TYPED_FIELDS) -> str:
    """One clause as an expression (see the module docstring for how values travel); a range
    on a key `typed` declares, with a bound of its kind, reads the typed column."""
    if clause.op in ("$eq", "$in"):
        values = clause.operand if isinstance(clause.operand, tuple) else (clause.operand,)
        if not values:
            # `$in: []` matches nothing; Milvus has no `false` literal, and no chunk holds this
            # digest (its type tag is none of ours).
            return f"array_contains_any({EQ_FIELD}, {_hex_list([_digest('nothing')])})"
        digests = sorted({term_digest(clause.key, v) for v in values})
        return f"array_contains_any({EQ_FIELD}, {_hex_list(digests)})"
    op = _OPS.get(clause.op)
    if op is None:
        raise FilterError(f"filter {clause.key!r}: operator {clause.op!r} is not supported here")
    key = check_key(clause.key)
    bound = clause.operand
    if isinstance(bound, bool | tuple):
        raise FilterError(f"filter {clause.key!r} {clause.op}: a bound is a number or a string")
    literal = string_literal(bound) if isinstance(bound, str) else number_literal(bound)
    if typed.get(key) == ("string" if isinstance(bound, str) else "number"):
        return f"{present_column(key)} == true and {typed_column(key)} {op} {literal}"
    return f'{METADATA_FIELD}["{key}"] {op} {literal}'


def filter_expr(filters: Filter | None, typed: TypedFields = NO_TYPED_FIELDS) -> str | None:
    """The AND of a filter's clauses; None when it allows everything."""
    if filters is None or not filters.clauses:
        return None
    return " and ".join(f"({clause_expr(c, typed)})" for c in filters.clauses)


def access_expr(viewer: Viewer | None) -> str:
    """What `viewer` may see: chunks without an access list, and those naming it."""
    if viewer is None:
        return f"{PUBLIC_FIELD} == true"
    digests = _hex_list(viewer_digests(viewer))
    return f"({PUBLIC_FIELD} == true or array_contains_any({ACCESS_FIELD}, {digests}))"


def scoped_expr(tenant: str, viewer: Viewer | None, *parts: str | None) -> str:
    """The full expression of a search: the tenant (checked against the tenant pattern, so it
    needs no escaping), the viewer's access, then each caller part in parentheses."""
    check_tenant(tenant)
    terms = [f'{TENANT_FIELD} == "{tenant}"', access_expr(viewer)]
    terms += [f"({p})" for p in parts if p]
    return " and ".join(terms)
