"""Webhook URLs and server-side request forgery: which URLs and addresses a webhook may reach.

A webhook URL must be https, have a host, and carry no credentials. Every address its host
resolves to must be a public unicast address: private, loopback, link-local, multicast,
reserved, unspecified, shared (CGNAT) and cloud-metadata addresses are refused, and so are IPv6
forms that embed one of those (IPv4-mapped, 6to4, Teredo, NAT64). The check runs at submit and
again at delivery, on the addresses the connection then uses (see ``webhooks.py``), so a name
that resolves elsewhere later (DNS rebinding) is caught where it matters.

At submit the host must also resolve, within ``SUBMIT_RESOLVE_SECONDS`` (``check_at_submit``):
a name that does not resolve, or not in time, is refused then rather than failing every
delivery attempt later. At delivery a name that does not resolve is retried (DNS may be back).
Resolution runs on the event loop's ``getaddrinfo`` (a thread of the default executor), never
blocking the loop.

An allow-list (``RAG_JOBS__WEBHOOK_ALLOW``: host names and CIDRs) exempts chosen hosts, for
receivers inside the network and for local development on loopback; only allow-listed hosts may
use http. A host allow-listed by name need not resolve at submit (a name of the workers' network
may not resolve where the API runs); it is resolved at delivery.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[Address]]]

MAX_URL_LENGTH: Final = 2048
# Long enough for a cold lookup through a recursive resolver, short enough for a submit to wait.
SUBMIT_RESOLVE_SECONDS: Final = 2.0
# Metadata services; most are link-local or private already, listed so that they stay refused
# even if an allow-list names a network around them.
METADATA_ADDRESSES: Final = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)
_NAT64: Final = ipaddress.ip_network("64:ff9b::/96")
# The local-use NAT64 prefix (RFC 8215): /48, so the IPv4 address sits in bits 48-63 and 72-87
# (RFC 6052). Refused as reserved anyway; unwrapped only to find a metadata address behind a
# host the operator allow-listed by name.
_LOCAL_NAT64: Final = ipaddress.ip_network("64:ff9b:1::/48")


class WebhookUrlRefused(ValueError):
    """The URL, or an address its host resolves to, may not be used for a webhook."""


@dataclass(frozen=True)
class WebhookTarget:
    """A parsed webhook URL."""

    url: str
    scheme: str
    host: str  # lower case, IPv6 without brackets
    port: int
    literal: Address | None  # the host, when it is an IP address


def _embedded(address: Address) -> Address | None:
    """The IPv4 address an IPv6 address carries, for the forms that route to it."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _unscoped(address: Address) -> Address:
    """``address`` without an IPv6 zone (``%eth0``): addresses compare equal only with the
    same zone, and the kernel ignores a zone on an address that is not link-local."""
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        return ipaddress.IPv6Address(int(address))
    return address


def _metadata(address: Address) -> bool:
    """A metadata address, or an IPv6 form that routes to one (``::ffff:169.254.169.254``),
    with any zone."""
    address = _unscoped(address)
    inner = _embedded(address)
    if address in _LOCAL_NAT64:
        bits = int(address)
        inner = ipaddress.IPv4Address((((bits >> 64) & 0xFFFF) << 16) | ((bits >> 40) & 0xFFFF))
    return address in METADATA_ADDRESSES or (inner is not None and inner in METADATA_ADDRESSES)


def refusal(address: Address) -> str | None:
    """Why a webhook may not connect to ``address``, or None when it may."""
    if _metadata(address):
        return "a cloud metadata address"
    address = _unscoped(address)
    inner = _embedded(address)
    if inner is not None:
        reason = refusal(inner)
        return f"an IPv6 form of {inner} ({reason})" if reason else None
    for name, flag in (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        # fec0::/10, deprecated but still routed inside some networks; ipaddress calls it global.
        ("site-local", isinstance(address, ipaddress.IPv6Address) and address.is_site_local),
    ):
        if flag:
            return f"a {name} address"
    if not address.is_global:
        return "not a public address"
    return None


async def system_resolver(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to (A and AAAA), without blocking the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    seen: dict[Address, None] = {}
    for info in infos:
        # Scoped IPv6 addresses come back as "fe80::1%eth0"; the scope is not part of the check.
        seen[ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])] = None
    return list(seen)


