"""The HTTP tests also run on Redis Cluster: ``store_url`` (and so ``api``) gets a third parameter here."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import BACKENDS, CLUSTER, empty_store_url


@pytest.fixture(params=[*BACKENDS, CLUSTER])
async def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return empty_store_url(request, request.param, tmp_path)
