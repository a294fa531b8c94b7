-- The outbox table of dedup-runtime (migration 0004): what `dedup_runtime::outbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS outbox_messages (
    id              BINARY(16) NOT NULL,
    seq             BIGINT NOT NULL AUTO_INCREMENT,
    consumer        VARBINARY(255) NOT NULL,
    cause_id        VARBINARY(255) NOT NULL,
    slot            VARBINARY(255) NOT NULL,
    destination     VARBINARY(255) NOT NULL,
    payload         LONGBLOB NOT NULL,
    headers         MEDIUMBLOB NULL,
    ordering_key    VARBINARY(255) NULL,
    traceparent     VARBINARY(55) NULL,
    created_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        INT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    owner           BINARY(16) NULL,
    lease_until     DATETIME(6) NULL,
    last_error      TEXT NULL,
    sent_at         DATETIME(6) NULL,
    PRIMARY KEY (id),
    UNIQUE KEY seq_key (seq),
    KEY unsent_idx (state, next_attempt_at, seq),
    KEY claimed_idx (state, lease_until),
    KEY ordering_idx (ordering_key, seq),
    KEY sent_idx (state, sent_at)
) ENGINE = InnoDB;
CREATE TABLE IF NOT EXISTS outbox_messages_relay (
    id        TINYINT NOT NULL PRIMARY KEY CHECK (id = 1),
    last_seen DATETIME(6) NOT NULL
) ENGINE = InnoDB;
