"""Every Redis key name the service uses, in one place.

Layout (all keys start with ``cm:``)::

    cm:{<bucket>}:m:<project>:<subject>   hash      one caller's memory: field name -> packed StoredField
    cm:{<bucket>}:x                       zset      expiry index of the bucket: member "<project>:<subject>",
                                                    score = earliest stored expiry among the caller's fields
    cm:p:<project>                        string    the project's configuration document (JSON bytes)
    cm:p:<project>:tokens                 zset      token ids of the project, scored by created_at
    cm:t:<token_id>                       hash      project, role, secret_hash (raw bytes), created_at, label
    cm:{<bucket>}:c:<project>:<conv_id>   hash      an ended conversation (subject, fingerprint, extra), in its
                                                    caller's bucket; expires by itself. After an erasure of
                                                    the caller, a marker {erased, expires_at} until then
    cm:{<bucket>}:f:<project>:<subject>   hash      the caller's first interaction (analytics), in the caller's
                                                    bucket; expires with the retention period
    cm:{a:<project>}:e:<conv_id>          string    "<expires_at>|<json>": a conversation as analytics lists it
    cm:{a:<project>}:i:all|repeat|first   zset      listing indexes, all scores 0, member "<sort key>"
                                                    ("<hour, 13 digits>:<conv_id>"), ranged BYLEX
    cm:{a:<project>}:k:<kind>:<start>     hash      counters of one hour, day or week (and "_expires_at")
    cm:{<bucket>}:t:<project>:<subject>   hash      an erased caller's tombstone {erased_at, expires_at}
    cm:{<bucket>}:cs:<project>:<subject>  set       the caller's ended conversation ids (unlinked on erasure)
    cm:{<bucket>}:la:<project>:<subject>  string    "<expires_at>|<profile>|<link_id>": the caller is an alias
                                                    of that profile until then (in the alias's own slot, so
                                                    that its writes see it atomically); PEXPIREAT expires_at
    cm:{<bucket>}:ll:<project>:<subject>  hash      the profile's links: alias subject -> "<state>|<linked_at>|
                                                    <expires_at>|<kind>|<link_id>", state "p" (merging) or
                                                    "d"; in the profile's slot; PEXPIREAT its latest expiry
    cm:projects                           set       every project id (sweeps walk it)
    cm:p:<project>:audit                  stream    the project's audit records
    cm:p:<project>:llm                    string    the memory proxy's upstream (its key sealed; llm.py)
    cm:p:<project>:platforms              hash      platform connections: platform -> document (secret
                                                    sealed; platforms.py)
    cm:p:<project>:platform-event:<platform>:<sha256 of the event id>
                                          string    a platform event seen, until its replay window ends
                                                    (platform_events.py)
    cm:p:<project>:inactivity-hold:<conv_id>
                                          string    a platform conversation's hold on its inactivity end,
                                                    until its end_grace (platform_events.py)
    cm:{platform-ends}:documents, :due     hash, zset  platform end events held for their analysis (sealed),
                                                    and when each is due (platform_events.py)
    cm:p:<project>:call-trust:<conv_id>   hash      a conversation's call trust (call_trust.py)
    cm:p:<project>:pending-answer:<conv_id>
                                          string    "<keep_until>|<document>": the proxy's last streamed
                                                    answer of a call, recorded at its end
                                                    (pending_answers.py); PXAT keep_until
    cm:p:<project>:pending-answers-of:<subject>
                                          set       the conversations of that caller with one (an erasure
                                                    walks it)
    cm:p:<project>:remembered:<conv_id>   hash      name -> "<made_at>|<value>": state keys a call remembered
                                                    through MCP, persisted by its end (remembered.py);
                                                    PEXPIREAT its latest keep_until
    cm:p:<project>:remembered-of:<subject>
                                          set       the conversations of that caller with some (an erasure
                                                    walks it)
    cm:sweeps                             list      the latest 100 sweep reports, newest first
    cm:lease:<name>                       string    a lease (the sweeper's), holder id, with a TTL
    cm:{<cbucket>}:cc:<project>:<conv_id> string    "<subject>|<expires_at>": the caller a conversation id was
                                                    ended for; cbucket is a hash of the conversation id;
                                                    "!|<expires_at>" once that caller was erased
    cm:{<vbucket>}:vh:<project>:<conv_id> hash      a conversation's header (TranscriptStore; fields in
                                                    redis_transcripts.py), until its forget_at; vbucket is a
                                                    hash of project and conversation id: all of a
                                                    conversation's keys (vh, vm, vi, vd) share that one tag
    cm:{<vbucket>}:vm:<project>:<conv_id> list      its messages, "<message id>\n<body>" ("" for none), in
                                                    order; until the transcript's expires_at
    cm:{<vbucket>}:vi:<project>:<conv_id> string    their index, 12 bytes per message: turn id (big-endian
                                                    double), first 4 bytes of sha1(message id); until then
    cm:{<vbucket>}:vd:<project>:<conv_id> hash      {checkpoint, summary}, until expires_at
    cm:{<bucket>}:vc:<project>:<subject>  zset      the caller's conversation ids (erasure finds them), in
                                                    the caller's slot; score = a time no earlier than the
                                                    conversation's forget_at (its "horizon")
    cm:{<bucket>}:vs:<project>:<subject>  zset      the same ids by start (score started_at): the listing's
                                                    pages; entries leave with the vc entry
    cm:{<bucket>}:vk:<project>:<subject>  zset      the caller's conversations by channel, all scores 0:
                                                    "<channel>\no<conv_id>" while open or ending, and
                                                    "<channel>\nr<13 digits: 9999999999999 - last
                                                    activity><conv_id>" for the newest resumable ended ones
                                                    (redis_caller_index.py)
    cm:{<bucket>}:va:<project>:<subject>  zset      the same across channels: conv_id -> 2^53 - 1 while open
                                                    or ending, its last activity once resumable and ended
    cm:vdue                               zset      the inactivity due index of the whole store: member
                                                    "<project>:<conv_id>", score = when it is due (never
                                                    later than the header says; see redis_transcripts.py)
    cm:{a:<project>}:vb                   hash      bytes of messages the project appended, by hour start
    cm:{<tag>}:s, {<key>}:s               string    Redis Cluster only: an empty marker written (expiring
                                                    within a second) to make a WAIT cover the slot's earlier
                                                    writes; in the slot of the key it is derived from

``bucket = int(subject[:8], 16) % N_BUCKETS``. The ``{bucket}`` hash tag puts a caller's hash and its
bucket's expiry index in one Redis Cluster slot, so one Lua script may touch both. Sweeps walk the expiry
indexes bucket by bucket; 4096 buckets spread a cluster's load over many slots while keeping a full sweep
to a few thousand small ZRANGEBYSCOREs.

``N_BUCKETS`` is fixed forever: changing it moves every caller to another key, and existing data would
become unreachable (there is no migration). Project ids (``[a-z0-9][a-z0-9_-]*``) hold no ``:``, so
``cm:p:<project>`` and ``cm:p:<project>:tokens`` cannot collide.
"""

