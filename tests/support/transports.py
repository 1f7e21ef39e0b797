"""Where a leaked socket came from: every asyncio socket transport made during the tests
remembers the test and the code that made it, and says so in its ``repr``.

A transport that is collected unclosed warns (``ResourceWarning: unclosed transport ...``), and
the suite's ``filterwarnings = error`` makes that a failure, but of whichever test is running
when the garbage collector gets to it, often long after the test that dropped it: the warning
alone names neither. With this, its text does ("made in tests/...::test_x by client.py:191
stream_chat < ..."). About 1 µs per transport; registered by ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from asyncio import selector_events
from typing import Any

import pytest

_current = ["(outside a test)"]
_SKIPPED = (
    "/asyncio/",
    "/anyio/",
    "/httpcore/",
    "/httpx/",
    "/uvicorn/",
    "/redis/",
    "/_pytest/",
    "/pluggy/",
    "/pytest_asyncio/",
)
_FRAMES = 4


def _origin() -> str:
    """The innermost few frames of the code that asked for the connection, libraries skipped."""
    frame = sys._getframe(2)
    found: list[str] = []
    while frame is not None and len(found) < _FRAMES:
        path = frame.f_code.co_filename
        if not any(part in path for part in _SKIPPED):
            found.append(f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(found) or "?"


_Transport: Any = selector_events._SelectorTransport
_init = _Transport.__init__
_repr = _Transport.__repr__


def _remembering_init(self: Any, *args: Any, **kwargs: Any) -> None:
    made_in = f"made in {_current[0]} by {_origin()}"
    # Set first: a transport whose __init__ raises half way (asyncio's Server closed as it
    # accepted, on 3.11) holds its socket all the same, and warns when collected.
    self._made_in = made_in + " (half made: its __init__ raised)"
    _init(self, *args, **kwargs)
    self._made_in = made_in


def _telling_repr(self: Any) -> str:
    made = getattr(self, "_made_in", None)
    text: str = _repr(self)
    return text if made is None else f"{text[:-1]} {made}>"


_Transport.__init__ = _remembering_init
_Transport.__repr__ = _telling_repr


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[0] = item.nodeid
