"""Access lists: which users of a tenant may see a document, enforced inside the search.

A document may carry an `AccessList` (groups and/or users). A document without one is visible to
the whole tenant; one with a list is visible only to a `Viewer` whose user is named in it or who
belongs to one of its groups. The tenant boundary is separate and comes first: each tenant has
its own index, so an access list only ever narrows what one tenant's users see.

The list is copied onto every chunk of its document. `AccessColumns` (built once per snapshot)
gives the rows a viewer may see, and the search runs on the snapshot as if it held only those
(`TenantIndex.visible_to`), before filters, BM25 candidates and the top k: a chunk the viewer
may not see never takes a slot, is never counted (`allowed`, the excluded counts, the spans),
and weighs in no statistic (a word's IDF) that a score could reveal.

Names (groups and users) follow the id rules (no whitespace, control characters or `#`) and may
not hold a comma (the key record stores a key's groups comma-separated); at most
`MAX_NAME_CHARS` characters and `MAX_ENTRIES` groups and `MAX_ENTRIES` users a list, since the
list is stored on every chunk. Matching is exact: no case folding or Unicode normalisation, so a
name spelled differently fails closed (the document stays hidden).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]

MAX_NAME_CHARS = 64
MAX_ENTRIES = 32
NAME = re.compile(r"[^\s#,\x00-\x1f\x7f]{1,64}")


class AccessError(ValueError):
    """An access list or a group name that is not valid."""


def check_name(kind: str, value: object) -> str:
    """`value` if it is a valid group or user name, else AccessError naming `kind`."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        shown = value[:80] if isinstance(value, str) else type(value).__name__
        raise AccessError(
            f"{kind} {shown!r} must be 1-{MAX_NAME_CHARS} characters without whitespace, "
            "control characters, '#' or ','"
        )
    return value


def check_names(kind: str, values: object) -> frozenset[str]:
    """A bounded list of names (duplicates collapse), or AccessError."""
    if not isinstance(values, list | tuple | frozenset | set):
        raise AccessError(f"access {kind}s must be a list of names")
    if len(values) > MAX_ENTRIES:
        raise AccessError(f"access lists name at most {MAX_ENTRIES} {kind}s, not {len(values)}")
    return frozenset(check_name(kind, v) for v in values)


@dataclass(frozen=True)
class AccessList:
    """Who may see a document: members of any of `groups`, and the `users` named."""

    groups: frozenset[str] = frozenset()
    users: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", check_names("group", self.groups))
        object.__setattr__(self, "users", check_names("user", self.users))
        if not self.groups and not self.users:
            # A list naming nobody would hide the document from everyone: almost surely a
            # mistake, and a silent one. Omit the list for a document the whole tenant sees.
            raise AccessError(
                "an access list must name at least one group or user "
                "(leave it out for a document the whole tenant may see)"
            )

    @staticmethod
    def parse(value: object) -> AccessList | None:
        """An access list from JSON (`{"groups": [...], "users": [...]}`); None stays None."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise AccessError('access must be an object: {"groups": [...], "users": [...]}')
        unknown = set(value) - {"groups", "users"}
        if unknown:
            raise AccessError(f"access takes only 'groups' and 'users', not {sorted(unknown)}")
        return AccessList(
            check_names("group", value.get("groups", [])),
            check_names("user", value.get("users", [])),
        )

    def to_json(self) -> dict[str, list[str]]:
        return {"groups": sorted(self.groups), "users": sorted(self.users)}

    def admits(self, viewer: Viewer | None) -> bool:
        """Whether `viewer` may see a document with this list (the reference for the masks)."""
        if viewer is None:
            return False
        return viewer.user in self.users or not self.groups.isdisjoint(viewer.groups)


@dataclass(frozen=True)
class Viewer:
    """The user a search is for, and the groups they belong to. A search without a viewer
    sees only the documents without an access list."""

    user: str
    groups: frozenset[str] = frozenset()


def may_see(access: AccessList | None, viewer: Viewer | None) -> bool:
    """Whether a chunk with `access` is visible to `viewer` (None: visible to the tenant)."""
    return access is None or access.admits(viewer)


class AccessColumns:
    """Row lists per group and per user over an index's chunks, built once per snapshot."""

    def __init__(self, access: Sequence[AccessList | None]) -> None:
        self.size = len(access)
        public = np.ones(self.size, dtype=np.bool_)
        by_group: dict[str, list[int]] = {}
        by_user: dict[str, list[int]] = {}
        for row, entry in enumerate(access):
            if entry is None:
                continue
            public[row] = False
            for group in entry.groups:
                by_group.setdefault(group, []).append(row)
            for user in entry.users:
                by_user.setdefault(user, []).append(row)
        self.restricted = not bool(public.all())
        self._public = public
        self._groups = {g: np.array(rows, dtype=np.int64) for g, rows in by_group.items()}
        self._users = {u: np.array(rows, dtype=np.int64) for u, rows in by_user.items()}

    def nbytes(self) -> int:
        """What these columns hold (their names are the access lists' own strings)."""
        lists = (*self._groups.values(), *self._users.values())
        return (
            sys.getsizeof(self._groups)
            + sys.getsizeof(self._users)
            + sum(map(sys.getsizeof, (self._public, *lists)))
        )

    @property
    def groups(self) -> frozenset[str]:
        """Every group some chunk's list names."""
        return frozenset(self._groups)

    @property
    def user_level(self) -> bool:
        """Whether some chunk's list names a user (so answers may differ per user)."""
        return bool(self._users)

    def mask(self, viewer: Viewer | None) -> BoolArray | None:
        """The rows `viewer` may see; None when every row is visible (no access lists)."""
        if not self.restricted:
            return None
        result = self._public.copy()
        if viewer is None:
            return result
        for rows in self._rows_of(viewer):
            result[rows] = True
        return result

    def _rows_of(self, viewer: Viewer) -> Iterable[npt.NDArray[np.int64]]:
        for group in viewer.groups:
            rows = self._groups.get(group)
            if rows is not None:
                yield rows
        rows = self._users.get(viewer.user)
        if rows is not None:
            yield rows

    def scope(self, viewer: Viewer | None) -> dict[str, Any] | None:
        """What decides `viewer`'s visible rows, and nothing more (for a cache key): None when
        the index has no access lists (everyone sees the same); else the viewer's groups that
        some list names, sorted, and the user only when some list names this user. Two viewers
        with equal scopes see exactly the same rows, so they may share an answer."""
        if not self.restricted:
            return None
        if viewer is None:
            return {"groups": [], "user": None}
        named = viewer.user in self._users
        return {
            "groups": sorted(viewer.groups & self.groups),
            "user": viewer.user if named else None,
        }


def whole_viewer(viewer: Viewer | None) -> dict[str, Any]:
    """A scope naming the viewer itself, user and every group: finer than any
    ``AccessColumns.scope`` (two viewers share it only when they are the same), and of
    another shape, so never equal to one."""
    if viewer is None:
        return {"viewer": None}
    return {"viewer": {"groups": sorted(viewer.groups), "user": viewer.user}}


def access_from_json(value: object) -> AccessList | None:
    """A stored list (a snapshot's column entry) back to an AccessList; None stays None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"a stored access list must be an object, not {type(value).__name__}")
    return AccessList(frozenset(value.get("groups", ())), frozenset(value.get("users", ())))
