-- The dedup table of dedup-runtime: what `dedup_runtime::migrate` creates.
-- Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS processed_messages (
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS processed_messages_processed_at_idx ON processed_messages (processed_at);
