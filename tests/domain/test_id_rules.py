"""No phone number in the ids a client chooses (issue 27, item 6): found by the redaction's matcher in the
project's and the caller's regions; UUIDs, platform SIDs and other random tokens are never taken for one."""

from __future__ import annotations

import random
import secrets
import uuid

import pytest
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.id_rules import check_chosen_id, holds_phone_number

REGIONS = ("GB", "US")

HOLDING = [
    "conv-+14155550100",
    "call_14155550100",
    "c4155550100",  # glued to a letter
    "caller-415-555-0100",
    "call 415.555.0100",
    "tel:+447911123456",
    "call-07911123456",  # a GB mobile, national form
    "call-447911123456",  # with its country code, no plus
    "x+33612345678",  # French, international
    "agent-\uff0b14155550100",  # a full-width plus
]
NOT_HOLDING = [
    "call-1",
    "room-2024-12-06",
    "room-2026-12-06-0001",
    "order-12345678",
    "call-1678901230",  # epoch seconds: a valid GB number only without its leading 0, as nobody writes one
    "call-1678901230000",  # epoch milliseconds
    "shop:ticket:99812",
    "sess_01HZX3K9T5",
]


@pytest.mark.parametrize("value", HOLDING)
def test_an_id_holding_a_number_is_found(value: str) -> None:
    assert holds_phone_number(value, REGIONS)


@pytest.mark.parametrize("value", NOT_HOLDING)
def test_an_id_without_a_number_is_left_alone(value: str) -> None:
    assert not holds_phone_number(value, REGIONS)


@pytest.mark.parametrize("region", ["FR", "IT", "GB", "US", "DE"])
def test_ids_of_a_date_and_a_counter_are_taken_in_every_region(region: str) -> None:
    rng = random.Random(15)
    ids = [
        f"conv-{rng.randrange(2000, 2030)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}-{rng.randrange(10**6):06d}"
        for _ in range(600)
    ]
    assert [value for value in ids if holds_phone_number(value, (region,))] == []
    assert not holds_phone_number("conv-2024-06-15T12:30:45", (region,))


def test_the_callers_region_is_read_too() -> None:
    french = "call-0612345678"  # a French mobile in its national form
    assert not holds_phone_number(french, ("GB",))
    assert holds_phone_number(french, ("GB", "FR"))


def test_ids_platforms_make_are_never_refused() -> None:
    rng = random.Random(27)
    uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(5000)]
    for made in (
        uuids,
        ["vapi:" + u for u in uuids[:1000]],
        ["CA" + secrets.token_hex(16) for _ in range(2000)],  # Twilio's call SIDs
        ["PN" + secrets.token_hex(16).upper() for _ in range(500)],
        [secrets.token_hex(16) for _ in range(2000)],
    ):
        refused = [value for value in made if holds_phone_number(value, REGIONS)]
        assert refused == [], refused[:3]


def test_the_refusal_names_the_member_and_never_echoes_the_id() -> None:
    with pytest.raises(InvalidInput) as refused:
        check_chosen_id("call-+14155550100", "conversation_id", "conversation id", REGIONS)
    assert refused.value.field == "conversation_id"
    assert "4155550100" not in str(refused.value.detail) and "phone number" in str(refused.value.detail)
    check_chosen_id(None, "channel", "channel", REGIONS)  # nothing to check
