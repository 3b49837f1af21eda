-- The SQLite backend's schema, run by SQLiteStore.open on every open (each statement is idempotent).
-- Columns added after the first release (first_interactions.created_at, the recorded_at columns) are in these
-- tables already; sqlite.py's _ADDED_COLUMNS adds them to files of earlier releases, with the indexes on them.
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
    label TEXT NOT NULL DEFAULT ''
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
