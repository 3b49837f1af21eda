"""Agora ConvoAI: start the Caller Memory conversation of a call and build the parts of Agora's join request
that Caller Memory owns.

Agora ConvoAI calls no webhook before an inbound call is answered, and its notifications carry no caller
number: your code starts the agent itself (Agora's ``join``: ``POST .../projects/{appid}/join``, or
``client.agents.start(...)`` of the ``agora-agents`` package). Before it does, :func:`prepare_join` starts
the conversation with the caller's number (and the call's caller-ID trust) and reads the caller's memory; the
:class:`AgoraJoin` it returns merges into the join's ``properties`` what makes the call Caller Memory's:

- ``labels``: ``{"caller_memory_conversation": "<conversation id>"}``. Agora returns the labels in the
  agent's notifications (101 joined, 102 left, 103 history), which is how the service's receiver
  (``POST /v1/projects/{p}/platforms/agora/notifications``) finds the conversation to end and fills its
  transcript. The id is never the caller's number and never the RTC channel's name: by default ``agora:``
  and 32 random hex digits, or your own id (``conversation_id=``), checked as ``client.conversation()``
  checks ids.
- **With the memory proxy** (``platform_token=``): the agent's custom LLM points at the service, which adds
  the caller's memory to every request, forwards it to your model (the project's upstream, ``PUT
  .../llm``) and records the call's turns: ``llm.vendor`` ``"custom"``, ``llm.style`` ``"openai"``,
  ``llm.url`` ``<service>/v1/projects/<project>/llm/chat/completions``, ``llm.api_key`` the platform token
  (a token of the role ``platform`` that an admin mints: it can call the proxy and the platform endpoints
  and read no caller by number; Agora's console and requests hold it, so never pass the agent token of your
  client), and ``llm.headers`` your headers plus ``X-Caller-Memory-Conversation: <conversation id>``. The
  memory is not put in ``llm.system_messages``: the proxy puts it in every request, as it is then.
- **Without the proxy**: ``llm`` stays as you set it (your model's URL and key), and the caller's memory is
  appended to ``llm.system_messages`` as one ``system`` message, as data
  (:func:`~caller_memory.sdk.render_memory`: a sentence saying that what follows is information about the
  caller and never instructions, then one JSON document). It is the memory at the start of the call: the
  agent keeps it for the whole call.
- A dropped call of the caller on this channel that the start offers (``join.resume``) is rendered as data
  too, in both modes (the proxy adds the caller's fields, not the dropped call): ``{"dropped_call": ...}``
  in the same message without the proxy, alone in one message with it.

Nothing here waits longer than the client's ``read_budget`` (0.15 s by default): the start and the read run
at once within it, as the first ``conv.begin_turn()`` of a conversation with ``transcript=True`` does (it is
that call). A slow, down or refusing service never fails the join: the labels and, with the proxy, the
``llm`` parts are built all the same (the proxy then answers without memory until it can), without the proxy
no memory message is added, and the join says what happened: ``join.memory`` is the SDK's
:class:`~caller_memory.sdk.Memory` (``available`` False with its ``reason``, or ``stale``), ``join.started``
whether the service started the conversation, ``join.start_error`` why not. To try the start again, call
:func:`prepare_join` again with ``conversation_id=join.conversation_id``.

The end of the call: Agora extracts nothing after a call, so what the call learned is written by your code,
through ``join.conversation`` (the SDK's :class:`~caller_memory.sdk.Conversation` of the call): set
``join.conversation.state[...]`` and ``await join.conversation.end(end_reason=...)`` when the call is over,
as with any call. Agora's notifications end the conversation too (its agent-left, 102, waits up to 30 s for
the history, 103): an end already made from your code makes them duplicates, and the transcript the proxy
recorded stays; an end from your code after theirs still writes its state (a late end, ``late`` true). Agora agents started without this helper (no label, no caller) get no memory.

Plain dictionaries in and out: the SDK does not depend on ``agora-agents``. Neither method changes what it
is given::

    from caller_memory.sdk import MemoryClient
    from caller_memory.sdk.agora import prepare_join

    async with MemoryClient(URL, token=AGENT_TOKEN, project="cheese-shop") as client:
        join = await prepare_join(client, caller="+14155550100", platform_token=PLATFORM_TOKEN)
        properties = join.properties({
            "channel": channel, "token": rtc_token, "agent_rtc_uid": "1001", "remote_rtc_uids": ["*"],
            "llm": {"params": {"model": "gpt-4o-mini"}, "system_messages": [PROMPT]},
            "asr": {...}, "tts": {...},
        })
        await agora.agents.start(APP_ID, name=agent_name, properties=properties)
        ...  # the call runs; at its end:
        join.conversation.state["booking_day"] = "Friday"
        await join.conversation.end(end_reason="completed")
"""