from __future__ import annotations

import hashlib

#: Number of expiry-index buckets. NEVER change it: keys of existing data depend on it.
N_BUCKETS = 4096

_PREFIX = "cm:"


def bucket_of(subject: str) -> int:
    """The bucket of a caller pseudonym (32 hex characters; the first 32 bits are uniformly spread)."""
    return int(subject[:8], 16) % N_BUCKETS


def memory_key(project: str, subject: str) -> str:
    """The hash holding one caller's memory."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:m:{project}:{subject}"


def expiry_index_key(bucket: int) -> str:
    """The expiry-index sorted set of one bucket."""
    return f"{_PREFIX}{{{bucket}}}:x"


def caller_index_key(subject: str) -> str:
    """The expiry-index sorted set that holds this caller (same slot as :func:`memory_key`)."""
    return expiry_index_key(bucket_of(subject))


def index_member(project: str, subject: str) -> str:
    """A caller's member in its bucket's expiry index."""
    return f"{project}:{subject}"


def parse_index_member(member: bytes | str) -> tuple[str, str]:
    """``(project, subject)`` from an expiry-index member."""
    text = member.decode() if isinstance(member, bytes) else member
    project, _, subject = text.partition(":")
    return project, subject


def project_key(project: str) -> str:
    """The string holding a project's configuration document."""
    return f"{_PREFIX}p:{project}"


