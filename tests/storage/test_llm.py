"""The memory proxy's upstreams (service/domain/store/llm.py) on every backend: one document per project,
replaced whole, read back byte for byte, deleted; projects apart."""

from __future__ import annotations

import uuid

from caller_memory.service.domain.store import Store


async def test_an_upstream_is_kept_replaced_and_deleted_per_project(store: Store) -> None:
    project, other = f"shop-{uuid.uuid4().hex[:8]}", f"deli-{uuid.uuid4().hex[:8]}"
    assert await store.get_llm(project) is None
    assert await store.put_llm(project, b'{"base_url": "https://a.example/v1"}') is True
    assert await store.put_llm(other, b"\x00\xffother") is True
    assert await store.get_llm(project) == b'{"base_url": "https://a.example/v1"}'
    # Replaced whole, and the answer says there was one already.
    assert await store.put_llm(project, b"\x01sealed\x00bytes") is False
    assert await store.get_llm(project) == b"\x01sealed\x00bytes"
    assert await store.delete_llm(project) is True
    assert await store.get_llm(project) is None
    assert await store.delete_llm(project) is False
    # The other project's stays.
    assert await store.get_llm(other) == b"\x00\xffother"
