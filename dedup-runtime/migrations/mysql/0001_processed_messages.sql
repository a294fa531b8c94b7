-- The dedup table of dedup-runtime: what `dedup_runtime::migrate` creates.
-- Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS processed_messages (
    consumer     VARBINARY(255) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    KEY processed_at_idx (processed_at)
) ENGINE = InnoDB;
ALTER TABLE processed_messages ALTER COLUMN processed_at SET DEFAULT (UTC_TIMESTAMP(6));
