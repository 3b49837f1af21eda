"""Where webhooks may go: the URL rules and the address policy (SSRF), without I/O. The HTTP tests send
real deliveries through the same policy (tests/http/test_webhooks.py)."""

from __future__ import annotations

import ipaddress

import pytest
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.webhooks.policy import RefusedAddress, WebhookPolicy, address_refusal

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("fc00::1", "private"),  # IPv6 unique-local
    ("fd12:3456::1", "private"),
    ("100.64.0.1", "special-purpose"),  # CGNAT
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("240.0.0.1", "special-purpose"),  # reserved
    ("255.255.255.255", "special-purpose"),
    ("192.0.2.10", "special-purpose"),  # documentation
    ("198.18.0.1", "special-purpose"),  # benchmarking
    ("::ffff:127.0.0.1", "IPv4-mapped"),
    ("::ffff:8.8.8.8", "IPv4-mapped"),
    ("64:ff9b::7f00:1", "special-purpose"),  # NAT64 of 127.0.0.1
    ("2002:7f00:1::1", "special-purpose"),  # 6to4 of 127.0.0.1
    ("2001:0:7f00:1::1", "special-purpose"),  # Teredo
]


@pytest.mark.parametrize(("address", "kind"), REFUSED)
def test_special_purpose_addresses_are_refused(address: str, kind: str) -> None:
    refusal = address_refusal(ipaddress.ip_address(address))
    assert refusal is not None and kind in refusal


#: IPv6 spellings of an IPv4 address (issue 27, item 12): each is refused whatever the IPv4 address inside,
#: and the refusal names that address where the form carries one.
IPV4_INSIDE_IPV6 = [
    ("::127.0.0.1", "IPv4-compatible", "127.0.0.1"),
    ("::a9fe:a9fe", "IPv4-compatible", "169.254.169.254"),
    ("::8.8.8.8", "IPv4-compatible", "8.8.8.8"),
    ("::ffff:0:7f00:1", "IPv4-translated", "127.0.0.1"),
    ("::ffff:0:a9fe:a9fe", "IPv4-translated", "169.254.169.254"),
    ("::ffff:0:808:808", "IPv4-translated", "8.8.8.8"),
    ("::ffff:a9fe:a9fe", "IPv4-mapped", "169.254.169.254"),
    ("64:ff9b::a9fe:a9fe", "NAT64", "169.254.169.254"),
    ("64:ff9b::8.8.8.8", "NAT64", "8.8.8.8"),
    ("64:ff9b:1:a9fe:a9:fe00::", "local-use NAT64", ""),
    ("2002:a9fe:a9fe::1", "6to4", "169.254.169.254"),
    ("2002:808:808::1", "6to4", "8.8.8.8"),
    # Teredo stores its client's address XOR-ed: 0x80fffffe is 127.0.0.1.
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "Teredo", "127.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:5601:5601", "Teredo", "169.254.169.254"),
    # ISATAP interface ids under a global prefix, with and without the universal bit.
    ("2606:4700::5efe:7f00:1", "ISATAP", "127.0.0.1"),
    ("2606:4700::200:5efe:a9fe:a9fe", "ISATAP", "169.254.169.254"),
    ("2606:4700::100:5efe:a00:1", "ISATAP", "10.0.0.1"),
]


@pytest.mark.parametrize(("address", "form", "inside"), IPV4_INSIDE_IPV6)
def test_every_ipv6_form_carrying_an_ipv4_address_is_refused_at_registration(
    address: str, form: str, inside: str
) -> None:
    refusal = address_refusal(ipaddress.ip_address(address))
    assert refusal is not None and form in refusal and inside in refusal
    with pytest.raises(InvalidInput, match=form) as refused:
        WebhookPolicy().check_url(f"https://[{address}]:8443/hook")
    assert refused.value.field == "url"
    with pytest.raises(RefusedAddress, match=form):
        WebhookPolicy().check_addresses("hooks.example.com", ["93.184.215.14", address])


#: IANA special-purpose ranges that Python 3.11's tables call global, or do not know, or that later Python
#: releases call global (the registries' "Globally Reachable" column): none can hold a receiver.
NEWER_SPECIAL_RANGES = [
    "3fff::1",  # documentation (RFC 9637)
    "3fff:fff:ffff::1",
    "5f00::1",  # SRv6 SIDs (RFC 9602)
    "5f00:1234::5",
    "100::1",  # discard-only
    "100:0:0:1::1",  # dummy prefix
    "fec0::1",  # deprecated site-local
    "4000::1",  # outside the global unicast space 2000::/3
    "1000::1",
    "2001:1::1",  # PCP anycast
    "2001:1::2",  # TURN anycast
    "2001:1::3",  # DNS-SD SRP anycast
    "2001:3::1",  # AMT
    "2001:4:112::1",  # AS112-v6
    "2001:20::1",  # ORCHIDv2
    "2001:30::1",  # drone remote ID tags
    "2001:1ff::1",  # unassigned in the IETF protocol assignments 2001::/23
    "2620:4f:8000::1",  # AS112 direct delegation
    "192.0.0.9",  # PCP anycast
    "192.0.0.10",  # TURN anycast
    "192.0.0.200",  # IETF protocol assignments, unassigned
    "192.31.196.1",  # AS112-v4
    "192.52.193.1",  # AMT relays
    "192.88.99.1",  # deprecated 6to4 relay anycast
    "192.88.99.2",  # 6a44 relay
    "192.175.48.1",  # AS112 direct delegation
]


