"""The HTTP side of webhook delivery (service/domain/webhooks/delivery.py's :class:`Sender`), with aiohttp's
client.

- The host is resolved by :class:`CheckedResolver`, which refuses the whole name when any address it
  resolves to is not public (the SSRF policy of service/domain/webhooks/policy.py), and hands aiohttp exactly
  the addresses it checked: the connection goes to one of those, never to a second resolution's answer. An
  IP literal (which aiohttp does not resolve) is checked before the request. No DNS cache: every attempt
  checks afresh.
- Redirects are not followed (a 3xx is a failed attempt: a receiver is registered by its final URL).
- The response body is read (at most 64 KiB, so that the connection can be reused) and dropped: it is never
  logged or kept. What an attempt keeps is the status, or a short reason.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from ..domain.webhooks.delivery import SendResult
from ..domain.webhooks.policy import RefusedAddress, WebhookPolicy

#: Most bytes of a receiver's answer read before the connection is given up.
MAX_ANSWER_BYTES = 64 * 1024


class CheckedResolver(AbstractResolver):
    """Resolves with the system resolver and applies the policy to every address found."""

    def __init__(self, policy: WebhookPolicy) -> None:
        self._policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=family)
        self._policy.check_addresses(host, [str(info[4][0]) for info in infos])
        results: list[ResolveResult] = []
        for found_family, _, proto, _, address in infos:
            results.append(
                {
                    "hostname": host,
                    "host": str(address[0]),
                    "port": int(address[1]),
                    "family": found_family,
                    "proto": proto,
                    "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                }
            )
        return results

    async def close(self) -> None:
        return None


class HttpSender:
    """One client session for every delivery of this process (its connections are reused per host)."""

    def __init__(self, policy: WebhookPolicy) -> None:
        self._policy = policy
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool-wide or per-host bound: endpoints on one host (or hung ones) must not wait for each
            # other's connections. What bounds the connections is the worker's per-endpoint concurrency.
            connector = aiohttp.TCPConnector(
                resolver=CheckedResolver(self._policy), use_dns_cache=False, limit=0, limit_per_host=0
            )
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, url: str, headers: dict[str, str], body: bytes, limit_s: float) -> SendResult:
        target = URL(url)
        refusal = self._policy.literal_refusal(target.host or "")
        if refusal is not None:
            return SendResult(None, f"refused: {refusal}")
        try:
            async with self._client().post(
                target,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=limit_s),
            ) as response:
                await _drain(response)
                if 300 <= response.status < 400:
                    return SendResult(response.status, f"HTTP {response.status} (redirects are not followed)")
                return SendResult(response.status)
        except RefusedAddress as exc:
            return SendResult(None, f"refused: {exc}")
        except aiohttp.ClientConnectorError as exc:
            cause: Any = exc.os_error
            if isinstance(cause, RefusedAddress):
                return SendResult(None, f"refused: {cause}")
            return SendResult(None, f"cannot connect ({type(cause).__name__})")
        except TimeoutError:
            return SendResult(None, f"timeout after {limit_s:g} s")
        except aiohttp.ClientError as exc:
            return SendResult(None, f"failed ({type(exc).__name__})")


async def _drain(response: aiohttp.ClientResponse) -> None:
    read = 0
    async for chunk in response.content.iter_chunked(16 * 1024):
        read += len(chunk)
        if read >= MAX_ANSWER_BYTES:
            response.close()
            return
