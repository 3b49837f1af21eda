"""The SIP participant of a LiveKit call, as LiveKit describes it in its attributes: the caller's number, the
call's id, its caller-ID attestation, and which of its disconnects are hang-ups. The LiveKit drop-in
(:mod:`caller_memory.sdk.livekit`) exports what is public here."""

from __future__ import annotations

from livekit import rtc

from . import _trust

#: The SIP participant attributes LiveKit sets (no constant for them exists in LiveKit's packages):
#: the caller's number on an inbound call (the dialled one on an outbound call; absent when the dispatch
#: rule hides the number), and LiveKit's id of the call, which is the conversation id (room names
#: usually contain the number, so they are not used).
SIP_PHONE_NUMBER = "sip.phoneNumber"
SIP_CALL_ID = "sip.callID"
#: Where the call's attestation is looked for when no attribute is named, in this order. LiveKit maps the
#: INVITE's headers to ``sip.h.<name in lower case>`` when the inbound trunk's ``include_headers`` asks for
#: them: ``SIP_X_HEADERS`` brings Twilio Elastic SIP Trunking's ``X-Twilio-VerStat`` (its value is the
#: verification result), ``SIP_ALL_HEADERS`` also ``P-Asserted-Identity``, whose ``verstat`` parameter is
#: where Telnyx (and carriers following 3GPP TS 24.229) put it. ``From`` is not read by default: a caller
#: writes their own From header.
SIP_ATTESTATION_ATTRIBUTES = ("sip.h.x-twilio-verstat", "sip.h.p-asserted-identity")
#: How a participant's disconnect that is a hang-up reads (others are a line that dropped).
HANG_UPS = frozenset(
    {
        rtc.DisconnectReason.CLIENT_INITIATED,
        rtc.DisconnectReason.ROOM_DELETED,
        rtc.DisconnectReason.USER_REJECTED,
    }
)


def caller_from_participant(participant: rtc.Participant) -> tuple[str | None, str | None]:
    """The caller's number and the call's id (``sip.phoneNumber``, ``sip.callID``) of a SIP participant;
    ``(None, None)`` for any other participant (a browser, another agent)."""
    if participant.kind != rtc.ParticipantKind.PARTICIPANT_KIND_SIP:
        return None, None
    attributes = participant.attributes
    return attributes.get(SIP_PHONE_NUMBER) or None, attributes.get(SIP_CALL_ID) or None


def attestation_from_participant(participant: rtc.Participant, attribute: str | None = None) -> str | None:
    """The call's caller-ID attestation in a SIP participant's attributes, or None: no SIP participant, or no
    attestation (outside North America, a trunk that maps no header).

    ``attribute`` names the one to read (what a trunk's ``headers_to_attributes`` maps the header to, or a
    ``sip.h.*`` header of your carrier's); its value is the verification result itself or a header holding a
    ``verstat`` parameter. Without it, :data:`SIP_ATTESTATION_ATTRIBUTES` are read in order. A value found
    that is not a STIR/SHAKEN verification result (``TN-Validation-...``, ``No-TN-Validation``, a bare level)
    counts as ``"failed"``: one that cannot be read grants nothing."""
    if participant.kind != rtc.ParticipantKind.PARTICIPANT_KIND_SIP:
        return None  # a browser or another agent sets its own attributes: they attest nothing
    attributes = participant.attributes
    for name in (attribute,) if attribute is not None else SIP_ATTESTATION_ATTRIBUTES:
        value = attributes.get(name)
        if not value:
            continue
        lowered = value.lower()
        # A header with a URI (P-Asserted-Identity, From) holds it as a parameter, or not at all.
        header = "verstat" in lowered or "sip:" in lowered or "tel:" in lowered or "<" in value
        found = _trust.from_provider(value, header=header)
        if found is not None:
            return found
    return None
