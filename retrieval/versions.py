"""The versioned directory of one tenant: naming versions, publishing one atomically, and
removing what is no longer needed. Callers that change the directory hold the tenant's lock."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from retrieval.snapshots import fsync_dir

NO_VERSION = "0"
POINTER = "CURRENT"
_VERSION_DIR = re.compile(r"(\d{8})-[0-9a-f]{6}")


def read_pointer(directory: Path) -> str:
    """The published version in `directory` (NO_VERSION when there is none). Never raises for
    what the file holds: a pointer that names no version (damaged, edited) is refused where a
    snapshot is loaded (`is_version`), never followed out of the tenant's directory."""
    try:
        return (directory / POINTER).read_bytes().decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return NO_VERSION
    except IsADirectoryError:
        return f"<{POINTER} is not a file>"  # names no version: refused where it is loaded


def is_version(name: str) -> bool:
    """Whether `name` is a version's directory name (what a pointer must hold)."""
    return _VERSION_DIR.fullmatch(name) is not None


def next_version(directory: Path) -> str:
    """A new version name: a sequence number above every version on disk, and a random suffix
    (so a tenant deleted and re-created never reuses a name a cache may still hold)."""
    numbers = [
        int(m.group(1)) for p in directory.iterdir() if (m := _VERSION_DIR.fullmatch(p.name))
    ]
    return f"{max(numbers, default=0) + 1:08d}-{secrets.token_hex(3)}"


def temp_dir(directory: Path, version: str) -> Path:
    """Where `version` is written before it is published."""
    return directory / f".tmp-{version}"


def publish(directory: Path, version: str) -> None:
    """Move the written temp dir of `version` into place, then point CURRENT at it atomically."""
    temp_dir(directory, version).rename(directory / version)
    fsync_dir(directory)
    point(directory, version)


def point(directory: Path, version: str) -> None:
    """Point CURRENT at `version`, a directory already in place, atomically and durably."""
    pointer = directory / f".{POINTER}-{version}"
    with pointer.open("w", encoding="ascii") as f:
        f.write(version)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, directory / POINTER)
    fsync_dir(directory)


def clean_leftovers(directory: Path) -> None:
    """Remove what crashed writers left: temp dirs and pointer files."""
    for path in directory.iterdir():
        if path.name.startswith((".tmp-", f".{POINTER}-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def prune(directory: Path, current: str, previous: str | None) -> bool:
    """Keep only the current and the previous version (and drop any never published); whether
    any was removed."""
    removed = False
    for path in directory.iterdir():
        if _VERSION_DIR.fullmatch(path.name) and path.name not in (current, previous):
            shutil.rmtree(path, ignore_errors=True)
            removed = True
    return removed
