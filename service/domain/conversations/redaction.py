"""What a transcript loses before it is stored (SPEC sections 10 and 14): the phone numbers said in
it (every number with ``redact_phone_numbers``, the caller's own identifiers always), found by
:mod:`.redaction` in the regions of the project and of the conversation's caller, at a cost bounded per byte,
in slices that give the event loop back within each project's CPU budget.

The caller's region is the one of their number when the request names them, else the one kept with the
conversation (never the number: :attr:`~caller_memory.service.domain.store.transcripts.Header.region`), remembered per conversation by this
process and read from the store only when a text holds digits enough for a number.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import InvalidIdentifier, PayloadTooLarge
from ..id_rules import check_chosen_id, might_hold_number
from ..memory import Caller, MemoryService
from ..projects import Project
from ..redaction import EVERY, Mask, enough_digits
from ..redaction_batches import CpuBudget, redact_batch_async
from ..store import CallerRef, Store
from ..store.links import Link
from ..store.transcripts import ConversationKey, NewMessage
from .messages import (
    MAX_MESSAGE_BYTES,
    Incoming,
    encode_message,
    estimate_tokens,
    redact_identifiers,
    region_of,
    regions_to_try,
)
from .requests import Batch

#: How long (ms) and for how many profiles a process keeps a profile's links.
LINKS_CACHE_MS = 60_000
LINKS_CACHE_SIZE = 10_000
#: How many conversations' regions a process remembers.
REGION_CACHE = 8192

#: Redacts the texts of one batch together (a number may run from one into the next).
Redactor = Callable[[Sequence[str]], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class Owned:
    """The caller's own identifiers, by pseudonym (the profile's and its links'), and whether any is an
    account id (then words are checked too)."""

    subjects: frozenset[str]
    accounts: bool
    memory: MemoryService
    project: Project

    def holds(self, canonical: str) -> bool:
        """Whether ``canonical`` (``+E164``, ``email:...``, ``account:...``) is one of the caller's."""
        try:
            return self.memory.caller(self.project, canonical).subject in self.subjects
        except InvalidIdentifier:
            return False


def caller_region(caller: Caller | None) -> str:
    """The region of the caller's number ("" when the caller is not known by a number)."""
    return (region_of(caller.e164) or "") if caller is not None and caller.e164 else ""


def regions_of(project: Project, caller: Caller | None, region: str = "") -> list[str | None]:
    """The regions numbers are read in: the project's, then the caller's (their number's when the request
    names them, else ``region``, the one kept with the conversation)."""
    return regions_to_try(project.default_region, caller_region(caller) or region or None)