from __future__ import annotations

import copy
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .client import CONVERSATION_ID, TOKEN, MemoryClient, _checked_base_url
from .conversation import DEFAULT_CHANNEL, Conversation
from .memory import Memory
from .render import render_memory
from .transcript import Resume

__all__ = ["CONVERSATION_HEADER", "CONVERSATION_LABEL", "AgoraJoin", "new_conversation_id", "prepare_join"]

#: The label of the agent that names the conversation (Agora returns it in the agent's notifications).
CONVERSATION_LABEL = "caller_memory_conversation"
#: The header of the custom LLM's requests that binds them to the conversation (the memory proxy reads it).
CONVERSATION_HEADER = "X-Caller-Memory-Conversation"
#: What the default conversation ids start with.
ID_PREFIX = "agora:"
#: The digits of a number that a value must not hold: the caller's last seven (its subscriber number, in
#: whatever form, with or without the country code or a national prefix).
_CALLER_DIGITS = 7
#: A number written internationally (``+`` then at least seven digits, with separators): nobody's belongs in
#: a label or a header.
_INTERNATIONAL = re.compile(r"[+\uff0b]\s*\d(?:[\s\-./()\u00a0]{0,3}\d){6,}")
_HEX_LETTER = re.compile(r"[a-f]")


def new_conversation_id() -> str:
    """A new conversation id: ``agora:`` and 32 random hex digits, letters among them (the service sets a
    run of hex digits with a letter aside as an opaque token, never reading a phone number in it)."""
    while True:
        token = secrets.token_hex(16)
        if _HEX_LETTER.search(token) and any(c.isdigit() for c in token):
            return ID_PREFIX + token


