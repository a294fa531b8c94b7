-- The inbox table of dedup-runtime (migration 0003): what `dedup_runtime::inbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS inbox_messages (
    seq             BIGINT NOT NULL AUTO_INCREMENT,
    consumer        VARBINARY(255) NOT NULL,
    message_id      VARBINARY(255) NOT NULL,
    payload         LONGBLOB NULL,
    headers         MEDIUMBLOB NULL,
    ordering_key    VARBINARY(255) NULL,
    received_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        INT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    owner           BINARY(16) NULL,
    lease_until     DATETIME(6) NULL,
    last_error      TEXT NULL,
    processed_at    DATETIME(6) NULL,
    receipt         BINARY(16) NULL,
    fingerprint     BINARY(32) NULL,
    PRIMARY KEY (consumer, message_id),
    UNIQUE KEY seq_key (seq),
    KEY work_idx (consumer, state, next_attempt_at),
    KEY ordering_idx (consumer, ordering_key, seq),
    KEY processed_idx (state, processed_at)
) ENGINE = InnoDB;