class UrlPolicy:
    """The webhook rules above, with an allow-list of hosts and networks."""

    def __init__(
        self, allow: Iterable[str] = (), *, resolve_seconds: float = SUBMIT_RESOLVE_SECONDS
    ) -> None:
        self.resolve_seconds = resolve_seconds
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in (e.strip() for e in allow):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        self.hosts = frozenset(hosts)
        self.networks = tuple(networks)

    def _allowed_address(self, address: Address) -> bool:
        return any(address in network for network in self.networks)

    def _allowed_host(self, target: WebhookTarget) -> bool:
        if target.literal is not None:
            return self._allowed_address(target.literal)
        return target.host in self.hosts

    def parse(self, url: str) -> WebhookTarget:
        """Check the URL itself (not yet what it resolves to); raises ``WebhookUrlRefused``."""
        if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
            raise WebhookUrlRefused("webhook_url must be an absolute https URL")
        if any(ord(c) <= 32 or ord(c) == 127 for c in url):
            raise WebhookUrlRefused("webhook_url must not contain spaces or control characters")
        try:
            parts = urlsplit(url)
            port = parts.port
            host = (parts.hostname or "").lower().rstrip(".")
        except ValueError as exc:
            raise WebhookUrlRefused(f"webhook_url is not a valid URL: {exc}") from None
        if parts.scheme not in ("https", "http") or not host:
            raise WebhookUrlRefused("webhook_url must be an absolute https URL")
        if parts.username is not None or parts.password is not None:
            raise WebhookUrlRefused("webhook_url must not contain credentials")
        if port == 0:
            raise WebhookUrlRefused("webhook_url has port 0")
        try:  # what the sender will make of it: a host IDNA 2008 refuses (☃.net) is refused now
            httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise WebhookUrlRefused(f"webhook_url is not a valid URL: {exc}") from None
        try:
            literal: Address | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
            try:
                host.encode("idna")
            except UnicodeError:
                raise WebhookUrlRefused("webhook_url has an invalid host name") from None
        target = WebhookTarget(
            url=url,
            scheme=parts.scheme,
            host=host,
            port=port or (443 if parts.scheme == "https" else 80),
            literal=literal,
        )
        if target.scheme == "http" and not self._allowed_host(target):
            raise WebhookUrlRefused("webhook_url must use https")
        if literal is not None:
            self.check_address(target, literal)
        return target

    def check_address(self, target: WebhookTarget, address: Address) -> None:
        """Raise ``WebhookUrlRefused`` unless ``target`` may connect to ``address``."""
        if _metadata(address):
            raise WebhookUrlRefused(f"webhook host {target.host} is a cloud metadata address")
        if self._allowed_address(address) or (target.literal is None and target.host in self.hosts):
            return
        reason = refusal(address)
        if reason is not None:
            shown = target.host if target.literal is not None else f"{target.host} ({address})"
            raise WebhookUrlRefused(f"webhook host {shown} is {reason}")

    async def resolve(
        self, target: WebhookTarget, resolver: Resolver = system_resolver
    ) -> list[Address]:
        """The addresses to connect to, each one checked; raises ``WebhookUrlRefused`` if any
        is refused, ``OSError`` if the name does not resolve."""
        if target.literal is not None:
            addresses = [target.literal]
        else:
            addresses = await resolver(target.host, target.port)
            if not addresses:
                raise OSError(f"{target.host} resolves to no address")
        for address in addresses:
            self.check_address(target, address)
        return addresses

    async def check_at_submit(
        self, target: WebhookTarget, resolver: Resolver = system_resolver
    ) -> None:
        """``resolve``, within ``resolve_seconds``: a host that does not resolve, or not in
        time, is refused (``WebhookUrlRefused``) unless it is allow-listed by name."""
        timeout = self.resolve_seconds
        try:
            async with asyncio.timeout(timeout):
                await self.resolve(target, resolver)
        except TimeoutError:  # before OSError: TimeoutError is one
            reason = f"did not resolve within {timeout:g} s"
        except OSError as exc:
            reason = f"does not resolve ({exc.strerror or 'no address'})"
        else:
            return
        if target.host not in self.hosts:
            raise WebhookUrlRefused(f"webhook_url: the host {target.host} {reason}")
