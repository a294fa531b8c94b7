-- The inbox table of dedup-runtime (migration 0003): what `dedup_runtime::inbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS inbox_messages (
    seq             INTEGER PRIMARY KEY,
    consumer        TEXT NOT NULL,
    message_id      TEXT NOT NULL,
    payload         BLOB,
    headers         BLOB,
    ordering_key    TEXT,
    received_at     TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    owner           BLOB,
    lease_until     TEXT,
    last_error      TEXT,
    processed_at    TEXT,
    fingerprint     BLOB,
    UNIQUE (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS inbox_messages_pending_idx ON inbox_messages (consumer, next_attempt_at, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS inbox_messages_ordering_idx ON inbox_messages (consumer, ordering_key, seq) WHERE ordering_key IS NOT NULL AND state <> 2;
CREATE INDEX IF NOT EXISTS inbox_messages_claimed_idx ON inbox_messages (consumer, lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS inbox_messages_processed_idx ON inbox_messages (processed_at) WHERE state = 2;
CREATE INDEX IF NOT EXISTS inbox_messages_dead_idx ON inbox_messages (consumer, seq) WHERE state = 3;
