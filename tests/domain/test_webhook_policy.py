"""Where webhooks may go: the URL rules and the address policy (SSRF), without I/O. The HTTP tests send
real deliveries through the same policy (tests/http/test_webhooks.py)."""

from __future__ import annotations

import ipaddress

import pytest
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.webhook_policy import RefusedAddress, WebhookPolicy, address_refusal

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


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "93.184.216.34"])
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


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
