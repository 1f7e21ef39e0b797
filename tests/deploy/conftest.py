"""A redis-server that asks for a password, as compose's does (``--requirepass``)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.support.servers import RedisServer


@pytest.fixture(scope="module")
def password_redis() -> Iterator[RedisServer]:
    server = RedisServer(password=secrets.token_hex(16))
    server.start()
    yield server
    server.stop()
