-- The outbox table of dedup-runtime (migration 0004): what `dedup_runtime::outbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS outbox_messages (
    seq             INTEGER PRIMARY KEY,
    id              BLOB NOT NULL UNIQUE CHECK (length(id) = 16),
    consumer        TEXT NOT NULL,
    cause_id        TEXT NOT NULL,
    slot            TEXT NOT NULL,
    destination     TEXT NOT NULL,
    payload         BLOB NOT NULL,
    headers         BLOB,
    ordering_key    TEXT,
    traceparent     TEXT,
    created_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    owner           BLOB,
    lease_until     TEXT,
    last_error      TEXT,
    sent_at         TEXT
);
CREATE INDEX IF NOT EXISTS outbox_messages_unsent_idx ON outbox_messages (next_attempt_at, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS outbox_messages_ordering_idx ON outbox_messages (ordering_key, seq) WHERE ordering_key IS NOT NULL AND state <> 2;
CREATE INDEX IF NOT EXISTS outbox_messages_claimed_idx ON outbox_messages (lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS outbox_messages_sent_idx ON outbox_messages (sent_at) WHERE state = 2;
CREATE INDEX IF NOT EXISTS outbox_messages_dead_idx ON outbox_messages (seq) WHERE state = 3;
CREATE TABLE IF NOT EXISTS outbox_messages_relay (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    last_seen TEXT NOT NULL
);
