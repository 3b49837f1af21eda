"""Where webhooks may go (SPEC sections 11 and 14, "No SSRF"): the URL rules and the address policy.

A receiver's URL is ``https://`` with a host name or a public IP address. Every address the host resolves to
must be a public unicast one: the IANA special-purpose ranges (loopback, private, link-local and its cloud
metadata address ``169.254.169.254``, CGNAT, multicast, reserved, documentation, benchmarking, IPv6
unique-local and link-local, and IPv4 addresses dressed as IPv6: mapped, NAT64, 6to4, Teredo) are refused. The
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

from .errors import InvalidInput

#: Longest receiver URL accepted.
MAX_URL_CHARS = 2048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Ranges that ``is_global`` leaves open but that no public receiver has (Python's tables follow the IANA
#: special-purpose registries; these are the ones they mark as globally reachable yet special).
_ALSO_REFUSED = [
    ipaddress.ip_network(net)
    for net in (
        "64:ff9b::/96",  # NAT64: an IPv4 address inside
        "64:ff9b:1::/48",  # local-use NAT64
        "2002::/16",  # 6to4: an IPv4 address inside
        "2001::/32",  # Teredo: an IPv4 address inside
    )
]


#: The private networks proper (RFC 1918, IPv6 unique-local), named as such; the other ranges Python calls
#: private (documentation, benchmarking, reserved...) are refused as special-purpose.
_PRIVATE = [
    ipaddress.ip_network(net) for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
]


class RefusedAddress(ValueError):
    """A receiver URL or address the policy refuses; ``str()`` says why, without the URL's path or query."""


def address_refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a public unicast address (None if it is one)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return f"{address} is an IPv4-mapped IPv6 address"
    if address.is_loopback:
        return f"{address} is a loopback address"
    if address.is_link_local:
        return f"{address} is a link-local address (cloud metadata services live there)"
    if address.is_multicast:
        return f"{address} is a multicast address"
    if address.is_unspecified:
        return f"{address} is the unspecified address"
    if any(address in net for net in _PRIVATE):
        return f"{address} is a private address"
    if address.is_private or not address.is_global or any(address in net for net in _ALSO_REFUSED):
        return f"{address} is a special-purpose address (IANA), not a public one"
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
