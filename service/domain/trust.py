"""Caller-ID trust (SPEC sections 13 and 14): which of a caller's fields a call qualifies for.

A call brings its caller-ID attestation (STIR/SHAKEN ``A``, ``B``, ``C``, ``failed`` or ``unknown``, normalised
from the provider's own string by :mod:`.attestation`) and whether the caller passed a step-up check in this
call (a PIN or one-time code the agent verified). The project classifies its state keys
(``field_classes``; a key without a class is ``personal``) and sets the level each class needs (``trust``;
``personal`` needs ``any`` unless configured):

========== ====================================================================================
``any``     every call
``A_or_B``  attestation A or B
``A``       attestation A
``step_up`` a step-up check passed in this call
========== ====================================================================================

A passed step-up check satisfies every level: the caller proved who they are, which no attestation does.
An ``unknown`` attestation (outside North America, or a provider that sends none) counts as the project's
``unknown_attestation`` (default ``C``): configured, never a silent pass.

What a call does not qualify for is *withheld*: not returned by any read (memory, context, start and
resume), not written or deleted by its end or its checkpoints, and listed by name. The list is the state
keys of the classes the call falls short of, whether or not the caller has them: it says nothing about the
caller. Admin and operator requests are not calls: no trust applies to them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from .attestation import ATTESTATIONS, normalize_attestation

LEVELS = ("any", "A_or_B", "A", "step_up")
ATTESTATION_HELP = (
    "the call's caller-ID attestation as the telephony provider sent it (Twilio's StirVerstat, Telnyx's "
    "verstat, ...) or normalised (A, B, C, failed, unknown); absent: unknown"
)
STEP_UP_HELP = "the caller passed a step-up check in this call (a PIN or one-time code the agent verified)"
#: The class of a state key that ``field_classes`` does not name.
DEFAULT_CLASS = "personal"
#: The class whose level a dropped call's transcript needs to be offered in ``resume`` (SPEC section 14).
TRANSCRIPT_CLASS = "sensitive"


@dataclass(frozen=True, slots=True)
class CallTrust:
    """What one call brings: its normalised attestation and whether a step-up check passed."""

    attestation: str = "unknown"
    step_up: bool = False

    @classmethod
    def of(cls, attestation: str | None, step_up: bool | None) -> CallTrust:
        if attestation is None and not step_up:
            return UNKNOWN_CALL  # most calls: no attestation sent
        return _call_trust(attestation, bool(step_up))


#: A call that brought nothing: no attestation, no step-up.
UNKNOWN_CALL = CallTrust()


@lru_cache(maxsize=1024)  # a provider sends a handful of strings; a refused one raises and is not kept
def _call_trust(attestation: str | None, step_up: bool) -> CallTrust:
    return CallTrust(normalize_attestation(attestation), step_up)


def qualifies(level: str, attestation: str, step_up: bool) -> bool:
    """Whether a call with this (effective, never ``unknown``) attestation meets ``level``."""
    if step_up or level == "any":
        return True
    if level == "A_or_B":
        return attestation in ("A", "B")
    if level == "A":
        return attestation == "A"
    return False  # step_up


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """A project's trust rules compiled for the hot path: what each possible call withholds, worked out
    once (there are ten kinds of call: five attestations, with or without step-up)."""

    #: The level of each state key that needs more than ``any``.
    levels: Mapping[str, str] = field(default_factory=dict)
    unknown_as: str = "C"
    #: The level a dropped call's transcript needs in ``resume``.
    transcript_level: str = "any"
    _withheld: Mapping[tuple[str, bool], tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        state_keys: list[str],
        field_classes: Mapping[str, str],
        trust: Mapping[str, str],
        unknown_as: str,
    ) -> TrustPolicy:
        class_levels = {DEFAULT_CLASS: "any", **trust}
        levels = {
            name: class_levels[field_classes.get(name, DEFAULT_CLASS)]
            for name in state_keys
            if class_levels[field_classes.get(name, DEFAULT_CLASS)] != "any"
        }
        withheld: dict[tuple[str, bool], tuple[str, ...]] = {}
        for attestation in ATTESTATIONS:
            effective = unknown_as if attestation == "unknown" else attestation
            for step_up in (False, True):
                withheld[(attestation, step_up)] = tuple(
                    sorted(name for name, level in levels.items() if not qualifies(level, effective, step_up))
                )
        return cls(levels, unknown_as, class_levels.get(TRANSCRIPT_CLASS, "any"), withheld)

    @property
    def active(self) -> bool:
        """Whether any field needs more than ``any`` (else every call qualifies for everything)."""
        return bool(self.levels)

    def withheld(self, call: CallTrust | None) -> tuple[str, ...]:
        """The state keys ``call`` does not qualify for, in name order (none for ``None``: not a call)."""
        if call is None or not self.levels:
            return ()
        return self._withheld[(call.attestation, call.step_up)]

    def effective(self, call: CallTrust) -> str:
        return self.unknown_as if call.attestation == "unknown" else call.attestation

    def may_resume_transcript(self, call: CallTrust | None) -> bool:
        """Whether ``call`` may be offered its dropped call's transcript."""
        return call is None or qualifies(self.transcript_level, self.effective(call), call.step_up)


def withheld_etag(etag: str, withheld: tuple[str, ...]) -> str:
    """The ETag of a memory answer with ``withheld`` left out: it differs from the whole memory's (a cache
    keyed by it must not serve one call's answer to a call that qualifies for more, or less)."""
    if not withheld:
        return etag
    digest = hashlib.sha1(f"{etag}\n{','.join(withheld)}".encode(), usedforsecurity=False).hexdigest()
    return f'"{digest[:20]}"'
