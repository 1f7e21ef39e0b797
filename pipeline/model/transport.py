"""The model client's network layer: httpcore over asyncio protocols, without anyio.

httpcore's default backend wraps every socket read in anyio's ``fail_after`` (a cancel scope)
and an exception-mapping context manager, and anyio's stream adds its own checkpoint: at one
read per streamed token, that was the largest share of what relaying a token cost this process
(BENCHMARKS.md, issue 18). ``AsyncioBackend`` gives httpcore the same contract on a plain
``asyncio.Protocol``:

- the loop reads the socket as data arrives and the protocol keeps it, so a read that finds
  data returns it without waiting (no future, no timer), and one that waits costs one future
  and one timer for its timeout;
- an idle pooled connection is "readable" (httpcore's test that the server closed it) when the
  protocol saw data, the end of the stream or the connection's loss: no socket poll;
- timeouts and socket errors become httpcore's own exceptions (``ReadTimeout``, ``ReadError``,
  ``ConnectTimeout``, ...), which httpx maps to its tree as for any backend, so the client's
  error mapping (``pipeline.model.client``) is unchanged.

TLS goes through ``loop.start_tls`` on the same protocol. ``transport`` builds an httpx
transport on this backend with httpx's own request and response handling.
"""

# ruff: noqa: ASYNC109 (the timeout parameters are httpcore's backend interface)
from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import socket
import ssl
from asyncio import staggered
from collections.abc import Iterable
from typing import Any, Final, cast

import httpcore
import httpx

# Reading pauses while this much is received and not yet read (a slow reader of a fast server).
HIGH_WATER: Final = 256 * 1024
# Happy eyeballs: how long one address of a host is tried alone before the next is tried too.
HAPPY_EYEBALLS_S: Final = 0.25


