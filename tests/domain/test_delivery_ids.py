"""The ``webhook-id`` of a delivery (service/domain/webhooks/service.py, ``delivery_id_of``): a receiver deduplicates by
it, so it must stay what it was for every event, whatever computes it: the lower-case base 32 of the first 20
bytes of a SHA-256, as the standard library writes it."""

from __future__ import annotations

import base64
import hashlib

from caller_memory.service.domain.store.webhooks import WebhookEndpoint
from caller_memory.service.domain.webhooks.service import base32_20, delivery_id_of
from hypothesis import example, given
from hypothesis import strategies as st


@given(st.binary(min_size=20, max_size=40))
@example(b"\x00" * 20)
@example(b"\xff" * 20)
@example(bytes(range(20)))
@example(bytes(1 << (i % 8) for i in range(20)))  # one bit per byte: every group boundary
def test_base32_writes_what_the_standard_library_writes(data: bytes) -> None:
    assert base32_20(data) == base64.b32encode(data[:20]).decode().lower()


@given(st.text(min_size=1, max_size=30), st.sampled_from(["conversation.ended", "caller.erased"]))
def test_a_delivery_id_is_the_base32_of_the_hash_of_what_made_it(about: str, kind: str) -> None:
    endpoint = WebhookEndpoint("cheese-shop", "wh_0123", "https://example.com/hook", (kind,), False, 0, b"")
    digest = hashlib.sha256(f"cheese-shop\x00wh_0123\x00{kind}\x00{about}".encode()).digest()
    expected = "msg_" + base64.b32encode(digest[:20]).decode().lower().rstrip("=")
    assert delivery_id_of(endpoint, kind, about) == expected
