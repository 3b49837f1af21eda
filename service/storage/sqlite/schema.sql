-- The SQLite backend's schema, run by SQLiteStore.open on every open (each statement is idempotent).
-- Columns added after the first release (first_interactions.created_at, the recorded_at columns,
-- tokens.agent) are in these tables already; sqlite.py's _ADDED_COLUMNS adds them to files of earlier
-- releases, with the indexes on them. Tables added later (the transcript tables, the webhook tables, then the
-- links table, at the end) are simply created when missing.
-- Times are integer milliseconds since the Unix epoch; subject is a caller pseudonym, never a phone number.
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS projects (
    project TEXT PRIMARY KEY,
    document BLOB NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    token_id TEXT PRIMARY KEY,
    project TEXT NOT NULL,
    role TEXT NOT NULL,
    secret_hash BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    agent TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS tokens_by_project ON tokens (project, created_at);
CREATE TABLE IF NOT EXISTS fields (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    name TEXT NOT NULL,
    value BLOB NOT NULL,
    expires_at INTEGER NOT NULL,
    written_at INTEGER NOT NULL,
    PRIMARY KEY (project, subject, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS fields_by_expiry ON fields (expires_at);
CREATE TABLE IF NOT EXISTS conversations (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    subject TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    extra BLOB NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS conversations_by_expiry ON conversations (expires_at);
CREATE TABLE IF NOT EXISTS first_interactions (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    hour INTEGER NOT NULL,
    qa TEXT,
    handoff_reason TEXT,
    handoff_to TEXT,
    expires_at INTEGER NOT NULL,
    seen_hour INTEGER NOT NULL,
    seen_day INTEGER NOT NULL,
    seen_week INTEGER NOT NULL,
    created_at INTEGER,
    PRIMARY KEY (project, subject)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS first_interactions_by_expiry ON first_interactions (expires_at);
CREATE TABLE IF NOT EXISTS analytics_conversations (
    project TEXT NOT NULL,
    sort_key TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    entry BLOB NOT NULL,
    expires_at INTEGER NOT NULL,
    recorded_at INTEGER,
    PRIMARY KEY (project, sort_key)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS analytics_conversations_by_id ON analytics_conversations (project, conversation_id);
CREATE INDEX IF NOT EXISTS analytics_conversations_by_kind ON analytics_conversations (project, repeat, sort_key);
CREATE INDEX IF NOT EXISTS analytics_conversations_by_expiry ON analytics_conversations (expires_at);
CREATE TABLE IF NOT EXISTS analytics_counters (
    project TEXT NOT NULL,
    kind TEXT NOT NULL,
    bucket INTEGER NOT NULL,
    name TEXT NOT NULL,
    count INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    recorded_at INTEGER,
    PRIMARY KEY (project, kind, bucket, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS analytics_counters_by_expiry ON analytics_counters (expires_at);
CREATE INDEX IF NOT EXISTS conversations_by_subject ON conversations (project, subject);
CREATE TABLE IF NOT EXISTS tombstones (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    erased_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, subject)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tombstones_by_expiry ON tombstones (expires_at);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sweeps (id INTEGER PRIMARY KEY AUTOINCREMENT, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    project TEXT NOT NULL,
    entry BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_project ON audit (project, id);
-- Conversation memory (schema version 2). One header row per conversation, its messages keyed by the header's
-- id (a few bytes per message instead of the project and conversation id). status is open, ending, ended, or
-- a marker (erased, deleted) whose subject is ''. due_at is set while an inactivity end or a lapsed end claim
-- is to run; purge_at is expires_at while the transcript (messages, checkpoint, summary) is still stored.
CREATE TABLE IF NOT EXISTS transcripts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    status TEXT NOT NULL,
    subject TEXT NOT NULL,
    channel TEXT NOT NULL,
    agent TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    last_activity INTEGER NOT NULL,
    turn_id INTEGER NOT NULL,
    messages INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    checkpoint BLOB,
    checkpoint_at INTEGER NOT NULL,
    summary BLOB,
    ended_by TEXT NOT NULL,
    end_reason TEXT NOT NULL,
    ended_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    forget_at INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    end_data BLOB NOT NULL,
    due_at INTEGER,
    purge_at INTEGER,
    -- The caller's region (ISO 3166, '' unknown): added after schema version 5 (sqlite.py adds it to older files).
    region TEXT NOT NULL DEFAULT '',
    UNIQUE (project, conversation_id)
);
CREATE INDEX IF NOT EXISTS transcripts_by_caller ON transcripts (project, subject, started_at);
-- What a start looks at (transcripts.py, channel_conversations): a caller's open or ending conversations
-- by channel, and their resumable ended ones by last activity, so that it costs what it finds, not what the
-- caller ever had. Each query repeats its index's WHERE word for word, so that SQLite uses it.
CREATE INDEX IF NOT EXISTS transcripts_open_by_channel ON transcripts (project, subject, channel)
    WHERE status IN ('open', 'ending');
CREATE INDEX IF NOT EXISTS transcripts_resumable_by_channel
    ON transcripts (project, subject, channel, last_activity)
    WHERE status = 'ended' AND (ended_by IN ('inactivity', 'superseded') OR end_reason = 'dropped');
CREATE INDEX IF NOT EXISTS transcripts_resumable ON transcripts (project, subject, last_activity)
    WHERE status = 'ended' AND (ended_by IN ('inactivity', 'superseded') OR end_reason = 'dropped');
CREATE INDEX IF NOT EXISTS transcripts_by_due ON transcripts (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS transcripts_by_purge ON transcripts (purge_at) WHERE purge_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS transcripts_by_forget ON transcripts (forget_at);
-- turn ids never decrease along seq, so (turn_id, seq) is append order and "after turn N" is a range.
CREATE TABLE IF NOT EXISTS transcript_messages (
    conv INTEGER NOT NULL,
    turn_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    message_id TEXT,
    body BLOB NOT NULL,
    PRIMARY KEY (conv, turn_id, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS transcript_messages_by_id ON transcript_messages (conv, message_id)
    WHERE message_id IS NOT NULL;
-- Bytes of messages appended per project and hour (transcript_bytes), less those of deleted or erased ones.
CREATE TABLE IF NOT EXISTS transcript_volume (
    project TEXT NOT NULL,
    hour INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, hour)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS transcript_volume_by_expiry ON transcript_volume (expires_at);
-- Webhooks (schema version 3): a project's endpoints and the durable queue of their deliveries
-- (webhooks.py). events is a JSON array of event types; secrets are encrypted by the domain.
CREATE TABLE IF NOT EXISTS webhook_endpoints (
    project TEXT NOT NULL,
    endpoint_id TEXT NOT NULL,
    url TEXT NOT NULL,
    events TEXT NOT NULL,
    include_history INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    secret BLOB NOT NULL,
    previous_secret BLOB NOT NULL,
    previous_until INTEGER NOT NULL,
    description TEXT NOT NULL,
    PRIMARY KEY (project, endpoint_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS webhook_endpoints_by_created ON webhook_endpoints (project, created_at, endpoint_id);
CREATE INDEX IF NOT EXISTS webhook_endpoints_by_created_all ON webhook_endpoints (created_at, endpoint_id, project);
-- A rowid table: a payload may carry a whole conversation, too big for the B-tree of a WITHOUT ROWID table.
-- status is queued, failed or delivered (kept without its payload for the listing); lease_owner is NULL and
-- lease_until 0 when no worker holds the delivery; attempt_log holds the latest attempts, a line each.
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id INTEGER PRIMARY KEY,
    project TEXT NOT NULL,
    delivery_id TEXT NOT NULL,
    endpoint_id TEXT NOT NULL,
    event TEXT NOT NULL,
    payload BLOB NOT NULL,
    subject TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_attempt_at INTEGER NOT NULL,
    last_attempt_at INTEGER NOT NULL,
    last_error TEXT NOT NULL,
    lease_owner TEXT,
    lease_until INTEGER NOT NULL,
    attempt_log TEXT NOT NULL DEFAULT '',
    UNIQUE (project, delivery_id)
);
-- What is due for one endpoint, in claim order; its (project, endpoint_id) prefix serves an endpoint's deletion.
CREATE INDEX IF NOT EXISTS webhook_deliveries_due
    ON webhook_deliveries (project, endpoint_id, status, next_attempt_at, delivery_id);
-- Failed deliveries in listing order, per project and per endpoint (partial: queued ones never touch them).
CREATE INDEX IF NOT EXISTS webhook_deliveries_failed
    ON webhook_deliveries (project, last_attempt_at DESC, delivery_id) WHERE status = 'failed';
CREATE INDEX IF NOT EXISTS webhook_deliveries_failed_by_endpoint
    ON webhook_deliveries (project, endpoint_id, last_attempt_at DESC, delivery_id) WHERE status = 'failed';
-- Queued deliveries oldest first, and delivered ones latest first, per project (the listing by state).
CREATE INDEX IF NOT EXISTS webhook_deliveries_queued
    ON webhook_deliveries (project, created_at, delivery_id) WHERE status = 'queued';
CREATE INDEX IF NOT EXISTS webhook_deliveries_delivered
    ON webhook_deliveries (project, last_attempt_at DESC, delivery_id) WHERE status = 'delivered';
-- An endpoint's delivered ones, latest first: the listing by endpoint, and the bound on how many are kept.
CREATE INDEX IF NOT EXISTS webhook_deliveries_delivered_by_endpoint
    ON webhook_deliveries (project, endpoint_id, last_attempt_at DESC, delivery_id) WHERE status = 'delivered';
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_subject ON webhook_deliveries (project, subject);
-- By expiry for purges; status and created_at make it cover the queue's statistics too.
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_expiry ON webhook_deliveries (expires_at, status, created_at);
-- The keys of a caller's archived conversations (an archived object holds no pseudonym: erasure finds them
-- here), kept as long as the objects live.
CREATE TABLE IF NOT EXISTS archive_index (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    object_key TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, subject, object_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS archive_index_by_expiry ON archive_index (expires_at);
-- Linked identifiers (schema version 4; links.py): an alias's record (the profile it points to) and
-- the profile's list of links, written together. kind is phone, email or account; link_id is random (the only
-- name of a link that leaves the service).
CREATE TABLE IF NOT EXISTS aliases (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    profile TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, subject)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS aliases_by_expiry ON aliases (expires_at);
CREATE TABLE IF NOT EXISTS links (
    project TEXT NOT NULL,
    profile TEXT NOT NULL,
    subject TEXT NOT NULL,
    link_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    linked_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, profile, subject)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS links_by_expiry ON links (expires_at);
-- The conversations an erasure removed something of (schema version 5; sqlite.py erase_caller): an end of one
-- by its erased caller, under whichever record (a late end's, a takeover's) and whenever it says it was made,
-- is refused as erased until expires_at (the conversation's horizon, or its record's expiry).
CREATE TABLE IF NOT EXISTS erased_conversations (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, subject, conversation_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS erased_conversations_by_expiry ON erased_conversations (expires_at);
-- The memory proxy's upstream of each project (storage/sqlite/llm.py): the domain's document, its API key sealed.
CREATE TABLE IF NOT EXISTS llm_upstreams (project TEXT PRIMARY KEY, document BLOB NOT NULL) WITHOUT ROWID;
-- Each project's platform connections (storage/sqlite/platforms.py): the domain's document, its secret sealed.
CREATE TABLE IF NOT EXISTS platform_connections (
    project TEXT NOT NULL,
    platform TEXT NOT NULL,
    document BLOB NOT NULL,
    PRIMARY KEY (project, platform)
) WITHOUT ROWID;
-- Platform events already seen (storage/sqlite/platform_events.py): an event id's hash, kept until expires_at.
CREATE TABLE IF NOT EXISTS platform_events (
    project TEXT NOT NULL,
    platform TEXT NOT NULL,
    event TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, platform, event)
);
CREATE INDEX IF NOT EXISTS platform_events_by_expiry ON platform_events (expires_at);
-- A platform's first end event of a conversation, held until its analysis or its due time (platform_events.py).
CREATE TABLE IF NOT EXISTS platform_held_ends (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    document BLOB NOT NULL,
    due_at INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS platform_held_ends_by_due ON platform_held_ends (due_at);
-- A conversation's call trust (storage/sqlite/call_trust.py): its start's attestation, step-up once passed.
CREATE TABLE IF NOT EXISTS call_trust (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    attestation TEXT NOT NULL,
    step_up INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id)
) WITHOUT ROWID;
-- A platform conversation's hold on its inactivity end, until its end_grace (storage/sqlite/platform_events.py).
CREATE TABLE IF NOT EXISTS platform_inactivity_holds (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    until_at INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS platform_inactivity_holds_by_time ON platform_inactivity_holds (until_at);
-- The memory proxy's last streamed answer of a call, recorded at its end (storage/sqlite/pending_answers.py).
CREATE TABLE IF NOT EXISTS pending_answers (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    subject TEXT NOT NULL,
    document BLOB NOT NULL,
    keep_until INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pending_answers_by_subject ON pending_answers (project, subject);
CREATE INDEX IF NOT EXISTS pending_answers_by_time ON pending_answers (keep_until);
-- State keys a call remembered through MCP, persisted by its end (storage/sqlite/remembered.py).
CREATE TABLE IF NOT EXISTS remembered_state (
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    name TEXT NOT NULL,
    subject TEXT NOT NULL,
    value BLOB NOT NULL,
    made_at INTEGER NOT NULL,
    keep_until INTEGER NOT NULL,
    PRIMARY KEY (project, conversation_id, name)
);
CREATE INDEX IF NOT EXISTS remembered_state_by_subject ON remembered_state (project, subject);
CREATE INDEX IF NOT EXISTS remembered_state_by_time ON remembered_state (keep_until);
