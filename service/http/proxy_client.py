"""The memory proxy's HTTP side toward the upstream model, with aiohttp's client.

- One client session per process, with no pool-wide or per-host bound: one project's hung upstream holds its
  own connections only, and never makes another project's wait for one.
- Destinations follow the webhooks' rules (SPEC section 14): the host is resolved by the webhook sender's
  :class:`~caller_memory.service.http.webhook_sender.CheckedResolver` (every address checked, the connection
  made to one of those), an IP literal is checked before the request; no DNS cache, no redirects, no proxy
  from the environment.
- Nothing is decoded: ``Accept-Encoding: identity`` is asked for, and whatever encoding the upstream uses
  anyway passes through with its ``Content-Encoding`` (``auto_decompress=False``).
- ``timeout`` bounds the connection, the wait for the answer's head and each read of its body (an idle gap).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from yarl import URL

from ..domain.webhooks.policy import RefusedAddress, WebhookPolicy
from ..proxy.upstream import Upstream
from .webhook_sender import CheckedResolver


class UpstreamFailed(Exception):
    """The upstream could not be reached, refused by the destination rules, or timed out before answering;
    ``code`` names which (the OpenAI-shaped 502's ``error.code``). The message names no address."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProxyClient:
    def __init__(self, policy: WebhookPolicy) -> None:
        self._policy = policy
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=CheckedResolver(self._policy), use_dns_cache=False, limit=0, limit_per_host=0
            )
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, upstream: Upstream, body: Callable[[], Awaitable[bytes]], accept: str
    ) -> aiohttp.ClientResponse:
        """The upstream's answer to a completion, its head read and its body not yet. ``body()`` is
        awaited once the connection is being made (the memory read runs meanwhile), and sent as it comes."""
        target = URL(upstream.completions_url)
        if self._policy.literal_refusal(target.host or "") is not None:
            raise UpstreamFailed("upstream_refused", "the upstream's address is not allowed")
        headers = {
            "Authorization": f"Bearer {upstream.api_key}",
            "Content-Type": "application/json",
            "Accept": accept,
            "Accept-Encoding": "identity",
        }

        async def sent() -> AsyncIterator[bytes]:
            yield await body()

        timeout = aiohttp.ClientTimeout(total=None, connect=upstream.timeout, sock_read=upstream.timeout)
        try:
            return await self._client().post(
                target, data=sent(), headers=headers, allow_redirects=False, timeout=timeout
            )
        except RefusedAddress:
            raise UpstreamFailed("upstream_refused", "the upstream's address is not allowed") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, RefusedAddress):
                raise UpstreamFailed("upstream_refused", "the upstream's address is not allowed") from None
            raise UpstreamFailed("upstream_unreachable", "the upstream model could not be reached") from None
        except TimeoutError:
            raise UpstreamFailed(
                "upstream_timeout",
                f"the upstream model did not answer within {upstream.timeout:g} s",
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailed(
                "upstream_unreachable", f"the upstream model failed ({type(exc).__name__})"
            ) from None
