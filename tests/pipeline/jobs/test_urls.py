"""Webhook URLs: the server-side request forgery rules, at submit and on resolved addresses."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading

import pytest

from pipeline.jobs.urls import UrlPolicy, WebhookUrlRefused, refusal, system_resolver

REFUSED_URLS = [
    ("https://10.1.2.3/hook", "private"),
    ("https://192.168.0.10/hook", "private"),
    ("https://172.16.5.4/hook", "private"),
    ("https://127.0.0.1/hook", "loopback"),
    ("https://169.254.169.254/latest/meta-data/", "metadata"),
    ("https://[::1]/hook", "loopback"),
    ("https://[fd00:ec2::254]/hook", "metadata"),
    ("https://[fc00::5]/hook", "private"),
    ("https://[fe80::1]/hook", "link-local"),
    ("https://[::ffff:127.0.0.1]/hook", "127.0.0.1"),
    ("https://[64:ff9b::a00:1]/hook", "10.0.0.1"),
    ("https://[2002:c0a8:0101::1]/hook", "192.168.1.1"),
    ("https://0.0.0.0/hook", "unspecified"),
    ("https://224.0.0.1/hook", "multicast"),
    ("https://100.100.100.200/hook", "metadata"),
    ("https://100.64.0.1/hook", "not a public address"),
    ("https://240.0.0.1/hook", "reserved"),
    ("https://[fec0::1]/hook", "site-local"),  # deprecated, still routed in some networks
    ("https://[::ffff:169.254.169.254]/hook", "metadata"),
]
MALFORMED_URLS = [
    "not a url",
    "hooks.example.com/path",
    "ftp://hooks.example.com/",
    "https://",
    "https:///path",
    "https://user:pw@hooks.example.com/",
    "https://hooks.example.com:99999/",
    "https://hooks.example.com/a b",
    "https://[::1/",
    "http://hooks.example.com/hook",  # http only for allow-listed hosts
    "https://" + "a" * 3000 + ".com/",
    "https://hooks.example.com:0/",
    "https://\u2603.net/hook",  # IDNA 2003 takes it, the sender's (2008) does not
]


@pytest.mark.parametrize(("url", "reason"), REFUSED_URLS)
def test_urls_naming_a_non_public_address_are_refused(url: str, reason: str) -> None:
    with pytest.raises(WebhookUrlRefused, match=reason):
        UrlPolicy().parse(url)


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_malformed_or_non_https_urls_are_refused(url: str) -> None:
    with pytest.raises(WebhookUrlRefused):
        UrlPolicy().parse(url)


def test_public_https_urls_pass_the_syntax_check() -> None:
    target = UrlPolicy().parse("https://Hooks.Example.com:8443/in?x=1")
    assert (target.scheme, target.host, target.port, target.literal) == (
        "https",
        "hooks.example.com",
        8443,
        None,
    )
    assert UrlPolicy().parse("https://93.184.216.34/hook").literal == ipaddress.ip_address(
        "93.184.216.34"
    )
    for address in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"):
        assert refusal(ipaddress.ip_address(address)) is None


async def test_a_name_resolving_to_loopback_is_refused_unless_allow_listed() -> None:
    target = UrlPolicy().parse("https://localhost:8443/hook")  # the name alone says nothing
    with pytest.raises(WebhookUrlRefused, match="loopback"):
        await UrlPolicy().resolve(target, system_resolver)
    allowed = UrlPolicy(["localhost"])
    addresses = await allowed.resolve(allowed.parse("http://localhost:8443/hook"))
    assert addresses and all(a.is_loopback for a in addresses)


async def test_every_resolved_address_is_checked() -> None:
    async def mixed(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.7")]

    policy = UrlPolicy()
    with pytest.raises(WebhookUrlRefused, match=r"10\.0\.0\.7"):
        await policy.resolve(policy.parse("https://hooks.example.com/"), mixed)


def test_the_allow_list_takes_hosts_and_networks_but_never_metadata() -> None:
    policy = UrlPolicy(["127.0.0.0/8", "hooks.internal", "169.254.0.0/16"])
    assert policy.parse("http://127.0.0.1:9000/hook").literal is not None
    assert policy.parse("http://hooks.internal/hook").host == "hooks.internal"
    with pytest.raises(WebhookUrlRefused, match="https"):
        policy.parse("http://other.internal/hook")
    with pytest.raises(WebhookUrlRefused, match="metadata"):
        policy.parse("http://169.254.169.254/latest/")
    with pytest.raises(WebhookUrlRefused, match="private"):
        policy.parse("https://10.0.0.1/")
    # An IPv6 zone makes an address compare unequal to the same address without one; the
    # kernel ignores it off link-local, so it would reach the metadata service all the same.
    around = UrlPolicy(["fd00::/8"])
    assert around.parse("https://[fd00::5]/").literal is not None
    for zoned in ("https://[fd00:ec2::254%1]/", "https://[fd00:ec2::254%25eth0]/"):
        with pytest.raises(WebhookUrlRefused, match="metadata"):
            around.parse(zoned)


# IPv6 forms that route to a metadata service: an allow-listed name whose DNS answers one of
# these (its owner's zone, or rebinding) must be refused as the IPv4 address itself is.
METADATA_FORMS = [
    "::ffff:169.254.169.254",
    "::ffff:a9fe:a9fe",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::",
    "::ffff:100.100.100.200",
    "::ffff:169.254.170.2",
    "64:ff9b:1:a9fe:a9:fe00::",  # the local-use NAT64 prefix, a /48
]


@pytest.mark.parametrize("address", METADATA_FORMS)
async def test_an_allow_listed_name_never_reaches_a_metadata_address_in_any_form(
    address: str,
) -> None:
    async def answers(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return [ipaddress.ip_address(address)]

    policy = UrlPolicy(["hooks.partner.example"])
    with pytest.raises(WebhookUrlRefused, match="metadata"):
        await policy.resolve(policy.parse("https://hooks.partner.example/in"), answers)
    mapped_private = UrlPolicy(["hooks.partner.example"])

    async def private(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return [ipaddress.ip_address("::ffff:10.0.0.5")]

    target = mapped_private.parse("https://hooks.partner.example/in")
    assert await mapped_private.resolve(target, private)  # the allow-list still holds for it


async def test_a_host_that_does_not_resolve_is_refused_at_submit() -> None:
    policy = UrlPolicy()
    with pytest.raises(WebhookUrlRefused, match=r"hooks\.example\.invalid does not resolve"):
        await policy.check_at_submit(policy.parse("https://hooks.example.invalid/hook"))
    await policy.check_at_submit(policy.parse("https://93.184.216.34/hook"))  # no name, no lookup


async def test_a_slow_lookup_is_refused_in_time_and_never_blocks_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resolver hangs until the test lets it go: a refusal that comes while it still hangs
    was bounded by resolve_seconds, not by the resolver; and the loop ticks while it hangs (a
    lookup run on the loop itself would block it: no ticks, and no refusal in time)."""
    entered, returned, release = threading.Event(), threading.Event(), threading.Event()

    def slow_getaddrinfo(*args: object, **kwargs: object) -> list[object]:
        entered.set()
        release.wait(30)  # a resolver that hangs; the loop's getaddrinfo runs it in a thread
        returned.set()
        return []

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += entered.is_set() and not returned.is_set()

    policy = UrlPolicy(resolve_seconds=0.2)
    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(WebhookUrlRefused, match=r"did not resolve within 0\.2 s"):
            await policy.check_at_submit(policy.parse("https://slow.example.invalid/hook"))
        assert entered.is_set() and not returned.is_set(), "bounded by the resolver"
    finally:
        ticker.cancel()
        release.set()
    assert ticks >= 1, "the event loop did not run while the lookup hung"


async def test_an_unresolvable_host_allow_listed_by_name_passes_at_submit() -> None:
    async def nowhere(host: str, port: int) -> list[ipaddress.IPv4Address]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    policy = UrlPolicy(["hooks.internal.invalid"])
    await policy.check_at_submit(policy.parse("http://hooks.internal.invalid/hook"), nowhere)
    with pytest.raises(WebhookUrlRefused, match="does not resolve"):
        await policy.check_at_submit(policy.parse("https://other.invalid/hook"), nowhere)
