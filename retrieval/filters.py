"""Metadata filters: a small Mongo-like syntax, parsed once and evaluated as a mask over chunks.

Syntax (a JSON object; every key must match, i.e. several keys are AND-ed)::

    {"lang": "en"}                        equality; on a list-valued field: the list contains it
    {"lang": {"$eq": "en"}}               the same, spelled out
    {"lang": {"$in": ["en", "de"]}}       equal to one of (list field: contains one of)
    {"year": {"$gte": 2020, "$lt": 2024}} range; bounds are numbers, or strings (ISO dates
                                          compare correctly as strings); several operators AND
    {"year": 2021, "lang": "en"}          both

Values are strings, numbers or bools; `1` matches `1.0` but never `true`. A key that no document
has matches nothing (an empty result, not an error). Anything else (an unknown operator such as
`$ne` or `$or`, a list where a value belongs, a nested object) raises `FilterError` naming the
offending key and operator.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]
Scalar: TypeAlias = str | int | float | bool
_EqKey: TypeAlias = tuple[str, str | float | bool]

_RANGE_OPS = ("$gt", "$gte", "$lt", "$lte")
OPERATORS = ("$eq", "$in", *_RANGE_OPS)


class FilterError(ValueError):
    """A filter specification that is not valid syntax."""


_KEY_BYTES = sys.getsizeof(("s", ""))  # an `_eq_key` tuple


def _eq_key(value: Scalar) -> _EqKey:
    # bool is a subclass of int: test it first so that True never equals 1.
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", float(value))
    return ("s", value)


@dataclass(frozen=True)
class Clause:
    """One test on one metadata key: `op` is "$eq", "$in" or a range operator."""

    key: str
    op: str
    operand: Scalar | tuple[Scalar, ...]

    def matches(self, value: object) -> bool:
        """Whether a chunk's metadata value (None when absent) passes this clause."""
        raw = value if isinstance(value, list) else [value]
        values: list[Scalar] = [v for v in raw if isinstance(v, str | int | float | bool)]
        operand = self.operand
        if isinstance(operand, tuple):
            wanted = {_eq_key(v) for v in operand}
            return any(_eq_key(v) in wanted for v in values)
        if self.op == "$eq":
            return any(_eq_key(v) == _eq_key(operand) for v in values)
        return any(_in_range(self.op, v, operand) for v in values)


def _in_range(op: str, value: Scalar, bound: Scalar) -> bool:
    if isinstance(bound, str) != isinstance(value, str) or isinstance(value, bool):
        return False
    v: Any = value
    if op == "$gt":
        return bool(v > bound)
    if op == "$gte":
        return bool(v >= bound)
    if op == "$lt":
        return bool(v < bound)
    return bool(v <= bound)


@dataclass(frozen=True)
class Filter:
    """A parsed filter: the AND of its clauses; no clauses matches everything."""

    clauses: tuple[Clause, ...] = ()

    def matches(self, metadata: Mapping[str, object]) -> bool:
        """Whether one chunk's metadata passes (the reference the masks are tested against)."""
        return all(c.matches(metadata.get(c.key)) for c in self.clauses)

    def mask(self, columns: MetadataColumns) -> BoolArray | None:
        """Allowed-chunk mask over an index's chunks; None when the filter allows all."""
        if not self.clauses:
            return None
        result = np.ones(columns.size, dtype=np.bool_)
        for clause in self.clauses:
            result &= columns.mask(clause)
        return result


def _check_scalar(key: str, op: str, value: object) -> Scalar:
    if isinstance(value, str | bool | int | float):
        return value
    raise FilterError(
        f"filter {key!r} {op}: expected a string, number or bool, got {type(value).__name__}"
    )