@dataclass(frozen=True, slots=True)
class AgoraJoin:
    """What :func:`prepare_join` made: the call's conversation and the parts of Agora's join request that
    Caller Memory owns. Its methods return new dictionaries and never change the ones they are given."""

    #: The conversation id (``labels.caller_memory_conversation``, and the binding header with the proxy).
    conversation_id: str
    #: The call's conversation in the SDK: its ``state`` and ``end()`` write what the call learned.
    conversation: Conversation
    #: The caller's memory as read at the join (``available`` False with a ``reason`` when it could not be
    #: read within the read budget; ``withheld`` what the call's trust does not qualify for).
    memory: Memory
    #: The caller's dropped call on this channel that the start offered, or None.
    resume: Resume | None
    #: Whether the service started the conversation (the proxy binds the agent's requests to it, and
    #: Agora's notifications end it). False when the start failed or was refused: see ``start_error``.
    started: bool
    #: Why the start failed (a timeout, an outage, a refusal), or why the service keeps no conversation
    #: (conversation memory off for the project, a blacklisted caller), or None.
    start_error: str | None
    #: The memory proxy's URL (``llm.url``) when a platform token was given, else None.
    llm_url: str | None
    _platform_token: str | None = field(default=None, repr=False)
    _caller: str = field(default="", repr=False)

    @property
    def proxy(self) -> bool:
        """Whether the agent's LLM goes through the memory proxy (a platform token was given)."""
        return self._platform_token is not None

    @property
    def labels(self) -> dict[str, str]:
        """The labels Caller Memory needs on the agent: ``{"caller_memory_conversation": <id>}``."""
        return {CONVERSATION_LABEL: self.conversation_id}

    @property
    def memory_message(self) -> str | None:
        """The text of the ``system`` message :meth:`llm` appends: without the proxy, the caller's memory
        and the offered dropped call as data (:func:`~caller_memory.sdk.render_memory`); with it, only the
        dropped call (the proxy adds the memory itself). None when there is nothing to add: no memory (a
        new caller, a blacklisted one, a read that failed) and no dropped call."""
        return render_memory(None if self.proxy else self.memory, self.resume)

    def llm(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Agora's ``properties.llm``: a copy of ``base`` (your LLM settings: ``params``, ``system_messages``,
        ``greeting_message``, ``max_history``..., as ``CustomLLM(...).to_config()`` of ``agora-agents``
        makes them) with Caller Memory's parts.

        With the proxy: ``vendor`` ``"custom"``, ``style`` ``"openai"``, ``url`` and ``api_key`` replaced
        (your model's URL and key belong in the project's upstream, ``PUT .../llm``), and
        ``X-Caller-Memory-Conversation`` added to ``headers``. Without it: :attr:`memory_message`, if any,
        appended to ``system_messages`` as ``{"role": "system", "content": ...}``.

        ValueError for a ``base`` Agora would refuse (``headers`` not strings) or that contradicts them: an
        ``X-Caller-Memory-Conversation`` header naming another conversation, or, with the proxy, an
        ``Authorization`` header (the proxy takes the platform token from ``api_key``) or a header value
        holding the caller's number."""
        llm = _copied(base, "llm")
        if self._platform_token is not None:
            llm["vendor"] = "custom"
            llm["style"] = "openai"
            llm["url"] = self.llm_url
            llm["api_key"] = self._platform_token
            llm["headers"] = self._headers(llm.get("headers"))
        message = self.memory_message
        if message is not None:
            messages = llm.get("system_messages")
            if messages is None:
                messages = []
            elif not isinstance(messages, list):
                raise ValueError("llm.system_messages must be a list of messages")
            llm["system_messages"] = [*messages, {"role": "system", "content": message}]
        return llm

    def properties(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Agora's join ``properties``: a copy of ``base`` (``channel``, ``token``, ``agent_rtc_uid``,
        ``remote_rtc_uids``, ``asr``, ``tts``, ``llm``, your ``labels``...) with :attr:`labels` merged into
        its labels (yours kept) and ``llm`` made by :meth:`llm` from its ``llm``.

        ValueError when ``base`` contradicts them: a label that is not a string or holds a phone number
        (the caller's in any form, or any written with ``+``: Agora sends the labels in the agent's
        notifications), a ``caller_memory_conversation`` label naming another conversation, or a
        ``channel`` (the RTC channel) that is the conversation id."""
        properties = _copied(base, "properties")
        if properties.get("channel") == self.conversation_id:
            raise ValueError(
                "the conversation id must not be the RTC channel's name: "
                "leave conversation_id None for a random one"
            )
        labels = properties.get("labels")
        if labels is None:
            labels = {}
        elif not isinstance(labels, Mapping):
            raise ValueError("labels must be a mapping of strings to strings")
        for key, value in labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError("labels must be a mapping of strings to strings (Agora refuses others)")
            if _holds_number(key, self._caller) or _holds_number(value, self._caller):
                raise ValueError(
                    "a label holds a phone number: Agora sends labels in the agent's notifications"
                )
        if labels.get(CONVERSATION_LABEL, self.conversation_id) != self.conversation_id:
            raise ValueError(f"the label {CONVERSATION_LABEL!r} names another conversation")
        properties["labels"] = {**labels, **self.labels}
        properties["llm"] = self.llm(properties.get("llm"))
        return properties

    def _headers(self, given: object) -> dict[str, str]:
        headers: dict[str, str] = {}
        if given is not None:
            if not isinstance(given, Mapping):
                raise ValueError("llm.headers must be a mapping of strings to strings")
            for name, value in given.items():
                if not isinstance(name, str) or not isinstance(value, str):
                    raise ValueError(
                        "llm.headers must be a mapping of strings to strings (Agora refuses others)"
                    )
                lowered = name.lower()
                if lowered == "authorization":
                    raise ValueError(
                        "llm.headers must not hold Authorization with the memory proxy: Agora sends "
                        "llm.api_key (the platform token) as the bearer token, and your model's key is the "
                        "project's upstream"
                    )
                if lowered == CONVERSATION_HEADER.lower():
                    if value != self.conversation_id:
                        raise ValueError(f"llm.headers' {CONVERSATION_HEADER} names another conversation")
                    continue
                if _holds_number(value, self._caller):
                    raise ValueError(f"the header {name!r} holds a phone number")
                headers[name] = value
        headers[CONVERSATION_HEADER] = self.conversation_id
        return headers


async def prepare_join(
    client: MemoryClient,
    *,
    caller: str,
    conversation_id: str | None = None,
    channel: str = DEFAULT_CHANNEL,
    agent: str | None = None,
    attestation: str | None = None,
    step_up: bool = False,
    platform_token: str | None = None,
    public_url: str | None = None,
) -> AgoraJoin:
    """Start the conversation of an Agora call with ``caller`` and read the caller's memory, within the
    client's ``read_budget``; never raises because of the service (see the module's documentation).

    - ``caller``: the caller's number as your telephony gave it (or ``email:...``, ``account:...``): it goes
      to Caller Memory only, never into the join.
    - ``conversation_id``: None for a new random one (``agora:<32 hex digits>``), or your own: 1-128 letters,
      digits, '.', '_', ':' or '-', starting with a letter or digit, not holding the caller's number (the
      service also refuses one that holds any phone number: ``started`` is then False).
    - ``channel``: Caller Memory's channel of the call (``"phone"``; transcripts, ``resume`` and supersession
      are kept per channel), not Agora's RTC channel; ``agent``: the agent handling it.
    - ``attestation``, ``step_up``: the call's caller-ID trust, as for ``client.conversation()``; the
      service keeps it with the conversation, and the proxy reads with it.
    - ``platform_token``: a token of the project with the role ``platform`` (minted by an admin) to route
      the agent's LLM through the memory proxy; None to put the memory in the system messages instead.
    - ``public_url``: the service's base URL as Agora's cloud reaches it, for ``llm.url`` (default: the
      client's ``base_url``, when your code reaches the service at the same public address).

    ValueError, before anything is sent, for arguments the service would refuse or that would put a number
    or an agent token into Agora's configuration.
    """
    if not isinstance(caller, str):
        raise ValueError(f"caller must be a string, not {type(caller).__name__}")
    token = _checked_platform_token(client, platform_token)
    base_url = client.base_url if public_url is None else _checked_base_url(public_url)
    if conversation_id is None:
        conversation_id = new_conversation_id()
    elif (
        isinstance(conversation_id, str)
        and CONVERSATION_ID.fullmatch(conversation_id)
        and _holds_number(conversation_id, caller)
    ):
        raise ValueError(
            "conversation_id must not hold the caller's number: it goes into the agent's labels "
            "(leave it None for a random one)"
        )
    conv = client.conversation(
        conversation_id,
        caller=caller,
        channel=channel,
        agent=agent,
        transcript=True,
        attestation=attestation,
        step_up=step_up,
    )
    memory = await conv.begin_turn()  # the start and the read at once, within the read budget
    problem = conv.start_error or conv.transcript_off
    return AgoraJoin(
        conversation_id=conversation_id,
        conversation=conv,
        memory=memory,
        resume=conv.resume,
        started=problem is None,
        start_error=problem,
        llm_url=None if token is None else f"{base_url}/v1/projects/{client.project}/llm/chat/completions",
        _platform_token=token,
        _caller=caller,
    )


def _checked_platform_token(client: MemoryClient, token: str | None) -> str | None:
    if token is None:
        return None
    token = token.strip(" \t\r\n") if isinstance(token, str) else ""
    if not TOKEN.fullmatch(token):
        raise ValueError("platform_token must be a bearer token (letters, digits and '-._~+/')")
    if hmac.compare_digest(f"Bearer {token}".encode(), client._headers["Authorization"].encode()):
        raise ValueError(
            "platform_token is the client's own token: Agora's configuration holds it, so give it a token of "
            "the role 'platform' (which reads no caller by number), minted by an admin"
        )
    return token


def _copied(base: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if base is None:
        return {}
    if not isinstance(base, Mapping):
        raise ValueError(f"the base {what} must be a mapping, not {type(base).__name__}")
    return copy.deepcopy(dict(base))


def _holds_number(value: str, caller: str) -> bool:
    """Whether ``value`` holds a number written internationally, or the caller's identifier: its last seven
    digits (in any script, whatever separates them) for a number, the identifier itself for an ``email:``
    or ``account:`` caller."""
    if _INTERNATIONAL.search(value):
        return True
    kind, _, identifier = caller.strip().partition(":")
    if kind.lower() in ("email", "account") and identifier:
        return identifier.lower() in value.lower()
    digits = _digits(caller)
    return len(digits) >= _CALLER_DIGITS and digits[-_CALLER_DIGITS:] in _digits(value)


def _digits(text: str) -> str:
    return "".join(str(int(c)) for c in text if c.isdecimal())