@pytest.mark.parametrize("address", NEWER_SPECIAL_RANGES)
def test_newer_special_purpose_ranges_are_refused_at_registration(address: str) -> None:
    refusal = address_refusal(ipaddress.ip_address(address))
    assert refusal is not None and "special-purpose" in refusal
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(InvalidInput, match="special-purpose"):
        WebhookPolicy().check_url(f"https://{host}/hook")
    with pytest.raises(RefusedAddress, match="special-purpose"):
        WebhookPolicy().check_addresses("hooks.example.com", [address])


PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "93.184.216.34",
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",  # 2001:4860::/32 is ordinary space just beyond 2001::/23
    "2a00:1450:4001:82b::200e",
    "2606:4700::200:5efe:808:808",  # an ISATAP interface id carrying a public address
]


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None
    host = f"[{address}]" if ":" in address else address
    assert WebhookPolicy().check_url(f"https://{host}/hook").hostname == address
    assert WebhookPolicy().check_addresses("hooks.example.com", [address]) == [address]


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://example.com/hook", "https://"),
        ("ftp://example.com/hook", "https://"),
        ("https:///nohost", "host"),
        ("https://user:pw@example.com/", "credentials"),
        ("https://example.com/#frag", "fragment"),
        ("https://example.com:0/", "port 0"),
        ("https://example.com:99999/", "port"),
        ("https://exa mple.com/", "spaces"),
        ("https://ex\u00e4mple.com/", "ASCII"),
        ("https://127.0.0.1/", "loopback"),
        ("https://[::1]:8443/", "loopback"),
        ("https://169.254.169.254/latest/meta-data", "link-local"),
        ("https://10.0.0.5/", "private"),
        ("", "https://"),
        ("https://example.com/" + "a" * 2100, "2048"),
    ],
)
def test_urls_the_policy_refuses_name_what_is_wrong(url: str, named: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        WebhookPolicy().check_url(url)
    assert named in refused.value.detail
    assert refused.value.field == "url"


def test_an_https_url_with_a_name_passes_and_its_addresses_are_checked() -> None:
    policy = WebhookPolicy()
    assert policy.check_url("https://hooks.example.com/in?x=1").hostname == "hooks.example.com"
    assert policy.check_addresses("hooks.example.com", ["93.184.216.34"]) == ["93.184.216.34"]
    with pytest.raises(RefusedAddress, match="loopback"):
        policy.check_addresses("hooks.example.com", ["127.0.0.1"])
    # One refused address among public ones refuses the name: DNS may answer with either.
    with pytest.raises(RefusedAddress, match="private"):
        policy.check_addresses("hooks.example.com", ["93.184.216.34", "10.0.0.1"])
    with pytest.raises(RefusedAddress, match="no address"):
        policy.check_addresses("hooks.example.com", [])


def test_an_allowed_host_may_be_private_and_plain_http_but_only_that_host() -> None:
    policy = WebhookPolicy.allowing(["127.0.0.1", " Receiver.Local. ", ""])
    assert policy.check_url("http://127.0.0.1:8080/hook").port == 8080
    assert policy.check_url("http://receiver.local/hook").hostname == "receiver.local"
    assert policy.check_addresses("receiver.local", ["10.0.0.7"]) == ["10.0.0.7"]
    # A name that resolves to an allowed address is not the allowed host: still checked.
    with pytest.raises(RefusedAddress, match="loopback"):
        policy.check_addresses("localhost", ["127.0.0.1"])
    with pytest.raises(InvalidInput, match="https://"):
        policy.check_url("http://localhost:8080/hook")
    with pytest.raises(InvalidInput, match="loopback"):
        policy.check_url("https://127.0.0.2/hook")


def test_a_host_written_as_an_address_is_refused_when_connecting_unless_allowed() -> None:
    """What the webhook sender and the memory proxy's client both check before they connect."""
    policy = WebhookPolicy.allowing(["127.0.0.1"])
    assert policy.literal_refusal("127.0.0.1") is None  # allowed by name
    assert policy.literal_refusal("10.0.0.7") == address_refusal(ipaddress.ip_address("10.0.0.7"))
    assert policy.literal_refusal("[::1]") == address_refusal(ipaddress.ip_address("::1"))
    assert policy.literal_refusal("receiver.example") is None  # a name: checked once resolved
    assert policy.literal_refusal("93.184.216.34") is None  # public