class _Protocol(asyncio.Protocol):
    """Keeps what the connection received until it is read; wakes the one waiting reader."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.eof = False
        self.lost = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False  # reading, by this protocol
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self.eof = True
        self._wake()
        # None: the transport closes itself (httpcore never writes after the server's end).

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.error = exc
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def readable(self) -> bool:
        """Whether a read would return at once: data, the end, or the connection gone."""
        return self.size > 0 or self.eof or self.lost

    def take(self, max_bytes: int) -> bytes:
        data = self.chunks.popleft()
        if len(data) > max_bytes:
            data, rest = data[:max_bytes], data[max_bytes:]
            self.chunks.appendleft(rest)
        self.size -= len(data)
        if self.paused and self.size <= HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _expire(waiter: asyncio.Future[None], error: type[Exception]) -> None:
    if not waiter.done():
        waiter.set_exception(error())


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection, for httpcore: reads, writes, TLS, and what httpcore asks of it."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        if not protocol.readable:
            loop = asyncio.get_running_loop()
            waiter = protocol.waiter = loop.create_future()
            timer = (
                None
                if timeout is None
                else loop.call_later(timeout, _expire, waiter, httpcore.ReadTimeout)
            )
            try:
                await waiter
            finally:
                protocol.waiter = None
                if timer is not None:
                    timer.cancel()
        if protocol.size:
            return protocol.take(max_bytes)
        if protocol.error is not None:  # the connection broke (reset, ...): not a clean end
            raise httpcore.ReadError(_reason(protocol.error))
        return b""  # the server ended the stream (httpcore reads this as the connection closed)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if protocol.lost or self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(buffer)
        drained = protocol.drained
        if drained is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(drained)
        except TimeoutError:
            raise httpcore.WriteTimeout("the server did not read in time") from None
        if protocol.error is not None:
            raise httpcore.WriteError(_reason(protocol.error))

    async def aclose(self) -> None:
        # At once, as anyio's backend does: a graceful close would keep the socket (and any
        # request bytes not sent) until a server that stopped reading read them, and over TLS
        # wait up to 30 s for the server's close_notify.
        self._transport.abort()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        protocol, plain = self._protocol, self._transport
        if protocol.readable or plain.is_closing():
            # The server hung up first (a TLS balancer with no backend): no handshake can
            # follow, and uvloop's start_tls would return a stream without one.
            plain.abort()
            raise httpcore.ConnectError("the server closed the connection before the TLS handshake")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(
                    plain, protocol, ssl_context, server_hostname=server_hostname
                )
        except BaseException as exc:
            plain.abort()
            if isinstance(exc, TimeoutError):
                raise httpcore.ConnectTimeout("the TLS handshake did not finish in time") from None
            if isinstance(exc, OSError | RuntimeError):  # SSLError is one; Runtime: closed first
                raise httpcore.ConnectError(_reason(exc)) from exc
            raise
        if transport is None or transport.get_extra_info("ssl_object") is None:
            (transport or plain).abort()
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        protocol.transport = transport
        return AsyncioStream(transport, protocol)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._protocol.readable
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        return None


async def _connected(
    connect: Any, timeout: float | None, socket_options: Iterable[Any] | None
) -> AsyncioStream:
    try:
        async with asyncio.timeout(timeout):
            transport, protocol = await connect()
    except TimeoutError:
        raise httpcore.ConnectTimeout("no connection in time") from None
    except OSError as exc:
        raise httpcore.ConnectError(_reason(exc)) from exc
    sock = transport.get_extra_info("socket")
    for option in socket_options or ():
        sock.setsockopt(*option)
    return AsyncioStream(transport, protocol)


def _interleaved(infos: list[Any]) -> list[Any]:
    """The addresses, their families taking turns (RFC 8305), each family in its own order."""
    families: dict[int, list[Any]] = {}
    for info in infos:
        families.setdefault(info[0], []).append(info)
    turns = itertools.zip_longest(*families.values())
    return [info for turn in turns for info in turn if info is not None]


async def _addresses(host: str, port: int) -> list[Any]:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def _open_socket(host: str, port: int, local_address: str | None) -> socket.socket:
    """A connected TCP socket to ``host``: its addresses tried in turn, each next one started
    ``HAPPY_EYEBALLS_S`` after the last unless that one failed first (as httpx's own backend
    does; ``loop.create_connection`` would spend the whole timeout on a first address that
    drops packets, and uvloop's has no such race)."""
    loop = asyncio.get_running_loop()
    infos = _interleaved(await _addresses(host, port))
    connected: list[socket.socket] = []

    async def attempt(info: Any) -> socket.socket:
        family, kind, proto, _, address = info
        sock = socket.socket(family, kind, proto)
        try:  # an attempt that fails or is cancelled (another won) closes its own socket
            sock.setblocking(False)
            if local_address is not None:
                sock.bind((local_address, 0))
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        connected.append(sock)
        return sock

    winner = None
    try:
        winner, _, errors = await staggered.staggered_race(
            [functools.partial(attempt, info) for info in infos], HAPPY_EYEBALLS_S
        )
    finally:  # a connection made as the caller gave up
        for sock in connected:
            if sock is not winner:
                sock.close()
    if winner is None:
        raise OSError("; ".join(str(e) for e in errors if e) or f"no address for {host}")
    winner.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return winner


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend on asyncio's protocols (TCP_NODELAY, as asyncio sets it)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()

        async def connect() -> Any:
            sock = await _open_socket(host, port, local_address)
            try:
                return await loop.create_connection(_Protocol, sock=sock)
            except BaseException:
                sock.close()
                raise

        return await _connected(connect, timeout, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()

        def connect() -> Any:
            return loop.create_unix_connection(_Protocol, path)

        return await _connected(connect, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def transport(*, verify: ssl.SSLContext, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's HTTP/1.1 transport, without a proxy, its connection pool on ``AsyncioBackend``
    (httpx builds the pool itself and takes no backend: it is replaced)."""
    made = httpx.AsyncHTTPTransport(verify=verify, limits=limits, trust_env=False)
    made._pool = httpcore.AsyncConnectionPool(
        ssl_context=verify,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return made