def project_tokens_key(project: str) -> str:
    """The sorted set of a project's token ids, scored by creation time."""
    return f"{_PREFIX}p:{project}:tokens"


def token_key(token_id: str) -> str:
    """The hash describing one token."""
    return f"{_PREFIX}t:{token_id}"


def conversation_record_key(project: str, subject: str, conversation_id: str) -> str:
    """The record of an ended conversation, in its caller's slot (written by the same script as the memory)."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:c:{project}:{conversation_id}"


def conversation_claim_key(project: str, conversation_id: str) -> str:
    """Which caller a conversation id belongs to; in the slot of the conversation id itself, so that reusing
    an id for another caller is caught whatever that caller's slot."""
    bucket = (
        int(hashlib.sha1(conversation_id.encode(), usedforsecurity=False).hexdigest()[:8], 16) % N_BUCKETS
    )
    return f"{_PREFIX}{{{bucket}}}:cc:{project}:{conversation_id}"


def first_interaction_key(project: str, subject: str) -> str:
    """The caller's first interaction, in the caller's slot (written with the memory, atomically)."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:f:{project}:{subject}"


def _analytics(project: str) -> str:
    # One hash tag per project: a project's analytics live in one slot, so one script updates them all.
    return f"{_PREFIX}{{a:{project}}}"


def analytics_entry_key(project: str, conversation_id: str) -> str:
    return f"{_analytics(project)}:e:{conversation_id}"


def analytics_index_key(project: str, repeat: bool | None) -> str:
    """The listing index of all conversations (None), of repeat ones (True) or first ones (False)."""
    kind = "all" if repeat is None else "repeat" if repeat else "first"
    return f"{_analytics(project)}:i:{kind}"


def analytics_counter_key(project: str, kind: str, start: int) -> str:
    return f"{_analytics(project)}:k:{kind}:{start}"


def tombstone_key(project: str, subject: str) -> str:
    """An erased caller's tombstone, in the caller's slot."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:t:{project}:{subject}"


def alias_key(project: str, subject: str) -> str:
    """The caller's alias record (which profile it is linked to), in the caller's slot: the scripts that write
    the caller's memory read it atomically."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:la:{project}:{subject}"


def links_key(project: str, subject: str) -> str:
    """The profile's list of links (alias subject -> link), in the profile's slot."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:ll:{project}:{subject}"


def caller_conversations_key(project: str, subject: str) -> str:
    """The ids of the caller's ended conversations (to unlink them on erasure), in the caller's slot."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:cs:{project}:{subject}"


def conversation_record_prefix(project: str, subject: str) -> str:
    return f"{_PREFIX}{{{bucket_of(subject)}}}:c:{project}:"


def conversation_bucket(project: str, conversation_id: str) -> int:
    """The bucket whose hash tag every key of one conversation carries: a stable hash of project and id (the
    same id in two projects is two conversations, each in its own slot)."""
    digest = hashlib.sha1(f"{project}:{conversation_id}".encode(), usedforsecurity=False).hexdigest()
    return int(digest[:8], 16) % N_BUCKETS


def _transcript(kind: str, project: str, conversation_id: str) -> str:
    return f"{_PREFIX}{{{conversation_bucket(project, conversation_id)}}}:{kind}:{project}:{conversation_id}"


def transcript_header_key(project: str, conversation_id: str) -> str:
    """A conversation's header hash (it outlives the transcript: until ``forget_at``)."""
    return _transcript("vh", project, conversation_id)


