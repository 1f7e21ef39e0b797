"""Fixtures of the tool tests."""

from __future__ import annotations

import pytest

from tests.pipeline.tools.support import Tracing


@pytest.fixture
def tracing() -> Tracing:
    """The tool tests' own `tracing` (tests/conftest.py's, with the tracer and span lookup)."""
    return Tracing()
