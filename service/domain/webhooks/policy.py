"""Where webhooks may go (SPEC sections 11 and 14, "No SSRF"): the URL rules and the address policy.

A receiver's URL is ``https://`` with a host name or a public IP address. Every address the host resolves to
must be a public unicast one: the IANA special-purpose ranges (loopback, private, link-local and its cloud
metadata address ``169.254.169.254``, CGNAT, multicast, reserved, documentation, benchmarking, anycast
services, IPv6 unique-local and link-local, IPv6 outside the global unicast space 2000::/3) are refused, and
so is every IPv6 form that carries an IPv4 address (mapped, compatible, translated, NAT64, 6to4, Teredo; an
ISATAP interface id when the address inside is refused). The
check runs at registration and again at every attempt (DNS answers change), and the sender connects to the
addresses that were checked (no second resolution: service/http/webhook_sender.py).

The operator may allow hosts explicitly (``CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS``: exact host names or IP
literals, for development and tests): an allowed host skips the address check and may use ``http://``. An
allowed IP literal allows that URL host only: a name that resolves to it is still checked (and refused).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from ..errors import InvalidInput

#: Longest receiver URL accepted.
MAX_URL_CHARS = 2048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: IANA hands out global unicast IPv6 from 2000::/3 only: everything outside it is reserved, local,
#: multicast or special (IPv4 embeddings in ::/96 and ::ffff:0:0/96, NAT64 in 64:ff9b::/96, the discard and
#: dummy prefixes in 100::/64 and 100:0:0:1::/64, SRv6 SIDs in 5f00::/16, the deprecated site-local
#: fec0::/10...). Checking the space that may hold a receiver, rather than listing what may not, also refuses
#: whatever IANA reserves there next.
_IPV6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")

#: Special-purpose ranges that Python 3.11's ``is_global`` tables miss or (in later Python releases, which
#: follow the registries' "Globally Reachable" column) call global. Whatever that column says, none can
#: hold a webhook receiver, so each is refused here rather than left to the Python version:
#:
#: - 192.0.0.0/24 and 2001::/23, the IETF protocol assignments, whole. Among them the "globally reachable"
#:   anycast services (PCP 192.0.0.9 and 2001:1::1, TURN 192.0.0.10 and 2001:1::2, DNS-SD SRP 2001:1::3):
#:   anycast reaches the nearest instance, which is the operator's own gateway or relay, an internal service;
#:   AMT 2001:3::/32, AS112 2001:4:112::/48, ORCHIDv2 2001:20::/28 and the drone remote-ID tags
#:   2001:30::/28 are relays, DNS sinks and identifiers (not locators) respectively; the rest of the block
#:   is benchmarking, Teredo or unassigned.
#: - 192.31.196.0/24 (AS112-v4), 192.175.48.0/24 and 2620:4f:8000::/48 (AS112 direct delegation): anycast
#:   DNS sinks for private reverse zones, run by operators inside their own networks.
#: - 192.52.193.0/24 (AMT relays): anycast multicast tunnel relays, the nearest one being local.
#: - 192.88.99.0/24: the deprecated 6to4 relay anycast (RFC 7526) and the 6a44 relay 192.88.99.2.
#: - 2001:db8::/32 and 3fff::/20 (RFC 9637): documentation; Python 3.11 knows only the first.
_SPECIAL_PURPOSE = [
    ipaddress.ip_network(net)
    for net in (
        "192.0.0.0/24",
        "192.31.196.0/24",
        "192.52.193.0/24",
        "192.88.99.0/24",
        "192.175.48.0/24",
        "2001::/23",
        "2001:db8::/32",
        "2620:4f:8000::/48",
        "3fff::/20",
    )
]

#: IPv6 forms that carry an IPv4 address, each refused whatever the IPv4 address is: a receiver publishes
#: its IPv4 address as such (an A record), and a translator or tunnel in between would send the request to
#: an IPv4 address this policy never checked. (name, network, where the IPv4 address sits)
_IPV4_INSIDE = [
    ("IPv4-mapped", ipaddress.IPv6Network("::ffff:0:0/96"), "low"),
    ("IPv4-translated (RFC 2765)", ipaddress.IPv6Network("::ffff:0:0:0/96"), "low"),
    ("IPv4-compatible (deprecated)", ipaddress.IPv6Network("::/96"), "low"),
    ("NAT64", ipaddress.IPv6Network("64:ff9b::/96"), "low"),
    ("local-use NAT64 (RFC 8215)", ipaddress.IPv6Network("64:ff9b:1::/48"), "none"),
    ("6to4", ipaddress.IPv6Network("2002::/16"), "6to4"),
    ("Teredo", ipaddress.IPv6Network("2001::/32"), "teredo"),
]

#: An ISATAP interface id (RFC 5214) is ``0000:5efe`` (or with the universal and group bits: ``0200:5efe``,
#: ``0100:5efe``, ``0300:5efe``) then an IPv4 address, under any /64 prefix. A node on that prefix's ISATAP
#: link (this service's own host may be one) sends such a destination over IPv4 to the address inside, so
#: that address is checked like any other; a public one passes (the prefix is an ordinary global one, and
#: a random interface id takes this shape once in 2**30).
_ISATAP_MASK = 0xFCFF_FFFF
_ISATAP_ID = 0x0000_5EFE


#: The private networks proper (RFC 1918, IPv6 unique-local), named as such; the other ranges Python calls
#: private (documentation, benchmarking, reserved...) are refused as special-purpose.
_PRIVATE = [
    ipaddress.ip_network(net) for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
]


class RefusedAddress(ValueError):
    """A receiver URL or address the policy refuses; ``str()`` says why, without the URL's path or query."""


