-- The dedup table of dedup-runtime: what `dedup_runtime::migrate` creates.
-- Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS processed_messages (
    consumer     text COLLATE "C" NOT NULL,
    message_id   text COLLATE "C" NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS processed_messages_processed_at_idx ON processed_messages (processed_at);