def parse_filters(spec: Mapping[str, Any] | None) -> Filter:
    """Parse a filter object (see the module docstring); None or {} allows everything."""
    if spec is None:
        return Filter()
    if not isinstance(spec, Mapping):
        raise FilterError("filters must be an object of key -> condition")
    clauses: list[Clause] = []
    for key, condition in spec.items():
        if not isinstance(key, str) or not key:
            raise FilterError(f"filter key {key!r} must be a non-empty string")
        if key.startswith("$"):
            raise FilterError(f"unsupported top-level operator {key!r}; several keys are AND-ed")
        if not isinstance(condition, Mapping):
            if isinstance(condition, list):
                raise FilterError(f"filter {key!r}: a list needs an operator: {{'$in': [...]}}")
            clauses.append(Clause(key, "$eq", _check_scalar(key, "$eq", condition)))
            continue
        if not condition:
            raise FilterError(f"filter {key!r}: empty condition")
        for op, operand in condition.items():
            if op not in OPERATORS:
                raise FilterError(
                    f"filter {key!r}: unknown operator {op!r}; use one of {', '.join(OPERATORS)}"
                )
            if op == "$in":
                if not isinstance(operand, list):
                    raise FilterError(f"filter {key!r} $in: expected a list")
                clauses.append(Clause(key, op, tuple(_check_scalar(key, op, v) for v in operand)))
            elif op == "$eq":
                clauses.append(Clause(key, op, _check_scalar(key, op, operand)))
            else:
                bound = _check_scalar(key, op, operand)
                if isinstance(bound, bool):
                    raise FilterError(f"filter {key!r} {op}: a bound must be a number or string")
                clauses.append(Clause(key, op, bound))
    return Filter(tuple(clauses))


class MetadataColumns:
    """Per-key inverted lists over an index's chunks, built once per snapshot.

    Equality and `$in` are unions of precomputed row lists; ranges are a binary search in the
    key's sorted numbers (or strings).
    """

    def __init__(self, metadata: Sequence[Mapping[str, object]]) -> None:
        self.size = len(metadata)
        eq: dict[str, dict[_EqKey, list[int]]] = {}
        ordered: dict[tuple[str, str], tuple[list[Any], list[int]]] = {}
        for row, meta in enumerate(metadata):
            for key, value in meta.items():
                values = value if isinstance(value, list) else [value]
                for v in values:
                    if not isinstance(v, str | int | float | bool):
                        continue
                    eq.setdefault(key, {}).setdefault(_eq_key(v), []).append(row)
                    if not isinstance(v, bool):
                        kind = "s" if isinstance(v, str) else "n"
                        vals, rows = ordered.setdefault((key, kind), ([], []))
                        vals.append(v)
                        rows.append(row)
        self._eq = {
            key: {v: np.array(rows, dtype=np.int64) for v, rows in by_value.items()}
            for key, by_value in eq.items()
        }
        self._ordered: dict[tuple[str, str], tuple[npt.NDArray[Any], npt.NDArray[np.int64]]] = {}
        for (key, kind), (vals, rows) in ordered.items():
            arr = np.array(vals, dtype=np.float64 if kind == "n" else object)
            order = np.argsort(arr, kind="stable")
            self._ordered[key, kind] = (arr[order], np.array(rows, dtype=np.int64)[order])

    def nbytes(self) -> int:
        """What these columns hold: the lists' dicts, keys and row arrays, and the sorted
        values' arrays. Their strings are the metadata's own, and so is a number's float
        unless it was made from an int (a whole number: counted, a float's own included)."""
        total = sys.getsizeof(self._eq) + sys.getsizeof(self._ordered)
        for by_value in self._eq.values():
            total += sys.getsizeof(by_value)
            for (_kind, value), rows in by_value.items():
                total += _KEY_BYTES + sys.getsizeof(rows)
                if isinstance(value, float) and value.is_integer():
                    total += sys.getsizeof(value)
        for key, found in self._ordered.items():
            total += sys.getsizeof(key) + sys.getsizeof(found) + sum(map(sys.getsizeof, found))
        return total

    def mask(self, clause: Clause) -> BoolArray:
        """Rows that pass one clause."""
        result = np.zeros(self.size, dtype=np.bool_)
        if clause.op in ("$eq", "$in"):
            by_value = self._eq.get(clause.key, {})
            operands = clause.operand if isinstance(clause.operand, tuple) else (clause.operand,)
            for operand in operands:
                rows = by_value.get(_eq_key(operand))
                if rows is not None:
                    result[rows] = True
            return result
        bound: Any = clause.operand
        kind = "s" if isinstance(bound, str) else "n"
        found = self._ordered.get((clause.key, kind))
        if found is None:
            return result
        values, rows = found
        side: Literal["left", "right"] = "left" if clause.op in ("$gte", "$lt") else "right"
        cut = int(np.searchsorted(values, bound, side=side))
        result[rows[cut:] if clause.op in ("$gt", "$gte") else rows[:cut]] = True
        return result
