"""Fixtures of the tool tests."""

from __future__ import annotations

import pytest

from tests.pipeline.tools.support import Tracing


@pytest.fixture
def tracing() -> Tracing:
    return Tracing()