def transcript_messages_key(project: str, conversation_id: str) -> str:
    """A conversation's messages (a list), in the header's slot."""
    return _transcript("vm", project, conversation_id)


def transcript_ids_key(project: str, conversation_id: str) -> str:
    """The index of a conversation's messages (turn ids and message id digests), in the header's slot."""
    return _transcript("vi", project, conversation_id)


def transcript_data_key(project: str, conversation_id: str) -> str:
    """A conversation's checkpoint and summary, in the header's slot."""
    return _transcript("vd", project, conversation_id)


def transcript_keys(project: str, conversation_id: str) -> list[str]:
    """Header, messages, ids and data of one conversation: the KEYS of the transcript scripts, in order."""
    return [_transcript(kind, project, conversation_id) for kind in ("vh", "vm", "vi", "vd")]


def caller_transcripts_key(project: str, subject: str) -> str:
    """The ids of the caller's conversations (transcripts), in the caller's slot, so that erasure finds them."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:vc:{project}:{subject}"


def caller_started_key(project: str, subject: str) -> str:
    """The caller's conversation ids by start time, in the caller's slot (the listing's pages)."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:vs:{project}:{subject}"


def caller_channels_key(project: str, subject: str) -> str:
    """The caller's open and newest resumable conversations by channel, in the caller's slot."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:vk:{project}:{subject}"


def caller_recent_key(project: str, subject: str) -> str:
    """The caller's open and newest resumable conversations across channels, in the caller's slot."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:va:{project}:{subject}"


def caller_index_keys(project: str, subject: str) -> list[str]:
    """The caller's conversation listing and its indexes, in the caller's slot: the KEYS of
    ``transcript_lane.lua`` in order (vc, vs, vk, va)."""
    return [
        caller_transcripts_key(project, subject),
        caller_started_key(project, subject),
        caller_channels_key(project, subject),
        caller_recent_key(project, subject),
    ]


#: The inactivity due index of every conversation of the store.
TRANSCRIPTS_DUE = f"{_PREFIX}vdue"


def due_member(project: str, conversation_id: str) -> str:
    """A conversation's member in :data:`TRANSCRIPTS_DUE` (project ids hold no ``:``)."""
    return f"{project}:{conversation_id}"


def transcript_volume_key(project: str) -> str:
    """The bytes of messages a project appended, by hour (in the project's analytics slot)."""
    return f"{_analytics(project)}:vb"


def memory_key_prefix(bucket: int) -> str:
    """``memory_key`` without ``<project>:<subject>``: index members complete it."""
    return f"{_PREFIX}{{{bucket}}}:m:"


#: Every project id (for sweeps that walk projects).
PROJECTS = f"{_PREFIX}projects"
#: The latest sweep reports (a list, newest first).
SWEEPS = f"{_PREFIX}sweeps"


def sync_key(key: str) -> str:
    """A marker key in ``key``'s cluster slot: its hash tag, or the whole key as the tag when it has none
    (a key without a tag is hashed whole, so ``{<key>}`` lands in the same slot)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    if start >= 0 and end > start + 1:
        return f"{_PREFIX}{key[start : end + 1]}:s"
    return f"{{{key}}}:s"


def lease_key(name: str) -> str:
    return f"{_PREFIX}lease:{name}"


def audit_key(project: str) -> str:
    """The project's audit stream."""
    return f"{_PREFIX}p:{project}:audit"


# Webhooks (WebhookStore; layout in webhooks.py) -------------------------------------------------------
#
#   cm:{wp:<project>}:we                  hash      the project's endpoints: endpoint_id -> JSON
#   cm:{wp:<project>}:wi                  hash      where each delivery is: delivery_id -> endpoint_id
#   cm:{wp:<project>}:wj                  zset      the same ids by expires_at (forgotten once passed)
#   cm:{wp:<project>}:wk                  zset      endpoints with deliveries, by their latest expires_at
#   cm:{wq:<project>:<endpoint_id>}:q|l|f|x|o  zset  one endpoint's queue: due, leased, failed, by expiry,
#                                                    queued by creation (one slot per endpoint)
#   cm:{wq:<project>:<endpoint_id>}:d:<delivery_id>  hash  one delivery, until its expires_at
#   cm:{<bucket>}:wc:<project>:<subject>  zset      the caller's deliveries (delivery_id -> expires_at), in
#                                                    the caller's slot, so that erasure finds them
#   cm:wprojects                          set       every project that registered an endpoint
#   cm:wwork                              zset      "<project>:<endpoint_id>" of endpoints with deliveries,
#                                                    by their latest expires_at (queue_stats walks it)


def _webhook_project(project: str) -> str:
    # One hash tag per project for its endpoints and its delivery index (another tag than its analytics, so
    # that webhook traffic does not land on the analytics' slot).
    return f"{_PREFIX}{{wp:{project}}}"


def webhook_endpoints_key(project: str) -> str:
    """The project's webhook endpoints: a hash of endpoint id -> the endpoint's JSON."""
    return f"{_webhook_project(project)}:we"


def webhook_index_keys(project: str) -> list[str]:
    """The project's delivery index (the KEYS of ``webhook_index.lua``): delivery id -> endpoint id, the same
    ids by expiry, and the endpoints that have deliveries; all in the project's slot."""
    return [f"{_webhook_project(project)}:{kind}" for kind in ("wi", "wj", "wk")]


def _webhook_queue(project: str, endpoint_id: str) -> str:
    # Every key of one endpoint's queue shares this tag (its own slot): a claim or a settlement is one script.
    # An id holding "}" shortens the tag, still the same for every key of that endpoint.
    return f"{_PREFIX}{{wq:{project}:{endpoint_id}}}"


def webhook_queue_keys(project: str, endpoint_id: str) -> list[str]:
    """One endpoint's queue (the KEYS of ``webhook_queue.lua``): due (queued, not leased, by next attempt),
    leased (by lease end), failed (by minus the last attempt), every delivery by expiry, queued by creation."""
    tag = _webhook_queue(project, endpoint_id)
    return [f"{tag}:{kind}" for kind in ("q", "l", "f", "x", "o")]


def webhook_delivery_prefix(project: str, endpoint_id: str) -> str:
    """The name of a delivery's hash without its id (the queue script completes it), in the queue's slot."""
    return f"{_webhook_queue(project, endpoint_id)}:d:"


def webhook_delivery_key(project: str, endpoint_id: str, delivery_id: str) -> str:
    """One delivery's hash."""
    return webhook_delivery_prefix(project, endpoint_id) + delivery_id


def caller_webhooks_key(project: str, subject: str) -> str:
    """The ids of the deliveries about a caller, in the caller's slot, so that erasure finds them."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:wc:{project}:{subject}"


#: Every project that registered a webhook endpoint (the delivery worker's list of every endpoint).
WEBHOOK_PROJECTS = f"{_PREFIX}wprojects"
#: Endpoints with deliveries, over every project (queue_stats walks it), by their latest expiry.
WEBHOOK_WORK = f"{_PREFIX}wwork"


def webhook_work_member(project: str, endpoint_id: str) -> str:
    """An endpoint's member in :data:`WEBHOOK_WORK` (project ids hold no ``:``)."""
    return f"{project}:{endpoint_id}"


def caller_archive_key(project: str, subject: str) -> str:
    """The keys of the caller's archived conversations (object key -> expiry), in the caller's slot, so that
    erasure finds them (an archived object holds no pseudonym)."""
    return f"{_PREFIX}{{{bucket_of(subject)}}}:va:{project}:{subject}"