def address_refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a public unicast address (None if it is one)."""
    if address.is_loopback:
        return f"{address} is a loopback address"
    if address.is_unspecified:
        return f"{address} is the unspecified address"
    if isinstance(address, ipaddress.IPv6Address):
        inside = _ipv4_inside(address)
        if inside is not None:
            return f"{address} is a special-purpose address (IANA), not a public one: {inside}"
    if address.is_link_local:
        return f"{address} is a link-local address (cloud metadata services live there)"
    if address.is_multicast:
        return f"{address} is a multicast address"
    if any(address in net for net in _PRIVATE):
        return f"{address} is a private address"
    if (
        address.is_private
        or not address.is_global
        or any(address in net for net in _SPECIAL_PURPOSE)
        or (isinstance(address, ipaddress.IPv6Address) and address not in _IPV6_GLOBAL_UNICAST)
    ):
        return f"{address} is a special-purpose address (IANA), not a public one"
    return None


def _ipv4_inside(address: ipaddress.IPv6Address) -> str | None:
    """What IPv4 address ``address`` carries and in which form (None if it carries none)."""
    for name, network, where in _IPV4_INSIDE:
        if address not in network:
            continue
        if where == "6to4":
            inner = address.sixtofour
        elif where == "teredo":
            teredo = address.teredo
            inner = teredo[1] if teredo is not None else None  # the client, un-XOR-ed
        elif where == "low":
            inner = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        else:
            inner = None
        shown = f" ({inner})" if inner is not None else ""
        return f"an IPv4 address{shown} inside IPv6, {name}"
    if (int(address) >> 32) & _ISATAP_MASK == _ISATAP_ID:
        inner = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        refusal = address_refusal(inner)
        if refusal is not None:
            return f"an ISATAP interface id carrying {inner}, and {refusal}"
    return None


@dataclass(frozen=True, slots=True)
class WebhookPolicy:
    """The operator's allowance (``CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS``), lower-cased host names and IP
    literals in their canonical form."""

    allowed_hosts: frozenset[str] = frozenset()

    @classmethod
    def allowing(cls, hosts: Iterable[str]) -> WebhookPolicy:
        return cls(frozenset(_canonical_host(h.strip()) for h in hosts if h.strip()))

    def allows_host(self, host: str) -> bool:
        return _canonical_host(host) in self.allowed_hosts

    def literal_refusal(self, host: str) -> str | None:
        """Why a host written as an IP address (``[...]`` for IPv6) is refused; None when it is allowed or is a
        name (a name is checked once resolved, by the connection's resolver)."""
        if self.allows_host(host):
            return None
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return None
        return address_refusal(literal)

    def check_url(self, url: str) -> SplitResult:
        """The parsed URL, or :class:`InvalidInput` naming what is wrong (an IP literal host is checked
        here; a name is resolved and checked by :meth:`check_addresses`)."""
        if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
            raise InvalidInput(
                f"url must be an https:// URL of at most {MAX_URL_CHARS} characters", field="url"
            )
        if not url.isascii() or any(c.isspace() or ord(c) < 0x20 for c in url):
            raise InvalidInput(
                "url must be ASCII without spaces (punycode and percent-encode the rest)", field="url"
            )
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise InvalidInput(
                "url is not a valid URL (its host or port cannot be read)", field="url"
            ) from None
        host = parts.hostname or ""
        if parts.scheme not in ("https", "http") or not host:
            raise InvalidInput("url must be an https:// URL with a host", field="url")
        if parts.username is not None or parts.password is not None:
            raise InvalidInput("url must not carry credentials (user:password@)", field="url")
        if parts.fragment:
            raise InvalidInput("url must not have a #fragment (it is never sent)", field="url")
        if port == 0:
            raise InvalidInput("url names port 0", field="url")
        allowed = self.allows_host(host)
        if parts.scheme == "http" and not allowed:
            raise InvalidInput(
                "url must be https:// (plain http:// only to a host the operator allows: "
                "CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS)",
                field="url",
            )
        literal = _ip_literal(host)
        if literal is not None and not allowed:
            refusal = address_refusal(literal)
            if refusal is not None:
                raise InvalidInput(f"url cannot be used: {refusal}", field="url")
        return parts

    def check_addresses(self, host: str, addresses: Iterable[str]) -> list[str]:
        """The addresses ``host`` resolved to, if every one is public (or the host is allowed); else
        :class:`RefusedAddress`. A name with one refused address is refused whole: DNS may answer with
        either."""
        found = list(dict.fromkeys(addresses))
        if not found:
            raise RefusedAddress(f"{host} resolves to no address")
        if self.allows_host(host):
            return found
        for text in found:
            address = ipaddress.ip_address(text.split("%", 1)[0])
            refusal = address_refusal(address)
            if refusal is not None:
                raise RefusedAddress(f"{host} resolves to {refusal}")
        return found


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _canonical_host(host: str) -> str:
    literal = _ip_literal(host)
    return str(literal) if literal is not None else host.lower().rstrip(".")