def _strings(value: Any, out: list[str]) -> None:
    """The strings of a JSON value (not its keys), in order."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _strings(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _strings(item, out)


def _replaced(value: Any, texts: Iterator[str]) -> Any:
    """``value`` with its strings replaced, in order, by ``texts``."""
    if isinstance(value, str):
        return next(texts)
    if isinstance(value, list):
        return [_replaced(item, texts) for item in value]
    if isinstance(value, dict):
        return {key: _replaced(item, texts) for key, item in value.items()}
    return value


def check_ids(conversation_id: str, batch: Batch, regions: Sequence[str | None], *, creates: bool) -> None:
    """Refuse the ids of an append that hold a phone number (:mod:`.id_rules`): the conversation's id,
    channel and agent when it creates the conversation (the first request to name them), and each message's
    id and agent."""
    named = [m.message_id or "" for m in batch.messages] + [m.agent or "" for m in batch.messages]
    if creates:
        named += [conversation_id, batch.channel or "", batch.agent or ""]
    if not might_hold_number("\n".join(named)):  # nearly every batch: no id with digits enough
        return
    if creates:
        check_chosen_id(conversation_id, "conversation_id", "conversation id", regions)
        check_chosen_id(batch.channel, "channel", "channel", regions)
        check_chosen_id(batch.agent, "agent", "agent name", regions)
    for index, message in enumerate(batch.messages):
        check_chosen_id(message.message_id, f"messages[{index}].message_id", "message id", regions)
        check_chosen_id(message.agent, f"messages[{index}].metadata.agent", "agent name", regions)


class TranscriptRedaction:
    """The redaction of one project's transcripts, per process: a CPU budget per project, and caches of the
    profiles' links and the conversations' regions."""

    def __init__(self, store: Store, memory: MemoryService) -> None:
        self._store = store
        self._memory = memory
        self.budget = CpuBudget()
        #: (project, profile) -> (its links, until when to use them): whose words a transcript loses.
        self._links_cache: dict[tuple[str, str], tuple[list[Link], int]] = {}
        #: Conversation -> its caller's region as kept with it (bounded; the oldest entry goes first).
        self._regions: dict[ConversationKey, str] = {}

    def remember_region(self, key: ConversationKey, region: str) -> None:
        regions = self._regions
        if regions.get(key) != region:
            regions[key] = region
            if len(regions) > REGION_CACHE:
                del regions[next(iter(regions))]

    def known_region(self, key: ConversationKey) -> str | None:
        """The conversation's caller's region if this process has seen it (None: read the header)."""
        return self._regions.get(key)

    @staticmethod
    def mask(project: Project, caller: Caller | None, own: Owned) -> Mask:
        """What redaction masks: every number with ``redact_phone_numbers``, else the caller's own only
        (known by their number, or by the pseudonyms of their identifiers)."""
        if project.conversation.redact_phone_numbers:
            return EVERY
        numbers = frozenset({caller.e164}) if caller is not None and caller.e164 else frozenset()
        return Mask(every=False, numbers=numbers, holds=own.holds if own.subjects else None)

    async def owned(self, project: Project, caller: Caller | None, subject: str, now: int) -> Owned:
        """The caller's own identifiers, by pseudonym: the conversation's caller (``subject``, the
        profile's) and, with identity linking, every identifier linked to it (cached a minute: a link made
        meanwhile shows in the next minute's messages). Their words are removed from transcripts whatever
        ``redact_phone_numbers`` says."""
        subject = subject or (caller.subject if caller is not None else "")
        accounts = caller is not None and caller.kind == "account"
        if not subject:
            return Owned(frozenset(), False, self._memory, project)
        subjects = {subject} | ({caller.subject} if caller is not None else set())
        if project.identity_linking:
            key = (project.project_id, subject)
            cached = self._links_cache.get(key)
            if cached is None or cached[1] <= now:
                links = await self._store.list_links(CallerRef(project.project_id, subject), now)
                cached = (links, now + LINKS_CACHE_MS)
                if len(self._links_cache) >= LINKS_CACHE_SIZE:
                    self._links_cache.clear()
                self._links_cache[key] = cached
            subjects |= {link.subject for link in cached[0]}
            accounts = accounts or any(link.kind == "account" for link in cached[0])
        return Owned(frozenset(subjects), accounts, self._memory, project)

    def redactor(
        self, project: Project, caller: Caller | None, own: Owned, regions: Sequence[str | None]
    ) -> Redactor:
        """What redacts the texts of one batch together, in slices that give the event loop back, within
        the project's CPU budget, reading numbers in ``regions`` (:func:`regions_of`)."""
        mask = self.mask(project, caller, own)
        every_email = project.conversation.redact_phone_numbers
        holds = own.holds if own.subjects else None
        budget, key = self.budget, project.project_id

        async def redact(texts: Sequence[str]) -> list[str]:
            found = await redact_batch_async(texts, regions, mask, budget=budget, key=key)
            return [
                redact_identifiers(text, every_email=every_email, own=holds, accounts=own.accounts)
                for text in found
            ]

        return redact

    @staticmethod
    async def checkpoint(checkpoint: bytes | None, redactor: Redactor) -> bytes | None:
        """A state checkpoint (encoded JSON) with its values redacted like a transcript's content (by the
        batch's ``redactor``: in slices, within the project's CPU budget): it is stored, offered back in
        ``resume`` and persisted by an inactivity end. Keys are kept as they are."""
        if checkpoint is None or not enough_digits(checkpoint.decode()):
            return checkpoint
        state = orjson.loads(checkpoint)
        texts: list[str] = []
        _strings(state, texts)
        return orjson.dumps(_replaced(state, iter(await redactor(texts))))

    async def state_value(self, project: Project, subject: str, region: str, value: bytes, now: int) -> bytes:
        """A state value (encoded JSON) of the conversation of ``subject`` (its caller) and ``region`` (its
        number's), redacted as its checkpoint would be: a value remembered through MCP is persisted by the
        call's end like the checkpoint's."""
        own = await self.owned(project, None, subject, now)
        redactor = self.redactor(project, None, own, regions_of(project, None, region))
        wrapped = await self.checkpoint(b'{"v":' + value + b"}", redactor)
        assert wrapped is not None  # a checkpoint in, a checkpoint out
        return orjson.dumps(orjson.loads(wrapped)["v"])

    @staticmethod
    async def encode(messages: Sequence[Incoming], redactor: Redactor, now: int) -> list[NewMessage]:
        """Redact (the batch's contents together, and its originals together) and encode; each message
        within MAX_MESSAGE_BYTES (413 naming it)."""
        out: list[NewMessage] = []
        contents = await redactor([message.content for message in messages]) if messages else []
        originals: dict[int, str] = {}
        interrupted = {i: m.original for i, m in enumerate(messages) if m.original is not None}
        if interrupted:
            originals = dict(zip(interrupted, await redactor(list(interrupted.values())), strict=True))
        for index, message in enumerate(messages):
            content = contents[index]
            original = originals.get(index)
            body = encode_message(message, content, original, message.timestamp or now)
            if len(body) > MAX_MESSAGE_BYTES:
                raise PayloadTooLarge(
                    f"messages[{index}] is {len(body):,} bytes stored; the limit per message is "
                    f"{MAX_MESSAGE_BYTES:,} bytes",
                    field=f"messages[{index}]",
                )
            tokens = message.tokens if message.tokens is not None else estimate_tokens(content)
            out.append(NewMessage(message.turn_id, body, message.message_id, tokens))
        return out
