"""Issue 27, item 13: an attestation is matched on its ASCII letters only. Values that Unicode case mapping
turns into a provider's value (the long s and sharp s fold to 's' and 'ss', the ligature 'ﬁ' to 'fi', the
Kelvin sign lowers to 'k') are refused with a 422 naming ``attestation``, through the normaliser and through
the HTTP read and end on every backend, and the read never grants their level."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from caller_memory.service.domain.attestation import normalize_attestation
from caller_memory.service.domain.errors import InvalidInput

from tests.conftest import Api
from tests.http.test_api import assert_problem
from tests.http.test_trust import BASE, CALLER, EVERYTHING, TRUST_CONFIG, read_path

#: Look-alikes of accepted values; the first five (a case fold took them to the value) and the last (strip()
#: took Unicode spaces) matched before.
LOOK_ALIKES = [
    "TN-Validation-Pa\u017f\u017fed-A",  # long s: Twilio's A level
    "TN-Validation-Pa\u00dfed",  # sharp s: Telnyx's A level
    "Veri\ufb01ed",  # 'ﬁ' ligature: Plivo's A level
    "Not Veri\ufb01ed",
    "un\u212anown",  # Kelvin sign
    "TN-Val\u0130dation-Passed-A",  # dotted capital I
    "TN-Val\u0131dation-Passed-A",  # dotless i
    "\uff21",  # full-width A
    "TN-Validation-Passed-\uff21",
    "\u0410",  # Cyrillic A
    "\u00a0A\u00a0",  # no-break spaces around a level
]


@pytest.fixture
async def bank(api: Api) -> dict[str, str]:
    tokens = await api.project_with_tokens("bank", TRUST_CONFIG)
    reply = await api.call("PATCH", f"{BASE}/callers/{CALLER}/memory", token=tokens["admin"], json=EVERYTHING)
    assert reply.status == 200, reply.body
    return tokens


@pytest.mark.parametrize("written", LOOK_ALIKES)
def test_look_alikes_of_an_attestation_are_refused(written: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        normalize_attestation(written)
    assert refused.value.field == "attestation"
    assert written not in refused.value.detail


def test_ascii_values_still_read_in_any_case() -> None:
    assert normalize_attestation(" tn-validation-PASSED-a\t") == "A"
    assert normalize_attestation("VERIFIED") == "A"
    assert normalize_attestation("UNKNOWN") == "unknown"


@pytest.mark.parametrize("written", LOOK_ALIKES[:5])
async def test_a_look_alike_gets_a_422_on_every_path_and_grants_nothing(
    api: Api, bank: dict[str, str], written: str
) -> None:
    read = await api.call("GET", read_path(quote(written), False), token=bank["agent"])
    assert_problem(read, 422, mentions="attestation")
    body = {"caller": CALLER, "attestation": written, "state": {"caller_name": "Eve", "balance": 0}}
    ended = await api.call("POST", f"{BASE}/conversations/look-alike/end", token=bank["agent"], json=body)
    assert_problem(ended, 422, mentions="attestation")
    memory = await api.call("GET", read_path(None, False), token=bank["admin"])
    assert memory.body["fields"]["caller_name"] == "Ada" and memory.body["fields"]["balance"] == 12
