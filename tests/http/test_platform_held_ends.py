"""The service runs the held platform ends (service/app.py): an end event without the analysis, held by the
ingestion rules, is ended by the scheduled inactivity pass once analysis_grace has passed, not before; on
every backend."""

from __future__ import annotations

import secrets

from caller_memory.service.app import scheduled_inactivity_ends
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.platforms.connections import Connection
from caller_memory.service.domain.platforms.records import CallEnd, SpokenMessage
from caller_memory.service.domain.store.transcripts import ConversationKey
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.platform_routes import INGESTION

from tests.conftest import running_api

CALLER = "+14155550100"
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["cheese"], "retention": "P30D"},
        "conversation": {"enabled": True},
    }
}


async def test_a_held_end_is_run_by_the_scheduled_pass_after_analysis_grace(
    store_url: str, clock: FakeClock
) -> None:
    async with running_api(store_url, clock, store_timeout=5.0, secret_key=secrets.token_bytes(32)) as api:
        services = api.app[SERVICES]
        shop, _ = await services.projects.apply("shop", CONFIG, actor="test")
        connection = Connection(
            "shop", "retell", {"cheese": "cheese"}, "phone", None, "PT2H", {}, None, None, 0
        )
        ended = CallEnd(
            platform="retell",
            conversation_id="retell:r-1",
            caller=CALLER,
            messages=[SpokenMessage("user", "Brie please")],
            extracted={"cheese": "brie"},
            end_reason="completed",
            carries_analysis=False,
        )
        answer = await api.app[INGESTION].end(shop, connection, ended)
        assert answer.outcome == "held"
        key = ConversationKey("shop", "retell:r-1")
        clock.advance(599)
        await scheduled_inactivity_ends(api.app)
        assert (await services.store.read_conversation(key, clock.now_ms()))[0] is None
        clock.advance(2)
        await scheduled_inactivity_ends(api.app)
        header, _ = await services.store.read_conversation(key, clock.now_ms())
        assert header is not None and header.ended_by == "explicit" and header.messages == 1
        fields = (await services.memory.read(shop, CALLER)).fields
        assert fields == {"cheese": b'"brie"'}
